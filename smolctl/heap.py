"""glibc's heap, tuned for a process that makes and frees large numpy temporaries batch after batch (dedup).

By default glibc maps every allocation past a threshold that starts at 128 KB (and grows as such blocks are
freed) on its own and unmaps it when it is freed, and hands the free top of its heap back to the kernel past twice
that threshold. An array freed and made again is then faulted in and zeroed page by page each time: a third of a
25k-document dedup's page faults, and at a million documents over a million faults and 2 s of kernel time
(benchmarks/RESULTS.md, dedup). Setting any of these turns the adaptation off, so all three are set together:
blocks up to MMAP_THRESHOLD come from the heap and are reused as they are, the heap grows HEAP_TOP_PAD at a time,
and its free top goes back to the kernel only past TRIM_THRESHOLD (what the process may hold beyond its need).
"""

from __future__ import annotations

import ctypes

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 * 2**20  # the largest glibc accepts on 64-bit machines
TRIM_THRESHOLD = 256 * 2**20
HEAP_TOP_PAD = 64 * 2**20


def reuse_freed_memory() -> bool:
    """Tune this process's heap as above; False where the C library is not glibc (macOS, musl: their
    allocators keep their own policy) or refuses a value."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, HEAP_TOP_PAD))
    return all(mallopt(parameter, value) == 1 for parameter, value in settings)
