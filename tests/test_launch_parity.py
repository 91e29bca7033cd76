"""torchrun parity: scripts written for torchrun, with nothing of hetrain in them, run
under `hetrain launch` with the same flags and give what plain torchrun gives.

Real processes on the CPU (gloo): the DDP example (`init_process_group()` over env://,
which needs the launcher to hand it a store as torchrun's agent does), a script that
relies on torch.distributed.elastic's restart semantics (TORCHELASTIC_RESTART_COUNT,
`@record` writing TORCHELASTIC_ERROR_FILE, a restart from its checkpoint), and a
two-node launch of two `hetrain launch --nnodes 2 --node_rank i` on this host. The
one-node DDP launch runs twice, so a launch that fails or aborts at exit now and then
shows up; the other launches run once each (every suite run repeats them)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import SCRIPTS, free_port, plain_reference_finished, repo_env

ROOT = Path(__file__).parents[1]
ENV = repo_env()
HETRAIN = [sys.executable, "-m", "hetrain.cli", "launch"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
DDP = [str(ROOT / "examples" / "ddp_digits.py"), "--epochs", "2"]
ELASTIC = str(SCRIPTS / "elastic_ddp.py")
RUNS = 2  # one-node DDP launches; the two-node and restart launches run once each



def _run(argv: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=cwd)


def _results(proc: subprocess.CompletedProcess, reference: int = 0) -> list[dict]:
    """Every rank's RESULT line, checked to exit 0 and without an abort. `reference`: a
    plain torchrun run of that many ranks, which may also end in PyTorch's own gloo exit
    race once every rank printed its result (tests/helpers.py); hetrain's runs may not."""
    out = proc.stdout + proc.stderr
    # plain torchrun's ranks share one stdout and print's pieces are separate writes, so two
    # ranks' lines can interleave ("RESULTRESULT  {..}{..}"): find each RESULT object itself
    # (they hold no nested objects; nothing else the scripts print holds braces)
    results = [json.loads(m) for m in re.findall(r"\{[^{}]*\}", proc.stdout)]
    if reference and plain_reference_finished(proc.returncode, out, len(results), reference):
        return results
    assert proc.returncode == 0, out[-4000:]
    assert "terminate called" not in out and "core dumped" not in out.lower(), out[-4000:]
    assert "RESULT" in proc.stdout, out[-3000:]
    assert results, out[-3000:]
    return results


def _same(results: list[dict], reference: dict, keys: tuple[str, ...]) -> None:
    for r in results:
        for k in keys:
            torch.testing.assert_close(torch.tensor(r[k]), torch.tensor(reference[k]))


@pytest.mark.slow
def test_the_ddp_example_runs_unchanged_under_hetrain_launch(tmp_path):
    """`torchrun --nproc_per_node 2 examples/ddp_digits.py` with torchrun replaced: every
    run exits 0 with the model plain torchrun trains."""
    reference = _results(_run([*TORCHRUN, "--standalone", "--nproc_per_node", "2", *DDP], tmp_path), reference=2)
    for i in range(RUNS):
        res = _results(_run([*HETRAIN, "--nproc_per_node", "2", "--run-dir", str(tmp_path / f"r{i}"), *DDP], tmp_path))
        assert len(res) == 2, f"run {i}"
        _same(res, reference[0], ("accuracy", "loss"))


@pytest.mark.long
def test_a_two_node_launch_runs_the_ddp_example(tmp_path):
    """Two launchers on this host, `--nnodes 2 --node_rank 0|1` with torchrun's flags:
    four ranks that train the model plain torchrun trains on four processes. (`long`: the
    default run keeps the one-node DDP launch above and the two-node launch of
    tests/test_multinode.py, which this repeats for a third-party script.)"""
    reference = _results(_run([*TORCHRUN, "--standalone", "--nproc_per_node", "4", *DDP], tmp_path), reference=4)
    for i in range(1):  # one launch: the one-node test repeats the launch itself
        port = free_port()
        nodes = [subprocess.Popen([*HETRAIN, "--nnodes", "2", "--node_rank", str(k), "--nproc_per_node", "2",
                                   "--master_addr", "127.0.0.1", "--master_port", str(port),
                                   "--run-dir", str(tmp_path / f"r{i}n{k}"), *DDP],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(
                                      ENV, HETRAIN_SECRET="parity-test-secret"), cwd=tmp_path) for k in range(2)]
        res = []
        for node in nodes:
            out, err = node.communicate(timeout=240)
            res += _results(subprocess.CompletedProcess(node.args, node.returncode, out, err))
        assert len(res) == 4, f"run {i}"
        _same(res, reference[0], ("accuracy", "loss"))


@pytest.mark.slow
def test_an_elastic_script_restarts_from_its_checkpoint_as_under_torchrun(tmp_path):
    """torch.distributed.elastic's restart semantics under `hetrain launch --max-restarts 1`:
    rank 1 fails after a checkpoint, `@record` writes its traceback to
    TORCHELASTIC_ERROR_FILE, the job restarts with TORCHELASTIC_RESTART_COUNT=1 and its
    env:// rendezvous forms again; the final weights equal an uninterrupted torchrun run."""
    (tmp_path / "ref").mkdir()
    reference = _results(_run([*TORCHRUN, "--standalone", "--nproc_per_node", "2", ELASTIC,
                               str(tmp_path / "ref"), "0"], tmp_path), reference=2)
    assert {r["restart"] for r in reference} == {0}
    for i in range(1):  # one launch: the one-node test repeats the launch itself
        out, run = tmp_path / f"out{i}", tmp_path / f"run{i}"
        out.mkdir()
        res = _results(_run([*HETRAIN, "--nproc_per_node", "2", "--max_restarts", "1", "--run-dir", str(run),
                             ELASTIC, str(out), "2"], tmp_path))
        assert [r["restart"] for r in res] == [1, 1], res
        _same(res, reference[0], ("weights",))
        error = json.loads((run / "errors" / "round0" / "rank1.json").read_text())
        assert "injected failure after a checkpoint" in json.dumps(error)


@pytest.mark.slow
def test_a_script_that_made_its_own_group_keeps_it_under_hetrain_init(tmp_path):
    """`init_process_group()` first (as under torchrun), then `hetrain.init()`: the
    group the script made is hetrain's too, and push_pull averages over both workers."""
    res = _results(_run([*HETRAIN, "--nproc_per_node", "2", "--run-dir", str(tmp_path / "run"),
                         str(SCRIPTS / "init_then_hetrain.py")], tmp_path))
    assert sorted(r["rank"] for r in res) == [0, 1] and {r["size"] for r in res} == {2}
    for r in res:
        torch.testing.assert_close(torch.tensor(r["mean"]), torch.full((4,), 1.5))
