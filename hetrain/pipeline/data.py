"""Generated click-through data: many sparse features with skewed IDs, a few dense
features, and labels drawn from a hidden ground-truth model, so the best reachable AUC
(the ceiling) is known. Nothing is downloaded.

The stream is deterministic by sample index: sample i lives in chunk i // CHUNK, which
is generated from (seed, chunk) alone, so any process can read any range of samples
(stage replicas read only their own micro-batches) and a resumed job sees the same data.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ..errors import UserError

CHUNK = 4096


@dataclass(frozen=True)
class CTRDataConfig:
    """Shape of the generated data and of its hidden model."""

    n_tables: int = 8          # sparse (categorical) features, one ID each
    rows: int = 20000          # distinct IDs per feature
    n_dense: int = 13          # dense features
    zipf: float = 1.05         # ID popularity ∝ (rank+1)^-zipf: a few hot IDs, a long tail
    latent: int = 4            # rank of the hidden pairwise interactions
    bias: float = -1.0         # sets the click rate (~30%)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_tables < 1 or self.rows < 2 or self.n_dense < 1:
            raise UserError(f"CTR data needs n_tables >= 1, rows >= 2, n_dense >= 1; got {self}")
        if not self.zipf >= 0:
            raise UserError(f"zipf must be >= 0 (0 = uniform IDs), got {self.zipf}")


class CTRData:
    """The hidden model and the sample stream (train: stream 0, test: stream 1)."""

    def __init__(self, cfg: CTRDataConfig = CTRDataConfig()):
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + 17)
        T, R = cfg.n_tables, cfg.rows
        self.w = torch.randn(T, R, generator=g) * 0.6                    # per-ID effect
        self.v = torch.randn(T, R, cfg.latent, generator=g) * (0.5 / cfg.latent ** 0.5)
        self.beta = torch.randn(cfg.n_dense, generator=g) * 0.4
        # popularity rank -> ID: a fixed random permutation per feature, so hot IDs are
        # spread over the sparse-PS shards
        self.perm = torch.stack([torch.randperm(R, generator=g) for _ in range(T)])
        p = (torch.arange(R, dtype=torch.float64) + 1.0) ** (-cfg.zipf)
        self.cdf = torch.cumsum(p / p.sum(), 0)

    def logit(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The ground truth: bias + dense·β + Σ_t w_t[id] + Σ_{t<u} <v_t[id], v_u[id]>."""
        t = torch.arange(self.cfg.n_tables)
        idx = ids[:, :, 0]
        w = self.w[t, idx].sum(1)
        v = self.v[t, idx]                                            # (n, T, latent)
        s = v.sum(1)
        pair = 0.5 * ((s * s).sum(1) - (v * v).sum((1, 2)))
        return self.cfg.bias + dense @ self.beta + w + pair

    def _chunk(self, stream: int, c: int):
        cfg = self.cfg
        g = torch.Generator().manual_seed(((cfg.seed * 7919 + stream) * 1_000_033 + c) % (2**63))
        dense = torch.randn(CHUNK, cfg.n_dense, generator=g)
        u = torch.rand(CHUNK, cfg.n_tables, generator=g, dtype=torch.float64)
        rank = torch.searchsorted(self.cdf, u).clamp_(max=cfg.rows - 1)
        ids = torch.gather(self.perm, 1, rank.T).T.unsqueeze(-1).contiguous()   # (n, T, 1)
        prob = torch.sigmoid(self.logit(dense, ids))
        label = (torch.rand(CHUNK, generator=g) < prob).float()
        return dense, ids, label, prob

    def samples(self, start: int, n: int, stream: int = 0):
        """Samples start..start+n-1 of a stream: (dense, ids, label)."""
        parts = [[], [], []]
        i = start
        while i < start + n:
            c, off = divmod(i, CHUNK)
            take = min(CHUNK - off, start + n - i)
            chunk = self._cached(stream, c)
            for p, x in zip(parts, chunk[:3]):
                p.append(x[off: off + take])
            i += take
        return tuple(torch.cat(p) if len(p) > 1 else p[0] for p in parts)

    def _cached(self, stream: int, c: int):
        key = (stream, c)
        if getattr(self, "_last_key", None) != key:
            self._last = self._chunk(stream, c)
            self._last_key = key
        return self._last

    def test_set(self, n: int = 20000):
        """Held-out samples with their true click probability (for the AUC ceiling)."""
        out = [[], [], [], []]
        for c in range((n + CHUNK - 1) // CHUNK):
            for o, x in zip(out, self._chunk(1, c)):
                o.append(x)
        return tuple(torch.cat(o)[:n] for o in out)

    @cached_property
    def ceiling_auc(self) -> float:
        _, _, label, prob = self.test_set()
        return auc(prob, label)


class MicroBatchLoader:
    """Streams the micro-batches one stage replica owns. A step s covers samples
    [s·B, (s+1)·B) of the training stream; micro-batch i (owned by replica i mod k of the
    first stage) covers a slice of it, laid out replica by replica: the micro-batches of
    replica 0 first, then replica 1's, ... So each replica reads one contiguous block and
    generates only the chunks of its own share (about 1/k of the step's data), and the
    step's samples are exactly those one process trains on."""

    def __init__(self, data: CTRData, batch: int, sizes: list[int], replicas: int = 1):
        self.data, self.batch, self.sizes = data, batch, sizes
        self.offsets = micro_batch_offsets(sizes, replicas)

    def get(self, step: int, mb: int):
        return self.data.samples(step * self.batch + int(self.offsets[mb]), int(self.sizes[mb]))


def micro_batch_offsets(sizes: list[int], replicas: int = 1) -> list[int]:
    """Offset of each micro-batch in its step when micro-batch i goes to replica i mod
    `replicas` and each replica's micro-batches are consecutive samples."""
    order = sorted(range(len(sizes)), key=lambda i: (i % replicas, i // replicas))
    out, off = [0] * len(sizes), 0
    for i in order:
        out[i] = off
        off += sizes[i]
    return out


def auc(scores, labels) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties)."""
    from scipy.stats import rankdata

    s = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(labels).ravel() > 0.5
    n1, n0 = int(y.sum()), int((~y).sum())
    if n1 == 0 or n0 == 0:
        raise ValueError("AUC needs both positive and negative labels")
    r = rankdata(s)
    return float((r[y].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))
