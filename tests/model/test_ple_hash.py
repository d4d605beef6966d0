"""PLEHasher: the kernel against its NumPy twin and against a transcription of transformers' hash on random
configs, sequences (EOS anywhere), contexts and chunkings; transformers' own code where it is installed (the
release's config, two PLE layers, chunks through its cache); the EOS rules by example; refusals."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engram_model.ple import PLEConfig, PLEHashBuffers, PLEHasher
from engram_store import InvalidArgument, InvalidType

import model_helpers as ref


@st.composite
def hashers(draw):
    """A random config (toy head sizes, where the modulo takes its general loop, and large ones), maybe a
    checkpoint's multipliers (large ones overflow int64: the products wrap, as in torch)."""
    ngram_size, hpn = draw(st.integers(2, 5)), draw(st.sampled_from([1, 3, 8]))
    vocab = draw(st.integers(2, 300))
    config = PLEConfig(ple_layer_ids=draw(st.lists(st.integers(1, 9), min_size=1, max_size=2, unique=True)),
                       ngram_size=ngram_size, heads_per_ngram=hpn, hidden_size=(ngram_size - 1) * hpn,
                       ngram_vocab_size_base=draw(st.sampled_from([2, 97, 20_000_000])), vocab_size=vocab,
                       eos_token_id=draw(st.integers(0, vocab - 1)), seed=draw(st.integers(-100, 100)))
    buffers = None
    if draw(st.booleans()):
        rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
        buffers = {}
        for lid in config.ple_layer_ids:
            b = config.hash_buffers(lid)
            wild = rng.integers(-2 ** 63, 2 ** 63, size=ngram_size, dtype=np.int64, endpoint=False)
            buffers[lid] = PLEHashBuffers(lid, tuple(wild.tolist()), b.sizes, b.offsets, b.rows)
    return PLEHasher(config, buffers)


def transcription(hasher: PLEHasher, ids: np.ndarray, context: np.ndarray) -> np.ndarray:
    """Every layer's rows by the transcription of transformers' forward: ``[B, T, n_layers, heads]``."""
    c = hasher.config
    return np.stack([ref.ngram_ids(ids, context, hasher.multipliers[j], hasher.sizes[j], hasher.offsets[j],
                                   c.heads_per_ngram, c.ngram_size, c.eos_token_id)
                     for j in range(len(c.ple_layer_ids))], axis=2)


def sequences(hasher: PLEHasher, data, B: int, T: int) -> np.ndarray:
    """Token ids with EOS where the draw puts them (often, in runs, or never)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    ids = rng.integers(0, hasher.config.vocab_size, (B, T))
    ids[rng.random((B, T)) < data.draw(st.sampled_from([0.0, 0.1, 0.5]))] = hasher.eos
    return ids


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hashers(), st.data())
def test_kernel_twin_and_transcription_agree(hasher, data):
    B, T = data.draw(st.integers(1, 3)), data.draw(st.sampled_from([1, 2, 5, 63, 64, 65, 130]))
    ids = sequences(hasher, data, B, T)
    context = sequences(hasher, data, B, hasher.context) if data.draw(st.booleans()) else None
    got = hasher(ids, context)
    full_context = np.full((B, hasher.context), hasher.eos) if context is None else context
    np.testing.assert_array_equal(got, hasher.hash_numpy(ids, context))
    np.testing.assert_array_equal(got, transcription(hasher, ids, full_context))
    assert got.dtype == np.int64 and got.shape == (B, T, len(hasher.config.ple_layer_ids), hasher.config.heads)
    assert ((got >= hasher.offsets[None, None]) & (got < hasher.offsets + hasher.sizes)).all()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hashers(), st.data())
def test_chunks_of_any_sizes_give_the_whole_sequence_rows(hasher, data):
    B, T = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 90))
    ids = sequences(hasher, data, B, T)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, T), max_size=6))) - {T})
    state, parts = hasher.begin(B), []
    for lo, hi in zip([0] + cuts, cuts + [T]):
        parts.append(hasher.step(state, ids[:, lo:hi]))
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), hasher(ids))
    # The state is the last ngram_size - 1 tokens, oldest first (EOS where there were fewer), as the reference's
    # cache keeps them; a call with that context continues the sequence.
    tail = np.concatenate([np.full((B, hasher.context), hasher.eos), ids], axis=1)[:, -hasher.context:]
    np.testing.assert_array_equal(state.history, tail)
    more = sequences(hasher, data, B, 7)
    np.testing.assert_array_equal(hasher(more, state.history), hasher(np.concatenate([ids, more], 1))[:, T:])


def test_equals_transformers_own_hash():
    """The release's config and a toy with two PLE layers and order 4: whole sequences, and chunks through
    transformers' own cache (its n-gram context kept in a conv state)."""
    torch, _, DynamicCache = ref.reference()
    rng = np.random.default_rng(0)
    configs = [PLEConfig(ple_layer_ids=[2]),
               PLEConfig(ple_layer_ids=[2, 3], vocab_size=1000, eos_token_id=5, ngram_vocab_size_base=40,
                         ngram_size=4, heads_per_ngram=3, hidden_size=36, seed=-7)]
    for config in configs:
        hasher = PLEHasher(config)
        ids = rng.integers(0, config.vocab_size, (3, 50))
        ids[rng.random(ids.shape) < 0.1] = config.eos_token_id
        ids[0, :3] = config.eos_token_id                                   # EOS first, and in a run
        ours = hasher(ids)
        for j, lid in enumerate(config.ple_layer_ids):
            module, hf_config = ref.hf_ngram_ids_module(config, lid)
            with torch.no_grad():
                whole = module(torch.from_numpy(ids), None).numpy().astype(np.int64)
                cache = DynamicCache(config=hf_config)
                chunks = [module(torch.from_numpy(ids[:, lo:hi]), cache).numpy().astype(np.int64)
                          for lo, hi in [(0, 1), (1, 4), (4, 5), (5, 30), (30, 50)]]
            np.testing.assert_array_equal(ours[:, :, j], whole)
            np.testing.assert_array_equal(np.concatenate(chunks, axis=1), whole)


EOS = 9
SMALL = PLEConfig(ple_layer_ids=[1], ngram_size=4, heads_per_ngram=2, hidden_size=6, ngram_vocab_size_base=1000,
                  vocab_size=100, eos_token_id=EOS)


def rows_of(hasher: PLEHasher, windows: list[tuple[int, ...]]) -> np.ndarray:
    """The rows ``[T, heads]`` of explicit windows (token, 1 back, 2 back, 3 back), by the formula."""
    m, sizes, offsets = hasher.multipliers[0].tolist(), hasher.sizes[0], hasher.offsets[0]
    out = []
    for window in windows:
        mix, row = window[0] * m[0], []
        for n in range(2, 5):
            mix ^= window[n - 1] * m[n - 1]
            row += [(mix % int(sizes[h])) + int(offsets[h]) for h in range((n - 2) * 2, (n - 1) * 2)]
        out.append(row)
    return np.array(out)


def test_the_eos_rules_by_example():
    hasher = PLEHasher(SMALL)
    # A sequence starts with EOS as its context.
    np.testing.assert_array_equal(hasher([[1, 2, 3, 4]])[0, :, 0],
                                  rows_of(hasher, [(1, 9, 9, 9), (2, 1, 9, 9), (3, 2, 1, 9), (4, 3, 2, 1)]))
    # Walking back, the first EOS met is kept and every older token reads EOS; the token itself is never replaced.
    np.testing.assert_array_equal(hasher([[1, 2, EOS, 4, 5, 6]])[0, :, 0],
                                  rows_of(hasher, [(1, 9, 9, 9), (2, 1, 9, 9), (9, 2, 1, 9), (4, 9, 9, 9),
                                                   (5, 4, 9, 9), (6, 5, 4, 9)]))
    # A context is the tokens before, oldest first; one whose last token is EOS blocks the older ones.
    np.testing.assert_array_equal(hasher([[4, 5]], [[7, 8, 3]])[0, :, 0],
                                  rows_of(hasher, [(4, 3, 8, 7), (5, 4, 3, 8)]))
    np.testing.assert_array_equal(hasher([[4, 5]], [[7, 8, EOS]])[0, :, 0],
                                  rows_of(hasher, [(4, 9, 9, 9), (5, 4, 9, 9)]))


def test_refusals_name_the_argument():
    hasher = PLEHasher(SMALL)
    with pytest.raises(InvalidArgument, match=r"input_ids: token id 100 at \[0, 1\] is outside the vocabulary"):
        hasher([[1, 100]])
    with pytest.raises(InvalidArgument, match=r"input_ids: token id -1 at \[1, 0\]"):
        hasher([[1], [-1]])
    with pytest.raises(InvalidArgument, match=r"context: expected shape \[B, ngram_size - 1\] = \[1, 3\]"):
        hasher([[1]], [[1, 2]])
    with pytest.raises(InvalidArgument, match=r"context: token id 100 at \[0, 2\]"):
        hasher([[1]], [[1, 2, 100]])
    with pytest.raises(InvalidArgument, match="input_ids: expected token ids of shape"):
        hasher([1, 2])
    with pytest.raises(InvalidType, match="config: expected a PLEConfig"):
        PLEHasher(object())
    with pytest.raises(InvalidArgument, match=r"buffers: layers \[5\] are not in ple_layer_ids \[1\]"):
        PLEHasher(SMALL, {5: SMALL.hash_buffers(1)})
    with pytest.raises(InvalidType, match="state: expected the PLEHashState of begin()"):
        hasher.step(None, [[1]])
    assert hasher(np.zeros((2, 0), np.int64)).shape == (2, 0, 1, 6)


def test_a_checkpoints_buffers_take_precedence():
    """With the checkpoint's multipliers, the hasher gives the transcription's rows of those multipliers."""
    b = SMALL.hash_buffers(1)
    theirs = PLEHashBuffers(1, (3, 5, 7, 11), b.sizes, b.offsets, b.rows)
    hasher = PLEHasher(SMALL, {1: theirs})
    ids = np.array([[1, 2, EOS, 4, 5, 6]])
    expected = ref.ngram_ids(ids, np.full((1, 3), EOS), theirs.multipliers, theirs.sizes, theirs.offsets, 2, 4, EOS)
    np.testing.assert_array_equal(hasher(ids)[:, :, 0], expected)
    assert not (hasher(ids) == PLEHasher(SMALL)(ids)).all()
