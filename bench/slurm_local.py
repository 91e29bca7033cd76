"""A real one-node Slurm cluster on this host, to run examples/deploy/hetrain.sbatch
through `sbatch` as a user's job would run.

Needs Debian's (or Ubuntu's) `slurm-wlm` and `munge` packages; with `--install` (root,
apt) it installs them: `apt-get update && apt-get install -y slurm-wlm munge`.
Everything else lives in a scratch folder: a munge key and daemon on its own socket, a
slurm.conf naming this host as controller and only node (process tracking by
/proc, no cgroups, so it runs in a container), slurmctld and slurmd in the foreground as
children of this script, stopped when it ends. The job's output is printed, and the
result (exit code, seconds, the job's last lines) goes to JSON.

    python bench/slurm_local.py [--install] [--json bench/results/slurm_local.json] [-- LAUNCH ARGS]

tests/test_deploy_slurm.py runs the same (slow; skipped only where Slurm cannot be
installed, saying why).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "examples" / "deploy" / "hetrain.sbatch"
PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("slurmctld", "slurmd", "munged", "mungekey", "sbatch", "scontrol")


def missing() -> list[str]:
    return [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]


def install() -> str | None:
    """apt-get the packages; None when they are there afterwards, else why not."""
    if not missing():
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"Slurm is not installed and cannot be installed here (needs root and apt-get): missing {missing()}"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", *PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
            return f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {tail[0]}"
    return None if not missing() else f"installed {PACKAGES}, but still missing {missing()}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tool(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class LocalSlurm:
    """munged + slurmctld + slurmd for this host, in `root` (a scratch folder)."""

    def __init__(self, root: Path):
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.procs: list[subprocess.Popen] = []
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def _write_conf(self) -> None:
        r = self.root
        for d in ("state", "spool", "munge"):
            (r / d).mkdir(mode=0o700, exist_ok=True)
        cpus = os.cpu_count() or 1
        self.conf.write_text(f"""ClusterName=hetrainci
SlurmctldHost={self.host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={r}/munge/munge.socket
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=ci Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
""")

    def start(self, timeout_s: float = 60.0) -> None:
        self._write_conf()
        m = self.root / "munge"
        subprocess.run([_tool("mungekey"), "--create", "--keyfile", str(m / "munge.key")], check=True,
                       capture_output=True, timeout=60)
        os.chmod(m / "munge.key", 0o600)
        subprocess.run([_tool("munged"), "--force", f"--socket={m}/munge.socket", f"--key-file={m}/munge.key",
                        f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"],
                       check=True, capture_output=True, timeout=60)  # munged puts itself in the background
        for daemon in ("slurmctld", "slurmd"):
            args = [_tool(daemon), "-D", "-f", str(self.conf)] + (["-c", "-i"] if daemon == "slurmctld" else [])
            log = open(self.root / f"{daemon}.out", "w")
            self.procs.append(subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            proc = subprocess.run([_tool("sinfo"), "-h", "-o", "%T"], env=self.env, capture_output=True, text=True,
                                  timeout=30)
            state = proc.stdout.strip()
            if state.startswith("idle"):
                return
            time.sleep(1)
        raise RuntimeError(f"the Slurm node never became idle (last state {state!r}); logs in {self.root}:\n"
                           + self.logs())

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text()[-2000:] for p in sorted(self.root.glob("*.log"))
                         + sorted(self.root.glob("*.out")) if p.is_file())

    def sbatch(self, script: Path, args: list[str], cwd: Path, timeout_s: float = 900.0) -> tuple[int, str, float]:
        """Submit `script ARGS` and wait for it (`sbatch --wait`): its exit code, output, seconds."""
        out = cwd / "job.out"
        t = time.monotonic()
        proc = subprocess.run([_tool("sbatch"), "--wait", f"--output={out}", "--chdir", str(cwd), str(script), *args],
                              env=self.env, capture_output=True, text=True, timeout=timeout_s)
        text = out.read_text() if out.exists() else ""
        return proc.returncode, f"{proc.stdout}{proc.stderr}{text}", time.monotonic() - t

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        pid_file = self.root / "munge" / "munged.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text().strip()), 15)
            except (ValueError, ProcessLookupError):
                pass


def run_recipe(args: list[str], workdir: Path, env: dict[str, str] | None = None) -> dict:
    """Start the cluster, run the shipped sbatch recipe with `args`, stop the cluster."""
    with tempfile.TemporaryDirectory(prefix="hetrain-slurm-") as d:
        slurm = LocalSlurm(Path(d))
        if env:
            slurm.env.update(env)
        try:
            slurm.start()
            rc, text, secs = slurm.sbatch(SBATCH, args, workdir)
            if rc != 0:
                text += "\n" + slurm.logs()
        finally:
            slurm.stop()
    return {"exit": rc, "seconds": secs, "output": text, "args": args}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--install", action="store_true", help="apt-get install slurm-wlm munge when missing (root)")
    ap.add_argument("--json", default=str(REPO / "bench" / "results" / "slurm_local.json"))
    ap.add_argument("launch_args", nargs="*", help="hetrain launch's arguments (default: the recipe's demo)")
    a = ap.parse_args()
    why = install() if a.install else (f"missing {missing()} (run with --install)" if missing() else None)
    if why:
        print(f"slurm_local: {why}")
        return 1
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "HETRAIN": f"{sys.executable} -m hetrain.cli"}
    with tempfile.TemporaryDirectory() as work:
        res = run_recipe(a.launch_args, Path(work), env)
    print(res["output"][-3000:])
    print(f"{'recipe':40} {'exit':>5} {'seconds':>8}")
    print(f"{'examples/deploy/hetrain.sbatch':40} {res['exit']:5d} {res['seconds']:8.1f}")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({**res, "output": res["output"][-4000:]}, indent=1))
    return 0 if res["exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
