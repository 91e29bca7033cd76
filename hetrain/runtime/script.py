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
into the script's namespace."""
from __future__ import annotations

import os
import runpy
import sys

from .settle import settle_at_exit


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or (args[0] == "-m" and len(args) < 2):
        raise SystemExit("usage: python -m hetrain.runtime.script SCRIPT [ARGS] | -m MODULE [ARGS]")
    settle_at_exit()
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


if __name__ == "__main__":
    main()
