"""Mooncake's first Engram module API, ported case by case from its test scripts.

``Engram(layer_id, config, backbone_cfg, store)`` with ``EngramConfig``/``BackboneConfig`` filled in attribute by
attribute, as Mooncake's ``scripts/test_engram.py`` does in its forward era (``forward``,
``populate_store_from_buffers``) and its query era (``hash_input_ids``, ``query``, workspace sizes,
``remove_from_store``); plus the cases of its later table-only era that apply to ``Engram``. Each test names the
Mooncake case it ports. The store is the embedded one (``DistributedStore.embedded()``), and one test runs a
whole Mooncake user script in a subprocess with only its imports changed.

On purpose, two things differ from Mooncake: tables are sized from ``get_table_vocab_sizes()`` (the prime per
head), where Mooncake's forward-era helper sized them from ``engram_vocab_size`` and its lookups then read zeros
for the missing rows; and populating a layer whose tables exist raises ``ObjectExists`` instead of keeping the
old tables, so the ports that repopulate a layer remove its tables first.
"""

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import engram_model
import engram_model.demo._config
from engram_model import BackboneConfig, Engram, EngramConfig
from engram_store import EngramError, InvalidArgument, InvalidType, NotConnected, ObjectExists

pytestmark = pytest.mark.timeout(180)


# ---- helpers, as in Mooncake's EngramTestBase ----------------------------------------------------------

def create_default_configs():
    """Mooncake's ``create_default_configs``: built empty, then set field by field."""
    cfg = EngramConfig()
    cfg.tokenizer_name_or_path = ""
    cfg.engram_vocab_size = [1000, 1000]
    cfg.max_ngram_size = 3
    cfg.n_embed_per_ngram = 64
    cfg.n_head_per_ngram = 4
    cfg.layer_ids = [1, 15]
    cfg.pad_id = 2
    cfg.seed = 0
    cfg.kernel_size = 4

    bb = BackboneConfig()
    bb.hidden_size = 256
    bb.hc_mult = 4
    bb.vocab_size = 128000
    bb.num_layers = 6
    return cfg, bb


def populate_store(engram, seed=0):
    """Mooncake's forward-era ``populate_store``, with each table sized from get_table_vocab_sizes()."""
    rng = np.random.default_rng(seed)
    embed_D = engram.get_embedding_dim()
    embedding_buffers = [rng.standard_normal((n, embed_D)).astype(np.float32) for n in engram.get_table_vocab_sizes()]
    engram.populate_store_from_buffers(embedding_buffers)
    return embedding_buffers


def make_embedding_tables(engram):
    """Mooncake's query-era ``make_embedding_tables``: row r of head h holds r * D + h .. r * D + D - 1 + h."""
    embed_dim = engram.get_embedding_dim()
    return [np.arange(n * embed_dim, dtype=np.float32).reshape(n, embed_dim) + h
            for h, n in enumerate(engram.get_table_vocab_sizes())]


def ramp_ids(B, L, vocab_size):
    return [[i % vocab_size for i in range(L)] for _ in range(B)]


@pytest.fixture
def store(embedded):
    return embedded


@pytest.fixture
def engram(store):
    """Mooncake's ``create_engram``: the default configs, layer 1, on the store; its tables removed afterwards."""
    cfg, bb = create_default_configs()
    layer = Engram(layer_id=1, config=cfg, backbone_cfg=bb, store=store)
    yield layer
    layer.remove_from_store(force=True)
    layer.close()


def assert_finite(output):
    assert not np.any(np.isnan(output))
    assert not np.any(np.isinf(output))


# ---- forward era: TestEngramCreation, TestPopulateStore --------------------------------------------------

def test_creation_config_and_creation(store):
    """TestEngramCreation.test_01_config_and_creation (tokenizer_name_or_path left at its default)."""
    cfg = EngramConfig()
    cfg.engram_vocab_size = [1000, 1000]
    cfg.max_ngram_size = 3
    cfg.n_embed_per_ngram = 64
    cfg.n_head_per_ngram = 4
    cfg.layer_ids = [1, 15]
    cfg.pad_id = 2
    cfg.seed = 0
    cfg.kernel_size = 4
    bb = BackboneConfig()
    bb.hidden_size = 256
    bb.hc_mult = 4
    bb.vocab_size = 128000
    bb.num_layers = 6
    engram = Engram(layer_id=1, config=cfg, backbone_cfg=bb, store=store)
    # A head per hash of each N-gram order (2 and 3), each table a prime above the order's vocab size, distinct.
    sizes = engram.get_table_vocab_sizes()
    assert len(sizes) == (cfg.max_ngram_size - 1) * cfg.n_head_per_ngram == 8
    assert len(set(sizes)) == 8 and all(n > 1000 and all(n % p for p in range(2, int(n ** 0.5) + 1)) for n in sizes)


def test_creation_different_configs(store, caplog, monkeypatch):
    """TestEngramCreation.test_02_different_configs: the small config lists two sizes for max_ngram_size = 2."""
    monkeypatch.setattr(engram_model.demo._config, "_warned_extra_sizes", set())
    cfg1 = EngramConfig()
    cfg1.engram_vocab_size = [100, 100]
    cfg1.max_ngram_size = 2
    cfg1.n_embed_per_ngram = 32
    cfg1.n_head_per_ngram = 2
    cfg1.layer_ids = [1]
    cfg1.pad_id = 0
    cfg1.seed = 0
    cfg1.kernel_size = 3
    bb1 = BackboneConfig()
    bb1.hidden_size = 128
    bb1.hc_mult = 2
    bb1.vocab_size = 10000
    bb1.num_layers = 4
    with caplog.at_level(logging.WARNING, logger="engram_model.demo._config"):
        engram1 = Engram(layer_id=1, config=cfg1, backbone_cfg=bb1, store=store)
        again = Engram(layer_id=1, config=cfg1, backbone_cfg=bb1, store=store)
    assert len(engram1.get_table_vocab_sizes()) == cfg1.n_head_per_ngram  # one order (2): two heads
    warnings = [r.getMessage() for r in caplog.records if "engram_vocab_size" in r.getMessage()]
    assert len(warnings) == 1 and "ignored" in warnings[0] and "[100]" in warnings[0]  # logged once
    # The extra entry changes nothing: the layer is the one built from a single size.
    exact = Engram(1, EngramConfig(engram_vocab_size=[100], max_ngram_size=2, n_embed_per_ngram=32,
                                   n_head_per_ngram=2, layer_ids=[1], pad_id=0, kernel_size=3), bb1)
    assert engram1.get_table_vocab_sizes() == again.get_table_vocab_sizes() == exact.get_table_vocab_sizes()
    ids = np.random.default_rng(0).integers(0, 10000, size=(2, 9))
    np.testing.assert_array_equal(engram1.hash_input_ids(ids), exact.hash_input_ids(ids))
    assert cfg1.engram_vocab_size == [100, 100]  # the caller's config is left as written

    cfg2 = EngramConfig()
    cfg2.engram_vocab_size = [5000, 5000]
    cfg2.max_ngram_size = 3
    cfg2.n_embed_per_ngram = 256
    cfg2.n_head_per_ngram = 16
    cfg2.layer_ids = [1, 5]
    cfg2.pad_id = 0
    cfg2.seed = 42
    cfg2.kernel_size = 5
    bb2 = BackboneConfig()
    bb2.hidden_size = 1024
    bb2.hc_mult = 16
    bb2.vocab_size = 200000
    bb2.num_layers = 32
    engram2 = Engram(layer_id=1, config=cfg2, backbone_cfg=bb2, store=store)
    assert engram2 is not None and engram2.get_num_heads() == 32 and engram2.get_embedding_dim() == 16


def test_too_few_engram_vocab_size_entries_name_the_field():
    cfg, bb = create_default_configs()
    cfg.max_ngram_size = 4
    with pytest.raises(InvalidArgument, match=r"engram_vocab_size: expected one base size per n-gram order 2\.\.4, "
                                              r"i\.e\. at least max_ngram_size - 1 = 3 entries, got 2"):
        Engram(layer_id=1, config=cfg, backbone_cfg=bb)


def test_populate_basic(engram):
    """TestPopulateStore.test_01_populate_basic."""
    cfg = engram.config
    embedding_buffers = populate_store(engram)
    assert len(embedding_buffers) == (cfg.max_ngram_size - 1) * cfg.n_head_per_ngram


def test_populate_large_tables(store):
    """TestPopulateStore.test_02_populate_large_tables."""
    cfg, bb = create_default_configs()
    cfg.engram_vocab_size = [10000, 10000]
    engram = Engram(layer_id=1, config=cfg, backbone_cfg=bb, store=store)
    embedding_buffers = populate_store(engram)
    for buf in embedding_buffers:
        assert buf.size > 0
        assert buf.dtype == np.float32
    assert min(engram.get_table_vocab_sizes()) > 10000
    engram.remove_from_store()


def test_populate_with_and_without_buffer_sizes(store):
    """Both documented forms: populate_store_from_buffers(buffers) and (buffers, buffer_sizes)."""
    cfg, bb = create_default_configs()
    engram = Engram(layer_id=1, config=cfg, backbone_cfg=bb, store=store)
    tables = make_embedding_tables(engram)
    engram.populate_store_from_buffers(tables, [t.nbytes for t in tables])
    assert engram.remove_from_store() == engram.get_num_heads()
    engram.populate_store_from_buffers(tables)
    assert engram.remove_from_store() == engram.get_num_heads()


def test_populate_casts_float64_tables(engram):
    """Mooncake forcecasts tables to float32: float64 tables (np.random.randn) upload as float32 rows."""
    tables = [np.random.default_rng(h).standard_normal((n, engram.get_embedding_dim()))
              for h, n in enumerate(engram.get_table_vocab_sizes())]
    assert tables[0].dtype == np.float64
    engram.populate_store_from_buffers(tables, [t.nbytes for t in tables])
    input_ids = [[5, 6, 7, 8, 9]]
    rows, hashed = engram.query(input_ids), engram.hash_input_ids(input_ids)
    assert rows.dtype == np.float32
    for h, table in enumerate(tables):
        np.testing.assert_array_equal(rows[0, :, h], table[hashed[0, :, h]].astype(np.float32))


def test_tables_sized_from_engram_vocab_size_are_refused(engram):
    """Mooncake's forward-era helper sized each table from engram_vocab_size (1000 rows where head 0 needs
    1009); Mooncake accepted that and read zeros for rows 1000..1008. Here it is refused, naming the fix."""
    cfg = engram.config
    D = engram.get_embedding_dim()
    short = [np.random.randn(cfg.engram_vocab_size[h // cfg.n_head_per_ngram], D).astype(np.float32)
             for h in range(engram.get_num_heads())]
    with pytest.raises(InvalidArgument, match=r"embedding_buffers\[0\]: expected shape \(1009, 16\) = "
                                              r"\(get_table_vocab_sizes\(\)\[0\], D_head\), got \(1000, 16\); "
                                              r"size each head's table from get_table_vocab_sizes\(\)"):
        engram.populate_store_from_buffers(short)
    assert engram.remove_from_store() == 0  # nothing was written


# ---- forward era: TestForwardBasic, TestForwardEdgeCases -----------------------------------------------

@pytest.mark.parametrize("B, L", [(2, 8), (8, 32), (16, 128)], ids=["small", "medium", "large"])
def test_forward_basic(engram, B, L):
    """TestForwardBasic.test_01_forward_small, test_02_forward_medium, test_03_forward_large."""
    bb = engram.backbone_cfg
    populate_store(engram)
    hidden_states = np.random.randn(B, L, bb.hc_mult, bb.hidden_size).astype(np.float32)
    input_ids = ramp_ids(B, L, bb.vocab_size)
    output = engram.forward(hidden_states, input_ids)
    assert output.shape == hidden_states.shape
    assert_finite(output)


def test_forward_single_token(engram):
    """TestForwardEdgeCases.test_01_forward_single_token."""
    bb = engram.backbone_cfg
    populate_store(engram)
    hidden_states = np.random.randn(4, 1, bb.hc_mult, bb.hidden_size).astype(np.float32)
    output = engram.forward(hidden_states, [[0], [1], [2], [3]])
    assert output.shape == hidden_states.shape
    assert not np.any(np.isnan(output))


def test_forward_padding(store):
    """TestForwardEdgeCases.test_02_forward_padding: pad_id 0, padded tail."""
    cfg, bb = create_default_configs()
    cfg.pad_id = 0
    engram = Engram(layer_id=1, config=cfg, backbone_cfg=bb, store=store)
    populate_store(engram)
    hidden_states = np.random.randn(2, 8, bb.hc_mult, bb.hidden_size).astype(np.float32)
    input_ids = [[1, 2, 3, 4, 0, 0, 0, 0], [5, 6, 7, 8, 9, 10, 11, 12]]
    output = engram.forward(hidden_states, input_ids)
    assert output.shape == hidden_states.shape
    assert not np.any(np.isnan(output))
    engram.remove_from_store()


def test_forward_large_vocab_ids(engram):
    """TestForwardEdgeCases.test_03_forward_large_vocab_ids: ids just below vocab_size."""
    bb = engram.backbone_cfg
    populate_store(engram)
    hidden_states = np.random.randn(2, 8, bb.hc_mult, bb.hidden_size).astype(np.float32)
    input_ids = [[bb.vocab_size - 1 - i for i in range(8)] for _ in range(2)]
    output = engram.forward(hidden_states, input_ids)
    assert output.shape == hidden_states.shape
    assert not np.any(np.isnan(output))


def test_forward_accepts_float64_hidden_states(engram):
    """Mooncake forcecasts hidden states to float32; np.random.randn without a cast works and gives float32."""
    bb = engram.backbone_cfg
    populate_store(engram)
    hidden_states = np.random.randn(2, 8, bb.hc_mult, bb.hidden_size)
    input_ids = ramp_ids(2, 8, bb.vocab_size)
    output = engram.forward(hidden_states, input_ids)
    assert output.dtype == np.float32 and output.shape == hidden_states.shape
    np.testing.assert_array_equal(output, engram.forward(hidden_states.astype(np.float32), input_ids))


# ---- forward era: TestMemoryLayout, TestNumericalStability ---------------------------------------------

def test_memory_layout_hc_groups(engram):
    """TestMemoryLayout.test_01_memory_layout_hc_groups: streams with different hidden states differ."""
    bb = engram.backbone_cfg
    populate_store(engram)
    B, L = 2, 8
    hidden_states = np.zeros((B, L, bb.hc_mult, bb.hidden_size), dtype=np.float32)
    for hc in range(bb.hc_mult):
        hidden_states[:, :, hc, :] = float(hc + 1)
    output = engram.forward(hidden_states, ramp_ids(B, L, bb.vocab_size))
    assert not np.allclose(output[:, :, 0, :], output[:, :, 1, :]), "hc=0 and hc=1 outputs are identical"


def test_memory_layout_shape_consistency(engram):
    """TestMemoryLayout.test_02_memory_layout_shape_consistency."""
    bb = engram.backbone_cfg
    populate_store(engram)
    for B, L in [(1, 1), (1, 8), (2, 8), (4, 16), (8, 32), (16, 64)]:
        hidden_states = np.random.randn(B, L, bb.hc_mult, bb.hidden_size).astype(np.float32)
        output = engram.forward(hidden_states, ramp_ids(B, L, bb.vocab_size))
        assert output.shape == hidden_states.shape, f"Shape mismatch for B={B}, L={L}"


def test_numerical_stability_no_nan_inf(engram):
    """TestNumericalStability.test_01_no_nan_inf."""
    bb = engram.backbone_cfg
    populate_store(engram)
    hidden_states = np.random.randn(8, 32, bb.hc_mult, bb.hidden_size).astype(np.float32)
    assert_finite(engram.forward(hidden_states, ramp_ids(8, 32, bb.vocab_size)))


@pytest.mark.parametrize("value", [1e6, 1e-6, 0.0])
def test_numerical_stability_extreme_values(engram, value):
    """TestNumericalStability.test_02_extreme_values: hidden states of 1e6, 1e-6 and 0."""
    bb = engram.backbone_cfg
    populate_store(engram)
    hidden_states = np.full((2, 8, bb.hc_mult, bb.hidden_size), value, dtype=np.float32)
    assert_finite(engram.forward(hidden_states, ramp_ids(2, 8, bb.vocab_size)))


# ---- forward era: TestErrorHandling, TestDifferentConfigs ----------------------------------------------

def test_error_wrong_hidden_states_shape(engram):
    """TestErrorHandling.test_01_wrong_hidden_states_shape: 3-D hidden states."""
    bb = engram.backbone_cfg
    populate_store(engram)
    hidden_states_3d = np.random.randn(2, 8, bb.hc_mult * bb.hidden_size).astype(np.float32)
    with pytest.raises(InvalidArgument, match=r"hidden_states: expected shape \[B, L, hc_mult=4, hidden_size=256\]"):
        engram.forward(hidden_states_3d, ramp_ids(2, 8, bb.vocab_size))


def test_error_empty_embedding_buffers(engram):
    """TestErrorHandling.test_02_empty_embedding_buffers."""
    with pytest.raises(InvalidArgument, match=r"embedding_buffers: expected 8 tables .*, got 0"):
        engram.populate_store_from_buffers([])


def test_different_hc_mult(store):
    """TestDifferentConfigs.test_01_different_hc_mult. Mooncake repopulated the same layer on every pass and
    kept the first tables; populate is create-only here, so each pass removes its tables when done."""
    cfg, bb = create_default_configs()
    for hc_mult in [1, 2, 4, 8]:
        bb.hc_mult = hc_mult
        engram = Engram(layer_id=1, config=cfg, backbone_cfg=bb, store=store)
        populate_store(engram)
        hidden_states = np.random.randn(2, 8, hc_mult, bb.hidden_size).astype(np.float32)
        output = engram.forward(hidden_states, ramp_ids(2, 8, bb.vocab_size))
        assert output.shape == (2, 8, hc_mult, bb.hidden_size)
        assert not np.any(np.isnan(output))
        with pytest.raises(ObjectExists, match="call remove_from_store"):
            populate_store(engram)
        engram.remove_from_store()


def test_different_hidden_size(store):
    """TestDifferentConfigs.test_02_different_hidden_size (each pass removes its tables, as above)."""
    cfg, bb = create_default_configs()
    for hidden_size in [128, 256, 512]:
        bb.hidden_size = hidden_size
        engram = Engram(layer_id=1, config=cfg, backbone_cfg=bb, store=store)
        populate_store(engram)
        hidden_states = np.random.randn(2, 8, bb.hc_mult, hidden_size).astype(np.float32)
        output = engram.forward(hidden_states, ramp_ids(2, 8, bb.vocab_size))
        assert output.shape == (2, 8, bb.hc_mult, hidden_size)
        assert not np.any(np.isnan(output))
        engram.remove_from_store()


# ---- query era: TestEngramMetadata, TestStorePopulateAndQuery, TestErrorHandling ------------------------

def test_creation_and_metadata(engram):
    """TestEngramMetadata.test_creation_and_metadata."""
    cfg = engram.config
    num_heads = (cfg.max_ngram_size - 1) * cfg.n_head_per_ngram
    assert engram.get_num_heads() == num_heads
    assert engram.get_embedding_dim() == cfg.n_embed_per_ngram // cfg.n_head_per_ngram
    assert len(engram.get_store_keys()) == num_heads


def test_table_vocab_sizes_use_per_head_primes(engram):
    """TestEngramMetadata.test_table_vocab_sizes_use_per_head_primes."""
    cfg = engram.config
    table_vocab_sizes = engram.get_table_vocab_sizes()
    assert len(table_vocab_sizes) == (cfg.max_ngram_size - 1) * cfg.n_head_per_ngram
    assert all(v >= 1000 for v in table_vocab_sizes)
    assert max(table_vocab_sizes) > max(cfg.engram_vocab_size)
    assert len(set(table_vocab_sizes)) == len(table_vocab_sizes)


def test_populate_and_query_shape(engram):
    """TestStorePopulateAndQuery.test_populate_and_query_shape."""
    engram.populate_store_from_buffers(make_embedding_tables(engram))
    input_ids = [[1, 2, 3, 4], [4, 3, 2, 1]]
    output = engram.query(input_ids)
    assert output.shape == (len(input_ids), len(input_ids[0]), engram.get_num_heads(), engram.get_embedding_dim())
    assert output.dtype == np.float32
    assert_finite(output)


def test_hash_and_query_are_consistent(engram):
    """TestStorePopulateAndQuery.test_hash_and_query_are_consistent."""
    tables = make_embedding_tables(engram)
    engram.populate_store_from_buffers(tables)
    input_ids = [[10, 11, 12, 13]]
    hash_ids = engram.hash_input_ids(input_ids)
    output = engram.query(input_ids)
    assert hash_ids.shape == (1, 4, engram.get_num_heads()) and hash_ids.dtype == np.int64
    assert output.shape == (1, 4, engram.get_num_heads(), engram.get_embedding_dim())
    for pos in range(hash_ids.shape[1]):
        for head in range(hash_ids.shape[2]):
            np.testing.assert_allclose(output[0, pos, head], tables[head][hash_ids[0, pos, head]])


def test_query_with_workspace(engram):
    """TestStorePopulateAndQuery.test_query_with_workspace, and what this implementation does with it."""
    engram.populate_store_from_buffers(make_embedding_tables(engram))
    input_ids = [[1, 2, 3, 4]]
    ws_bytes = engram.get_query_workspace_size(len(input_ids), len(input_ids[0]))
    workspace = np.empty(ws_bytes, dtype=np.uint8)
    output = engram.query(input_ids, workspace)
    assert output.shape == (1, 4, engram.get_num_heads(), engram.get_embedding_dim())
    # Scratch, never the output: the result is a new array; here the workspace is not even written.
    workspace[:] = 7
    np.testing.assert_array_equal(engram.query(input_ids, workspace=workspace), output)
    assert np.all(workspace == 7)
    np.testing.assert_array_equal(engram.query(input_ids, np.empty(3, np.uint8)), output)  # too small: ignored
    with pytest.raises(InvalidType, match=r"workspace: expected a NumPy array .* got bytearray"):
        engram.query(input_ids, bytearray(ws_bytes))
    with pytest.raises(InvalidType, match=r"workspace: expected a NumPy array .* got list"):
        engram.query(input_ids, [0] * 16)


def test_workspace_sizes(engram):
    """get_query_workspace_size(B, L) = sum_h min(N_h, max(1, B * L)) * D * 4 bytes; the tables' footprint."""
    sizes, D = engram.get_table_vocab_sizes(), engram.get_embedding_dim()
    H = engram.get_num_heads()
    assert engram.get_query_workspace_size(1, 4) == H * 4 * D * 4
    assert engram.get_query_workspace_size(B=2, L=8) == H * 16 * D * 4
    assert engram.get_query_workspace_size(0, 0) == H * 1 * D * 4
    assert engram.get_query_workspace_size(100, 100) == sum(min(n, 10000) for n in sizes) * D * 4
    assert engram.get_query_workspace_size(1000, 1000) == engram.get_embedding_tables_workspace_size()
    assert engram.get_embedding_tables_workspace_size() == sum(sizes) * D * 4
    with pytest.raises(InvalidArgument, match="L: expected a non-negative integer, got -1"):
        engram.get_query_workspace_size(1, -1)


def test_remove_from_store(engram, store):
    """TestStorePopulateAndQuery.test_remove_from_store."""
    engram.populate_store_from_buffers(make_embedding_tables(engram))
    removed = engram.remove_from_store(force=True)
    assert removed == engram.get_num_heads()
    for key in engram.get_store_keys():
        assert store.is_exist(key) == 0
    assert engram.remove_from_store(force=True) == 0


def test_populate_rejects_wrong_table_shape(engram):
    """TestErrorHandling.test_populate_rejects_wrong_table_shape: head 0 one row short."""
    tables = make_embedding_tables(engram)
    tables[0] = tables[0][:-1]
    with pytest.raises(InvalidArgument, match=r"embedding_buffers\[0\]: expected shape"):
        engram.populate_store_from_buffers(tables)


@pytest.mark.parametrize("empty", [[], [[]], np.zeros((2, 0), np.int64)], ids=["[]", "[[]]", "B=2,L=0"])
def test_query_rejects_empty_input(engram, empty):
    """TestErrorHandling.test_query_rejects_empty_input."""
    engram.populate_store_from_buffers(make_embedding_tables(engram))
    with pytest.raises(InvalidArgument, match=r"input_ids: expected a non-empty \[B, L\]"):
        engram.query(empty)


def test_hash_input_ids_of_empty_input_is_empty(engram):
    """Mooncake's hash_input_ids([]) returns an empty array; here it keeps the head axis: (0, 0, H)."""
    H = engram.get_num_heads()
    for empty, shape in [([], (0, 0, H)), ([[]], (1, 0, H)), (np.zeros((3, 0), np.int64), (3, 0, H))]:
        hashed = engram.hash_input_ids(empty)
        assert hashed.shape == shape and hashed.dtype == np.int64


# ---- table-only era, where it applies to Engram ---------------------------------------------------------

def test_creation_without_store_keeps_metadata_accessible():
    """test_creation_without_store_keeps_metadata_accessible: store=None keeps hashing and the getters."""
    cfg, bb = create_default_configs()
    engram = Engram(layer_id=1, config=cfg, backbone_cfg=bb, store=None)
    assert engram.get_num_heads() == 8 and engram.get_embedding_dim() == 16
    assert len(engram.get_table_vocab_sizes()) == 8
    assert engram.get_store_keys()[0] == "engram:l1:h0"
    assert engram.hash_input_ids([[1, 2, 3]]).shape == (1, 3, 8)
    assert engram.get_query_workspace_size(1, 3) > 0
    with pytest.raises(NotConnected):
        engram.query([[1, 2, 3]])
    with pytest.raises(NotConnected):
        engram.populate_store_from_buffers(make_embedding_tables(engram))
    with pytest.raises(NotConnected):
        engram.forward(np.zeros((1, 3, 4, 256), np.float32), [[1, 2, 3]])


def test_query_list_and_numpy_paths_match(engram):
    """test_lookup_list_and_numpy_paths_match: list ids and integer arrays give the same rows."""
    engram.populate_store_from_buffers(make_embedding_tables(engram))
    ids = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]]
    from_list = engram.query(ids)
    np.testing.assert_array_equal(from_list, engram.query(np.asarray(ids, dtype=np.int64)))
    np.testing.assert_array_equal(from_list, engram.query(np.asarray(ids, dtype=np.int32)))


def test_query_rejects_missing_tables(engram):
    """test_lookup_rejects_missing_tables: a query before populate raises instead of returning zeros."""
    with pytest.raises(EngramError):
        engram.query([[1, 2, 3, 4]])


def test_populate_rejects_reusing_existing_layer_keys(engram):
    """test_populate_rejects_reusing_existing_layer_keys: populate is create-only."""
    tables = make_embedding_tables(engram)
    engram.populate_store_from_buffers(tables)
    with pytest.raises(ObjectExists, match=r"key 'engram:l1:h0' already exists"):
        engram.populate_store_from_buffers(tables)


def test_row_ids_with_wrong_head_dimension_or_out_of_range_are_refused(engram):
    """test_lookup_rejects_wrong_head_dimension and test_lookup_rejects_out_of_range_row_id, for rows the caller
    hashed itself (forward(row_ids=)): ids are checked, never clamped (Mooncake's query era clamped them)."""
    engram.populate_store_from_buffers(make_embedding_tables(engram))
    bb = engram.backbone_cfg
    hidden_states = np.zeros((1, 1, bb.hc_mult, bb.hidden_size), np.float32)
    with pytest.raises(InvalidArgument, match="expected H = 8 heads"):
        engram.forward(hidden_states, row_ids=np.zeros((1, 1, 7), np.int64))
    bad = np.zeros((1, 1, 8), np.int64)
    bad[0, 0, 3] = 999999
    with pytest.raises(InvalidArgument, match=r"row_ids\[0, 0, 3\] = 999999 is out of range"):
        engram.forward(hidden_states, row_ids=bad)


# ---- a whole Mooncake user script, only its imports changed ---------------------------------------------

USER_SCRIPT = """
import numpy as np

# Was: from mooncake.mooncake_config import MooncakeConfig
#      from mooncake.store import MooncakeDistributedStore, Engram, EngramConfig, BackboneConfig
from engram_model import Engram, EngramConfig, BackboneConfig
from engram_store.compat import MooncakeConfig, MooncakeDistributedStore

config = MooncakeConfig.load_from_env()
store = MooncakeDistributedStore()
rc = store.setup(
    config.local_hostname,
    config.metadata_server,
    config.global_segment_size,
    config.local_buffer_size,
    config.protocol,
    config.device_name,
    config.master_server_address,
)
if rc != 0:
    raise RuntimeError(f"Failed to setup mooncake store, error code: {rc}")
store.remove_all()

cfg = EngramConfig()
cfg.tokenizer_name_or_path = ""
cfg.engram_vocab_size = [1000, 1000]
cfg.max_ngram_size = 3
cfg.n_embed_per_ngram = 64
cfg.n_head_per_ngram = 4
cfg.layer_ids = [1, 15]
cfg.pad_id = 2
cfg.seed = 0
cfg.kernel_size = 4

bb = BackboneConfig()
bb.hidden_size = 256
bb.hc_mult = 4
bb.vocab_size = 128000
bb.num_layers = 6

engram = Engram(layer_id=1, config=cfg, backbone_cfg=bb, store=store)
num_heads = engram.get_num_heads()
embed_D = engram.get_embedding_dim()
print("heads", num_heads, "D", embed_D, "rows", engram.get_table_vocab_sizes())

embedding_buffers = [np.random.randn(n, embed_D).astype(np.float32) for n in engram.get_table_vocab_sizes()]
buffer_sizes = [t.nbytes for t in embedding_buffers]
engram.populate_store_from_buffers(embedding_buffers, buffer_sizes)

B, L = 2, 8
hidden_states = np.random.randn(B, L, bb.hc_mult, bb.hidden_size).astype(np.float32)
input_ids = [[i % bb.vocab_size for i in range(L)] for _ in range(B)]
output = engram.forward(hidden_states, input_ids)
assert output.shape == hidden_states.shape
assert not np.any(np.isnan(output)) and not np.any(np.isinf(output))

hash_ids = engram.hash_input_ids(input_ids)
assert hash_ids.shape == (B, L, num_heads)
workspace = np.empty(engram.get_query_workspace_size(B, L), dtype=np.uint8)
rows = engram.query(input_ids, workspace)
assert rows.shape == (B, L, num_heads, embed_D) and rows.dtype == np.float32
for b in range(B):
    for l in range(L):
        for h in range(num_heads):
            np.testing.assert_allclose(rows[b, l, h], embedding_buffers[h][hash_ids[b, l, h]])

removed = engram.remove_from_store(force=True)
assert removed == num_heads, removed
for key in engram.get_store_keys():
    assert store.is_exist(key) == 0
assert engram.remove_from_store(force=True) == 0

del engram
store.close()
print("output", output.shape, "query", rows.shape, "removed", removed)
"""


def test_mooncake_user_script_runs_with_changed_imports(tmp_path):
    script = tmp_path / "mooncake_engram_quickstart.py"
    script.write_text(textwrap.dedent(USER_SCRIPT))
    # The store comes from the environment, as MooncakeConfig.load_from_env() reads it: no master given means
    # an embedded one; the segment is kept small for the test.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGRAM_", "MOONCAKE_"))}
    env["MOONCAKE_GLOBAL_SEGMENT_SIZE"] = "64MiB"
    root = str(Path(engram_model.__file__).resolve().parent.parent)  # this checkout, not an installed copy
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=150)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "heads 8 D 16 rows [1009, 1013, 1019, 1021" in result.stdout
    assert "output (2, 8, 4, 256) query (2, 8, 8, 16) removed 8" in result.stdout
