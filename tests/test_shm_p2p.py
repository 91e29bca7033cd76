"""The shared-memory point-to-point channel (comm/shm/channel.py): gloo's matching and
ordering with many sends posted before any receive, a SIGKILLed peer named within the
heartbeat time with no segment left behind, and no attaching without the job secret."""
from __future__ import annotations

import multiprocessing as mp
import os
import stat
import uuid

import pytest
import torch

from hetrain.comm.shm.doorbell import bell_path
from hetrain.comm.shm.mailbox import Mailbox, attach, mailbox_name
from hetrain.comm.shm.segment import Segment, SegmentAuthError
from hetrain.runtime.shmnames import SHM_DIR, job_segments, remove_job_segments
from tests import shm_p2p_procs as procs


def _run(target, job: str, timeout: float = 120) -> list:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ps = [ctx.Process(target=target, args=(r, 2, job, out)) for r in range(2)]
    for p in ps:
        p.start()
    results = []
    try:
        for _ in range(len(ps)):
            results.append(out.get(timeout=timeout))
            if target is procs.killed:
                break  # rank 1 dies: one report
    finally:
        for p in ps:
            p.join(30)
            if p.is_alive():
                p.kill()
        remove_job_segments(job)
    return sorted(results)


def test_messages_arrive_whole_in_order_with_every_send_posted_first():
    job = f"p2p-{uuid.uuid4().hex[:8]}"
    results = _run(procs.exchange, job)
    assert [(r, ok) for r, ok, _ in results] == [(0, True), (1, True)], results
    assert not any(linked for _, _, linked in results), "a mailbox kept its name after its peer attached"
    assert job_segments(job) == []


def test_a_killed_peer_is_named_soon_and_leaves_no_segment():
    job = f"p2p-{uuid.uuid4().hex[:8]}"
    results = _run(procs.killed, job)
    assert len(results) == 1, results
    rank, msg, waited, ranks = results[0]
    assert rank == 0 and ranks == [1], results
    assert "rank 1 ended" in msg, msg
    assert waited < 5.0, f"the dead peer was named after {waited:.1f} s"
    assert job_segments(job) == [], "a segment outlived the exchange"


def test_a_process_without_the_job_secret_cannot_attach():
    job = f"p2p-{uuid.uuid4().hex[:8]}"
    box = Mailbox(job, procs.SECRET, "t", 0, [1], slots=2, slot_bytes=4096)
    try:
        path = SHM_DIR / mailbox_name(job, procs.SECRET, "t", 0)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        # without the secret the name cannot be computed: another secret names no mailbox
        assert attach(job, "another-secret-of-32-characters!", "t", 0, 1) is None
        # and the mailbox, found by listing /dev/shm, refuses a wrong secret
        with pytest.raises(SegmentAuthError, match="does not carry this job's token"):
            Segment.attach(path.name, "another-secret-of-32-characters!")
        bell = bell_path(path)
        assert stat.S_ISFIFO(os.stat(bell).st_mode) and stat.S_IMODE(os.stat(bell).st_mode) == 0o600
        seg, ring, ring_bell = attach(job, procs.SECRET, "t", 0, 1)
        assert ring.sender_pid == os.getpid()
        assert box.tidy() and not path.exists() and not bell.exists()  # its one sender attached: the names go
        seg.close()
        ring_bell.close()
    finally:
        box.close()
        remove_job_segments(job)


def test_a_rank_without_a_ring_in_the_mailbox_is_refused():
    job = f"p2p-{uuid.uuid4().hex[:8]}"
    box = Mailbox(job, procs.SECRET, "t", 0, [1], slots=2, slot_bytes=4096)
    try:
        with pytest.raises(Exception, match="has no ring for rank 5"):
            attach(job, procs.SECRET, "t", 0, 5)
    finally:
        box.close()
        remove_job_segments(job)


def test_a_strided_tensor_is_refused_when_posted():
    job = f"p2p-{uuid.uuid4().hex[:8]}"
    from hetrain.comm.shm.pump import Pump

    pump = Pump(job, procs.SECRET, "t", 0, [1], timeout_s=5, slots=2, slot_bytes=4096)
    try:
        with pytest.raises(ValueError, match="contiguous"):
            pump.channels[1].isend(torch.zeros(4, 4).t(), 3)
    finally:
        pump.close()
        pump.mailbox.close()
        remove_job_segments(job)


def test_an_idle_receiver_sleeps_until_a_message_rings_its_doorbell():
    """A receive posted long before its message: the pump's receiving thread sleeps
    instead of looking at its rings (a handful of looks while the receive waits 0.6 s
    for nothing, where polling would make thousands), and the message's first chunk
    wakes it."""
    from hetrain.comm.shm.pump import Pump

    job = f"p2p-{uuid.uuid4().hex[:8]}"
    pump = Pump(job, procs.SECRET, "t", 0, [1], timeout_s=5, slots=2, slot_bytes=4096)
    try:
        found = attach(job, procs.SECRET, "t", 0, 1)  # this test plays rank 1, writing by hand
        seg, ring, bell = found
        buf = torch.zeros(10)
        lane = pump.lanes[0]
        before = lane.looks
        work = pump.channels[1].irecv(buf, 7)  # rings this process's own bell: one look
        assert not work.done.wait(0.6), "a receive completed with nothing sent"
        idle_looks = lane.looks - before
        msg = torch.arange(10, dtype=torch.float32)
        ring.put(7, msg.numel() * 4, 0, msg.view(torch.uint8))
        bell.set()
        assert work.done.wait(5.0), "the rung receiver never took its message"
        assert torch.equal(buf, msg)
        assert idle_looks <= 6, f"the receiving thread looked {idle_looks} times while nothing came"
        seg.close()
        bell.close()
    finally:
        pump.close()
        pump.mailbox.close()
        remove_job_segments(job)


def test_a_doorbell_wakes_only_when_rung_and_refuses_a_file_that_is_no_pipe(tmp_path):
    from hetrain.comm.shm.doorbell import Doorbell
    from hetrain.errors import UserError

    own = Doorbell.create(tmp_path / "x.bell")
    other = Doorbell.attach(tmp_path / "x.bell")
    try:
        assert not own.wait(0)
        other.set()
        other.set()
        assert own.wait(0)
        own.clear()  # both rings taken at once
        assert not own.wait(0)
        own.set()  # the owner rings its own (a receive posted in its process)
        assert own.wait(0)
        with pytest.raises(UserError, match="exists already"):
            Doorbell.create(tmp_path / "x.bell")
        (tmp_path / "plain").write_bytes(b"")
        with pytest.raises(UserError, match="not a named pipe"):
            Doorbell.attach(tmp_path / "plain")
    finally:
        own.close()
        other.close()
    assert not (tmp_path / "x.bell").exists()
