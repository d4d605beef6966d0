"""Numba kernels of Qwen4-Exp's PLE: the n-gram hash of continuous-batching steps (whole sequences are one step).

Takes arrays and scalars only; :class:`engram_model.ple.PLEHasher` checks dtypes, shapes and contiguity first, and
tests hold the kernel to the NumPy twins of ``_hasher.py`` (``tests/model/test_ple_hash.py``).

:func:`hash_ragged` builds each token's window of raw token ids (the reference's ``_shift_right_ignore_eos``: walking
back from the token, the first EOS met is kept and every older slot reads EOS; the token itself is never
replaced), and hands blocks of :data:`~engram_model._ngram_kernels.HASH_BLOCK` windows to the mixing and modulo of
DeepSeek-V4.1's hash, which is the same arithmetic (``r = t0 * m0 ^ t1 * m1 ^ ...`` per order, int64 wrapping,
``r mod size + offset`` non-negative).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .._ngram_kernels import HASH_BLOCK, ragged_refusal, rows_of_block


@njit(cache=True, nogil=True, error_model="numpy")
def hash_ragged(tokens, query_start_loc, slots, vocab, eos, history, multipliers, sizes, inv_sizes, offsets,
                heads_per_ngram, emit, commit, out):
    """Rows of one engine step of R requests; returns (0, -1) or the first problem.

    tokens int64 [T] raw token ids, request r's are tokens[query_start_loc[r] : query_start_loc[r + 1]] and its
    context is history[slots[r]]; query_start_loc int64 [R + 1] (0 first and T last, checked by the caller); slots
    int64 [R]; history int64 [S, C] (C = ngram_size - 1), each slot's last C tokens oldest first (EOS where there
    were none); multipliers int64 [n_layers, ngram_size]; sizes, offsets int64 and inv_sizes float64 [n_layers,
    heads]; out int64 [T, n_layers, heads] (written only if emit). Where commit, each request's slot moves on by its
    tokens; a request without tokens leaves its slot as it was; with emit False only the last C tokens of each
    request are read (a commit). Problems, found before anything is written: (1, t) tokens[t] is outside
    [0, vocab); (2, r) slots[r] is outside [0, S); (3, r) slots[r] was named by an earlier request; (4, r)
    query_start_loc[r + 1] < query_start_loc[r].
    """
    S, C = history.shape
    kind, at = ragged_refusal(tokens, query_start_loc, slots, vocab, S)
    if kind:
        return kind, at
    n_layers, max_n = multipliers.shape
    W = sizes.shape[0] * sizes.shape[1]
    small = False
    for layer in range(n_layers):
        for h in range(sizes.shape[1]):
            small = small or sizes[layer, h] <= 4096
    p_flat, inv_flat, off_flat = sizes.reshape(W), inv_sizes.reshape(W), offsets.reshape(W)
    out2 = out.reshape(out.shape[0], W)                                 # (T, W): a token's rows, layer by layer
    ctx = np.empty(C, dtype=np.int64)                                   # ctx[k]: the token k + 1 back
    lanes = HASH_BLOCK if emit else 0                                    # a commit hashes nothing
    toks = np.full((max_n, lanes), eos, dtype=np.int64)                  # a partial block hashes (and drops) EOS
    mix = np.empty((n_layers * C, lanes), dtype=np.int64)
    tmp = np.empty((W, lanes), dtype=np.int64)
    nb = 0   # windows of the current block so far
    t0 = 0   # flat index of the block's first token
    for r in range(slots.shape[0]):
        lo, hi = query_start_loc[r], query_start_loc[r + 1]
        if lo == hi:
            continue
        slot = slots[r]
        for k in range(C):
            ctx[k] = history[slot, C - 1 - k]
        for t in range(lo if emit else max(lo, hi - C), hi):
            c0 = tokens[t]
            if emit:
                if nb == 0:
                    t0 = t
                toks[0, nb] = c0  # the token itself, EOS or not
                blocked = False   # an EOS met walking back: it is kept, everything older reads EOS
                for s in range(1, max_n):
                    prev = ctx[s - 1]
                    toks[s, nb] = eos if blocked else prev
                    blocked = blocked or prev == eos
                nb += 1
                if nb == HASH_BLOCK:
                    rows_of_block(toks, nb, multipliers, heads_per_ngram, p_flat, inv_flat, off_flat, small, mix,
                                  tmp, out2, t0)
                    nb = 0
            for k in range(C - 1, 0, -1):
                ctx[k] = ctx[k - 1]
            ctx[0] = c0
        if commit:
            for k in range(C):
                history[slot, C - 1 - k] = ctx[k]
    if nb:
        rows_of_block(toks, nb, multipliers, heads_per_ngram, p_flat, inv_flat, off_flat, small, mix, tmp, out2, t0)
    return 0, -1
