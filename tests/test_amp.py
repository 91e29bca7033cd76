"""torch.amp.GradScaler with a DistributedOptimizer (api/amp.py): when one worker's
gradients overflow, every worker skips that step and lowers its scale alike (before,
the overflowing worker skipped the exchange while the others waited in it), and with
overlap the update uses unscaled gradients. Two workers against one process."""
import sys
import warnings

import torch
import torch.nn.functional as F

from tests.helpers import SCRIPTS, small_cluster

sys.path.insert(0, str(SCRIPTS))
from reference import data, global_batch, make_model  # noqa: E402

STEPS, BAD_STEP = 5, 2


def _single_process(clip=None):
    x, y = data()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)
    for step in range(STEPS):
        idx = global_batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        if step == BAD_STEP:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
    return model.state_dict(), scaler.get_scale()


def test_grad_scaler_agrees_across_workers(launch, tmp_path):
    out = tmp_path / "res"
    rc, log, _ = launch("amp_train.py", str(out), cluster=small_cluster(workers=2, cpus=1), mode="allreduce",
                        timeout=15)
    assert rc == 0, log  # before: the overflowing worker skipped the exchange, the other waited (timeout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = {"plain": _single_process(), "plain_overlap": _single_process(), "horovod": _single_process(0.5)}
    assert want["plain"][1] == 2.0 ** 13  # doubled after 2 good steps, halved at the bad one, doubled again
    for r in range(2):
        got = torch.load(out / f"rank{r}.pt", weights_only=True)
        for loop, (weights, scale) in want.items():
            assert got[loop]["scale"] == scale, (r, loop)
            for name, w in weights.items():
                torch.testing.assert_close(got[loop]["weights"][name], w, rtol=1e-5, atol=1e-6,
                                           msg=f"rank {r} {loop} {name}")
