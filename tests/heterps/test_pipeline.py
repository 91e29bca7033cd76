"""The stage pipeline end to end (real processes through the launcher): three stages
with fan-out 1->2 and fan-in 2->1, embeddings in two stages, two sparse-PS shards; the
trained parameters equal a single-process run on the same data."""
import json

import torch
from torch.testing import assert_close

from hetrain.pipeline.reference import assemble, train_single
from hetrain.pipeline.spec import RunSpec
from tests.heterps.helpers import make_plan, train


def _compare(spec: RunSpec, step: int) -> None:
    ref = train_single(spec, steps=step)
    got = assemble(spec, step)
    init = spec.model.build()
    moved = 0
    for (name, a), (_, b), (_, c) in zip(ref.named_parameters(), got.named_parameters(), init.named_parameters()):
        assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        moved += int((a != c).any())
    assert moved == len(list(init.parameters()))  # every tensor trained, so the check means something


def test_pipeline_equals_single_process(tmp_path):
    rc, out, run = train(tmp_path, make_plan(), "--steps", "3", "--micro-batches", "8", "--optimizer", "sgd",
                         "--lr", "0.5", "--no-emulate", "--quiet", "--json", str(tmp_path / "r.json"))
    assert rc == 0, out
    assert "measured" in out and "cost model" in out
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["processes"] == 6 and res["ps_shards"] == 2
    assert res["measured_sps"] > 0 and res["predicted_sps"] > 0
    spec = RunSpec.load(run / "spec.json")
    assert [s.instances for s in spec.stages] == [1, 2, 1]
    _compare(spec, 3)
