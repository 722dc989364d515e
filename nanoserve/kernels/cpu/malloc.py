"""CPU only: keep freed tensor memory in the process instead of handing it back to the kernel.

glibc serves allocations above its mmap threshold (128 KiB, raised on the fly up to 32 MiB) with
fresh mmaps and trims the heap's top on free, so the multi-MiB activations of a prefill step
(a [2048, 3072] gate_up output is 12 MiB) are new pages on every step and every first write
page-faults. In a VM a fault costs about a microsecond: a 16 x 128-token prefill step of SmolLM2
faulted 58,000-81,000 times (230-320 MiB touched afresh, measured with getrusage), 0 with the
settings below. vLLM's CPU docs get the same effect by preloading tcmalloc.

mallopt() with an explicit threshold turns glibc's dynamic threshold off, so this is opt-out:
NANOSERVE_KEEP_CPU_MEMORY=0, or any MALLOC_*_ environment setting, leaves glibc as it is.

zeros_on_huge_pages: the KV pool's memory on CPU, resident only where written, on transparent huge
pages where Linux gives them."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
from collections.abc import Callable

import torch

from nanoserve import envs

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's upper bound on 64-bit; bigger blocks (the KV pool) still mmap
TRIM_THRESHOLD = 1 << 30

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the settings once per process; True when they are in effect."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if not envs.keep_cpu_memory():
        return False
    mallopt = _libc_function("mallopt", (ctypes.c_int, ctypes.c_int))
    if mallopt is None:  # not glibc (musl, macOS): nothing to tune
        return False
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not _applied:
        logger.info("mallopt refused the CPU memory settings; prefill steps will page-fault more")
    return _applied


HUGE_PAGE = 2 << 20


def release_free_memory() -> None:
    """Hand the heap's free memory back to the kernel once (glibc's malloc_trim): after loading,
    the staging buffers of a checkpoint's layers (each under the mmap threshold, so from the heap)
    are free but stay resident under keep_freed_memory's trim threshold (about 290 MiB on Llama
    3.2 1B's Q4_K_M file). A no-op where there is no malloc_trim."""
    trim = _libc_function("malloc_trim", (ctypes.c_size_t,))
    if trim is not None:
        trim(0)


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor that takes memory only where it is written, and whose memory the kernel
    may back with 2 MiB transparent huge pages. The KV pool: its own anonymous mapping, which Linux
    fills with zero pages on first write, so a pool sized for many long contexts is resident only
    as far as requests have used it (a pool zeroed up front was all resident from start-up: 2 GiB
    for a lone user's few hundred tokens). Its span, whole huge pages from a 2 MiB boundary, is
    madvise(MADV_HUGEPAGE)'d (Linux's default THP mode, `madvise`, gives huge pages to such spans
    only): a decode step reads one 2 KiB block-head at a time from anywhere in it, a TLB miss each
    on 4 KiB pages; the bf16 decode attention ran 1.07-1.16x faster on a Zen 4 EPYC with the pool
    on huge pages (benchmarks/ab_kernels.py levels's layout). Below 2 MiB this is torch.zeros;
    where madvise is refused, the same tensor on 4 KiB pages."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, span + HUGE_PAGE)  # room to start on a boundary; zero until written
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while it lives
    start = -buffer.data_ptr() % HUGE_PAGE
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, span)
    except (AttributeError, OSError):
        logger.debug("madvise(MADV_HUGEPAGE) refused; the KV pool stays on 4 KiB pages")
    return buffer[start : start + nbytes].view(dtype).view(shape)


@functools.cache
def _libc_function(name: str, argtypes: tuple) -> Callable[..., int] | None:
    """libc's `name` returning int, or None where there is no such libc function."""
    try:
        function = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = list(argtypes)
    function.restype = ctypes.c_int
    return function
