"""Calls of the API after hetrain.shutdown() in a job of several workers: each is refused
at once with what to do, not turned into a new rendezvous that the other workers never
join (which hung until the timeout, or failed on a refused connection)."""
import torch

import hetrain
from hetrain.errors import UserError

hetrain.init()
me = hetrain.rank()
x = torch.full((3,), float(me + 1))
hetrain.push_pull([("x", x)])
print(f"rank {me} averaged {x.tolist()}", flush=True)
hetrain.shutdown()
for name, call in (("rank", hetrain.rank), ("push_pull", lambda: hetrain.push_pull([("x", x)])),
                   ("broadcast_parameters", lambda: hetrain.broadcast_parameters([x]))):
    try:
        call()
    except UserError as err:
        print(f"rank {me} {name} refused: {err}", flush=True)
    else:
        print(f"rank {me} {name} ran after shutdown", flush=True)
