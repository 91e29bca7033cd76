"""Job scaling model: how fast a data-parallel job progresses on g GPUs of one type.

This is the one cost model shared by the scheduling policies, the simulator and the
real executor (numpy only). Two curves, both answering `rate(gpu_type, g)` in *work
units per second* (a work unit is whatever the job's remaining work is counted in:
global steps, or per-GPU minibatches as in Gavel's measurements):

- `RingCurve`: ring maths, T(g) = overhead + T_compute(batch/g) + 2(g-1)/g·M/B + 2(g-1)·lat,
  built on `hetrain.perf.comm.ring_allreduce_time`. Fixed global batch (strong scaling,
  one unit = one global step) or fixed per-GPU batch (weak scaling, one step = g units).
- `TableCurve`: measured rates per GPU type and count (Gavel's
  `simulation_throughputs.json`), linearly interpolated between measured counts.

`fit_job` fits a job's ring curve (overhead, compute per GPU type, bandwidth and
latency) to the step times its workers report, split into compute and communication
(least squares, non-negative coefficients): the scheduler's executor re-fits it as a
job runs at new sizes and the policies plan with it (fit, then schedule, as AdaptDL
does). `fit_ring` is the same fit from total step times alone, where the bandwidth
term must be given. `rate_table` turns any curve into a dense (types × counts) array
so policies and the simulator look rates up in O(1). `completion_time` is the one
formula for "seconds to finish" used by every policy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

import numpy as np

from ..errors import UserError  # dependency-free: perf stays numpy-only
from .comm import ring_allreduce_time


class ScalingCurve(Protocol):
    def rate(self, gpu_type: str, g: int) -> float:
        """Work units per second on g GPUs of gpu_type; 0 means the job cannot run so."""

    def max_gpus(self, gpu_type: str) -> int:
        """Largest GPU count of this type the curve knows (0: the type is unusable)."""


@dataclass(frozen=True)
class RingCurve:
    """Ring all-reduce step-time model.

    compute_s[type]: seconds of forward+backward for one step's batch on ONE GPU of that
    type (strong scaling: the batch is split, so compute is compute_s/g; weak scaling:
    every GPU does compute_s). model_bytes / bandwidth / latency feed the ring formula.
    """

    compute_s: Mapping[str, float]
    model_bytes: float = 0.0
    bandwidth: float = 1.25e9
    latency: float = 0.0
    overhead_s: float = 0.0
    weak: bool = False
    max_g: int = 64

    def __post_init__(self) -> None:
        if not self.compute_s:
            raise UserError("RingCurve needs compute_s for at least one GPU type, e.g. {'v100': 0.1}")
        for t, c in self.compute_s.items():
            if not c > 0:
                raise UserError(f"compute_s[{t!r}] must be > 0 seconds, got {c}")
        if self.bandwidth <= 0:
            raise UserError(f"bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if self.model_bytes < 0 or self.latency < 0 or self.overhead_s < 0:
            raise UserError("model_bytes, latency and overhead_s must be >= 0")
        if self.max_g < 1:
            raise UserError(f"max_g must be >= 1, got {self.max_g}")

    def step_time(self, gpu_type: str, g: int) -> float:
        c = self.compute_s[gpu_type]
        compute = c if self.weak else c / g
        return self.overhead_s + compute + ring_allreduce_time(self.model_bytes, g, self.bandwidth, self.latency)

    def rate(self, gpu_type: str, g: int) -> float:
        if g < 1 or g > self.max_g or gpu_type not in self.compute_s:
            return 0.0
        units = g if self.weak else 1
        return units / self.step_time(gpu_type, g)

    def max_gpus(self, gpu_type: str) -> int:
        return self.max_g if gpu_type in self.compute_s else 0


@dataclass(frozen=True)
class TableCurve:
    """Measured rates: rates[type][g] in work units/s. Counts between two measured
    counts are interpolated linearly; counts above the largest measured one (or with a
    zero measurement, e.g. out of memory) are not allowed."""

    rates: Mapping[str, Mapping[int, float]]
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def _points(self, gpu_type: str) -> tuple[np.ndarray, np.ndarray]:
        if gpu_type not in self._cache:
            pts = []
            # keep only the prefix of counts that run (a zero at g=2 makes g>=2 unusable)
            for g, r in sorted((int(g), float(r)) for g, r in self.rates.get(gpu_type, {}).items()):
                if not r > 0:
                    break
                pts.append((g, r))
            gs = np.array([g for g, _ in pts], dtype=float)
            rs = np.array([r for _, r in pts], dtype=float)
            self._cache[gpu_type] = (gs, rs)
        return self._cache[gpu_type]

    def rate(self, gpu_type: str, g: int) -> float:
        gs, rs = self._points(gpu_type)
        if len(gs) == 0 or g < gs[0] or g > gs[-1]:
            return 0.0
        return float(np.interp(g, gs, rs))

    def max_gpus(self, gpu_type: str) -> int:
        gs, _ = self._points(gpu_type)
        return int(gs[-1]) if len(gs) else 0


@dataclass(frozen=True)
class RingFit:
    """T(g) = a + b/g + c·2(g-1)/g + d·2(g-1): a fixed, b split compute, c = M/B, d = latency."""

    a: float
    b: float
    c: float
    d: float

    def step_time(self, g: np.ndarray | int) -> np.ndarray | float:
        g = np.asarray(g, dtype=float)
        out = self.a + self.b / g + self.c * 2 * (g - 1) / g + self.d * 2 * (g - 1)
        return float(out) if out.ndim == 0 else out


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Small non-negative least squares by elimination of negative coefficients."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        if np.all(sol >= 0):
            x[:] = 0
            x[active] = sol
            return x
        active.pop(int(np.argmin(sol)))
    return x


def fit_ring(gpus: Sequence[int], step_times: Sequence[float], comm_s: float = 0.0,
             latency_term: bool = False) -> RingFit:
    """Fit T(g) = a + b/g + comm_s·2(g-1)/g (+ d·2(g-1)) to measured step times.

    The bandwidth term 2(g-1)/g = 2 - 2/g is a combination of the other two columns, so
    it cannot be told apart from them by step times alone: pass `comm_s` = M/B from the
    model size and link bandwidth (the cost model in `comm`), and the fit finds the
    fixed cost a, the split compute b and, optionally, the per-hop latency d (all >= 0).
    """
    g = np.asarray(gpus, dtype=float)
    y = np.asarray(step_times, dtype=float)
    if g.shape != y.shape or len(g) == 0:
        raise UserError("fit_ring needs as many step times as GPU counts (at least one)")
    if np.any(g < 1) or np.any(y <= 0):
        raise UserError("GPU counts must be >= 1 and step times > 0")
    if comm_s < 0:
        raise UserError(f"comm_s must be >= 0, got {comm_s}")
    resid = y - comm_s * 2 * (g - 1) / g
    cols = [np.ones_like(g), 1.0 / g]
    if latency_term:
        cols.append(2 * (g - 1))
    x = _nnls(np.stack(cols, axis=1), resid)
    return RingFit(float(x[0]), float(x[1]), float(comm_s), float(x[2]) if latency_term else 0.0)


def rate_table(curve: ScalingCurve, gpu_types: Sequence[str], max_g: int) -> np.ndarray:
    """Dense rates[type_index, g] for g = 0..max_g (column 0 is zero)."""
    out = np.zeros((len(gpu_types), max_g + 1))
    for i, t in enumerate(gpu_types):
        top = min(max_g, curve.max_gpus(t))
        for g in range(1, top + 1):
            out[i, g] = curve.rate(t, g)
    return out


def completion_time(remaining, rate, restart_s=0.0):
    """Seconds to finish `remaining` work at `rate` after a restart pause; inf where the
    rate is 0. Scalars give a float; numpy arrays (broadcast) give an array."""
    if not isinstance(remaining, np.ndarray) and not isinstance(rate, np.ndarray) \
            and not isinstance(restart_s, np.ndarray):  # the scalar path is hot in policies: keep it cheap
        return float(restart_s + remaining / rate) if rate > 0 else float("inf")
    rate = np.asarray(rate, dtype=float)
    pos = rate > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(pos, restart_s + np.asarray(remaining, dtype=float) / np.where(pos, rate, 1.0), np.inf)


@dataclass(frozen=True)
class StepSample:
    """What a job's workers measured at one size: mean seconds per step of computing
    (forward, backward, optimizer) and of communicating (gradient sum, step agreement),
    over `steps` steps on `g` GPUs of `gpu_type`, at global batch `batch` (0: the job's
    base batch, the one its curve is counted at)."""

    gpu_type: str
    g: int
    steps: int
    compute_s: float
    comm_s: float
    batch: int = 0

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclass(frozen=True)
class JobFit:
    """A fitted ring curve: step(T, g) = overhead + compute[T]/g + 2(g-1)/g·M/B + 2(g-1)·latency.
    `measured` says which parts came from measurements rather than from the prior."""

    overhead_s: float
    compute_s: Mapping[str, float]  # one global batch on one GPU of each type
    model_bytes: float
    bandwidth: float
    latency: float
    measured: frozenset = frozenset()  # subset of {"compute:<type>", "overhead", "bandwidth", "latency"}

    def curve(self, max_g: int = 64) -> RingCurve:
        return RingCurve(dict(self.compute_s), model_bytes=self.model_bytes, bandwidth=self.bandwidth,
                         latency=self.latency, overhead_s=self.overhead_s, max_g=max_g)

    def step_time(self, gpu_type: str, g: int, batch_ratio: float = 1.0) -> float:
        """Seconds per step on g GPUs of gpu_type at `batch_ratio` times the base batch
        (the compute term scales with the batch, overhead and communication do not)."""
        base = self.curve().step_time(gpu_type, g)
        if batch_ratio == 1.0 or gpu_type not in self.compute_s:
            return base
        return base + (batch_ratio - 1.0) * self.compute_s[gpu_type] / g


def fit_job(samples: Sequence[StepSample], prior: RingCurve, base_batch: int = 0) -> JobFit:
    """Fit a job's ring curve to its measured steps; the prior fills what was not measured.

    Compute and communication are fitted separately, which is what makes the bandwidth
    identifiable (from total step times alone 2(g-1)/g is a mix of the other two terms):
    - compute(T, g) = overhead + c_T / g: one overhead for the job, one c_T per GPU type,
      by non-negative least squares weighted by steps. A type seen at one size only keeps
      the prior's overhead; a type never seen scales the fitted compute by the prior's
      ratio between types.
      A step at another batch M (a goodput-aware scheduler changes it on restarts)
      computes M/base_batch base batches: its column is (M/base_batch)/g.
    - comm(g) = 2(g-1)/g · M/B (+ 2(g-1)·latency once two sizes >= 2 were seen): M is the
      job's gradient bytes, so the fit gives the bandwidth B the job really gets.
    """
    samples = [s for s in samples if s.steps > 0]
    M = prior.model_bytes
    measured: set[str] = set()
    overhead, compute = prior.overhead_s, dict(prior.compute_s)
    types = sorted({s.gpu_type for s in samples if s.gpu_type in compute})
    if types:
        rows = [s for s in samples if s.gpu_type in compute]
        w = np.sqrt([s.steps for s in rows])
        y = np.array([s.compute_s for s in rows])
        sizes = {t: {s.g for s in rows if s.gpu_type == t} for t in types}
        fit_overhead = any(len(v) >= 2 for v in sizes.values())
        share = [(s.batch / base_batch if s.batch and base_batch else 1.0) / s.g for s in rows]
        cols = [[share[k] if s.gpu_type == t else 0.0 for k, s in enumerate(rows)] for t in types]
        if fit_overhead:
            cols.insert(0, [1.0] * len(rows))
            x = _nnls(np.array(cols).T * w[:, None], y * w)
            overhead, coef = float(x[0]), x[1:]
            measured.add("overhead")
        else:
            x = _nnls(np.array(cols).T * w[:, None], (y - overhead) * w)
            coef = x
        fitted = {t: float(c) for t, c in zip(types, coef) if c > 0}
        measured.update(f"compute:{t}" for t in fitted)
        if fitted:  # unseen types: the prior's ratio to the fitted ones
            ratio = np.median([fitted[t] / prior.compute_s[t] for t in fitted])
            compute = {t: fitted.get(t, prior.compute_s[t] * ratio) for t in prior.compute_s}
    bandwidth, latency = prior.bandwidth, prior.latency
    multi = [s for s in samples if s.g >= 2]
    if multi and M > 0:
        g = np.array([s.g for s in multi], dtype=float)
        w = np.sqrt([s.steps for s in multi])
        y = np.array([s.comm_s for s in multi])
        cols = [2 * (g - 1) / g]
        if len(set(g.tolist())) >= 2:
            cols.append(2 * (g - 1))
        x = _nnls(np.stack(cols, axis=1) * w[:, None], y * w)
        bandwidth = float(M / x[0]) if x[0] > 0 else float("inf")
        measured.add("bandwidth")
        if len(cols) == 2:
            latency = float(x[1])
            measured.add("latency")
        else:
            latency = 0.0  # one size: the bandwidth term carries the latency too
    return JobFit(overhead, compute, M, bandwidth, latency, frozenset(measured))
