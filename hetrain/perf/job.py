"""Whole-job cost model: step time, memory per device and cost of every way to train one
model data-parallel on one cluster, numpy only.

A *candidate* (`Candidate`) is one choice of each knob the runtime has: the
communication mode (ring all-reduce among the workers, BytePS with the CPU machines as
extra summation servers, or a plain parameter server on the CPU machines), how the
global batch is split (equal shares, or shares balanced on the step-time model so all
workers finish together), whether gradients are pushed while backward still runs
(overlap), and the gradient codec. For worker i with share b_i:

    compute_i = fixed_i + b_i · per_sample_i                 (the H-PS step-time model, perf.steptime)
    M         = gradient bytes · codec ratio                 (fp32 1, fp16 1/2, int8 1/4, int4 1/8)
    comm      = t(M) / efficiency                            (ring: 2(n-1)/n·M over the slowest NIC, or
                                                               memcpy-bound through shared memory where
                                                               every worker is on one host: perf.comm
                                                               `shm_allreduce_time`;
                                                               BytePS: the LP split of perf.comm;
                                                               PS: the busiest NIC of n·M/k; with
                                                               servers, push + pull of the last
                                                               partition do not overlap: `comm_time`)
    codec     = codec seconds per fp32 byte · gradient bytes (encode + decode, fitted)
    exposed   = comm + codec                                 (no overlap)
              = max(comm + codec − window · max_i compute_i, tail · (comm + codec) / pieces)   (overlap;
                tail 0 for an all-reduce paced before its sends, `JobCluster.paced_before_send`;
                an all-reduce of one bucket hides nothing: it starts after backward, `allreduce_buckets`)
    step      = max_i compute_i + exposed + overhead
    memory_i  = state factor · parameter bytes (+ an fp32 residual per codec)
                + b_i · activation bytes per sample kept for backward

With balanced shares the runtime may leave workers out of a step altogether (a worker
whose samples save less compute than its part in the exchange costs: share 0, it leaves
the exchange, hetrain.api.members); `predict` prices that too: besides the whole set, the
k fastest workers for every k (`perf.exchangeset.fastest_sets`), a set of one exchanging
nothing and a smaller set all-reducing fp32 among its members, and predicts the fastest.

`overhead` (seconds per step the framework adds: the step header, metrics exchange,
Python), `efficiency` (bytes/s reached over the nominal NIC rate) and the codec costs are
*fitted* (`fit`) from measured steps, so the model is the one the runs check
(`plan.job`, bench/plan.py). Cost per sample: the $/hour of the machines a candidate
uses over its samples per hour.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from ..errors import UserError  # dependency-free: perf stays numpy-only
from ..modes import PRICED_MODES, Codec, Mode  # the exchange's vocabulary, dependency-free too
from .comm import MEMCPY_SPEED, byteps_shares, ring_allreduce_time, shm_allreduce_time
from .exchangeset import fastest_sets
from .steptime import predicted_times, solve_shares

SharePolicy = Literal["equal", "balanced"]
CODEC_RATIO: dict[Codec, float] = {c: c.ratio for c in Codec}  # fp32 1, fp16 1/2, int8 1/4, int4 1/8
COMM_MODES: tuple[Mode, ...] = PRICED_MODES
# the runtime's default all-reduce buckets (PyTorch DDP's first_bucket_bytes_cap and
# bucket_cap_mb, comm/buckets.py DDP_CAPS; perf stays free of comm)
FIRST_BUCKET_BYTES = 2**20
BUCKET_BYTES = 25 * 2**20
SHARE_POLICIES: tuple[str, ...] = ("equal", "balanced")


@dataclass(frozen=True)
class JobWorker:
    """One worker process: its compute line, NIC, memory and price."""

    name: str
    per_sample_s: float          # seconds per sample of forward+backward on this device
    bandwidth: float             # NIC bytes/s each way
    fixed_s: float = 0.0         # seconds per step whatever the share (launches, optimizer step)
    memory: float = np.inf       # bytes the device holds
    price_per_hour: float = 0.0


@dataclass(frozen=True)
class JobCluster:
    workers: tuple[JobWorker, ...]
    cpu_bandwidth: tuple[float, ...] = ()     # CPU-only machines' NICs (summation servers)
    cpu_price_per_hour: tuple[float, ...] = ()
    duplex: bool = True            # both directions of a NIC limited (False: uploads only, the in-process limiter)
    partition_bytes: float = 4_096_000  # the runtime's partition size (BytePS default)
    # share of a step's compute after which gradients start to be ready, so an overlapped
    # exchange can run beside it: backward's share (about 2/3) on real devices; all of it
    # on emulated devices of the calibrated model (the slowdown follows the real backward)
    overlap_window: float = 2 / 3
    # the in-process limiter charges a send before it is issued, from the backward hook
    # that posts it: an overlapped all-reduce's bytes are then all paced while backward
    # runs and no last bucket is left after it (a summation server's pull still is: it
    # is sent once the pushes are in); on real links and tc the last bucket goes after
    paced_before_send: bool = False
    # every worker process on one host, links not emulated: their all-reduce goes through
    # shared memory (comm/shm/), bound by memory copies, not by a NIC (`shm_allreduce_time`)
    shared_memory: bool = False
    memcpy_speed: float = MEMCPY_SPEED  # bytes one thread of that host copies per second
    cores: int = 0                      # cores the worker processes share (0: a core each)

    def __post_init__(self) -> None:
        if not self.workers:
            raise UserError("a job needs at least one worker")
        if len(self.cpu_price_per_hour) not in (0, len(self.cpu_bandwidth)):
            raise UserError("give one price per CPU machine, or none")
        bad = any(w.per_sample_s <= 0 or w.bandwidth <= 0 for w in self.workers)
        if bad or any(b <= 0 for b in self.cpu_bandwidth):
            raise UserError("per-sample times and bandwidths must be > 0")


@dataclass(frozen=True)
class JobModel:
    """What the cost model needs of a model (from its layer profile)."""

    name: str
    grad_bytes: float               # dense gradient bytes per step (fp32)
    act_bytes_per_sample: float     # activation bytes kept for backward per sample
    state_factor: float = 3.0       # bytes per parameter byte: weights, gradients, momentum (SGD)
    # fp32 gradient bytes per layer, input side first (the profile's layers; empty: unknown),
    # which says how the all-reduce cuts its buckets (`allreduce_buckets`)
    layer_grad_bytes: tuple[float, ...] = ()


@dataclass(frozen=True)
class Fitted:
    """The model's constants fitted from measured steps (defaults: the ideal machine)."""

    overhead_s: float = 0.0         # seconds per step the framework adds
    efficiency: float = 1.0         # achieved / nominal bandwidth
    codec_s_per_byte: dict[str, float] = field(default_factory=lambda: {c: 0.0 for c in CODEC_RATIO})
    codec_scale: float = 1.0        # measured / nominal codec compute (a loaded host encodes slower)
    # seconds per step overlap adds (a message per tensor, hooks) or, negative, hides of the
    # framework's own per-step work (it runs beside the compute too); never below -overhead_s
    overlap_s: float = 0.0
    partitions: int = 4             # pieces an overlapped exchange is cut into (the last is never hidden)


@dataclass(frozen=True)
class Candidate:
    mode: Mode = Mode.ALLREDUCE
    shares: SharePolicy = "balanced"
    overlap: bool = False
    codec: Codec = Codec.FP32

    def __post_init__(self) -> None:  # the words of a plan file or a bench, parsed once
        object.__setattr__(self, "mode", Mode.parse(self.mode, COMM_MODES))
        object.__setattr__(self, "codec", Codec.parse(self.codec))

    def label(self) -> str:
        return f"{self.mode}/{self.shares}/{'overlap' if self.overlap else 'no-overlap'}/{self.codec}"


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    step_s: float
    global_batch: int
    shares: np.ndarray        # samples per worker
    compute_s: np.ndarray     # per worker
    comm_s: float             # exposed communication + codec
    memory: np.ndarray        # bytes per worker
    fits: bool
    dollars_per_hour: float
    why: str
    parts: dict = field(default_factory=dict)  # nominal terms of the step, what `fit` adjusts
    # what the step runs as where workers sit out (the set's own exchange: an fp32
    # all-reduce among them, or none); None: the candidate itself
    runs_as: Candidate | None = None

    @property
    def ran(self) -> Candidate:
        """The exchange the step's parts describe (what `fit` and `step_time` take)."""
        return self.runs_as or self.candidate

    @property
    def samples_per_s(self) -> float:
        return self.global_batch / self.step_s

    @property
    def dollars_per_million(self) -> float:
        return self.dollars_per_hour / (self.samples_per_s * 3600.0) * 1e6


def _phases(mode: Mode, nbytes: float, n: int, wbw: np.ndarray, cbw: np.ndarray):
    """Bytes each machine sends (up) and receives (down) in the push and the pull phase,
    workers first then CPU machines: ((push_up, push_down), (pull_up, pull_down))."""
    k = len(cbw)
    if mode.worker_servers:  # byteps
        m, c = (f * nbytes for f in byteps_shares(wbw, cbw))
    else:  # ps
        if k == 0:
            raise UserError("a parameter server needs CPU machines")
        m, c = np.zeros(n), np.full(k, nbytes / k)
    push_up = np.concatenate([nbytes - m, np.zeros(k)])
    push_down = np.concatenate([(n - 1) * m, n * c])
    return (push_up, push_down), (push_down, push_up)  # a pull mirrors its push


def comm_time(mode: Mode | str, nbytes: float, worker_bw: np.ndarray, cpu_bw: np.ndarray, duplex: bool = True,
              partitions: int = 1) -> float:
    """Seconds to sum `nbytes` of gradient over the workers in `mode` (nominal rates).

    Ring all-reduce moves 2(n-1)/n·M through every NIC each way. With summation servers
    (BytePS, PS) a partition is pushed, summed, then pulled: with `partitions` pieces in
    flight the NICs carry push and pull at once except for the last piece, so the time
    runs from push + pull (one partition) down to the NIC's total bytes over its rate
    (many; the BytePS paper's t_opt). `duplex`: both directions of a NIC are limited (real
    links, tc in network namespaces); False: only uploads are (the in-process limiter)."""
    mode = Mode.parse(mode, COMM_MODES)
    n = len(worker_bw)
    if n <= 1:
        return 0.0
    if not mode.has_servers:
        return ring_allreduce_time(nbytes, n, float(np.min(worker_bw)))
    bw = np.concatenate([worker_bw, cpu_bw])
    (pu, pd), (qu, qd) = _phases(mode, nbytes, n, worker_bw, cpu_bw)

    def phase(up, down):
        return float(np.max((np.maximum(up, down) if duplex else up) / bw))

    push, pull, total = phase(pu, pd), phase(qu, qd), phase(pu + qu, pd + qd)
    p = max(1, int(partitions))
    return total + (push + pull - total) / p


def exchange_time(mode: Mode, nbytes: float, cluster: JobCluster, partitions: int = 1) -> float:
    """`comm_time` on `cluster`'s NICs, except an all-reduce among processes of one host
    (`JobCluster.shared_memory`), which goes through shared memory: `shm_allreduce_time`."""
    if not mode.has_servers and cluster.shared_memory:
        return shm_allreduce_time(nbytes, len(cluster.workers), cluster.memcpy_speed, cluster.cores)
    wbw = np.array([w.bandwidth for w in cluster.workers], dtype=float)
    return comm_time(mode, nbytes, wbw, np.array(cluster.cpu_bandwidth, dtype=float), cluster.duplex, partitions)


def shares_for(policy: str, global_batch: int, cluster: JobCluster, caps: np.ndarray) -> np.ndarray:
    """Samples per worker: equal (capped by memory, the rest spread evenly) or balanced by
    the step-time model so every worker is predicted to finish together."""
    n = len(cluster.workers)
    if policy == "equal":
        return solve_shares(global_batch, np.zeros(n), np.ones(n), caps)
    if policy == "balanced":
        return solve_shares(global_batch, np.array([w.fixed_s for w in cluster.workers]),
                            np.array([w.per_sample_s for w in cluster.workers]), caps)
    raise UserError(f"unknown share policy {policy!r}; choose one of {SHARE_POLICIES}")


def memory_per_worker(model: JobModel, codec: Codec, shares: np.ndarray) -> np.ndarray:
    residual = model.grad_bytes if codec.lossy else 0.0  # error feedback keeps an fp32 residual
    return model.state_factor * model.grad_bytes + residual + shares * model.act_bytes_per_sample


def _sample_caps(model: JobModel, codec: Codec, cluster: JobCluster, global_batch: int) -> np.ndarray:
    fixed = memory_per_worker(model, codec, np.zeros(len(cluster.workers)))
    per = model.act_bytes_per_sample
    mem = np.array([w.memory for w in cluster.workers], dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        caps = np.where(per > 0, np.floor((mem - fixed) / max(per, 1e-300)), np.where(mem >= fixed, np.inf, -1))
    return np.clip(np.nan_to_num(caps, posinf=global_batch), 0, global_batch).astype(np.int64)


def predict(cand: Candidate, model: JobModel, cluster: JobCluster, global_batch: int,
            fitted: Fitted = Fitted(), every_worker: bool = False) -> Prediction:
    """Step time, memory per worker and cost of one candidate: with balanced shares, of the
    fastest set of workers the runtime would train on (`_fewer`), unless `every_worker`
    (a run in which every worker took part, e.g. a short profiling round)."""
    whole = _predict_set(cand, model, cluster, global_batch, fitted)
    if every_worker or cand.shares != "balanced" or not whole.fits or len(cluster.workers) < 2:
        return whole
    return _fewer(whole, cand, model, cluster, global_batch, fitted)


def _fewer(whole: Prediction, cand: Candidate, model: JobModel, cluster: JobCluster, global_batch: int,
           fitted: Fitted) -> Prediction:
    """`whole`, or the k fastest workers alone where they are predicted faster: the others
    sit out at share 0 and leave the exchange (a set of one exchanges nothing; a smaller set
    all-reduces fp32 among its members, whatever the job's mode). The machines left out are
    still paid for, and their memory is what they hold without a batch."""
    workers = cluster.workers
    caps = _sample_caps(model, cand.codec, cluster, global_batch)
    best = whole
    for mask in fastest_sets(global_batch, [w.fixed_s for w in workers], [w.per_sample_s for w in workers], caps):
        idx = np.flatnonzero(mask)
        sub = replace(cluster, workers=tuple(workers[i] for i in idx))
        # the runtime's subgroup engine all-reduces from backward's hooks; one worker alone moves nothing
        sub_cand = replace(cand, mode=Mode.ALLREDUCE, codec=Codec.FP32, overlap=len(idx) > 1)
        p = _predict_set(sub_cand, model, sub, global_batch, fitted)
        if not p.fits or p.step_s >= best.step_s:
            continue
        shares = np.zeros(len(workers), dtype=np.int64)
        shares[idx] = p.shares
        compute = np.zeros(len(workers))
        compute[idx] = p.compute_s
        out = ", ".join(workers[i].name for i in range(len(workers)) if not mask[i])
        why = (f"{out} sit{'s' if len(workers) - len(idx) == 1 else ''} out (exchanging with "
               f"{'them' if len(workers) - len(idx) > 1 else 'it'} costs more than the compute saved); {p.why}")
        best = replace(p, candidate=cand, shares=shares, compute_s=compute,
                       memory=memory_per_worker(model, cand.codec, shares), dollars_per_hour=whole.dollars_per_hour,
                       why=why, parts={**p.parts, "workers": int(len(idx))}, runs_as=sub_cand)
    return best


def _predict_set(cand: Candidate, model: JobModel, cluster: JobCluster, global_batch: int,
                 fitted: Fitted) -> Prediction:
    """`predict` with every worker of `cluster` in the step."""
    n = len(cluster.workers)
    wbw = np.array([w.bandwidth for w in cluster.workers], dtype=float)
    cbw = np.array(cluster.cpu_bandwidth, dtype=float)
    caps = _sample_caps(model, cand.codec, cluster, global_batch)
    why = []
    fits = int(caps.sum()) >= global_batch
    if fits:
        shares = shares_for(cand.shares, global_batch, cluster, caps)
    else:  # report what the batch would need on equal shares
        shares = np.full(n, global_batch // n) + (np.arange(n) < global_batch % n)
        why.append(f"does not fit: the workers hold {int(caps.sum())} of {global_batch} samples")
    memory = memory_per_worker(model, cand.codec, shares)
    mem_cap = np.array([w.memory for w in cluster.workers], dtype=float)
    if fits and np.any(memory > mem_cap):
        fits = False
        why.append("does not fit: model state exceeds a device's memory")
    compute = np.where(shares > 0, predicted_times(shares, [w.fixed_s for w in cluster.workers],
                                                   [w.per_sample_s for w in cluster.workers]), 0.0)
    nbytes = model.grad_bytes * cand.codec.ratio
    pieces = int(np.ceil(nbytes / cluster.partition_bytes))
    tail = 0.0 if not cand.mode.has_servers and cluster.paced_before_send else 1.0
    parts = {"compute": float(compute.max()), "window": cluster.overlap_window, "tail": tail,
             "buckets": allreduce_buckets(model) if not cand.mode.has_servers else 0,
             "comm": exchange_time(cand.mode, nbytes, cluster, pieces) if n > 1 else 0.0,
             "codec": codec_work(cand, model, wbw, cbw) * fitted.codec_s_per_byte.get(cand.codec, 0.0)}
    step, exposed = step_time(parts, cand, fitted)
    slowest = parts["compute"]
    price = sum(w.price_per_hour for w in cluster.workers)
    if cand.mode.cpu_servers:
        price += sum(cluster.cpu_price_per_hour)
    why.append(f"compute {slowest * 1e3:.1f} ms (slowest worker), exchange {exposed * 1e3:.1f} ms"
               + (" after overlap" if cand.overlap else ""))
    return Prediction(cand, step, global_batch, shares, compute, exposed, memory, fits, price, "; ".join(why), parts)


def allreduce_buckets(model: JobModel, first: float = FIRST_BUCKET_BYTES, cap: float = BUCKET_BYTES) -> int:
    """How many buckets the runtime's all-reduce cuts the gradients into (comm/partition.py
    `plan_buckets` at the profile's layer granularity: walked from the output side, a bucket
    closes at a whole layer once it holds `first` bytes (the first one) or `cap`; a layer
    over `cap` is cut into `cap`-sized pieces). Why it matters: a layout of one bucket can
    start only once backward made its last gradient, so overlap hides none of it (the
    runtime then sends it at step()); without layer sizes, one bucket where the whole
    gradient fits the first cap."""
    if not model.layer_grad_bytes:
        return 1 if model.grad_bytes <= first else 2
    count, held, limit = 0, 0.0, first
    for nbytes in reversed(model.layer_grad_bytes):
        if nbytes > cap:
            count += (held > 0) + int(np.ceil(nbytes / cap))
            held, limit = 0.0, cap
            continue
        held += nbytes
        if held >= limit:
            count, held, limit = count + 1, 0.0, cap
    return max(1, count + (held > 0))


def codec_work(cand: Candidate, model: JobModel, wbw: np.ndarray, cbw: np.ndarray) -> float:
    """fp32 bytes encoded and decoded on a step's critical path: a worker's own gradient
    (encode, then decode the sum), then the busiest server's share, which it decodes from
    each of the n workers and encodes once: about (n+1)/2 encode+decode passes."""
    n = len(wbw)
    if not cand.codec.lossy or n <= 1 or not cand.mode.has_servers:
        return 0.0
    if not cand.mode.worker_servers:  # ps
        server = model.grad_bytes / len(cbw)
    else:
        gpu, cpu = byteps_shares(wbw, cbw)
        server = model.grad_bytes * float(max(gpu.max(), cpu.max() if len(cbw) else 0.0))
    return model.grad_bytes + (n + 1) / 2 * server


def step_time(parts: dict, cand: Candidate, fitted: Fitted) -> tuple[float, float]:
    """(step seconds, exposed exchange seconds) from a candidate's nominal parts."""
    exposed = parts["comm"] / fitted.efficiency + parts["codec"] * fitted.codec_scale
    if cand.overlap and exposed > 0 and parts.get("buckets", 2) != 1:
        last = parts.get("tail", 1.0) * exposed / max(1, fitted.partitions)
        exposed = max(exposed - parts["window"] * parts["compute"], last)
    return parts["compute"] + exposed + fitted.overhead_s + (fitted.overlap_s if cand.overlap else 0.0), exposed


def candidates(cluster: JobCluster, codecs=tuple(CODEC_RATIO), modes=COMM_MODES,
               policies=SHARE_POLICIES, overlaps=(False, True)) -> list[Candidate]:
    """Every candidate the runtime can run on the cluster: BytePS and PS need CPU machines;
    codecs need summation servers to decode (all-reduce sums fp32 only); all-reduce always
    overlaps (the runtime all-reduces each bucket from backward's hooks, as DDP does)."""
    modes = [Mode.parse(m, COMM_MODES) for m in modes]
    codecs = [Codec.parse(c) for c in codecs]
    usable = [m for m in modes if not m.cpu_servers or cluster.cpu_bandwidth]
    return [Candidate(m, s, o, c) for m in usable for s in policies for o in overlaps for c in codecs
            if m.has_servers or (not c.lossy and o)]


def rank(preds: list[Prediction], target: float | None = None, budget: float | None = None) -> list[Prediction]:
    """Best first. Plans that fit come first; then, with a throughput `target`, the ones that
    reach it, cheapest per sample first; with a `budget` ($/hour), the ones within it,
    fastest first; without either, fastest first. Ties: fewer bytes, simpler knobs."""
    def key(p: Prediction):
        simple = (p.candidate.overlap, p.candidate.codec.lossy, p.candidate.shares != "equal")
        if target is not None:
            ok = p.samples_per_s >= target
            return (not p.fits, not ok, p.dollars_per_million if ok else -p.samples_per_s, simple)
        if budget is not None:
            ok = p.dollars_per_hour <= budget
            return (not p.fits, not ok, -p.samples_per_s if ok else p.dollars_per_hour, simple)
        return (not p.fits, -round(p.samples_per_s, 9), simple)
    return sorted(preds, key=key)


def fit(observations: list[tuple[Prediction, float]], base: Fitted = Fitted()) -> Fitted:
    """Fit the model's constants to measured step times, in three steps whose terms add up:

    1. `overhead_s` and `efficiency`: least squares of measured − compute ≈ overhead +
       comm/efficiency over runs without overlap and codec (with one such run, or an
       efficiency above 1, only the overhead);
    2. `codec_scale`: the median of (measured − the fp32 terms) / nominal codec time over
       codec runs without overlap;
    3. `overlap_s`: the median of measured − predicted over overlapped runs (negative
       where overlap also hides part of the per-step overhead; at least −overhead_s).
    Without a run free of overlap (an all-reduce job always overlaps) the overhead is fitted
    on the overlapped fp32 runs instead, and overlap adds nothing of its own.
    Each prediction is one made with `predict` (any constants: the nominal parts are used),
    for the set of workers the measured run trained on (`Prediction.ran`)."""
    fitted = _fit_overhead(observations, base)
    coded = [(p, m) for p, m in observations if not p.ran.overlap and p.parts["codec"] > 0]
    if coded:
        scale = [(m - step_time({**p.parts, "codec": 0.0}, p.ran, fitted)[0]) / p.parts["codec"]
                 for p, m in coded]
        fitted = replace(fitted, codec_scale=max(0.0, float(np.median(scale))))
    lapped = [(p, m) for p, m in observations if p.ran.overlap]
    if lapped:
        extra = [m - step_time(p.parts, p.ran, replace(fitted, overlap_s=0.0))[0] for p, m in lapped]
        fitted = replace(fitted, overlap_s=max(-fitted.overhead_s, float(np.median(extra))))
    return fitted


def _fit_overhead(observations: list[tuple[Prediction, float]], base: Fitted) -> Fitted:
    """Step 1 of `fit`: overhead (and, with two or more plain runs, efficiency)."""
    plain = [(p, m) for p, m in observations if not p.ran.overlap and not p.ran.codec.lossy]
    if not plain:
        lapped = [(p, m) for p, m in observations if p.ran.overlap and not p.ran.codec.lossy]
        if not lapped:
            raise UserError("fitting the cost model needs at least one measured run without a codec")
        zero = replace(base, overhead_s=0.0, overlap_s=0.0)
        rest = [m - step_time(p.parts, p.ran, zero)[0] for p, m in lapped]
        return replace(base, overhead_s=max(0.0, float(np.median(rest))))
    a = np.array([(1.0, p.parts["comm"]) for p, _ in plain])
    y = np.array([m - p.parts["compute"] for p, m in plain])
    fitted = replace(base, overhead_s=max(0.0, float(np.median(y - a[:, 1] / base.efficiency))))
    if len(plain) >= 2 and np.ptp(a[:, 1]) > 1e-9:
        (over, inv_eff), *_ = np.linalg.lstsq(a, y, rcond=None)
        if inv_eff >= 1.0 and over >= 0:
            fitted = replace(base, overhead_s=float(over), efficiency=float(1.0 / inv_eff))
    return fitted
