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
        seg, ring = attach(job, procs.SECRET, "t", 0, 1)
        assert ring.sender_pid == os.getpid()
        assert box.tidy() and not path.exists()  # its one sender attached: the name goes
        seg.close()
    finally:
        box.segment.close()
        remove_job_segments(job)


def test_a_rank_without_a_ring_in_the_mailbox_is_refused():
    job = f"p2p-{uuid.uuid4().hex[:8]}"
    box = Mailbox(job, procs.SECRET, "t", 0, [1], slots=2, slot_bytes=4096)
    try:
        with pytest.raises(Exception, match="has no ring for rank 5"):
            attach(job, procs.SECRET, "t", 0, 5)
    finally:
        box.segment.close()
        remove_job_segments(job)


def test_a_strided_tensor_is_refused_when_posted():
    job = f"p2p-{uuid.uuid4().hex[:8]}"
    from hetrain.comm.shm.pump import Pump

    pump = Pump(job, procs.SECRET, "t", 0, [1], timeout_s=5, slots=2, slot_bytes=4096)
    try:
        with pytest.raises(ValueError, match="contiguous"):
            pump.channels[1].isend(torch.zeros(4, 4).t(), 3)
    finally:
        pump.mailbox.segment.close()
        remove_job_segments(job)
