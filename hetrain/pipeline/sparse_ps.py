"""Sparse parameter server: embedding rows sharded across CPU server processes.

All embedding tables share one global key space (table t's ID i is key offset_t + i).
Key g lives on shard g mod n at local row g div n: the hot IDs of a skewed feature
spread over every shard, and a table larger than one shard's memory cap is split over
several. Workers pull only the rows a micro-batch touches and push the gradient of
those rows; the shard sums the pushed gradients of a step and, once every client has
committed the step, applies the optimizer (SGD or Adagrad) to the touched rows only.
So one step of the pipeline makes exactly the update a single process would make on
the whole global batch (synchronous training).

Wire protocol (gloo point-to-point through comm/p2p.py, tensors only; nothing received is
unpickled; tags from p2p's sparse-ps range):
client -> shard  header int64[4] = [op, step, n, 0] on TAG_HDR (any-source receive on
the shard), then for PULL: keys int64[n] (TAG_IDS) and the shard answers rows
float32[n, dim] (TAG_ROWS); PUSH: keys int64[n] and grads float32[n, dim] (TAG_GRAD);
COMMIT(step) and STOP carry nothing more.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..comm import p2p

from ..errors import UserError

PULL, PUSH, COMMIT, STOP = 1, 2, 3, 4
TAG_HDR, TAG_IDS, TAG_ROWS, TAG_GRAD = (p2p.SPARSE_PS(i) for i in range(4))


@dataclass(frozen=True)
class SparseOptim:
    """The per-row optimizer the shards run."""

    kind: str = "adagrad"   # adagrad | sgd
    lr: float = 0.05
    eps: float = 1e-10      # Adagrad's, as torch.optim.Adagrad

    def __post_init__(self) -> None:
        if self.kind not in ("adagrad", "sgd"):
            raise UserError(f"sparse optimizer (--optimizer) must be 'adagrad' or 'sgd', got {self.kind!r}")
        if not self.lr > 0:
            raise UserError(f"learning rate (--lr) must be > 0, got {self.lr}")


def shards_needed(total_rows: int, dim: int, memory_cap: float, requested: int = 1,
                  state_factor: float = 2.0) -> int:
    """Shards so that every shard's rows and optimizer state fit in ``memory_cap`` bytes:
    max(requested, ceil(bytes / cap)). A table larger than one cap is thereby split."""
    if requested < 1:
        raise UserError(f"need at least one sparse-PS shard (--ps-shards), got {requested}")
    if not memory_cap > 0:
        raise UserError(f"shard memory cap (--ps-memory) must be > 0 bytes, got {memory_cap}")
    need = total_rows * dim * 4 * state_factor
    return max(requested, math.ceil(need / memory_cap))


class ShardLayout:
    """Where each embedding row lives: shard = key mod n, local row = key div n."""

    def __init__(self, table_rows: list[int], n_shards: int):
        if n_shards < 1:
            raise UserError(f"need at least one shard (--ps-shards), got {n_shards}")
        self.table_rows = [int(r) for r in table_rows]
        self.n = int(n_shards)
        off = [0]
        for r in self.table_rows:
            off.append(off[-1] + r)
        self.offsets = off
        self.total = off[-1]

    def keys(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        return ids % self.table_rows[table] + self.offsets[table]

    def rows_on(self, shard: int) -> int:
        return len(range(shard, self.total, self.n))

    def split(self, keys: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """For each shard: (positions in ``keys``, local rows on that shard)."""
        owner = keys % self.n
        out = []
        for j in range(self.n):
            pos = torch.nonzero(owner == j).flatten()
            out.append((pos, keys[pos] // self.n))
        return out

    def shard_of(self, full: torch.Tensor, shard: int) -> torch.Tensor:
        """Shard ``shard``'s slice of a (total, dim) matrix of every row."""
        return full[shard:: self.n].clone()


class ShardState:
    """One shard's rows, Adagrad accumulators and the gradients summed this step."""

    def __init__(self, rows: torch.Tensor, optim: SparseOptim):
        self.rows = rows.contiguous().float()
        self.optim = optim
        self.acc = torch.zeros_like(self.rows) if optim.kind == "adagrad" else None
        self.grad = torch.zeros_like(self.rows)
        self.touched = torch.zeros(self.rows.shape[0], dtype=torch.bool)
        self.pulled = torch.zeros(self.rows.shape[0], dtype=torch.bool)  # for tests/inspection

    def pull(self, local: torch.Tensor) -> torch.Tensor:
        self.pulled[local] = True
        return self.rows.index_select(0, local)

    def push(self, local: torch.Tensor, grad: torch.Tensor) -> None:
        self.grad.index_add_(0, local, grad)
        self.touched[local] = True

    def apply(self) -> int:
        """Optimizer step on the rows pushed since the last apply; returns how many."""
        idx = torch.nonzero(self.touched).flatten()
        if idx.numel():
            g = self.grad.index_select(0, idx)
            if self.optim.kind == "sgd":
                self.rows.index_add_(0, idx, g, alpha=-self.optim.lr)
            else:
                a = self.acc.index_select(0, idx).addcmul_(g, g)
                self.acc.index_copy_(0, idx, a)
                w = self.rows.index_select(0, idx).addcdiv_(g, a.sqrt().add_(self.optim.eps), value=-self.optim.lr)
                self.rows.index_copy_(0, idx, w)
            self.grad.index_fill_(0, idx, 0.0)
            self.touched.zero_()
        return int(idx.numel())

    def state_dict(self) -> dict:
        d = {"rows": self.rows.clone()}
        if self.acc is not None:
            d["acc"] = self.acc.clone()
        return d

    def load_state_dict(self, d: dict) -> None:
        if d["rows"].shape != self.rows.shape:
            raise ValueError(f"checkpointed shard has {tuple(d['rows'].shape)} rows, this shard "
                             f"{tuple(self.rows.shape)}: resume with the same plan and --ps-shards")
        self.rows.copy_(d["rows"])
        if self.acc is not None:
            self.acc.copy_(d["acc"])


# ------------------------------------------------------------------ network roles


def _hdr(op: int, step: int = 0, n: int = 0) -> torch.Tensor:
    return torch.tensor([op, step, n, 0], dtype=torch.int64)


class SparseClient:
    """A stage replica's view of the sharded tables."""

    def __init__(self, layout: ShardLayout, shard_ranks: list[int], dim: int, on_error=None):
        self.layout, self.ranks, self.dim = layout, shard_ranks, dim
        self._pending: list = []   # sends of pushes still in flight (buffers kept alive)
        self.on_error = on_error

    def _wait(self, works, what: str, peers: list[int]) -> None:
        p2p.wait_all(works, self.on_error, what, peers)

    def pull(self, keys: torch.Tensor, step: int) -> torch.Tensor:
        """Rows for distinct ``keys`` (int64, 1-D), gathered from their shards."""
        return self.wait(self.start(keys, step))

    def start(self, keys: torch.Tensor, step: int):
        """Post the pull of ``keys``' rows and return at once (`wait` collects them), so a
        stage can compute while its next micro-batch's rows are on their way."""
        parts = self.layout.split(keys)
        works, bufs = [], []
        for j, (pos, local) in enumerate(parts):
            if pos.numel() == 0:
                continue
            r = self.ranks[j]
            h = _hdr(PULL, step, local.numel())
            buf = torch.empty(local.numel(), self.dim)
            try:  # gloo raises at once on a connection it already knows is broken
                works += [p2p.isend(h, r, TAG_HDR), p2p.isend(local, r, TAG_IDS), p2p.irecv(buf, r, TAG_ROWS)]
            except RuntimeError as err:
                if self.on_error is None:
                    raise
                raise self.on_error("pulling embedding rows", [r], err) from None
            bufs.append((pos, buf, h, local))
        return keys.numel(), works, bufs

    def wait(self, pending) -> torch.Tensor:
        n, works, bufs = pending
        self._wait(works, "pulling embedding rows", self.ranks)
        out = torch.empty(n, self.dim)
        for pos, buf, _, _ in bufs:
            out[pos] = buf
        return out

    def push(self, keys: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        """Send the gradient of the rows ``keys`` (no reply; summed on the shard)."""
        for j, (pos, local) in enumerate(self.layout.split(keys)):
            if pos.numel() == 0:
                continue
            r = self.ranks[j]
            h = _hdr(PUSH, step, local.numel())
            g = grad.index_select(0, pos).contiguous()
            self._pending.append(([p2p.isend(h, r, TAG_HDR), p2p.isend(local, r, TAG_IDS),
                                   p2p.isend(g, r, TAG_GRAD)], (h, local, g)))

    def commit(self, step: int) -> None:
        """This client has pushed everything of ``step``."""
        works = [w for ws, _ in self._pending for w in ws]
        self._pending.clear()
        hs = [_hdr(COMMIT, step) for _ in self.ranks]
        works += [p2p.isend(h, r, TAG_HDR) for h, r in zip(hs, self.ranks)]
        self._wait(works, "committing sparse gradients", self.ranks)

    def stop(self) -> None:
        hs = [_hdr(STOP) for _ in self.ranks]
        self._wait([p2p.isend(h, r, TAG_HDR) for h, r in zip(hs, self.ranks)],
                   "stopping the sparse shards", self.ranks)


def serve(state: ShardState, clients: list[int], dim: int, start_step: int = 0,
          on_step=None, on_error=None) -> int:
    """Shard main loop: answer pulls, sum pushes, apply after all clients commit a step.

    A pull for the next step that arrives before every client committed this one is
    kept and answered after the update, so every pull of step s sees the parameters
    after step s-1 exactly. Returns the number of steps applied.
    """
    step = start_step
    committed: set[int] = set()
    stopped: set[int] = set()
    deferred: list[tuple[int, torch.Tensor]] = []
    hdr = torch.empty(4, dtype=torch.int64)
    sends = []

    def answer(src: int, local: torch.Tensor) -> None:
        rows = state.pull(local)
        sends.append((p2p.isend(rows, src, TAG_ROWS), rows))

    while len(stopped) < len(clients):
        try:
            src = p2p.recv(hdr, None, TAG_HDR)
            op, s, n = int(hdr[0]), int(hdr[1]), int(hdr[2])
            if op in (PULL, PUSH):
                local = torch.empty(n, dtype=torch.int64)
                p2p.recv(local, src, TAG_IDS)
            if op == PULL:
                if s > step:
                    deferred.append((src, local))
                else:
                    answer(src, local)
            elif op == PUSH:
                g = torch.empty(n, dim)
                p2p.recv(g, src, TAG_GRAD)
                state.push(local, g)
            elif op == COMMIT:
                committed.add(src)
                if committed >= set(clients) - stopped:
                    state.apply()
                    step += 1
                    committed.clear()
                    if on_step:
                        on_step(step)
                    for src2, local2 in deferred:
                        answer(src2, local2)
                    deferred.clear()
            elif op == STOP:
                stopped.add(src)
            else:
                raise RuntimeError(f"sparse shard got an unknown request {op} from rank {src}")
            if len(sends) > 64:
                p2p.wait_all([w for w, _ in sends], None, "returning embedding rows")  # named below
                sends.clear()
        except RuntimeError as err:
            if on_error:
                raise on_error("serving embedding rows", [], err) from None
            raise
    p2p.wait_all([w for w, _ in sends], on_error, "returning embedding rows")
    return step
