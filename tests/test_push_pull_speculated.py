"""push_pull called again with the same tensors in an all-reduce job (the engine's
`speculate`: the step header runs beside the sums, which are divided by Σb after):
weighted averages, sums, the async and in-place forms and float16 tensors (whose weighted
sum would overflow) give the same results as the first call, which agreed the layout first; an all-zero-weight call is refused on every
worker and the next call works. (tests/test_faults.py: a worker whose tensors change
while the others speculate is named on every rank.)"""
import torch

from tests.helpers import small_cluster

N = 3


def test_repeated_push_pull_is_the_weighted_average(launch, tmp_path):
    out = tmp_path / "res"
    cluster = small_cluster(workers=N, cpus=0)
    rc, log, _ = launch("speculated.py", str(out), cluster=cluster, mode="allreduce", timeout=20)
    assert rc == 0, log
    w = torch.arange(1.0, N + 1)
    mean = float((w * w).sum() / w.sum())  # rank r pushes r + 1 with batch size r + 1
    for r in range(N):
        got = torch.load(out / f"rank{r}.pt", weights_only=True)
        for call in got["average"] + [got["after"]]:
            torch.testing.assert_close(call, torch.full((5,), mean))
        for call in got["sum"]:
            torch.testing.assert_close(call, torch.full((5,), float(w.sum())))
        for k, call in enumerate(got["async"], start=1):
            torch.testing.assert_close(call, torch.full((5,), k * mean))
        want = torch.cat([torch.full((3,), mean), torch.full((4,), 10 * mean)])
        for call in got["inplace"]:
            torch.testing.assert_close(call, want)
        for call in got["half"]:
            torch.testing.assert_close(call, torch.full((2,), 60000.0, dtype=torch.float16))
        assert len(got["zero"]) == 2 and all("every worker pushed with weight 0" in m for m in got["zero"]), got
