"""Worker side of push_pull: the one entry point for every communication mode.

`allreduce` uses torch.distributed's all-reduce among workers; the server modes
(`byteps`, `ps`, `colocated`) send partitions to summation servers in priority order
under a credit window (bytes in flight per worker) and receive the sums back. In every
mode the result is the batch-weighted average Σ b_i g_i / Σ b_i, so workers with
different batch sizes produce the update one machine would on the whole global batch.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import UserError
from ..runtime.context import Context, init
from .layout import Manifest, TensorMismatchError, exchange_manifests
from .protocol import (MAX_PARTITIONS, OK, SLOW, STOPPED, ControlExchange, check_header, exchange_header,
                       part_tag, speculating)
from .compress import ErrorFeedback
from .server import plan_for
from .wire import WirePart, decode_part, encode_part, payload_bytes, tensor_codecs, wire_plan


@dataclass
class CommStats:
    """Per-worker accounting for the step summary (seconds and bytes)."""

    steps: int = 0
    comm_s: float = 0.0  # moving partitions (or all-reduce)
    wait_s: float = 0.0  # waiting for the other workers (the step header)
    hidden_s: float = 0.0  # communication that ran while backward was still computing
    bytes_sent: int = 0  # bytes on the wire (encoded payloads when a codec is used)
    bytes_received: int = 0
    per_step: list[dict] = field(default_factory=list)


class PushPull:
    def __init__(self, ctx: Context | None = None):
        self.ctx = ctx or init()
        self.stats = CommStats()
        self._digest = 0
        self._epoch = 0  # layouts seen so far (partition tags carry it)
        self._manifest: Manifest | None = None
        self._parts = []
        self._wire: list[WirePart] | None = None
        self._send = torch.empty(0)
        self._recv = torch.empty(0)
        self._step: _Step | None = None
        self._server_ranks = [p.rank for p in self.ctx.topology.servers] if self.ctx.topology else []

    # ---- public -------------------------------------------------------------------------
    def push_pull(self, named: list[tuple[str, torch.Tensor]], weight: int = 1, average: bool = True) -> None:
        """Replace each tensor, in place, by the weighted average (or sum) over workers.

        `named` is in priority order: first = sent first (the input-side layers, needed
        first by the next forward pass). `weight` is this worker's batch size.
        """
        if not self.begin(named, weight, average):
            return
        order = range(len(named))
        if self._unlimited:  # --overlap: same order as backward, which the servers expect
            order = reversed(order)
        for i in order:
            self.ready(i, named[i][1])
        self.finish([t for _, t in named])

    def begin(self, named: list[tuple[str, torch.Tensor]], weight: int = 1, average: bool = True,
              overlapped: bool = False) -> bool:
        """Start a push_pull whose tensors will be handed over one by one with `ready`
        (e.g. from gradient hooks while backward runs) and collected by `finish`.

        `named` gives names and shapes (the tensors themselves are not read here).
        Returns False when there is nothing to move (a one-process job). `overlapped`
        says the tensors arrive while compute goes on, so only the time `finish` blocks
        counts as communication and the rest of the transfer time as hidden.
        """
        if self._step is not None:
            raise UserError("push_pull.begin() called while another push_pull is in flight; call finish() first")
        if weight < 0 or int(weight) != weight:
            raise UserError(f"push_pull weight must be a non-negative integer batch size, got {weight!r}")
        for name, t in named:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise UserError(f"push_pull tensor {name!r} must be a floating-point torch.Tensor, got {type(t).__name__}"
                                f"{'' if not isinstance(t, torch.Tensor) else ' of ' + str(t.dtype)}")
        ctx = self.ctx
        if ctx.distributed and ctx.comm.sync != "sync":
            raise UserError(f"push_pull is synchronous but this job runs sync={ctx.comm.sync!r}; use "
                            "hetrain.DistributedOptimizer, which pushes to and pulls from the parameter servers")
        manifest = self._manifest_for(named)
        t0 = time.perf_counter()
        if not ctx.distributed:  # one process: the weighted average of one worker is itself
            if average and weight == 0:
                raise UserError("every worker pushed with weight 0: at least one worker needs a non-empty batch")
            self._account(time.perf_counter() - t0, 0.0, 0, 0.0)
            return False
        control, total = None, -1  # total: Σb when known now, else read from the answers in finish
        if not self._server_ranks:  # allreduce: workers scale their own share
            total = self._slow_header(manifest, int(weight))
            if average and total == 0:
                raise UserError("every worker pushed with weight 0: at least one worker needs a non-empty batch")
            scale = (weight / total) if average else 1.0
        else:  # the servers weight each worker's push (they learn b_i from its control message)
            scale = 1.0
            control, total = self._announce(manifest, int(weight), average)
        t1 = time.perf_counter()
        self._step = _Step(scale=scale, wait_s=t1 - t0, t_begin=t1, done=[False] * len(named),
                           filled=[0] * len(self._parts), overlapped=overlapped,
                           control=control, manifest=manifest, weight=int(weight), average=average, total=total)
        return True

    def ready(self, index: int, tensor: torch.Tensor) -> None:
        """Tensor `index` of the current push_pull is final: post every partition it
        completes (overlap: called from a gradient hook).

        Nothing is copied here. A partition that lies inside one contiguous tensor is sent
        from that tensor and its result received straight into it (zero-copy both ways:
        the result can only arrive after the server has the whole push, so after the send
        has read it); one that spans tensors is copied into a staging buffer when it is
        posted. Tensors must stay untouched until finish() returns."""
        st = self._step
        if st is None or st.done[index]:
            return
        st.done[index] = True
        t = tensor.detach()
        storage = t.untyped_storage().data_ptr() if t.numel() else None
        # a tensor sharing storage with an earlier one (tied or viewed buffers) is sent from
        # a snapshot: the earlier one's result may land in that memory before it is read
        inplace = t.is_contiguous() and (storage is None or storage not in st.storages)
        st.storages.add(storage)
        st.flat[index] = t.view(-1) if inplace else t.reshape(-1).clone()
        st.inplace[index] = inplace
        st.tensors[index] = tensor
        if self.ctx.comm.mode == "allreduce":
            a, b = self._bounds[index], self._bounds[index + 1]
            self._fill(self._send[a:b], st.flat[index], st.scale)
            return
        for pid, n in self._touches[index]:
            st.filled[pid] += n
            if st.filled[pid] == self._parts[pid].length:
                st.pending.append(pid)
        self._flush(st, block=False)

    @staticmethod
    def _fill(dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
        if scale != 1.0:
            torch.mul(src, scale, out=dst)
        else:
            dst.copy_(src)

    def _deliver(self, st: "_Step", pid: int) -> None:
        """Write partition `pid`'s result into the user's tensors as soon as it arrives
        (unless it was received in place), so finish() has no copy of the model left."""
        if st.direct[pid]:
            return
        for i, lo, hi in self._spans[pid]:
            if st.inplace[i]:
                a = self._bounds[i]
                st.flat[i][lo - a: hi - a].copy_(self._recv[lo:hi])

    def finish(self, tensors: list[torch.Tensor]) -> None:
        """Send what is left, wait for every sum and write the results into `tensors`."""
        st = self._step
        if st is None:
            return
        t_fin = time.perf_counter()
        try:
            for i, t in enumerate(tensors):
                if not st.done[i]:
                    self.ready(i, t)
            if self.ctx.comm.mode == "allreduce":
                if self.ctx.bucket is not None:  # a ring moves 2(n-1)/n of the buffer through each uplink
                    n = self.ctx.num_workers
                    self.ctx.bucket.consume(int(2 * (n - 1) / n * self._send.numel() * 4))
                try:
                    dist.all_reduce(self._send, group=self.ctx.worker_group)
                except RuntimeError as err:
                    raise self.ctx.peer_error("all-reducing gradients", [], err) from None
                result = self._send
                st.t_last = time.perf_counter()
            else:
                if st.control is not None:
                    self._check_answers(st)
                self._flush(st, block=True)
                for q in st.inflight.values():
                    while q:
                        self._retire(st, q.popleft())
                result = self._recv
            if self.ctx.comm.mode == "allreduce":
                self._unfill(tensors, result)
            else:  # tensors that could not take their results in place
                for i, t in enumerate(tensors):
                    if not st.inplace.get(i, True):
                        a, b = self._bounds[i], self._bounds[i + 1]
                        t.copy_(result[a:b].view_as(t))
            if st.average and st.total == 0:
                raise UserError("every worker pushed with weight 0: at least one worker needs a non-empty batch")
        finally:
            self._step = None
        end = time.perf_counter()
        if self.ctx.comm.mode == "allreduce":
            moved = self._send.numel() * 4
            st.bytes_out = st.bytes_in = moved
        if st.overlapped:
            span = max(st.t_last, t_fin) - min(st.t_first or t_fin, t_fin)
            exposed = end - t_fin
            hidden = max(0.0, span - exposed)
        else:
            exposed, hidden = end - st.t_begin, 0.0
        self._account(st.wait_s, exposed, st.bytes_out, hidden, st.bytes_in)

    def is_ready(self, index: int) -> bool:
        """Whether tensor `index` of the push_pull in flight was already handed over."""
        return self._step is not None and self._step.done[index]

    @property
    def in_flight(self) -> bool:
        return self._step is not None

    def _announce(self, manifest: Manifest, weight: int, average: bool) -> tuple["ControlExchange | None", int]:
        """Send this step's control message to every server. With an unchanged layout
        the servers already hold receives for it, so return at once (the answers, with
        Σb, are read in finish); otherwise wait for them and take the header path, which
        gives Σb now."""
        digest = manifest.digest()
        try:
            control = ControlExchange(self._server_ranks, digest=digest, numel=manifest.numel, weight=weight,
                                      stop=False, average=average)
            if digest == self._digest and speculating(self._epoch):
                return control, -1
            replies = control.wait()
        except RuntimeError as err:
            raise self.ctx.peer_error("announcing the step to the summation servers", [], err) from None
        status = {r.status for r in replies}
        if status == {OK}:  # unchanged layout, not speculating (after MAX_EPOCHS layouts)
            return control, -1
        if status != {SLOW}:  # pragma: no cover - servers decide alike
            self.ctx.failed = True
            raise RuntimeError(f"summation servers answered a new layout with {replies}")
        return None, self._slow_header(manifest, weight)

    def _check_answers(self, st: "_Step") -> None:
        """The servers' verdict on a step announced without waiting; anything but OK
        means the workers disagree, and the header path says how, on every rank."""
        try:
            replies = st.control.wait()
        except RuntimeError as err:
            raise self.ctx.peer_error("waiting for the summation servers' answer", [], err) from None
        status = {r.status for r in replies}
        if status == {SLOW}:
            self._slow_header(st.manifest, st.weight)  # raises the mismatch on every rank
        if status != {OK}:  # pragma: no cover - servers decide alike
            self.ctx.failed = True
            raise RuntimeError(f"summation servers disagree about the step: {replies}")
        st.total = replies[0].weight

    def _slow_header(self, manifest: Manifest, weight: int) -> int:
        """The global step header (every rank): new layouts, mismatches and stops."""
        ctx = self.ctx
        try:
            h = exchange_header(digest=manifest.digest(), weight=weight, numel=manifest.numel, is_worker=True)
        except RuntimeError as err:
            raise ctx.peer_error("exchanging the step header", [], err) from None
        try:
            check_header(h, ctx.num_workers, manifest)
        except TensorMismatchError:
            ctx.failed = True
            raise
        if h.digest != self._digest:
            exchange_manifests(manifest)
            self._digest = h.digest
            self._epoch += 1
            self._layout(manifest)
        return h.weight

    def shutdown(self) -> None:
        """Tell the summation servers the job is over (every worker calls this once)."""
        if self.ctx.distributed and self._server_ranks and not self.ctx.failed and self.ctx.comm.sync != "sync":
            from .async_ps import send_stop

            send_stop(self.ctx)
            return
        if self.ctx.distributed and self._server_ranks and not self.ctx.failed:
            try:
                replies = ControlExchange(self._server_ranks, digest=0, numel=0, weight=0, stop=True,
                                          average=False).wait()
                if {r.status for r in replies} == {STOPPED}:
                    return
                h = exchange_header(stop=True, is_worker=True)  # not every worker stops: say so everywhere
            except RuntimeError as err:
                raise self.ctx.peer_error("telling the servers the job is over", [], err) from None
            try:
                check_header(h, self.ctx.num_workers, None)
            except TensorMismatchError:
                self.ctx.failed = True
                raise

    # ---- internals ----------------------------------------------------------------------
    def _manifest_for(self, named) -> Manifest:
        m = Manifest.of(named)
        if self._manifest is None or m != self._manifest:
            self._manifest = m
        return self._manifest

    def _layout(self, manifest: Manifest) -> None:
        numel = manifest.numel
        self._send = torch.empty(numel, dtype=torch.float32)
        self._recv = torch.empty(numel, dtype=torch.float32)
        self._parts = plan_for(self.ctx, numel) if self._server_ranks else []
        if len(self._parts) >= MAX_PARTITIONS:
            raise UserError(f"{len(self._parts)} partitions per step is more than hetrain supports ({MAX_PARTITIONS}); "
                            "raise --partition-bytes")
        self._bounds = [0]
        for e in manifest.entries:
            self._bounds.append(self._bounds[-1] + e.numel)
        starts = [p.start for p in self._parts]
        self._touches = []  # per tensor: (pid, elements of that partition it fills)
        for i in range(len(manifest.entries)):
            a, b = self._bounds[i], self._bounds[i + 1]
            touch = []
            j = max(0, bisect.bisect_right(starts, a) - 1)
            while j < len(self._parts) and self._parts[j].start < b:
                p = self._parts[j]
                n = min(b, p.start + p.length) - max(a, p.start)
                if n > 0:
                    touch.append((j, n))
                j += 1
            self._touches.append(touch)
        self._spans = [[] for _ in self._parts]  # per partition: (tensor, flat lo, flat hi)
        for i, touch in enumerate(self._touches):
            a, b = self._bounds[i], self._bounds[i + 1]
            for pid, _ in touch:
                p = self._parts[pid]
                self._spans[pid].append((i, max(a, p.start), min(b, p.start + p.length)))
        self._wire = None
        if self._parts:
            codecs = wire_codecs(self.ctx, manifest)
            self._wire = wire_plan(self._parts, manifest, codecs)
        if self._wire is not None:
            total = payload_bytes(self._wire)
            self._psend = torch.zeros(total, dtype=torch.uint8)
            self._precv = torch.zeros(total, dtype=torch.uint8)
            self._feedback = ErrorFeedback(numel)
            self._unit = 1  # credit counted in payload bytes
            sizes = [w.nbytes for w in self._wire]
        else:
            self._unit = 4
            sizes = [p.length * 4 for p in self._parts]
        self._sizes = sizes
        self._credit = max(1, self.ctx.comm.credit_bytes)
        self._window = 0 if self.ctx.comm.credit_bytes else window_partitions(self.ctx.comm.partition_bytes)
        self._unlimited = self.ctx.comm.overlap and not self.ctx.comm.credit_bytes

    def _unfill(self, tensors, result: torch.Tensor) -> None:
        off = 0
        for t in tensors:
            n = t.numel()
            t.copy_(result[off: off + n].view_as(t))
            off += n

    def _post(self, st: "_Step", pid: int) -> None:
        p = self._parts[pid]
        dst = self._server_ranks[p.server]
        spans = self._spans[pid]
        if self._wire is None and len(spans) == 1:  # inside one tensor: zero-copy
            i, lo, hi = spans[0]
            a = self._bounds[i]
            sbuf = st.flat[i][lo - a: hi - a]
            st.direct[pid] = st.inplace[i]
            rbuf = sbuf if st.direct[pid] else self._recv[lo:hi]
        else:
            st.direct[pid] = False
            for i, lo, hi in spans:
                a = self._bounds[i]
                self._send[lo:hi].copy_(st.flat[i][lo - a: hi - a])
            if self._wire is None:
                sbuf = self._send[p.start: p.start + p.length]
                rbuf = self._recv[p.start: p.start + p.length]
            else:
                w = self._wire[pid]
                sbuf = self._psend[w.offset: w.offset + w.nbytes]
                encode_part(w, self._send, sbuf, self._feedback)
                rbuf = self._precv[w.offset: w.offset + w.nbytes]
        if st.t_first is None:
            st.t_first = time.perf_counter()

        g = self.ctx.lane(p.lane)
        self.ctx.pace(dst, sbuf.numel() * sbuf.element_size())
        tag = part_tag(self._epoch, p.pid)
        s = dist.isend(sbuf, dst=dst, tag=tag, group=g)
        r = dist.irecv(rbuf, src=dst, tag=tag, group=g)
        st.inflight.setdefault(p.server, deque()).append((pid, dst, s, r))
        st.used += self._sizes[pid]

    def _flush(self, st: "_Step", block: bool) -> None:
        """Post pending partitions in priority order while the credit window allows;
        with block=False never wait (called from backward), with block=True wait as needed.

        The default window is per server: at most `window` partitions in flight to each
        server. A byte budget over all servers (--credit-bytes) lets a worker whose
        flows happen to run fast put several partitions ahead at one server while
        another worker's first one is still on its way; that server can sum nothing
        until the slowest worker's partition arrives whole, so its uplink idles. A
        per-server window keeps every worker within one partition of the others."""
        st.pending.sort(reverse=self._unlimited)
        # overlapped steps (and every step under --overlap without --credit-bytes)
        # post each partition as soon as it is ready: holding one back would idle the
        # link until the next gradient hook fires, and waiting for an early-posted
        # (late-layer) sum while an earlier partition is still held back could
        # deadlock against a server that sums in partition order.
        unlimited = self._unlimited or st.overlapped
        while st.pending:
            pid = st.pending[0]
            srv = self._parts[pid].server
            if not unlimited:
                if self._window:
                    while len(st.inflight.setdefault(srv, deque())) >= self._window:
                        if not block:
                            return
                        self._retire(st, st.inflight[srv].popleft())
                else:
                    while st.used and st.used + self._sizes[pid] > self._credit:
                        if not block:
                            return
                        self._retire_oldest(st)
            st.pending.pop(0)
            self._post(st, pid)

    def _retire_oldest(self, st: "_Step") -> None:
        srv = min((q[0][0], s) for s, q in st.inflight.items() if q)[1]
        self._retire(st, st.inflight[srv].popleft())

    def _retire(self, st: "_Step", item) -> None:
        pid, dst, s, r = item
        try:
            s.wait()
            r.wait()
        except RuntimeError as err:
            raise self.ctx.peer_error(f"waiting for the sum of partition {pid}", [dst], err) from None
        st.t_last = time.perf_counter()
        st.used -= self._sizes[pid]
        st.bytes_out += self._sizes[pid]
        st.bytes_in += self._sizes[pid]
        if self._wire is not None:
            w = self._wire[pid]
            decode_part(w, self._precv[w.offset: w.offset + w.nbytes], self._recv)
        self._deliver(st, pid)

    def _account(self, wait_s: float, comm_s: float, moved: int, hidden_s: float, received: int | None = None) -> None:
        st = self.stats
        received = moved if received is None else received
        st.steps += 1
        st.wait_s += wait_s
        st.comm_s += comm_s
        st.hidden_s += hidden_s
        st.bytes_sent += moved
        st.bytes_received += received
        st.per_step.append({"wait_s": wait_s, "comm_s": comm_s, "hidden_s": hidden_s, "bytes": moved + received})


@dataclass
class _Step:
    """Book-keeping of one push_pull in flight."""

    scale: float
    wait_s: float
    t_begin: float
    done: list[bool]
    filled: list[int]
    overlapped: bool = False
    control: object = None  # this step's ControlExchange, answers not yet read
    manifest: object = None
    weight: int = 0
    average: bool = True
    total: int = -1  # Σ batch weights, from the servers' answers
    tensors: dict = field(default_factory=dict)  # index -> the user's tensor, once ready
    flat: dict = field(default_factory=dict)  # index -> its flat view (or snapshot)
    inplace: dict = field(default_factory=dict)  # index -> results written straight into it
    storages: set = field(default_factory=set)
    direct: dict = field(default_factory=dict)  # pid -> received straight into the tensor
    pending: list[int] = field(default_factory=list)
    inflight: dict = field(default_factory=dict)  # server index -> deque of partitions in flight
    used: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    t_first: float | None = None
    t_last: float = 0.0


WINDOW_BYTES = 256 * 1024


def window_partitions(partition_bytes: int) -> int:
    """Partitions in flight per server by default: at least 2 (one summing, one
    arriving) and about 256 KiB, chosen by sweeping 128 KiB-1 MiB over bench/comm.py's
    8 MB cases (exploratory runs, not recorded; the chosen value's results are in
    bench/results/comm-*.txt). Less was unstable; more lets the workers' flows into one
    server drift apart, and a server can sum a partition only when the slowest worker's
    copy is in."""
    return max(2, -(-WINDOW_BYTES // max(1, partition_bytes)))


def wire_codecs(ctx: Context, manifest: Manifest) -> list[str]:
    """Each tensor's codec, the same on every rank (config and cluster are shared)."""
    bw = min(m.bandwidth for m in ctx.cluster.machines) if ctx.cluster else float("inf")
    return tensor_codecs(manifest, ctx.comm.codec, ctx.comm.codec_rules, bw)
