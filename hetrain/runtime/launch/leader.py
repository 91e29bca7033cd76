"""Node 0's side of a job: it decides every round (which machines, when to restart or
resize, when the job is over) and acts on what the round watch reports. Its policy for
machines that fail or come back is `supervisor.Membership`; the store protocol with the
other nodes' launchers is `rounds.py`."""
from __future__ import annotations

import signal
import time
import uuid

from ...errors import UserError
from .. import STOP_REQUESTED
from ..devices import host_clash
from ..env import round_prefix
from ..rounds import COMMITS, JOB, RESIZE, TEARDOWN, dead_key, publish_round, read_exit
from ..supervisor import Membership
from ..topology import Topology, build_topology
from .admission import NodeAdmission
from .config import EXIT_STOPPED
from .watch import RootCause, RoundOutcome, RoundResult, RoundWatch, joined


class Leader(NodeAdmission):
    """Mixed into the launcher (`agent.Launcher`) of node 0 or of a one-host job."""

    def _lead(self) -> int:
        cfg, el = self.cfg, self.cfg.elastic
        self.membership = Membership(self.cluster, el, probe=self._probe)
        self._joins_seen, self._join_missing_since = 0, None
        self.node_instance: dict[int, str] = {}
        self._nodes_ever: set[int] = set()
        self.node_live = None
        if self.multinode:
            self._await_nodes()
            clash = host_clash(build_topology(self.cluster, cfg.comm.mode), cfg.comm, self._hosts())
            if clash:
                self._log(f"hetrain: job refused: {clash}")
                return self._end_job(1)
        restarts, r = 0, 0
        while True:
            back = self.membership.ready_to_return() if r > 0 else []
            if back:
                self.membership.readmit(back)
                self._log(f"hetrain: machine(s) {', '.join(back)} healthy again: back in the job")
            try:
                sub = self.membership.next_cluster()
                topo = build_topology(sub, cfg.comm.mode)
            except UserError as err:
                self._log(f"hetrain: job failed: no usable cluster without the machines left out "
                          f"({', '.join(self.membership.left_out())}): {err}")
                return self._end_job(1)
            if len(topo.workers) < el.min_workers:
                self._log(f"hetrain: job failed: {len(topo.workers)} worker machine(s) left "
                          f"({', '.join(p.machine.name for p in topo.workers)}), fewer than --min-workers "
                          f"{el.min_workers}; left out: {', '.join(self.membership.left_out())}")
                return self._end_job(1)
            if r == 0 and STOP_REQUESTED.is_set():  # asked to stop before any process started: nothing to save
                self._log("hetrain: stop requested before the job started; relaunch to run it")
                return self._end_job(EXIT_STOPPED)
            names = [m.name for m in sub.machines]
            # the round's admission nonce exists before any of its processes asks for it
            self.store.set(f"{round_prefix(r)}/hetrain/nonce", uuid.uuid4().hex)
            self._open_script_store(r)
            if self.multinode:
                publish_round(self.store, r, names)
            rstore = self._start_round(r, sub, topo)
            self._announce(r, topo, names)
            res = self._watch_round(rstore, topo, names, last_chance=restarts >= el.max_restarts)
            decision = self._after_round(res, topo, restarts)
            if decision is not None:
                return self._end_job(decision)
            if res.outcome is RoundOutcome.FAILED:
                restarts += 1
                note = self._last_note
                self._log(f"hetrain: restart {restarts} of {el.max_restarts}: starting round {r + 1} from the last "
                          "commit" + (f"; {note}" if note else ""))
            r += 1

    def _announce(self, r: int, topo: Topology, names: list[str]) -> None:
        what = (f"mode {self.cfg.comm.mode}, {len(topo.workers)} workers + {len(topo.servers)} summation servers "
                f"on {', '.join(names)}")
        if r == 0:
            node = "this node " if self.embedded else f"node 0 of {self.cluster.nnodes} "
            self._log(f"hetrain: job {self.job_id}, {what}; {node}starts {len(self.children)} processes; "
                      f"logs in {self.run_dir}")
        else:
            self._log(f"hetrain: round {r}: {what}")

    def _after_round(self, res: RoundResult, topo: Topology, restarts: int) -> int | None:
        """The job's exit code when this round ends it, None when another round follows."""
        el = self.cfg.elastic
        culprit = res.culprit.machine.name if res.culprit else None
        if res.commits:
            self.membership.progressed(res.names, culprit)
        if res.outcome is RoundOutcome.DONE:
            self._log(f"hetrain: all {len(topo.procs)} processes finished")
            return 0
        if res.outcome is RoundOutcome.STOPPED:
            self._log("hetrain: job stopped at a checkpoint on request; relaunch to resume")
            return EXIT_STOPPED
        if res.outcome is RoundOutcome.RESIZE:
            self.membership.readmit(self.membership.ready_to_return())
            self._log(f"hetrain: workers stopped at a commit for {', '.join(res.joining) or 'a membership change'}"
                      " to join; starting the next round")
            return None
        self._last_note = self.membership.blame(culprit, res.record) if culprit else None
        if restarts >= el.max_restarts or STOP_REQUESTED.is_set():
            why = "" if not el.elastic else (" (stop requested)" if STOP_REQUESTED.is_set()
                                             else f" after {restarts} restart(s) (--max-restarts {el.max_restarts})")
            self._log(f"hetrain: job failed{why}: {res.culprit_text}.{self._last_output(res.tail)}")
            return 1
        return None

    def _last_output(self, tail: list[str]) -> str:
        """The failed process's last output for the closing line: streamed already (not
        --quiet), only its last line (the exception), so a traceback shows once; else
        its last 15 lines."""
        lines = [line for line in tail if line.strip()]
        if not lines:
            return ""
        if not self.cfg.quiet:
            return f" Its last line (its output is above): {lines[-1].strip()}"
        return " Its last output:\n" + "\n".join(f"    {line}" for line in lines[-15:])

    def _watch_round(self, rstore, topo: Topology, names: list[str], last_chance: bool) -> RoundResult:
        """Run the round to its end: the watch reports, this acts (records the culprit,
        stops a hung process, grants the others a grace period, tears the round down)."""
        hang_s = self.cfg.comm.timeout_s
        watch = RoundWatch(rstore, topo, self.children, self.backend, hang_s)
        remote = watch.remote
        never_joined_checked = False
        root: RootCause | None = None
        deadline = None
        joining: list[str] = []
        while True:
            now = time.monotonic()
            if watch.collect(now):
                self._scan_joins()
                for node in self._watch_nodes():
                    watch.mark_lost(node)
                if root is None and not joining:
                    joining = self._ask_resize(rstore, names)
            if root is None:
                root = watch.root_cause(now)
                if root is not None:
                    deadline = now + self._act_on_root(rstore, topo, watch, root, last_chance)
            if root is None and not never_joined_checked and watch.workers_ended:
                never_joined_checked = True  # asked once, when the last worker has ended
                if watch.never_joined():
                    self._log("hetrain: every worker finished without joining the job (the script never called "
                              "hetrain.init()); stopping the summation servers")
                    self._stop_all(grace=3.0)
                    if remote:
                        self._teardown_remote(rstore, remote, watch.exits)
                    watch.servers_done()
            if watch.all_ended:
                break
            if deadline is not None and now > deadline:
                if any(c.popen.poll() is None for c in self.children):
                    self._log("hetrain: some processes did not stop in time; terminating them")
                self._stop_all(grace=3.0)
                if remote:
                    self._teardown_remote(rstore, remote, watch.exits)
                break
            time.sleep(0.1)
        return watch.result(root, names, joining)

    def _ask_resize(self, rstore, names: list[str]) -> list[str]:
        """A machine may join at a commit, but only once this round has made progress of
        its own (two commits: its first is where it resumed), so machines that come and
        go cannot keep the job restarting without training. Returns the machines asked in."""
        if not self.cfg.elastic.elastic or int(rstore.add(COMMITS, 0)) < 2:
            return []
        joining = self._pending(names)
        if joining:
            rstore.set(RESIZE, ",".join(joining))
            self._log(f"hetrain: {', '.join(joining)} can join; asking the workers to stop at their next commit")
        return joining

    def _act_on_root(self, rstore, topo: Topology, watch: RoundWatch, root: RootCause, last_chance: bool) -> float:
        """Record the culprit for every survivor to name, stop it if it hangs; returns
        the grace the others get to stop on their own."""
        try:
            rstore.set(dead_key(root.rank), root.record)
        except Exception:
            pass
        hang_s = self.cfg.comm.timeout_s
        grace = hang_s + 5 if last_chance else min(hang_s, 5.0)
        if root.kind == "hung":
            self._log(f"hetrain: {topo.describe(root.rank)} stopped answering: {root.how}; stopping it")
            if root.rank in watch.local:
                self.backend.signal(watch.local[root.rank], signal.SIGKILL)
        elif not joined(rstore, root.rank):  # the others wait for it at the rendezvous: nothing to wait for
            self._log(f"hetrain: {topo.describe(root.rank)} exited ({root.how}) before the job formed; stopping "
                      "the others now")
            grace = 0.0
        else:
            self._log(f"hetrain: {topo.describe(root.rank)} failed ({root.how}); waiting up to {grace:.0f}s for "
                      "the others to stop")
        return grace

    def _teardown_remote(self, rstore, remote: list[int], exits: dict) -> None:
        """Ask the other nodes' launchers to stop this round's processes; wait a little."""
        try:
            rstore.set(TEARDOWN, "1")
        except Exception:
            return
        end = time.monotonic() + 10
        while time.monotonic() < end and any(k not in exits for k in remote):
            for k in remote:
                if k not in exits:
                    e = read_exit(rstore, k)
                    if e is not None:
                        exits[k] = e
            time.sleep(0.2)

    def _end_job(self, rc: int) -> int:
        """Tell the other nodes' launchers the job is over (once)."""
        if not self._job_over and self.store is not None and self.multinode and self.node_rank in (None, 0):
            self._job_over = True
            try:
                self.store.set(JOB, str(rc))
                # the store lives in this process: keep it up until the connected nodes read the end
                nodes = list(getattr(self, "node_instance", {}))
                end = time.monotonic() + 10
                while nodes and time.monotonic() < end:
                    nodes = [k for k in nodes if not self.store.check([f"{JOB}/ack/{k}"])]
                    time.sleep(0.1)
            except Exception:
                pass
        self._job_over = True
        return rc

    def _probe(self, name: str) -> bool:
        """Independent evidence that a left-out machine of this host works again."""
        if self.netns is not None:
            return self.netns.link_up(name)
        return True

    def _pending(self, names: list[str]) -> list[str]:
        """Machines that should join the running round at its next commit."""
        want = set(self.membership.included()) | set(self.membership.ready_to_return())
        return sorted(want - set(names))
