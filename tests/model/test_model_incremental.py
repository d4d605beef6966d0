"""IncrementalHasher: any split of a token stream into steps, with rollbacks, hashes like the whole sequence."""
from __future__ import annotations

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
