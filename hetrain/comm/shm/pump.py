"""This process's shared-memory mailbox and the two threads that move its messages
(comm/shm/channel.py says how the channels work and why this way): `Pump` makes the
mailbox (comm/shm/mailbox.py) and a channel per partner, and a `_Lane` per direction
writes sends into the peers' rings or reads this process's rings into receives."""
from __future__ import annotations

import atexit
import threading
from collections.abc import Callable, Sequence

from .channel import ATTACH_EVERY, NAP_STREAM, ShmChannel
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
        # the receiving thread sleeps on the mailbox's doorbell, which senders ring when a
        # message starts (doorbell.py), looking unrung only every CHECK_S; the sending
        # thread on an event rung by posts here, looking every ATTACH_EVERY while sends
        # wait for a peer's mailbox to appear (nothing rings then)
        self.lanes = (_Lane(self, False, self.mailbox.bell, idle_s=CHECK_S),
                      _Lane(self, True, threading.Event(), idle_s=ATTACH_EVERY))
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
        self.mailbox.bell.unlink()

    def wake(self, sending: bool) -> None:
        self.lanes[sending].bell.set()

    def lost_ranks(self) -> Sequence[int]:
        return self._lost() if self._lost is not None else ()


class _Lane:
    """One of a pump's threads: the sends of every channel, or the receives, each
    channel's under that direction's lock. `bell` (an event, or the mailbox's doorbell)
    is rung when there is something to move; while works wait and nothing streams, the
    thread also looks every `idle_s` unrung."""

    def __init__(self, pump: Pump, sending: bool, bell, idle_s: float):
        self.pump, self.sending = pump, sending
        self.bell, self.idle_s = bell, idle_s
        self.stop = False
        self.looks = 0  # times the thread looked at its channels (how often it woke)
        name = "hetrain-shm-send" if sending else "hetrain-shm-recv"
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        """Move what can move, sleep when nothing could: a growing nap up to NAP_STREAM
        while a message streams (the peer frees or fills a slot in the time of a chunk's
        copy, and rings nothing), else until the bell (or `idle_s` while works wait). A
        daemon thread: a process that leaves mid-step does not wait for it. The receiving
        lane also unlinks the mailbox's name once every sender has attached."""
        sending, box = self.sending, self.pump.mailbox
        nap, chans = 0.0, list(self.pump.channels.values())
        while not self.stop:
            self.bell.clear()  # before looking: a post from here on rings again
            self.looks += 1
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
            if any(ch.streaming(sending) for ch in chans):
                nap = min(NAP_STREAM, max(1e-5, nap * 2))
                timeout: float | None = nap
            elif any(ch.outstanding(sending) for ch in chans):
                timeout = self.idle_s
            else:
                timeout = None if tidy else CHECK_S
            if self.bell.wait(timeout):
                nap = 0.0
