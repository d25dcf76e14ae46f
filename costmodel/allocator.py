"""torch's CUDA caching allocator, replayed: what `max_memory_reserved()` reads for a sequence
of allocations and frees.

Why: a run dies on the memory the allocator has reserved from the driver, not on the bytes its
tensors hold. The two differ by the allocator's rounding, its segment sizes, the slack of blocks
it will not split, free blocks no request fits, and pools that serve one stream only (FSDP2
gathers parameters on a stream of its own). This replays those mechanisms on a trace.

The mechanisms and constants are torch's, not a GPU's (c10/cuda/CUDACachingAllocator.cpp at
001074d2, the same since torch 1.x; `../shared/reference/gpu_memory_facts.md` section 1):

- every request is rounded up to 512 B (`kMinBlockSize`, `round_size`);
- requests of at most 1 MiB take the small pool (`kSmallSize`), larger ones the large pool, and
  a free block serves only its own pool and the stream that allocated it;
- a new segment (`cudaMalloc`) is 2 MiB for the small pool (`kSmallBuffer`), 20 MiB for a
  request under 10 MiB (`kLargeBuffer`, `kMinLargeAlloc`), else the request rounded up to
  2 MiB (`kRoundLarge`): `get_allocation_size`;
- the smallest free block that fits is taken (best fit); a small block is split if at least
  512 B remain, a large one only if more than 1 MiB remains, else the request holds the whole
  block (`should_split`); `max_split_size` is unlimited by default, so nothing is oversize;
- a freed block merges with free neighbours of its own segment only;
- a segment goes back to the driver only when a request would exceed the device: every wholly
  free segment is released and the request retried (`release_cached_blocks`), else the request
  fails (out of memory);
- with `expandable_segments:True` each (pool, stream) has one segment that maps pages on
  demand (2 MiB small, 20 MiB large), splits any remainder of at least 512 B, and so leaves
  no slack between segments. Under pressure every whole page inside a free block is unmapped
  (`release_blocks` -> `unmap_block`), not only the segment's free tail; a request that later
  takes such a block maps again what it needs (modelled per block: which of its pages were
  unmapped is not tracked, only how many).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20
DEFAULT_STREAM = "default"


class OutOfMemory(Exception):
    """The request fits neither a cached block nor what the device has left."""

    def __init__(self, nbytes: int, reserved: int, capacity: int) -> None:
        super().__init__(f"{nbytes} B requested with {reserved} B reserved of {capacity} B")
        self.nbytes, self.reserved, self.capacity = nbytes, reserved, capacity


def round_size(nbytes: int) -> int:
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def is_small(rounded: int) -> bool:
    return rounded <= SMALL_SIZE


def segment_size(rounded: int) -> int:
    """The `cudaMalloc` a request of `rounded` bytes makes when no cached block fits it."""
    if is_small(rounded):
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-rounded // ROUND_LARGE) * ROUND_LARGE


def page_size(rounded: int) -> int:
    """An expandable segment's page: 2 MiB in the small pool, 20 MiB in the large one."""
    return pool_page(is_small(rounded))


def pool_page(small: bool) -> int:
    """The page of an expandable segment in the small pool (`small`) or the large one."""
    return SMALL_BUFFER if small else LARGE_BUFFER


def splits(rounded: int, remaining: int, expandable: bool) -> bool:
    if is_small(rounded) or expandable:
        return remaining >= MIN_BLOCK
    return remaining > SMALL_SIZE


@dataclass(eq=False)
class Block:
    segment: int
    offset: int
    size: int
    pool: tuple[bool, str]  # (small pool?, stream)
    free: bool = True
    unmapped: int = 0  # expandable: bytes of this free block whose pages went back to the driver
    prev: Block | None = None
    next: Block | None = None


@dataclass
class Stats:
    """The counters torch keeps: `allocated_bytes` counts whole blocks (rounding and unsplit slack
    included), `reserved_bytes` whole segments or mapped pages."""

    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    requested: int = 0
    peak_requested: int = 0
    segments: int = 0
    retries: int = 0


@dataclass
class CachingAllocator:
    """One device's allocator. `capacity` (bytes) makes a request past it release the cached
    segments and retry, then fail with `OutOfMemory`, as torch does; None never fails."""

    expandable_segments: bool = False
    capacity: int | None = None
    stats: Stats = field(default_factory=Stats)
    _free: dict[tuple[bool, str], list] = field(default_factory=dict)  # pool -> sorted [(size, id, block)]
    _live: dict[object, tuple[Block, int]] = field(default_factory=dict)
    _segments: dict[int, Block] = field(default_factory=dict)  # segment -> its first block
    _tails: dict[tuple[bool, str], Block] = field(default_factory=dict)  # expandable: each pool's last block

    def malloc(self, key: object, nbytes: int, stream: str = DEFAULT_STREAM) -> None:
        rounded = round_size(nbytes)
        pool = (is_small(rounded), stream)
        block = self._take_cached(pool, rounded) or self._grow(pool, rounded)
        if block.unmapped:
            self._remap(block, rounded)
        block = self._split(block, rounded)
        block.free = False
        self._live[key] = (block, nbytes)
        s = self.stats
        s.allocated += block.size
        s.requested += nbytes
        s.peak_allocated, s.peak_requested = max(s.peak_allocated, s.allocated), max(s.peak_requested, s.requested)

    def free(self, key: object) -> None:
        block, nbytes = self._live.pop(key)
        self.stats.allocated -= block.size
        self.stats.requested -= nbytes
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._unlist(neighbour)
                block = self._merge(block, neighbour)
        self._list(block)

    def holds(self, key: object) -> bool:
        return key in self._live

    # -- cached blocks ---------------------------------------------------------------------
    def _list(self, block: Block) -> None:
        bisect.insort(self._free.setdefault(block.pool, []), (block.size, id(block), block))

    def _unlist(self, block: Block) -> None:
        blocks = self._free.get(block.pool, [])
        i = bisect.bisect_left(blocks, (block.size, id(block)))
        if i < len(blocks) and blocks[i][2] is block:  # an emptied expandable tail is not listed
            blocks.pop(i)

    def _take_cached(self, pool, rounded: int) -> Block | None:
        blocks = self._free.get(pool, [])
        i = bisect.bisect_left(blocks, (rounded, -1))
        if i == len(blocks):
            return None
        return blocks.pop(i)[2]

    def _split(self, block: Block, rounded: int) -> Block:
        remaining = block.size - rounded
        if not splits(rounded, remaining, self.expandable_segments):
            return block
        rest = Block(block.segment, block.offset + rounded, remaining, block.pool, unmapped=block.unmapped,
                     prev=block, next=block.next)
        block.unmapped = 0
        if block.next is not None:
            block.next.prev = rest
        block.next, block.size = rest, rounded
        if self._tails.get(block.pool) is block:
            self._tails[block.pool] = rest
        self._list(rest)
        return block

    def _merge(self, block: Block, neighbour: Block) -> Block:
        first, second = (neighbour, block) if neighbour.next is block else (block, neighbour)
        first.size += second.size
        first.unmapped += second.unmapped
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        if self._tails.get(first.pool) is second:
            self._tails[first.pool] = first
        return first

    # -- memory from the driver ------------------------------------------------------------
    def _grow(self, pool, rounded: int) -> Block:
        if self.expandable_segments:
            return self._map_pages(pool, rounded)
        size = segment_size(rounded)
        self._reserve(size, rounded)
        block = Block(self.stats.segments, 0, size, pool)
        self._segments[block.segment] = block
        self.stats.segments += 1
        return block

    def _map_pages(self, pool, rounded: int) -> Block:
        """Extend the pool's one segment by whole pages, reusing its free tail (what the pages
        must add is counted again after a release, which may unmap part of that tail)."""
        added = self._pages_needed(pool, rounded)
        if self._over(added):
            self._release_cached()
            added = self._pages_needed(pool, rounded)
        tail = self._tails.get(pool)
        remap = tail.unmapped if tail is not None and tail.free else 0  # a merged-in block's unmapped pages
        self._reserve(added + remap, rounded, release=False)
        if tail is not None and tail.free:
            self._unlist(tail)
            tail.size += added
            tail.unmapped = 0
            return tail
        offset = tail.offset + tail.size if tail is not None else 0
        block = Block(-1, offset, added, pool, prev=tail)
        if tail is not None:
            tail.next = block
        self._tails[pool] = block
        return block

    def _remap(self, block: Block, rounded: int) -> None:
        """Map again the pages of `block` that a request of `rounded` bytes needs beyond its mapped part."""
        page = page_size(rounded)
        short = max(0, rounded - (block.size - block.unmapped))
        needed = min(block.unmapped, math.ceil(short / page) * page)
        self._reserve(needed, rounded)
        block.unmapped -= needed

    def _pages_needed(self, pool, rounded: int) -> int:
        tail = self._tails.get(pool)
        have = tail.size - tail.unmapped if tail is not None and tail.free else 0
        page = page_size(rounded)
        return math.ceil((rounded - have) / page) * page

    def _over(self, size: int) -> bool:
        return self.capacity is not None and self.stats.reserved + size > self.capacity

    def _reserve(self, size: int, rounded: int, release: bool = True) -> None:
        if self._over(size) and release:
            self._release_cached()
        if self._over(size):
            raise OutOfMemory(rounded, self.stats.reserved, self.capacity)
        self.stats.reserved += size
        self.stats.peak_reserved = max(self.stats.peak_reserved, self.stats.reserved)

    def _release_cached(self) -> None:
        """Give every wholly free segment back to the driver (an expandable pool: the whole pages
        of every free block, its free tail's included)."""
        self.stats.retries += 1
        if self.expandable_segments:
            self._unmap_free_pages()
            for pool, tail in self._tails.items():
                page = pool_page(small=pool[0])
                if tail.free and tail.size >= page:
                    self._unlist(tail)
                    released = tail.size // page * page
                    tail.size -= released
                    self.stats.reserved -= max(0, released - tail.unmapped)  # some may be unmapped already
                    tail.unmapped = max(0, tail.unmapped - released)
                    if tail.size:
                        self._list(tail)
            return
        for segment, block in list(self._segments.items()):
            if block.free and block.next is None:
                self._unlist(block)
                self.stats.reserved -= block.size
                del self._segments[segment]

    def _unmap_free_pages(self) -> None:
        """Unmap the whole pages inside each free block short of its pool's tail (which gives its
        pages back by shrinking)."""
        for pool, blocks in self._free.items():
            page = pool_page(small=pool[0])
            for _, _, block in blocks:
                if self._tails.get(pool) is block:
                    continue
                first, last = -(-block.offset // page), (block.offset + block.size) // page
                inside = max(0, last - first) * page
                released = max(0, inside - block.unmapped)
                block.unmapped += released
                self.stats.reserved -= released


def replay(events, *, expandable_segments: bool = False, capacity: int | None = None) -> Stats:
    """Replay `events`, each ("malloc", key, nbytes, stream) or ("free", key), on a fresh allocator."""
    allocator = CachingAllocator(expandable_segments=expandable_segments, capacity=capacity)
    for event in events:
        if event[0] == "malloc":
            allocator.malloc(event[1], event[2], event[3])
        elif allocator.holds(event[1]):  # a trace may free what it saw allocated before it began
            allocator.free(event[1])
    return allocator.stats
