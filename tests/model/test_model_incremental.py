"""IncrementalHasher: any split of a token stream into steps, with rollbacks, hashes like the whole sequence."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_model import CompressedTokenizer, IncrementalHasher, NgramHashMapping
from engram_store import InvalidArgument

TEXTS = ["<pad>", "<s>", "a", " A", "b", "B ", "  ", "\t", "é", "e", "c", "C"]


def _mapping(max_n: int, tokenizer: bool) -> NgramHashMapping:
    return NgramHashMapping([101, 211, 307][:max_n - 1], max_n, 8, 2, [3, 7],
                            CompressedTokenizer(TEXTS) if tokenizer else None, pad_id=0, seed=1,
                            vocab_size=len(TEXTS))


# One operation: ("step", tokens for this step) or ("rollback", how many).
ops = st.lists(st.one_of(st.tuples(st.just("step"), st.lists(st.integers(0, len(TEXTS) - 1), min_size=1,
                                                             max_size=5)),
                         st.tuples(st.just("rollback"), st.integers(0, 4))), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(max_n=st.integers(2, 4), tokenizer=st.booleans(), streams=st.lists(ops, min_size=1, max_size=3),
       move_at=st.integers(0, 30), max_rollback=st.integers(0, 6))
def test_steps_with_rollbacks_equal_hashing_the_final_sequence(max_n, tokenizer, streams, move_at, max_rollback):
    # A rollback deeper than the kept history is refused and must leave the request as it was.
    mapping = _mapping(max_n, tokenizer)
    hasher = IncrementalHasher(mapping, max_rollback=max_rollback)
    sequences = [[] for _ in streams]
    emitted = [{lid: [] for lid in mapping.layer_ids} for _ in streams]
    for step in range(max(len(s) for s in streams)):
        if step == move_at:  # move every request to a fresh hasher, as prefill -> decode does
            other = IncrementalHasher(mapping, max_rollback=max_rollback)
            for r in range(len(streams)):
                if r in hasher:
                    other.import_state(r, hasher.export_state(r))
                    hasher.release(r)
            hasher = other
        for r, stream in enumerate(streams):
            if step >= len(stream):
                continue
            kind, arg = stream[step]
            if kind == "step":
                rows = hasher.hash_step([r], np.array([arg]))
                sequences[r] += arg
                for lid, value in rows.items():
                    assert value.shape == (1, len(arg), mapping.num_heads)
                    emitted[r][lid] += list(value[0])
            elif r in hasher:
                n = min(arg, len(sequences[r]))
                try:
                    hasher.rollback(r, n)
                except InvalidArgument as exc:
                    assert "max_rollback" in str(exc)
                    continue
                del sequences[r][len(sequences[r]) - n:]
                for lid in emitted[r]:
                    del emitted[r][lid][len(emitted[r][lid]) - n:]
    for r, sequence in enumerate(sequences):
        if not sequence:
            continue
        full = mapping.hash(np.array([sequence]))
        for lid in mapping.layer_ids:
            np.testing.assert_array_equal(np.array(emitted[r][lid]), full[lid][0])


def test_a_batch_of_requests_with_several_tokens_each():
    mapping = _mapping(3, tokenizer=True)
    hasher = IncrementalHasher(mapping)
    prompts = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    hasher.hash_step(["a", "b"], prompts)
    rows = hasher.hash_step(["b", "a"], np.array([[9, 10], [11, 2]]))
    full = mapping.hash(np.array([[1, 2, 3, 4, 11, 2], [5, 6, 7, 8, 9, 10]]))
    for lid in mapping.layer_ids:
        np.testing.assert_array_equal(rows[lid][1], full[lid][0, 4:])
        np.testing.assert_array_equal(rows[lid][0], full[lid][1, 4:])
    assert len(hasher) == 2
    hasher.release("a")
    assert "a" not in hasher and len(hasher) == 1


def test_bad_calls_raise_clear_errors():
    mapping = _mapping(3, tokenizer=False)
    hasher = IncrementalHasher(mapping, max_rollback=1)
    with pytest.raises(InvalidArgument, match="request_ids: expected 2"):
        hasher.hash_step(["a"], np.zeros((2, 1), dtype=np.int64))
    with pytest.raises(InvalidArgument, match="appears twice"):
        hasher.hash_step(["a", "a"], np.zeros((2, 1), dtype=np.int64))
    with pytest.raises(InvalidArgument, match="not a known request"):
        hasher.rollback("nobody", 1)
    hasher.hash_step(["a"], np.arange(6).reshape(1, 6))
    with pytest.raises(InvalidArgument, match="max_rollback"):
        hasher.rollback("a", 3)
    with pytest.raises(InvalidArgument, match="n_tokens: expected an integer"):
        hasher.rollback("a", -1)
    other = IncrementalHasher(_mapping(4, tokenizer=False))
    with pytest.raises(InvalidArgument, match="same Engram configuration"):
        other.import_state("a", hasher.export_state("a"))


@pytest.mark.timeout(120)
def test_decode_loop_reads_the_rows_of_the_whole_sequence():
    from engram_model import BackboneConfig, Engram, EngramConfig
    from engram_store import DistributedStore

    config = EngramConfig(engram_vocab_size=[1000, 1000], max_ngram_size=3, n_embed_per_ngram=16,
                          n_head_per_ngram=2, layer_ids=[1, 3])
    backbone = BackboneConfig(hidden_size=32, hc_mult=2, vocab_size=500, num_layers=4)
    rng = np.random.default_rng(0)
    with DistributedStore.embedded(segment_size="64MiB") as store:
        engrams = [Engram(lid, config, backbone, store) for lid in config.layer_ids]
        for e in engrams:
            e.populate_store_from_buffers(
                [rng.standard_normal((n, e.get_embedding_dim()), dtype=np.float32) for n in e.get_table_vocab_sizes()],
                [n * e.get_embedding_dim() * 4 for n in e.get_table_vocab_sizes()])
        hasher = IncrementalHasher(engrams[0].hash_mapping)
        prompt = rng.integers(0, 500, size=(3, 5))
        hasher.hash_step(range(3), prompt)
        tokens = prompt
        for _ in range(4):  # decode: one new token per request per step, hashed once for both layers
            new = rng.integers(0, 500, size=(3, 1))
            tokens = np.concatenate([tokens, new], axis=1)
            rows = hasher.hash_step(range(3), new)
            h = rng.standard_normal((3, 1, 2, 32), dtype=np.float32)
            for e in engrams:
                expected = e.query_embeddings(tokens)[:, -1:]
                np.testing.assert_array_equal(e.engram_store.lookup(rows[e.layer_id]), expected)
                np.testing.assert_array_equal(e.forward(h, row_ids=rows[e.layer_id]),
                                              e.forward(h, embeddings=expected))


# ---- the batched step: any interleaving of requests, hashers and operations -------------------------------

REQUESTS = ["r0", "r1", "r2", 3, (4, "x"), 5]
# ("step", hasher, requests, T, seed) | ("release", request) | ("rollback", request, n) | ("move", request)
interleaving = st.lists(st.one_of(
    st.tuples(st.just("step"), st.integers(0, 1), st.lists(st.sampled_from(REQUESTS), min_size=1, unique=True),
              st.integers(1, 9), st.integers(0, 2 ** 32 - 1)),
    st.tuples(st.just("release"), st.sampled_from(REQUESTS)),
    st.tuples(st.just("rollback"), st.sampled_from(REQUESTS), st.integers(0, 6)),
    st.tuples(st.just("move"), st.sampled_from(REQUESTS))), min_size=1, max_size=40)


def _check_slot_table(hasher: IncrementalHasher) -> None:
    """The slot table's invariants: the kernel writes without bounds checks, so a bad head would corrupt."""
    keep = hasher.context + hasher.max_rollback
    used = sorted(hasher._slots.values())
    assert len(set(used)) == len(used) and not set(used) & set(hasher._free)
    assert sorted(used + hasher._free) == list(range(hasher.capacity))
    assert ((hasher._head[used] >= 0) & (hasher._head[used] < keep)).all()
    assert ((hasher._count[used] >= 0) & (hasher._count[used] <= np.minimum(hasher._total[used], keep))).all()


@settings(max_examples=80, deadline=None)
@given(max_n=st.integers(2, 4), tokenizer=st.booleans(), max_rollback=st.integers(0, 4),
       layer_ids=st.sampled_from([None, [7], [7, 3]]), capacity=st.integers(1, 3), ops=interleaving)
def test_batched_steps_in_any_interleaving_equal_hashing_each_sequence(max_n, tokenizer, max_rollback, layer_ids,
                                                                       capacity, ops):
    # Batches of several requests with T tokens each, requests joining, leaving, rolling back and moving
    # between two hashers (export -> JSON -> import): every step's rows are those of the whole sequence.
    mapping = _mapping(max_n, tokenizer)
    lids = mapping.layer_ids if layer_ids is None else layer_ids
    hashers = [IncrementalHasher(mapping, layer_ids, max_rollback=max_rollback, initial_capacity=capacity)
               for _ in range(2)]
    context, keep = max_n - 1, max_n - 1 + max_rollback
    home: dict = {}                       # request -> index of the hasher that holds it
    seq: dict = {r: [] for r in REQUESTS}  # raw token ids since the request (re)started
    kept: dict = {}                       # tokens of context the hasher must keep, by the documented rule
    for op in ops:
        kind, r = op[0], op[1]
        if kind == "step":
            _, h, requests, T, seed = op
            batch = [q for q in requests if home.get(q, h) == h]
            if not batch:
                continue
            new = np.random.default_rng(seed).integers(0, len(TEXTS), size=(len(batch), T))
            rows = hashers[h].hash_step(batch, new)
            assert list(rows) == lids
            for b, q in enumerate(batch):
                home[q] = h
                seq[q] += new[b].tolist()
                kept[q] = min(kept.get(q, 0) + T, keep)
                full = mapping.hash_layers(np.array([seq[q]]), lids)
                for lid in lids:
                    assert rows[lid].shape == (len(batch), T, mapping.num_heads) and rows[lid].flags.c_contiguous
                    np.testing.assert_array_equal(rows[lid][b], full[lid][0, -T:])
        elif r not in home:
            assert all(r not in hasher for hasher in hashers)
            if kind == "release":
                hashers[0].release(r)  # unknown ids are ignored
            else:
                with pytest.raises(InvalidArgument, match="not a known request"):
                    hashers[0].export_state(r) if kind == "move" else hashers[0].rollback(r, op[2])
        elif kind == "release":
            hashers[home.pop(r)].release(r)
            seq[r], kept[r] = [], 0
        elif kind == "rollback":
            n, total = op[2], len(seq[r])
            if n > total:
                with pytest.raises(InvalidArgument, match="cannot take back"):
                    hashers[home[r]].rollback(r, n)
            elif kept[r] - n < min(total - n, context):
                with pytest.raises(InvalidArgument, match="max_rollback"):
                    hashers[home[r]].rollback(r, n)
            else:
                hashers[home[r]].rollback(r, n)
                del seq[r][total - n:]
                kept[r] -= n
        else:  # move
            source, target = hashers[home[r]], hashers[1 - home[r]]
            state = json.loads(json.dumps(source.export_state(r)))
            target.import_state(r, state)
            source.release(r)
            home[r] = 1 - home[r]
        for hasher in hashers:
            _check_slot_table(hasher)
    for h, hasher in enumerate(hashers):
        living = [r for r in REQUESTS if home.get(r) == h]
        assert len(hasher) == len(living) and all(r in hasher for r in living)
        assert hasher.capacity >= len(living)
        for r in living:
            state = hasher.export_state(r)
            compressed = mapping.prepare_ids(np.array([seq[r]], dtype=np.int64))[0] if seq[r] else []
            assert state["total"] == len(seq[r])
            assert state["tokens"] == list(compressed[len(compressed) - kept[r]:])


def test_a_released_slot_serves_the_next_request_without_its_context():
    mapping = _mapping(3, tokenizer=False)
    hasher = IncrementalHasher(mapping, initial_capacity=2)
    hasher.hash_step(["a", "b"], np.array([[1, 2, 3], [4, 5, 6]]))
    hasher.release("a")
    rows = hasher.hash_step(["c", "b"], np.array([[7], [8]]))  # "c" takes the slot "a" left
    assert hasher.capacity == 2 and len(hasher) == 2
    for lid, expected in mapping.hash(np.array([[7]])).items():
        np.testing.assert_array_equal(rows[lid][0], expected[0])
    for lid, expected in mapping.hash(np.array([[4, 5, 6, 8]])).items():
        np.testing.assert_array_equal(rows[lid][1], expected[0, -1:])
    hasher.release("c")
    hasher.import_state("d", {**hasher.export_state("b"), "tokens": [9], "total": 1})  # and so does an import
    assert hasher.capacity == 2
    rows = hasher.hash_step(["d"], np.array([[10]]))
    for lid, expected in mapping.hash(np.array([[9, 10]])).items():
        np.testing.assert_array_equal(rows[lid][0], expected[0, -1:])


def test_the_slot_table_grows_past_its_initial_size_and_keeps_every_context():
    mapping = _mapping(4, tokenizer=True)
    hasher = IncrementalHasher(mapping, max_rollback=2, initial_capacity=1)
    rng = np.random.default_rng(7)
    tokens = {r: rng.integers(0, len(TEXTS), size=3).tolist() for r in range(11)}
    hasher.hash_step([0], np.array([tokens[0]]))
    hasher.hash_step([1, 2], np.array([tokens[1], tokens[2]]))    # grows within one step
    hasher.hash_step(range(3, 11), np.array([tokens[r] for r in range(3, 11)]))
    assert len(hasher) == 11 and hasher.capacity == 16
    order = rng.permutation(11).tolist()
    new = rng.integers(0, len(TEXTS), size=(11, 2))
    rows = hasher.hash_step(order, new)
    for b, r in enumerate(order):
        full = mapping.hash(np.array([tokens[r] + new[b].tolist()]))
        for lid in mapping.layer_ids:
            np.testing.assert_array_equal(rows[lid][b], full[lid][0, -2:])


def test_returned_rows_belong_to_the_caller():
    mapping = _mapping(3, tokenizer=False)
    hasher = IncrementalHasher(mapping)
    first = hasher.hash_step(["a", "b"], np.array([[1], [2]]))
    kept = {lid: r.copy() for lid, r in first.items()}
    hasher.hash_step(["a", "b"], np.array([[3], [4]]))
    for lid, r in first.items():
        assert r.dtype == np.int64 and r.flags.c_contiguous
        np.testing.assert_array_equal(r, kept[lid])


def test_requests_stepped_from_several_threads():
    mapping = _mapping(3, tokenizer=True)
    hasher = IncrementalHasher(mapping, initial_capacity=1)
    rng = np.random.default_rng(3)
    streams = {t: rng.integers(0, len(TEXTS), size=(2, 60)) for t in range(4)}
    got = {t: {lid: [] for lid in mapping.layer_ids} for t in streams}
    errors = []

    def run(t):
        try:
            for i in range(0, 60, 3):
                rows = hasher.hash_step([(t, 0), (t, 1)], streams[t][:, i:i + 3])
                for lid, r in rows.items():
                    got[t][lid].append(r)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in streams]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(hasher) == 8
    for t, ids in streams.items():
        full = mapping.hash(ids)
        for lid in mapping.layer_ids:
            np.testing.assert_array_equal(np.concatenate(got[t][lid], axis=1), full[lid])


def test_bad_hasher_arguments_name_the_argument():
    mapping = _mapping(3, tokenizer=False)
    with pytest.raises(InvalidArgument, match="initial_capacity: expected an integer >= 1"):
        IncrementalHasher(mapping, initial_capacity=0)
    with pytest.raises(InvalidArgument, match="max_rollback: expected an integer >= 0"):
        IncrementalHasher(mapping, max_rollback=-1)
    with pytest.raises(InvalidArgument, match="layer_ids: expected at least one"):
        IncrementalHasher(mapping, layer_ids=[])
    with pytest.raises(InvalidArgument, match="layer_id: expected one of"):
        IncrementalHasher(mapping, layer_ids=[5])
    hasher = IncrementalHasher(mapping)
    with pytest.raises(InvalidArgument, match="input_ids: expected shape"):
        hasher.hash_step(["a"], np.zeros(3, dtype=np.int64))
    donor = IncrementalHasher(mapping)
    donor.hash_step(["a"], np.array([[1, 2]]))
    with pytest.raises(InvalidArgument, match="state: 'total' must be"):
        hasher.import_state("a", {**donor.export_state("a"), "total": 1})
    with pytest.raises(InvalidArgument, match="state: expected a dict from export_state"):
        hasher.import_state("a", {**donor.export_state("a"), "version": 99})
    assert len(hasher) == 0  # refused calls change nothing
