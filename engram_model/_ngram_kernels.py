"""Numba kernels the model families' n-gram hashes share: a block of tokens' rows (the mixes of every order, then
the modulo of every column, as vector loops over the block) and the first problem of a ragged step's arguments.
"""

from __future__ import annotations

import numpy as np
from numba import njit


#: Tokens whose rows :func:`hash_ragged` computes together: their n-gram mixes and modulos run as vector loops over
#: the block (one column at a time, every token alike), then the block is written out token by token.
HASH_BLOCK = 64


#: States up to this many slots find a slot named twice in a call with a byte per slot; larger ones sort the slots.
MARK_SLOTS = 1 << 16


@njit(inline="always")
def rows_of_block(toks, nb, multipliers, n_heads, primes, inv_primes, offsets, small, mix, tmp, out, t0):
    # Rows of the block's nb tokens into out[t0 : t0 + nb] (int64 [T, W], W = n_layers * cols, a token's columns
    # layer by layer). toks int64 [max_n, HASH_BLOCK]: toks[s, j] the id s tokens back from token j, pad once
    # blocked. mix int64 [n_layers * (max_n - 1), HASH_BLOCK]: mix[g, j] the rolling XOR of layer g // (max_n - 1)
    # at order g % (max_n - 1) + 2. tmp int64 [W, HASH_BLOCK]: the block's rows, column-major. primes, offsets
    # int64 and inv_primes float64 [W]. Column by column over the block, every inner loop is a plain vector loop;
    # token by token, each order's mix has to be spread over its n_heads columns, which compiles to scalar stores
    # (released config, per token: 33 ns that way; 21 ns this way, of which the modulos take 7 and the last
    # transpose into out 13).
    n_layers, max_n = multipliers.shape
    W = primes.shape[0]
    C = max_n - 1
    lanes = (nb + 7) & ~7  # whole vectors; the rest of a partial block is left alone
    for layer in range(n_layers):
        g = layer * C
        m0, m1 = multipliers[layer, 0], multipliers[layer, 1]
        for j in range(lanes):
            mix[g, j] = (toks[0, j] * m0) ^ (toks[1, j] * m1)
        for n in range(2, max_n):  # each order extends the one below by one more token (XOR)
            mn = multipliers[layer, n]
            for j in range(lanes):
                mix[g + n - 1, j] = mix[g + n - 2, j] ^ (toks[n, j] * mn)
    for w in range(W):
        src = mix[w // n_heads]
        p, inv, off = primes[w], inv_primes[w], offsets[w]
        dst = tmp[w]
        if small:
            for j in range(lanes):
                q = src[j] - np.int64(np.float64(src[j]) * inv) * p
                while q < 0:
                    q += p
                while q >= p:
                    q -= p
                dst[j] = q + off
        else:  # one correction each way (see hash_step)
            for j in range(lanes):
                q = src[j] - np.int64(np.float64(src[j]) * inv) * p
                q = q + p if q < 0 else q
                q = q - p if q >= p else q
                dst[j] = q + off
    for j in range(nb):
        for w in range(W):
            out[t0 + j, w] = tmp[w, j]


@njit(cache=True, nogil=True)
def ragged_refusal(tokens, query_start_loc, slots, V, S):
    """The first problem of a ragged step's arguments, (0, -1) if none (the codes of :func:`hash_ragged`; tokens
    must lie in [0, V), slots in [0, S), each named once)."""
    R = slots.shape[0]
    for r in range(R):
        if query_start_loc[r + 1] < query_start_loc[r]:
            return 4, r
    for r in range(R):
        if slots[r] < 0 or slots[r] >= S:
            return 2, r
    if S <= MARK_SLOTS:
        seen = np.zeros(S, dtype=np.uint8)
        for r in range(R):
            if seen[slots[r]]:
                return 3, r
            seen[slots[r]] = 1
    elif R > 1:
        order = np.argsort(slots, kind="mergesort")  # stable: the later of two equal slots comes second
        for i in range(1, R):
            if slots[order[i]] == slots[order[i - 1]]:
                return 3, order[i]
    for t in range(tokens.shape[0]):
        v = tokens[t]
        if v < 0 or v >= V:
            return 1, t
    return 0, -1
