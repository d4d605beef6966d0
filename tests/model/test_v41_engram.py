"""V41Engram: the forward pass against the V4.1 formula written here in NumPy (within one bf16 ulp), the fused
gather+decode against reads over the network, prefetch, the token mask, and refusals."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_model.v41 import (V41Config, V41Engram, V41Hasher, V41Prefetch, decode_fp8_rows, encode_fp8_rows,
                              v41_store_config)
from engram_store import DistributedStore, EngramStore, EngramStoreConfig, InvalidArgument, InvalidType


def bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even), kept as float32."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def reference_forward(h, E, wkv, q, k, eps, mask=None):
    """The V4.1 Engram formula: h [B, L, hc, D], E [B, L, cols, head_dim] decoded rows. Returns the output and how
    far an exact implementation may be from it: one bf16 ulp of the output (its own rounding), plus the term the
    value adds times one bf16 ulp of the value (``kv = bf16(E @ wkv.T)`` rounds a sum whose last bits depend on the
    order it is added in, so a value near a rounding boundary may round either way; with ``h`` and ``g * val``
    of opposite signs that ulp of the value can be several ulps of the output)."""
    B, L, hc, D = h.shape
    kv = bf16(E.reshape(B, L, -1).astype(np.float64) @ wkv.T.astype(np.float64))  # (B, L, (hc + 1) * D)
    key = kv[..., :hc * D].reshape(B, L, hc, D).astype(np.float64)
    val = kv[..., hc * D:].astype(np.float32)
    h64 = h.astype(np.float64)
    w = (q * k).astype(np.float64)
    rstd = 1 / np.sqrt((h64 ** 2).mean(-1) + eps) / np.sqrt((key ** 2).mean(-1) + eps)
    dot = (h64 * w * key).sum(-1) * rstd / np.sqrt(D)
    g = 1 / (1 + np.exp(-np.copysign(np.sqrt(np.maximum(np.abs(dot), 1e-6)), dot)))
    if mask is not None:
        g = np.where(mask[..., None], g, 0.0)
    out = bf16(h + g[..., None].astype(np.float32) * val[:, :, None, :])
    tolerance = bf16_ulp(out) + g[..., None] * bf16_ulp(val)[:, :, None, :]
    return out, tolerance


def bf16_ulp(x: np.ndarray) -> np.ndarray:
    """One bf16 ulp at the magnitude of each element of ``x`` (float64)."""
    return np.ldexp(1.0, np.maximum(np.frexp(np.abs(x).astype(np.float64))[1] - 8, -133))


def within_one_bf16_ulp(got, want):
    mag = np.maximum(np.abs(got), np.abs(want)).astype(np.float64)
    return np.abs(got.astype(np.float64) - want) <= bf16_ulp(mag)


def make_layer(cfg: V41Config, layer_id: int, rng, store=None):
    """Random FP8 tables (one per column), bound in memory or populated into ``store``; random weights."""
    primes = [p for heads in cfg.primes(layer_id) for p in heads]
    tables = [encode_fp8_rows(rng.standard_normal((p, cfg.head_dim)).astype(np.float32)) for p in primes]
    es = EngramStore(layer_id, v41_store_config(cfg, layer_id), store)
    if store is None:
        es.bind_local(tables)
    else:
        es.populate(tables)
    K, hc, D = cfg.cols * cfg.head_dim, cfg.hc_mult, cfg.hidden_size
    wkv = (rng.standard_normal(((hc + 1) * D, K)) / np.sqrt(K)).astype(np.float32)
    q, k = (rng.standard_normal((hc, D)).astype(np.float32) for _ in range(2))
    return tables, es, wkv, q, k


def decoded_rows(cfg, layer_id, tables, rows):
    offsets = cfg.offsets(layer_id)
    return np.stack([decode_fp8_rows(tables[c][rows[..., c] - offsets[c]]) for c in range(cfg.cols)], axis=2)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), shape=st.sampled_from([(2, 1), (3, 2), (4, 2)]),
       head_dim=st.sampled_from([32, 64]), hc=st.integers(1, 4), hidden=st.sampled_from([8, 48, 64]),
       B=st.integers(1, 3), L=st.integers(1, 9), masked=st.booleans(), scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_forward_matches_the_formula(seed, shape, head_dim, hc, hidden, B, L, masked, scale):
    max_n, heads = shape
    rng = np.random.default_rng(seed)
    cfg = V41Config(layer_ids=[3, 7], max_ngram_size=max_n, n_heads=heads, head_dim=head_dim, engram_vocab_size=50,
                    compressed_vocab_size=40, hidden_size=hidden, hc_mult=hc, rms_norm_eps=1e-6)
    token_map = np.concatenate([np.arange(40), rng.integers(0, 40, 20)])
    tables, es, wkv, q, k = make_layer(cfg, 7, rng)
    engram = V41Engram(cfg, 7, wkv, q, k, es, V41Hasher(cfg, token_map))
    ids = rng.integers(0, 60, size=(B, L))
    h = (rng.standard_normal((B, L, hc, hidden)) * scale).astype(np.float32)
    mask = rng.random((B, L)) > 0.3 if masked else None
    out = engram.forward(h, ids, token_mask=mask)
    assert out.shape == h.shape and out.dtype == np.float32
    np.testing.assert_array_equal(out, bf16(out))  # bf16 values
    rows = engram.hasher(ids, mask)[:, :, 1]
    want, tolerance = reference_forward(h, decoded_rows(cfg, 7, tables, rows), wkv, q, k, cfg.rms_norm_eps, mask)
    assert (np.abs(out.astype(np.float64) - want) <= np.maximum(tolerance, bf16_ulp(out))).all()
    assert engram.fused_reads == 1 and engram.staged_reads == 0
    if mask is not None:  # masked positions pass through, rounded
        np.testing.assert_array_equal(out[~mask], bf16(h[~mask]))
    es.close()


@pytest.mark.timeout(120)
def test_store_reads_fused_staged_and_prefetched(embedded):
    cfg = V41Config(layer_ids=[1, 14], n_heads=2, head_dim=64, engram_vocab_size=3000, compressed_vocab_size=200,
                    hidden_size=32, hc_mult=4)
    rng = np.random.default_rng(11)
    token_map = np.concatenate([np.arange(200), rng.integers(0, 200, 56)])
    hasher = V41Hasher(cfg, token_map)
    tables, es, wkv, q, k = make_layer(cfg, 14, rng, embedded)
    ids = rng.integers(0, 256, size=(3, 10))
    h = rng.standard_normal((3, 10, 4, 32)).astype(np.float32)
    all_rows = hasher(ids)
    try:
        local = V41Engram(cfg, 14, wkv, q, k, es, hasher)
        out = local.forward(h, ids)
        assert local.fused_reads == 1  # the segment is mapped in this process: decoded in place
        np.testing.assert_array_equal(local.rows(all_rows), decoded_rows(cfg, 14, tables, all_rows[:, :, 1]))
        with DistributedStore.connect(embedded.master_address, local_direct=False) as remote_client:
            remote = V41Engram(cfg, 14, wkv, q, k, EngramStore(14, v41_store_config(cfg, 14), remote_client))
            np.testing.assert_array_equal(remote.forward(h, row_ids=all_rows), out)
            handle = remote.prefetch(row_ids=all_rows[:, :, 1])
            assert isinstance(handle, V41Prefetch)
            np.testing.assert_array_equal(remote.forward(h, prefetched=handle), out)
            assert remote.fused_reads == 0 and remote.staged_reads == 2
            remote.close()
        handle = local.prefetch(ids)
        np.testing.assert_array_equal(local.forward(h, prefetched=handle), out)
        with pytest.raises(InvalidArgument, match=r"prefetched: rows of layer 14 for \(3, 10\) tokens"):
            local.forward(h[:, :5], prefetched=local.prefetch(ids))
        local.close()
    finally:
        es.remove_from_store()


def test_refusals_name_the_argument():
    cfg = V41Config(layer_ids=[1, 2], n_heads=1, max_ngram_size=2, head_dim=32, engram_vocab_size=100,
                    compressed_vocab_size=10, hidden_size=8, hc_mult=2)
    rng = np.random.default_rng(2)
    tables, es, wkv, q, k = make_layer(cfg, 2, rng)
    with pytest.raises(InvalidArgument, match=r"wkv: expected shape \[24, 32\], got \[24, 31\]"):
        V41Engram(cfg, 2, wkv[:, :31], q, k, es)
    with pytest.raises(InvalidType, match="q_weight: expected a float32 NumPy array"):
        V41Engram(cfg, 2, wkv, q.tolist(), k, es)
    with pytest.raises(InvalidArgument, match="layer_id: expected one of layer_ids"):
        V41Engram(cfg, 5, wkv, q, k, es)
    with pytest.raises(InvalidArgument, match="store: holds layers \\[2\\], not layer 1"):
        V41Engram(cfg, 1, wkv, q, k, es)
    wrong = EngramStore(2, EngramStoreConfig(v41_store_config(cfg, 2).table_vocab_sizes, 33), None)
    with pytest.raises(InvalidArgument, match="row_format='float32', expected 'bytes'"):
        V41Engram(cfg, 2, wkv, q, k, wrong)
    with pytest.raises(InvalidType, match="store: expected an EngramStore"):
        V41Engram(cfg, 2, wkv, q, k, None)
    engram = V41Engram(cfg, 2, wkv, q, k, es)
    h = np.zeros((1, 2, 2, 8), dtype=np.float32)
    with pytest.raises(InvalidArgument, match="this V41Engram has no hasher"):
        engram.forward(h, np.array([[1, 2]]))
    prime = cfg.primes(2)[0][0]
    offset = int(cfg.offsets(2)[0])
    with pytest.raises(InvalidArgument, match=rf"row_ids\[0, 1, 0\] = {offset + prime} is outside column 0"):
        engram.forward(h, row_ids=np.array([[[offset], [offset + prime]]]))
    with pytest.raises(InvalidArgument, match=r"row_ids: expected shape \[B, L, 1\]"):
        engram.forward(h, row_ids=np.zeros((1, 2, 3), dtype=np.int64))
    with pytest.raises(InvalidArgument, match=r"hidden_states: expected shape \[B, L, hc_mult=2, hidden_size=8\]"):
        engram.forward(np.zeros((1, 2, 3, 8), np.float32), row_ids=np.full((1, 2, 1), offset))
    with pytest.raises(InvalidArgument, match=r"token_mask: expected a bool array of shape \(1, 2\)"):
        engram.forward(h, row_ids=np.full((1, 2, 1), offset), token_mask=np.ones((1, 2), np.int8))
    tables[0][5, 32] = 255  # a corrupt scale byte in column 0, row 5
    with pytest.raises(InvalidArgument, match=r"layer 2, column 0, table row 5: holds scale byte 255"):
        engram.forward(h, row_ids=np.full((1, 2, 1), offset + 5))
    es.close()


@pytest.mark.timeout(120)
def test_the_demo_runs(capsys):
    from engram_model.v41 import demo

    assert demo.main(["--batch", "2", "--prompt-len", "8", "--decode-steps", "2", "--segment-size", "64MiB"]) == 0
    out = capsys.readouterr().out
    assert "the masked position passed through unchanged: True" in out
    assert "layer 1: 4 fused, 0 staged" in out  # warm-up, prefill, 2 decode steps: all decoded in place


def test_rows_take_torch_ids():
    torch = pytest.importorskip("torch", reason="torch is an optional extra (pip install -e '.[torch]')")
    cfg = V41Config(layer_ids=[1, 2], n_heads=1, max_ngram_size=2, head_dim=32, engram_vocab_size=100,
                    compressed_vocab_size=10, hidden_size=8, hc_mult=2)
    tables, es, wkv, q, k = make_layer(cfg, 2, np.random.default_rng(3))
    engram = V41Engram(cfg, 2, wkv, q, k, es)
    ids = np.full((1, 3, 1), int(cfg.offsets(2)[0]) + 4)
    np.testing.assert_array_equal(engram.rows(torch.from_numpy(ids.astype(np.int32))), engram.rows(ids))
    es.close()
