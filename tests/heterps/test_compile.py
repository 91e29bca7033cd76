"""Plan -> run spec: roles by rank, fan-in/out micro-batch counts, the cost model's
prediction, and clear errors for plans the runtime cannot run."""
import pytest

from hetrain.errors import UserError
from hetrain.perf.pipeline import CostParams, evaluate
from hetrain.pipeline.cli import cluster_for, compile_plan
from hetrain.pipeline.data import CTRData, CTRDataConfig, auc
from hetrain.pipeline.spec import Role
from hetrain.pipeline.workload import CATALOGUE, emulated_profile
from hetrain.plan.catalogue import load_catalogue
from tests.heterps.helpers import THREE_STAGES, make_plan


def test_roles_cluster_and_prediction():
    spec, score, cat = compile_plan(make_plan(THREE_STAGES, batch=256), micro_batches=7)
    assert spec.micro_batches == 8  # rounded up to a multiple of every replica count (1, 2, 1)
    assert [spec.role(r) for r in range(spec.world_size)] == [
        Role("stage", 0, 0), Role("stage", 1, 0), Role("stage", 1, 1), Role("stage", 2, 0),
        Role("shard", 0), Role("shard", 1)]
    machines = cluster_for(spec, cat)["machines"]
    assert [m["name"] for m in machines] == ["s0r0", "s1r0", "s1r1", "s2r0", "ps0", "ps1"]
    assert machines[1]["device"]["kind"] == "gpu-k80"
    # the prediction is the shared cost model's, with the plan's instance counts
    w = emulated_profile().workload(load_catalogue(CATALOGUE))
    assign = [0] * 5 + [1] * 6 + [0] * 3
    ref = evaluate(w, assign, 100.0, CostParams(batch_size=256), instances=[1, 2, 1])
    assert score.throughput == pytest.approx(ref.throughput)
    assert [s.time_per_sample_s for s in spec.stages] == pytest.approx([s.time_per_sample for s in ref.stages])


def test_small_memory_cap_adds_shards():
    spec, _, _ = compile_plan(make_plan(), ps_memory="1MiB", ps_shards=1)
    # 8 tables x 20,000 rows x 16 dims x 4 B x 2 (rows + Adagrad state) = 20.5 MB -> 20 shards of 1 MiB
    assert spec.ps_shards == 20


@pytest.mark.parametrize("stages, match", [
    ([((0, 5), "cpu", "cpu", 1), ((5, 14), "cpu", "cpu", 1)], "same type"),
    ([((0, 5), "cpu", "cpu", 1), ((6, 14), "gpu-k80", "gpu", 1)], "places 13 layers"),
    ([((0, 14), "tpu", "gpu", 1)], "no resource type 'tpu'"),
])
def test_bad_plans_are_explained(stages, match):
    with pytest.raises(UserError, match=match):
        compile_plan(make_plan(stages))


def test_infeasible_plan_refused():
    plan = make_plan()
    plan["feasible"] = False
    plan["reason"] = "too slow"
    with pytest.raises(UserError, match="not feasible"):
        compile_plan(plan)


def test_generated_data_is_skewed_deterministic_and_learnable():
    d = CTRData(CTRDataConfig(seed=3))
    a = d.samples(5000, 300)
    b = CTRData(CTRDataConfig(seed=3)).samples(5000, 300)
    assert all((x == y).all() for x, y in zip(a, b))  # any process reads the same samples
    _, ids, label = d.samples(0, 8192)
    counts = ids[:, 0, 0].bincount(minlength=d.cfg.rows).sort(descending=True).values
    assert counts[:20].sum() > 0.15 * 8192  # a few hot IDs (Zipf), long tail
    assert 0.1 < label.mean() < 0.6
    assert 0.75 < d.ceiling_auc < 0.99   # the hidden model is far from random
    assert auc([0.1, 0.2, 0.3, 0.4], [0, 0, 1, 1]) == 1.0


def test_each_first_stage_replica_reads_one_contiguous_block():
    from hetrain.pipeline.data import micro_batch_offsets

    sizes = [32, 32, 32, 31, 31, 31, 31, 31]  # 251 samples in 8 micro-batches
    for k in (1, 2, 4):
        off = micro_batch_offsets(sizes, k)
        spans = sorted((off[i], off[i] + sizes[i]) for i in range(8))
        assert spans[0][0] == 0 and spans[-1][1] == 251
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # every sample once
        for r in range(k):
            mine = sorted((off[i], off[i] + sizes[i]) for i in range(8) if i % k == r)
            assert all(a[1] == b[0] for a, b in zip(mine, mine[1:]))  # replica r: one block
    assert micro_batch_offsets(sizes, 1) == [0, 32, 64, 96, 127, 158, 189, 220]
