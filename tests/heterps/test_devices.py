"""`hetrain train --devices`: plan types onto real devices, and the refusals before
training (a GPU type on a host without CUDA, a GPU too small for its stages, a devices
file that misses a type). In-process, plus one CLI call that must stop before any
process starts."""
import pytest

from hetrain.errors import UserError
from hetrain.pipeline.cli import cluster_for, compile_plan
from hetrain.pipeline.devicemap import DeviceMapError, check_gpu_memory, check_host, load_device_map
from hetrain.pipeline.workload import CATALOGUE
from hetrain.plan.catalogue import load_catalogue
from tests.heterps.helpers import THREE_STAGES, make_plan, train


def test_real_maps_gpu_types_to_cuda_and_cpu_types_to_cpu():
    spec, _, cat = compile_plan(make_plan(THREE_STAGES), devices="real")
    assert [s.device for s in spec.stages] == ["cpu", "cuda", "cpu"]
    assert not spec.emulate  # real devices are never padded
    machines = cluster_for(spec, cat)["machines"]
    assert [m["device"].get("cuda", False) for m in machines] == [False, True, True, False, False, False]
    assert all("threads" not in m for m in machines)
    emulated, _, _ = compile_plan(make_plan(THREE_STAGES))
    assert emulated.emulate and {s.device for s in emulated.stages} == {"emulated"}
    assert not any(m["device"].get("cuda") for m in cluster_for(emulated, cat)["machines"])


def test_devices_file_with_threads_and_shorthand(tmp_path):
    f = tmp_path / "devices.yaml"
    f.write_text("types:\n  gpu-k80: cuda\n  cpu: {device: cpu, threads: 3}\n")
    spec, _, cat = compile_plan(make_plan(THREE_STAGES), devices=str(f))
    assert [(s.device, s.threads) for s in spec.stages] == [("cpu", 3), ("cuda", 0), ("cpu", 3)]
    machines = cluster_for(spec, cat)["machines"]
    assert [m.get("threads") for m in machines[:4]] == [3, None, None, 3]
    # the cost model's memory per replica: dense state + stored activations, no tables
    assert all(s.memory_bytes > 0 for s in spec.stages)


@pytest.mark.parametrize("text, match", [
    ("types:\n  cpu: cpu\n", "no device for plan type 'gpu-k80'"),
    ("types:\n  cpu: tpu\n  gpu-k80: cuda\n", "types.cpu.device"),
    ("types:\n  cpu: {device: cpu, threads: 0}\n  gpu-k80: cuda\n", "threads"),
    ("types: {}\n", "maps no type"),
    ("[1, 2]\n", "expected a mapping"),
])
def test_bad_devices_files_name_the_field(tmp_path, text, match):
    f = tmp_path / "devices.yaml"
    f.write_text(text)
    with pytest.raises(DeviceMapError, match=match):
        compile_plan(make_plan(THREE_STAGES), devices=str(f))


def test_unknown_devices_value_says_what_to_write():
    with pytest.raises(DeviceMapError, match="write `emulated`, `real`, or the path"):
        load_device_map("gpu", load_catalogue(CATALOGUE))


def test_gpu_type_on_a_host_without_cuda_is_refused_with_what_to_change():
    spec, _, _ = compile_plan(make_plan(THREE_STAGES), devices="real")
    with pytest.raises(UserError) as err:
        check_host(spec.stages, cuda_count=0)
    msg = str(err.value)
    assert "stage 1 (layers 5..10) is placed on gpu-k80" in msg and "no CUDA device" in msg
    assert "--devices emulated" in msg and "--planner cpu" in msg
    check_host(spec.stages, cuda_count=1)  # a host with a GPU runs it


def test_gpu_memory_counts_every_replica_on_the_gpu():
    spec, _, _ = compile_plan(make_plan(THREE_STAGES), devices="real")
    need = spec.stages[1].instances * spec.stages[1].memory_bytes
    check_gpu_memory(spec.stages, int(need) + 1, "cuda:0")
    with pytest.raises(UserError) as err:
        check_gpu_memory(spec.stages, int(need) - 1, "cuda:0 of machine s1r0")
    msg = str(err.value)
    assert "GPU cuda:0 of machine s1r0" in msg and "stage 1 (gpu-k80 x2)" in msg and "free" in msg
    assert "--batch-size" in msg


def test_cli_refuses_before_any_process_starts_on_a_host_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the command sees no GPU, on any host
    rc, out, run = train(tmp_path, make_plan(THREE_STAGES), "--devices", "real", limit=60)
    assert rc == 2, out
    lines = [l for l in out.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("hetrain: error: stage 1 (layers 5..10) is placed on gpu-k80")
    assert not (run / "launch").exists()  # nothing was started
