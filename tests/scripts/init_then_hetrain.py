"""A torchrun-style script that makes its own process group (`init_process_group()`,
env://) before it calls `hetrain.init()`: hetrain keeps the script's group. Prints the
average of (rank + 1) over the workers as `RESULT`."""
import json

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
import hetrain  # noqa: E402

hetrain.init()
out = hetrain.push_pull(torch.full((4,), float(hetrain.rank() + 1)), name="t", average=True)
print("RESULT", json.dumps({"rank": hetrain.rank(), "size": hetrain.size(), "mean": out.tolist()}), flush=True)
hetrain.shutdown()
