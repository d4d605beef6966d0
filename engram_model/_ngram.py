"""What the model families' n-gram hashes share: prime table sizes, the NumPy hash of n-gram windows, and the
arguments of a continuous-batching step (a ragged step's tokens, offsets and slots, and the refusals of what the
kernel :func:`engram_model._ngram_kernels.ragged_refusal` finds). DeepSeek-V4.1's and Qwen4-Exp's hashes mix and
reduce with the same arithmetic; the demo architecture's table sizes are primes too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engram_store.errors import InvalidArgument

from ._tokenizer import as_int_ids


_MILLER_RABIN_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)  # deterministic below 3.3e24


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin primality test (exact for every n below 3.3e24)."""
    if n < 2:
        return False
    for p in _MILLER_RABIN_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _MILLER_RABIN_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def find_next_prime(start: int, seen_primes: set[int]) -> int:
    """The smallest prime above ``start`` that is not in ``seen_primes``."""
    candidate = start + 1
    while not (is_prime(candidate) and candidate not in seen_primes):
        candidate += 1
    return candidate


def ragged_arguments(tokens: Any, slots: Any, query_start_loc: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A ragged step's ``(tokens [T], query_start_loc [R + 1], slots [R])`` as int64 vectors, their lengths and the
    offsets' ends checked (what the kernels check, :func:`~engram_model.v41._kernels.ragged_refusal`, aside)."""
    ids = int_vector(tokens, "tokens", "[T]")
    starts = int_vector(query_start_loc, "query_start_loc", "[R + 1]")
    where = int_vector(slots, "slots", "[R]")
    T, R = ids.shape[0], where.shape[0]
    if starts.shape[0] != R + 1:
        raise InvalidArgument(f"query_start_loc: expected R + 1 = {R + 1} offsets (slots has R = {R}), "
                              f"got {starts.shape[0]}")
    if starts[0] != 0 or starts[R] != T:
        raise InvalidArgument(f"query_start_loc: expected offsets from 0 to T = {T} (the number of tokens), "
                              f"got {int(starts[0])} to {int(starts[R])}")
    return ids, starts, where


def ragged_refused(kind: int, at: int, ids: np.ndarray, starts: np.ndarray, slots: np.ndarray, n_slots: int,
                   tokens_in: str) -> None:
    """Raise for the problem :func:`~engram_model.v41._kernels.ragged_refusal` found (its codes); ``tokens_in``
    says where token ids must lie."""
    if kind == 1:
        r = int(np.searchsorted(starts, at, side="right")) - 1
        raise InvalidArgument(f"tokens: token id {int(ids[at])} at [{at}] (request {r}) is outside {tokens_in}")
    if kind == 4:
        raise InvalidArgument(f"query_start_loc: expected non-decreasing offsets, got {int(starts[at])} then "
                              f"{int(starts[at + 1])} at [{at}, {at + 1}]")
    slot = int(slots[at])
    if kind == 2:
        raise InvalidArgument(f"slots: expected slots of the state in [0, {n_slots}), got {slot} for request {at}")
    first = int(np.flatnonzero(slots == slot)[0])
    raise InvalidArgument(f"slots: expected a distinct slot per request, got slot {slot} for requests {first} "
                          f"and {at}")


def int_vector(value: Any, name: str, shape: str) -> np.ndarray:
    """Integer ``value`` as a C-contiguous int64 vector (engines pass int32 ones: they are converted)."""
    if isinstance(value, np.ndarray) and value.dtype == np.int64 and value.ndim == 1 and value.flags.c_contiguous:
        return value  # the decode fast path: nothing to convert
    arr = as_int_ids(value, name)
    if arr.ndim != 1:
        raise InvalidArgument(f"{name}: expected shape {shape}, got shape {arr.shape}")
    return np.ascontiguousarray(arr)


def rows_numpy(tokens: np.ndarray, multipliers: np.ndarray, primes: np.ndarray, offsets: np.ndarray,
                n_heads: int) -> np.ndarray:
    """Rows ``[..., n_layers, cols]`` of n-gram windows ``tokens [..., max_n]`` (s tokens back, pad if blocked)."""
    n_layers, max_n = multipliers.shape
    out = np.empty(tokens.shape[:-1] + (n_layers, primes.shape[1]), dtype=np.int64)
    for layer in range(n_layers):
        r = tokens[..., 0] * multipliers[layer, 0]
        for n in range(2, max_n + 1):
            r = r ^ (tokens[..., n - 1] * multipliers[layer, n - 1])
            cols = slice((n - 2) * n_heads, (n - 1) * n_heads)
            out[..., layer, cols] = r[..., None] % primes[layer, cols] + offsets[layer, cols]
    return out
