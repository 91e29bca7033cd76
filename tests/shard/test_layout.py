"""Who owns which span, shares by memory, and the planner (pure: no processes)."""
from __future__ import annotations

import pytest

from hetrain.errors import UserError
from hetrain.perf.shardmem import (ShardModel, ShardWorker, choose_plan, memory_items, peak_bytes,
                                   shares_by_memory, sharded_bytes, whole_bytes)
from hetrain.train.shard.layout import UnitLayout, owner_spans

MiB = 2**20


def test_spans_cover_the_unit_in_proportion():
    spans = owner_spans(1000, [3.0, 1.0, 0.0, 1.0])
    assert spans[0][0] == 0 and spans[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert [e - s for s, e in spans] == [600, 200, 0, 200]


def test_spans_round_to_the_nearest_element():
    sizes = [e - s for s, e in owner_spans(10, [1, 1, 1])]
    assert sum(sizes) == 10 and max(sizes) - min(sizes) <= 1


def test_bad_weights_are_refused():
    for bad in ([], [0, 0], [1, -1], [float("nan")]):
        with pytest.raises(UserError, match="weights"):
            owner_spans(10, bad)


def test_overlap_between_two_layouts():
    three = UnitLayout.build("u", [(4, 5), (5,)], [1, 1, 1])   # 25 elements
    two = UnitLayout.build("u", [(4, 5), (5,)], [3, 2])
    assert three.numel == 25 and three.offsets == (0, 20)
    assert two.spans == ((0, 15), (15, 25))
    assert two.overlap(0, three.spans[1]) == (9, 15)
    assert two.overlap(1, three.spans[0]) is None


def test_shares_by_memory_follow_the_room_left():
    # 100, 60 and 30 MiB free; activations of their batch shares; 10 MiB held whole
    w = shares_by_memory([100 * MiB, 60 * MiB, 30 * MiB], [20 * MiB, 10 * MiB, 25 * MiB], 10 * MiB)
    assert w == [70 * MiB, 40 * MiB, 0.0]


def test_shares_by_memory_refuses_when_nobody_has_room():
    with pytest.raises(UserError, match="worker 1 has 10.0 MiB free but needs 30.0 MiB"):
        shares_by_memory([40 * MiB, 10 * MiB], [30 * MiB, 20 * MiB], 10 * MiB)


def _model():
    return ShardModel("m", (1_000_000,) * 8, act_bytes_per_sample=4096.0)


def test_items_shrink_with_the_stage():
    m = _model()
    peaks = [peak_bytes(m, s, 0.25, 16) for s in (0, 1, 2, 3)]
    assert peaks == sorted(peaks, reverse=True)
    items = memory_items(m, 3, 0.25, 16)
    assert items["optimizer state"] == 0.25 * 8e6 * 8
    assert items["parameters"] == 0.25 * 8e6 * 4 + 2 * 1e6 * 4
    # a worker's peak is what it holds whole plus its share of what is split
    for s in (1, 2, 3):
        if s < 3:
            assert peak_bytes(m, s, 0.25, 16) == pytest.approx(whole_bytes(m, s, 16) + 0.25 * sharded_bytes(m, s)
                                                                + 2 * 0.25 * 1e6 * 4)


def test_planner_picks_the_fastest_stage_that_fits_and_gives_the_small_worker_less():
    m = _model()  # 8M elements: a 128 MB replica + Adam state
    workers = [ShardWorker("big", 300 * MiB, 0.01), ShardWorker("small", 60 * MiB, 0.02)]
    plan = choose_plan(m, workers, 48, stages=(1, 2, 3))
    assert plan.stage == 2  # stage 1 keeps whole gradients the small worker cannot hold
    assert "stage 1: small over by" in plan.why
    assert plan.batch == (32, 16)  # by speed
    assert plan.shares[1] < plan.shares[0]
    assert all(p <= w.memory for p, w in zip(plan.peak, workers))


def test_planner_refuses_a_plan_that_fits_nowhere_naming_item_and_worker():
    m = _model()
    workers = [ShardWorker("gpu0", 4000 * MiB, 0.01), ShardWorker("t4", 20 * MiB, 0.02)]
    with pytest.raises(UserError) as err:
        choose_plan(m, workers, 48)
    msg = str(err.value)
    assert "worker t4" in msg and "stage 3" in msg and "largest item is" in msg
    assert "has 20.0 MiB" in msg


def _cluster_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("name: mixed\nmachines:\n"
                 "  - {name: big, role: worker, device: {speed: 1.0, memory: 150MiB}}\n"
                 "  - {name: small, role: worker, device: {speed: 0.4, memory: 45MiB}}\n")
    return str(f)


def test_shard_plan_command_shows_the_choice(tmp_path, capsys):
    from hetrain.cli import main

    assert main(["shard-plan", "--cluster", _cluster_file(tmp_path), "--units", "590592x8,7690",
                 "--global-batch", "48"]) == 0
    out = capsys.readouterr().out
    assert "the fastest that fits every worker" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("big", "small"))}
    assert float(rows["small"][2]) < float(rows["big"][2])          # the small worker's share is smaller
    assert float(rows["small"][3]) <= float(rows["small"][4])       # its predicted peak fits its cap


def test_shard_plan_command_refuses_with_the_named_message(tmp_path, capsys):
    from hetrain.cli import main

    assert main(["shard-plan", "--cluster", _cluster_file(tmp_path), "--units", "59059200x8"]) == 2
    err = capsys.readouterr().err
    assert "no sharding plan fits" in err and "worker small" in err and "largest item is" in err


def test_shard_plan_command_explains_bad_units(tmp_path, capsys):
    from hetrain.cli import main

    assert main(["shard-plan", "--cluster", _cluster_file(tmp_path), "--units", "12xbig"]) == 2
    assert "give unit sizes in elements" in capsys.readouterr().err


def test_shard_config_names_the_stages():
    from pydantic import ValidationError

    from hetrain.train.shard import ShardConfig

    with pytest.raises(ValidationError, match="1, 2 or 3"):
        ShardConfig(stage=4)
    with pytest.raises(ValidationError, match="extra"):
        ShardConfig(stage=2, stages=3)
