"""H-PS in real processes (gloo): measured, re-balanced shares with overlapped push give
the single-process update; codec-aware servers sum compressed pushes correctly."""
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
from reference import single_process  # noqa: E402

HPS = Path(__file__).parent / "scripts"
THREE = {"name": "t", "machines": [
    {"name": "w0", "role": "worker", "device": {"speed": 1.0}},
    {"name": "w1", "role": "worker", "device": {"speed": 0.5}},
    {"name": "w2", "role": "worker", "device": {"speed": 0.25}},
    {"name": "c0", "role": "cpu"}]}


@pytest.mark.slow
def test_balanced_loader_overlapped_update_equals_single_process(launch, tmp_path):
    """BalancedLoader through the launcher: one epoch (a last partial batch included) with
    shares re-balanced by measured speed gives the single-process update."""
    out = tmp_path / "params"
    # overlap from the optimizer only (servers sum in partition order) and a credit
    # window smaller than the gradient: hooks post late layers first, which must not
    # deadlock against servers waiting for the first partition
    rc, log, _ = launch(str(HPS / "balanced_train.py"), str(out), "--overlap", cluster=THREE,
                        extra=("--partition-bytes", "2048", "--credit-bytes", "4096"))
    assert rc == 0, log
    runs = [torch.load(out / f"rank{r}.pt") for r in range(3)]
    order = runs[0]["order"]
    ref = single_process([order[s * 24:(s + 1) * 24] for s in range(-(-200 // 24))])
    for r, got in enumerate(runs):
        for name, want in ref.items():
            torch.testing.assert_close(got["params"][name], want, rtol=1e-5, atol=1e-6, msg=f"rank {r} {name}")
    sizes = runs[0]["sizes"]
    # emulated devices, end to end: each process ran at its machine's speed from the cluster
    # file, and a step of b samples took at least b * cost / speed (the sleep makes up the rest)
    for r, speed in enumerate([1.0, 0.5, 0.25]):
        run = torch.load(out / f"rank{r}.pt")
        samples, speeds, compute_s, sleep_s = run["compute"].T
        assert torch.all(speeds == speed), (r, speeds)
        assert torch.all(compute_s >= samples * run["cost"] / speed), (r, run["compute"])
        # overlap hid communication: every step's partitions were on the wire before step()
        # was called (hidden > 0), and they stayed in flight through the emulated compute
        # that follows backward (transfers are posted from the gradient hooks, the device's
        # sleep comes after), so the hidden time covers most of that sleep
        hidden = run["hidden_s"]
        assert len(hidden) == len(samples) and torch.all(hidden > 0), (r, hidden)
        assert hidden.sum() >= 0.5 * sleep_s.sum() > 0, (r, hidden, sleep_s)
    assert torch.all(sizes.sum(1) == 24)
    assert all(torch.equal(r["sizes"], sizes) for r in runs)  # every worker agreed on every share
    # after a few measured steps the shares follow speed 1 : 0.5 : 0.25 (ideal 13.7, 6.9, 3.4)
    assert sizes[-1, 0] > sizes[-1, 1] > sizes[-1, 2], sizes
    assert abs(int(sizes[-1, 0]) - 13.7) <= 2, sizes


def check_one_process_update(out: Path, strategy: str, tail: float, rtol=1e-5, atol=1e-6,
                             workers: int = 3) -> list[dict]:
    """balanced_train.py's workers ended with one process's parameters on the same
    global batches, agreed on every share, and trained every sample of every step once
    (claimed tail chunks included). Returns each rank's saved results."""
    runs = [torch.load(out / f"rank{r}.pt") for r in range(workers)]
    order = runs[0]["order"]
    ref = single_process([order[s * 24:(s + 1) * 24] for s in range(-(-200 // 24))])
    for r, got in enumerate(runs):
        assert got["strategy"] == strategy
        for name, want in ref.items():
            torch.testing.assert_close(got["params"][name], want, rtol=rtol, atol=atol, msg=f"rank {r} {name}")
    sizes = runs[0]["sizes"]
    assert torch.all(sizes.sum(1) == 24)
    assert all(torch.equal(r["sizes"], sizes) for r in runs)  # every worker agreed on every share
    trained = torch.stack([r["trained"] for r in runs])  # workers x steps x (samples, passes, copies)
    own = trained[:, :, 0] * (1 - trained[:, :, 2])  # not a probe's copies
    assert own.sum(0).tolist() == [24] * 8 + [200 - 8 * 24]  # every sample of every step, once
    if tail:  # chunks were claimed: some worker ran more than one pass in a step
        assert int(trained[:, :, 1].max()) > 1, trained
    return runs


ALLREDUCE_THREE = {"name": "t", "machines": [m for m in THREE["machines"] if m["role"] == "worker"]}
ALLREDUCE_TWO = {"name": "t", "machines": ALLREDUCE_THREE["machines"][:2]}


@pytest.mark.parametrize("strategy,tail,workers", [("unequal", 0.0, 3), ("accumulate", 0.0, 3), ("unequal", 0.3, 3),
                                                   ("unequal", 0.0, 2)])
def test_both_strategies_give_the_single_process_update(launch, tmp_path, strategy, tail, workers):
    """Mode allreduce (in-place buckets overlapped with backward, no step header once the
    loader knows the total): unequal local batches, and equal micro-batches with a count
    per worker (gradient accumulation), both give the update one process computes on
    the same global batches, a last partial batch included; so do unequal batches whose
    last 30% is claimed while the step runs (the dynamic tail: extra passes, the
    exchange started on the last one). Every exchange of the balancer's rows rode the
    next step's gradient all-reduce where every worker took part in it (gloo's ring with
    three workers, a bucket swap with two); one made after the last step would have been
    gathered at `finish`."""
    out = tmp_path / "params"
    rc, log, _ = launch(str(HPS / "balanced_train.py"), str(out), f"--strategy={strategy}", f"--tail={tail}",
                        cluster=ALLREDUCE_THREE if workers == 3 else ALLREDUCE_TWO, mode="allreduce")
    assert rc == 0, log
    runs = check_one_process_update(out, strategy, tail, workers=workers)
    # an exchange every other step (BalanceConfig.every), each riding the next step's all-reduce
    # where every worker takes part in it; where a worker sits that step out (no samples: it
    # leaves the exchange, hetrain.api.members) the rows are gathered instead
    trained = torch.stack([r["trained"] for r in runs])  # workers x steps x (samples, passes)
    steps = trained.shape[1]
    rode = sum(1 for k in range(2, steps, 2) if tail > 0 or bool((trained[:, k, 0] > 0).all()))
    assert all(r["carried"] == rode for r in runs), ([r["carried"] for r in runs], rode, trained[:, :, 0])
    sizes = runs[0]["sizes"]
    if strategy == "accumulate":  # whole micro-batches per worker (the last one of a step may be short)
        micro = runs[0]["micro"]
        assert micro == 4
        assert int((sizes % micro != 0).sum(1).max()) <= 1, sizes


@pytest.mark.slow
def test_codec_servers_sum_compressed_pushes(launch, tmp_path):
    """Also runs the --overlap job configuration: partitions posted last-first, servers
    summing in that order, no credit window."""
    out = tmp_path / "cp"
    steps = 6
    rc, log, _ = launch(str(HPS / "codec_pushpull.py"), str(out), str(steps), cluster=THREE, mode="ps",
                        extra=("--partition-bytes", "2048", "--codec", "int8", "--codec-rule", "*.bias=fp16",
                               "--codec-rule", "layer1.*=int4", "--overlap"))  # --overlap: backward-order path
    assert rc == 0, log
    runs = [torch.load(out / f"rank{r}.pt") for r in range(3)]
    got, want = runs[0]["got"], runs[0]["want"]
    for r in runs[1:]:
        torch.testing.assert_close(r["got"], got, rtol=0, atol=0)  # every worker gets the same sum
    scale = want.abs().max()
    err = (got - want).abs().max(0).values
    # layout: layer0.weight (1200, int8), layer0.bias (40, fp16), layer1.weight (700, int4)
    regions = {"int8": (slice(0, 1200), 0.03), "fp16": (slice(1200, 1240), 0.002), "int4": (slice(1240, 1940), 0.3)}
    for name, (sl, tol) in regions.items():
        assert err[sl].max() <= tol * scale, (name, err[sl].max(), scale)
    assert err[0:1200].max() < err[1240:].max()  # 8-bit is finer than 4-bit
    # error feedback on workers and servers: the running sum drifts by about one step's error,
    # not by steps × that
    step_err = err.max()
    cum_err = (got.sum(0) - want.sum(0)).abs().max()
    assert cum_err <= 1.5 * step_err, (cum_err, step_err)
    fp32_bytes = 2 * steps * want.shape[1] * 4  # sent + received per worker, fp32
    assert runs[0]["bytes"][0] + runs[0]["bytes"][1] <= 0.3 * fp32_bytes
