"""The launcher, end to end: torchrun launch lines, the demo under hetrain launch, plain
torchrun and plain python, torchrun's variables and pinned cores inside the processes,
progress bars that move, and jobs that end at once when they cannot form."""
import json
import os
import random
import re
import subprocess
import sys
import threading
import time

import pytest
import yaml

from hetrain.cluster import parse_cluster
from hetrain.cluster.netns import NetnsCluster, netns_available
from tests.helpers import SCRIPTS, free_port, repo_env, small_cluster

ENV = repo_env()
HETRAIN = [sys.executable, "-m", "hetrain.cli"]



def _env_lines(log: str) -> list[dict]:
    return [json.loads(line.split("ENV ", 1)[1]) for line in log.splitlines() if "ENV {" in line]


@pytest.mark.slow
def test_a_torchrun_line_trains_the_demo_under_hetrain_launch(tmp_path):
    run = tmp_path / "run"
    line = ["--nnodes=1", "--nproc_per_node=2", "--node_rank=0", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", "-m", "hetrain.demo.digits", "--epochs", "3"]
    proc = subprocess.run([*HETRAIN, "launch", "--run-dir", str(run), *line], capture_output=True, text=True,
                          timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["ranks"]) == {"w0", "w1"} and summary["mode"] == "allreduce"
    assert all(r["samples"] > 0 for r in summary["ranks"].values())
    assert summary["accuracy"] >= 0.6, summary


@pytest.mark.slow
def test_the_demo_runs_under_plain_torchrun(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "hetrain.demo.digits", "--epochs", "3"], capture_output=True, text=True,
                          timeout=300, env=dict(ENV, HETRAIN_RUN_DIR=str(run)), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "mode allreduce; 2 workers" in proc.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["ranks"]) == {"w0", "w1"}
    assert all(r["samples"] > 0 and r["bytes"] > 0 for r in summary["ranks"].values())
    assert summary["accuracy"] >= 0.6, summary


def test_the_demo_runs_under_plain_python(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hetrain.demo.digits", "--epochs", "1"], capture_output=True,
                          text=True, timeout=300, env=ENV, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "runs" / "single" / "summary.json").read_text())
    assert list(summary["ranks"]) == ["w0"] and summary["ranks"]["w0"]["samples"] > 0


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to give 2 workers one each")
def test_torchrun_variables_and_pinned_cores_inside_the_processes(launch):
    cluster = small_cluster(workers=2, cpus=1)
    for m in cluster["machines"][:2]:
        m["threads"] = 1
    rc, log, _ = launch("report_env.py", cluster=cluster, mode="ps")
    assert rc == 0, log
    rows = sorted(_env_lines(log), key=lambda r: r["rank"])
    assert [r["machine"] for r in rows] == ["w0", "w1"], log
    for i, r in enumerate(rows):
        # ranks 0, 1 are the workers and 2 the server; all three run on this host
        assert (r["RANK"], r["WORLD_SIZE"], r["LOCAL_RANK"], r["LOCAL_WORLD_SIZE"]) == (str(i), "3", str(i), "3")
        assert r["MASTER_ADDR"] == "127.0.0.1" and int(r["MASTER_PORT"]) > 0
        assert r["sum_ok"]
        assert len(r["affinity"]) == 1 and r["torch_threads"] == 1 and r["OMP_NUM_THREADS"] == "1"
    assert rows[0]["affinity"] != rows[1]["affinity"]  # each its own core
    assert "hetrain: cores: w0/w0: " in log


@pytest.mark.slow
def test_the_progress_bar_moves_while_the_job_runs(tmp_path):
    """The script's bar waits after its first update until the test has seen that
    update in the launcher's output: a launcher that held the bar back until the job
    ended would leave it waiting, and the script gives up with exit code 1."""
    go = tmp_path / "go"
    cfile = tmp_path / "one.yaml"
    cfile.write_text(yaml.safe_dump(small_cluster(workers=1, cpus=0)))
    cmd = [*HETRAIN, "launch", "--cluster", str(cfile), "--mode", "allreduce", "--run-dir", str(tmp_path / "run"),
           str(SCRIPTS / "progress.py"), str(go)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    seen: list[tuple[float, str]] = []

    def read():
        for line in proc.stdout:
            seen.append((time.monotonic(), line.rstrip("\n")))
            if "progress:" in line and "1/3" in line:
                go.touch()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    rc = proc.wait(timeout=240)
    reader.join(10)
    log = "\n".join(text for _, text in seen)
    assert rc == 0, log
    first = next(i for i, (_, text) in enumerate(seen) if "progress:" in text and "1/3" in text)
    last = next(i for i, (_, text) in enumerate(seen) if "progress:" in text and "3/3" in text)
    done = next(i for i, (_, text) in enumerate(seen) if text.endswith(" done"))
    assert first < last < done and seen[first][0] <= seen[done][0]
    assert "nobody saw the bar move" not in log


@pytest.mark.slow
def test_a_process_that_exits_before_the_job_forms_ends_it_at_once(launch):
    # the 300 s lost-peer timeout would otherwise hold the others; limit=150 is the hang detector
    rc, log, _ = launch("exit_early.py", cluster=small_cluster(workers=2, cpus=1), timeout=300, limit=150)
    assert rc == 1, log
    assert "rank 1 (worker on machine w1) exited (exit code 2) before the job formed; stopping the others now" in log
    last_output = log.split("Its last", 1)[1]
    assert "unrecognized arguments: --lr=0.1x" in last_output
    assert "unreachable" not in log


@pytest.mark.slow
def test_workers_that_never_join_do_not_leave_servers_waiting(launch):
    rc, log, _ = launch("no_init.py", cluster=small_cluster(workers=2, cpus=1), timeout=300, limit=150)
    assert rc == 0, log
    assert log.count("plain script done") == 2
    assert "never called hetrain.init()" in log and "job failed" not in log


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(netns_available() is not None, reason=f"cannot create network namespaces here: {netns_available()}")
def test_a_two_node_torchrun_line_without_node_ranks(tmp_path):
    """torchrun's c10d style: the same line on both nodes, no --node-rank; the node
    that holds the rendezvous address is node 0, the other joins as node 1."""
    hosts = parse_cluster({"machines": [{"name": "hostA", "role": "worker", "device": {}},
                                        {"name": "hostB", "role": "worker", "device": {}}]})
    port = str(random.randint(20000, 40000))
    env = dict(ENV, HETRAIN_SECRET="torchrun-line-test-secret-01")
    with NetnsCluster(hosts) as net:
        net.up()
        a = net.addresses["hostA"]
        procs = []
        for host in ("hostB", "hostA"):  # the joining node may come first
            cmd = net.wrap(host, [*HETRAIN, "launch", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend",
                                  "c10d", "--rdzv-id", "t1", "--rdzv-endpoint", f"{a}:{port}", "--timeout", "60",
                                  "--run-dir", str(tmp_path / host), str(SCRIPTS / "report_env.py")])
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = dict(zip(("hostB", "hostA"), (p.communicate(timeout=240)[0] for p in procs)))
    assert [p.returncode for p in procs] == [0, 0], "\n=====\n".join(outs.values())
    rows = {host: _env_lines(out) for host, out in outs.items()}
    assert [r["RANK"] for r in rows["hostA"]] == ["0"] and [r["RANK"] for r in rows["hostB"]] == ["1"]
    for (r,) in rows.values():
        assert (r["WORLD_SIZE"], r["LOCAL_RANK"], r["LOCAL_WORLD_SIZE"], r["MASTER_ADDR"]) == ("2", "0", "1", a)
        assert r["sum_ok"]
    assert "node 1 of 2 starts 1 processes" in outs["hostB"]


def test_a_torchrun_script_with_its_own_nccl_default_group_keeps_host_traffic_on_gloo(tmp_path):
    """The script calls init_process_group itself on a backend that refuses CPU tensors
    (NCCL; "cuda:gloo" stands in for it on a CPU host): hetrain's step header and host
    all-reduce must still work (over its own gloo groups), not fail as a lost peer."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(SCRIPTS / "nccl_default.py")], capture_output=True, text=True, timeout=120,
                          env=ENV, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # plain torchrun's ranks share one stdout, so two RESULT lines can land on one line
    results = sorted(re.findall(r"RESULT (\d+) (\[[^\]]*\])", proc.stdout))
    assert [rank for rank, _ in results] == ["0", "1"], proc.stdout[-2000:]
    for _, values in results:  # (1 * 1 + 2 * 2) / (1 + 2)
        assert all(abs(float(x) - 5 / 3) < 1e-6 for x in values.strip("[]").split(",")), values
