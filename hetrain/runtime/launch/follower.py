"""A launcher on node k > 0 (an *agent*, in torchrun's words): it joins the job with a
proof of the secret, beats a node heartbeat, and starts or stops its node's share of
each round the leader publishes (`rounds.py`), posting its processes' exits back."""
from __future__ import annotations

import signal
import time
import uuid
from datetime import timedelta

from ..heartbeat import Heartbeat
from ..rounds import JOB, JOINS, NODE_HB, TEARDOWN, JoinRequest, dead_key, join_key, latest_round, post_exit, \
    round_machines
from ..topology import build_topology
from .procs import is_consequence


class Follower:
    """Mixed into the launcher (`agent.Launcher`) of a node other than 0."""

    def _follow(self) -> int:
        from ..auth import join_tag

        store, node = self.store, self.node_rank
        instance = uuid.uuid4().hex[:12]
        nonce = store.get("hetrain/nonce").decode()

        def join() -> None:
            i = int(store.add(JOINS, 1)) - 1
            store.set(join_key(i), JoinRequest(node, instance, join_tag(self.secret, nonce, node, instance)).dumps())

        join()
        beat = Heartbeat(self.master_addr, self.port, "", node, keyfmt=NODE_HB).start()
        self._log(f"hetrain: node {node} joined job at {self.master_addr}:{self.port}; waiting for rounds")
        store.set_timeout(timedelta(seconds=10))
        try:
            return self._follow_rounds(join)
        finally:
            beat.stop(join_s=beat.timeout_s + 1.0)  # gone before the interpreter finalises (Heartbeat.stop)

    def _follow_rounds(self, join) -> int:
        cfg, store, node = self.cfg, self.store, self.node_rank
        current, rstore, posted = -1, None, set()
        lost_since = None
        left_out_since = None  # none of this node's machines runs: the leader may have dropped it
        while True:
            try:
                if store.check([JOB]):
                    rc = int(store.get(JOB).decode())
                    store.set(f"{JOB}/ack/{node}", "1")
                    self._stop_all(grace=3.0)
                    self._log(f"hetrain: the job ended (exit code {rc})")
                    return rc
                latest = latest_round(store)
                if latest > current:
                    if self.children:
                        self._stop_all(grace=3.0)
                        self._post_exits(rstore, posted)
                    current = latest
                    sub = self.cluster.subset(round_machines(store, current))
                    topo = build_topology(sub, cfg.comm.mode)
                    posted = set()
                    rstore = self._start_round(current, sub, topo)
                    self._log(f"hetrain: round {current}: node {node} of {self.cluster.nnodes} starts "
                              f"{len(self.children)} processes")
                    left_out_since = None if self.children else time.monotonic()
                if left_out_since is not None and time.monotonic() - left_out_since > 2 * cfg.comm.timeout_s:
                    join()  # e.g. after a partition healed: prove the secret again to be counted
                    left_out_since = time.monotonic()
                if rstore is not None:
                    self._obey(rstore, posted)
                lost_since = None
            except (RuntimeError, OSError) as err:  # the store (node 0) is unreachable
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since > max(cfg.comm.timeout_s, 30):
                    self._log(f"hetrain: lost the job's master at {self.master_addr}:{self.port} ({err}); "
                              "stopping this node's processes")
                    self._stop_all(grace=3.0)
                    return 1
            time.sleep(0.3)

    def _obey(self, rstore, posted: set) -> None:
        """Post this node's exits; stop what the leader found hung, or the whole round."""
        self._post_exits(rstore, posted)
        for c in self.children:
            if c.popen.poll() is None and rstore.check([dead_key(c.proc.rank)]):
                if rstore.get(dead_key(c.proc.rank)).decode().startswith("hung"):
                    self.backend.signal(c, signal.SIGKILL)
        if any(c.popen.poll() is None for c in self.children) and rstore.check([TEARDOWN]):
            self._stop_all(grace=3.0)
            self._post_exits(rstore, posted)

    def _post_exits(self, rstore, posted: set) -> None:
        for c in self.children:
            if c.proc.rank not in posted and c.popen.poll() is not None:
                if c.reader:
                    c.reader.join(timeout=2)
                post_exit(rstore, c.proc.rank, c.popen.returncode, is_consequence(c))
                posted.add(c.proc.rank)
