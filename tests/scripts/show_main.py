"""Prints what a script sees of how it was started (name, argv, path[0]) and exits with
the code given as its first argument."""
import json
import os
import sys

print("SEEN", json.dumps({"name": __name__, "argv": sys.argv, "path0": os.path.realpath(sys.path[0]),
                          "file": os.path.realpath(__file__)}), flush=True)
sys.exit(int(sys.argv[1]))
