"""How node 0 admits the other nodes' launchers: each proves the job secret to join,
beats a heartbeat while it is in, and is counted out (its machines with it) when the
beat stops, until it reconnects. Mixed into `leader.Leader`; the round decisions that
use the set of connected nodes stay there."""
from __future__ import annotations

import time

from ..devices import host_key
from ..heartbeat import Liveness
from ..rounds import HOST, JOINS, NODE_HB, JoinRequest, join_key


class NodeAdmission:
    """The connected node launchers of a job (`node_instance`), kept by node 0."""

    def _hosts(self) -> dict[int, str]:
        """The host of each connected node (node 0: this one), as their launchers said."""
        hosts = {0: host_key()}
        for node in self.node_instance:
            try:
                if self.store.check([HOST.format(node)]):
                    hosts[node] = self.store.get(HOST.format(node)).decode()[:300]
            except Exception:
                pass
        return hosts

    def _await_nodes(self) -> None:
        """Round 0 starts when every node's launcher joined, or after the rendezvous
        timeout without the missing ones (they join later, at a commit)."""
        wait_s = max(60.0, self.cfg.comm.timeout_s)
        end = time.monotonic() + wait_s
        want = set(range(1, self.cluster.nnodes))
        while set(self.node_instance) < want and time.monotonic() < end:
            self._scan_joins()
            time.sleep(0.2)
        for node in sorted(want - set(self.node_instance)):
            self.membership.node_lost(node)
            self._log(f"hetrain: node {node}'s launcher did not join within {wait_s:.0f} s; starting without its "
                      "machines (they join when it connects)")

    def _scan_joins(self) -> None:
        """Admit node launchers that prove the job secret; report any that do not."""
        from ..auth import check_join

        n = int(self.store.add(JOINS, 0))
        nonce = self.store.get("hetrain/nonce").decode()
        while self._joins_seen < n:
            k = join_key(self._joins_seen)
            if not self.store.check([k]):  # counted but not written yet: look again soon
                self._join_missing_since = self._join_missing_since or time.monotonic()
                if time.monotonic() - self._join_missing_since < 5:
                    return
                self._joins_seen += 1
                continue
            self._joins_seen += 1
            self._join_missing_since = None
            req = JoinRequest.loads(self.store.get(k))
            if req is None or not check_join(self.secret, nonce, req.node, req.instance, req.proof):
                self._log(f"hetrain: refused a process that asked to join the job as node {getattr(req, 'node', '?')}: "
                          "it does not prove this job's secret (HETRAIN_SECRET / --secret-file); the job goes on "
                          "without it")
                continue
            if not 1 <= req.node < self.cluster.nnodes:
                self._log(f"hetrain: refused a launcher that asked to join as node {req.node}: this job's nodes are "
                          f"0..{self.cluster.nnodes - 1} and node 0 leads it")
                continue
            self._admit(req)

    def _admit(self, req: JoinRequest) -> None:
        connected = req.node in self.node_instance
        self.node_instance[req.node] = req.instance
        if self.node_live is None:
            self.node_live = Liveness(self.store, [], keyfmt=NODE_HB)
        self.node_live.track(req.node)
        self.membership.node_back(req.node)
        if not connected:
            seen = req.node in self._nodes_ever
            self._nodes_ever.add(req.node)
            self._log(f"hetrain: node {req.node}'s launcher {'reconnected' if seen else 'joined'}")

    def _watch_nodes(self) -> list[int]:
        """Nodes whose launcher stopped beating for the peer timeout: their machines
        are out until it reconnects."""
        if self.node_live is None:
            return []
        self.node_live.poll()
        lost = self.node_live.hung(self.cfg.comm.timeout_s)
        for node in lost:
            self.node_live.forget(node)
            self.node_instance.pop(node, None)
            self.membership.node_lost(node)
            self._log(f"hetrain: node {node}'s launcher stopped answering for {self.cfg.comm.timeout_s:.0f} s; "
                      "its machines are out until it reconnects")
        return lost
