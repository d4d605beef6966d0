"""V41Hasher.step_ragged / commit: continuous batching. The kernel against its NumPy twin on random calls, and
random engine schedules (arrivals, chunked prefills, decode steps, drafts partly accepted, finished requests whose
slots are reused, masks, document starts, requests without tokens) against one whole-sequence call per request."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engram_model.v41 import V41Config, V41Hasher, V41HashState
from engram_model._ngram_kernels import MARK_SLOTS
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


@st.composite
def hashers(draw):
    """A random config (toy primes, where the modulo takes its general loop, and large ones) and token map."""
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    distinct = draw(st.integers(2, 200))
    vocab = distinct + draw(st.integers(0, 100))
    cfg = V41Config(layer_ids=draw(st.lists(st.integers(0, 40), min_size=1, max_size=2, unique=True)),
                    max_ngram_size=draw(st.integers(2, 5)), n_heads=draw(st.sampled_from([1, 3, 8])),
                    engram_vocab_size=draw(st.sampled_from([2, 97, 16_000_000])), compressed_vocab_size=distinct,
                    pad_id=draw(st.integers(0, vocab - 1)), hidden_size=8)
    return V41Hasher(cfg, first_appearance_map(rng, vocab, distinct)), rng


def whole(hasher: V41Hasher, ids: list[int], mask: list[bool], docs: list[bool]) -> np.ndarray:
    """Rows of one whole-sequence call: position ids restart at every document start."""
    if not ids:
        return np.empty((0, len(hasher.config.layer_ids), hasher.config.cols), dtype=np.int64)
    positions = np.zeros(len(ids), dtype=np.int64)
    for p in range(1, len(ids)):
        positions[p] = 0 if docs[p] else positions[p - 1] + 1
    return hasher(np.array([ids]), token_mask=np.array([mask]), position_ids=positions[None])[0]


def ragged_call(hasher, state, parts, use_mask, use_docs, commit):
    """step_ragged(commit=commit), or commit() where ``commit == "commit"``, over ``parts``, a list of (slot, ids,
    mask, docs) per request; checks the kernel against the NumPy twin on a copy of the state."""
    tokens = np.array([t for _, ids, _, _ in parts for t in ids], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum([len(ids) for _, ids, _, _ in parts])]).astype(np.int64)
    slots = np.array([s for s, _, _, _ in parts], dtype=np.int64)
    mask = np.array([m for _, _, ms, _ in parts for m in ms], dtype=bool) if use_mask else None
    docs = np.array([d for _, _, _, ds in parts for d in ds], dtype=bool) if use_docs else None
    twin = state.copy()
    if commit == "commit":
        assert hasher.commit(state, tokens, slots, starts, token_mask=mask, doc_start=docs) is None
        hasher.step_ragged_numpy(twin, tokens, slots, starts, token_mask=mask, doc_start=docs, commit=True)
        np.testing.assert_array_equal(state.history, twin.history)
        return None
    got = hasher.step_ragged(state, tokens, slots, starts, token_mask=mask, doc_start=docs, commit=commit)
    expected = hasher.step_ragged_numpy(twin, tokens, slots, starts, token_mask=mask, doc_start=docs, commit=commit)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(state.history, twin.history)
    return [got[lo:hi] for lo, hi in zip(starts[:-1], starts[1:])]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hashers(), st.data())
def test_kernel_matches_the_numpy_twin(case, data):
    hasher, rng = case
    S = data.draw(st.integers(1, 6))
    state = hasher.begin(S)
    # Any history: compressed ids and DEAD slots (masked tokens, starts) anywhere in it.
    state.history[:] = rng.integers(-1, hasher.config.compressed_vocab_size, size=state.history.shape)
    R = data.draw(st.integers(0, S))
    slots = rng.permutation(S)[:R]
    lengths = [data.draw(st.sampled_from([0, 1, 2, 3, 7, 70])) for _ in range(R)]
    T = sum(lengths)
    parts, at = [], 0
    for slot, n in zip(slots, lengths):
        parts.append((int(slot), rng.integers(0, hasher.token_map.size, n).tolist(),
                      (rng.random(n) > 0.2).tolist(), (rng.random(n) < 0.15).tolist()))
        at += n
    assert at == T
    mode = data.draw(st.sampled_from([True, False, "commit"]))
    before = state.history.copy()
    rows = ragged_call(hasher, state, parts, data.draw(st.booleans()), data.draw(st.booleans()), mode)
    if mode is False:
        np.testing.assert_array_equal(state.history, before)  # a draft leaves the state as it was
    untouched = np.setdiff1d(np.arange(S), [s for s, ids, _, _ in parts if ids])
    np.testing.assert_array_equal(state.history[untouched], before[untouched])  # slots without tokens stay
    if rows is not None:
        for li, lid in enumerate(hasher.config.layer_ids):  # every id lands in its column's range of the table
            offsets = hasher.offsets[li]
            for r in rows:
                assert ((r[:, li] >= offsets) & (r[:, li] < offsets + hasher.primes[li])).all()


def flags(rng, n, use_mask, use_docs):
    """A token mask (all True unless used) and document starts (none unless used) of n tokens."""
    return (rng.random(n) > 0.15 if use_mask else np.ones(n, bool)).tolist(), \
        (rng.random(n) < 0.1 if use_docs else np.zeros(n, bool)).tolist()


class Request:
    """A request's whole token sequence (ids, mask, document starts) and how far the engine has got in it."""

    def __init__(self, rng, vocab, use_mask, use_docs):
        n = int(rng.integers(1, 40))
        self.ids = rng.integers(0, vocab, n).tolist()
        self.mask, self.docs = flags(rng, n, use_mask, use_docs)
        self.done = 0            # tokens accepted so far
        self.rows: list = []     # their rows, in order
        self.slot = -1

    def left(self) -> int:
        return len(self.ids) - self.done


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hashers(), st.data())
def test_random_schedules_equal_one_whole_sequence_call_per_request(case, data):
    hasher, rng = case
    vocab = hasher.token_map.size
    S = data.draw(st.integers(1, 5))
    use_mask, use_docs = data.draw(st.booleans()), data.draw(st.booleans())
    state = hasher.begin(S)
    free, running, finished = list(range(S)), [], []
    arrivals = data.draw(st.integers(1, 9))
    for _ in range(data.draw(st.integers(1, 14))):
        while free and arrivals and data.draw(st.booleans()):  # arrivals take free slots, maybe reused ones
            req = Request(rng, vocab, use_mask, use_docs)
            req.slot = free.pop(int(rng.integers(0, len(free))))
            state.reset([req.slot])
            running.append(req)
            arrivals -= 1
        if not running:
            continue
        order = rng.permutation(len(running))
        batch = [running[i] for i in order[:data.draw(st.integers(1, len(running)))]]
        if data.draw(st.booleans()):
            # A plain step: each request brings a chunk of its prompt (any size), one decoded token, or nothing.
            sizes = [min(r.left(), data.draw(st.sampled_from([0, 1, 1, 2, 5, 40]))) for r in batch]
            parts = [(r.slot, r.ids[r.done:r.done + n], r.mask[r.done:r.done + n], r.docs[r.done:r.done + n])
                     for r, n in zip(batch, sizes)]
            for r, n, rows in zip(batch, sizes, ragged_call(hasher, state, parts, use_mask, use_docs, True)):
                r.rows.append(rows)
                r.done += n
        else:
            # A speculative step: the accepted tokens then rejected drafts (random), hashed without moving the
            # state; then a commit of the accepted prefixes (none for a fully rejected draft).
            accepted = [min(r.left(), data.draw(st.integers(0, 4))) for r in batch]
            drafts = [data.draw(st.integers(0, 3)) for _ in batch]
            parts = []
            for r, a, d in zip(batch, accepted, drafts):
                lo = r.done
                mask, docs = flags(rng, d, use_mask, use_docs)
                parts.append((r.slot, r.ids[lo:lo + a] + rng.integers(0, vocab, d).tolist(), r.mask[lo:lo + a] + mask,
                              r.docs[lo:lo + a] + docs))
            before = state.history.copy()
            rows = ragged_call(hasher, state, parts, use_mask, use_docs, False)
            np.testing.assert_array_equal(state.history, before)
            for r, (_, ids, mask, docs), got in zip(batch, parts, rows):
                # The rejected drafts hashed as if they had followed the accepted tokens.
                seq = slice(0, r.done)
                expect = whole(hasher, r.ids[seq] + ids, r.mask[seq] + mask, r.docs[seq] + docs)[r.done:]
                np.testing.assert_array_equal(got, expect)
            commit = [(slot, ids[:a], mask[:a], docs[:a]) for (slot, ids, mask, docs), a in zip(parts, accepted)]
            ragged_call(hasher, state, commit, use_mask, use_docs, "commit")
            for r, a, got in zip(batch, accepted, rows):
                r.rows.append(got[:a])
                r.done += a
        for r in [r for r in running if r.left() == 0 and data.draw(st.booleans())]:
            running.remove(r)  # finished: its slot goes back to the pool
            free.append(r.slot)
            finished.append(r)
    for r in finished + running:
        n = r.done
        expect = whole(hasher, r.ids[:n], r.mask[:n], r.docs[:n])
        np.testing.assert_array_equal(np.concatenate(r.rows) if r.rows else expect[:0], expect)


def released_hasher() -> V41Hasher:
    cfg = V41Config(layer_ids=[1, 14])
    return V41Hasher(cfg, first_appearance_map(np.random.default_rng(3), 129280, cfg.compressed_vocab_size))


def test_released_config_decode_with_drafts_and_int32_inputs():
    hasher = released_hasher()
    rng = np.random.default_rng(4)
    R, L = 70, 9  # more tokens than one block of the kernel, requests spanning two blocks
    prompts = rng.integers(0, 129280, size=(R, L))
    state = hasher.begin(R + 5)
    slots = (np.arange(R) * 7 % (R + 5)).astype(np.int32)
    starts = (np.arange(R + 1) * (L - 3)).astype(np.int32)
    got = hasher.step_ragged(state, prompts[:, :L - 3].ravel().astype(np.int32), slots, starts)
    assert got.shape == (R * (L - 3), 2, 24) and got.dtype == np.int64
    draft = hasher.step_ragged(state, prompts[:, L - 3:].ravel(), slots, np.arange(R + 1) * 3, commit=False)
    hasher.commit(state, prompts[:, L - 3:].ravel(), slots, np.arange(R + 1) * 3)
    expect = hasher(prompts)
    np.testing.assert_array_equal(got.reshape(R, L - 3, 2, 24), expect[:, :L - 3])
    np.testing.assert_array_equal(draft.reshape(R, 3, 2, 24), expect[:, L - 3:])
    # The state moved by the committed tokens: a plain step after them continues every sequence.
    nxt = rng.integers(0, 129280, size=(R, 1))
    more = hasher.step_ragged(state, nxt.ravel(), slots, np.arange(R + 1))
    np.testing.assert_array_equal(more, hasher(np.concatenate([prompts, nxt], axis=1))[:, L])


def test_reset_reused_slot_and_empty_calls():
    hasher = released_hasher()
    state = hasher.begin(2)
    ids = np.array([5, 6, 7, 8])
    hasher.step_ragged(state, ids, [1], [0, 4])
    state.reset([1])  # a new request in slot 1: nothing of the old one is looked back at
    got = hasher.step_ragged(state, ids[:2], [1], [0, 2])
    np.testing.assert_array_equal(got, hasher(ids[None, :2])[0])
    before = state.history.copy()
    empty = hasher.step_ragged(state, np.zeros(0, np.int64), [0, 1], [0, 0, 0])
    assert empty.shape == (0, 2, 24)
    assert hasher.step_ragged(state, [], [], [0]).shape == (0, 2, 24)
    hasher.commit(state, [], [1], [0, 0])
    np.testing.assert_array_equal(state.history, before)


def test_a_slot_named_twice_is_found_in_large_states_too():
    hasher = released_hasher()
    big = hasher.begin(MARK_SLOTS + 3)  # past the byte-per-slot marks: the slots are sorted
    with pytest.raises(InvalidArgument, match=r"slots: expected a distinct slot per request, got slot 65537 for "
                                              r"requests 0 and 2"):
        hasher.step_ragged(big, [1, 2, 3], [65537, 4, 65537], [0, 1, 2, 3])
    got = hasher.step_ragged(big, [1, 2, 3], [65537, 4, 65538], [0, 1, 2, 3])
    np.testing.assert_array_equal(got, hasher(np.array([[1], [2], [3]]))[:, 0])


def test_a_slot_named_twice_is_found_wherever_it_sorts_in_large_states():
    hasher = released_hasher()
    big = hasher.begin(MARK_SLOTS + 3)
    for slots in ([7, 7], [9, 65538, 9], [65538, 3, 65538, 4]):  # the repeat sorts first, in the middle, last
        before = big.history.copy()
        with pytest.raises(InvalidArgument, match=f"got slot {slots[-2] if slots[-1] == 4 else slots[-1]} for "):
            hasher.step_ragged(big, list(range(len(slots))), slots, list(range(len(slots) + 1)))
        np.testing.assert_array_equal(big.history, before)


def test_a_config_whose_primes_straddle_the_small_modulo_bound_hashes_as_numpy_does():
    """Each column's modulo takes the general loop if any prime of the config is small (<= 4096), one correction
    otherwise: a config whose primes run from tiny ones (one correction is far from enough) to ones above that
    bound must take the loop everywhere."""
    cfg = V41Config(layer_ids=list(range(20)), max_ngram_size=5, n_heads=8, engram_vocab_size=2,
                    compressed_vocab_size=300, pad_id=0, hidden_size=8)
    primes = [p for layer in cfg.layer_ids for heads in cfg.primes(layer) for p in heads]
    assert primes[0] == 2 and primes[-1] > 4096
    rng = np.random.default_rng(5)
    hasher = V41Hasher(cfg, first_appearance_map(rng, 400, 300))
    state = hasher.begin(4)
    tokens = rng.integers(0, 400, 60)
    parts = [(s, tokens[15 * s:15 * (s + 1)].tolist(), [True] * 15, [False] * 15) for s in range(4)]
    ragged_call(hasher, state, parts, False, False, True)


def test_bad_arguments_are_named_and_leave_the_state():
    hasher = released_hasher()
    state = hasher.begin(3)
    hasher.step_ragged(state, [1, 2, 3], [0, 2], [0, 2, 3])
    before = state.history.copy()
    cases = [
        (InvalidArgument, r"slots: expected slots of the state in \[0, 3\), got 3 for request 1",
         dict(tokens=[1, 2], slots=[0, 3], query_start_loc=[0, 1, 2])),
        (InvalidArgument, r"slots: expected slots of the state in \[0, 3\), got -1 for request 0",
         dict(tokens=[1], slots=[-1], query_start_loc=[0, 1])),
        (InvalidArgument, r"slots: expected a distinct slot per request, got slot 2 for requests 0 and 1",
         dict(tokens=[1, 2], slots=[2, 2], query_start_loc=[0, 1, 2])),
        (InvalidArgument, r"query_start_loc: expected non-decreasing offsets, got 2 then 1 at \[1, 2\]",
         dict(tokens=[1, 2], slots=[0, 1, 2], query_start_loc=[0, 2, 1, 2])),
        (InvalidArgument, r"query_start_loc: expected offsets from 0 to T = 2 \(the number of tokens\), got 1 to 2",
         dict(tokens=[1, 2], slots=[0], query_start_loc=[1, 2])),
        (InvalidArgument, r"query_start_loc: expected offsets from 0 to T = 2 \(the number of tokens\), got 0 to 1",
         dict(tokens=[1, 2], slots=[0], query_start_loc=[0, 1])),
        (InvalidArgument, r"query_start_loc: expected R \+ 1 = 2 offsets \(slots has R = 1\), got 3",
         dict(tokens=[1, 2], slots=[0], query_start_loc=[0, 1, 2])),
        (InvalidArgument, r"tokens: token id 129280 at \[2\] \(request 1\) is outside the token map \[0, 129280\)",
         dict(tokens=[1, 2, 129280], slots=[0, 1], query_start_loc=[0, 2, 3])),
        (InvalidArgument, r"tokens: token id -4 at \[0\] \(request 0\)",
         dict(tokens=[-4], slots=[1], query_start_loc=[0, 1])),
        (InvalidArgument, r"tokens: expected shape \[T\], got shape \(1, 2\)",
         dict(tokens=[[1, 2]], slots=[0], query_start_loc=[0, 2])),
        (InvalidArgument, r"slots: expected shape \[R\], got shape \(1, 1\)",
         dict(tokens=[1], slots=[[0]], query_start_loc=[0, 1])),
        (InvalidType, "tokens: expected integer token ids, got dtype float64",
         dict(tokens=[1.0], slots=[0], query_start_loc=[0, 1])),
        (InvalidType, "query_start_loc: expected integer token ids, got dtype float64",
         dict(tokens=[1], slots=[0], query_start_loc=[0.0, 1.0])),
        (InvalidType, r"token_mask: expected a bool array \(False: not a text token\), got dtype int64",
         dict(tokens=[1], slots=[0], query_start_loc=[0, 1], token_mask=[1])),
        (InvalidType, r"doc_start: expected a bool array \(True: a document starts\), got dtype int64",
         dict(tokens=[1], slots=[0], query_start_loc=[0, 1], doc_start=[0])),
        (InvalidArgument, r"doc_start: expected shape \(2,\) \(that of the token ids\), got \(1,\)",
         dict(tokens=[1, 2], slots=[0], query_start_loc=[0, 2], doc_start=[True])),
    ]
    for error, message, kwargs in cases:
        for call in (hasher.step_ragged, hasher.commit):
            with pytest.raises(error, match=message):
                call(state, **kwargs)
            np.testing.assert_array_equal(state.history, before)
    with pytest.raises(InvalidType, match="state: expected the V41HashState of begin"):
        hasher.step_ragged(state.history, [1], [0], [0, 1])
    other = V41HashState(np.full((2, 2), DEAD, dtype=np.int64))
    with pytest.raises(InvalidArgument, match="state: has context 2, this hasher's is 3"):
        hasher.commit(other, [1], [0], [0, 1])
