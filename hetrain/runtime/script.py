"""How `hetrain launch` runs a worker's training script:

    python -u -m hetrain.runtime.script SCRIPT [ARGS...]
    python -u -m hetrain.runtime.script -m MODULE [ARGS...]

runs SCRIPT (or MODULE) exactly as `python SCRIPT ARGS` (`python -m MODULE ARGS`) would:
`__name__ == "__main__"`, `sys.argv` and the script's directory first on `sys.path`. The
one addition: `settle_native_threads` (runtime/settle.py) is registered at exit before
anything the script registers, so it runs after the script's own exit handlers and
before the interpreter finalises. A torchrun script then does not abort at exit when a
gloo worker thread is still releasing the last collective of its backward pass, which
plain torchrun runs of the same script do now and then. Nothing of hetrain is imported
into the script's namespace. A script that raises shows its traceback from its own
first frame, as `python SCRIPT` prints it, without this module's and runpy's frames."""
from __future__ import annotations

import os
import runpy
import sys
import types

from .settle import settle_at_exit


def _script_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback from the user's first frame on: this module's and runpy's frames
    (the wrapper) cut off the front."""
    wrapper = (os.path.abspath(__file__), runpy.__file__)
    while tb is not None and (tb.tb_frame.f_code.co_filename in wrapper
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    return tb


def _run(args: list[str]) -> None:
    if args[0] == "-m":
        name = args[1]
        sys.argv = [name, *args[2:]]  # run_module(alter_sys=True) puts the module's file in argv[0]
        sys.path[0] = os.getcwd()  # as `python -m`: the current directory first
        runpy.run_module(name, run_name="__main__", alter_sys=True)
        return
    script = args[0]
    sys.argv = [script, *args[1:]]
    # as `python SCRIPT`: the script's own directory first (a directory or zip with a
    # __main__.py is put there by run_path itself)
    sys.path[0] = os.path.dirname(os.path.realpath(script)) if os.path.isfile(script) else script
    runpy.run_path(script, run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or (args[0] == "-m" and len(args) < 2):
        raise SystemExit("usage: python -m hetrain.runtime.script SCRIPT [ARGS] | -m MODULE [ARGS]")
    settle_at_exit()
    try:
        _run(args)
    except Exception as err:  # noqa: BLE001 - printed as Python would, then exit 1 as Python does
        # through sys.excepthook, so hooks the job installed (rank prefix, failure mark) still run
        tb = _script_frames(err.__traceback__) or err.__traceback__
        # hooks may format the exception's own traceback rather than the one passed
        sys.excepthook(type(err), err.with_traceback(tb), tb)
        sys.stderr.flush()
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
