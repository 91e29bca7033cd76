"""Streaming a process's output with its rank prefix, as it arrives."""
from __future__ import annotations

import codecs
import os
import re
import select
from typing import Callable

from .procs import Child


def pump(child: Child, log: Callable[[str], None], quiet: bool, idle_s: float = 0.2) -> None:
    """Forward a process's output as it arrives, one line per `\\n`- or `\\r`-ended
    piece: progress bars redraw with `\\r`, so each redraw shows as its own line while
    the job runs. Output is read in chunks, not lines (a bar ends its line only when
    it closes); a piece with no end yet (a bar waiting for its next redraw) is shown
    once nothing more has arrived for `idle_s`. The last lines stay in `child.tail`."""
    prefix = f"[{child.proc.rank}:{child.proc.label}]"

    def emit(piece: str) -> None:
        if piece.strip():
            child.tail.append(piece)
            if not quiet:
                log(f"{prefix} {piece}")

    stream = child.popen.stdout
    if not hasattr(stream, "fileno"):  # a remote process (Ray) hands over its output line by line
        for line in stream:
            for piece in re.split(r"[\r\n]", line if isinstance(line, str) else line.decode(errors="replace")):
                emit(piece)
        return
    fd = stream.fileno()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    pending, shown = "", 0  # text after the last line end, and how much of it is already shown
    while True:
        if len(pending) > shown and not poller.poll(int(idle_s * 1000)):
            emit(pending[shown:])
            shown = len(pending)
            continue
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if not data:
            break
        pieces = re.split(r"[\r\n]", pending + decoder.decode(data))
        pending = pieces.pop()
        if pieces:
            emit(pieces[0][shown:])
            for piece in pieces[1:]:
                emit(piece)
            shown = 0
    emit(pending[shown:] + decoder.decode(b"", final=True))
