"""Engram.forward against an independent float64 transcription of the reference formulas (no store needed)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_model import BackboneConfig, Engram, EngramConfig, EngramModule, EngramModuleConfig
from engram_store import ConfigError, InvalidArgument, InvalidType, NotConnected

F32_EPS = float(np.finfo(np.float32).eps)


def reference_forward(sd, emb, h, hc, hidden, K, dilation):
    """Engram.forward of engram_demo_v1.py, written out in float64 loops over channels and time."""
    B, L = h.shape[:2]
    e = emb.reshape(B, L, -1).astype(np.float64)
    h = h.astype(np.float64)

    def rms(x, w, eps):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * w

    gates = []
    for i in range(hc):
        key = e @ sd[f"key_projs.{i}.weight"].T.astype(np.float64) + sd[f"key_projs.{i}.bias"]
        normed_key = rms(key, sd[f"norm1.{i}.weight"], F32_EPS)
        normed_query = rms(h[:, :, i, :], sd[f"norm2.{i}.weight"], F32_EPS)
        g = (normed_key * normed_query).sum(-1) / np.sqrt(hidden)
        g = np.sqrt(np.maximum(np.abs(g), 1e-6)) * np.sign(g)
        gates.append(1.0 / (1.0 + np.exp(-g)))
    gates = np.stack(gates, axis=2)[..., None]                                     # B, L, hc, 1
    value = gates * (e @ sd["value_proj.weight"].T + sd["value_proj.bias"])[:, :, None, :]
    x = np.concatenate([rms(value[:, :, i, :], sd[f"short_conv.norms.{i}.weight"], 1e-5) for i in range(hc)],
                       axis=-1)                                                    # B, L, hc*hidden
    w = sd["short_conv.conv.weight"].astype(np.float64)                            # hc*hidden, 1, K
    y = np.zeros_like(x)
    for t in range(L):
        for j in range(K):
            src = t - (K - 1 - j) * dilation
            if src >= 0:
                y[:, t, :] += w[:, 0, j] * x[:, src, :]
    y = y / (1.0 + np.exp(-y))
    return value + y.reshape(B, L, hc, hidden), gates[..., 0]


def random_state(engram, rng):
    """Weights far from the initial ones, so every term of the formula matters."""
    sd = {}
    for name, value in engram.state_dict().items():
        if "norm" in name:
            sd[name] = (1.0 + 0.3 * rng.standard_normal(value.shape)).astype(np.float32)
        else:
            sd[name] = (0.4 * rng.standard_normal(value.shape)).astype(np.float32)
    return sd


def make_engram(max_n=3, n_head=2, n_embed=8, hidden=12, hc=3, kernel_size=3, seed=0):
    cfg = EngramConfig(engram_vocab_size=[50 + 10 * i for i in range(max_n - 1)], max_ngram_size=max_n,
                       n_embed_per_ngram=n_embed, n_head_per_ngram=n_head, layer_ids=[0, 2], kernel_size=kernel_size,
                       seed=seed)
    return Engram(2, cfg, BackboneConfig(hidden_size=hidden, hc_mult=hc, vocab_size=1000, num_layers=4))


@settings(max_examples=25, deadline=None)
@given(max_n=st.integers(2, 4), n_head=st.integers(1, 3), hidden=st.integers(1, 20), hc=st.integers(1, 4),
       kernel_size=st.integers(1, 5), B=st.integers(1, 3), L=st.integers(1, 14), seed=st.integers(0, 1000))
def test_forward_matches_float64_transcription(max_n, n_head, hidden, hc, kernel_size, B, L, seed):
    engram = make_engram(max_n, n_head, 4 * n_head, hidden, hc, kernel_size)
    rng = np.random.default_rng(seed)
    sd = random_state(engram, rng)
    engram.load_state_dict(sd)
    emb = rng.standard_normal((B, L, engram.get_num_heads(), engram.get_embedding_dim()), dtype=np.float32)
    h = rng.standard_normal((B, L, hc, hidden), dtype=np.float32)
    out, gates = engram.forward_with_gates(h, embeddings=emb)
    ref, ref_gates = reference_forward(sd, emb, h, hc, hidden, kernel_size, max_n)
    assert out.dtype == np.float32 and out.shape == (B, L, hc, hidden)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(gates, ref_gates, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(engram.forward(h, embeddings=emb), out)


def test_initial_weights_seeded_and_documented_values():
    a, b = make_engram(seed=3), make_engram(seed=3)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(np.array_equal(sa[k], sb[k]) for k in sa)
    assert not np.array_equal(sa["value_proj.weight"], make_engram(seed=4).state_dict()["value_proj.weight"])
    assert np.all(sa["value_proj.bias"] == 0) and np.all(sa["norm1.0.weight"] == 1)
    assert 0.01 < sa["key_projs.1.weight"].std() < 0.03
    assert sa["short_conv.conv.weight"].shape == (3 * 12, 1, 3)


def test_state_dict_names_and_shapes():
    engram = make_engram()
    sd = engram.state_dict()
    E = 2 * 8
    expected = {"value_proj.weight": (12, E), "value_proj.bias": (12,), "short_conv.conv.weight": (36, 1, 3)}
    for i in range(3):
        expected.update({f"key_projs.{i}.weight": (12, E), f"key_projs.{i}.bias": (12,), f"norm1.{i}.weight": (12,),
                         f"norm2.{i}.weight": (12,), f"short_conv.norms.{i}.weight": (12,)})
    assert {k: v.shape for k, v in sd.items()} == expected
    assert all(v.dtype == np.float32 for v in sd.values())
    sd["value_proj.bias"][:] = 5  # a copy: the layer is unchanged
    assert np.all(engram.state_dict()["value_proj.bias"] == 0)


def test_load_state_dict_errors_name_every_problem():
    engram = make_engram()
    sd = engram.state_dict()
    before = engram.state_dict()
    bad = dict(sd)
    del bad["norm2.1.weight"]
    bad["extra.weight"] = np.zeros(3, np.float32)
    bad["value_proj.weight"] = np.zeros((12, 15), np.float32)
    bad["key_projs.0.bias"] = sd["key_projs.0.bias"] + 1
    with pytest.raises(InvalidArgument) as info:
        engram.load_state_dict(bad)
    msg = str(info.value)
    assert "missing: norm2.1.weight" in msg and "unexpected: extra.weight" in msg
    assert "value_proj.weight: expected (12, 16), got (12, 15)" in msg
    assert all(np.array_equal(engram.state_dict()[k], before[k]) for k in before)  # nothing changed
    with pytest.raises(InvalidType, match="key_projs.0.bias"):
        engram.load_state_dict({**sd, "key_projs.0.bias": np.zeros(12, np.int64)})
    # Non-strict: missing and unexpected names are tolerated, shapes are still checked.
    partial = {"value_proj.bias": np.full(12, 2.0), "other": np.zeros(1)}
    engram.load_state_dict(partial, strict=False)
    assert np.all(engram.state_dict()["value_proj.bias"] == 2)
    with pytest.raises(InvalidArgument, match="wrong shape"):
        engram.load_state_dict({"value_proj.bias": np.zeros(11)}, strict=False)


def test_reference_table_entries_are_recognised():
    engram = make_engram()
    sizes = engram.get_table_vocab_sizes()
    sd = engram.state_dict()
    table = np.zeros((sum(sizes), engram.get_embedding_dim()), np.float32)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    engram.load_state_dict({**sd, "multi_head_embedding.embedding.weight": table,
                            "multi_head_embedding.offsets": offsets})
    with pytest.raises(InvalidArgument, match="sum of get_table_vocab_sizes"):
        engram.load_state_dict({**sd, "multi_head_embedding.embedding.weight": table[1:]})
    with pytest.raises(InvalidArgument, match="offsets"):
        engram.load_state_dict({**sd, "multi_head_embedding.offsets": offsets + 1})
    with pytest.raises(NotConnected):  # populating needs a store
        engram.load_state_dict({**sd, "multi_head_embedding.embedding.weight": table}, populate_tables=True)


def test_forward_input_errors():
    engram = make_engram()
    H, D = engram.get_num_heads(), engram.get_embedding_dim()
    h = np.zeros((2, 5, 3, 12), np.float32)
    emb = np.zeros((2, 5, H, D), np.float32)
    with pytest.raises(InvalidType, match="hidden_states: expected a floating-point dtype .*, got int32"):
        engram.forward(h.astype(np.int32), embeddings=emb)
    with pytest.raises(InvalidType, match="hidden_states: expected a float32 NumPy array"):
        engram.forward(h.tolist(), embeddings=emb)
    with pytest.raises(InvalidArgument, match=r"hidden_states: expected shape \[B, L, hc_mult=3, hidden_size=12\]"):
        engram.forward(np.zeros((2, 5, 4, 12), np.float32), embeddings=emb)
    with pytest.raises(InvalidArgument, match="hidden_states"):
        engram.forward(np.zeros((0, 5, 3, 12), np.float32), embeddings=emb)
    with pytest.raises(InvalidArgument, match=r"embeddings: expected rows of shape \(2, 5, 4, 4\)"):
        engram.forward(h, embeddings=emb[:, :4])
    with pytest.raises(InvalidType, match="embeddings"):
        engram.forward(h, embeddings=emb.astype(np.float16))
    with pytest.raises(InvalidArgument, match="input_ids: expected"):
        engram.forward(h)
    with pytest.raises(InvalidArgument, match=r"input_ids: expected shape \(2, 5\)"):
        engram.forward(h, np.zeros((2, 4), np.int64))
    with pytest.raises(InvalidType, match="input_ids: expected integer"):
        engram.forward(h, np.zeros((2, 5)))
    with pytest.raises(InvalidType, match="prefetched"):
        engram.forward(h, prefetched=emb)
    with pytest.raises(NotConnected):
        engram.forward(h, np.zeros((2, 5), np.int64))


def test_config_validation_says_what_to_change():
    with pytest.raises(ConfigError, match="n_embed_per_ngram: expected a multiple of n_head_per_ngram = 3"):
        EngramConfig(n_embed_per_ngram=64, n_head_per_ngram=3)
    with pytest.raises(ConfigError, match=r"engram_vocab_size: expected one base size per n-gram order 2\.\.4"):
        EngramConfig(max_ngram_size=4)
    with pytest.raises(ConfigError, match=r"engram_vocab_size\[1\]: expected a positive integer"):
        EngramConfig(engram_vocab_size=[10, 0])
    with pytest.raises(ConfigError, match="max_ngram_size: expected >= 2"):
        EngramConfig(max_ngram_size=1, engram_vocab_size=[])
    with pytest.raises(ConfigError, match="hidden_size: expected a positive integer, got 0"):
        BackboneConfig(hidden_size=0)
    with pytest.raises(ConfigError, match="hc_mult"):
        BackboneConfig(hc_mult=-1)
    with pytest.raises(ConfigError, match="layer_ids: expected distinct"):
        EngramConfig(layer_ids=[1, 1])
    cfg = EngramConfig()
    cfg.max_ngram_size = 4  # set by attribute: checked when used
    with pytest.raises(ConfigError, match="engram_vocab_size"):
        Engram(1, cfg, BackboneConfig())
    with pytest.raises(ConfigError, match=r"layer_id: 3 is not in config.layer_ids = \[1, 15\]"):
        Engram(3, EngramConfig(), BackboneConfig())
    with pytest.raises(ConfigError, match="num_layers"):
        Engram(15, EngramConfig(), BackboneConfig(num_layers=6))
    with pytest.raises(InvalidType, match="config: expected an EngramConfig"):
        Engram(1, {"max_ngram_size": 3})
    assert EngramConfig().num_heads == 16 and EngramConfig().head_dim == 64


def test_config_edits_after_build_do_not_change_the_layer():
    cfg = EngramConfig(engram_vocab_size=[100, 100], n_embed_per_ngram=8, n_head_per_ngram=2)
    engram = Engram(1, cfg, BackboneConfig(hidden_size=8, hc_mult=2))
    cfg.n_head_per_ngram = 4
    assert engram.get_num_heads() == 4 and engram.config.n_head_per_ngram == 2


def test_engram_module_single_stream_matches_engram():
    mcfg = EngramModuleConfig(vocab_size=500, min_n=2, max_n=3, num_hash_heads=2, embedding_table_size=70,
                              embedding_dim=4, hidden_dim=10, kernel_size=2)
    module = EngramModule(mcfg)
    engram = module.engram
    assert engram.backbone_cfg.hc_mult == 1 and engram.get_num_heads() == 4 and engram.get_embedding_dim() == 4
    assert module.get_table_vocab_sizes() == [71, 73, 79, 83]
    rng = np.random.default_rng(0)
    engram.load_state_dict(random_state(engram, rng))
    h = rng.standard_normal((2, 6, 10), dtype=np.float32)
    emb = rng.standard_normal((2, 6, 4, 4), dtype=np.float32)
    out, gating = module.forward(h, memory_embeddings=emb, return_gating=True)
    direct, gates = engram.forward_with_gates(h[:, :, None, :], embeddings=emb)
    np.testing.assert_array_equal(out, h + direct[:, :, 0, :])
    np.testing.assert_array_equal(gating, gates)
    assert gating.shape == (2, 6, 1)
    assert module.forward(h, memory_embeddings=emb)[1] is None
    with pytest.raises(InvalidArgument, match=r"hidden_states: expected shape \[B, L, hidden_dim=10\]"):
        module.forward(h[:, :, None, :], memory_embeddings=emb)
    with pytest.raises(ConfigError, match="min_n, max_n"):
        EngramModuleConfig(min_n=4, max_n=3)
    # min_n > 2 hashes only the higher orders.
    high = EngramModule(EngramModuleConfig(vocab_size=500, min_n=3, max_n=4, num_hash_heads=2,
                                           embedding_table_size=70, embedding_dim=4, hidden_dim=10))
    assert high.engram.get_num_heads() == 4
    assert high.engram.hash_input_ids([[1, 2, 3]]).shape == (1, 3, 4)


def test_forward_casts_other_float_dtypes_to_float32():
    # Mooncake's forward takes float64 hidden states (a forcecast); here they are cast once on entry.
    engram = make_engram()
    rng = np.random.default_rng(7)
    emb = rng.standard_normal((2, 5, engram.get_num_heads(), engram.get_embedding_dim()), dtype=np.float32)
    h64 = rng.standard_normal((2, 5, 3, 12))
    out = engram.forward(h64, embeddings=emb)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, engram.forward(h64.astype(np.float32), embeddings=emb))
    assert engram.forward(h64.astype(np.float16), embeddings=emb).dtype == np.float32
