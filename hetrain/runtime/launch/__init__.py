"""The single launcher: start every worker and summation server of a cluster.

Locally it runs the whole cluster on this host (an *embedded* cluster). Across
machines, the same command runs on each node with `--node-rank` and the master's
address, torchrun-style: node 0 hosts the torch.distributed TCPStore (bound to the
cluster address only, `store.py`) and every process rendezvouses through it; node 0's
launcher decides each round of the job (`leader.py`) and the others follow
(`follower.py`, protocol in `runtime/rounds.py`). The launcher streams each process's
output with a rank prefix (`output.py`).

The layout follows torchrun's elastic agent: the agent (`agent.Launcher`) runs rounds;
processes are started behind one interface (`procs.ProcessBackend`: this host, or Ray
actors); a round watch (`watch.RoundWatch`) only reports what happened and whom to
blame (a `RoundResult` with a `RoundOutcome`); the leader acts on it: it records the
root cause in the store so every survivor names it, stops a hung process, and gives
the rest a grace period to stop. With `--max-restarts N` it then starts a new round
from the last commit (`hetrain.train.elastic`) on the machines still in
(`supervisor.py`); otherwise it returns non-zero with the failing rank's error.

It fails fast, in the user's terms (`preflight.py`): a script or module that does not
exist, workers that ask for more cores than the host has, or GPUs the node lacks are
refused before anything starts; a process that exits before the job has formed
(before the rendezvous completes) ends the round at once, since the others would only
wait for it.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .agent import Launcher
    from .config import EXIT_RESIZE, EXIT_STOPPED, LaunchConfig
    from .preflight import check_entry_point
    from .procs import Child, LocalProcesses, ProcessBackend, full_env, process_args, process_env, start_process
    from .watch import RoundOutcome, RoundResult

# Names load on first use (PEP 562): the agent imports torch (runtime/devices.py), and
# `hetrain launch` checks its arguments and cluster file before paying for that, so a
# mistake is answered in well under a second.
_WHERE = {"Launcher": "agent", "EXIT_RESIZE": "config", "EXIT_STOPPED": "config", "LaunchConfig": "config",
          "check_entry_point": "preflight", "Child": "procs", "LocalProcesses": "procs", "ProcessBackend": "procs",
          "full_env": "procs", "process_args": "procs", "process_env": "procs", "start_process": "procs",
          "RoundOutcome": "watch", "RoundResult": "watch"}

__all__ = ["EXIT_RESIZE", "EXIT_STOPPED", "Child", "LaunchConfig", "Launcher", "LocalProcesses", "ProcessBackend",
           "RoundOutcome", "RoundResult", "check_entry_point", "full_env", "launch", "process_args", "process_env",
           "start_process"]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def launch(cfg: "LaunchConfig") -> int:
    from .agent import Launcher

    return Launcher(cfg).run()
