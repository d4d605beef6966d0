"""Numba kernels for multi-head N-gram hashing.

:func:`hash_layers` hashes a batch of whole sequences; :func:`hash_step` hashes one decode step of many
requests, each request's new tokens after the context it kept in a slot table (see
:class:`engram_model.IncrementalHasher`). One pass over the token ids computes the row ids of every head of
every requested layer, so the ids of a position and its left context are read once. Integer arithmetic
matches NumPy's exactly: int64 products wrap on overflow, and the row is the floor-modulo ``mix % prime``
(never negative, since primes are positive).

The modulo avoids the 64-bit hardware division, the slowest step: the quotient is estimated in float64 from
a precomputed ``1 / prime``, the remainder ``mix - q * prime`` is then exact in wrapping int64 arithmetic
(its true value is small, so it survives the wrap), and a few corrections bring it into ``[0, prime)``.
Rounding ``mix`` to float64 moves the estimate by at most ``2**10 / prime``, so the corrections take one or
two steps for table-sized primes (more only for tiny moduli); the loops make the result exact for any
positive modulus. That arithmetic lives once, in :func:`_position_rows`, inlined into both kernels (called
rather than inlined, it slows the whole-sequence kernel down by a quarter or more). ``tests/model`` checks the
kernels against the NumPy formulation in :func:`engram_model.demo._hasher.ngram_hashes_numpy` and a Python-int
transcription.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["hash_layers", "hash_step"]


@njit(inline="always", error_model="numpy")
def _position_rows(tokens, multipliers, primes, inv_primes, min_n, n_head, out, b, t):
    # The rows of one position for every layer: tokens[k] is token[t - k] (pad_id before the start);
    # writes out[:, b, t, :]. Both kernels inline it, so they cannot drift apart.
    n_layers, max_n = multipliers.shape
    for layer in range(n_layers):
        mix = tokens[0] * multipliers[layer, 0]
        for n in range(2, max_n + 1):  # order n extends order n-1's mix by one more token
            mix ^= tokens[n - 1] * multipliers[layer, n - 1]
            if n < min_n:
                continue
            base = (n - min_n) * n_head
            fmix = np.float64(mix)
            for j in range(n_head):
                p = primes[layer, base + j]
                r = mix - np.int64(fmix * inv_primes[layer, base + j]) * p  # mix % p, up to a few p
                while r < 0:
                    r += p
                while r >= p:
                    r -= p
                out[layer, b, t, base + j] = r


@njit(cache=True, nogil=True, error_model="numpy")
def _hash_layers(x, pad_id, multipliers, primes, inv_primes, min_n, n_head, out):
    # x: int64 [B, T]; multipliers: int64 [n_layers, max_n]; primes: int64 [n_layers, H];
    # inv_primes: float64 1 / primes; out: int64 [n_layers, B, T, H] with H = (max_n - min_n + 1) * n_head.
    B, T = x.shape
    max_n = multipliers.shape[1]
    tokens = np.empty(max_n, dtype=np.int64)
    for b in range(B):
        for t in range(T):
            for k in range(max_n):  # token[t - k], left-padded with pad_id
                tokens[k] = x[b, t - k] if t >= k else pad_id
            _position_rows(tokens, multipliers, primes, inv_primes, min_n, n_head, out, b, t)


@njit(cache=True, nogil=True, error_model="numpy")
def hash_step(new, slots, ring, head, count, total, pad_id, multipliers, primes, inv_primes, min_n, n_head, out):
    """One decode step of many requests: hash each request's new tokens after its kept context, then keep them.

    new: int64 [B, T] (compressed ids); slots: int64 [B], distinct rows of the slot table. The slot table holds
    each request's last compressed tokens in a ring: ring int64 [S, keep], head int64 [S] (where the next token
    goes), count int64 [S] (tokens kept, <= keep), total int64 [S] (tokens seen). out: int64 [n_layers, B, T, H];
    the other arguments as for :func:`hash_layers`. Context the ring does not hold reads as pad_id, as at the
    start of a sequence. No checks here (it runs every decode step): the caller passes C-contiguous arrays of
    these dtypes, ``keep >= max_n - 1`` and slots in range.
    """
    B, T = new.shape
    keep = ring.shape[1]
    max_n = multipliers.shape[1]
    C = max_n - 1
    context = np.empty(C, dtype=np.int64)  # context[a - 1]: the kept token a steps back
    tokens = np.empty(max_n, dtype=np.int64)
    for b in range(B):
        s = slots[b]
        h = head[s]
        c = count[s]
        for a in range(1, C + 1):
            if a <= c:
                i = h - a
                if i < 0:
                    i += keep
                context[a - 1] = ring[s, i]
            else:
                context[a - 1] = pad_id
        for t in range(T):
            for k in range(max_n):  # token[t - k]: this step's, else the kept context
                tokens[k] = new[b, t - k] if t >= k else context[k - t - 1]
            _position_rows(tokens, multipliers, primes, inv_primes, min_n, n_head, out, b, t)
        # Keep the new tokens; of a long step only the last keep survive (they fill the ring from any head).
        for t in range(T - keep if T > keep else 0, T):
            ring[s, h] = new[b, t]
            h += 1
            if h == keep:
                h = 0
        head[s] = h
        count[s] = min(c + T, keep)
        total[s] += T


def hash_layers(x: np.ndarray, pad_id: int, multipliers: np.ndarray, primes: np.ndarray, min_n: int,
                n_head: int) -> np.ndarray:
    """Row ids ``int64 [n_layers, B, T, H]`` for token ids ``x`` (int64 ``[B, T]``).

    ``multipliers`` is int64 ``[n_layers, max_n]``, ``primes`` int64 ``[n_layers, H]`` (all > 0) with
    ``H = (max_n - min_n + 1) * n_head``, heads ordered n-gram major. The caller has validated the values;
    this wrapper fixes dtype and layout.
    """
    x = np.ascontiguousarray(x, dtype=np.int64)
    multipliers = np.ascontiguousarray(multipliers, dtype=np.int64)
    primes = np.ascontiguousarray(primes, dtype=np.int64)
    assert x.ndim == 2, f"x must be [B, T], got shape {x.shape}"
    assert multipliers.ndim == 2 and primes.ndim == 2 and multipliers.shape[0] == primes.shape[0]
    assert 2 <= min_n <= multipliers.shape[1], f"min_n must be in 2..max_n, got {min_n}"
    assert primes.shape[1] == (multipliers.shape[1] - min_n + 1) * n_head, \
        "primes must have (max_n - min_n + 1) * n_head columns"
    assert (primes > 0).all(), "primes must be positive"
    out = np.empty((primes.shape[0], x.shape[0], x.shape[1], primes.shape[1]), dtype=np.int64)
    _hash_layers(x, np.int64(pad_id), multipliers, primes, 1.0 / primes, np.int64(min_n), np.int64(n_head), out)
    return out
