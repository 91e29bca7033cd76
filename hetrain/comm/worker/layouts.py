"""The layout an engine's workers agreed on, and what hangs on it (`LayoutKeeper`, a part
of `PushPull`): the pushed tensors' description (device, manifest, digest), the layouts
kept by digest when another is agreed (comm/known.py), the flat layout with its
partitions, codecs and pushers (comm/flatlayout.py), the all-reduce bucket tuner
(comm/buckets.py), and the gradient homes of the in-place host staging."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ...errors import UserError
from ...runtime.context import Context
from ..buckets import BucketTuner
from ..flatlayout import FlatLayout
from ..group import Group
from ..layout import Manifest, check_tensors
from ..protocol import MAX_PARTITIONS, Announcer
from ..staging import HostInPlace, Staging
from ..transport import AllReduceTransport, Transport
from ..wire import wire_codecs


class LayoutKeeper:
    """The layout half of `PushPull` (comm/engine.py), which sets these attributes; the
    protocol calls `_new_layout` whenever every rank agreed on another layout."""

    ctx: Context
    group: Group | None
    transport: Transport | None
    protocol: Announcer | None
    _layout: FlatLayout | None
    _stagings: dict[torch.device, Staging]
    _tuner: BucketTuner | None
    _memo: tuple | None  # (key of the tensors, (device, manifest, digest)): see _described
    _step: object | None  # the push_pull in flight (comm/worker/step.py `_Step`)

    def _described(self, named: list[tuple[str, torch.Tensor]]) -> tuple[torch.device, Manifest, int]:
        """The tensors' device (checked), manifest and digest. A training loop hands over
        tensors of the same names, shapes, dtypes and devices every step, so the last
        answer is kept while they stay so (the key is all the check and the manifest
        read): a step then costs one pass over the tensors, not three and a hash."""
        key = tuple((n, t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else None for n, t in named)
        memo = self._memo
        if memo is not None and memo[0] == key:
            return memo[1]
        device = check_tensors(named, self.ctx.device if self.ctx.distributed else None)
        manifest = Manifest.of(named)
        out = (device, manifest, manifest.digest())
        self._memo = (key, out) if None not in key else None
        return out

    def _new_layout(self, manifest: Manifest, left: int) -> None:
        """Every rank agreed on another layout: keep the one left (`left`, its digest) and
        take back this one's if it was kept (comm/known.py); else derive its partitions,
        codecs and pushers (and, for the job's all-reduce with `--buckets tuned`, start
        tuning its buckets)."""
        tr, known = self.transport, self.protocol.known
        if self._layout is not None:
            known.stash(left, (self._layout, self._stagings, self._tuner, getattr(tr, "caps", None)))
        kept = known.take(self.protocol.digest)
        if kept is not None:
            self._layout, self._stagings, self._tuner, caps = kept
            if caps is not None:
                tr.caps = caps
            return
        if isinstance(tr, AllReduceTransport) and self.group is None and self.ctx.comm.tunes_buckets:
            self._tuner = BucketTuner([e.numel for e in manifest.entries], self._agree_max)
            tr.caps = self._tuner.caps
        else:
            self._tuner = None
        self._build_layout(manifest)

    def _agree_max(self, values: list[float]) -> list[float]:
        """Element-wise maximum of `values` over the job's workers (the bucket tuner's
        agreement, at the same step on every worker)."""
        t = torch.tensor(values, dtype=torch.float64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.transport.members.gloo)
        except RuntimeError as err:
            raise self.ctx.peer_error("agreeing on all-reduce bucket sizes", [], err) from None
        return t.tolist()

    def _tune_buckets(self, began: float, on_device: bool) -> None:
        """End of a step that began (its push_pull did) at `began`: the tuner may switch
        the bucket plan for the next one."""
        if self._tuner is not None and self._tuner.step_done(time.perf_counter() - began, on_device):
            self.transport.caps = self._tuner.caps
            self._build_layout(self._layout.manifest)

    def _build_layout(self, manifest: Manifest) -> None:
        ctx = self.ctx
        parts = self.transport.partitions(manifest)
        if len(parts) >= MAX_PARTITIONS:
            raise UserError(f"{len(parts)} partitions per step is more than hetrain supports ({MAX_PARTITIONS}); "
                            "raise --partition-bytes")
        if self.group is not None:  # all-reduce among the members: fp32, no pushers
            self._layout = FlatLayout.build(manifest, parts, None, [[r] for r in self.group.ranks])
        else:
            codecs = wire_codecs(manifest, ctx.comm, ctx.cluster) if ctx.topology.servers else None
            self._layout = FlatLayout.build(manifest, parts, codecs, ctx.topology.worker_machines)
        self._stagings = {}  # buffers (pinned ones included) are allocated once per layout

    def grad_homes(self, named: list[tuple[str, torch.Tensor]]) -> dict[int, torch.Tensor]:
        """Where the gradients of `named` (the agreed layout's parameters) can live so that
        backward accumulates them straight into the all-reduce buckets, by index: views of
        the host buffers (`HostInPlace.homes_for`); empty before a step agreed the layout
        and elsewhere (servers, GPUs, one process)."""
        st = self._stagings.get(torch.device("cpu"))
        if self._step is not None or not isinstance(st, HostInPlace) or self._layout is None:
            return {}
        if len(named) != len(self._layout.manifest.entries) or any(
                n != e.name for (n, _), e in zip(named, self._layout.manifest.entries)):
            return {}
        return st.homes_for([t for _, t in named])

    def zero_grad_homes(self) -> None:
        """Zero the buffers that hold gradient homes (see `grad_homes`)."""
        if isinstance(st := self._stagings.get(torch.device("cpu")), HostInPlace):
            st.zero_homes()

    @property
    def single_bucket(self) -> bool:
        """The agreed layout is one all-reduce bucket of host tensors: handing them over
        while backward runs starts nothing earlier (not for GPU tensors, whose copies to
        the host do overlap with backward)."""
        return (self._layout is not None and isinstance(self.transport, AllReduceTransport)
                and len(self._layout.parts) == 1 and bool(self._stagings)
                and all(d.type == "cpu" for d in self._stagings))
