"""Numba kernels of the miss-ratio curve: a spatially hashed sample of row keys replayed into an LRU stack.

SHARDS (Waldspurger, Park, Garthwaite, Ahmad, FAST 2015), in its fixed-size form::

    for each looked-up key k (column c):
        if hash(k) >= T: skip                                   # a spatial sample of rate R = T / 2**32
        d = distinct sampled keys touched since k's last touch  # the LRU stack distance among the sample
        hist[c, bin(d / R)] += 1 / R                            # the distance and weight of the whole stream
        if more than max_keys keys are tracked: T //= 2, forget the keys above it

An LRU cache of S rows hits an access iff its distance is < S, so the hit rate at S is the weight of the bins
below S over the rows looked up (every row, sampled or not). A key is either always or never sampled, so every
touch of a sampled key is seen and its distances are exact among the sample.

The stack distance is counted over access times (Bennett and Kruskal, 1975): each tracked key marks the time of
its last touch, so the keys touched since time t are the marks after t. The marks are a bitmap with a count per
block of 1024 times (a rank structure): a distance is a popcount of the key's word, of the words after it in its
block, and the counts of the blocks after that. Times run from 1 to ``TIMES - 1``; when they run out the live
keys are renumbered in order (``_rebuild``), which also drops keys when the rate falls. A Fenwick tree over the
same times did O(log n) scattered reads a touch and cost 2.4x as much inside a lookup whose rows had just pushed
it out of the CPU's caches; the bitmap of 8,192 keys' times is 4 KiB. Keys and their last times sit side by
side in an open-addressing table with linear probing (an empty slot's key is -1; a rebuild builds it afresh).

The state (``MissRatioCurve`` owns it; ``_mrc`` has the exact twin the tests hold these kernels to):

* ``state`` int64, one array (each array a kernel takes costs its call ~0.15 us, and the lookup path calls it
  once per layer): the scalars ``[THRESHOLD, NOW, KEYS, MAX_KEYS, REBUILDS, RATE_DROPS, SLOTS, TIMES]``; the
  table, ``SLOTS`` pairs ``(key, time)`` (``SLOTS`` a power of 2 >= ``2 * (max_keys + 1)``); the bitmap of
  times, ``TIMES / 64`` words; the count of each block, ``TIMES / 1024`` words;
* ``hist`` float64 ``[columns, N_BINS + 1]``: weight by estimated distance, bin ``COLD`` for first touches,
  and in column ``LOOKED`` the rows looked up (every one, sampled or not).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ..kernels import prefetch_hint as _prefetch

THRESHOLD, NOW, KEYS, MAX_KEYS, REBUILDS, RATE_DROPS, SLOTS, TIMES = range(8)
N_SCALARS = 8
FULL = np.int64(1) << 32            # the threshold of a rate of 1: every key sampled
BINS_PER_OCTAVE = 8                 # bins 1 + 8 e .. 8 + 8 e split [2**e, 2**(e + 1)) in 8 equal parts
MAX_OCTAVES = 44                    # distances up to 2**44 rows
N_BINS = 2 + BINS_PER_OCTAVE * MAX_OCTAVES  # bin 0: distance 0; the last: a first touch (no distance)
COLD = N_BINS - 1
LOOKED = N_BINS                     # hist's last column: the rows looked up (every one, sampled or not)
KEY_ROW_BITS = 40                   # a key is (tag << 40) | row, as the row cache's
BLOCK_WORDS = 16                    # bitmap words per counted block (1024 times)
TIME_QUANTUM = 64 * BLOCK_WORDS     # TIMES is a multiple of it
AHEAD = 4                           # sampled rows ahead whose table slot is prefetched

_M1 = np.uint64(0x9E3779B1)
_M2 = np.uint64(0x85EBCA6B)
_M3 = np.uint64(0xC2B2AE35)
_LOW32 = np.uint64(0xFFFFFFFF)


@intrinsic
def popcount(typingctx, word):
    """The number of bits set in an int64 (LLVM's ``ctpop``: one instruction where the CPU has it)."""
    if word != types.int64:
        return None

    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic("llvm.ctpop", [ir.IntType(64)])
        return builder.call(fn, [args[0]])

    return types.int64(word), codegen


@njit(cache=True, nogil=True, inline="always")
def sample_hash(key):
    """A 32-bit hash of a key (murmur3's finaliser over its two halves), unrelated to the cache's set index."""
    u = np.uint64(key)
    x = (u & _LOW32) ^ (((u >> np.uint64(32)) * _M1) & _LOW32)
    x ^= x >> np.uint64(16)
    x = (x * _M2) & _LOW32
    x ^= x >> np.uint64(13)
    x = (x * _M3) & _LOW32
    x ^= x >> np.uint64(16)
    return np.int64(x)


@njit(cache=True, nogil=True, inline="always")
def _slot_of(key, mask):
    return np.int64((np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(20)) & mask


@njit(cache=True, nogil=True, inline="always")
def distance_bin(distance):
    """The histogram bin of an estimated stack distance (a float >= 0): 0 below 1, else ``1 + 8 e + f`` for
    ``distance = 2**e * (1 + f / 8 + ...)``, read off the float's exponent and top 3 mantissa bits (a log2
    cost a sampled row more than the rest of its update)."""
    if distance < 1.0:
        return 0
    bits = np.int64(np.float64(distance).view(np.int64)) >> 49  # exponent (biased by 1023) and 3 mantissa bits
    return min(1 + bits - (1023 << 3), N_BINS - 2)


@njit(cache=True, nogil=True, inline="always")
def bin_low(b):
    """The smallest distance of bin ``b`` >= 1 (see :func:`distance_bin`)."""
    e, f = divmod(b - 1, BINS_PER_OCTAVE)
    return 2.0 ** e * (1.0 + f / BINS_PER_OCTAVE)


@njit(cache=True, nogil=True, inline="always")
def _parts(state):
    """The scalars, the table, the bitmap of times and the blocks' counts, laid end to end in ``state``."""
    slots, times = state[SLOTS], state[TIMES]
    at = N_SCALARS + 2 * slots
    words = times // 64
    return (state[:N_SCALARS], state[N_SCALARS:at], state[at:at + words],
            state[at + words:at + words + words // BLOCK_WORDS])


@njit(cache=True, nogil=True, inline="always")
def _mark(bits, blocks, t, v):
    """Set (``v`` = 1) or clear (-1) the mark of time ``t``."""
    w = t >> 6
    if v > 0:
        bits[w] |= np.int64(1) << (t & 63)
    else:
        bits[w] &= ~(np.int64(1) << (t & 63))
    blocks[w // BLOCK_WORDS] += v


@njit(cache=True, nogil=True, inline="always")
def _marks_after(bits, blocks, t):
    """The number of marked times after ``t``."""
    w = t >> 6
    b = t & 63
    n = popcount(np.int64(np.uint64(bits[w]) >> np.uint64(b + 1))) if b < 63 else 0
    end = (w // BLOCK_WORDS + 1) * BLOCK_WORDS
    for i in range(w + 1, end):
        n += popcount(bits[i])
    for i in range(w // BLOCK_WORDS + 1, blocks.size):
        n += blocks[i]
    return n


@njit(cache=True, nogil=True)
def _rebuild(scal, table, bits, blocks, threshold):
    """Keep the tracked keys whose hash is below ``threshold``, renumber their times 1..n in order, and build
    the table and the marks afresh (times are distinct and below ``TIMES``: ordered by a pass over them, not
    a sort)."""
    by_time = np.full(scal[TIMES], -1, dtype=np.int64)
    for s in range(scal[SLOTS]):
        key = table[2 * s]
        if key >= 0 and sample_hash(key) < threshold:
            by_time[table[2 * s + 1]] = key
    table[::2] = -1
    bits[:] = 0
    blocks[:] = 0
    mask = scal[SLOTS] - 1
    n = 0
    for t in range(1, by_time.size):
        key = by_time[t]
        if key < 0:
            continue
        n += 1
        s = _slot_of(key, mask)
        while table[2 * s] >= 0:
            s = (s + 1) & mask
        table[2 * s] = key
        table[2 * s + 1] = n
        _mark(bits, blocks, n, 1)
    scal[THRESHOLD] = threshold
    scal[KEYS] = n
    scal[NOW] = n + 1
    scal[REBUILDS] += 1


@njit(cache=True, nogil=True, inline="always")
def _touch(scal, table, bits, blocks, hist, key, col, scale):
    """Replay one sampled access of ``key`` (column ``col``): its distance goes into ``hist`` with the weight
    of the rate it was sampled at (``scale``: ``FULL / scal[THRESHOLD]``, the caller's to keep, as a division
    costs as much as the rest); the key moves to the top of the stack."""
    threshold = scal[THRESHOLD]
    if sample_hash(key) >= threshold:  # sampled at a rate since lowered
        return
    if scal[NOW] >= scal[TIMES]:
        _rebuild(scal, table, bits, blocks, threshold)
    mask = scal[SLOTS] - 1
    s = _slot_of(key, mask)
    while table[2 * s] >= 0 and table[2 * s] != key:
        s = (s + 1) & mask
    now = scal[NOW]
    if table[2 * s] == key:
        t0 = table[2 * s + 1]
        d = _marks_after(bits, blocks, t0)  # keys whose last touch came after this one's
        _mark(bits, blocks, t0, -1)
        hist[col, distance_bin(d * scale)] += scale
    else:
        table[2 * s] = key
        scal[KEYS] += 1
        hist[col, COLD] += scale
    table[2 * s + 1] = now
    _mark(bits, blocks, now, 1)
    scal[NOW] = now + 1
    while scal[KEYS] > scal[MAX_KEYS]:  # too many keys for the table: halve the rate
        _rebuild(scal, table, bits, blocks, scal[THRESHOLD] // 2)
        scal[RATE_DROPS] += 1


@njit(cache=True, nogil=True)
def observe(ids, row_base, tag, col0, state, hist, buf):
    """One lookup of a layer: ``ids`` int64 ``[M, H]``, row ``ids[m, h]`` of the head whose first row in the
    layer is ``row_base[h]``, counted in column ``col0 + h`` (``hist[:, LOOKED]`` counts every row). Sampled rows
    are replayed into the stack. ``buf`` (``[count, overflow, threshold, keys..., cols...]``) collects the rows
    whose hash is below its threshold while it has room (for a host's curve; threshold 0: none).

    Passes: every row's hash (a loop the compiler vectorises), the positions of the few below a threshold, then
    their updates with the table slot of the one ``AHEAD`` prefetched (inside a lookup, whose rows have just
    pushed the table out of the CPU's caches, each probe was a cache miss). One pass with the update in it ran 3x
    slower on the rows that were not sampled."""
    M, H = ids.shape
    scal, table, bits, blocks = _parts(state)
    scratch = np.empty(M * H, dtype=np.int64)
    tag_bits = np.int64(tag) << KEY_ROW_BITS
    for m in range(M):
        for h in range(H):
            scratch[m * H + h] = sample_hash(tag_bits | (row_base[h] + ids[m, h]))
    for h in range(H):
        hist[col0 + h, LOOKED] += M
    threshold = scal[THRESHOLD]
    scale = FULL / max(threshold, 1)
    buf_threshold = buf[2] if buf.size > 3 else 0
    top = max(threshold, buf_threshold)
    picked = 0  # the sampled rows' positions, gathered in place
    for i in range(M * H):
        if scratch[i] < top:
            scratch[picked] = i
            picked += 1
    cap = (buf.size - 3) // 2
    mask = scal[SLOTS] - 1
    for k in range(picked):
        if k + AHEAD < picked:  # the table slot of a row ahead, on its way while this one is replayed
            i = scratch[k + AHEAD]
            _prefetch(table, 2 * _slot_of(tag_bits | (row_base[i % H] + ids[i // H, i % H]), mask))
        m, h = divmod(scratch[k], H)
        key = tag_bits | (row_base[h] + ids[m, h])
        x = sample_hash(key)
        if x < threshold:
            _touch(scal, table, bits, blocks, hist, key, col0 + h, scale)
            if scal[THRESHOLD] != threshold:
                threshold = scal[THRESHOLD]
                scale = FULL / max(threshold, 1)
        if x < buf_threshold:
            n = buf[0]
            if n < cap:
                buf[3 + n] = key
                buf[3 + cap + n] = col0 + h
                buf[0] = n + 1
            else:
                buf[1] += 1


@njit(cache=True, nogil=True)
def replay(keys, cols, col_map, state, hist):
    """Replay buffered accesses (``keys[i]`` in column ``col_map[cols[i]]``; -1 skips it), the table slot of the
    key ``AHEAD`` prefetched (a host's stack in shared memory is out of the CPU's caches: 1.5x faster)."""
    scal, table, bits, blocks = _parts(state)
    mask = scal[SLOTS] - 1
    n = keys.size
    for i in range(n):
        if i + AHEAD < n:
            _prefetch(table, 2 * _slot_of(keys[i + AHEAD], mask))
        c = col_map[cols[i]]
        if c >= 0:
            _touch(scal, table, bits, blocks, hist, keys[i], c, FULL / max(scal[THRESHOLD], 1))


@njit(cache=True, nogil=True)
def hits_at(hist, cols, sizes, out):
    """``out[i, j]``: the estimated hits of column ``cols[i]`` in an LRU of ``sizes[j]`` rows (SHARDS_adj: the
    rows looked up that the sample's weight misses or overcounts are taken as distance 0, the hottest rows)."""
    for i in range(cols.size):
        c = cols[i]
        seen = 0.0
        for b in range(N_BINS):
            seen += hist[c, b]
        looked = hist[c, LOOKED]
        adjust = looked - seen
        for j in range(sizes.size):
            S = sizes[j]
            total = hist[c, 0] + adjust if S > 0 else 0.0
            for b in range(1, N_BINS - 1):
                lo = bin_low(b)
                hi = bin_low(b + 1)
                if hi <= S:
                    total += hist[c, b]
                else:
                    if lo < S:
                        total += hist[c, b] * (S - lo) / (hi - lo)
                    break
            out[i, j] = min(max(total, 0.0), looked)
