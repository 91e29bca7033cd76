"""This process's shared-memory mailbox and the two threads that move its messages
(comm/shm/channel.py says how the channels work and why this way): `Pump` makes the
mailbox (comm/shm/mailbox.py) and a channel per partner, and a `_Lane` per direction
writes sends into the peers' rings or reads this process's rings into receives."""
from __future__ import annotations

import atexit
import threading
from collections.abc import Callable, Sequence

from .channel import NAP_MAX, NAP_STREAM, ShmChannel
from .mailbox import Mailbox
from .waits import CHECK_S


class Pump:
    """This process's mailbox and the two threads that move its shared-memory messages
    (see the module docstring): one writes sends into the peers' rings, one reads this
    process's rings into receives, so a server copies its next pushes in while it copies
    the last sum out; callers move their own messages too when they can (`help`).
    `partners`: the ranks that may send to it and receive from it over shared memory;
    `lost()` gives ranks the launcher knows to be dead or hung."""

    def __init__(self, job_id: str, secret: str, key: str, rank: int, partners: Sequence[int],
                 timeout_s: float = 60.0, lost: Callable[[], Sequence[int]] | None = None, **ring):
        self.job_id, self.secret, self.key, self.rank = job_id, secret, key, rank
        self.timeout_s = timeout_s
        self._lost = lost
        self.mailbox = Mailbox(job_id, secret, key, rank, partners, **ring)
        self.slot_bytes = self.mailbox.slot_bytes
        self.keep: list = []  # the peers' mailboxes mapped here (kept for the process's life)
        self.channels = {p: ShmChannel(self, p) for p in self.mailbox.senders}
        self.lanes = (_Lane(self, sending=False), _Lane(self, sending=True))
        atexit.register(self.close)

    def close(self, wait_s: float = 1.0) -> None:
        """Stop the threads (at exit, while the interpreter is whole: a daemon thread
        inside a copy when the interpreter finalises would abort the process, see
        runtime/settle.py) and unlink the mailbox's name if a sender never attached.
        The mappings stay until the process ends (a peer may still write into them)."""
        for lane in self.lanes:
            lane.stop = True
            lane.bell.set()
        for lane in self.lanes:
            lane.thread.join(wait_s)
        self.mailbox.segment.unlink()

    def wake(self, sending: bool) -> None:
        self.lanes[sending].bell.set()

    def lost_ranks(self) -> Sequence[int]:
        return self._lost() if self._lost is not None else ()


class _Lane:
    """One of a pump's threads: the sends of every channel, or the receives, each
    channel's under that direction's lock."""

    def __init__(self, pump: Pump, sending: bool):
        self.pump, self.sending = pump, sending
        self.bell = threading.Event()  # rung when a work is posted
        self.stop = False
        name = "hetrain-shm-send" if sending else "hetrain-shm-recv"
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        """Move what can move, sleep a little when nothing could (a growing nap while
        anything is outstanding, until the next post when nothing is). A daemon thread:
        a process that leaves mid-step does not wait for it. The receiving lane also
        unlinks the mailbox's name once every sender has attached."""
        sending, box = self.sending, self.pump.mailbox
        nap, chans = 0.0, list(self.pump.channels.values())
        while not self.stop:
            self.bell.clear()  # before looking: a post from here on rings again
            moved = False
            for ch in chans:
                with ch.locks[sending]:
                    try:
                        moved |= ch.pump_out() if sending else ch.pump_in()
                    except Exception as err:  # handed to whoever waits on the channel's works
                        ch.fail(err, sending)
            tidy = sending or moved or not box.segment.linked or box.tidy()
            if moved:
                nap = 0.0
                continue
            if any(ch.outstanding(sending) for ch in chans):
                cap = NAP_STREAM if any(ch.streaming(sending) for ch in chans) else NAP_MAX
                nap = min(cap, max(1e-5, nap * 2))
                timeout: float | None = nap
            else:
                timeout = None if tidy else CHECK_S
            if self.bell.wait(timeout):
                nap = 0.0
