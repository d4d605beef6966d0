"""PLEHasher.step_ragged / commit: continuous batching. The kernel against its NumPy twin on random calls, and
random engine schedules (arrivals, chunked prefills, decode steps, drafts partly accepted, finished requests whose
slots are reused, EOS anywhere, requests without tokens) against one whole-sequence call per request."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engram_model.ple import PLEConfig, PLEHasher, PLEHashState
from engram_model._ngram_kernels import MARK_SLOTS
from engram_store import InvalidArgument, InvalidType


@st.composite
def hashers(draw):
    ngram_size, hpn = draw(st.integers(2, 5)), draw(st.sampled_from([1, 3, 8]))
    vocab = draw(st.integers(2, 200))
    return PLEHasher(PLEConfig(ple_layer_ids=draw(st.lists(st.integers(1, 9), min_size=1, max_size=2, unique=True)),
                               ngram_size=ngram_size, heads_per_ngram=hpn, hidden_size=(ngram_size - 1) * hpn,
                               ngram_vocab_size_base=draw(st.sampled_from([2, 97, 20_000_000])), vocab_size=vocab,
                               eos_token_id=draw(st.integers(0, vocab - 1))))


def tokens_of(rng, hasher: PLEHasher, n: int) -> list[int]:
    ids = rng.integers(0, hasher.config.vocab_size, n)
    ids[rng.random(n) < 0.15] = hasher.eos
    return ids.tolist()


def ragged_call(hasher, state, parts, commit):
    """step_ragged(commit=commit), or commit() where ``commit == "commit"``, over ``parts``, a list of (slot, ids)
    per request; checks the kernel against the NumPy twin on a copy of the state."""
    tokens = np.array([t for _, ids in parts for t in ids], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum([len(ids) for _, ids in parts])]).astype(np.int64)
    slots = np.array([s for s, _ in parts], dtype=np.int64)
    twin = state.copy()
    if commit == "commit":
        assert hasher.commit(state, tokens, slots, starts) is None
        hasher.step_ragged_numpy(twin, tokens, slots, starts, commit=True)
        np.testing.assert_array_equal(state.history, twin.history)
        return None
    got = hasher.step_ragged(state, tokens, slots, starts, commit=commit)
    np.testing.assert_array_equal(got, hasher.step_ragged_numpy(twin, tokens, slots, starts, commit=commit))
    np.testing.assert_array_equal(state.history, twin.history)
    return [got[lo:hi] for lo, hi in zip(starts[:-1], starts[1:])]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hashers(), st.data())
def test_kernel_matches_the_numpy_twin(hasher, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    S = data.draw(st.integers(1, 6))
    state = hasher.begin(S)
    state.history[:] = rng.integers(0, hasher.config.vocab_size, size=state.history.shape)  # any context, EOS too
    state.history[rng.random(state.history.shape) < 0.3] = hasher.eos
    R = data.draw(st.integers(0, S))
    parts = [(int(slot), tokens_of(rng, hasher, data.draw(st.sampled_from([0, 1, 2, 3, 7, 70]))))
             for slot in rng.permutation(S)[:R]]
    mode = data.draw(st.sampled_from([True, False, "commit"]))
    before = state.history.copy()
    rows = ragged_call(hasher, state, parts, mode)
    if mode is False:
        np.testing.assert_array_equal(state.history, before)  # a draft leaves the state as it was
    untouched = np.setdiff1d(np.arange(S), [s for s, ids in parts if ids])
    np.testing.assert_array_equal(state.history[untouched], before[untouched])  # slots without tokens stay
    for (slot, ids), got in zip(parts, rows or []):  # each request continues its slot's context
        np.testing.assert_array_equal(got, hasher(np.array([ids], dtype=np.int64).reshape(1, -1),
                                                  before[slot:slot + 1])[0])


class Request:
    """A request's whole token sequence and how far the engine has got in it."""

    def __init__(self, rng, hasher):
        self.ids = tokens_of(rng, hasher, int(rng.integers(1, 40)))
        self.done = 0            # tokens accepted so far
        self.rows: list = []     # their rows, in order
        self.slot = -1

    def left(self) -> int:
        return len(self.ids) - self.done


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hashers(), st.data())
def test_random_schedules_equal_one_whole_sequence_call_per_request(hasher, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    S = data.draw(st.integers(1, 5))
    state = hasher.begin(S)
    state.history[:] = rng.integers(0, hasher.config.vocab_size, size=state.history.shape)  # stale slots
    free, running, finished = list(range(S)), [], []
    arrivals = data.draw(st.integers(1, 9))
    for _ in range(data.draw(st.integers(1, 14))):
        while free and arrivals and data.draw(st.booleans()):  # arrivals take free slots, maybe reused ones
            req = Request(rng, hasher)
            req.slot = free.pop(int(rng.integers(0, len(free))))
            state.reset([req.slot])
            running.append(req)
            arrivals -= 1
        if not running:
            continue
        batch = [running[i] for i in rng.permutation(len(running))[:data.draw(st.integers(1, len(running)))]]
        if data.draw(st.booleans()):
            # A plain step: each request brings a chunk of its prompt (any size), one decoded token, or nothing.
            sizes = [min(r.left(), data.draw(st.sampled_from([0, 1, 1, 2, 5, 40]))) for r in batch]
            parts = [(r.slot, r.ids[r.done:r.done + n]) for r, n in zip(batch, sizes)]
            for r, n, rows in zip(batch, sizes, ragged_call(hasher, state, parts, True)):
                r.rows.append(rows)
                r.done += n
        else:
            # A speculative step: the accepted tokens then rejected drafts, hashed without moving the state; then a
            # commit of the accepted prefixes (none for a fully rejected draft).
            accepted = [min(r.left(), data.draw(st.integers(0, 4))) for r in batch]
            parts = [(r.slot, r.ids[r.done:r.done + a] + tokens_of(rng, hasher, data.draw(st.integers(0, 3))))
                     for r, a in zip(batch, accepted)]
            before = state.history.copy()
            rows = ragged_call(hasher, state, parts, False)
            np.testing.assert_array_equal(state.history, before)
            for r, (_, ids), got in zip(batch, parts, rows):  # drafts hashed as if they followed the accepted
                seq = np.array([r.ids[:r.done] + ids], dtype=np.int64)
                np.testing.assert_array_equal(got, hasher(seq)[0, r.done:])
            ragged_call(hasher, state, [(slot, ids[:a]) for (slot, ids), a in zip(parts, accepted)], "commit")
            for r, a, got in zip(batch, accepted, rows):
                r.rows.append(got[:a])
                r.done += a
        for r in [r for r in running if r.left() == 0 and data.draw(st.booleans())]:
            running.remove(r)  # finished: its slot goes back to the pool
            free.append(r.slot)
            finished.append(r)
    for r in finished + running:
        expect = hasher(np.array([r.ids[:r.done]], dtype=np.int64).reshape(1, -1))[0]
        np.testing.assert_array_equal(np.concatenate(r.rows) if r.rows else expect[:0], expect)


def test_released_config_decode_with_drafts_and_int32_inputs():
    hasher = PLEHasher(PLEConfig(ple_layer_ids=[2]))
    rng = np.random.default_rng(4)
    R, L = 70, 9  # more tokens than one block of the kernel, requests spanning two blocks
    prompts = rng.integers(0, 248320, size=(R, L))
    prompts[rng.random(prompts.shape) < 0.1] = 248044
    state = hasher.begin(R + 5)
    slots = (np.arange(R) * 7 % (R + 5)).astype(np.int32)
    starts = (np.arange(R + 1) * (L - 3)).astype(np.int32)
    got = hasher.step_ragged(state, prompts[:, :L - 3].ravel().astype(np.int32), slots, starts)
    assert got.shape == (R * (L - 3), 1, 16) and got.dtype == np.int64
    draft = hasher.step_ragged(state, prompts[:, L - 3:].ravel(), slots, np.arange(R + 1) * 3, commit=False)
    hasher.commit(state, prompts[:, L - 3:].ravel(), slots, np.arange(R + 1) * 3)
    expect = hasher(prompts)
    np.testing.assert_array_equal(got.reshape(R, L - 3, 1, 16), expect[:, :L - 3])
    np.testing.assert_array_equal(draft.reshape(R, 3, 1, 16), expect[:, L - 3:])
    nxt = rng.integers(0, 248320, size=(R, 1))
    more = hasher.step_ragged(state, nxt.ravel(), slots, np.arange(R + 1))
    np.testing.assert_array_equal(more, hasher(np.concatenate([prompts, nxt], axis=1))[:, L])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hashers(), st.data())
def test_a_step_after_each_requests_own_context_as_vllm_passes_it(hasher, data):
    """hash_ragged: vLLM's stateless step (``ngram_context [R, ngram_size - 1]``, EOS where a request has none,
    int32 as vLLM keeps it) equals one whole-sequence call per request after the same context, and the kernel's
    twin; nothing else is kept."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    R, C = data.draw(st.integers(1, 5)), hasher.context
    context = rng.integers(0, hasher.config.vocab_size, (R, C)).astype(np.int32)
    context[rng.random(context.shape) < 0.3] = hasher.eos
    parts = [tokens_of(rng, hasher, data.draw(st.sampled_from([0, 1, 2, 5]))) for _ in range(R)]
    tokens = np.array([t for ids in parts for t in ids], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum([len(ids) for ids in parts])]).astype(np.int32)
    got = hasher.hash_ragged(tokens, starts, context)
    twin = hasher.step_ragged_numpy(PLEHashState(context.astype(np.int64), hasher.eos), tokens, np.arange(R),
                                    starts.astype(np.int64), commit=False)
    np.testing.assert_array_equal(got, twin)
    for r, ids in enumerate(parts):
        if ids:
            whole = hasher(np.array([ids], dtype=np.int64), context=context[r:r + 1])[0]
            np.testing.assert_array_equal(got[starts[r]:starts[r + 1]], whole)
    with pytest.raises(InvalidArgument, match=r"context: expected shape \[B, ngram_size - 1\] = "
                                              rf"\[{R}, {C}\]"):
        hasher.hash_ragged(tokens, starts, context[:, :C - 1])


def test_reset_reused_slot_and_empty_calls():
    hasher = PLEHasher(PLEConfig(ple_layer_ids=[2]))
    state = hasher.begin(2)
    ids = np.array([5, 6, 7, 8])
    hasher.step_ragged(state, ids, [1], [0, 4])
    state.reset([1])  # a new request in slot 1 starts from EOS
    assert (state.history[1] == 248044).all()
    np.testing.assert_array_equal(hasher.step_ragged(state, ids[:2], [1], [0, 2]), hasher(ids[None, :2])[0])
    before = state.history.copy()
    assert hasher.step_ragged(state, np.zeros(0, np.int64), [0, 1], [0, 0, 0]).shape == (0, 1, 16)
    assert hasher.step_ragged(state, [], [], [0]).shape == (0, 1, 16)
    hasher.commit(state, [], [1], [0, 0])
    np.testing.assert_array_equal(state.history, before)
    with pytest.raises(InvalidArgument, match=r"rows: expected batch rows in \[0, 2\)"):
        state.reset([2])


def test_a_slot_named_twice_is_found_in_large_states_too():
    hasher = PLEHasher(PLEConfig(ple_layer_ids=[2]))
    big = hasher.begin(MARK_SLOTS + 3)  # past the byte-per-slot marks: the slots are sorted
    before = big.history.copy()
    with pytest.raises(InvalidArgument, match=r"slots: expected a distinct slot per request, got slot 65537 for "
                                              r"requests 0 and 2"):
        hasher.step_ragged(big, [1, 2, 3], [65537, 4, 65537], [0, 1, 2, 3])
    np.testing.assert_array_equal(big.history, before)
    got = hasher.step_ragged(big, [1, 2, 3], [65537, 4, 65538], [0, 1, 2, 3])
    np.testing.assert_array_equal(got, hasher(np.array([[1], [2], [3]]))[:, 0])


def test_bad_arguments_are_named_and_leave_the_state():
    hasher = PLEHasher(PLEConfig(ple_layer_ids=[2]))
    state = hasher.begin(3)
    hasher.step_ragged(state, [1, 2, 3], [0, 2], [0, 2, 3])
    before = state.history.copy()
    cases = [
        (InvalidArgument, r"slots: expected slots of the state in \[0, 3\), got 3 for request 1",
         dict(tokens=[1, 2], slots=[0, 3], query_start_loc=[0, 1, 2])),
        (InvalidArgument, r"slots: expected a distinct slot per request, got slot 2 for requests 0 and 1",
         dict(tokens=[1, 2], slots=[2, 2], query_start_loc=[0, 1, 2])),
        (InvalidArgument, r"query_start_loc: expected non-decreasing offsets, got 2 then 1 at \[1, 2\]",
         dict(tokens=[1, 2], slots=[0, 1, 2], query_start_loc=[0, 2, 1, 2])),
        (InvalidArgument, r"query_start_loc: expected offsets from 0 to T = 2 \(the number of tokens\), got 1 to 2",
         dict(tokens=[1, 2], slots=[0], query_start_loc=[1, 2])),
        (InvalidArgument, r"query_start_loc: expected R \+ 1 = 2 offsets \(slots has R = 1\), got 3",
         dict(tokens=[1, 2], slots=[0], query_start_loc=[0, 1, 2])),
        (InvalidArgument, r"tokens: token id 248320 at \[2\] \(request 1\) is outside the vocabulary \[0, 248320\)",
         dict(tokens=[1, 2, 248320], slots=[0, 1], query_start_loc=[0, 2, 3])),
        (InvalidArgument, r"tokens: expected shape \[T\], got shape \(1, 2\)",
         dict(tokens=[[1, 2]], slots=[0], query_start_loc=[0, 2])),
        (InvalidType, "tokens: expected integer token ids, got dtype float64",
         dict(tokens=[1.0], slots=[0], query_start_loc=[0, 1])),
    ]
    for error, message, kwargs in cases:
        for call in (hasher.step_ragged, hasher.commit):
            with pytest.raises(error, match=message):
                call(state, **kwargs)
            np.testing.assert_array_equal(state.history, before)
    with pytest.raises(InvalidType, match="state: expected the PLEHashState of begin"):
        hasher.step_ragged(state.history, [1], [0], [0, 1])
    with pytest.raises(InvalidArgument, match="state: expected a C-contiguous int64 history of context 2"):
        hasher.commit(PLEHashState(np.zeros((2, 3), np.int64), 248044), [1], [0], [0, 1])
