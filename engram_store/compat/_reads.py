"""Reads with Mooncake's per-key results over this project's all-or-nothing reads.

:class:`~engram_store.DistributedStore` reads a whole batch or raises. Mooncake answers per key (and per range):
a missing key fails its own entries while the others are read. So every batch is read at once first, and only
when that fails is it read again key by key, to find which entries fail and with what code. A batch read checks
every key and range before it copies anything, so a first attempt refused for a missing key or a bad range
leaves the destinations untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..client import DistributedStore
from ..errors import EngramError, InvalidArgument
from ._buffers import Registrations, view
from ._codes import ErrorCode

INVALID = int(ErrorCode.INVALID_PARAMS)

#: ``fail(op, exc)``: log the failure, keep it as the store's ``last_error``, and return its code.
Fail = Callable[[str, BaseException], int]


def _is_offset(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and value >= 0


def object_sizes(store: DistributedStore, keys: Sequence[Any], fail: Fail, op: str) -> list[int]:
    """Each object's size in one master request; a negative code for a key that has none (found key by key)."""
    if not keys:
        return []
    if all(isinstance(k, str) and k for k in keys):
        try:
            return [info.size for info in store.locate(list(keys), lease=False)]
        except EngramError:
            pass
    sizes = []
    for key in keys:
        try:
            sizes.append(store.get_size(key))
        except EngramError as exc:
            sizes.append(fail(op, exc))
    return sizes


def read_whole(store: DistributedStore, keys: Sequence[str], dsts: Sequence[np.ndarray], sizes: Sequence[int],
               fail: Fail, op: str) -> list[int]:
    """Read each whole object (``sizes`` bytes) into the start of its destination; the bytes read, or a code."""
    if not keys:
        return []
    try:
        store.get_into_ranges(list(dsts), [[key] for key in keys], [[[0]] for _ in keys], [[[0]] for _ in keys],
                              [[[size]] for size in sizes])
        return list(sizes)
    except EngramError:
        pass
    results = []
    for key, dst in zip(keys, dsts):
        try:
            results.append(store.get_into(key, dst))
        except EngramError as exc:
            results.append(fail(op, exc))
    return results


@dataclass
class _KeyRead:
    """The fragments of one key read into one buffer; ``row`` is that key's list in the results, filled in place."""

    buffer: np.ndarray
    key: Any
    row: list[int]
    fragments: list[int]  # indices still to read
    dst: Sequence[int]
    src: Sequence[int]
    sizes: Sequence[int]


def _count(seq: Any, i: int, j: int | None = None) -> int:
    """Mooncake's result shape: the length of ``seq[i]`` (or ``seq[i][j]``), 1 where that entry is missing."""
    try:
        return len(seq[i]) if j is None else len(seq[i][j])
    except (IndexError, TypeError):
        return 1


def read_ranges(store: DistributedStore, registrations: Registrations, buffer_ptrs: Sequence[int],
                all_keys: Sequence[Sequence[str]], all_dst_offsets: Sequence, all_src_offsets: Sequence,
                all_sizes: Sequence, fail: Fail) -> list[list[list[int]]]:
    """Mooncake's ``get_into_ranges``: per buffer, key and fragment the bytes read, or a negative code.

    Every entry starts as -600 and stays so where Mooncake leaves it: the whole result when the top-level lists
    differ in length, a key whose offset and size lists differ in length (an empty list for a key with none),
    a fragment past its destination buffer (the registered region holding it; for an unregistered address,
    exactly the bytes the call writes) or past its object. A missing key fails its own fragments only.
    """
    op = "get_into_ranges"
    n = len(buffer_ptrs)
    results = [[[INVALID] * _count(all_dst_offsets, i, j) for j in range(_count(all_keys, i))] for i in range(n)]
    if not len(all_keys) == len(all_dst_offsets) == len(all_src_offsets) == len(all_sizes) == n:
        fail(op, InvalidArgument(f"{op}: expected one entry per buffer ({n}) in all_keys, all_dst_offsets, "
                                 f"all_src_offsets and all_sizes, got {len(all_keys)}, {len(all_dst_offsets)}, "
                                 f"{len(all_src_offsets)} and {len(all_sizes)}"))
        return results
    plans: list[_KeyRead] = []
    for i, ptr in enumerate(buffer_ptrs):
        keys, dsts, srcs, sizes = all_keys[i], all_dst_offsets[i], all_src_offsets[i], all_sizes[i]
        if not len(keys) == len(dsts) == len(srcs) == len(sizes):
            fail(op, InvalidArgument(f"buffer {i}: expected one offset and size list per key ({len(keys)} keys), "
                                     f"got {len(dsts)}, {len(srcs)} and {len(sizes)}"))
            continue
        shaped = []
        for j, key in enumerate(keys):
            if len(dsts[j]) == len(srcs[j]) == len(sizes[j]):
                shaped.append(j)
            else:
                fail(op, InvalidArgument(f"all_dst_offsets[{i}][{j}], all_src_offsets[{i}][{j}], all_sizes[{i}][{j}]"
                                         f": expected lists of one length, got {len(dsts[j])}, {len(srcs[j])} and "
                                         f"{len(sizes[j])} (key {key!r})"))
        valid = {j: [k for k in range(len(dsts[j])) if all(map(_is_offset, (dsts[j][k], srcs[j][k], sizes[j][k])))]
                 for j in shaped}
        capacity = registrations.capacity(ptr) if isinstance(ptr, int) and ptr > 0 else None
        if capacity is None:  # not registered: exactly the bytes asked of it
            capacity = max((int(dsts[j][k]) + int(sizes[j][k]) for j in shaped for k in valid[j]), default=0)
        try:
            buffer = view(ptr, capacity, f"buffer_ptrs[{i}]")
        except EngramError as exc:
            fail(op, exc)
            continue
        for j in shaped:
            inside = [k for k in valid[j] if int(dsts[j][k]) + int(sizes[j][k]) <= capacity]
            if len(inside) < len(dsts[j]):
                outside = sorted(set(range(len(dsts[j]))) - set(inside))
                fail(op, InvalidArgument(f"buffer {i}, key {keys[j]!r}: fragments {outside} are not offsets and "
                                         f"sizes >= 0 within the buffer's {capacity} bytes"))
            plans.append(_KeyRead(buffer, keys[j], results[i][j], inside, dsts[j], srcs[j], sizes[j]))
    plans = [plan for plan in plans if plan.fragments]
    try:
        _read(store, plans)
    except EngramError:
        for plan in plans:
            _read_key(store, plan, fail, op)
    return results


def _read(store: DistributedStore, plans: Sequence[_KeyRead]) -> None:
    """All plans in one read; fills their rows with the bytes read (or raises, having copied nothing)."""
    if not plans:
        return
    picked = [(plan, plan.fragments) for plan in plans]
    read = store.get_into_ranges([plan.buffer for plan in plans], [[plan.key] for plan in plans],
                                 [[[int(plan.dst[k]) for k in ks]] for plan, ks in picked],
                                 [[[int(plan.src[k]) for k in ks]] for plan, ks in picked],
                                 [[[int(plan.sizes[k]) for k in ks]] for plan, ks in picked])
    for (plan, ks), per_buffer in zip(picked, read):
        for k, nbytes in zip(ks, per_buffer[0]):
            plan.row[k] = int(nbytes)


def _read_key(store: DistributedStore, plan: _KeyRead, fail: Fail, op: str) -> None:
    """One key's fragments on their own: a missing key fails them all, a fragment past the object fails alone."""
    try:
        size = store.get_size(plan.key)
    except EngramError as exc:
        code = fail(op, exc)
        for k in plan.fragments:
            plan.row[k] = code
        return
    inside = [k for k in plan.fragments if int(plan.src[k]) + int(plan.sizes[k]) <= size]
    if len(inside) < len(plan.fragments):
        fail(op, InvalidArgument(f"all_src_offsets: fragments {sorted(set(plan.fragments) - set(inside))} of key "
                                 f"{plan.key!r} reach past its {size} bytes"))
    plan.fragments = inside
    try:
        _read(store, [plan])
    except EngramError as exc:
        code = fail(op, exc)
        for k in inside:
            plan.row[k] = code
