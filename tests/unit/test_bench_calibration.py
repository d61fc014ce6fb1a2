"""What `bench switch --predict` measures of a CPU host's memory: the kernel's rates for fresh and
released pages (`page_rates`) and the allocator's state (`heap_state`)."""

from __future__ import annotations

import ctypes.util
import math

import pytest
import torch

from shardshift.bench.switch import heap_state, page_rates

_LIBC = ctypes.util.find_library("c")
glibc = pytest.mark.skipif(not (_LIBC and hasattr(ctypes.CDLL(_LIBC), "mallinfo2")),
                           reason="heap_state reads glibc's mallinfo2")


def test_the_kernel_s_page_rates_are_finite_and_unmapping_is_the_cheaper():
    fresh, unmap = page_rates(64 << 20)  # as the bench measures
    assert all(math.isfinite(rate) and rate > 0 for rate in (fresh, unmap))
    # Mapping and zeroing a page costs more than handing a written one back (3 vs 20 GB/s here);
    # a measurement that lost the faults (a copy into pages written before) would not show it.
    assert fresh < unmap


@glibc
def test_a_large_block_is_mapped_apart_and_its_room_is_not_the_heap_s():
    free, share = heap_state()
    assert free >= 0 and 0 <= share <= 1
    # Above glibc's largest mmap threshold (32 MiB on 64-bit), a block gets a mapping of its own:
    # while it lives, the share of live bytes mapped apart grows; freed, it leaves no room behind.
    block = torch.ones(256 << 20, dtype=torch.uint8)
    _, held_share = heap_state()
    assert held_share > share
    del block
    after_free, after_share = heap_state()
    assert after_share < held_share and after_free < free + (64 << 20)
