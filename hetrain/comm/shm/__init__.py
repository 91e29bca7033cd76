"""The shared-memory data plane of processes on one host: segments (segment.py), waits
on their control counters that name a dead peer (waits.py), the host group's
reduce-scatter + all-gather (group.py), its CUDA strategy (cuda.py: segments registered
as pinned memory, copies straight between the GPU and the segments), and the choice of
it for a transport (select.py)."""
