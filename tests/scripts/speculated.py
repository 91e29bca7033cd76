"""The same push_pull called again and again in an all-reduce job: from the second call
on, each worker sends b_i·x at once and the step header (Σb, the check that every
worker's tensors agree) runs beside the sums. Rank r pushes r + 1 with batch size r + 1;
saves what each form returned, and the message of an all-zero-weight call, after which
the engine must still work."""
import sys
from pathlib import Path

import torch

import hetrain
from hetrain.errors import UserError

hetrain.init()
r = hetrain.rank()
x = torch.full((5,), float(r + 1))
res = {"average": [hetrain.push_pull(x, name="x", batch_size=r + 1) for _ in range(3)],
       "sum": [hetrain.push_pull(x, average=False, name="x") for _ in range(3)]}
handles = [hetrain.push_pull_async(x * k, name="x", batch_size=r + 1) for k in (1, 2, 3)]
res["async"] = [hetrain.synchronize(h) for h in handles]
inplace = []
for _ in range(3):
    named = [("a", torch.full((3,), float(r + 1))), ("b", torch.full((2, 2), float(10 * (r + 1))))]
    hetrain.push_pull(named, batch_size=r + 1)
    inplace.append(torch.cat([t.reshape(-1) for _, t in named]))
res["inplace"] = inplace
# half precision: the sum of b_i·x (360,000) would not fit in float16, the average does
half = torch.full((2,), 60000.0, dtype=torch.float16)
res["half"] = [hetrain.push_pull(half, name="half", batch_size=r + 1) for _ in range(3)]
errors = []
for _ in range(2):  # a new layout, then the same one again (speculated)
    try:
        hetrain.push_pull(torch.ones(4), name="zero", batch_size=0)
    except UserError as err:
        errors.append(str(err))
res["zero"] = errors
res["after"] = hetrain.push_pull(x, name="x", batch_size=r + 1)
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
torch.save(res, out / f"rank{r}.pt")
hetrain.shutdown()
