"""A free-list allocator for one segment: best-fit placement, coalescing on free."""

from __future__ import annotations

import bisect
from engram_store.errors import InvalidArgument

#: Every allocation starts on this boundary, so float32/int64 views of a table are aligned.
ALIGNMENT = 64


def _align_up(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


class FreeListAllocator:
    """Space of one segment as a sorted list of free blocks ``(offset, size)``.

    ``allocate`` takes the smallest free block that fits (best fit keeps large blocks whole for large
    tables); ``free`` returns a block and merges it with free neighbours, so freeing everything always
    restores one block covering the whole segment. Sizes are rounded up to :data:`ALIGNMENT`.
    Zero-byte objects take no space and get offset 0.
    """

    def __init__(self, capacity: int):
        if capacity < 0:
            raise InvalidArgument(f"capacity: expected >= 0, got {capacity}")
        self.capacity = capacity
        usable = capacity // ALIGNMENT * ALIGNMENT
        self._offsets: list[int] = [0] if usable else []
        self._sizes: list[int] = [usable] if usable else []
        self.used = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        return max(self._sizes, default=0)

    def free_blocks(self) -> list[tuple[int, int]]:
        return list(zip(self._offsets, self._sizes))

    def copy(self) -> "FreeListAllocator":
        """An independent allocator with the same free blocks (to work out a change before making it)."""
        other = FreeListAllocator(0)
        other.capacity, other.used = self.capacity, self.used
        other._offsets, other._sizes = list(self._offsets), list(self._sizes)
        return other

    def allocate(self, size: int) -> int | None:
        """Reserve ``size`` bytes; return the offset, or None when no free block is large enough."""
        if size == 0:
            return 0
        need = _align_up(size)
        best = -1
        for i, block in enumerate(self._sizes):
            if block >= need and (best < 0 or block < self._sizes[best]):
                best = i
                if block == need:
                    break
        if best < 0:
            return None
        offset = self._offsets[best]
        if self._sizes[best] == need:
            del self._offsets[best], self._sizes[best]
        else:
            self._offsets[best] += need
            self._sizes[best] -= need
        self.used += need
        return offset

    def reserve(self, offset: int, size: int) -> bool:
        """Mark ``[offset, offset+size)`` used (replaying known objects); False if it is not wholly free."""
        if size == 0:
            return True
        need = _align_up(size)
        i = bisect.bisect_right(self._offsets, offset) - 1
        if i < 0 or offset % ALIGNMENT:
            return False
        start, length = self._offsets[i], self._sizes[i]
        if offset + need > start + length:
            return False
        del self._offsets[i], self._sizes[i]
        tail_start, tail_len = offset + need, start + length - (offset + need)
        if tail_len:
            self._offsets.insert(i, tail_start)
            self._sizes.insert(i, tail_len)
        if offset > start:
            self._offsets.insert(i, start)
            self._sizes.insert(i, offset - start)
        self.used += need
        return True

    def free(self, offset: int, size: int) -> None:
        """Return a block obtained from :meth:`allocate` or :meth:`reserve`, merging free neighbours."""
        if size == 0:
            return
        need = _align_up(size)
        i = bisect.bisect_left(self._offsets, offset)
        if i < len(self._offsets) and self._offsets[i] < offset + need:
            raise InvalidArgument(f"free({offset}, {size}): overlaps the free block at {self._offsets[i]}")
        if i > 0 and self._offsets[i - 1] + self._sizes[i - 1] > offset:
            raise InvalidArgument(f"free({offset}, {size}): overlaps the free block at {self._offsets[i - 1]}")
        self.used -= need
        merge_prev = i > 0 and self._offsets[i - 1] + self._sizes[i - 1] == offset
        merge_next = i < len(self._offsets) and offset + need == self._offsets[i]
        if merge_prev and merge_next:
            self._sizes[i - 1] += need + self._sizes[i]
            del self._offsets[i], self._sizes[i]
        elif merge_prev:
            self._sizes[i - 1] += need
        elif merge_next:
            self._offsets[i] = offset
            self._sizes[i] += need
        else:
            self._offsets.insert(i, offset)
            self._sizes.insert(i, need)
