"""Workers change the tensors they push mid-job (all together, so it is legal), push
with unequal and zero batch weights, and ask for plain sums; every result is checked
against the value computed locally from every rank's deterministic inputs."""
import torch

import hetrain

hetrain.init()
r, n = hetrain.rank(), hetrain.size()
layouts = {"A": [("a", (7,)), ("b", (30, 20))], "B": [("a", (7,)), ("c", (2000,)), ("b", (30, 20))]}
plan = ["A", "A", "B", "B", "B", "A", "A"]


def value(rank: int, step: int, shape) -> torch.Tensor:
    numel = 1
    for s in shape:
        numel *= s
    return (torch.arange(numel, dtype=torch.float32) * 0.01 + (rank + 1) * (step + 1)).reshape(shape)


for step, name in enumerate(plan):
    weights = [0 if (k == 1 and step == 3) else k + 2 for k in range(n)]  # rank 1 has an empty batch once
    average = step != 4  # step 4: plain sums
    named = [(t, value(r, step, shape)) for t, shape in layouts[name]]
    hetrain.push_pull(named, batch_size=weights[r], average=average)
    for (t, shape), (_, got) in zip(layouts[name], named):
        vals = [value(k, step, shape) for k in range(n)]
        want = sum(w * v for w, v in zip(weights, vals)) / sum(weights) if average else sum(vals)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"step {step} tensor {t}")
print(f"relayout ok on rank {r}", flush=True)
hetrain.shutdown()
