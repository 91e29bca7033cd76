"""Solver output kept off stdout.

HiGHS (SciPy's MILP/LP solver) writes some debug lines, such as
``HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();``, with the C
library's printf straight to file descriptor 1, whatever `disp` or `output_flag` say;
Python's `sys.stdout` never sees them, so `contextlib.redirect_stdout` cannot catch them.
`quiet_stdout` points descriptor 1 at /dev/null for the duration of a solve (a dup2 pair,
microseconds) and flushes Python's buffer first so nothing printed before is lost.
Descriptor 1 is process-wide: another thread printing during a solve is silenced too,
which is acceptable for its users (the scheduler's policies, perf's split LP, the
planner's MILP): they print between solves, not during them. A small module below every
part, as `errors.py`, so that perf (numpy-only) may import it too.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def quiet_stdout() -> Iterator[None]:
    """Discard whatever is written to file descriptor 1 inside the block."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no descriptor 1 (embedded interpreters): nothing to hide
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)
