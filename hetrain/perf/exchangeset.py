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

`exchange(S)` comes from what the workers measure: each reports the seconds its steps
spent beyond its compute while it exchanged with others (the exposed exchange and the
wait for the others: `comm_s + wait_s`), as a median over its recent such steps. All
workers of a step end it together (the exchange's last sum), so the worker that computed
longest waited least: its number is the step's exchange alone, and `exchange(S)` is the
least number among S's members (a member not measured yet takes the least measured over
all workers; none measured: 0, and sets are chosen on compute alone). A set's exchange
is taken as that of its members measured in whatever set they were in: a model, exact
for the sets seen, which is what the probes (train/probe.py) refresh.

numpy-only, as all of perf.
"""
from __future__ import annotations

import math

import numpy as np


def exchange_cost(members, comm) -> float:
    """Predicted seconds the exchange among `members` (bool per worker) adds to a step,
    from every worker's measured exchange seconds `comm` (NaN: not measured)."""
    m = [bool(x) for x in np.asarray(members).ravel().tolist()]
    if sum(m) <= 1:
        return 0.0
    c = np.asarray(comm, dtype=float).ravel().tolist()
    good = [math.isfinite(x) and x > 0 for x in c]
    mine = [x for x, g, k in zip(c, good, m) if g and k]
    if mine:
        return min(mine)
    known = [x for x, g in zip(c, good) if g]
    return min(known) if known else 0.0


def priced(comm) -> bool:
    """Whether any worker measured its exchange (else sets are chosen on compute alone)."""
    return any(math.isfinite(x) and x > 0 for x in np.asarray(comm, dtype=float).ravel().tolist())


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


def price_floor(batch: int, fixed, per_sample, caps, comm, compute_floor: float) -> float:
    """A price no split of `batch` beats: a set of several workers computes no sooner than
    `compute_floor` (every worker's water level, `step_floor`) and exchanges for at least
    the least measured `comm`; a worker alone takes its solo time (where its cap holds the
    batch). Lets the balancer keep a split within `hold` of it without solving."""
    c = np.asarray(caps, dtype=np.int64).ravel().tolist()
    solo = [t for t, cap in zip(solo_times(batch, fixed, per_sample), c) if cap >= batch]
    known = [x for x in np.asarray(comm, dtype=float).ravel().tolist() if math.isfinite(x) and x > 0]
    several = compute_floor + (min(known) if known else 0.0)
    return min([several, *solo])
