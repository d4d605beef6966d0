"""Numba kernels of the disk tier: page layout, read planning, block reads and the hot-row cache.

Vocabulary (see ``_layout`` for the file format):

* A *block* is the unit of a read: one 4 KiB page holding ``rows_per_block`` whole rows (rows of at most
  4 KiB), or the ``block_bytes / 4096`` pages one larger row fills. Row ``r`` of head ``h`` lies in the block at
  file offset ``head_offset[h] + (r // rows_per_block) * block_bytes``, ``(r % rows_per_block) * row_bytes``
  bytes into it.
* ``ids`` is a validated C-contiguous ``int64 [M, H]`` array; position ``i = m * H + h`` of the output holds row
  ``ids[m, h]`` of head ``h`` at byte ``i * row_bytes``.
* A cache *key* is ``(tag << 40) | (row_base[h] + r)``: the layer's tag and the row's index among all rows of
  the layer, so one cache serves several layers. Keys are >= 0; -1 marks an empty way.

The cache is set-associative: ``meta[s]`` is one 64-byte line per set, word 0 the set's version (bits 16-63), pinned
ways (bits 8-14) and CLOCK reference bits (bits 0-6), words 1-7 the keys of its 7 ways; ``rows[s * 7 + w]`` holds
way ``w``'s row. Readers take no lock: they read a set as a sequence lock (version, keys and row, version again) and
count a row as a hit only if the version did not move and no writer was busy in the set. Writers (cache fills) are
serialised by the caller and mark the set busy while they replace a way (their kernels are in ``_cache_kernels``). A
hit reads one metadata line and the row (the cache's arrays start on a cache line), both prefetched a burst of rows
ahead (``_probe_all``), and marks its way used only after the lookup's rows are copied, with a plain byte store.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..kernels import prefetch_hint as _prefetch
from ._checksum import block_ok, seal_block
from ._intrinsics import (address, atomic_add, errno, fence_acquire, load_acquire, memcpy, memcpy_to,
                      or_low_byte_relaxed, pread, syscall3, syscall5)

WAYS = 7                    # ways per set: 7 keys and the version word fill one 64-byte line
META_WORDS = 8
REF_MASK = np.int64(0x7F)   # bits 0-6 of the version word: the CLOCK reference bits of the 7 ways
PIN_SHIFT = 8               # bits 8-14: ways pinned by a warm start (CLOCK passes them by); writers only
PIN_MASK = REF_MASK << PIN_SHIFT
VERSION_SHIFT = 16          # bits 16-63: the version, in steps of BUSY
BUSY = np.int64(1 << VERSION_SHIFT)  # set while a writer changes a set
KEY_ROW_BITS = 40           # a key's row part: up to 2**40 rows per layer
MAX_TAG = (1 << 23) - 1     # a key's layer tag keeps keys positive
#: status of a block that no worker reached (another block's failure stopped the read)
NOT_READ = np.int64(-(1 << 62))
EINTR = 4
BURST = 16         # the probe's pipeline: rows a burst (see _probe_all); 8-32 measured alike
RING = 64          # a power of two >= 3 bursts: the ones whose keys, ways and rows are in flight
RING_MASK = RING - 1

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@njit(cache=True, nogil=True, inline="always")
def _set_of(key, n_sets):
    # the product's top 32 bits scaled onto [0, n_sets) by a multiply and a shift, not a division
    return np.int64((((np.uint64(key) * _GOLDEN) >> np.uint64(32)) * np.uint64(n_sets)) >> np.uint64(32))


# ---- layout (the writer) --------------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def _pack_rows(rows, row_bytes, rows_per_block, block_bytes, out, first_offset=0, summed=0):
    """Lay ``rows`` (flat bytes of n whole rows, the first one at a block start) out as whole blocks in ``out``;
    with ``summed`` > 0 (``DiskLayout.summed_bytes``), each block ends with the checksum of its first ``summed``
    bytes, seeded with its offset in the file (the first block's is ``first_offset``)."""
    n = rows.size // row_bytes
    blocks = (n + rows_per_block - 1) // rows_per_block
    for b in range(blocks):
        first = b * rows_per_block
        count = min(rows_per_block, n - first)
        memcpy(out, b * block_bytes, rows, first * row_bytes, count * row_bytes)
        pad_from = b * block_bytes + count * row_bytes
        for p in range(pad_from, (b + 1) * block_bytes):
            out[p] = 0
        if summed > 0:
            seal_block(out, b * block_bytes, summed, first_offset + b * block_bytes)
    return blocks * block_bytes


@njit(cache=True, nogil=True)
def _unpack_rows(blocks, row_bytes, rows_per_block, block_bytes, n_rows, out):
    """The inverse of ``_pack_rows``: the first ``n_rows`` rows held by whole ``blocks``, packed in ``out``."""
    for r in range(n_rows):
        memcpy(out, r * row_bytes, blocks, (r // rows_per_block) * block_bytes + (r % rows_per_block) * row_bytes,
               row_bytes)
    return n_rows * row_bytes


# ---- planning a read ------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def _mark_used(meta, marks, count):
    """Set the CLOCK reference bits of the ways ``marks[:count]`` (``base * 8 + way``) once a lookup's rows are
    copied.

    The bit lives in the version word's lowest byte and is set with a plain byte store: writes among a lookup's
    probes stall on the misses in flight (a locked one on all of them) and cost a decode-sized hit a fifth of its
    time, while here the lines are still cached. A racing fill may lose a bit; the row then waits one more round
    of CLOCK.
    """
    for k in range(count):
        r = marks[k]
        or_low_byte_relaxed(meta, r >> 3, np.int64(1) << (r & 7))


@njit(cache=True, nogil=True, inline="always")
def _find_way(meta, base, key):
    # the way holding key (WAYS if none): every way compared, no early exit, so the way's position (random)
    # costs no branch misprediction
    found = np.int64(WAYS)
    for w in range(WAYS - 1, -1, -1):
        if meta[base + 1 + w] == key:
            found = w
    return found


@njit(cache=True, nogil=True)
def _probe_all(ids, row_base, tag, meta, rows, slot_bytes, out, row_bytes, miss_pos, miss_key):
    """Copy every row of ``ids`` the cache holds to its place in ``out``; list the others (output position and
    key) in ``miss_pos`` / ``miss_key``. Returns how many missed.

    A software pipeline over bursts of ``BURST`` rows: burst ``b + 2``'s keys are computed and their sets'
    metadata lines prefetched; burst ``b + 1``'s lines have arrived, so their ways are found (each set's version
    read first, as a sequence lock) and every line of their rows prefetched; burst ``b``'s rows are copied, each
    counted as a hit only if its set's version did not move meanwhile. A burst's misses and page walks overlap
    (one row at a time, 8 ahead, took 1.17x as long on a warm cache of 1.2 GiB). The keys and ways in flight sit
    in a small ring, so no pass over the whole lookup's keys leaves the CPU caches.
    """
    M, H = ids.shape
    n = M * H
    n_sets = meta.size // META_WORDS
    tag_bits = np.int64(tag) << KEY_ROW_BITS
    ring_key = np.empty(RING, dtype=np.int64)
    ring_base = np.empty(RING, dtype=np.int64)
    ring_version = np.empty(RING, dtype=np.int64)   # the set's version read before its keys
    ring_way = np.empty(RING, dtype=np.int64)
    ring_at = np.empty(RING, dtype=np.int64)        # the row's byte offset in rows, -1 on a miss
    marks = np.empty(n, dtype=np.int64)             # hits whose reference bit is set after the copies
    n_marks = 0
    K = 0
    am = 0
    ah = 0  # the position (m, h) of the row whose key is computed next
    bursts = (n + BURST - 1) // BURST
    for b in range(-2, bursts):
        if b + 2 < bursts:
            for p in range((b + 2) * BURST, min(n, (b + 3) * BURST)):
                key = tag_bits | (row_base[ah] + ids[am, ah])
                base = _set_of(key, n_sets) * META_WORDS
                ring_key[p & RING_MASK] = key
                ring_base[p & RING_MASK] = base
                _prefetch(meta, base)
                ah += 1
                if ah == H:
                    ah = 0
                    am += 1
        if 0 <= b + 1 < bursts:
            for p in range((b + 1) * BURST, min(n, (b + 2) * BURST)):
                base = ring_base[p & RING_MASK]
                version = load_acquire(meta, base)
                way = _find_way(meta, base, ring_key[p & RING_MASK])
                at = -1
                if way < WAYS and not (version & BUSY):
                    at = ((base // META_WORDS) * WAYS + way) * slot_bytes
                    ring_version[p & RING_MASK] = version
                    ring_way[p & RING_MASK] = way
                    line = at - (at & 63)
                    while line < at + row_bytes:  # every line of the row
                        _prefetch(rows, line)
                        line += 64
                ring_at[p & RING_MASK] = at
        if b < 0:
            continue
        for i in range(b * BURST, min(n, (b + 1) * BURST)):
            at = ring_at[i & RING_MASK]
            if at >= 0:
                memcpy(out, i * row_bytes, rows, at, row_bytes)
                fence_acquire()
                base = ring_base[i & RING_MASK]
                version = ring_version[i & RING_MASK]
                way = ring_way[i & RING_MASK]
                if (version >> VERSION_SHIFT) == (meta[base] >> VERSION_SHIFT):
                    if not (version & (np.int64(1) << way)):
                        marks[n_marks] = base * 8 + way
                        n_marks += 1
                    continue
            miss_pos[K] = i
            miss_key[K] = ring_key[i & RING_MASK]
            K += 1
    _mark_used(meta, marks, n_marks)
    return K


@njit(cache=True, nogil=True)
def _first_bad(ids, n_rows):
    """The first flat position ``m * H + h`` whose id lies outside ``[0, n_rows[h])``, or -1."""
    M, H = ids.shape
    for m in range(M):
        out_of_range = False
        for h in range(H):  # no early exit: the compares vectorise (a negative id is a huge unsigned one)
            out_of_range |= np.uint64(ids[m, h]) >= np.uint64(n_rows[h])
        if out_of_range:
            for h in range(H):
                if np.uint64(ids[m, h]) >= np.uint64(n_rows[h]):
                    return m * H + h
    return -1


@njit(cache=True, nogil=True)
def _serve_hits(ids, n_rows, row_base, tag, meta, rows, slot_bytes, out, row_bytes, miss_pos, miss_key):
    """Check ``ids``, copy every row the cache holds to ``out`` and list the others: their output positions in
    ``miss_pos`` and cache keys in ``miss_key`` (``int64 [M * H]`` each, the caller's). Returns how many missed, or
    ``-1 - i`` where ``i`` is the first position whose id lies outside its head (nothing is read then).

    One call a lookup and an integer back: a lookup the cache serves whole returns no array (each one a kernel
    returns costs its call about 2 us), and its blocks are planned by :func:`_plan_read` only where some row missed.
    """
    M, H = ids.shape
    bad = _first_bad(ids, n_rows)
    if bad >= 0:
        return -1 - bad
    if meta.size > 0:
        return _probe_all(ids, row_base, tag, meta, rows, slot_bytes, out, row_bytes, miss_pos, miss_key)
    tag_bits = np.int64(tag) << KEY_ROW_BITS
    i = 0
    for m in range(M):
        for h in range(H):
            miss_pos[i] = i
            miss_key[i] = tag_bits | (row_base[h] + ids[m, h])
            i += 1
    return M * H


@njit(cache=True, nogil=True)
def _plan_read(ids, miss_pos, head_offset, rows_per_block, block_bytes, row_bytes):
    """Plan the block reads of the rows :func:`_serve_hits` listed as missing (``miss_pos``: their output
    positions, ``m * H + h``).

    Returns ``(offsets, starts, order, in_block)``: ``offsets[j]`` the file offset of the j-th distinct block to
    read; the rows it serves are ``order[starts[j]:starts[j + 1]]`` (indices into the misses), ``in_block[k]``
    bytes into their block.
    """
    H = ids.shape[1]
    K = miss_pos.size
    # distinct blocks of the misses: an open-addressing table of block offsets
    size = 16
    while size < 2 * K:
        size *= 2
    table = np.full(size, -1, dtype=np.int64)
    slot_block = np.empty(size, dtype=np.int64)
    block_of = np.empty(K, dtype=np.int64)
    in_block = np.empty(K, dtype=np.int64)
    offsets = np.empty(K, dtype=np.int64)
    P = 0
    mask = np.uint64(size - 1)
    for k in range(K):
        i = miss_pos[k]
        h = i % H
        r = ids[i // H, h]
        off = head_offset[h] + (r // rows_per_block) * block_bytes
        in_block[k] = (r % rows_per_block) * row_bytes
        s = np.int64((np.uint64(off) * _GOLDEN >> np.uint64(20)) & mask)
        while table[s] != -1 and table[s] != off:
            s = np.int64((np.uint64(s) + np.uint64(1)) & mask)
        if table[s] == -1:
            table[s] = off
            slot_block[s] = P
            offsets[P] = off
            P += 1
        block_of[k] = slot_block[s]
    starts = np.zeros(P + 1, dtype=np.int64)
    for k in range(K):
        starts[block_of[k] + 1] += 1
    for j in range(P):
        starts[j + 1] += starts[j]
    fill = starts[:P].copy()
    order = np.empty(K, dtype=np.int64)
    for k in range(K):
        j = block_of[k]
        order[fill[j]] = k
        fill[j] += 1
    return offsets[:P], starts, order, in_block


# ---- reading blocks -------------------------------------------------------------------------------------------
#
# A *batch* is what one read moves, for one or several layers: ``fds[j]``, ``offsets[j]``, ``lens[j]`` describe
# block j; the rows it serves are ``starts[j] .. starts[j + 1]``, row t copied from ``src_off[t]`` bytes into the
# block to the address ``dst[t]`` (``row_len[t]`` bytes). ``sums[j]``: the bytes of block j its checksum covers
# (0: unchecked); a block whose checksum does not match serves nothing. ``status[j]`` ends as the bytes read,
# -errno, or BAD_CHECKSUM.

#: status of a block read whole whose bytes do not match its checksum
BAD_CHECKSUM = np.int64(-(1 << 61))

@njit(cache=True, nogil=True)
def _serve_block(j, buf, buf_at, starts, dst, src_off, row_len):
    for t in range(starts[j], starts[j + 1]):
        memcpy_to(dst[t], buf, buf_at + src_off[t], row_len[t])


@njit(cache=True, nogil=True)
def _pread_drive(fds, offsets, lens, starts, dst, src_off, row_len, sums, buf, counter, status):
    """One of several threads reading a batch with blocking ``pread``: claim the next block through
    ``counter[0]``, read it into ``buf``, check it, serve its rows. A failed, short or damaged read stops every
    thread of the batch (the counter jumps past the end). Returns the number of blocks this thread read."""
    P = offsets.size
    done = 0
    while True:
        j = atomic_add(counter, 0, 1)
        if j >= P:
            break
        got = pread(fds[j], buf, 0, lens[j], offsets[j])
        while got < 0 and errno() == EINTR:
            got = pread(fds[j], buf, 0, lens[j], offsets[j])
        status[j] = got if got >= 0 else -errno()
        if got == lens[j] and not block_ok(buf, 0, sums[j], offsets[j]):
            status[j] = BAD_CHECKSUM
        if status[j] != lens[j]:
            atomic_add(counter, 0, P)
            break
        done += 1
        _serve_block(j, buf, 0, starts, dst, src_off, row_len)
    return done


IOCB_WORDS = 8      # struct iocb: 64 bytes
EVENT_WORDS = 4     # struct io_event: 32 bytes
SLOT_SHIFT = 40     # an iocb's aio_data: block index | slot << 40
EAGAIN = 11
SUBMIT_BATCH = 1    # reads per io_submit (see _aio_drive); 1 and 2 measured ~0.95-1.05x fio, 32 at ~0.85x


@njit(cache=True, nogil=True)
def _aio_drive(ctx, nr_submit, nr_getevents, fds, offsets, lens, starts, dst, src_off, row_len, sums, bufs,
               slot_bytes, iocbs, ptrs, events, counter, status):
    """Read a batch with Linux native AIO from one thread, ``ptrs.size`` reads in flight. Each read goes to the
    kernel in an ``io_submit`` of its own as soon as a slot is free (a direct read's submission does its work in
    the call, a few microseconds: a batch of 32 keeps the last one waiting for the first 31, and the reads then
    finish in bursts); between submissions, completions are reaped without waiting, and the loop blocks in
    ``io_getevents`` only when every slot is busy or nothing is left to submit. Returns 0, or -errno if
    ``io_getevents`` itself failed (reads may then still be in flight: the context must be destroyed)."""
    P = offsets.size
    depth = ptrs.size
    free = np.arange(depth)
    n_free = depth
    inflight = 0
    pending = 0  # ptrs[:pending]: prepared, not yet accepted by io_submit
    stopped = False
    bufs_at = address(bufs, 0)
    iocbs_at = address(iocbs, 0)
    low = (np.int64(1) << SLOT_SHIFT) - 1
    no_wait = np.zeros(2, dtype=np.int64)  # struct timespec {0, 0}
    while True:
        while n_free > 0 and not stopped and pending < SUBMIT_BATCH:
            j = atomic_add(counter, 0, 1)
            if j >= P:
                stopped = True
                break
            n_free -= 1
            slot = free[n_free]
            w = slot * IOCB_WORDS
            iocbs[w] = j | (slot << SLOT_SHIFT)                    # aio_data
            iocbs[w + 1] = 0                                       # aio_key, aio_rw_flags
            iocbs[w + 2] = np.int64(fds[j]) << 32                  # IOCB_CMD_PREAD (0), aio_reqprio, aio_fildes
            iocbs[w + 3] = bufs_at + slot * slot_bytes             # aio_buf
            iocbs[w + 4] = lens[j]                                 # aio_nbytes
            iocbs[w + 5] = offsets[j]                              # aio_offset
            iocbs[w + 6] = 0
            iocbs[w + 7] = 0                                       # aio_flags, aio_resfd
            ptrs[pending] = iocbs_at + w * 8
            pending += 1
        if pending > 0:
            r = syscall3(nr_submit, ctx, pending, address(ptrs, 0))
            if r > 0:
                for t in range(r, pending):
                    ptrs[t - r] = ptrs[t]
                pending -= r
                inflight += r
            else:
                e = errno() if r < 0 else EAGAIN
                if e != EINTR and e != EAGAIN:
                    # the kernel refused the first read outright (a bad descriptor, a misaligned O_DIRECT
                    # read): report it, stop claiming, drop what was not submitted, drain what was
                    j = iocbs[(ptrs[0] - iocbs_at) >> 3] & low
                    status[j] = -e
                    if not stopped:
                        stopped = True
                    atomic_add(counter, 0, P)
                    for t in range(pending):
                        free[n_free] = iocbs[(ptrs[t] - iocbs_at) >> 3] >> SLOT_SHIFT
                        n_free += 1
                    pending = 0
        if inflight == 0:
            if pending == 0:
                break
            continue  # EINTR or EAGAIN with nothing in flight: submit again
        if n_free > 0 and not stopped:  # more to submit: take what has completed, do not wait
            got = syscall5(nr_getevents, ctx, 0, depth, address(events, 0), address(no_wait, 0))
        else:
            got = syscall5(nr_getevents, ctx, 1, depth, address(events, 0), 0)
        if got < 0:
            e = errno()
            if e == EINTR:
                continue
            return -e
        for i in range(got):
            data = events[i * EVENT_WORDS]
            res = events[i * EVENT_WORDS + 2]
            j = data & low
            slot = data >> SLOT_SHIFT
            status[j] = res
            if res == lens[j] and not block_ok(bufs, slot * slot_bytes, sums[j], offsets[j]):
                status[j] = BAD_CHECKSUM
            if status[j] == lens[j]:
                _serve_block(j, bufs, slot * slot_bytes, starts, dst, src_off, row_len)
            elif not stopped:
                stopped = True
                atomic_add(counter, 0, P)
            free[n_free] = slot
            n_free += 1
        inflight -= got
    return 0
