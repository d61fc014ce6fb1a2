"""What `bench switch --predict` measures of a host's memory (`bench.calibration`): the copy rates
out of a rank's own state (`copy_rates`), the kernel's rates for fresh and released pages
(`page_rates`) and the allocator's state (`heap_state`)."""

from __future__ import annotations

import ctypes.util
import math

import pytest
import torch

from shardshift.bench.calibration import _state_samples, copy_rates, heap_state, page_rates

_LIBC = ctypes.util.find_library("c")
CPU = torch.device("cpu")
glibc = pytest.mark.skipif(not (_LIBC and hasattr(ctypes.CDLL(_LIBC), "mallinfo2")),
                           reason="heap_state reads glibc's mallinfo2")


def test_the_kernel_s_page_rates_are_finite_and_unmapping_is_the_cheaper():
    fresh, unmap = page_rates(64 << 20)  # as the bench measures
    assert all(math.isfinite(rate) and rate > 0 for rate in (fresh, unmap))
    # Mapping and zeroing a page costs more than handing a written one back; a measurement that
    # lost the faults (a copy into pages written before) would not show it.
    assert fresh < unmap


@glibc
def test_a_large_block_is_mapped_apart_and_its_room_is_not_the_heap_s():
    free, share = heap_state()
    assert free >= 0 and 0 <= share <= 1
    # A block above glibc's largest mmap threshold (32 MiB on 64-bit) that no free chunk of the
    # heap can hold gets a mapping of its own (glibc looks in its free chunks first: earlier tests
    # may have left more than 256 MiB there). While it lives, the share of live bytes mapped apart
    # grows; freed, it leaves no room behind. Never written: mapped, not touched.
    block = torch.empty(max(256 << 20, int(free) + (64 << 20)), dtype=torch.uint8)
    _, held_share = heap_state()
    assert held_share > share
    del block
    after_free, after_share = heap_state()
    assert after_share < held_share and after_free < free + (64 << 20)


def test_the_copy_rates_sample_disjoint_parts_of_the_state_and_leave_most_of_it_alone():
    # A transformer-like state: matrices of three sizes and vectors, 150 MB.
    state = [torch.ones(shape) for _ in range(12) for shape in ((768, 3072), (2304, 768), (768,), (768, 768))]
    total = sum(t.numel() * t.element_size() for t in state)
    whole, halves = _state_samples(state, 64 << 20, CPU, 3)
    assert len(whole) == len(halves) == 3
    sampled = [id(t) for group in whole + halves for t in group]
    assert len(sampled) == len(set(sampled))  # no tensor is in two samples: each is copied once
    assert all(t.dim() == 2 for group in halves for t in group)  # half rows: matrices only
    share = total // 48
    assert all(sum(t.numel() * t.element_size() for t in group) >= share for group in whole)
    assert all(sum(t.numel() * t.element_size() // 2 for t in group) >= share for group in halves)
    # What the samples copy stays a small part of what a switch copies after them.
    copied = sum(t.numel() * t.element_size() for group in whole for t in group)
    copied += sum(t.numel() * t.element_size() // 2 for group in halves for t in group)
    assert copied < total / 4
    contiguous, strided = copy_rates(state, 64 << 20, CPU)
    assert all(math.isfinite(rate) and rate > 0 for rate in (contiguous, strided))


def test_a_state_with_nothing_to_sample_is_measured_on_a_buffer_in_its_place():
    vectors = [torch.ones(1 << 20) for _ in range(4)]  # no matrix: nothing for the strided rate
    whole, halves = _state_samples(vectors, 8 << 20, CPU, 3)
    assert {id(t) for group in whole for t in group} <= {id(t) for t in vectors}
    assert len(halves) == 1 and halves[0][0].dim() == 2 and halves[0][0].numel() == 8 << 20
    assert _state_samples([], 8 << 20, CPU, 3)[0][0][0].numel() == 8 << 20
    assert all(math.isfinite(rate) and rate > 0 for rate in copy_rates([], 8 << 20, CPU))


def test_a_state_of_mixed_dtypes_is_copied_at_aligned_offsets():
    # An odd number of bytes (a flag vector, the RNG state's bytes) before float32 matrices.
    state = [torch.ones(3, dtype=torch.bool), torch.ones(512, 1024), torch.ones(5, dtype=torch.uint8),
             torch.ones(256, 2048, dtype=torch.float64)]
    assert all(math.isfinite(rate) and rate > 0 for rate in copy_rates(state, 1 << 20, CPU))
