"""cpu_malloc.zeros_on_huge_pages: the KV pool's allocation on CPU."""

from __future__ import annotations

import os

import pytest
import torch

from nanoserve.kernels.cpu.malloc import HUGE_PAGE, zeros_on_huge_pages


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address` in /proc/self/smaps."""
    flags, inside = None, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
    assert flags is not None, hex(address)
    return flags


@pytest.mark.parametrize(
    "shape, dtype",
    [((300, 3, 16, 64), torch.bfloat16), ((1 << 20,), torch.float32), ((7, 5), torch.bfloat16)],
)
def test_zeroed_with_the_shape_and_dtype(shape, dtype):
    pool = zeros_on_huge_pages(shape, dtype)
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    assert torch.count_nonzero(pool) == 0
    pool.fill_(1)  # all of it writable, and it is the tensor's own memory
    assert pool.sum().item() == pool.numel()


@pytest.mark.skipif(
    not os.path.isdir("/sys/kernel/mm/transparent_hugepage"),
    reason="a Linux kernel with transparent huge pages (and /proc/self/smaps)",
)
def test_large_pools_start_on_a_huge_page_and_are_advised():
    pool = zeros_on_huge_pages((4 * HUGE_PAGE // 2,), torch.bfloat16)  # 4 MiB
    assert pool.data_ptr() % HUGE_PAGE == 0
    # madvise(MADV_HUGEPAGE) shows as the mapping's "hg" flag, whatever THP mode the kernel runs.
    assert "hg" in _vm_flags(pool.data_ptr())
    assert "hg" in _vm_flags(pool.data_ptr() + pool.numel() * 2 - 1)


def _resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's pages that are in memory (mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    start = tensor.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    pages = -(-length // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vector) == 0, (
        ctypes.get_errno()
    )
    return sum(v & 1 for v in vector) * mmap.PAGESIZE


def test_a_large_pool_is_resident_only_where_written():
    pool = zeros_on_huge_pages((64, HUGE_PAGE // 2), torch.bfloat16)  # 128 MiB, 64 huge pages
    assert _resident_bytes(pool) == 0
    pool[5].fill_(1)  # one huge page's worth
    resident = _resident_bytes(pool)
    assert HUGE_PAGE <= resident <= 2 * HUGE_PAGE
    assert torch.count_nonzero(pool) == HUGE_PAGE // 2  # the rest still reads as zeros
