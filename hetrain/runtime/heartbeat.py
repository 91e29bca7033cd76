"""Liveness that does not ride on the data plane: tell a hung process from the peers
that merely wait on it.

A process blocked in a gloo receive and the process it waits for look alike from the
data plane: both are silent. So every process also runs a small daemon thread that
bumps a counter key `hetrain/hb/<rank>` in the launcher-hosted TCPStore every
`INTERVAL_S` over its own store connection. The thread keeps beating while the main
thread waits in gloo (torch releases the GIL there), and stops when the whole process
stops (SIGSTOP, a debugger) or wedges holding the GIL.

Two observers read the counters:

- the launcher (`Liveness`), which polls every rank's counter and declares a rank
  *hung* once its counter has not moved for the peer timeout. For its own children it
  also reads `/proc/<pid>/stat`, which shows a stopped process as state `T`/`t` at once
  and covers a process that has not started beating yet (still importing torch);
- a survivor whose collective failed (`stale_ranks`): it samples the counters over a
  few seconds; a rank whose counter stands still while the others move is the one
  that hangs, not a peer that waits on it.

Counters, not timestamps: the nodes' clocks need not agree.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta

INTERVAL_S = 1.0
KEY = "hetrain/hb/{}"
# a survivor samples the counters this long; healthy ranks beat several times meanwhile
SAMPLE_S = 3.0


LEAVING = "hetrain/hb/{}/leaving"
# a process that has reached interpreter exit stops beating (its threads are frozen)
# while Python and torch finalise, which takes seconds on a loaded host: give it this
# much longer than the peer timeout before calling it hung
LEAVING_EXTRA_S = 30.0


def key(rank: int) -> str:
    return KEY.format(rank)


def mark_leaving(store, rank: int, heartbeat: "Heartbeat | None" = None) -> None:
    """Called at interpreter exit (atexit): from here on silence is expected. Then the
    heartbeat stops, and its thread ends before the interpreter finalises (see
    `Heartbeat.stop`); a beat in flight takes at most the heartbeat store's timeout."""
    try:
        store.set_timeout(timedelta(seconds=2))
        store.set(LEAVING.format(rank), "1")
    except Exception:
        pass
    if heartbeat is not None:
        heartbeat.stop(join_s=heartbeat.timeout_s + 1.0)


class Heartbeat:
    """Process side: bump this rank's counter every `interval` seconds until stopped.

    It opens its own store client so a main thread that holds the shared client (or
    changed its timeout) never delays a beat; after a failed beat (a link that was down
    longer than the op timeout) it reconnects rather than reuse a broken socket.
    """

    def __init__(self, host: str, port: int, prefix: str, rank: int, interval: float = INTERVAL_S,
                 keyfmt: str = KEY):
        self.host, self.port, self.prefix, self.rank, self.interval = host, port, prefix, rank, interval
        self.key = keyfmt.format(rank)
        self.timeout_s = max(5.0, 5 * interval)  # the longest one beat may take
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"hetrain-heartbeat-{rank}", daemon=True)
        self.beats = 0

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self, join_s: float = 0.0) -> None:
        """Stop beating; with `join_s`, wait up to that long for the thread to end.

        At interpreter exit the thread must be gone before Python finalises: a daemon
        thread still inside a store call then (the C++ client, GIL released) is ended by
        the interpreter with a forced unwind through torch's C++ frames, which aborts the
        whole process ("terminate called without an active exception")."""
        self._stop.set()
        if join_s > 0 and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(join_s)

    def _connect(self):
        import torch.distributed as dist

        client = dist.TCPStore(self.host, self.port, None, False, timeout=timedelta(seconds=self.timeout_s))
        return dist.PrefixStore(self.prefix, client) if self.prefix else client

    def _loop(self) -> None:
        store = None
        while not self._stop.is_set():
            try:
                if store is None:
                    store = self._connect()
                store.add(self.key, 1)
                self.beats += 1
            except Exception:  # store unreachable for now: try a fresh connection next beat
                store = None
            self._stop.wait(self.interval)


def read_counters(store, ranks, keyfmt: str = KEY) -> dict[int, int]:
    """Current counter of each rank (0: has not beaten yet). `add(key, 0)` reads a
    counter without blocking on a missing key, as `get` would."""
    return {r: int(store.add(keyfmt.format(r), 0)) for r in ranks}


def stale_ranks(store, ranks, sample_s: float = SAMPLE_S) -> list[int]:
    """Ranks whose heartbeat stood still over `sample_s` seconds while others beat.

    Used by a survivor after a collective failed with no rank reported dead: the ranks
    it returns are hung; the ones that beat are alive (and probably wait too). Returns
    [] when nothing moved at all (then the store, not a peer, is what is silent).
    """
    ranks = list(ranks)
    try:
        before = read_counters(store, ranks)
        time.sleep(sample_s)
        after = read_counters(store, ranks)
    except Exception:
        return []
    moved = [r for r in ranks if after[r] != before[r]]
    if not moved:
        return []
    return [r for r in ranks if after[r] == before[r] and after[r] > 0]


def proc_state(pid: int) -> str | None:
    """The kernel's one-letter state of a local process (R, S, D, T, t, Z...), or None
    when it is gone. `T` (stopped by a signal) and `t` (stopped by a tracer) mean it
    cannot answer anyone, however long one waits."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode(errors="replace")
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces or ')'
    return stat[stat.rfind(")") + 2:][:1] or None


STOPPED_STATES = ("T", "t")


@dataclass
class _Seen:
    value: int = 0
    changed_at: float = 0.0
    stopped_since: float | None = None
    leaving: bool = False


class Liveness:
    """Launcher side: which ranks of a round have gone silent, and for how long.

    `poll()` reads every rank's counter (and the /proc state of the local children it is
    given pids for); `hung(hang_s)` returns the ranks silent for at least `hang_s` with
    the reason, for the message. A rank that exited is dropped with `forget`.
    """

    def __init__(self, store, ranks, clock=time.monotonic, keyfmt: str = KEY):
        self.store = store
        self.clock = clock
        self.keyfmt = keyfmt
        now = clock()
        self.seen = {r: _Seen(0, now) for r in ranks}
        self.pids: dict[int, int] = {}

    def watch_pid(self, rank: int, pid: int) -> None:
        self.pids[rank] = pid

    def track(self, rank: int) -> None:
        """Start (or restart) watching `rank`, from its current counter."""
        self.seen[rank] = _Seen(int(self.store.add(self.keyfmt.format(rank), 0)), self.clock())

    def forget(self, rank: int) -> None:
        self.seen.pop(rank, None)
        self.pids.pop(rank, None)

    def poll(self) -> None:
        now = self.clock()
        try:
            counters = read_counters(self.store, list(self.seen), self.keyfmt)
        except Exception:
            counters = {}
        for r, s in self.seen.items():
            v = counters.get(r)
            if v is not None and v != s.value:
                s.value, s.changed_at = v, now
            elif not s.leaving and s.value > 0 and now - s.changed_at > 2 * INTERVAL_S:
                try:
                    s.leaving = bool(self.store.check([LEAVING.format(r)]))
                except Exception:
                    pass
            pid = self.pids.get(r)
            state = proc_state(pid) if pid is not None else None
            if state in STOPPED_STATES:
                s.stopped_since = s.stopped_since if s.stopped_since is not None else now
            else:
                s.stopped_since = None

    def silent_for(self, rank: int) -> float:
        """Seconds since `rank` last showed a sign of life (0 if it never beat yet and
        is not stopped: a process still starting is not silent)."""
        s = self.seen.get(rank)
        if s is None:
            return 0.0
        now = self.clock()
        stopped = now - s.stopped_since if s.stopped_since is not None else 0.0
        beat = now - s.changed_at if s.value > 0 else 0.0
        return max(stopped, beat)

    def reason(self, rank: int) -> str:
        s = self.seen[rank]
        silent = self.silent_for(rank)
        if s.leaving and s.stopped_since is None:
            return f"it reached interpreter exit but did not exit within {silent:.0f} s (hung while exiting)"
        if s.stopped_since is not None:
            return f"its process is stopped (state T, e.g. SIGSTOP) and sent no heartbeat for {silent:.0f} s"
        return f"it sent no heartbeat for {silent:.0f} s (hung)"

    def hung(self, hang_s: float) -> list[int]:
        """Ranks silent for at least `hang_s` (ranks that are exiting: `hang_s` plus
        LEAVING_EXTRA_S, unless stopped by a signal), longest silent first."""
        def limit(r: int) -> float:
            s = self.seen[r]
            return hang_s + LEAVING_EXTRA_S if s.leaving and s.stopped_since is None else hang_s

        return sorted((r for r in self.seen if self.silent_for(r) >= limit(r)), key=lambda r: -self.silent_for(r))
