"""Cost model of a heterogeneous layer pipeline (HeterPS), numpy only.

A model is an ordered chain of L layers; a catalogue has R resource types. A *plan*
gives every layer a type; a maximal run of consecutive layers on one type is a
*stage*; a stage gets k instances of its type that split each global batch of
``batch_size`` samples evenly (data parallelism inside the stage).

For a stage covering layers i..j-1 on type r (all times in seconds per sample on one
instance, bytes per sample):

    compute   = Σ_l t[l, r]                                 (forward + backward)
    transfer  = transfer_time(a_in + a_out, bw_r)            (activations in and the
                gradient of the input back, the output activations out and their
                gradient in; full duplex, so each direction carries a_in + a_out)
    T         = compute + transfer
    step(k)   = batch·T/k + ring_allreduce_time(P_dense, k, bw_r)
    thr(k)    = batch / step(k)                                (samples/s)
    mem(k)    = f_d·P_dense + (f_s·P_sparse + batch·A)/k        (A: activation bytes
                stored for backward; sparse tables are sharded over the k instances)

``thr(k) >= target`` is linear in k: k·(B − τG) >= τ(B·T − G) with G = 2·P_dense/bw,
so the smallest k that meets the target and fits in memory has a closed form
(`min_instances`). Plan throughput = min over stages of thr(k_s); plan price per
hour = Σ_s k_s·price_r; the plan is provisioned for the target, and a run of N
samples at the target rate costs ``N/τ/3600 · price per hour`` (the objective every
planner minimises). Infeasible: a stage that cannot meet the target or fit in memory
with at most the available count, or more instances of a type than available in
total.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import UserError  # dependency-free: perf stays numpy-only
from .comm import ring_allreduce_time, transfer_time

INF = np.inf


@dataclass(frozen=True)
class CostParams:
    """Knobs of the pipeline cost model (defaults match docs/placement.md)."""

    batch_size: int = 512            # global samples per step; a stage splits it over its k instances
    dense_state_factor: float = 4.0  # bytes kept per dense parameter byte: weights, grads, 2 Adam moments
    sparse_state_factor: float = 2.0  # embedding rows + an Adagrad accumulator
    activation_factor: float = 1.0   # multiplier on stored activation bytes
    latency: float = 0.0             # seconds per inter-stage transfer (per sample, amortised)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise UserError(f"batch_size must be >= 1, got {self.batch_size}")
        for name in ("dense_state_factor", "sparse_state_factor", "activation_factor", "latency"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Workload:
    """Numbers the cost model needs, as arrays (L layers, R resource types)."""

    compute: np.ndarray             # (L, R) s/sample, forward+backward, one instance of type r
    act_bytes: np.ndarray           # (L,) bytes/sample of layer l's output (crosses a cut after l)
    dense_param_bytes: np.ndarray   # (L,)
    sparse_param_bytes: np.ndarray  # (L,)
    price: np.ndarray               # (R,) $/hour per instance
    count: np.ndarray               # (R,) instances available
    memory: np.ndarray              # (R,) bytes per instance
    bandwidth: np.ndarray           # (R,) bytes/s per instance NIC, each direction
    stored_act_bytes: np.ndarray | None = None  # (L,) kept for backward; defaults to act_bytes
    type_names: tuple[str, ...] = ()
    type_kinds: tuple[str, ...] = ()   # "cpu" / "gpu" per type (for baselines and reports)
    layer_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        c = np.asarray(self.compute, dtype=float)
        if c.ndim != 2 or c.shape[0] < 1 or c.shape[1] < 1:
            raise UserError(f"compute must be an (L, R) array with L, R >= 1, got shape {c.shape}")
        L, R = c.shape
        object.__setattr__(self, "compute", c)
        for name, n in (("act_bytes", L), ("dense_param_bytes", L), ("sparse_param_bytes", L),
                        ("price", R), ("count", R), ("memory", R), ("bandwidth", R)):
            a = np.asarray(getattr(self, name), dtype=float)
            if a.shape != (n,):
                raise UserError(f"{name} must have shape ({n},), got {a.shape}")
            if np.any(a < 0) or not np.all(np.isfinite(a)):
                raise UserError(f"{name} must be finite and >= 0")
            object.__setattr__(self, name, a)
        if np.any(np.isnan(c)) or np.any(c <= 0):
            raise UserError("compute times must be > 0 (use inf for a layer a type cannot run)")
        if np.any(self.bandwidth <= 0):
            raise UserError("bandwidth must be > 0")
        s = self.act_bytes if self.stored_act_bytes is None else np.asarray(self.stored_act_bytes, float)
        object.__setattr__(self, "stored_act_bytes", s)

    @property
    def n_layers(self) -> int:
        return self.compute.shape[0]

    @property
    def n_types(self) -> int:
        return self.compute.shape[1]


# ---------------------------------------------------------------- one stage


def min_instances(T, p_dense, p_sparse, stored, bw, mem, count, target, params: CostParams):
    """Smallest k >= 1 with thr(k) >= target and mem(k) <= mem and k <= count (inf if none).

    Every argument broadcasts (numpy arrays or scalars); returns float array of k.
    """
    T, p_dense, p_sparse, stored, bw, mem, count = np.broadcast_arrays(
        *(np.asarray(x, dtype=float) for x in (T, p_dense, p_sparse, stored, bw, mem, count)))
    B = float(params.batch_size)
    tau = float(target)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        # memory: f_d·Pd + (f_s·Ps + B·A)/k <= mem
        free = mem - params.dense_state_factor * p_dense
        need = params.sparse_state_factor * p_sparse + B * params.activation_factor * stored
        k_mem = np.where(free > 0, np.maximum(1.0, np.ceil(need / free * (1 - 1e-12))), INF)
        # throughput: k·D >= E with D = B - τG, E = τ(B·T - G), G = 2·Pd/bw
        G = 2.0 * p_dense / bw
        D = B - tau * G
        E = tau * (B * T - G)
        k_thr = np.where(D > 0, np.maximum(1.0, np.ceil(E / D * (1 - 1e-12))),
                         np.where(D >= E, 1.0, INF))
        k = np.maximum(k_mem, k_thr)
        ok = np.isfinite(k) & np.isfinite(T) & (k <= count)
        # for D <= 0 the throughput falls with k: the k chosen for memory must still pass
        ok &= (D > 0) | (k * D >= E - 1e-9 * np.abs(E))
    return np.where(ok, k, INF)


def stage_throughput(T, p_dense, bw, k, params: CostParams):
    """Samples/s of a stage with k instances (the ring all-reduce of dense parameters
    runs once per step of ``batch_size`` samples)."""
    B = float(params.batch_size)
    k = int(k)
    if not np.isfinite(T) or k < 1:
        return 0.0
    step = B * T / k + ring_allreduce_time(float(p_dense), k, float(bw))
    return B / step if step > 0 else INF


def stage_memory(p_dense, p_sparse, stored, k, params: CostParams) -> float:
    return (params.dense_state_factor * p_dense
            + (params.sparse_state_factor * p_sparse
               + params.batch_size * params.activation_factor * stored) / k)


@dataclass(frozen=True)
class StageTables:
    """Every possible stage: arrays indexed [i, j, r] = layers i..j-1 on type r.

    ``k`` is the smallest instance count meeting the target (inf: impossible);
    ``hourly`` = k·price (inf when impossible); ``T`` the per-instance time per sample;
    ``k_raw`` the smallest k ignoring the available count (how far over it a stage is).
    """

    T: np.ndarray
    k: np.ndarray
    hourly: np.ndarray
    target: float
    k_raw: np.ndarray | None = None

    @property
    def n_layers(self) -> int:
        return self.T.shape[0] - 1


def _boundary_bytes(w: Workload) -> tuple[np.ndarray, np.ndarray]:
    # a cut at boundary b (between layers b-1 and b) carries act_bytes[b-1]; the model's
    # input (b = 0) comes from the data loader and its output (b = L) is the loss: free.
    cut = np.concatenate([[0.0], w.act_bytes[:-1], [0.0]])
    return cut, cut


def stage_tables(w: Workload, target: float, params: CostParams = CostParams()) -> StageTables:
    """Vectorised smallest-k and price of every (i, j, r) stage; O(L²R) memory."""
    if not target > 0:
        raise UserError(f"throughput target (--throughput) must be > 0 samples/s, got {target}")
    L, R = w.compute.shape
    cum = np.vstack([np.zeros((1, R)), np.cumsum(w.compute, axis=0)])          # (L+1, R)
    comp = cum[None, :, :] - cum[:, None, :]                                       # (i, j, r)
    a_in, a_out = _boundary_bytes(w)
    comm = (a_in[:, None, None] + a_out[None, :, None]) / w.bandwidth[None, None, :]
    if params.latency:
        comm = comm + params.latency * ((a_in[:, None, None] > 0).astype(float) + (a_out[None, :, None] > 0))
    T = comp + comm
    def cs(x):
        c = np.concatenate([[0.0], np.cumsum(x)])
        return (c[None, :] - c[:, None])[:, :, None]
    pd, ps, st = cs(w.dense_param_bytes), cs(w.sparse_param_bytes), cs(w.stored_act_bytes)
    valid = (np.arange(L + 1)[:, None] < np.arange(L + 1)[None, :])[:, :, None]
    T = np.where(valid, T, INF)
    k_raw = min_instances(T, pd, ps, st, w.bandwidth[None, None, :], w.memory[None, None, :],
                          INF, target, params)
    k_raw = np.where(valid, k_raw, INF)
    k = np.where(k_raw <= w.count[None, None, :], k_raw, INF)
    hourly = k * w.price[None, None, :]
    hourly = np.where(np.isfinite(k), hourly, INF)
    return StageTables(T=T, k=k, hourly=hourly, target=float(target), k_raw=k_raw)


# ---------------------------------------------------------------- whole plan


@dataclass(frozen=True)
class Stage:
    start: int          # first layer
    end: int            # one past the last layer
    rtype: int
    instances: int      # 0 when impossible
    time_per_sample: float
    throughput: float   # samples/s with `instances` instances
    memory: float       # bytes per instance
    hourly: float       # $/hour


@dataclass(frozen=True)
class PlanScore:
    assignment: tuple[int, ...]
    stages: tuple[Stage, ...]
    throughput: float     # min over stages (samples/s)
    hourly: float         # $/hour (inf when infeasible)
    feasible: bool
    reason: str = ""
    used: tuple[int, ...] = field(default=())  # instances per type

    def run_cost(self, n_samples: float, target: float) -> float:
        return run_cost(self.hourly, n_samples, target)


def run_cost(hourly: float, n_samples: float, target: float) -> float:
    """$ for N samples at the target rate (the plan is provisioned for the target)."""
    return hourly * n_samples / target / 3600.0


def stages_of(assignment) -> list[tuple[int, int, int]]:
    """Maximal runs of one type: [(start, end, type)]."""
    a = np.asarray(assignment, dtype=int)
    if a.size == 0:
        return []
    cut = np.flatnonzero(np.diff(a)) + 1
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [a.size]])
    return [(int(s), int(e), int(a[s])) for s, e in zip(starts, ends)]


def evaluate(w: Workload, assignment, target: float, params: CostParams = CostParams(),
             instances: list[int] | None = None) -> PlanScore:
    """Score one plan. Instance counts default to the smallest meeting the target."""
    a = tuple(int(x) for x in assignment)
    if len(a) != w.n_layers:
        raise UserError(f"assignment has {len(a)} entries, the model has {w.n_layers} layers")
    if any(x < 0 or x >= w.n_types for x in a):
        raise UserError(f"assignment entries must be type indices 0..{w.n_types - 1}")
    a_in, a_out = _boundary_bytes(w)
    out: list[Stage] = []
    reasons: list[str] = []
    used = np.zeros(w.n_types, dtype=int)
    for si, (i, j, r) in enumerate(stages_of(a)):
        comp = float(w.compute[i:j, r].sum())
        comm = transfer_time(a_in[i] + a_out[j], w.bandwidth[r])
        if params.latency:
            comm += params.latency * ((a_in[i] > 0) + (a_out[j] > 0))
        T = comp + comm
        pd = float(w.dense_param_bytes[i:j].sum())
        ps = float(w.sparse_param_bytes[i:j].sum())
        st = float(w.stored_act_bytes[i:j].sum())
        if instances is None:
            k = float(min_instances(T, pd, ps, st, w.bandwidth[r], w.memory[r], w.count[r], target, params))
        else:
            k = float(instances[si])
        name = w.type_names[r] if w.type_names else f"type {r}"
        if not np.isfinite(k) or k < 1:
            reasons.append(f"stage {si} (layers {i}..{j - 1} on {name}) cannot reach the target "
                           f"within {int(w.count[r])} instances and {w.memory[r] / 2**30:.1f} GiB each")
            out.append(Stage(i, j, r, 0, T, 0.0, INF, INF))
            continue
        k = int(k)
        used[r] += k
        thr = stage_throughput(T, pd, w.bandwidth[r], k, params)
        mem = stage_memory(pd, ps, st, k, params)
        if mem > w.memory[r] * (1 + 1e-9):
            reasons.append(f"stage {si} needs {mem / 2**30:.2f} GiB per instance, {name} has "
                           f"{w.memory[r] / 2**30:.2f} GiB")
        out.append(Stage(i, j, r, k, T, thr, mem, k * float(w.price[r])))
    for r in range(w.n_types):
        if used[r] > w.count[r]:
            name = w.type_names[r] if w.type_names else f"type {r}"
            reasons.append(f"plan uses {used[r]} instances of {name}, only {int(w.count[r])} available")
    thr = min(s.throughput for s in out) if out else 0.0
    if thr < target * (1 - 1e-9) and not reasons:
        reasons.append(f"throughput {thr:.4g} samples/s is below the target {target:.4g}")
    feasible = not reasons
    hourly = float(sum(s.hourly for s in out)) if feasible else INF
    return PlanScore(a, tuple(out), float(thr), hourly, feasible, "; ".join(reasons), tuple(int(u) for u in used))


def score_assignments(tables: StageTables, w: Workload, assignments: np.ndarray,
                      raw: bool = False) -> tuple[np.ndarray, ...]:
    """Price per hour of many plans at once (B, L) -> (hourly (B,), violation (B,)).

    hourly is inf for infeasible plans; violation (0 exactly when feasible) = Σ over types
    of (instances needed - available)/available where positive, plus the number of stages
    that cannot meet the target or fit at any count: a graded penalty for a learner.
    With ``raw=True`` also returns the price ignoring the available counts (inf only when
    a stage is impossible at any count) and the number of impossible stages.
    Uses the same stage tables as `exact`, so all planners score plans identically.
    """
    A = np.asarray(assignments, dtype=np.int64)
    Bn, L = A.shape
    R = w.n_types
    change = np.ones((Bn, L + 1), dtype=bool)
    change[:, 1:L] = A[:, 1:] != A[:, :-1]
    # stage starts: positions where change; ends: next change
    rows, starts = np.nonzero(change[:, :L])
    # end of each stage = next start in the same row, or L
    nxt = np.empty_like(starts)
    nxt[:-1] = starts[1:]
    last = np.ones(len(starts), dtype=bool)
    last[:-1] = rows[1:] != rows[:-1]
    nxt[last] = L
    types = A[rows, starts]
    k = (tables.k_raw if tables.k_raw is not None else tables.k)[starts, nxt, types]
    bad = ~np.isfinite(k)
    hourly_stage = np.where(bad, 0.0, k * w.price[types])
    hourly = np.bincount(rows, weights=hourly_stage, minlength=Bn)
    nbad = np.bincount(rows, weights=bad.astype(float), minlength=Bn)
    used = np.zeros(Bn * R)
    np.add.at(used, rows * R + types, np.where(bad, 0.0, k))
    over = (np.clip(used.reshape(Bn, R) - w.count[None, :], 0, None) / w.count[None, :]).sum(axis=1)
    violation = over + nbad
    price_raw = np.where(nbad > 0, INF, hourly)
    hourly = np.where(violation > 0, INF, hourly)
    if raw:
        return hourly, violation, price_raw, nbad
    return hourly, violation
