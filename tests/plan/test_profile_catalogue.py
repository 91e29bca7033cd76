"""Layer profiles, the model zoo and the resource catalogue: loading and bad input."""
from pathlib import Path

import pytest
import torch

from hetrain.models import build_model
from hetrain.models.ctr import CTRModel
from hetrain.plan.catalogue import CatalogueError, gavel_speed_ratios, load_catalogue, parse_catalogue
from hetrain.plan.profile import ModelProfile, ProfileError, load_or_profile, parse_profile, profile_model

GAVEL = Path(__file__).resolve().parents[2] / "hetrain" / "data" / "gavel" / "simulation_throughputs.json"


def small_ctr():
    return CTRModel(table_rows=(1000, 5_000_000, 50), dim=8, n_dense=4, bottom=(16,), top=(16,), rows_cap=500)


def test_ctr_model_trains_with_sparse_gradients():
    torch.manual_seed(0)
    m = small_ctr()
    dense, ids = m.example_inputs(8)
    out = m(dense, ids)
    assert out.shape == (8, 1)
    m.loss(out, torch.ones(8)).backward()
    table = m.layers[2].table
    assert table.weight.grad.is_sparse
    kinds = [k for _, _, k in m.layer_list()]
    assert kinds.count("sparse") == 3 and kinds[0] == "dense"


def test_profile_marks_sparse_layers_and_counts_declared_rows(tmp_path):
    m = small_ctr()
    prof = profile_model(m, "ctr-small", batch=8, repeats=1)
    by = {l.name: l for l in prof.layers}
    assert by["emb1"].kind == "sparse"
    assert by["emb1"].sparse_param_bytes == 5_000_000 * 8 * 4      # declared, not allocated
    assert by["emb1"].dense_param_bytes == 0
    assert by["bottom0"].dense_param_bytes == (4 * 16 + 16) * 4
    assert by["bottom0"].sparse_param_bytes == 0
    # the cut after the last table carries dense(8) + 3 pooled vectors(8) floats, no ids
    assert by["emb2"].act_bytes == 4 * 8 * 4
    assert all(l.time_s > 0 for l in prof.layers)
    path = tmp_path / "p.json"
    prof.save(path)
    assert ModelProfile.load(path) == prof


def test_workload_uses_speed_table_or_measured_times(tiny_catalogue_dict):
    cat = parse_catalogue(tiny_catalogue_dict)
    layers = [{"name": "a", "kind": "dense", "time_s": 1e-2, "act_bytes": 10, "stored_act_bytes": 10,
               "dense_param_bytes": 0, "sparse_param_bytes": 0},
              {"name": "b", "kind": "sparse", "time_s": 3e-3, "act_bytes": 10, "stored_act_bytes": 10,
               "dense_param_bytes": 0, "sparse_param_bytes": 1e6}]
    prof = parse_profile({"model": "m", "layers": layers})
    w = prof.workload(cat)
    assert w.compute[0].tolist() == pytest.approx([1e-2 / 20, 1e-2 / 2])
    assert w.compute[1].tolist() == pytest.approx([3e-3 / 1, 3e-3 / 3])
    prof2 = parse_profile({"model": "m", "layers": layers, "measured": {"cpu-a": [0.5, 0.25]}})
    assert prof2.workload(cat).compute[:, 1].tolist() == [0.5, 0.25]
    with pytest.raises(ProfileError, match="does not list"):
        parse_profile({"model": "m", "layers": layers, "measured": {"tpu": [1, 1]}}).workload(cat)


def test_malformed_profiles_say_what_is_wrong(tmp_path):
    with pytest.raises(ProfileError, match="layers"):
        parse_profile({"model": "m", "layers": []})
    with pytest.raises(ProfileError, match="one time per layer"):
        parse_profile({"model": "m", "layers": [{"name": "a", "kind": "dense", "time_s": 1, "act_bytes": 1,
                                                 "stored_act_bytes": 1, "dense_param_bytes": 0,
                                                 "sparse_param_bytes": 0}], "measured": {"x": [1, 2]}})
    with pytest.raises(ProfileError, match="layers.0.kind"):
        parse_profile({"model": "m", "layers": [{"name": "a", "kind": "weird", "time_s": 1, "act_bytes": 1,
                                                 "stored_act_bytes": 1, "dense_param_bytes": 0,
                                                 "sparse_param_bytes": 0}]})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        ModelProfile.load(bad)
    with pytest.raises(ProfileError, match="neither a built-in model"):
        load_or_profile("resnet9000")


def test_builtin_catalogues_load():
    for name in ("aws", "gcp"):
        cat = load_catalogue(name)
        classes = {k.device_class for k in cat.kinds}
        assert classes == {"cpu", "gpu"}
        assert all(k.price_per_hour > 0 and k.memory > 2**30 for k in cat.kinds)
        assert cat.source


def test_catalogue_gpu_speeds_follow_gavel_measurements():
    ratios = gavel_speed_ratios(GAVEL)
    cat = load_catalogue("gcp")
    k80, p100, v100 = (cat.kind(n).speed for n in ("n1-8-k80", "n1-8-p100", "n1-8-v100"))
    for kind in ("dense", "memory", "sparse"):
        assert p100.for_kind(kind) / k80.for_kind(kind) == pytest.approx(ratios[kind]["p100"], rel=0.02)
        assert v100.for_kind(kind) / k80.for_kind(kind) == pytest.approx(ratios[kind]["v100"], rel=0.02)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["types"][0].pop("price_per_hour"), "types.0.price_per_hour: required"),
    (lambda d: d["types"][0].update(price_per_hour=-1), "types.0.price_per_hour"),
    (lambda d: d["types"][1].update(colour="red"), "unknown key 'colour'"),
    (lambda d: d["types"][1].update(name="gpu-a"), r"\['gpu-a'\] listed twice"),
    (lambda d: d["types"][0].update(memory="lots"), "cannot read memory size"),
    (lambda d: d["types"][0].update({"class": "tpu"}), "types.0.class"),
    (lambda d: d.update(types=[]), "types"),
])
def test_malformed_catalogues_say_where(tiny_catalogue_dict, mutate, message):
    mutate(tiny_catalogue_dict)
    with pytest.raises(CatalogueError, match=message):
        parse_catalogue(tiny_catalogue_dict)


def test_catalogue_file_errors(tmp_path):
    with pytest.raises(CatalogueError, match="does not exist"):
        load_catalogue(tmp_path / "none.yaml")
    f = tmp_path / "bad.yaml"
    f.write_text("types: [\n")
    with pytest.raises(CatalogueError, match="not valid YAML"):
        load_catalogue(f)


def test_zoo_models_run_forward():
    for name in ("cnn", "transformer"):
        m = build_model(name)
        out = m(*m.example_inputs(2))
        assert out.shape[0] == 2 and torch.isfinite(out).all()
    assert len(build_model("transformer200").layer_list()) == 200


def test_real_device_times_calibrate_a_catalogue_type(tiny_catalogue_dict):
    cat = parse_catalogue(tiny_catalogue_dict)
    layers = [{"name": n, "kind": k, "time_s": t, "act_bytes": 10, "stored_act_bytes": 10,
               "dense_param_bytes": 0, "sparse_param_bytes": 0}
              for n, k, t in (("a", "dense", 1e-2), ("b", "dense", 3e-2), ("c", "memory", 2e-3))]
    prof = parse_profile({"model": "m", "layers": layers, "devices": {"cuda: Test GPU": [1e-4, 1e-4, 1e-4]}})
    assert prof.calibrated_speed() == pytest.approx({"dense": 4e-2 / 2e-4, "memory": 20.0})
    w = prof.with_device_as("gpu-a").workload(cat)
    assert w.compute[:, 0].tolist() == [1e-4, 1e-4, 1e-4]  # the GPU type uses the measured times
    assert w.compute[0, 1] == pytest.approx(1e-2 / 2)       # the CPU type still uses its speed table
    with pytest.raises(ProfileError, match="no times measured on 'cuda: other'"):
        prof.with_device_as("gpu-a", "cuda: other")
    with pytest.raises(ProfileError, match=r"devices\['x'\] has 1 times"):
        parse_profile({"model": "m", "layers": layers, "devices": {"x": [1.0]}})


def test_cpu_profile_has_no_gpu_times_without_cuda():
    prof = profile_model(small_ctr(), "ctr-small", batch=8, repeats=1, cuda=False)
    assert prof.devices == {}


@pytest.mark.gpu
def test_cuda_layer_times_beside_cpu_times():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from hetrain.plan.profile import cuda_device_key

    prof = profile_model(small_ctr(), "ctr-small", batch=64, repeats=2)
    times = prof.devices[cuda_device_key()]
    assert len(times) == prof.n_layers and all(t > 0 for t in times)
    assert set(prof.calibrated_speed()) == {"dense", "sparse", "memory"}
