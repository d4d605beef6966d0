"""PLELayer's forward: against a float64 transcription of transformers' ``Qwen4ExpTextPLELayer.forward`` (always),
against transformers' own layer in bf16 and float32 where it is installed (whole sequences, and chunks through its
cache), chunked and ragged steps against whole sequences, rows read from a table, refusals."""
from __future__ import annotations

import numpy as np
import pytest

from engram_model._rows_format import round_bf16 as ref_round
from engram_model.ple import PLEConfig, PLEHasher, PLELayer
from engram_store import EngramStore, InvalidArgument, InvalidType

import model_helpers as ref

CONFIG = PLEConfig(ple_layer_ids=[2], vocab_size=500, eos_token_id=5, ngram_vocab_size_base=40, hidden_size=64,
                   hc_count=4, ple_embed_dim=2560)
BF16_ULP = 2.0 ** -8  # a bf16 value's rounding step, relative to it (at most; 8 significant bits)


def random_weights(config: PLEConfig, rng: np.random.Generator) -> dict:
    C, H, E, K = config.hc_count * config.hidden_size, config.hidden_size, config.ple_embed_dim, \
        config.ple_conv_kernel_size
    bf16 = lambda a: ref_round(a.astype(np.float32))  # noqa: E731 (weights a bf16 model holds)
    return {"key_proj": bf16(rng.standard_normal((C, E)) / np.sqrt(E)),
            "value_proj": bf16(rng.standard_normal((H, E)) / np.sqrt(E)),
            "norm_key": bf16(0.1 * rng.standard_normal(C)), "norm_query": bf16(0.1 * rng.standard_normal(C)),
            "norm_conv": bf16(0.1 * rng.standard_normal(C)), "conv1d": bf16(0.5 * rng.standard_normal((C, K)))}


def inputs(config: PLEConfig, rng: np.random.Generator, B: int, T: int):
    hidden = ref_round(rng.standard_normal((B, T, config.hc_count * config.hidden_size)).astype(np.float32))
    emb = ref_round((0.5 * rng.standard_normal((B, T, config.ple_embed_dim))).astype(np.float32))
    return hidden, emb


def test_float32_equals_the_transcription_and_bf16_is_near_it():
    rng = np.random.default_rng(0)
    w = random_weights(CONFIG, rng)
    hidden, emb = inputs(CONFIG, rng, 3, 30)
    expect, _ = ref.ple_forward({k: v.astype(np.float64) for k, v in w.items()}, hidden.astype(np.float64),
                                emb.astype(np.float64), 4, 64, CONFIG.rms_norm_eps, CONFIG.ngram_size)
    got32 = PLELayer(CONFIG, 2, w, dtype="float32").forward(hidden, emb)
    np.testing.assert_allclose(got32, expect, rtol=1e-4, atol=1e-5)
    got16 = PLELayer(CONFIG, 2, w).forward(hidden, emb)
    assert (got16 == ref_round(got16)).all()                           # bf16 values, held in float32
    assert np.abs(got16 - expect).max() < 0.05 * np.abs(expect).max()  # rounding at every op, nothing more


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_chunks_with_state_and_ragged_steps_equal_whole_sequences(dtype):
    rng = np.random.default_rng(1)
    layer = PLELayer(CONFIG, 2, random_weights(CONFIG, rng), dtype=dtype)
    B, T = 3, 23
    hidden, emb = inputs(CONFIG, rng, B, T)
    whole = layer.forward(hidden, emb)
    tol = dict(rtol=2 * BF16_ULP, atol=1e-3) if dtype == "bfloat16" else dict(rtol=1e-5, atol=1e-6)
    state, parts = layer.begin(B), []
    for lo, hi in [(0, 1), (1, 4), (4, 5), (5, 16), (16, 23)]:   # shorter and longer than the 9 rows of state
        parts.append(layer.forward(hidden[:, lo:hi], emb[:, lo:hi], state))
    np.testing.assert_allclose(np.concatenate(parts, axis=1), whole, **tol)
    # Ragged: the 3 sequences in slots 4, 0, 2 of 5, each step a different number of tokens per request.
    ragged = layer.begin(5)
    slots, done, out = [4, 0, 2], [0, 0, 0], [[], [], []]
    for step in ([3, 0, 1], [1, 5, 1], [10, 1, 1], [9, 17, 20]):
        n = [min(k, T - d) for k, d in zip(step, done)]
        rows = [slice(d, d + k) for d, k in zip(done, n)]
        got = layer.forward_ragged(np.concatenate([hidden[b, r] for b, r in enumerate(rows)]),
                                   np.concatenate([emb[b, r] for b, r in enumerate(rows)]), ragged, slots,
                                   np.concatenate([[0], np.cumsum(n)]))
        for b, (lo, hi) in enumerate(zip(np.concatenate([[0], np.cumsum(n)])[:-1], np.cumsum(n))):
            out[b].append(got[lo:hi])
            done[b] += n[b]
    assert done == [T] * 3
    for b in range(B):
        np.testing.assert_allclose(np.concatenate(out[b]), whole[b], **tol)
    assert not ragged.rows[[1, 3]].any()  # slots no request used stay zero


def test_equals_transformers_own_layer(capsys):
    """transformers' Qwen4ExpTextPLELayer in bf16 (as released) and float32, whole sequences and chunks through its
    cache, fed the same rows: the largest difference is printed (pytest -s)."""
    torch, M, DynamicCache = ref.reference()
    torch.manual_seed(0)
    rng = np.random.default_rng(2)
    hf_config = ref.hf_text_config(CONFIG)
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float32, "float32")):
        module = M.Qwen4ExpTextPLELayer(hf_config, 1, 0)
        w = random_weights(CONFIG, rng)
        with torch.no_grad():
            for part in ("key_proj", "value_proj", "norm_key", "norm_query", "norm_conv"):
                getattr(module, part).weight.copy_(torch.from_numpy(w[part]))
            module.conv1d.weight.copy_(torch.from_numpy(w["conv1d"][:, None, :]))
        module = module.to(dtype)
        B, T = 3, 40
        ids = rng.integers(0, CONFIG.vocab_size, (B, T))
        hidden, _ = inputs(CONFIG, rng, B, T)
        h = torch.from_numpy(hidden).to(dtype)
        with torch.no_grad():
            emb = module.ple_embedding(torch.from_numpy(ids), None).float().numpy()
            whole = module(h, torch.from_numpy(ids), None).float().numpy()
            cache, chunks = DynamicCache(config=hf_config), []
            for lo, hi in [(0, 7), (7, 8), (8, 9), (9, 25), (25, 40)]:
                chunks.append(module(h[:, lo:hi], torch.from_numpy(ids[:, lo:hi]), cache).float().numpy())
        layer = PLELayer(CONFIG, 2, w, dtype=name)
        ours = layer.forward(hidden, emb)
        state = layer.begin(B)
        ours_chunked = np.concatenate([layer.forward(hidden[:, lo:hi], emb[:, lo:hi], state)
                                       for lo, hi in [(0, 7), (7, 8), (8, 9), (9, 25), (25, 40)]], axis=1)
        for got, expect in ((ours, whole), (ours_chunked, np.concatenate(chunks, axis=1))):
            diff = np.abs(got - expect)
            # A bf16 step of each token and stream's largest value: one rounding of an operand (a key summed over
            # 2560 values in another order) moves an output by steps of the operands, not of a small result.
            largest = np.abs(expect).reshape(B, T, 4, -1).max(axis=-1, keepdims=True)
            scale = np.exp2(np.floor(np.log2(np.maximum(largest, 1e-30))) - 7)     # its bf16 step
            steps = (diff.reshape(B, T, 4, -1) / np.maximum(scale, 1e-30)).max()
            with capsys.disabled():
                print(f"\nPLE forward vs transformers, {name}: max |diff| {diff.max():.3g} (max |out| "
                      f"{np.abs(expect).max():.3g}), {(diff > 0).mean():.2%} of values differ, at most {steps:.2f} "
                      "bf16 steps of their token and stream's largest value")
            if name == "bfloat16":  # measured: 0.17% of values differ, by at most 2 steps
                assert steps <= 4.0 and (diff > 0).mean() < 0.01, "beyond bf16 rounding"
            else:
                np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-5)


def test_rows_are_read_from_the_table_and_decoded():
    rng = np.random.default_rng(3)
    layer_cfg = PLEConfig(ple_layer_ids=[2], vocab_size=500, eos_token_id=5, ngram_vocab_size_base=40, hidden_size=8,
                          hc_count=2, ple_embed_dim=2560)
    buffers = layer_cfg.hash_buffers(2)
    tables = [(rng.standard_normal((n, 160)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
              for n in buffers.sizes]
    with EngramStore(2, layer_cfg.row_format.store_config(buffers.sizes), None) as table:
        table.bind_local(tables)
        layer = PLELayer(layer_cfg, 2, random_weights(layer_cfg, rng), table)
        ids = PLEHasher(layer_cfg)(rng.integers(0, 500, (2, 6)))[:, :, 0]      # [2, 6, 16] global rows
        got = layer.rows(ids)
        assert got.shape == (2, 6, 16, 160)
        for h in range(16):
            local = ids[..., h] - buffers.offsets[h]
            np.testing.assert_array_equal(got[..., h, :], (tables[h][local].astype(np.uint32) << 16).view(np.float32))
        with pytest.raises(InvalidArgument, match="out of range"):
            layer.rows(ids + 10 ** 9)


def test_refusals_name_the_argument():
    rng = np.random.default_rng(4)
    w = random_weights(CONFIG, rng)
    layer = PLELayer(CONFIG, 2, w)
    hidden, emb = inputs(CONFIG, rng, 1, 3)
    with pytest.raises(InvalidType, match=r"weights\['conv1d'\]: expected a float NumPy array"):
        PLELayer(CONFIG, 2, {**w, "conv1d": None})
    with pytest.raises(InvalidArgument, match=r"weights\['key_proj'\]: expected shape \[256, 2560\]"):
        PLELayer(CONFIG, 2, {**w, "key_proj": w["key_proj"][:3]})
    with pytest.raises(InvalidArgument, match=r"weights\['norm_key'\]: holds NaN"):
        PLELayer(CONFIG, 2, {**w, "norm_key": np.full(256, np.nan, np.float32)})
    with pytest.raises(InvalidArgument, match="dtype: expected one of"):
        PLELayer(CONFIG, 2, w, dtype="float16")
    with pytest.raises(InvalidArgument, match="layer_id"):
        PLELayer(CONFIG, 3, w)
    with pytest.raises(InvalidArgument, match=r"hidden_states: expected float \[B, T, hc_count \* hidden_size = 256\]"):
        layer.forward(hidden[..., :10], emb)
    with pytest.raises(InvalidArgument, match=r"embeddings: expected float \[1, 3, 2560\] or \[1, 3, 16, 160\]"):
        layer.forward(hidden, emb[:, :2])
    with pytest.raises(InvalidArgument, match=r"state: expected the PLEConvState of begin\(1\)"):
        layer.forward(hidden, emb, layer.begin(2))
    with pytest.raises(InvalidArgument, match="table: this PLELayer has no table"):
        layer.rows(np.zeros((1, 16), np.int64))
    state = layer.begin(3)
    with pytest.raises(InvalidArgument, match=r"slots: expected distinct slots in \[0, 3\)"):
        layer.forward_ragged(hidden[0], emb[0], state, [1, 1], [0, 1, 3])
    with pytest.raises(InvalidArgument, match="query_start_loc: expected R \\+ 1 = 2 non-decreasing offsets"):
        layer.forward_ragged(hidden[0], emb[0], state, [1], [0, 2])
    assert not state.rows.any()  # refused calls moved nothing
