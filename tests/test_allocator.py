"""The caching-allocator replay against the behaviour torch's allocator documents
(c10/cuda/CUDACachingAllocator.cpp; ../shared/reference/gpu_memory_facts.md section 1)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel.allocator import CachingAllocator, OutOfMemory, replay

MiB = 1 << 20


def _cycle(first: int, n_first: int, second: int, n_second: int, **kwargs) -> CachingAllocator:
    a = CachingAllocator(**kwargs)
    for i in range(n_first):
        a.malloc(("a", i), first * MiB)
    for i in range(n_first):
        a.free(("a", i))
    for i in range(n_second):
        a.malloc(("b", i), second * MiB)
    return a


def test_order_decides_what_is_reserved():
    """ezyang's worked example (pytorch/devlogs, 2026-06-01): freed 16 MiB segments cannot merge
    into 32 MiB ones, while freed 32 MiB blocks split into 16 MiB ones."""
    assert _cycle(16, 8, 32, 4).stats.peak_reserved == 256 * MiB
    assert _cycle(32, 4, 16, 8).stats.peak_reserved == 128 * MiB


def test_expandable_segments_map_pages_and_split_any_remainder():
    """8 x 16 MiB map 140 MiB of 20 MiB pages (the devlog's figure), and the 16-then-32 pattern no
    longer strands segments: the freed pages merge into one block."""
    a = CachingAllocator(expandable_segments=True)
    for i in range(8):
        a.malloc(i, 16 * MiB)
    assert a.stats.reserved == 140 * MiB
    assert _cycle(16, 8, 32, 4, expandable_segments=True).stats.peak_reserved == 140 * MiB


def test_rounding_pools_and_segment_sizes():
    a = CachingAllocator()
    a.malloc("tiny", 1)  # 512 B, in a 2 MiB small segment
    assert (a.stats.allocated, a.stats.reserved) == (512, 2 * MiB)
    for i in range(4):  # 1-10 MiB requests share one 20 MiB segment, split while > 1 MiB remains
        a.malloc(("mid", i), 5 * MiB)
    assert a.stats.reserved == 22 * MiB
    a.malloc("big", 19 * MiB + MiB // 2)  # >= 10 MiB: its own segment, rounded to 2 MiB; 0.5 MiB slack unsplit
    assert a.stats.reserved == 42 * MiB
    assert a.stats.allocated == 512 + 20 * MiB + 20 * MiB
    assert a.stats.requested == 1 + 20 * MiB + 19 * MiB + MiB // 2


def test_a_freed_block_serves_only_its_own_stream():
    a = CachingAllocator()
    a.malloc("gather", 64 * MiB, "all_gather")
    a.free("gather")
    a.malloc("activation", 64 * MiB)
    assert a.stats.reserved == 128 * MiB


def test_near_capacity_cached_segments_are_released_then_the_request_fails():
    a = _cycle(32, 2, 48, 1, capacity=64 * MiB)
    assert (a.stats.reserved, a.stats.retries) == (48 * MiB, 1)
    with pytest.raises(OutOfMemory):
        a.malloc("more", 32 * MiB)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40 * MiB), st.sampled_from(["default", "side"]), st.booleans()),
                max_size=60), st.booleans())
def test_counters_hold_on_any_trace(requests, expandable):
    """Allocated never exceeds reserved, counts at least what was asked, and returns to zero."""
    events, live = [], []
    for i, (nbytes, stream, free_one) in enumerate(requests):
        events.append(("malloc", i, nbytes, stream))
        live.append(i)
        if free_one and live:
            events.append(("free", live.pop(0)))
    events += [("free", key) for key in live]
    stats = replay(events, expandable_segments=expandable)
    assert stats.requested == stats.allocated == 0
    assert stats.peak_requested <= stats.peak_allocated <= stats.peak_reserved
    assert stats.reserved == stats.peak_reserved  # nothing goes back to the driver without a capacity


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40 * MiB), st.booleans()), max_size=60), st.booleans(),
       st.integers(20 * MiB, 200 * MiB))
def test_every_block_holds_its_request_near_capacity(requests, expandable, capacity):
    """At a device's capacity the allocator releases cached memory and retries; whatever it
    releases, each live block still holds what was asked, and the reservation stays within the device."""
    a = CachingAllocator(expandable_segments=expandable, capacity=capacity)
    live = []
    for i, (nbytes, free_one) in enumerate(requests):
        try:
            a.malloc(i, nbytes)
        except OutOfMemory:
            break
        live.append(i)
        assert a.stats.allocated >= a.stats.requested and a.stats.reserved <= capacity
        if free_one:
            a.free(live.pop(0))
    assert all(a._live[k][0].size >= a._live[k][1] for k in live)


def test_an_expandable_pool_counts_its_pages_again_after_a_release():
    """A free 20 MiB tail, then 50 MiB asked of a 50 MiB device: the release unmaps the tail, so
    the request needs three fresh pages, which do not fit; it must not build on the unmapped tail."""
    a = CachingAllocator(expandable_segments=True, capacity=50 * MiB)
    a.malloc("small", 10 * MiB)
    a.free("small")
    with pytest.raises(OutOfMemory):
        a.malloc("big", 50 * MiB)
    assert a.stats.reserved == 0


def test_under_pressure_an_expandable_pool_unmaps_the_pages_of_every_free_block():
    """torch's `release_blocks` unmaps the whole pages inside each free block of an expandable
    segment (`unmap_block`), not only its tail: a 60 MiB hole below live blocks goes back to the
    driver, so 100 MiB more fits a 200 MiB device; a later request that takes the hole maps again
    only the pages it needs, and what the live tensors cannot fit still fails."""
    a = CachingAllocator(expandable_segments=True, capacity=200 * MiB)
    for key, nbytes in (("a", 60), ("b", 60), ("c", 20)):
        a.malloc(key, nbytes * MiB)
    a.free("a")
    a.malloc("d", 100 * MiB)
    assert (a.stats.reserved, a.stats.retries, a.stats.peak_reserved) == (180 * MiB, 1, 180 * MiB)
    a.malloc("e", 15 * MiB)  # into the unmapped hole: one 20 MiB page mapped again
    assert a.stats.reserved == 200 * MiB and a._live["e"][0].offset == 0
    with pytest.raises(OutOfMemory):
        a.malloc("f", 30 * MiB)  # 195 MiB live: no release makes 30 MiB more fit
    without = CachingAllocator(expandable_segments=True)
    for key, nbytes in (("a", 60), ("b", 60), ("c", 20)):
        without.malloc(key, nbytes * MiB)
    without.free("a")
    without.malloc("d", 100 * MiB)
    assert without.stats.peak_reserved == 240 * MiB  # with no device to fit, nothing is given back
