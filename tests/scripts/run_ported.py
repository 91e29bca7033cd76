"""Run the Horovod- and BytePS-style example scripts (examples/horovod, examples/byteps)
one after another in this worker, as `python script.py ARGS` would (each as __main__,
with its own argv), and save the RESULT line each printed (one launched job for all)."""
import contextlib
import io
import json
import runpy
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parents[2] / "examples"
out = Path(sys.argv[1])
ck = str(out / "ck-{epoch}.pt")
RUNS = [
    ("horovod/synthetic_benchmark.py", []),
    ("horovod/synthetic_benchmark.py", ["--use-adasum"]),
    ("horovod/mnist.py", ["--epochs", "1"]),
    ("horovod/imagenet_resume.py", ["--epochs", "1", "--checkpoint-format", ck]),
    ("horovod/imagenet_resume.py", ["--epochs", "2", "--checkpoint-format", ck]),  # resumes from epoch 1
    ("byteps/synthetic_benchmark.py", []),
    ("byteps/mnist.py", ["--epochs", "1"]),
]
out.mkdir(parents=True, exist_ok=True)
results = []
for script, args in RUNS:
    sys.argv = [str(EXAMPLES / script), *args]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    print(buf.getvalue(), end="", flush=True)
    line = next(x for x in buf.getvalue().splitlines() if x.startswith("RESULT "))
    results.append({"script": script, "args": args, **json.loads(line[len("RESULT "):])})
import hetrain  # noqa: E402  (the examples already joined the job)

(out / f"rank{hetrain.rank()}.json").write_text(json.dumps(results))
