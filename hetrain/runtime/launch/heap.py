"""How the C heap of a job's processes gives memory back, set at launch (`--heap`).

A training step allocates its activations and gradients, frees them, and allocates the
same sizes again in the next step. glibc's malloc serves blocks above its mmap threshold
(128 KiB at first, raised as large blocks are freed) with fresh mappings, and hands the
top of the heap back to the kernel once more than its trim threshold is free. Either way
the next step touches new pages, and every first touch is a page fault that zeroes a
page. bench/heap.py, a CNN step of 350 samples on a pinned core of a 2-core VM: 3126
faults and 49.6 ms with glibc's defaults, none and 42.8 ms with the pages kept.

"keep" (the default) fixes both thresholds at 1 GiB through the variables mallopt(3)
documents, so the heap keeps what a step used for the next one: a process's resident
memory stays at its peak instead of shrinking between steps. This is what PyTorch's CPU
launcher gets by preloading jemalloc or tcmalloc with decay off (`torch.backends.xeon.
run_cpu`); hetrain uses glibc's own switches because they need nothing installed.
"system" leaves the allocator as the machine configures it. A variable the launcher's
environment already sets is left alone, so a user's own tuning wins. Other C libraries
(musl, macOS) ignore these variables.
"""
from __future__ import annotations

import os
from typing import Literal

HeapPolicy = Literal["keep", "system"]

KEEP_BYTES = 1 << 30  # above any one step's block; glibc accepts it from the environment
KEEP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(KEEP_BYTES), "MALLOC_TRIM_THRESHOLD_": str(KEEP_BYTES)}


def heap_env(policy: HeapPolicy, already: dict[str, str] | None = None) -> dict[str, str]:
    """The variables a process gets for `policy`, less those `already` set (default: the
    launcher's environment)."""
    already = os.environ if already is None else already
    if policy == "system":
        return {}
    return {k: v for k, v in KEEP_ENV.items() if k not in already}
