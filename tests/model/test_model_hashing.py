"""NgramHashMapping: the Numba kernel against a plain NumPy transcription of the reference formulas."""

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_model.demo import _kernels
from engram_model import BackboneConfig, CompressedTokenizer, EngramConfig, NgramHashMapping, get_hash_mapping
from engram_model.demo._hasher import layer_multipliers, ngram_hashes_numpy, table_sizes_across_layers
from engram_model._ngram import find_next_prime, is_prime
from engram_store import InvalidArgument, InvalidType

INT64_MIN, INT64_MAX = np.iinfo(np.int64).min, np.iinfo(np.int64).max


def naive_is_prime(n):
    return n >= 2 and all(n % d for d in range(2, int(n ** 0.5) + 1))


def transcribed_hash(x, pad_id, multipliers, primes_per_ngram, max_n, min_n=2):
    """Position by position, in Python ints reduced to int64 the way NumPy wraps them."""
    def wrap(v):
        return (v + 2 ** 63) % 2 ** 64 - 2 ** 63

    B, T = x.shape
    out = np.zeros((B, T, sum(len(p) for p in primes_per_ngram)), dtype=np.int64)
    for b in range(B):
        for t in range(T):
            tok = [int(x[b, t - k]) if t - k >= 0 else pad_id for k in range(max_n)]
            col = 0
            for n in range(min_n, max_n + 1):
                mix = wrap(tok[0] * int(multipliers[0]))
                for k in range(1, n):
                    mix ^= wrap(tok[k] * int(multipliers[k]))
                for p in primes_per_ngram[n - min_n]:
                    out[b, t, col] = mix % p  # Python %: floor modulo, like NumPy's
                    col += 1
    return out


configs = st.fixed_dictionaries({
    "max_n": st.integers(2, 5),
    "n_head": st.integers(1, 4),
    "base": st.integers(2, 5000),
    "layer_ids": st.lists(st.integers(0, 40), min_size=1, max_size=3, unique=True),
    "pad_id": st.integers(0, 50),
    "seed": st.integers(0, 2 ** 32),
    "vocab": st.one_of(st.integers(1, 10), st.integers(11, 2 ** 40)),
})


def build(cfg, min_n=2):
    orders = cfg["max_n"] - min_n + 1
    return NgramHashMapping([cfg["base"] + 7 * i for i in range(orders)], cfg["max_n"], cfg["n_head"] * 2,
                            cfg["n_head"], cfg["layer_ids"], pad_id=cfg["pad_id"], seed=cfg["seed"],
                            vocab_size=cfg["vocab"], min_ngram_size=min_n)


@settings(max_examples=50, deadline=None)
@given(cfg=configs, B=st.integers(1, 3), T=st.integers(1, 12), data=st.data())
def test_kernel_matches_numpy_and_transcription(cfg, B, T, data):
    m = build(cfg)
    ids = data.draw(st.lists(st.one_of(st.integers(-5, 200), st.integers(INT64_MIN, INT64_MAX)),
                             min_size=B * T, max_size=B * T))
    x = np.asarray(ids, dtype=np.int64).reshape(B, T)
    all_layers = m.hash(x)
    assert list(all_layers) == m.layer_ids
    for lid in m.layer_ids:
        got = all_layers[lid]
        assert got.dtype == np.int64 and got.shape == (B, T, m.num_heads)
        np.testing.assert_array_equal(got, m.hash_numpy(x, lid))
        np.testing.assert_array_equal(got, transcribed_hash(x, m.pad_id, m.layer_multipliers[lid],
                                                            m.vocab_size_across_layers[lid], m.max_ngram_size))
        np.testing.assert_array_equal(got, m.hash_layer(x, lid))
        primes = np.asarray(m.get_table_vocab_sizes(lid))
        assert (got >= 0).all() and (got < primes).all()


@settings(max_examples=20, deadline=None)
@given(cfg=configs.filter(lambda c: c["max_n"] >= 3), data=st.data())
def test_min_ngram_size_drops_low_orders(cfg, data):
    min_n = data.draw(st.integers(3, cfg["max_n"]))
    m = build(cfg, min_n)
    x = np.asarray(data.draw(st.lists(st.integers(INT64_MIN, INT64_MAX), min_size=10, max_size=10)),
                   dtype=np.int64).reshape(2, 5)
    for lid in m.layer_ids:
        expected = transcribed_hash(x, m.pad_id, m.layer_multipliers[lid], m.vocab_size_across_layers[lid],
                                    m.max_ngram_size, min_n)
        np.testing.assert_array_equal(m.hash_layer(x, lid), expected)


@settings(max_examples=50, deadline=None)
@given(data=st.data(), max_n=st.integers(2, 4), n_head=st.integers(1, 3), n_layers=st.integers(1, 2))
def test_kernel_modulo_exact_for_any_modulus_and_multiplier(data, max_n, n_head, n_layers):
    """The float-estimated modulo against Python's %, including tiny and near-int64 moduli."""
    H = (max_n - 1) * n_head
    moduli = st.one_of(st.integers(1, 20), st.integers(21, 2 ** 40), st.integers(2 ** 60, INT64_MAX))
    primes = np.asarray(data.draw(st.lists(moduli, min_size=n_layers * H, max_size=n_layers * H)),
                        dtype=np.int64).reshape(n_layers, H)
    mults = np.asarray(data.draw(st.lists(st.integers(INT64_MIN, INT64_MAX), min_size=n_layers * max_n,
                                          max_size=n_layers * max_n)), dtype=np.int64).reshape(n_layers, max_n)
    x = np.asarray(data.draw(st.lists(st.integers(INT64_MIN, INT64_MAX), min_size=6, max_size=6)),
                   dtype=np.int64).reshape(2, 3)
    pad = data.draw(st.integers(INT64_MIN, INT64_MAX))
    got = _kernels.hash_layers(x, pad, mults, primes, 2, n_head)
    for layer in range(n_layers):
        per_ngram = primes[layer].reshape(max_n - 1, n_head).tolist()
        np.testing.assert_array_equal(got[layer], transcribed_hash(x, pad, mults[layer], per_ngram, max_n))


def test_numpy_reference_function_matches_kernel_on_demo_config():
    m = get_hash_mapping(EngramConfig(), BackboneConfig())
    x = np.random.default_rng(1).integers(0, 129280, size=(4, 300))
    for lid in m.layer_ids:
        ref = ngram_hashes_numpy(x, m.pad_id, m.layer_multipliers[lid], m.vocab_size_across_layers[lid], 3)
        np.testing.assert_array_equal(m.hash_layer(x, lid), ref)


def test_is_prime_and_next_prime():
    assert [n for n in range(200) if is_prime(n)] == [n for n in range(200) if naive_is_prime(n)]
    assert all(is_prime(n) == naive_is_prime(n) for n in range(646_000, 647_000))
    assert is_prime(2 ** 61 - 1) and not is_prime(2 ** 61 + 1)
    assert find_next_prime(1000, set()) == 1009
    assert find_next_prime(1008, {1009}) == 1013
    assert find_next_prime(1009, set()) == 1013  # strictly above start


def test_primes_unique_across_layers_and_prime():
    sizes = table_sizes_across_layers([1000, 1000, 50], 4, 5, [1, 15, 3])
    flat = [p for layer in sizes.values() for order in layer for p in order]
    assert len(flat) == len(set(flat)) == 3 * 3 * 5
    assert all(naive_is_prime(p) for p in flat)
    assert sizes[1][0][:3] == [1009, 1013, 1019]
    assert all(p > 49 for layer in sizes.values() for p in layer[2])
    # Layer order matters: the first listed layer gets the smallest primes.
    assert sizes[1][0][0] < sizes[15][0][0] < sizes[3][0][0]


def test_demo_config_primes():
    m = get_hash_mapping(EngramConfig(engram_vocab_size=[1000, 1000], max_ngram_size=3, n_embed_per_ngram=64,
                                      n_head_per_ngram=4, layer_ids=[1, 15]), BackboneConfig(vocab_size=128000))
    assert m.get_table_vocab_sizes(1) == [1009, 1013, 1019, 1021, 1031, 1033, 1039, 1049]
    assert m.get_table_vocab_sizes(15)[0] == 1051


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2 ** 40), layer=st.integers(0, 100), max_n=st.integers(2, 6),
       vocab=st.integers(1, 2 ** 62))
def test_multipliers_follow_default_rng_formula(seed, layer, max_n, vocab):
    half_bound = max(1, (np.iinfo(np.int64).max // vocab) // 2)
    r = np.random.default_rng(seed + 10007 * layer).integers(0, half_bound, size=max_n, dtype=np.int64)
    got = layer_multipliers(seed, layer, max_n, vocab)
    np.testing.assert_array_equal(got, r * 2 + 1)
    assert (got % 2 == 1).all()


def test_tokenizer_compresses_ids_and_pad():
    tok = CompressedTokenizer(["<pad>", "A", "a", " á", "b", "<s>"])
    m = NgramHashMapping([100, 100], 3, 4, 2, [0], tokenizer=tok, pad_id=2, seed=0)
    assert m.tokenizer_vocab_size == len(tok) == 4 and m.pad_id == 1  # " á" also normalises to "a"
    x = np.array([[1, 2, 3, 4, 0]])
    np.testing.assert_array_equal(m.hash_layer(x, 0),
                                  ngram_hashes_numpy(tok(x), 1, m.layer_multipliers[0],
                                                     m.vocab_size_across_layers[0], 3))
    with pytest.raises(InvalidArgument, match="out of range"):
        m.hash_layer([[1, 6]], 0)
    with pytest.raises(InvalidArgument, match="pad_id"):
        NgramHashMapping([100, 100], 3, 4, 2, [0], tokenizer=tok, pad_id=6)


def test_hash_input_errors():
    m = NgramHashMapping([100, 100], 3, 4, 2, [0, 5], vocab_size=1000)
    with pytest.raises(InvalidArgument, match=r"input_ids: expected shape \[B, L\]"):
        m.hash([1, 2, 3])
    with pytest.raises(InvalidType, match="input_ids: expected integer"):
        m.hash(np.ones((2, 3), dtype=np.float32))
    with pytest.raises(InvalidArgument, match="input_ids"):
        m.hash([[1, 2], [3]])
    with pytest.raises(InvalidArgument, match="layer_id: expected one of"):
        m.hash_layer([[1]], 3)
    with pytest.raises(InvalidArgument, match="vocab_size"):
        NgramHashMapping([100, 100], 3, 4, 2, [0])
    assert m.hash(np.zeros((0, 4), dtype=np.int64))[0].shape == (0, 4, 4)


def test_cache_returns_shared_instance_and_is_thread_safe():
    cfg, bb = EngramConfig(engram_vocab_size=[3001, 3001], layer_ids=[2, 4]), BackboneConfig(vocab_size=777)
    results = []
    threads = [threading.Thread(target=lambda: results.append(get_hash_mapping(cfg, bb))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(r) for r in results}) == 1
    assert get_hash_mapping(cfg, BackboneConfig(vocab_size=778)) is not results[0]
    tok_a, tok_b = CompressedTokenizer(["a", "b", "B"]), CompressedTokenizer(["a", "b", "B"])
    assert get_hash_mapping(cfg, bb, tok_a) is get_hash_mapping(cfg, bb, tok_b)
    assert get_hash_mapping(cfg, bb, tok_a) is not get_hash_mapping(cfg, bb, CompressedTokenizer(["a", "b", "c"]))
