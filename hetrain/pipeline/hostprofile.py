"""Profile and catalogue of this host's real devices, for planning the runtime's CTR
model onto them (`bench/heterps.py --real`, `pipeline/measure.py`).

`runtime_layer_times(device, micro_batch, threads)` times each layer of the runtime's
CTR model *as the runtime runs it*: pipeline/stage.py's `StageCompute` (the code the
stage processes run), on micro-batches of the run's size, on the CPU with the CPU type's
threads and cores, or on the GPU; embedding lookups pull their rows from an in-process
shard (`ShardState`, the shards' own code; the network hop is in the link time below).
Each measurement is the one profiler's statistic (`plan.profile.time_passes`, also
behind `hetrain plan`'s layer profiles): a warm-up, then `runs` forward+backward passes
back to back over a few different micro-batches of the stream, with one device
synchronisation at the end, the median of `repeats`.
`stage_loop_time` times the whole model as one stage with the runtime's step loop (no
messages), to set beside the profile's sum. Consecutive
embedding layers are timed together and share the time evenly, since a stage pulls the
rows of all its tables at once. The first layer is also charged the data generation of
its micro-batch (the first stage generates its data; `CTRData` on the CPU).

This measures the runtime's own stage path, which is what its throughput depends on; a
generic per-layer CUDA profile of a model (`hetrain plan --calibrate`, where it exists)
times the model's own `nn.EmbeddingBag` lookups instead of the sparse PS path.

`link_bandwidth(nbytes)` measures TCP over loopback (gloo's transport between the
processes of one host) for messages of one micro-batch's activations, so per-message
latency is part of the figure. `host_catalogue` writes a catalogue with this host's GPU
as a GPU type and CPU workers of N threads as a CPU type, priced from the list prices
below (stated; check them before relying on them).
"""
from __future__ import annotations

import contextlib
import os
import platform
import socket
import threading
import time
from dataclasses import dataclass

import torch

from ..cluster.hardware import Inventory
from ..plan.catalogue import parse_catalogue
from ..plan.profile import ModelProfile, time_passes
from .data import CTRData, CTRDataConfig, MicroBatchLoader
from .messages import wire_for
from .sparse_ps import ShardLayout, ShardState, SparseOptim
from .stage import LocalRows, StageCompute
from .workload import MODEL_NAME, CTRModelConfig, emulated_profile

# $/hour per GPU: AWS on-demand list prices, us-east-1 Linux, as published in 2023 and
# written down without network access (check them): p5.48xlarge $98.32 for 8 H100,
# p4d.24xlarge $32.77 for 8 A100 40GB, p3.2xlarge $3.06 (V100), g4dn.xlarge $0.526 (T4).
GPU_PRICES = {"H100": 98.32 / 8, "A100": 32.77 / 8, "V100": 3.06, "T4": 0.526}
DEFAULT_GPU = "H100"  # a GPU not in the table is priced as this one (said in the catalogue's note)
# $/hour per vCPU: c5.4xlarge, $0.68 for 16 vCPU (hetrain/data/catalogue_aws.yaml)
CPU_PRICE_PER_THREAD = 0.68 / 16


@contextlib.contextmanager
def _cpu_threads(threads: int | None, pin: bool = True):
    """Run with `threads` torch threads, pinned to as many cores (as a CPU type's process
    is, `threads: N`) or not (a GPU stage's process: one thread, unpinned), then restore."""
    if not threads:
        yield
        return
    old_n = torch.get_num_threads()
    old_aff = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        if pin and old_aff is not None and len(old_aff) >= threads:
            os.sched_setaffinity(0, sorted(old_aff)[:threads])
        torch.set_num_threads(threads)
        yield
    finally:
        torch.set_num_threads(old_n)
        if old_aff is not None:
            os.sched_setaffinity(0, old_aff)


def _segments(model) -> list[tuple[int, int]]:
    """Layer ranges timed together: each run of embedding layers, every other layer alone."""
    out, i, n = [], 0, len(model.layers)
    while i < n:
        j = i + 1
        if hasattr(model.layers[i], "table"):
            while j < n and hasattr(model.layers[j], "table"):
                j += 1
        out.append((i, j))
        i = j
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _standalone(device: torch.device, cfg: CTRModelConfig):
    """The runtime's model on `device` with its sparse tables in one in-process shard:
    (wire, model, shard layout, shard), what a stage needs to run without other processes."""
    wire = wire_for(device, "profiling")
    model = cfg.build()
    model.train()
    layout = ShardLayout([cfg.rows] * cfg.n_tables, 1)
    full = torch.cat([m.table.weight.detach() for m in model.layers if hasattr(m, "table")])
    return wire, model, layout, ShardState(full.clone(), SparseOptim())


def data_time_per_sample(data: CTRData, micro_batch: int, batches: int = 8) -> float:
    """Seconds per sample to generate the training stream (chunks included)."""
    t0 = time.perf_counter()
    for i in range(batches):
        data.samples(i * micro_batch, micro_batch)
    return (time.perf_counter() - t0) / (batches * micro_batch)


def runtime_layer_times(device: torch.device | str, micro_batch: int, threads: int | None = None, runs: int = 12,
                        repeats: int = 3, distinct: int = 4, cfg: CTRModelConfig = CTRModelConfig(),
                        data_cfg: CTRDataConfig = CTRDataConfig()) -> tuple[float, ...]:
    """Forward+backward seconds per sample of every layer, run as the runtime runs it:
    `runs` passes back to back over `distinct` different micro-batches of the stream
    (fresh rows and activations, not one cache-hot batch), one synchronisation at the
    end; the median of `repeats` such timings."""
    device = torch.device(device)
    # a CPU type's process: `threads` pinned cores; a GPU stage's: one thread, unpinned (as the worker runs)
    with _cpu_threads(threads or 1, pin=device.type == "cpu" and bool(threads)):
        wire, model, layout, shard = _standalone(device, cfg)
        data = CTRData(data_cfg)
        t_data = data_time_per_sample(data, micro_batch)
        states = []
        for k in range(distinct):
            dense, ids, _ = data.samples(k * micro_batch, micro_batch)
            states.append([wire.from_cpu(dense), wire.from_cpu(ids)])
        times = [0.0] * len(model.layers)
        for a, b in _segments(model):
            stage = StageCompute(model, a, b, layout, wire, LocalRows(shard))
            inputs = [[t.detach().requires_grad_(t.is_floating_point() and a > 0) for t in st] for st in states]

            outs: list = [None] * distinct

            def once(k: int) -> None:
                out, pulled = stage.forward(inputs[k], 0)
                fl = [o for o in out if o.is_floating_point() and o.requires_grad]
                if fl:
                    torch.autograd.backward(fl, [torch.ones_like(o) for o in fl])
                stage.push(pulled, 0)
                outs[k] = out

            per_pass = time_passes(once, device, distinct, runs, repeats)  # the one profiler's statistic
            states = [[o.detach() for o in out] for out in outs]
            for layer in range(a, b):
                times[layer] = per_pass / micro_batch / (b - a)
        times[0] += t_data
    return tuple(max(t, 1e-12) for t in times)


def stage_loop_time(device: torch.device | str, micro_batch: int, threads: int | None = None, steps: int = 3,
                    micro_batches: int = 8, cfg: CTRModelConfig = CTRModelConfig(),
                    data_cfg: CTRDataConfig = CTRDataConfig()) -> float:
    """Seconds per sample of the whole model as one stage in one process, the runtime's
    step loop without its messages (data, pulls from an in-process shard, forward, loss,
    backward, pushes; the shard's update and the optimizer step per step): set beside
    the profile's sum, it says how much of a gap to the prediction the per-layer profile
    explains, and how much the messages and processes of a run add."""
    device = torch.device(device)
    # a CPU type's process: `threads` pinned cores; a GPU stage's: one thread, unpinned (as the worker runs)
    with _cpu_threads(threads or 1, pin=device.type == "cpu" and bool(threads)):
        wire, model, layout, shard = _standalone(device, cfg)
        stage = StageCompute(model, 0, len(model.layers), layout, wire, LocalRows(shard))
        opt = torch.optim.Adagrad(stage.params, lr=0.05)
        batch = micro_batch * micro_batches
        loader = MicroBatchLoader(CTRData(data_cfg), batch, [micro_batch] * micro_batches)

        def step(s: int) -> None:
            for i in range(micro_batches):
                dense, ids, label = (wire.from_cpu(t) for t in loader.get(s, i))
                out, pulled = stage.forward([dense, ids], s)
                (model.loss(out[0], label) * (micro_batch / batch)).backward()
                stage.push(pulled, s)
            shard.apply()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step(0)  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        for s in range(1, steps + 1):
            step(s)
        _sync(device)
        return (time.perf_counter() - t0) / (steps * batch)


@dataclass(frozen=True)
class HostDevices:
    """The plan types of this host: a GPU type (its CUDA device) and a CPU type
    (processes of `cpu_threads` threads on cores of their own)."""

    gpu_type: str
    gpu_name: str
    gpu_memory: float
    cpu_type: str
    cpu_threads: int
    cpu_count: int
    cpu_memory: float


def host_devices(cpu_threads: int = 4, reserved_cores: int = 4) -> HostDevices:
    """This host's GPU and how many CPU workers of `cpu_threads` threads fit beside the
    GPU process, the sparse-PS shards and the launcher (`reserved_cores`)."""
    props = torch.cuda.get_device_properties(0)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    count = max(1, (cores - reserved_cores) // cpu_threads)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return HostDevices("gpu", props.name, float(props.total_memory), f"cpu{cpu_threads}t", cpu_threads, count,
                       float(ram) / (count + 2))


def link_bandwidth(nbytes: int, messages: int = 64) -> float:
    """Bytes/s of TCP over loopback for messages of `nbytes` (one direction, streamed)."""
    nbytes = max(int(nbytes), 1)
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    got = []

    def sink():
        conn, _ = srv.accept()
        with conn:
            left = nbytes * messages
            while left > 0:
                chunk = conn.recv(min(left, 1 << 20))
                if not chunk:
                    break
                left -= len(chunk)
            got.append(time.perf_counter())

    th = threading.Thread(target=sink, daemon=True)
    th.start()
    payload = bytes(nbytes)
    with socket.create_connection(srv.getsockname()) as cli:
        cli.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        for _ in range(messages):
            cli.sendall(payload)
        th.join(timeout=60)
    srv.close()
    if not got:
        raise RuntimeError("loopback bandwidth measurement did not finish")
    return nbytes * messages / (got[0] - t0)


def gpu_price(name: str) -> tuple[float, str]:
    """$/hour of a GPU by its name, and where the figure comes from."""
    for key, price in GPU_PRICES.items():
        if key.lower() in name.lower():
            return price, f"AWS on-demand list price per {key} (2023)"
    return GPU_PRICES[DEFAULT_GPU], f"{name} is not in the price table: priced as one {DEFAULT_GPU} (AWS, 2023)"


def host_catalogue(dev: HostDevices, bandwidth: float, gpu_price_per_hour: float | None = None) -> Inventory:
    """A catalogue of this host: its GPU (count 1) and CPU workers of N threads."""
    price, source = gpu_price(dev.gpu_name)
    if gpu_price_per_hour is not None:
        price, source = gpu_price_per_hour, "given on the command line"
    data = {
        "name": f"host-{platform.node() or 'local'}",
        "source": f"GPU: {source}; CPU: c5.4xlarge ($0.68/h for 16 vCPU) per thread; bandwidth: TCP loopback, measured",
        "types": [
            {"name": dev.gpu_type, "class": "gpu", "note": f"this host's {dev.gpu_name}", "price_per_hour": price,
             "count": 1, "memory": dev.gpu_memory, "bandwidth": bandwidth,
             "speed": {"dense": 1.0, "memory": 1.0, "sparse": 1.0}},
            {"name": dev.cpu_type, "class": "cpu", "note": f"a CPU worker of {dev.cpu_threads} threads on cores of its own",
             "price_per_hour": CPU_PRICE_PER_THREAD * dev.cpu_threads, "count": dev.cpu_count,
             "memory": dev.cpu_memory, "bandwidth": bandwidth, "speed": {"dense": 1.0, "memory": 1.0, "sparse": 1.0}},
        ],
    }
    return parse_catalogue(data, "<this host>")


def real_profile(dev: HostDevices, micro_batch: int, cfg: CTRModelConfig = CTRModelConfig(),
                 gpu_device: str = "cuda", **kw) -> ModelProfile:
    """The runtime's CTR model measured on this host's CPU type and GPU type (the
    profile's `measured` times per type; bytes from the model, as `emulated_profile`)."""
    cpu = runtime_layer_times("cpu", micro_batch, dev.cpu_threads, cfg=cfg, **kw)
    gpu = runtime_layer_times(gpu_device, micro_batch, cfg=cfg, **kw)
    base = emulated_profile(cfg)
    layers = tuple(l.model_copy(update={"time_s": t}) for l, t in zip(base.layers, cpu))
    host = f"{platform.node()}: {dev.gpu_name}; CPU workers of {dev.cpu_threads} threads; micro-batch {micro_batch}"
    return ModelProfile(model=MODEL_NAME, host=host, batch=micro_batch, layers=layers,
                        measured={dev.cpu_type: cpu, dev.gpu_type: gpu})
