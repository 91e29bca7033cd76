"""Output at a glance: a progress bar redrawn in place on a terminal and plain lines in a
log, and the run table's one naming of its columns with a legend and the emulated speeds."""
import io
import os
import pty
import sys
import threading

import pytest

from hetrain.runtime.launch.output import Console, _pump_fd
from hetrain.train.summary import LEGEND, format_table
from tests.helpers import repo_env


def test_a_terminal_redraws_the_bar_in_place_and_keeps_it_below_other_lines():
    out = io.StringIO()
    c = Console(out, tty=True)
    c.redraw("[0] bar 1/3", "[0]")
    c.redraw("[0] bar 2/3", "[0]")
    c.line("[4] server says hi", "[4]")  # another process: above the bar, the bar drawn again
    c.redraw("[0] bar 2/3", "[0]")  # the same state again: nothing
    c.line("[0] bar 3/3", "[0]")  # the bar's own end
    c.line("hetrain: done")
    text = out.getvalue()
    lines = text.split("\n")
    assert lines[0] == "\r[0] bar 1/3\x1b[K\r[0] bar 2/3\x1b[K\r\x1b[K[4] server says hi"
    assert lines[1] == "\r[0] bar 2/3\x1b[K\r\x1b[K[0] bar 3/3"
    assert lines[2:] == ["hetrain: done", ""]


def test_a_log_gets_each_state_once_as_a_plain_line():
    out = io.StringIO()
    c = Console(out, tty=False)
    for text in ("[0] bar 1/3", "[0] bar 1/3", "[0] bar 2/3"):
        c.redraw(text, "[0]")
    c.line("[0] bar 2/3", "[0]")  # the closing state, already in the log
    c.line("[0] done", "[0]")
    assert out.getvalue() == "[0] bar 1/3\n[0] bar 2/3\n[0] done\n"
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_pieces_ended_by_a_carriage_return_are_bar_states():
    r, w = os.pipe()
    got = []
    t = threading.Thread(target=_pump_fd, args=(r, lambda piece, final=True: got.append((piece, final)), 0.05))
    t.start()
    os.write(w, b"start\n\rbar 1/2\rbar 2/2\r\n")
    os.write(w, b"tail without end")
    os.close(w)
    t.join(10)
    os.close(r)
    assert ("start", True) in got and ("bar 1/2", False) in got and ("bar 2/2", True) in got
    assert got[-1] == ("tail without end", True)


def test_one_naming_of_the_time_columns_with_a_legend_and_speeds():
    rows = [{"samples": 300, "steps": 10, "wall_s": 5.0, "compute_s": 2.0, "comm_s": 1.0, "hidden_s": 0.5,
             "wait_s": 0.5, "bytes": 2e6},
            {"samples": 100, "steps": 10, "wall_s": 5.0, "compute_s": 2.5, "comm_s": 1.0, "wait_s": 0.0,
             "bytes": 2e6}]
    text = format_table(rows, ["w0", "w1"], ["cpu/1t", "cpu/1t"], [1.0, 0.25])
    head, _, w0, w1, *legend = text.splitlines()
    assert head.split() == ["rank", "device", "speed", "share", "samples", "compute", "s", "comm", "s", "hidden", "s",
                            "wait", "s", "other", "s", "MB/step"]
    assert w0.split() == ["w0", "cpu/1t", "1.00", "0.750", "300", "2.00", "1.00", "0.50", "0.50", "1.50", "0.200"]
    assert w1.split()[2:4] == ["0.25", "0.250"] and w1.split()[7] == "0.00"  # no hidden_s given: none hidden
    assert " ".join(legend) == LEGEND and "other = the rest of the wall time" in LEGEND


def _on_a_pty(argv: list[str], cwd, timeout_s: float = 600) -> tuple[int, str]:
    """Run `python -m hetrain.cli ARGV` with a terminal as its stdout and stderr."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: exec at once
        os.chdir(cwd)
        os.execve(sys.executable, [sys.executable, "-m", "hetrain.cli", *argv], repo_env())
    chunks = []
    timer = threading.Timer(timeout_s, lambda: os.kill(pid, 9))
    timer.start()
    try:
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:  # the terminal closed: the child is gone
                break
            if not data:
                break
            chunks.append(data)
    finally:
        timer.cancel()
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode(errors="replace")


def test_a_launched_progress_bar_is_one_line_on_a_terminal(tmp_path):
    (tmp_path / "bar.py").write_text(
        "import sys, time\nfrom tqdm import tqdm\nimport hetrain\nhetrain.init()\n"
        "for i in tqdm(range(5), desc='phase', file=sys.stdout, ascii=True, mininterval=0):\n"
        "    time.sleep(0.3)  # a phase's work\nprint('after the bar', flush=True)\nhetrain.shutdown()\n")
    rc, text = _on_a_pty(["launch", "--nproc-per-node", "1", "bar.py"], tmp_path, 180)
    assert rc == 0, text
    bar_lines = [line for line in text.split("\n") if "phase:" in line]
    assert len(bar_lines) == 1, text
    assert bar_lines[0].count("\r") >= 3 and "5/5" in bar_lines[0]  # redrawn in place, to its end
    assert any("after the bar" in line for line in text.split("\n"))


@pytest.mark.slow
def test_the_demo_on_a_terminal_shows_one_progress_line(tmp_path):
    rc, text = _on_a_pty(["demo", "--epochs", "3"], tmp_path)
    assert rc == 0, text
    bar_lines = [line for line in text.split("\n") if "epochs:" in line]
    assert len(bar_lines) == 1, text  # one phase, one line
    assert "3/3" in bar_lines[0] and bar_lines[0].count("\r") >= 3
    assert "at speed 0.25" in text and "other = the rest of the wall time" in text
