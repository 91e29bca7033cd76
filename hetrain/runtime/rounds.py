"""The store protocol between the launchers of a job (node 0 leads, the others follow).

Node 0's launcher hosts the TCPStore and decides every round (`Supervisor` policy in
`supervisor.py`); a launcher on another node (an *agent*) joins with a proof of the job
secret, beats a node heartbeat, and starts or stops its node's share of each round's
processes. Everything is a small string under `hetrain/`; nothing is unpickled.

    hetrain/nonce                  per job, for join proofs
    hetrain/joins                  counter; hetrain/join/<i> = JSON join request i
    hetrain/node/<k>/hb            node k's launcher heartbeat counter
    hetrain/host/<k>               node k's host (devices.host_key): nodes on one host share its GPUs
    hetrain/round                  counter: round r is published when it reaches r+1
    hetrain/roundspec/<r>          JSON {"machines": [...]} of round r
    hetrain/job                    "<exit code>" once the job is over
    round<r>/hetrain/exit/<rank>   "<code> <1 if it failed because it lost a peer>"
    round<r>/hetrain/dead/<rank>   "died: how" | "hung: why" (the root cause; survivors read it)
    round<r>/hetrain/teardown      the leader ends round r: agents stop their processes
    round<r>/hetrain/resize        a machine is coming back: workers stop at their next commit
    round<r>/hetrain/commits       counter bumped by each commit (progress)
"""
from __future__ import annotations

import json
from dataclasses import dataclass

ROUND = "hetrain/round"
JOB = "hetrain/job"
JOINS = "hetrain/joins"
NODE_HB = "hetrain/node/{}/hb"
HOST = "hetrain/host/{}"
EXIT = "hetrain/exit/{}"
TEARDOWN = "hetrain/teardown"
RESIZE = "hetrain/resize"
COMMITS = "hetrain/commits"


def spec_key(r: int) -> str:
    return f"hetrain/roundspec/{r}"


def join_key(i: int) -> str:
    return f"hetrain/join/{i}"


@dataclass(frozen=True)
class JoinRequest:
    node: int
    instance: str
    proof: str

    def dumps(self) -> str:
        return json.dumps({"node": self.node, "instance": self.instance, "proof": self.proof})

    @classmethod
    def loads(cls, raw: bytes) -> "JoinRequest | None":
        """A request as posted, or None for anything malformed (the store is writable
        by anyone on the cluster network: parse defensively, never trust types)."""
        try:
            d = json.loads(raw.decode())
            return cls(int(d["node"]), str(d["instance"])[:64], str(d["proof"])[:128])
        except Exception:
            return None


def publish_round(store, r: int, machines: list[str]) -> None:
    store.set(spec_key(r), json.dumps({"machines": list(machines)}))
    store.add(ROUND, 1)


def latest_round(store) -> int:
    """The newest published round, -1 if none yet."""
    return int(store.add(ROUND, 0)) - 1


def round_machines(store, r: int) -> list[str]:
    return list(json.loads(store.get(spec_key(r)).decode())["machines"])


def post_exit(rstore, rank: int, code: int, consequence: bool) -> None:
    rstore.set(EXIT.format(rank), f"{code} {int(consequence)}")


def read_exit(rstore, rank: int) -> tuple[int, bool] | None:
    if not rstore.check([EXIT.format(rank)]):
        return None
    code, cons = rstore.get(EXIT.format(rank)).decode().split()
    return int(code), cons == "1"


def dead_key(rank: int) -> str:
    """Where the launcher records a rank of this round that died or hung (the root cause)."""
    return f"hetrain/dead/{rank}"
