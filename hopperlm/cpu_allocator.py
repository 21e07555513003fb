"""glibc's malloc on a CPU run: keep freed memory for the next step instead of handing it back to the kernel.

A training step on a CPU frees and allocates the same large tensors every step: the logits of 1,024 tokens over
a 32K vocabulary are 131 MB, and their log-softmax, its gradient and the zeros nll_loss's backward fills are as
large again; the activations of a micro-batch are megabytes each. glibc serves every block above its mmap
threshold (128 KiB, adapting up to 32 MiB) with a fresh mmap and gives it back with munmap when freed, so each
step page-faults those pages in again and the kernel zeroes them first: on this project's 2-core machine a
fresh 131 MB `torch.zeros` took 60 ms where zeroing the same bytes in place took 18.

`keep_freed_memory()` raises glibc's mmap and trim thresholds to 2 GiB through mallopt, which is what
MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ do from the environment (PyTorch's CPU performance guide gets
the same effect from jemalloc or tcmalloc through LD_PRELOAD). Measured by bench/cpu_allocator.py
(bench/results/2026-11-28-cpu-allocator-cpu.json, configs/debug.yaml, one thread, 5 alternated runs a row):
1.84x the tokens/s with TinyLlama's 32K vocabulary, 2.06x with bytes, the same validation loss. The cost is
memory: freed blocks stay in the process and the heap outgrows the live tensors (process peak 0.80 -> 1.29 GB
at a 0.34 GB estimate with the 32K vocabulary; 0.36 -> 0.37 GB with bytes), so the plan keeps freed blocks only
where HEAP_GROWTH times its estimate fits the memory budget. Blocks of 2 GiB and more are still mmapped.
An allocator the user chose (those variables, GLIBC_TUNABLES, a preloaded allocator) is left as it is.
"""

from __future__ import annotations

import ctypes
import os
import platform

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_BELOW = 2**31 - 1  # bytes: mallopt takes an int; the largest block still served from the heap
USER_SWITCHES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
PRELOADED = ("jemalloc", "tcmalloc", "mimalloc")
TO_KEEP_DEFAULT = "MALLOC_TRIM_THRESHOLD_=131072 keeps glibc's default"
# why, in the plan's line
WHY = (
    "each step frees and re-allocates large tensors, which glibc would hand back to the kernel and fault in "
    "again (about 2x the tokens/s measured on a 2-core CPU; docs/speed-and-plan.md)"
)
# the heap a run keeps, over its memory estimate: measured 2.4x (0.83 GB of heap above the runtime's 0.46 GB at
# a 0.34 GB estimate), rounded up; the plan keeps freed blocks only where this multiple fits the memory budget
HEAP_GROWTH = 3.0


def allocator_set_by_user(environ: dict[str, str] | None = None) -> str | None:
    """What in the environment already chose the allocator's behaviour, or None."""
    env = os.environ if environ is None else environ
    for name in USER_SWITCHES:
        if name in env:
            return name
    if "malloc" in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    preload = env.get("LD_PRELOAD", "")
    for name in PRELOADED:
        if name in preload:
            return f"{name} (LD_PRELOAD)"
    return None


def glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (whose mallopt takes these parameters), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def platform_name() -> str:
    """The system and its C library, as the plan names them when glibc's switch is not there."""
    libc = platform.libc_ver()[0]
    return platform.system() + (f", {libc}" if libc else "")


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (process-wide, for every later allocation). False when this is
    not glibc or mallopt refused a value."""
    libc = glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, KEEP_BELOW)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, KEEP_BELOW)
    )
