"""Streaming a process's output with its rank prefix, as it arrives, and the launcher's
console: a progress bar redrawn in place on a terminal, plain lines in a log."""
from __future__ import annotations

import codecs
import os
import re
import select
import shutil
import sys
import threading
from typing import TextIO

from .procs import Child


class Console:
    """The launcher's output. `line` prints a finished line; `redraw` shows a progress
    bar's new state (a piece a process ended with `\\r`). On a terminal a bar is drawn
    in place: one line per bar, rewritten with `\\r`, kept below the other lines (a
    line from elsewhere is printed above it and the bar drawn again), cut to the
    terminal's width so it never wraps (a wrapped line cannot be rewritten). In a log
    (not a terminal) each new state is a plain line, repeats left out."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self._lock = threading.Lock()
        self._bar: tuple[str, str] | None = None  # (source, text) of the bar drawn in place
        self._last: dict[str, str] = {}  # source -> its last state shown (log: repeats left out)

    def _width(self) -> int:
        return max(20, shutil.get_terminal_size((100, 24)).columns - 1)

    def _draw(self, text: str) -> None:
        self.stream.write("\r" + text[:self._width()] + "\x1b[K")

    def line(self, text: str, source: str = "") -> None:
        with self._lock:
            if self._last.pop(source, None) == text and not self.tty:
                return  # a bar's closing state, already in the log
            if self.tty and self._bar is not None:
                self.stream.write("\r\x1b[K" + text + "\n")  # over the bar; the bar's own end replaces it
                if self._bar[0] == source:
                    self._bar = None
                else:
                    self._draw(self._bar[1])
            else:
                self.stream.write(text + "\n")
            self.stream.flush()

    def redraw(self, text: str, source: str = "") -> None:
        with self._lock:
            if self._last.get(source) == text:
                return
            self._last[source] = text
            if self.tty:
                self._bar = (source, text)
                self._draw(text)
            else:
                self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        """End a bar left open (its process died before closing it)."""
        with self._lock:
            if self.tty and self._bar is not None:
                self.stream.write("\n")
                self.stream.flush()
            self._bar = None


def pump(child: Child, console: Console, quiet: bool, idle_s: float = 0.2) -> None:
    """Forward a process's output as it arrives: a `\\n`-ended piece as a line, a piece
    ended by `\\r` (a progress bar about to redraw) as a new state of the bar
    (`Console.redraw`). Output is read in chunks, not lines (a bar ends its line only
    when it closes); a piece with no end yet (a bar waiting for its next redraw) is
    shown as a bar state once nothing more has arrived for `idle_s`. The last lines
    stay in `child.tail`."""
    prefix = f"[{child.proc.rank}:{child.proc.label}]"

    def emit(piece: str, final: bool = True) -> None:
        if piece.strip():
            child.tail.append(piece)
            if not quiet:
                (console.line if final else console.redraw)(f"{prefix} {piece}", prefix)

    stream = child.popen.stdout
    if not hasattr(stream, "fileno"):  # a remote process (Ray) hands over its output line by line
        for line in stream:
            for piece in re.split(r"[\r\n]", line if isinstance(line, str) else line.decode(errors="replace")):
                emit(piece)
        return
    _pump_fd(stream.fileno(), emit, idle_s)


def _pump_fd(fd: int, emit, idle_s: float) -> None:
    """`pump` on a file descriptor: whole pieces, with how each ended (`\\n`: final);
    the console leaves out a state it has already shown."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    pending, shown = "", False  # text after the last piece end; whether it is on screen already
    while True:
        if pending and not shown and not poller.poll(int(idle_s * 1000)):
            emit(pending, final=False)  # a bar waiting for its next redraw, or a line not ended yet
            shown = True
            continue
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if not data:
            break
        parts = re.split(r"(\r\n|\r|\n)", pending + decoder.decode(data))  # piece, end, ..., rest
        rest = parts.pop()
        for i in range(0, len(parts), 2):
            emit(parts[i], final=parts[i + 1] != "\r")
        shown = shown and rest == pending and not parts
        pending = rest
    emit(pending + decoder.decode(b"", final=True))
