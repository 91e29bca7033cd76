"""The shared-memory data plane of processes on one host: segments (segment.py), waits
on their control counters that name a dead peer (waits.py), the host group's
reduce-scatter + all-gather (group.py), its CUDA strategy (cuda.py: segments registered
as pinned memory, copies straight between the GPU and the segments), point-to-point
messages between a worker and a summation server through per-process mailboxes
(mailbox.py, channel.py, pump.py), and the choice of them (select.py)."""
