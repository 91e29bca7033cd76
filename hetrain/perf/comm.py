"""Communication times of the BytePS family (all-reduce and PS are special cases).

Notation follows the BytePS paper: n worker machines, k CPU-only machines, M bytes of
gradient, B bytes/s per NIC in each direction. Every function is numpy/scipy only so
the planner, scheduler and simulator can call it without torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import UserError  # dependency-free: perf stays numpy-only
from ..quiet import quiet_stdout  # likewise: HiGHS's C-level prints kept off stdout


def ring_allreduce_time(nbytes: float, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """Bandwidth-optimal ring all-reduce: each NIC moves 2(n-1)/n · M."""
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / bandwidth + 2.0 * (n - 1) * latency


# The shared-memory all-reduce of processes on one host (hetrain/comm/shm/: a
# reduce-scatter and an all-gather over segments every member maps) moves no byte over a
# NIC: it is bound by memory copies. The engine keeps host buckets in the shared segments
# (comm/shm/arena.py), so per process the all-reduce reads and writes
# SHM_BYTES_PER_BYTE · N + SHM_BYTES_PER_SLICE · N/n bytes for an N-byte bucket among n
# processes: it reads N and writes N/n to sum its slice of every segment, and reads and
# writes (n-1)N/n to push the sum into the others' segments: 3N - N/n (bench/colocated.py's
# memcpy_bound). Buffers it did not allocate are copied in and out (5N + N/n).
SHM_BYTES_PER_BYTE = 3.0
SHM_BYTES_PER_SLICE = -1.0
# bytes one thread copies per second where the host's was not measured (this development
# host: about 11 GB/s; `memcpy_speed` measures it)
MEMCPY_SPEED = 10e9


def shm_allreduce_time(nbytes: float, n: int, memcpy_speed: float = MEMCPY_SPEED, cores: int = 0) -> float:
    """Seconds of the shared-memory all-reduce of `nbytes` among `n` processes of one
    host: the bytes each reads and writes (`SHM_BYTES_PER_BYTE` · N + `SHM_BYTES_PER_SLICE`
    · N/n) at the
    memcpy speed (a copy of B bytes reads and writes 2B), the processes sharing `cores`
    where they outnumber them (0: a core each)."""
    if n <= 1:
        return 0.0
    if memcpy_speed <= 0:
        raise UserError(f"the memcpy speed must be > 0 bytes/s, got {memcpy_speed}")
    crowd = n / min(n, cores) if cores > 0 else 1.0
    return (SHM_BYTES_PER_BYTE + SHM_BYTES_PER_SLICE / n) * nbytes / (2.0 * memcpy_speed) * crowd


def memcpy_speed(nbytes: int = 64 * 2**20, repeats: int = 3) -> float:
    """Bytes one thread of this host copies per second (the median of `repeats` copies of
    `nbytes`, after one that touches the pages)."""
    import time

    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return float(nbytes / max(float(np.median(times)), 1e-9))


def byteps_split(n: int, k: int, nbytes: float = 1.0) -> tuple[float, float]:
    """Optimal bytes held by each CPU server and each co-located server: (M_cpu, M_gpu).

    For k <= n: M_cpu = 2(n-1)M/(n²+kn-2k), M_gpu = (n-k)M/(n²+kn-2k).
    For k > n only CPU servers are used (M_gpu = 0, M_cpu = M/k).
    """
    if n < 1 or k < 0:
        raise UserError(f"need n >= 1 worker machines and k >= 0 CPU machines, got n={n}, k={k}")
    if k > n:
        return nbytes / k, 0.0
    if n == 1:  # one worker machine: summing stays local, nothing crosses a NIC
        return 0.0, nbytes
    den = n * n + k * n - 2 * k
    return 2.0 * (n - 1) * nbytes / den, (n - k) * nbytes / den


def byteps_time(nbytes: float, n: int, k: int, bandwidth: float) -> float:
    """t_opt: the proven-optimal push_pull time; k=0 is ring all-reduce, k=n is PS."""
    if n <= 1:
        return 0.0
    if k >= n:
        return nbytes / bandwidth
    return 2.0 * n * (n - 1) * nbytes / ((n * n + k * n - 2 * k) * bandwidth)


def byteps_speedup_over_allreduce(n: int, k: int) -> float:
    """1 + k(n-2)/n² for k <= n (the paper's headline ratio)."""
    k = min(k, n)
    return 1.0 + k * (n - 2) / (n * n)


def ps_time(nbytes: float, n: int, k: int, bandwidth: float) -> float:
    """Plain PS on k CPU servers: a server NIC carries n·M/k, a worker NIC carries M."""
    if k < 1:
        raise UserError("a parameter server needs at least one CPU machine (k >= 1)")
    return max(nbytes, n * nbytes / k) / bandwidth


@dataclass(frozen=True)
class SplitPlan:
    """Bytes per server (co-located servers first, in worker order, then CPU servers)."""

    gpu_bytes: np.ndarray
    cpu_bytes: np.ndarray
    time_s: float

    @property
    def shares(self) -> np.ndarray:
        total = self.gpu_bytes.sum() + self.cpu_bytes.sum()
        return np.concatenate([self.gpu_bytes, self.cpu_bytes]) / total


def optimal_split(nbytes: float, worker_bw: np.ndarray, cpu_bw: np.ndarray) -> SplitPlan:
    """Bytes per server minimising the slowest NIC, for per-machine bandwidths.

    Generalises `byteps_split` (equal bandwidths) to uneven NICs as a small LP:
    worker machine i moves M + (n-2)·m_i bytes each way, CPU machine j moves n·m_j;
    minimise T with every machine's bytes/bandwidth <= T and Σ m = M. Solved with
    SciPy's HiGHS; for equal bandwidths it reproduces the closed form (tested).
    """
    from scipy.optimize import linprog

    worker_bw = np.asarray(worker_bw, dtype=float)
    cpu_bw = np.asarray(cpu_bw, dtype=float)
    n, k = len(worker_bw), len(cpu_bw)
    if n < 1:
        raise UserError("need at least one worker machine")
    if np.any(worker_bw <= 0) or np.any(cpu_bw <= 0):
        raise UserError("bandwidths must be positive")
    if n == 1:
        return SplitPlan(np.array([float(nbytes)]), np.zeros(k), 0.0)
    # Solve in units of the fastest NIC: raw bytes/s (1e9 and up) give coefficients
    # below HiGHS's small-value threshold, which it drops, returning a degenerate split.
    scale = float(max(worker_bw.max(), cpu_bw.max() if k else 0.0))
    worker_bw, cpu_bw = worker_bw / scale, cpu_bw / scale
    # variables: m_0..m_{n-1}, c_0..c_{k-1}, T   (in units of M, so the LP is well scaled)
    nv = n + k + 1
    cost = np.zeros(nv)
    cost[-1] = 1.0
    a_ub, b_ub = [], []
    for i in range(n):
        row = np.zeros(nv)
        row[i] = (n - 2) / worker_bw[i]
        row[-1] = -1.0
        a_ub.append(row)
        b_ub.append(-1.0 / worker_bw[i])
    for j in range(k):
        row = np.zeros(nv)
        row[n + j] = n / cpu_bw[j]
        row[-1] = -1.0
        a_ub.append(row)
        b_ub.append(0.0)
    a_eq = np.zeros((1, nv))
    a_eq[0, : n + k] = 1.0
    with quiet_stdout():
        res = linprog(cost, A_ub=np.array(a_ub), b_ub=np.array(b_ub), A_eq=a_eq, b_eq=[1.0],
                      bounds=[(0, None)] * nv, method="highs")
    if res.status != 0:  # pragma: no cover - the LP is always feasible and bounded
        raise RuntimeError(f"split LP failed: {res.message}")
    x = np.clip(res.x, 0.0, None)
    m = x[: n + k] / x[: n + k].sum() * nbytes
    return SplitPlan(m[:n], m[n:], float(x[-1]) * nbytes / scale)


def byteps_shares(worker_bw, cpu_bw) -> tuple[np.ndarray, np.ndarray]:
    """Fractions of the gradient each co-located and each CPU server holds, as the runtime
    splits it: the closed form (`byteps_split`) for equal NICs, else the LP
    (`optimal_split`); only CPU servers when there are more CPU machines than workers."""
    wbw, cbw = np.asarray(worker_bw, dtype=float), np.asarray(cpu_bw, dtype=float)
    n, k = len(wbw), len(cbw)
    if np.allclose(wbw, wbw[0]) and (k == 0 or np.allclose(cbw, wbw[0])):
        if k > n:
            return np.zeros(n), np.full(k, 1.0 / k)
        m_cpu, m_gpu = byteps_split(n, k)
        return np.full(n, m_gpu), np.full(k, m_cpu)
    split = optimal_split(1.0, wbw, cbw)
    return split.gpu_bytes, split.cpu_bytes


def transfer_time(nbytes: float, bandwidth: float, latency: float = 0.0) -> float:
    """Point-to-point transfer of nbytes over one link."""
    return latency + nbytes / bandwidth
