"""Numba kernels of the hot-row cache's writers: fills, warm-start pins, the repair of a set a dead writer left.

The layout is ``_kernels``'s (one 64-byte metadata line per set: the version word, then 7 keys). Readers take no
lock: they read a set as a sequence lock and count a row as a hit only if the version did not move and no writer
was busy in the set. A writer, which the caller serialises (a thread lock in a process; a file lock between the
processes of a host cache), changes one way of one set at a time:

1. it records the set in ``journal[0]`` (a writer found dead holding the lock left at most that set unfinished);
2. adds ``BUSY`` to the version (readers of the set back off), writes the key and the row, clears the way's
   reference and pin bits, and adds ``BUSY`` again (even: the set is readable, under a new version);
3. clears ``journal[0]``.

:func:`_cache_repair` empties the set a writer was changing when it died: every key is dropped and the version
moves on, so no reader ever takes the half-written row, and the set is usable again.

Admission: a missed row takes a free way at once; when the set is full it evicts the CLOCK victim, the first
unpinned way from the set's hand whose reference bit is clear (``ADMIT_ALWAYS``), or, with ``ADMIT_DOORKEEPER``,
only on its second miss within a window as long as the cache. Pinned ways (a warm start's most frequent rows,
:func:`_cache_pin`) are never evicted.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ._kernels import BUSY, PIN_MASK, PIN_SHIFT, REF_MASK, WAYS, META_WORDS, _set_of
from ._intrinsics import atomic_add, atomic_and, atomic_or, fence_release, memcpy

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX2 = np.uint64(0xC2B2AE3D27D4EB4F)

ADMIT_ALWAYS = 0
ADMIT_DOORKEEPER = 1


@njit(cache=True, nogil=True)
def _door_bits(key, n_bits):
    x = np.uint64(key)
    a = np.int64(((x * _GOLDEN) >> np.uint64(17)) % np.uint64(n_bits))
    b = np.int64(((x * _MIX2) >> np.uint64(19)) % np.uint64(n_bits))
    return a, b


@njit(cache=True, nogil=True)
def _door_check_add(door, door_state, key):
    """The doorkeeper: True if ``key`` was seen since the last reset; otherwise remember it and return False.
    ``door_state = [additions, reset_after]``: the filter is cleared after that many additions."""
    n_bits = door.size * 64
    a, b = _door_bits(key, n_bits)
    ma = np.uint64(1) << np.uint64(a & 63)
    mb = np.uint64(1) << np.uint64(b & 63)
    if (door[a >> 6] & ma) and (door[b >> 6] & mb):
        return True
    if door_state[0] >= door_state[1]:
        door[:] = 0
        door_state[0] = 0
    door[a >> 6] |= ma
    door[b >> 6] |= mb
    door_state[0] += 1
    return False


@njit(cache=True, nogil=True)
def _find(meta, base, key):
    """``(way holding key or -1, first empty way or -1)``."""
    empty = -1
    for w in range(WAYS):
        t = meta[base + 1 + w]
        if t == key:
            return w, empty
        if t == -1 and empty < 0:
            empty = w
    return -1, empty


@njit(cache=True, nogil=True)
def _clock_victim(meta, hands, s, base):
    """The way CLOCK evicts in set ``s`` (clearing the reference bits it passes), or -1 if every way is pinned."""
    pins = (meta[base] >> PIN_SHIFT) & REF_MASK
    if pins == REF_MASK:  # redundant while pins come from RowCache.pin, which leaves a way of each set unpinned
        return -1
    hand = np.int64(hands[s])
    for _ in range(2 * WAYS + 1):
        bit = np.int64(1) << hand
        if pins & bit:
            hand = (hand + 1) % WAYS
        elif meta[base] & bit:
            atomic_and(meta, base, ~bit)
            hand = (hand + 1) % WAYS
        else:
            break
    hands[s] = (hand + 1) % WAYS
    return hand


@njit(cache=True, nogil=True)
def _replace(meta, rows, slot_bytes, s, way, key, src, src_at, row_bytes, journal, die):
    """Put ``key`` and its row (``src[src_at:]``) in way ``way`` of set ``s`` (see the module docstring).
    ``die`` (a test hook) stops half-way through the row, as a writer killed there would."""
    base = s * META_WORDS
    journal[0] = s
    fence_release()
    atomic_add(meta, base, BUSY)  # odd version: readers of this set back off
    fence_release()
    meta[base + 1 + way] = key
    if die:
        memcpy(rows, (s * WAYS + way) * slot_bytes, src, src_at, row_bytes // 2)
        return
    memcpy(rows, (s * WAYS + way) * slot_bytes, src, src_at, row_bytes)
    atomic_and(meta, base, ~((np.int64(1) << way) | (np.int64(1) << (PIN_SHIFT + way))))
    fence_release()
    atomic_add(meta, base, BUSY)
    fence_release()
    journal[0] = -1


@njit(cache=True, nogil=True)
def _cache_fill(meta, hands, rows, slot_bytes, miss_key, miss_pos, out, row_bytes, admission, door, door_state,
                journal, stop_at):
    """Offer each missed row (now in ``out``) to the cache; returns how many were inserted.

    A key already cached is skipped; see the module docstring for the ways chosen. ``stop_at`` >= 0 is a test
    hook: the insertion of that index stops half-way (key written, row half copied, set busy) and the kernel
    returns ``-1 - stop_at``; -1 turns it off.
    """
    n_sets = meta.size // META_WORDS
    inserted = 0
    for k in range(miss_key.size):
        key = miss_key[k]
        s = _set_of(key, n_sets)
        base = s * META_WORDS
        found, way = _find(meta, base, key)
        if found >= 0:
            continue
        if way < 0:
            if admission == ADMIT_DOORKEEPER and not _door_check_add(door, door_state, key):
                continue
            way = _clock_victim(meta, hands, s, base)
            if way < 0:  # redundant while pins come from RowCache.pin, which leaves a way of each set unpinned
                continue
        die = inserted == stop_at
        _replace(meta, rows, slot_bytes, s, way, key, out, miss_pos[k] * row_bytes, row_bytes, journal, die)
        if die:
            return -1 - inserted
        inserted += 1
    return inserted


@njit(cache=True, nogil=True)
def _cache_pin(meta, hands, rows, slot_bytes, keys, src, row_bytes, max_pinned, journal):
    """Cache row ``i`` of ``src`` (``src[i * row_bytes:]``) under ``keys[i]`` and pin it, in order, leaving at
    most ``max_pinned`` pinned ways in any set (keys beyond that are skipped); returns how many were pinned."""
    n_sets = meta.size // META_WORDS
    pinned = 0
    for i in range(keys.size):
        key = keys[i]
        s = _set_of(key, n_sets)
        base = s * META_WORDS
        pins = (meta[base] >> PIN_SHIFT) & REF_MASK
        count = 0
        for w in range(WAYS):
            count += (pins >> w) & 1
        way, empty = _find(meta, base, key)
        if way >= 0 and (pins >> way) & 1:
            continue
        if count >= max_pinned:
            continue
        if way < 0:
            way = empty if empty >= 0 else _clock_victim(meta, hands, s, base)
            if way < 0:  # redundant: fewer than max_pinned <= WAYS - 1 ways are pinned, so CLOCK finds a victim
                continue
            _replace(meta, rows, slot_bytes, s, way, key, src, i * row_bytes, row_bytes, journal, False)
        atomic_or(meta, base, np.int64(1) << (PIN_SHIFT + way))
        pinned += 1
    return pinned


@njit(cache=True, nogil=True)
def _cache_repair(meta, s):
    """Empty set ``s`` (a writer died changing it): drop every key and move the version on, busy no more."""
    base = s * META_WORDS
    if not (meta[base] & BUSY):
        atomic_add(meta, base, BUSY)
    fence_release()
    for w in range(WAYS):
        meta[base + 1 + w] = -1
    atomic_and(meta, base, ~(REF_MASK | PIN_MASK))
    fence_release()
    atomic_add(meta, base, BUSY)


@njit(cache=True, nogil=True)
def _counter_add(counters, index, value):
    """``counters[index] += value`` atomically (counters a host's processes share)."""
    atomic_add(counters, index, value)


@njit(cache=True, nogil=True)
def _count_lookup(counters, hits, misses):
    """A lookup's hits and misses added to ``counters[0]`` and ``counters[1]`` in one call (one dispatch)."""
    atomic_add(counters, 0, hits)
    atomic_add(counters, 1, misses)
