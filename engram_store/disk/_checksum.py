"""Page checksums of disk layers: XXH64 in a Numba kernel, so the read path checks every block it reads as it lands.

A layer written with page checksums (``DiskLayout.checked``) stores, in the last 8 bytes of each block (a page, or
one large row's pages), XXH64 of the block's other bytes (its rows and their zero padding) seeded with the block's
offset in the file, little-endian. The seed ties a block to its place: a page written or read at the wrong offset
fails its check like a flipped bit does. Rows of 264 bytes (DeepSeek-V4.1's FP8 rows) pack 15 to a page and leave
136 bytes free; a row format that fills its pages to within 8 bytes (a power-of-two row size) has no room, and its
layers are read unchecked (``engram-layers list`` says so).

XXH64 (Yann Collet, https://github.com/Cyan4973/xxHash/blob/dev/doc/xxhash_spec.md), for ``n`` bytes at ``p``::

    if n >= 32:  v = [seed + P1 + P2, seed + P2, seed, seed - P1]
                 for each 32-byte stripe: v[i] = rotl(v[i] + lane_i * P2, 31) * P1
                 h = rotl(v0, 1) + rotl(v1, 7) + rotl(v2, 12) + rotl(v3, 18); h = merge(h, v[i]) for each i
    else:        h = seed + P5
    h += n; then the tail: 8-byte words, one 4-byte word, single bytes; then the avalanche

Four independent lanes keep a core's multipliers busy: a 4 KiB page costs well under a microsecond, beside the
tens of microseconds its read takes. :func:`xxh64_numpy` is the twin the tests hold the kernel to (the ``xxhash``
package's XXH64).
"""
from __future__ import annotations

import numpy as np
import xxhash
from numba import njit

from ..errors import InvalidArgument
from ._intrinsics import load_u32, load_u64

#: Bytes at the end of each block that hold its checksum.
CHECKSUM_BYTES = 8

_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)
_P4 = np.uint64(0x85EBCA77C2B2AE63)
_P5 = np.uint64(0x27D4EB2F165667C5)


@njit(cache=True, nogil=True, inline="always")
def _rotl(x, r):
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


@njit(cache=True, nogil=True, inline="always")
def _round(acc, lane):
    return _rotl(acc + lane * _P2, 31) * _P1


@njit(cache=True, nogil=True, inline="always")
def _merge(h, v):
    return (h ^ _round(np.uint64(0), v)) * _P1 + _P4


@njit(cache=True, nogil=True)
def xxh64(buf, start, n, seed):
    """XXH64 of ``buf[start:start + n]`` (a uint8 array; no bounds check) with the seed ``seed`` (int64 >= 0)."""
    p = start
    end = start + n
    s = np.uint64(seed)
    if n >= 32:
        v1 = s + _P1 + _P2
        v2 = s + _P2
        v3 = s
        v4 = s - _P1
        limit = end - 32
        while p <= limit:
            v1 = _round(v1, load_u64(buf, p))
            v2 = _round(v2, load_u64(buf, p + 8))
            v3 = _round(v3, load_u64(buf, p + 16))
            v4 = _round(v4, load_u64(buf, p + 24))
            p += 32
        h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
        h = _merge(h, v1)
        h = _merge(h, v2)
        h = _merge(h, v3)
        h = _merge(h, v4)
    else:
        h = s + _P5
    h += np.uint64(n)
    while p + 8 <= end:
        h = _rotl(h ^ _round(np.uint64(0), load_u64(buf, p)), 27) * _P1 + _P4
        p += 8
    if p + 4 <= end:
        h = _rotl(h ^ (np.uint64(load_u32(buf, p)) * _P1), 23) * _P2 + _P3
        p += 4
    while p < end:
        h = _rotl(h ^ (np.uint64(buf[p]) * _P5), 11) * _P1
        p += 1
    h ^= h >> np.uint64(33)
    h *= _P2
    h ^= h >> np.uint64(29)
    h *= _P3
    h ^= h >> np.uint64(32)
    return h


@njit(cache=True, nogil=True, inline="always")
def block_ok(buf, at, summed, seed):
    """Whether the block at ``buf[at:]`` whose first ``summed`` bytes its checksum covers (0: an unchecked block)
    holds the checksum of them (seeded with the block's file offset ``seed``) in the 8 bytes after them."""
    if summed == 0:
        return True
    return xxh64(buf, at, summed, seed) == load_u64(buf, at + summed)


@njit(cache=True, nogil=True)
def seal_block(buf, at, summed, seed):
    """Write the checksum of ``buf[at:at + summed]`` (seeded with the block's file offset) after those bytes."""
    h = xxh64(buf, at, summed, seed)
    for k in range(CHECKSUM_BYTES):
        buf[at + summed + k] = np.uint8((h >> np.uint64(8 * k)) & np.uint64(0xFF))


@njit(cache=True, nogil=True)
def first_bad_block(blocks, block_bytes, count, first_offset):
    """The index of the first of ``count`` whole blocks in ``blocks`` (the first at file offset ``first_offset``)
    whose checksum does not match, or -1."""
    summed = block_bytes - CHECKSUM_BYTES
    for b in range(count):
        if not block_ok(blocks, b * block_bytes, summed, first_offset + b * block_bytes):
            return b
    return -1


def page_checksum(data: np.ndarray, offset: int) -> int:
    """The checksum of a block's bytes ``data`` (uint8, C-contiguous; all but the block's last 8) at file offset
    ``offset``, as the kernel computes it."""
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 1:
        raise InvalidArgument(f"data: expected a 1-D uint8 array, got {type(data).__name__}")
    if not isinstance(offset, (int, np.integer)) or offset < 0:
        raise InvalidArgument(f"offset: expected a file offset >= 0, got {offset!r}")
    return int(xxh64(np.ascontiguousarray(data), 0, data.size, int(offset)))


def xxh64_numpy(data: np.ndarray, offset: int) -> int:
    """The twin: the ``xxhash`` package's XXH64 of the same bytes with the same seed."""
    return xxhash.xxh64_intdigest(np.ascontiguousarray(data).tobytes(), seed=int(offset))
