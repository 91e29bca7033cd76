"""The single partitioner: cut the flat gradient into partitions and give each to a
summation server so that bytes per server follow the target shares exactly.

The flat buffer is walked in priority order (tensors nearest the input first) in
rounds; in each round every server gets one contiguous slice whose length follows
its share. Server j's slices over R rounds sum to exactly its target T_j because
round r gives floor((r+1)·T_j/R) - floor(r·T_j/R) elements. Interleaving servers
inside each round keeps every NIC busy from the first partition on, which a
contiguous per-server split (server 0 gets all early layers) would not.

Rounds ramp up and down in size (1/8, 1/4, 1/2 of a full round at each end). A
server can return a sum only once the partition has arrived whole from every
worker, so its uplink idles for one partition's push at the start of a step and its
downlink for one partition's pull at the end; small first and last partitions
shrink both (on the n=4, k=2 benchmark the CPU servers' uplinks started 60-85 ms
into a 190 ms transfer with full-size first partitions).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
    """Partitions of a flat buffer of `numel` elements for servers with `shares`.

    The largest slice in a round is about `partition_elems`; smaller-share servers
    get proportionally smaller slices.
    """
    shares = np.asarray(shares, dtype=float)
    if numel <= 0:
        return []
    if shares.ndim != 1 or len(shares) == 0 or np.any(shares < 0) or shares.sum() <= 0:
        raise ValueError(f"need non-negative server shares with a positive sum, got {shares}")
    if partition_elems < 1:
        raise ValueError("partition_elems must be >= 1")
    targets = largest_remainder(numel, shares)
    per_round = partition_elems / (shares.max() / shares.sum())
    weights = round_weights(numel / per_round, ramp)
    cum = np.concatenate([[0], np.cumsum(weights)]).astype(np.int64)
    parts: list[Partition] = []
    offset = 0
    active = np.nonzero(targets)[0]
    for r in range(len(weights)):
        for j in active:
            t = int(targets[j])
            length = cum[r + 1] * t // cum[-1] - cum[r] * t // cum[-1]
            if length:
                parts.append(Partition(len(parts), int(j), offset, int(length)))
                offset += int(length)
    assert offset == numel
    return parts


def round_weights(full_rounds: float, ramp: int = 3) -> list[int]:
    """Relative sizes of the rounds: a doubling ramp of `ramp` steps up to full size,
    full rounds, and the mirror ramp down; fewer ramp steps when the buffer is small.
    The result is in units of 1/2**ramp of a full round."""
    while ramp > 0:
        full = 1 << ramp
        units = int(np.ceil(full_rounds * full))
        edge = full - 1  # 1 + 2 + ... + full/2 units in each ramp
        if units >= 2 * edge + full:
            up = [1 << i for i in range(ramp)]
            middle = int(np.ceil((units - 2 * edge) / full))
            return up + [full] * middle + up[::-1]
        ramp -= 1
    return [1] * max(1, int(np.ceil(full_rounds)))


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


def lanes_for(shares: np.ndarray, max_lanes: int = 8) -> list[int]:
    """Parallel connections per server, proportional to its share (at least 1)."""
    shares = np.asarray(shares, dtype=float)
    smallest = shares[shares > 0].min()
    return [int(min(max_lanes, max(1, round(s / smallest)))) if s > 0 else 1 for s in shares]


def bytes_per_server(parts: list[Partition], num_servers: int, itemsize: int = 4) -> np.ndarray:
    out = np.zeros(num_servers, dtype=np.int64)
    for p in parts:
        out[p.server] += p.length * itemsize
    return out
