"""Rank 1 stops before joining the job (as a bad script argument would); the others
join and wait for it at the rendezvous."""
import os
import sys

if os.environ.get("RANK") == "1":
    print("exit_early.py: error: unrecognized arguments: --lr=0.1x", file=sys.stderr, flush=True)
    sys.exit(2)
import hetrain  # noqa: E402

hetrain.init()
print("unreachable: the job formed without rank 1", flush=True)
