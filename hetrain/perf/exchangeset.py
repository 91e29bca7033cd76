"""Which workers take part in a data-parallel step once the gradient exchange is priced.

The share solver (`hetrain.perf.steptime`) finds the split that ends the *compute*
soonest. A worker in the step also takes part in the gradient exchange, which costs
every step a collective; a worker with no samples leaves it (hetrain.api.members), and a
set of one worker exchanges nothing. So a set of workers is priced as

    price(S) = compute(S) + exchange(S),   exchange(S) = 0 for one worker,

and the best of a few candidate sets is taken: the compute-optimal split's own set, and
the k fastest workers alone for every k (fastest: the least time for the whole batch
alone), so the best subset of devices (a GPU alone beside CPU workers) is always a
candidate and a job is never predicted slower than it.

`exchange(S)` comes from what the workers measure: each reports the seconds its step
spent beyond its compute while it exchanged with others (the exposed exchange and the
wait for the others: `comm_s + wait_s`), apart for the two kinds of exchange a set can
have (`whole`: every worker in, the job's own engine; `part`: a set short of the job,
which all-reduces among its members), and never a set's first exchange (it makes the
set's group, announces the layout, connects to the servers: hundreds of milliseconds
that no later step pays). All workers of a step end it together (the exchange's last
sum), so the worker that reached the exchange last waited least: the least number its
members report is the step's exchange alone. Each worker's price of a kind is the
median of that over its recent steps of the kind (train/exchange_price.py), and a set's
exchange is the least price among its members (a member not measured yet takes the
least measured over all workers).

The kinds differ most with summation servers (byteps, ps): every worker in, the
exchange is the servers' path, and each worker's push and pull overlap the others' on
the servers, so it costs about one worker's, however many take part (the BytePS model,
`perf.comm`: a worker's NIC carries its gradient each way whatever n): a worker joining
the whole job adds its samples and next to no exchange beyond that path. A set short
of the job all-reduces among its members instead, priced by its own measurements; until
one is measured, by the cost model's all-reduce where its workers share a host (the
shared-memory all-reduce, `perf.comm.shm_allreduce_time`: a set is tried and measured
where the model says it is cheaper), else at the whole job's exchange (between hosts
the model's NIC rates are not what the runtime reaches). So the slowest worker leaves
where the servers' path costs more than its samples' compute saves over the others'
all-reduce, and the fastest worker alone (no exchange) is always weighed. Nothing
measured: 0, and sets are chosen on compute alone. A set's exchange is taken as that
of its members measured in whatever set of its kind they were in: a model, exact for
the sets seen, which is what the probes (train/probe.py) refresh.

numpy-only, as all of perf.
"""
from __future__ import annotations

import math

import numpy as np


def _least(seconds, members) -> float:
    """The least measured number among `members` (bool per worker), else over every
    worker; NaN where none is measured."""
    c = np.asarray(seconds, dtype=float).ravel().tolist()
    good = [math.isfinite(x) and x > 0 for x in c]
    mine = [x for x, g, k in zip(c, good, members) if g and k]
    known = mine or [x for x, g in zip(c, good) if g]
    return min(known) if known else math.nan


def exchange_cost(members, comm, part=None, short=None) -> float:
    """Predicted seconds the exchange among `members` (bool per worker) adds to a step,
    from every worker's measured exchange seconds with every worker in (`comm`) and in
    sets short of the job (`part`; NaN: not measured; None: the same numbers as `comm`).
    A set short of the job not measured yet takes `short(k)`, the modelled all-reduce of
    its k workers where they share a host (`perf.comm.shm_allreduce_time`), else the whole
    job's exchange; the whole job one measured in sets short of it where it was never
    measured itself."""
    m = [bool(x) for x in np.asarray(members).ravel().tolist()]
    if sum(m) <= 1:
        return 0.0
    part = comm if part is None else part
    t = _least(comm if all(m) else part, m)
    if math.isfinite(t):
        return t
    if not all(m) and short is not None:
        return float(short(sum(m)))
    t = _least(part if all(m) else comm, m)
    return t if math.isfinite(t) else 0.0


def _known(*arrays) -> list[float]:
    return [x for a in arrays for x in np.asarray(a, dtype=float).ravel().tolist() if math.isfinite(x) and x > 0]


def priced(comm, part=()) -> bool:
    """Whether any worker measured an exchange (else sets are chosen on compute alone)."""
    return bool(_known(comm, part))


def solo_times(batch: int, fixed, per_sample) -> list[float]:
    """Each worker's predicted time for the whole `batch` alone (inf where not measured)."""
    f = np.asarray(fixed, dtype=float).ravel().tolist()
    p = np.asarray(per_sample, dtype=float).ravel().tolist()
    return [fi + pi * batch if (math.isfinite(fi) and math.isfinite(pi) and pi > 0) else math.inf
            for fi, pi in zip(f, p)]


def fastest_sets(batch: int, fixed, per_sample, caps) -> list[np.ndarray]:
    """Candidate sets besides the compute-optimal split's: the k fastest workers for k =
    1 .. n-1 (by `solo_times`, ties by rank), each only where its members' caps hold the
    batch. Bool masks, smallest set first."""
    solo = solo_times(batch, fixed, per_sample)
    c = np.asarray(caps, dtype=np.int64).ravel()
    order = sorted(range(len(solo)), key=lambda i: (solo[i], i))
    out = []
    for k in range(1, len(solo)):
        m = np.zeros(len(solo), dtype=bool)
        m[order[:k]] = True
        if int(np.minimum(c[m], batch).sum()) >= batch and math.isfinite(solo[order[k - 1]]):
            out.append(m)
    return out


def price_floor(batch: int, fixed, per_sample, caps, comm, compute_floor: float, part=()) -> float:
    """A price no split of `batch` beats: a set of several workers computes no sooner than
    `compute_floor` (every worker's water level, `step_floor`) and exchanges for at least
    the least measured exchange (`comm` or `part`); a worker alone takes its solo time
    (where its cap holds the batch). Lets the balancer keep a split within `hold` of it
    without solving."""
    c = np.asarray(caps, dtype=np.int64).ravel().tolist()
    solo = [t for t, cap in zip(solo_times(batch, fixed, per_sample), c) if cap >= batch]
    known = _known(comm, part)
    several = compute_floor + (min(known) if known else 0.0)
    return min([several, *solo])
