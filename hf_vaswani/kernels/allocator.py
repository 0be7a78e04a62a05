"""The C allocator of a process that frees and allocates the same large tensors at every step (training, decoding).

torch's CPU tensors come from malloc. glibc's malloc serves a block by a fresh `mmap` when it is larger than its
adaptive threshold (at most 32 MiB, so always for a base-size model's 72 MiB embedding gradients) and unmaps it when
freed, and it hands the freed top of its heap back to the OS beyond twice that threshold. A loop that frees its
gradients, activations and vocabulary-sized scores and allocates them again then takes a page fault for every 4 KiB it
touches, every step, and the kernel zeroes each page again. The page faults and training speed measured with and
without `reuse_freed_memory`: docs/performance.md.
"""

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
KEPT_BYTES = 1 << 30  # blocks below 1 GiB come from the heap, and up to 1 GiB of freed heap stays with the process


def reuse_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for the process's next allocations instead of returning it to the OS.

    Process-wide and for the rest of the process: the `vaswani` console script calls it first, as its process is its
    own (`cli.main(argv)` called from Python leaves the caller's allocator alone); a Python program may call it
    itself. The process's resident memory then stays near its peak instead of shrinking between steps. Returns False,
    changing nothing, where the C library is not glibc (macOS, Windows, musl).
    """
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, KEPT_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, KEPT_BYTES) == 1
