"""The single partitioner: cut the flat gradient into partitions and give each to a
summation server so that bytes per server follow the target shares exactly.

Every server gets partitions of about `partition_bytes` (a server with a bigger share
gets more partitions, not bigger ones: a partition a third the size costs the same
per-message work; in exploratory runs of bench/comm.py's k=1 and k=2 cases equal sizes
were 3-6% faster).
Server j's sizes add up to exactly its target T_j. The partitions of all servers are
interleaved by how far each is through its own target, so the flat buffer, walked in
priority order (tensors nearest the input first), feeds every server at the rate of
its share and keeps every NIC busy from the first partition on, which a contiguous
per-server split (server 0 gets all early layers) would not.

Each server's sizes ramp up and down (1/8, 1/4, 1/2 of a full partition at each end).
A server can return a sum only once the partition has arrived whole from every
worker, so its downlink idles for one partition's pull at the end of a step; small
last partitions shrink that drain.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..runtime.topology import lanes_for  # noqa: F401  (the lane count is the topology's)


@dataclass(frozen=True)
class Partition:
    pid: int  # also the priority: lower goes first
    server: int  # server index (not rank)
    start: int  # element offset in the flat buffer
    length: int  # elements
    lane: int = 0  # which parallel connection to the server carries it


def largest_remainder(total: int, shares: np.ndarray) -> np.ndarray:
    """Integers proportional to shares that add up to total exactly."""
    shares = np.asarray(shares, dtype=float)
    raw = shares / shares.sum() * total
    out = np.floor(raw).astype(np.int64)
    short = total - int(out.sum())
    if short:
        order = np.argsort(-(raw - out), kind="stable")
        out[order[:short]] += 1
    return out


def plan_partitions(numel: int, shares: np.ndarray, partition_elems: int, ramp: int = 3) -> list[Partition]:
    """Partitions of a flat buffer of `numel` elements for servers with `shares`;
    none is longer than `partition_elems`."""
    shares = np.asarray(shares, dtype=float)
    if numel <= 0:
        return []
    if shares.ndim != 1 or len(shares) == 0 or np.any(shares < 0) or shares.sum() <= 0:
        raise ValueError(f"need non-negative server shares with a positive sum, got {shares}")
    if partition_elems < 1:
        raise ValueError("partition_elems must be >= 1")
    targets = largest_remainder(numel, shares)
    pieces = []  # (progress through the server's target at the piece's middle, server, length)
    for j in np.nonzero(targets)[0]:
        t = int(targets[j])
        done = 0
        for size in ramped_sizes(t, partition_elems, ramp):
            pieces.append(((done + size / 2) / t, int(j), size))
            done += size
    pieces.sort()
    parts: list[Partition] = []
    offset = 0
    for _, j, length in pieces:
        parts.append(Partition(len(parts), j, offset, length))
        offset += length
    assert offset == numel
    return parts


def ramped_sizes(total: int, full: int, ramp: int = 3) -> list[int]:
    """One server's partition sizes: doubling up to `full`, full ones, the mirror ramp
    down; they add up to `total` exactly and none exceeds `full`. Without room for the
    ramps, equal pieces of at most `full`."""
    up = [max(1, full >> (ramp - i)) for i in range(ramp)]
    if total < 2 * sum(up) + full:
        n = max(1, -(-total // full))
        return [(total * (i + 1)) // n - (total * i) // n for i in range(n)]
    middle = total - 2 * sum(up)
    n = -(-middle // full)
    return up + [(middle * (i + 1)) // n - (middle * i) // n for i in range(n)] + up[::-1]


def split_lanes(parts: list[Partition], lanes: list[int]) -> list[Partition]:
    """Cut each partition of server j into lanes[j] pieces, one per parallel connection.

    TCP shares a NIC equally per connection, but the BytePS optimum gives a CPU server
    several times the bytes of a co-located one. With lanes ∝ share, every connection
    carries about the same bytes, so fair sharing yields the optimal rates.
    """
    out: list[Partition] = []
    for p in parts:
        k = max(1, min(lanes[p.server], p.length))
        bounds = [p.start + (p.length * i) // k for i in range(k + 1)]
        for lane in range(k):
            out.append(Partition(len(out), p.server, bounds[lane], bounds[lane + 1] - bounds[lane], lane))
    return out


def plan_for(shares, numel: int, partition_bytes: int, max_lanes: int = 1) -> list[Partition]:
    """The partition plan every rank derives from the same flat size and server shares
    (fp32 elements of about `partition_bytes`, cut across lanes when there are several)."""
    shares = np.asarray(shares, dtype=float)
    elems = max(1, partition_bytes // 4)
    return split_lanes(plan_partitions(numel, shares, elems), lanes_for(shares, max_lanes))


def bytes_per_server(parts: list[Partition], num_servers: int, itemsize: int = 4) -> np.ndarray:
    out = np.zeros(num_servers, dtype=np.int64)
    for p in parts:
        out[p.server] += p.length * itemsize
    return out


def plan_buckets(numels, first_elems: int, cap_elems: int) -> list[Partition]:
    """All-reduce buckets of a model whose tensors have `numels` elements (manifest order:
    input side first), as PyTorch DDP's reducer cuts them (torch/csrc/distributed/c10d/
    reducer.cpp, compute_bucket_assignment_by_size): tensors are walked in the order
    backward makes their gradients (the reverse of the manifest), a bucket closes at whole
    tensors once it holds `first_elems` (the first bucket: small, so the first all-reduce
    starts early in backward) or `cap_elems` (every later one). Unlike DDP, a tensor larger
    than the cap is cut into cap-sized pieces, so no bucket is larger than the cap and a
    huge embedding does not wait whole.

    A function of the tensors' sizes and the two caps only, never of the local device, so
    every worker of a job derives the same buckets. Partitions are returned in flat order
    (pid = position in the buffer); backward order is the reverse."""
    pieces: list[tuple[int, int]] = []  # (start, length), walked from the end
    bounds = np.concatenate([[0], np.cumsum(np.asarray(list(numels), dtype=np.int64))])
    cap = max(1, int(first_elems))
    open_start = open_end = int(bounds[-1])
    for i in range(len(bounds) - 2, -1, -1):
        a, b = int(bounds[i]), int(bounds[i + 1])
        if b - a > cap_elems:  # too big for any bucket: close the open one, cut this tensor
            if open_end > open_start:
                pieces.append((open_start, open_end - open_start))
                cap = max(1, int(cap_elems))
            for hi in range(b, a, -cap_elems):
                lo = max(a, hi - cap_elems)
                pieces.append((lo, hi - lo))
            open_start = open_end = a
            continue
        open_start = a
        if open_end - open_start >= cap:
            pieces.append((open_start, open_end - open_start))
            open_end = open_start
            cap = max(1, int(cap_elems))
    if open_end > open_start:
        pieces.append((open_start, open_end - open_start))
    pieces.reverse()
    return [Partition(pid, 0, start, length) for pid, (start, length) in enumerate(pieces) if length > 0]
