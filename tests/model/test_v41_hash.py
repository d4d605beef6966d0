"""V41Hasher: the Numba kernel and the NumPy version against the reference rule transcribed in Python ints,
for random configs, masks and document starts; chunked steps and snapshots against one whole-sequence call."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engram_model.v41 import V41Config, V41Hasher, V41HashState
from engram_store import InvalidArgument, InvalidType

DEAD = -1


def first_appearance_map(rng: np.random.Generator, vocab: int, distinct: int) -> np.ndarray:
    """A random token map with exactly ``distinct`` compressed ids, numbered in order of first appearance."""
    keys = np.concatenate([np.arange(distinct), rng.integers(0, distinct, vocab - distinct)])
    rng.shuffle(keys)
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    rank = np.empty(first.size, dtype=np.int64)
    rank[np.argsort(first)] = np.arange(first.size)
    return rank[inverse.ravel()]


def transcribed(cfg: V41Config, token_map, ids, mask=None, positions=None) -> np.ndarray:
    """The hash of V41_ENGRAM.md position by position, in Python ints."""
    pad = int(token_map[cfg.pad_id])
    B, L = ids.shape
    out = np.zeros((B, L, len(cfg.layer_ids), cfg.cols), dtype=np.int64)
    for b in range(B):
        def c(q):
            return DEAD if mask is not None and not mask[b, q] else int(token_map[ids[b, q]])
        for p in range(L):
            blocked, tok = False, []
            for s in range(cfg.max_ngram_size):
                blocked = blocked or p - s < 0 or c(p - s) == DEAD or (positions is not None and positions[b, p] < s)
                tok.append(pad if blocked else c(p - s))
            for li, lid in enumerate(cfg.layer_ids):
                m = [int(v) for v in cfg.multipliers(lid)]
                primes = [q for heads in cfg.primes(lid) for q in heads]
                offsets = cfg.offsets(lid)
                r = tok[0] * m[0]
                for n in range(2, cfg.max_ngram_size + 1):
                    r ^= tok[n - 1] * m[n - 1]
                    assert 0 <= r < 2 ** 63  # the bound on the multipliers rules out overflow
                    for h in range(cfg.n_heads):
                        col = (n - 2) * cfg.n_heads + h
                        out[b, p, li, col] = r % primes[col] + int(offsets[col])
    return out


@st.composite
def cases(draw):
    """A random config and token map, token ids, maybe a mask, maybe position ids with document starts."""
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    distinct = draw(st.integers(2, 300))
    vocab = distinct + draw(st.integers(0, 200))
    cfg = V41Config(layer_ids=draw(st.lists(st.integers(0, 40), min_size=1, max_size=3, unique=True)),
                    max_ngram_size=draw(st.integers(2, 5)), n_heads=draw(st.integers(1, 4)),
                    engram_vocab_size=draw(st.sampled_from([2, 97, 5000, 16_000_000])),
                    compressed_vocab_size=distinct, pad_id=draw(st.integers(0, vocab - 1)), hidden_size=8)
    token_map = first_appearance_map(rng, vocab, distinct)
    B, L = draw(st.integers(1, 3)), draw(st.integers(1, 24))
    ids = rng.integers(0, vocab, size=(B, L))
    mask = rng.random((B, L)) > draw(st.sampled_from([0.0, 0.2, 0.6])) if draw(st.booleans()) else None
    positions = None
    if draw(st.booleans()):  # documents packed back to back: positions restart at each start
        starts = rng.random((B, L)) < 0.2
        starts[:, 0] = True
        positions = np.zeros((B, L), dtype=np.int64)
        for b in range(B):
            for p in range(1, L):
                positions[b, p] = 0 if starts[b, p] else positions[b, p - 1] + 1
    return cfg, token_map, ids, mask, positions, rng


@settings(max_examples=40, deadline=None)
@given(cases())
def test_whole_sequence_hash_matches_the_transcription(case):
    cfg, token_map, ids, mask, positions, _ = case
    hasher = V41Hasher(cfg, token_map)
    expected = transcribed(cfg, token_map, ids, mask, positions)
    got = hasher(ids, token_mask=mask, position_ids=positions)
    assert got.shape == expected.shape and got.dtype == np.int64
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(hasher.hash_numpy(ids, mask, positions), expected)
    # Every id lands inside its column's range of the layer's table.
    for li, lid in enumerate(cfg.layer_ids):
        offsets, primes = cfg.offsets(lid), np.array([q for hs in cfg.primes(lid) for q in hs])
        assert ((got[:, :, li] >= offsets) & (got[:, :, li] < offsets + primes)).all()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.data())
def test_chunked_steps_equal_one_whole_sequence_call(case, data):
    cfg, token_map, ids, mask, positions, rng = case
    hasher = V41Hasher(cfg, token_map)
    whole = hasher(ids, token_mask=mask, position_ids=positions)
    B, L = ids.shape
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(L - 1, 1)), max_size=4))) | {0, L})
    state = hasher.begin(B)
    pieces = []
    for lo, hi in zip(cuts, cuts[1:]):
        if lo >= hi:
            continue
        # A speculative detour first: its tokens are rejected and the snapshot taken before them restored.
        snapshot = state.copy()
        hasher.step(state, rng.integers(0, token_map.size, size=(B, data.draw(st.integers(1, 3)))))
        state = snapshot
        pieces.append(hasher.step(state, ids[:, lo:hi], None if mask is None else mask[:, lo:hi],
                                  None if positions is None else positions[:, lo:hi]))
    np.testing.assert_array_equal(np.concatenate(pieces, axis=1), whole)


def test_released_layout_and_a_short_sequence():
    cfg = V41Config(layer_ids=[1, 14])
    rng = np.random.default_rng(3)
    token_map = first_appearance_map(rng, 129280, cfg.compressed_vocab_size)
    hasher = V41Hasher(cfg, token_map)
    ids = rng.integers(0, 129280, size=(2, 9))
    mask = np.ones((2, 9), dtype=bool)
    mask[1, 4] = False  # an image position: n-grams reaching it are blocked for the next max_ngram - 1 tokens
    got = hasher(ids, token_mask=mask)
    assert got.shape == (2, 9, 2, 24)
    np.testing.assert_array_equal(got, transcribed(cfg, token_map, ids, mask))
    # Row 1 after the masked token: orders reaching back past it hash the pad, as a sequence start does.
    start = hasher(ids[1:, 5:])
    np.testing.assert_array_equal(got[1, 5:], start[0])


def test_state_reset_copy_and_decode_batch():
    cfg = V41Config(layer_ids=[1, 2], n_heads=2, engram_vocab_size=1000, compressed_vocab_size=50, hidden_size=8)
    token_map = first_appearance_map(np.random.default_rng(0), 80, 50)
    hasher = V41Hasher(cfg, token_map)
    ids = np.random.default_rng(1).integers(0, 80, size=(3, 7))
    state = hasher.begin(3)
    hasher.step(state, ids[:, :4])
    assert isinstance(state, V41HashState) and state.batch_size == 3 and state.history.shape == (3, 3)
    state.reset([1])  # row 1 starts a new sequence with token 4
    got = hasher.step(state, ids[:, 4:])
    np.testing.assert_array_equal(got[[0, 2]], hasher(ids[[0, 2]])[:, 4:])
    np.testing.assert_array_equal(got[1], hasher(ids[1:2, 4:])[0])
    state.reset()
    np.testing.assert_array_equal(state.history, DEAD)


def test_bad_arguments_are_named():
    cfg = V41Config(layer_ids=[1], n_heads=2, engram_vocab_size=1000, compressed_vocab_size=50, hidden_size=8)
    token_map = first_appearance_map(np.random.default_rng(0), 80, 50)
    hasher = V41Hasher(cfg, token_map)
    with pytest.raises(InvalidArgument, match=r"token id 80 at \[0, 2\] is outside the token map \[0, 80\)"):
        hasher(np.array([[1, 2, 80]]))
    with pytest.raises(InvalidArgument, match=r"token id -1 at \[1, 0\]"):
        hasher(np.array([[1], [-1]]))
    with pytest.raises(InvalidArgument, match=r"input_ids: expected token ids of shape \[B, L\]"):
        hasher(np.array([1, 2]))
    with pytest.raises(InvalidType, match="input_ids: expected integer token ids"):
        hasher(np.array([[1.0]]))
    with pytest.raises(InvalidType, match="token_mask: expected a bool array"):
        hasher(np.array([[1, 2]]), token_mask=np.array([[1, 0]]))
    with pytest.raises(InvalidArgument, match=r"position_ids: expected shape \(1, 2\)"):
        hasher(np.array([[1, 2]]), position_ids=np.array([[0, 1, 2]]))
    state = hasher.begin(2)
    with pytest.raises(InvalidArgument, match="state: holds 2 sequences"):
        hasher.step(state, np.array([[1]]))
    with pytest.raises(InvalidType, match="state: expected the V41HashState"):
        hasher.step(None, np.array([[1]]))
    with pytest.raises(InvalidArgument, match="batch_size"):
        hasher.begin(0)
    with pytest.raises(InvalidArgument, match="rows: expected batch rows"):
        state.reset([2])
    before = state.history.copy()
    with pytest.raises(InvalidArgument, match="outside the token map"):
        hasher.step(state, np.array([[1], [99]]))
    np.testing.assert_array_equal(state.history, before)  # a refused step leaves the state as it was
    with pytest.raises(InvalidArgument, match="token_map: has 50 compressed ids, expected config.compressed_vocab"):
        V41Hasher(V41Config(layer_ids=[1], compressed_vocab_size=51, hidden_size=8), token_map)
    with pytest.raises(InvalidArgument, match="config.pad_id: 90"):
        V41Hasher(V41Config(layer_ids=[1], compressed_vocab_size=50, pad_id=90, hidden_size=8), token_map)
    with pytest.raises(InvalidType, match="config: expected a V41Config"):
        V41Hasher({"layer_ids": [1]}, token_map)
