"""Numba kernels of DeepSeek-V4.1's Engram: the n-gram hash, FP8 row decoding (fused with the row gather) and the gate.

All take arrays and scalars only; the wrappers in ``_hasher.py``, ``_fp8.py`` and ``_engram.py`` check dtypes,
shapes and contiguity first. Each kernel is tested against a plain NumPy version (``tests/model/test_v41_*``).

* :func:`hash_step` hashes ``T`` new tokens of ``B`` sequences after the history each one carries (the last
  ``max_ngram_size - 1`` compressed ids, DEAD where there is none), for every Engram layer in one pass; a whole
  sequence is one step from an all-DEAD history. The modulo avoids 64-bit division as
  :mod:`engram_model.demo._kernels` does: a float64 quotient estimate from ``1 / prime``, then exact corrections.
* :func:`hash_ragged` is the same hash for one step of a continuous-batching engine: the requests' tokens
  flattened into one array (``query_start_loc`` marking where each starts), each request's history in a slot of
  one state, document starts that block the look-back, and a switch that hashes a speculative draft without
  moving the state (or moves it without hashing, for the accepted tokens). It works through blocks of
  :data:`HASH_BLOCK` tokens, column by column, so its inner loops are vector loops.
* :func:`decode_rows` and :func:`gather_decode` turn packed rows (``head_dim`` e4m3 bytes, then one e8m0 scale
  byte per 32 values) into bf16-exact float32 through a ``[scale byte, code]`` table of the rounded products.
* :func:`gate_output` is the gate and the residual update for every token and stream, reading ``kv`` already
  rounded to bf16 (:func:`round_bf16_inplace`).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from .._ngram_kernels import HASH_BLOCK, ragged_refusal, rows_of_block

#: A compressed id that blocks every n-gram reaching it (masked tokens, positions before a sequence's start).
DEAD = -1
#: Values per e8m0 scale byte.
BLOCK = 32
#: The gate's floor on |dot| before the signed square root (the reference's clamp_value).
GATE_CLAMP = 1e-6


@njit(inline="always")
def _bf16(x):
    # Round a float32 to the nearest bfloat16 (ties to even), returned as float32. Infinities stay, and the
    # quiet NaNs NumPy produces stay NaN.
    u = np.uint64(np.float32(x).view(np.uint32))
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return np.uint32(u).view(np.float32)


# ---- hash -------------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True, error_model="numpy")
def hash_step(ids, token_map, mask, has_mask, positions, has_positions, history, pad, multipliers, primes,
              inv_primes, offsets, n_heads, out):
    """Rows of ``T`` new tokens of ``B`` sequences; returns -1, or the flat index of the first bad token id.

    ids int64 [B, T] raw token ids; token_map int64 [V]; mask bool [B, T] (False: DEAD; read only if has_mask);
    positions int64 [B, T] (slot s of a token is blocked where its position is below s; read only if
    has_positions); history int64 [B, max_n - 1], history[b, k] the compressed id k + 1 tokens back or DEAD,
    updated in place; pad: the compressed pad id; multipliers int64 [n_layers, max_n]; primes, offsets int64 and
    inv_primes float64 [n_layers, cols]; out int64 [B, T, n_layers, cols], row % prime + offset. A bad id is
    reported before anything is written.
    """
    B, T = ids.shape
    V = token_map.shape[0]
    n_layers, max_n = multipliers.shape
    cols = primes.shape[1]
    C = max_n - 1
    for b in range(B):
        for t in range(T):
            v = ids[b, t]
            if v < 0 or v >= V:
                return b * T + t
    # One correction each way makes the float64 quotient estimate exact where every prime is above 2^12 (its
    # error is below 2^12 / prime); smaller primes (toy configs) take the general loop.
    small = False
    for layer in range(n_layers):
        for col in range(cols):
            small = small or primes[layer, col] <= 4096
    ctx = np.empty(C, dtype=np.int64)      # ctx[k]: the compressed id k + 1 tokens back, DEAD if none
    tok = np.empty(max_n, dtype=np.int64)  # tok[s]: the id s tokens back, pad once blocked
    mix = np.empty(cols, dtype=np.int64)   # mix[col]: the rolling XOR of the column's order
    for b in range(B):
        for k in range(C):
            ctx[k] = history[b, k]
        for t in range(T):
            c0 = token_map[ids[b, t]]
            if has_mask and not mask[b, t]:
                c0 = DEAD
            blocked = c0 == DEAD or (has_positions and positions[b, t] < 0)
            tok[0] = pad if blocked else c0
            for s in range(1, max_n):
                prev = ctx[s - 1]
                blocked = blocked or prev == DEAD or (has_positions and positions[b, t] < s)
                tok[s] = pad if blocked else prev
            for layer in range(n_layers):
                r = tok[0] * multipliers[layer, 0]
                for n in range(2, max_n + 1):  # order n extends order n - 1 by one more token (XOR)
                    r ^= tok[n - 1] * multipliers[layer, n - 1]
                    for h in range((n - 2) * n_heads, (n - 1) * n_heads):
                        mix[h] = r
                row = out[b, t, layer]
                p_row, inv_row, off_row = primes[layer], inv_primes[layer], offsets[layer]
                if small:
                    for col in range(cols):
                        p = p_row[col]
                        q = mix[col] - np.int64(np.float64(mix[col]) * inv_row[col]) * p
                        while q < 0:
                            q += p
                        while q >= p:
                            q -= p
                        row[col] = q + off_row[col]
                else:  # branch-free, so the columns vectorise
                    for col in range(cols):
                        p = p_row[col]
                        q = mix[col] - np.int64(np.float64(mix[col]) * inv_row[col]) * p
                        q = q + p if q < 0 else q
                        q = q - p if q >= p else q
                        row[col] = q + off_row[col]
            for k in range(C - 1, 0, -1):
                ctx[k] = ctx[k - 1]
            ctx[0] = c0
        for k in range(C):
            history[b, k] = ctx[k]
    return -1


@njit(cache=True, nogil=True, error_model="numpy")
def hash_ragged(tokens, query_start_loc, slots, token_map, mask, has_mask, doc_start, has_doc, history, pad,
                multipliers, primes, inv_primes, offsets, n_heads, emit, commit, out):
    """Rows of one engine step of R requests flattened as engines pass them; returns (0, -1) or the first problem.

    tokens int64 [T] raw token ids, request r's are tokens[query_start_loc[r] : query_start_loc[r + 1]] and its
    history is history[slots[r]]; query_start_loc int64 [R + 1] (0 first and T last, checked by the caller);
    slots int64 [R]; mask bool [T] (False: DEAD; read only if has_mask); doc_start bool [T] (True: the token starts a
    document, so nothing before it is looked back at; read only if has_doc); history int64 [S, max_n - 1] as for
    :func:`hash_step`; primes, offsets int64 and inv_primes float64 [n_layers, cols]; out int64 [T, n_layers, cols]
    (written only if emit). Where commit, each request's slot moves on by its tokens; a request without tokens
    leaves its slot as it was. With emit False only the last max_n - 1 tokens of each request are read for the
    state (a commit). Problems, found before anything is written: (1, t) tokens[t] is outside the token map;
    (2, r) slots[r] is outside [0, S); (3, r) slots[r] was named by an earlier request; (4, r)
    query_start_loc[r + 1] < query_start_loc[r].
    """
    R = slots.shape[0]
    S, C = history.shape
    n_layers, max_n = multipliers.shape
    W = primes.shape[0] * primes.shape[1]
    kind, at = ragged_refusal(tokens, query_start_loc, slots, token_map.shape[0], S)
    if kind:
        return kind, at
    small = False
    for layer in range(n_layers):
        for col in range(primes.shape[1]):
            small = small or primes[layer, col] <= 4096
    p_flat, inv_flat, off_flat = primes.reshape(W), inv_primes.reshape(W), offsets.reshape(W)
    out2 = out.reshape(out.shape[0], W)                                 # (T, W): a token's rows, layer by layer
    ctx = np.empty(C, dtype=np.int64)                                   # ctx[k]: the id k + 1 tokens back, or DEAD
    lanes = HASH_BLOCK if emit else 0                                    # a commit hashes nothing
    toks = np.full((max_n, lanes), pad, dtype=np.int64)                  # a partial block hashes (and drops) pads
    mix = np.empty((n_layers * C, lanes), dtype=np.int64)
    tmp = np.empty((W, lanes), dtype=np.int64)
    nb = 0   # tokens of the current block so far
    t0 = 0   # flat index of the block's first token
    for r in range(R):
        lo, hi = query_start_loc[r], query_start_loc[r + 1]
        if lo == hi:
            continue
        slot = slots[r]
        for k in range(C):
            ctx[k] = history[slot, k]
        for t in range(lo if emit else max(lo, hi - C), hi):
            if has_doc and doc_start[t]:
                for k in range(C):
                    ctx[k] = DEAD
            c0 = token_map[tokens[t]]
            if has_mask and not mask[t]:
                c0 = DEAD
            if emit:
                if nb == 0:
                    t0 = t
                blocked = c0 == DEAD
                toks[0, nb] = pad if blocked else c0
                for s in range(1, max_n):
                    prev = ctx[s - 1]
                    blocked = blocked or prev == DEAD
                    toks[s, nb] = pad if blocked else prev
                nb += 1
                if nb == HASH_BLOCK:
                    rows_of_block(toks, nb, multipliers, n_heads, p_flat, inv_flat, off_flat, small, mix, tmp, out2,
                                   t0)
                    nb = 0
            for k in range(C - 1, 0, -1):
                ctx[k] = ctx[k - 1]
            ctx[0] = c0
        if commit:
            for k in range(C):
                history[slot, k] = ctx[k]
    if nb:
        rows_of_block(toks, nb, multipliers, n_heads, p_flat, inv_flat, off_flat, small, mix, tmp, out2, t0)
    return 0, -1


# ---- FP8 rows ---------------------------------------------------------------------------------------------

#: Rows whose cache lines are touched together before they are decoded (see :func:`gather_decode`).
TOUCH_AHEAD = 32


@njit(inline="always")
def _decode_row(src, dst, lut, head_dim):
    # Decode one packed row src (uint8 [head_dim + head_dim // 32]) into dst (float32 [head_dim]) through the
    # [scale byte, code] table; returns True if the row holds a NaN (scale byte 255, or a code 0x7F / 0xFF).
    nan = False
    for k in range(head_dim // BLOCK):
        s = src[head_dim + k]
        nan |= s == 255
        for j in range(k * BLOCK, (k + 1) * BLOCK):
            c = src[j]
            nan |= (c & 0x7F) == 0x7F
            dst[j] = lut[s, c]
    return nan


@njit(cache=True, nogil=True)
def decode_rows(rows, lut, head_dim, out):
    """Packed rows uint8 [N, head_dim + head_dim // 32] -> float32 [N, head_dim]; -1, or the first bad row.

    lut float32 [256, 256]: lut[scale byte, code], the bf16-rounded value. A row is bad if a scale byte is 255
    (e8m0 NaN) or a code is an e4m3 NaN (0x7F, 0xFF).
    """
    N = rows.shape[0]
    for i in range(N):
        if _decode_row(rows[i], out[i], lut, head_dim):
            return i
    return -1


@njit(cache=True, nogil=True)
def gather_decode(tables, row_ids, offsets, lut, head_dim, out):
    """Gather rows straight from each column's table and decode them on the way: no copy of the packed rows.

    tables: a tuple of ``cols`` uint8 [N_c, row_bytes] arrays (column c's rows); row_ids int64 [N, cols], rows of
    the layer's one table (column c's start at offsets[c]); out float32 [N, cols, head_dim]. Returns
    (0, -1) on success, (1, i) if flat id i = n * cols + c is outside its column, (2, i) if its row holds a NaN.
    """
    N, cols = row_ids.shape
    total = N * cols
    row_bytes = tables[0].shape[1]
    touched = 0
    for first in range(0, total, TOUCH_AHEAD):
        last = min(first + TOUCH_AHEAD, total)
        # Random rows of tables far larger than the caches: load one byte of every cache line of the next rows
        # first, so their misses overlap (a short loop keeps many in flight), then decode them from cache.
        for i in range(first, last):
            n, c = divmod(i, cols)
            table = tables[c]
            r = row_ids[n, c] - offsets[c]
            if r < 0 or r >= table.shape[0]:
                return 1, i
            for b in range(0, row_bytes, 64):
                touched += table[r, b]
        for i in range(first, last):
            n, c = divmod(i, cols)
            if _decode_row(tables[c][row_ids[n, c] - offsets[c]], out[n, c], lut, head_dim):
                return 2, i
    return 0, -1 if touched >= 0 else -2  # (uses the touched bytes, so the loads stay)


# ---- gate -------------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def round_bf16_inplace(x):
    """Round every value of a float32 array [N, M] to bf16, in place."""
    N, M = x.shape
    for i in range(N):
        for j in range(M):
            x[i, j] = _bf16(x[i, j])


@njit(cache=True, nogil=True, error_model="numpy")
def gate_output(h, kv, w, eps, mask, has_mask, out):
    """out = bf16(h + g * value), g the per-stream gate; h float32 [N, hc, D], kv float32 [N, (hc + 1) * D]
    (bf16 values: hc keys, then the value shared by all streams), w float32 [hc, D] (q_weight * k_weight),
    mask bool [N] (g = 0 where False; read only if has_mask), out float32 [N, hc, D]. Sums run in float64.
    """
    N, hc, D = h.shape
    inv_sqrt_d = 1.0 / np.sqrt(np.float64(D))
    for n in range(N):
        for s in range(hc):
            g = np.float32(0.0)
            if not has_mask or mask[n]:
                hh = 0.0
                kk = 0.0
                hk = 0.0
                for j in range(D):
                    x = h[n, s, j]
                    k = kv[n, s * D + j]
                    hh += np.float64(x * x)
                    kk += np.float64(k * k)
                    hk += np.float64(x * w[s, j] * k)  # float32 products, as the reference forms them
                rstd = 1.0 / np.sqrt(hh / D + eps) / np.sqrt(kk / D + eps)
                dot = hk * rstd * inv_sqrt_d
                root = np.sqrt(max(abs(dot), GATE_CLAMP))
                g = np.float32(1.0 / (1.0 + np.exp(-math.copysign(root, dot))))
            for j in range(D):
                out[n, s, j] = _bf16(h[n, s, j] + g * kv[n, hc * D + j])


# ---- checkpoint -------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def pack_rows(weight, scale, out):
    """Interleave checkpoint rows into packed rows, checking them; returns -1, or the first row holding a NaN.

    weight uint8 [N, head_dim] (e4m3 codes), scale uint8 [N, head_dim // 32] (e8m0 bytes), out uint8
    [N, head_dim + head_dim // 32].
    """
    N, head_dim = weight.shape
    blocks = scale.shape[1]
    for i in range(N):
        nan = False
        for j in range(head_dim):  # branch-free, so it runs at memory speed
            c = weight[i, j]
            nan |= (c & 0x7F) == 0x7F
            out[i, j] = c
        for k in range(blocks):
            s = scale[i, k]
            nan |= s == 255
            out[i, head_dim + k] = s
        if nan:
            return i
    return -1


@njit(cache=True, nogil=True)
def dequantize_blocks(codes, scales, e4m3, out):
    """float32 out[i, j] = e4m3[codes[i, j]] * scales[i // 32, j // 32] (32x32 weight blocks); returns -1, or the
    flat index of the first NaN code."""
    R, K = codes.shape
    for i in range(R):
        nan = False
        for j in range(K):
            c = codes[i, j]
            nan |= (c & 0x7F) == 0x7F
            out[i, j] = e4m3[c] * scales[i // BLOCK, j // BLOCK]
        if nan:
            for j in range(K):
                if (codes[i, j] & 0x7F) == 0x7F:
                    return i * K + j
    return -1
