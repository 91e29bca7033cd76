"""Leaving a process in order: the script runner `hetrain launch` starts workers with
runs a script as plain `python` would, and lets the process's native threads settle
(runtime/settle.py) before the interpreter finalises. In-process and small real
processes; no collective needed."""
import hashlib
import json
import subprocess
import sys
import threading

from hetrain.runtime.settle import _runnable_threads, settle_native_threads
from tests.helpers import SCRIPTS, repo_env

ENV = repo_env()


def _seen(proc: subprocess.CompletedProcess) -> dict:
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("SEEN ")]
    return json.loads(line[5:])


def test_settling_waits_for_a_thread_still_running_outside_the_gil():
    """A thread busy in C code without the GIL (hashing, as gloo's worker finishing a
    collective) is runnable: settling returns only after it finished its work."""
    started, done = threading.Event(), threading.Event()
    data = b"x" * (64 << 20)

    def busy():
        started.set()
        for _ in range(4):
            hashlib.sha256(data).digest()  # releases the GIL for large inputs
        done.set()

    t = threading.Thread(target=busy)
    t.start()
    started.wait()
    assert settle_native_threads(max_wait_s=120)
    assert done.is_set()
    t.join()


def test_settling_returns_when_the_other_threads_sleep():
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert settle_native_threads(max_wait_s=120)
        assert t.native_id not in _runnable_threads(threading.get_native_id())
    finally:
        stop.set()
        t.join()


def test_the_runner_starts_a_script_as_plain_python_does(tmp_path):
    """Same __name__, argv, first path entry and exit code as `python SCRIPT ARGS`, from
    another directory."""
    script = SCRIPTS / "show_main.py"
    plain = subprocess.run([sys.executable, str(script), "3", "--x"], capture_output=True, text=True, env=ENV,
                           cwd=tmp_path, timeout=60)
    ours = subprocess.run([sys.executable, "-m", "hetrain.runtime.script", str(script), "3", "--x"],
                          capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=60)
    assert plain.returncode == ours.returncode == 3, ours.stderr
    assert _seen(ours) == _seen(plain) == {"name": "__main__", "argv": [str(script), "3", "--x"],
                                            "path0": str(SCRIPTS.resolve()), "file": str(script.resolve())}


def test_the_runner_starts_a_module_as_python_m_does(tmp_path):
    (tmp_path / "mymod.py").write_text((SCRIPTS / "show_main.py").read_text())
    plain = subprocess.run([sys.executable, "-m", "mymod", "0"], capture_output=True, text=True, env=ENV,
                           cwd=tmp_path, timeout=60)
    ours = subprocess.run([sys.executable, "-m", "hetrain.runtime.script", "-m", "mymod", "0"], capture_output=True,
                          text=True, env=ENV, cwd=tmp_path, timeout=60)
    assert plain.returncode == ours.returncode == 0, ours.stderr
    assert _seen(ours) == _seen(plain)
    assert _seen(ours)["path0"] == str(tmp_path.resolve())


def test_the_runner_passes_on_a_failing_script(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("raise ValueError('broken on purpose')\n")
    ours = subprocess.run([sys.executable, "-m", "hetrain.runtime.script", str(bad)], capture_output=True, text=True,
                          env=ENV, cwd=tmp_path, timeout=60)
    assert ours.returncode == 1 and "ValueError: broken on purpose" in ours.stderr
