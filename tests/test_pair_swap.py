"""Two members summing a bucket by swapping it (comm/p2p.py `Swap`): two real processes over
gloo; both hold the same bits, equal to a + b and to gloo's own all-reduce."""
import json
import subprocess
import sys

from tests.helpers import free_port, repo_env


CHILD = r"""
import json, sys, torch, torch.distributed as dist
from hetrain.comm import p2p
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
g = torch.Generator().manual_seed(0)
mine = [torch.randn(1000, generator=g) * 10 ** torch.randint(-6, 6, (1000,), generator=g) for _ in range(2)]
a, b = mine[rank].clone(), mine[1 - rank].clone()
swapped, reduced = a.clone(), a.clone()
works = [p2p.Swap(swapped[:600], torch.empty(600), 1 - rank, p2p.PAIR(0), None, "test"),
         p2p.Swap(swapped[600:], torch.empty(400), 1 - rank, p2p.PAIR(1), None, "test")]
for w in works:
    w.wait()
dist.all_reduce(reduced)
print("SEEN " + json.dumps({"swapped": swapped.view(torch.int32).tolist(),
                            "reduced": reduced.view(torch.int32).tolist(),
                            "sum": (mine[0] + mine[1]).view(torch.int32).tolist()}))
dist.destroy_process_group()
"""



def test_a_swap_sums_two_buckets_to_the_same_bits_on_both_members():
    port = free_port()
    env = repo_env(GLOO_SOCKET_IFNAME="lo")
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(r), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    seen = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        [line] = [ln for ln in out.splitlines() if ln.startswith("SEEN ")]
        seen.append(json.loads(line[5:]))
    assert seen[0]["swapped"] == seen[1]["swapped"] == seen[0]["sum"]  # bit for bit: IEEE addition commutes
    assert seen[0]["reduced"] == seen[0]["swapped"]
