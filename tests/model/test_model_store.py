"""Engram with its tables in the store: populate, lookup, forward, prefetch, checkpoints, the demo."""

import numpy as np
import pytest

from engram_model import (BackboneConfig, CompressedTokenizer, Engram, EngramConfig, EngramModule,
                          EngramModuleConfig, prefetch_layers)
from engram_model.demo import demo
from engram_model.demo.demo import quick_start_configs as demo_quick_start_configs
from engram_store import InvalidArgument, InvalidType, ObjectExists
from suite_helpers import read_ranges_served

pytestmark = pytest.mark.timeout(120)


def quick_start_configs():
    return demo_quick_start_configs(num_layers=20)


def tables_for(engram, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, engram.get_embedding_dim()), dtype=np.float32)
            for n in engram.get_table_vocab_sizes()]


@pytest.fixture
def layer(embedded):
    cfg, bb = quick_start_configs()
    engram = Engram(layer_id=1, config=cfg, backbone_cfg=bb, store=embedded)
    tables = tables_for(engram)
    engram.populate_store_from_buffers(tables, [t.nbytes for t in tables])
    yield engram, tables
    engram.remove_from_store(force=True)
    engram.close()


def gather(tables, rows):
    return np.stack([tables[h][rows[..., h]] for h in range(len(tables))], axis=2)  # (B, L, H, D)


def test_query_and_forward_through_store(layer):
    engram, tables = layer
    rng = np.random.default_rng(1)
    input_ids = rng.integers(0, 128000, size=(2, 8))
    rows = engram.hash_input_ids(input_ids)
    emb = engram.query_embeddings(input_ids.tolist())
    assert emb.shape == (2, 8, 8, 16) and emb.dtype == np.float32
    np.testing.assert_array_equal(emb, gather(tables, rows))
    hidden = rng.standard_normal((2, 8, 4, 256), dtype=np.float32)
    out = engram.forward(hidden, input_ids)
    assert out.shape == (2, 8, 4, 256)
    np.testing.assert_array_equal(out, engram.forward(hidden, embeddings=gather(tables, rows)))


def test_prefetched_and_direct_forward_identical(layer):
    engram, _ = layer
    rng = np.random.default_rng(2)
    input_ids = rng.integers(0, 128000, size=(3, 33))
    hidden = rng.standard_normal((3, 33, 4, 256), dtype=np.float32)
    handle = engram.prefetch(input_ids)
    np.testing.assert_array_equal(engram.forward(hidden, input_ids, prefetched=handle),
                                  engram.forward(hidden, input_ids))
    assert handle.done()
    np.testing.assert_array_equal(engram.forward(hidden, prefetched=handle), engram.forward(hidden, input_ids))
    with pytest.raises(InvalidArgument, match="prefetched: the handle was made for other input_ids"):
        engram.forward(hidden, input_ids + 1, prefetched=handle)
    with pytest.raises(InvalidArgument, match=r"prefetched: expected rows of shape \(2, 33"):
        engram.forward(hidden[:2], prefetched=handle)


def test_prefetch_layers_hashes_once_for_all(embedded):
    cfg, bb = quick_start_configs()
    engrams = [Engram(lid, cfg, bb, embedded) for lid in (1, 15)]
    try:
        assert engrams[0].hash_mapping is engrams[1].hash_mapping
        for e in engrams:
            e.populate_store_from_buffers(tables_for(e, e.layer_id))
        input_ids = np.random.default_rng(3).integers(0, 128000, size=(2, 16))
        handles = prefetch_layers(engrams, input_ids)
        assert sorted(handles) == [1, 15]
        for e in engrams:
            np.testing.assert_array_equal(handles[e.layer_id].result(timeout=30), e.query_embeddings(input_ids))
        with pytest.raises(InvalidArgument, match="handle is for layer 15"):
            engrams[0].forward(np.zeros((2, 16, 4, 256), np.float32), prefetched=handles[15])
    finally:
        for e in engrams:
            e.remove_from_store(force=True)
            e.close()


def test_tables_sized_from_engram_vocab_size_are_refused(embedded):
    cfg, bb = quick_start_configs()
    engram = Engram(1, cfg, bb, embedded)
    wrong = [np.zeros((cfg.engram_vocab_size[h // 4], 16), np.float32) for h in range(8)]
    with pytest.raises(InvalidArgument, match=r"embedding_buffers\[0\]: expected shape \(1009, 16\) = "
                                              r"\(get_table_vocab_sizes\(\)\[0\], D_head\), got \(1000, 16\); "
                                              r"size each head's table from get_table_vocab_sizes\(\)"):
        engram.populate_store_from_buffers(wrong, [t.nbytes for t in wrong])
    good = tables_for(engram)
    with pytest.raises(InvalidArgument, match=r"embedding_buffers: expected 8 tables"):
        engram.populate_store_from_buffers(good[:7])
    with pytest.raises(InvalidType, match=r"embedding_buffers\[2\]: expected a floating-point dtype .*, got int32"):
        engram.populate_store_from_buffers(good[:2] + [good[2].astype(np.int32)] + good[3:])
    with pytest.raises(InvalidArgument, match=r"buffer_sizes\[1\]: expected 64832"):
        engram.populate_store_from_buffers(good, [t.nbytes for t in good[:1]] + [1000] * 7)
    assert engram.remove_from_store() == 0  # nothing was written
    engram.populate_store_from_buffers(good)
    with pytest.raises(ObjectExists):
        engram.populate_store_from_buffers(good)
    assert engram.remove_from_store() == 8
    engram.close()


def test_checkpoint_tables_populate_the_store(embedded, tmp_path):
    cfg, bb = quick_start_configs()
    source = Engram(1, cfg, bb)
    sizes = source.get_table_vocab_sizes()
    stacked = np.random.default_rng(4).standard_normal((sum(sizes), 16)).astype(np.float32)
    path = tmp_path / "engram_l1.safetensors"
    source.save(str(path), include_tables=stacked)
    with Engram(1, cfg, bb, embedded) as engram:
        engram.load(str(path), populate_tables=True)
        try:
            ids = np.random.default_rng(5).integers(0, 128000, size=(2, 9))
            rows = engram.hash_input_ids(ids)
            offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            np.testing.assert_array_equal(engram.query_embeddings(ids), stacked[rows + offsets])
        finally:
            engram.remove_from_store()


def test_tokenizer_engram_through_store(embedded):
    texts = [f"tok{i % 50}" if i % 3 else f"TOK{i % 50}" for i in range(300)]
    tok = CompressedTokenizer(texts)
    assert len(tok) == 50 and tok.compression_ratio == 6.0
    cfg = EngramConfig(engram_vocab_size=[97, 97], n_embed_per_ngram=8, n_head_per_ngram=2, layer_ids=[0])
    with Engram(0, cfg, BackboneConfig(hidden_size=8, hc_mult=2, vocab_size=300), embedded, tokenizer=tok) as engram:
        engram.populate_store_from_buffers(tables_for(engram))
        try:
            ids = np.array([[0, 50, 100, 7], [150, 200, 250, 257], [1, 2, 3, 4]])
            # ids equal modulo 50 share a compressed id, so equal-modulo sequences read the same rows
            rows = engram.hash_input_ids(ids)
            np.testing.assert_array_equal(rows, engram.hash_input_ids(ids % 50))
            emb = engram.query_embeddings(ids)
            np.testing.assert_array_equal(emb[0], emb[1])
            assert not np.array_equal(emb[0], emb[2])
            with pytest.raises(InvalidArgument, match="out of range for the tokenizer"):
                engram.query_embeddings([[300]])
        finally:
            engram.remove_from_store()


def test_engram_module_prefetch(embedded):
    mcfg = EngramModuleConfig(vocab_size=1000, min_n=2, max_n=3, num_hash_heads=2, embedding_table_size=200,
                              embedding_dim=8, hidden_dim=16, layer_id=7)
    module = EngramModule(mcfg, store=embedded)
    module.engram.populate_store_from_buffers(tables_for(module.engram))
    try:
        rng = np.random.default_rng(6)
        ids = rng.integers(0, 1000, size=(2, 5))
        h = rng.standard_normal((2, 5, 16), dtype=np.float32)
        handle = module.prefetch_embeddings(ids)
        out, gating = module.forward(h, ids, memory_embeddings=handle, return_gating=True)
        direct, direct_gating = module.forward(h, ids, return_gating=True)
        np.testing.assert_array_equal(out, direct)
        np.testing.assert_array_equal(gating, direct_gating)
        assert module.engram.get_store_keys()[0] == "engram:l7:h0"
    finally:
        module.engram.remove_from_store()
        module.close()


def test_mooncake_compat_store():
    from engram_store.compat import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "", 64 << 20, 0, "tcp", "", "") == 0
    try:
        cfg, bb = quick_start_configs()
        engram = Engram(layer_id=1, config=cfg, backbone_cfg=bb, store=store)
        engram.populate_store_from_buffers(tables_for(engram))
        hidden = np.random.default_rng(7).standard_normal((2, 8, 4, 256), dtype=np.float32)
        input_ids = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]
        assert engram.forward(hidden, input_ids).shape == (2, 8, 4, 256)
        assert engram.remove_from_store() == 8
        engram.close()
    finally:
        store.close()


def test_demo_main_prints_output_shape(capsys):
    assert demo.main([]) == 0
    out = capsys.readouterr().out
    assert "Output shape: (2, 8, 4, 256)" in out
    assert "populate_store_from_buffers" in out and "forward" in out


def test_transformer_example_prefetches_every_layer(embedded):
    from engram_model.demo.example import TransformerWithEngram

    cfg = EngramConfig(engram_vocab_size=[300, 300], n_embed_per_ngram=16, n_head_per_ngram=2, layer_ids=[1, 3])
    bb = BackboneConfig(hidden_size=16, hc_mult=2, vocab_size=1000, num_layers=4)
    model = TransformerWithEngram(cfg, bb, embedded)
    model.populate_random_tables()
    try:
        rng = np.random.default_rng(8)
        ids = rng.integers(0, 1000, size=(2, 7))
        hidden = rng.standard_normal((2, 7, 2, 16), dtype=np.float32)
        h = hidden
        for layer_id, w in enumerate(model.block_weights):  # the same stack, reading rows without prefetch
            if layer_id in model.engrams:
                h = h + model.engrams[layer_id].forward(h, ids)
            h = h + np.tanh(h @ w)
        np.testing.assert_array_equal(model(ids, hidden), h)
    finally:
        assert model.remove_from_store() == 8
        model.close()


def test_prefetch_layers_reads_every_layer_in_one_request_per_segment():
    from engram_store import DistributedStore

    cfg, bb = quick_start_configs()
    with DistributedStore.embedded(segment_size="64MiB", local_direct=False) as store:
        engrams = [Engram(lid, cfg, bb, store) for lid in (1, 15)]
        for e in engrams:
            e.populate_store_from_buffers(tables_for(e, e.layer_id))
        input_ids = np.random.default_rng(4).integers(0, 128000, size=(2, 16))
        expected = {e.layer_id: e.query_embeddings(input_ids) for e in engrams}  # also resolves placements

        before = read_ranges_served(store)
        handles = prefetch_layers(engrams, input_ids)
        for e in engrams:
            np.testing.assert_array_equal(handles[e.layer_id].result(timeout=30), expected[e.layer_id])
        assert read_ranges_served(store) - before == 1  # both layers' tables sit on the one segment: one request for both
        for e in engrams:
            e.remove_from_store(force=True)
            e.close()


@pytest.mark.timeout(180)
def test_demo_against_a_master_leaves_a_layer_it_did_not_create(capsys):
    from engram_store import DistributedStore, EngramStore, EngramStoreConfig
    from engram_store.testing import Cluster

    with Cluster(segments=0) as c:
        with DistributedStore.connect(c.address, segment_size="64MiB") as store:
            cfg, bb = demo_quick_start_configs()
            sizes = Engram(layer_id=1, config=cfg, backbone_cfg=bb).get_table_vocab_sizes()
            mine = EngramStore(1, EngramStoreConfig(table_vocab_sizes=sizes, embedding_dim=64), store)
            tables = [np.full((n, 64), h, dtype=np.float32) for h, n in enumerate(sizes)]
            mine.populate(tables)
            assert demo.main(["--master", c.address, "--segment-size", "0"]) == 1
            assert "layer 1 is already in the store" in capsys.readouterr().err
            assert mine.verify() == list(range(len(sizes)))  # still there, untouched
            assert demo.main(["--master", c.address, "--segment-size", "0"]) == 1  # and again
            mine.remove_from_store(force=True)
            assert demo.main(["--master", c.address, "--segment-size", "0"]) == 0
            assert not any(store.batch_is_exist(mine.get_store_keys()))  # the demo removed only its own layer
