"""Qwen4-Exp checkpoints in the released layout (the toy writer): the layout written, the weights and the table
scale read, the checkpoint's hash buffers taking precedence over the config's (and said), the table re-sliced from
its row-range shards, rows a table must not hold refused naming the row, failures rolled back, engram-load."""
from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

from engram_model.load import main as load_main
from engram_model.ple import (PLEConfig, PLEHasher, PLELayer, load_ple_hash_buffers, load_ple_table, load_ple_weights,
                              open_ple_table, ple_store_config, write_toy_checkpoint)
from engram_model.ple import _checkpoint as ple_checkpoint
from engram_model.ple._toy import toy_tensors
from engram_model.v41 import SafetensorsCheckpoint, V41Config
from engram_model.v41 import write_toy_checkpoint as write_v41_checkpoint
from engram_model._safetensors import write_safetensors
from engram_store import DistributedStore, EngramStore, InvalidArgument, ObjectExists
from engram_store.disk import DiskDir

import model_helpers as ref

BF16 = PLEConfig(ple_layer_ids=[2, 5], vocab_size=500, eos_token_id=5, ngram_vocab_size_base=100, hidden_size=16,
                 hc_count=2, ple_embed_dim=320, split_ngram_parts=16)
FP8 = PLEConfig(**{**BF16.__dict__, "ple_embedding_dtype": "float8_e4m3fn"})
PREFIX = "model.language_model.layers.{i}.ple."


def widen(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def table_of(tensors: dict, layer_id: int) -> np.ndarray:
    prefix = PREFIX.format(i=layer_id - 1) + "ple_embedding.ngram_embedding.shard_"
    names = sorted((n for n in tensors if n.startswith(prefix)), key=lambda n: int(n[len(prefix):].split(".")[0]))
    return np.concatenate([tensors[n][1] for n in names])


def write(directory, config: PLEConfig, tensors: dict) -> str:
    """A one-file checkpoint of ``tensors`` with ``config``'s config.json."""
    from engram_model.ple._toy import hf_config

    directory.mkdir(parents=True, exist_ok=True)
    write_safetensors(directory / "model.safetensors", tensors)
    (directory / "config.json").write_text(json.dumps(hf_config(config)))
    return str(directory)


def test_the_toy_checkpoint_is_the_released_layout(tmp_path):
    path = write_toy_checkpoint(tmp_path, BF16)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["Qwen4ExpForConditionalGeneration"] and raw["text_config"]["ple_layer_ids"] == [2, 5]
    assert PLEConfig.from_hf(path) == BF16
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 2
    ckpt = SafetensorsCheckpoint(path)
    rows, parts = BF16.num_embeddings(5), BF16.split_ngram_parts
    per = -(-rows // parts)
    shards = [ckpt.info(PREFIX.format(i=4) + f"ple_embedding.ngram_embedding.shard_{k}.weight") for k in range(parts)]
    assert all(s == ("BF16", (per, 20)) for s in shards[:-1]) and shards[-1] == ("BF16", (rows - per * (parts - 1), 20))
    bounds = set(range(0, rows, per))
    heads = set(BF16.head_offsets(5).tolist())
    assert bounds - heads and heads - bounds                              # the shards cross head boundaries
    assert ckpt.info(PREFIX.format(i=4) + "ple_embedding.layer_multipliers") == ("I64", (3,))
    assert ckpt.info(PREFIX.format(i=4) + "conv1d.weight") == ("BF16", (32, 1, 4))
    assert ckpt.info(PREFIX.format(i=4) + "key_proj.weight") == ("BF16", (32, 320))
    fp8 = SafetensorsCheckpoint(write_toy_checkpoint(tmp_path / "fp8", FP8))
    assert fp8.info(PREFIX.format(i=1) + "ple_embedding.ngram_embedding.shard_0.weight")[0] == "F8_E4M3"
    assert fp8.info(PREFIX.format(i=1) + "ple_embedding.ngram_embedding.weight_scale") == ("F32", (1,))


def test_weights_and_the_table_scale(tmp_path):
    tensors = toy_tensors(FP8)
    path = write_toy_checkpoint(tmp_path, FP8)
    got = load_ple_weights(path, FP8, 5)
    base = PREFIX.format(i=4)
    for part in ("key_proj", "value_proj", "norm_key", "norm_query", "norm_conv"):
        np.testing.assert_array_equal(got[part], widen(tensors[base + part + ".weight"][1]))
        assert got[part].dtype == np.float32
    np.testing.assert_array_equal(got["conv1d"], widen(tensors[base + "conv1d.weight"][1])[:, 0, :])
    assert got["table_scale"] == float(tensors[base + "ple_embedding.ngram_embedding.weight_scale"][1][0])
    assert load_ple_weights(write_toy_checkpoint(tmp_path / "bf16", BF16), BF16, 5)["table_scale"] is None


def test_fp8_projections_are_dequantised_by_their_block_scales(tmp_path):
    """An FP8 export's key_proj: e4m3 codes and weight_scale_inv per 128 x 128 block (blocks cut at the edges)."""
    config = PLEConfig(**{**FP8.__dict__, "hidden_size": 160, "ple_embed_dim": 320})
    tensors = toy_tensors(config)
    rng = np.random.default_rng(0)
    base = PREFIX.format(i=1)
    codes = rng.integers(0, 256, (320, 320), dtype=np.uint8) & 0xF7
    scales = rng.uniform(0.5, 2.0, (3, 3)).astype(np.float32)
    tensors[base + "key_proj.weight"] = ("F8_E4M3", codes)
    tensors[base + "key_proj.weight_scale_inv"] = ("F32", scales)
    got = load_ple_weights(write(tmp_path, config, tensors), config, 2)["key_proj"]
    e4m3 = np.array([ref_e4m3(c) for c in range(256)], dtype=np.float64)
    expect = e4m3[codes] * np.repeat(np.repeat(scales.astype(np.float64), 128, 0), 128, 1)[:320, :320]
    np.testing.assert_array_equal(got, expect.astype(np.float32))
    del tensors[base + "key_proj.weight_scale_inv"]
    with pytest.raises(InvalidArgument, match="an F8_E4M3 weight needs .*weight_scale_inv"):
        load_ple_weights(write(tmp_path / "noscale", config, tensors), config, 2)


def ref_e4m3(code: int) -> float:
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    value = mantissa * 2.0 ** -9 if exponent == 0 else (8 + mantissa) * 2.0 ** (exponent - 10)
    return -value if code & 0x80 else value


def test_the_checkpoints_hash_buffers_take_precedence_and_are_said(tmp_path, caplog):
    """Multipliers and head sizes that differ from the config's: a WARNING names both, the hasher and the table
    follow the checkpoint (two heads' sizes swapped: the re-slicing follows its offsets)."""
    tensors = toy_tensors(BF16)
    base = PREFIX.format(i=1) + "ple_embedding."
    theirs = np.array([7, 11, 13], dtype=np.int64)
    sizes = tensors[base + "ngram_heads_vocab_sizes"][1].copy()
    sizes[[0, 1]] = sizes[[1, 0]]
    tensors[base + "layer_multipliers"] = ("I64", theirs)
    tensors[base + "ngram_heads_vocab_sizes"] = ("I64", sizes)
    tensors[base + "ngram_heads_offsets"] = ("I64", np.concatenate([[0], np.cumsum(sizes)[:-1]]))
    path = write(tmp_path / "ckpt", BF16, tensors)
    with caplog.at_level(logging.WARNING, logger="engram_model.ple._checkpoint"):
        buffers = load_ple_hash_buffers(path, BF16)
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert f"layer_multipliers [7, 11, 13] differs from the config's {BF16.multipliers(2).tolist()}" in said
    assert "ngram_heads_vocab_sizes" in said and "ngram_heads_offsets" in said
    assert buffers[5] == BF16.hash_buffers(5)                              # layer 5 agrees: taken as it is
    ids = np.array([[1, 2, 5, 4, 9, 9]])
    expect = ref.ngram_ids(ids, np.full((1, 2), 5), theirs, sizes, buffers[2].offsets, 8, 3, 5)
    np.testing.assert_array_equal(PLEHasher(BF16, buffers)(ids)[:, :, 0], expect)
    with load_ple_table(path, BF16, 2, local_dir=str(tmp_path / "shm")) as table:
        assert table.get_table_vocab_sizes() == sizes.tolist()
        full = table_of(tensors, 2)
        for h in (0, 1, 15):
            ids = np.zeros((sizes[h], 1, 16), np.int64)
            ids[:, 0, h] = np.arange(sizes[h])
            got = table.lookup(ids)[:, 0, h]
            np.testing.assert_array_equal(got, full[buffers[2].offsets[h]:buffers[2].offsets[h] + sizes[h]])


def corrupt(tensors: dict, layer_id: int, row: int, value) -> str:
    """Set a value of table row ``row`` (global) in its shard; returns the shard's name."""
    prefix = PREFIX.format(i=layer_id - 1) + "ple_embedding.ngram_embedding.shard_"
    per = tensors[prefix + "0.weight"][1].shape[0]
    name = f"{prefix}{row // per}.weight"
    dtype, arr = tensors[name]
    arr = arr.copy()
    arr[row % per, 3] = value
    tensors[name] = (dtype, arr)
    return name


@pytest.mark.parametrize("config, row, value, words", [
    (FP8, 700, 0x7F, "e4m3 NaN code 0x7F at value 3"),
    (BF16, 5, 0x7F80, "bf16 infinity 0x7F80 at value 3"),
    (BF16, None, 0x7FC1, "bf16 NaN 0x7FC1 at value 3"),                     # a padding row: read, not stored
])
def test_rows_a_table_must_not_hold_are_refused_naming_them(tmp_path, config, row, value, words):
    tensors = toy_tensors(config)
    row = config.num_embeddings(2) - 1 if row is None else row
    name = corrupt(tensors, 2, row, value)
    path = write(tmp_path / "ckpt", config, tensors)
    for where in ({"disk_dir": str(tmp_path / "ssd")}, {"local_dir": str(tmp_path / "shm")}):
        with pytest.raises(InvalidArgument, match=rf"PLE layer 2: table row {row} \({name} row \d+\) holds {words}"):
            load_ple_table(path, config, 2, progress=False, **where)
    assert DiskDir(tmp_path / "ssd").layers() == [] and not (tmp_path / "shm" / "layer-2").exists()


@pytest.mark.parametrize("edit, words", [
    (lambda t, b: t.pop(b + "shard_3.weight"), r"shard_3.weight is missing, but .*shard_4.weight is there"),
    (lambda t, b: t.update({b + "shard_0.weight": ("F8_E4M3", t[b + "shard_0.weight"][1].view(np.uint8))}),
     r"shard_0.weight: expected dtype BF16 \(ple_embedding_dtype = 'bfloat16' in config.json\), got F8_E4M3"),
    (lambda t, b: t.update({b + "shard_1.weight": ("BF16", t[b + "shard_1.weight"][1][:, :10])}),
     r"shard_1.weight: expected shape \[rows, 20\]"),
])
def test_malformed_tables_are_refused_before_anything_is_written(tmp_path, edit, words):
    tensors = toy_tensors(BF16)
    edit(tensors, PREFIX.format(i=1) + "ple_embedding.ngram_embedding.")
    path = write(tmp_path / "ckpt", BF16, tensors)
    with pytest.raises(InvalidArgument, match=words):
        load_ple_table(path, BF16, 2, disk_dir=str(tmp_path / "ssd"))
    assert DiskDir(tmp_path / "ssd").layers() == []


def test_a_short_table_and_a_missing_or_stray_scale_are_refused(tmp_path):
    bf16 = toy_tensors(BF16)
    bf16[PREFIX.format(i=1) + "ple_embedding.ngram_embedding.weight_scale"] = ("F32", np.ones(1, np.float32))
    with pytest.raises(InvalidArgument, match="the checkpoint scales its table, but config.json describes bf16 rows"):
        load_ple_weights(write(tmp_path / "c", BF16, bf16), BF16, 2)
    tensors = toy_tensors(FP8)
    base = PREFIX.format(i=1) + "ple_embedding.ngram_embedding."
    scale = tensors.pop(base + "weight_scale")
    with pytest.raises(InvalidArgument, match=r"the FP8 table has no scale"):
        load_ple_weights(write(tmp_path / "a", FP8, tensors), FP8, 2)
    tensors[base + "weight_scale"] = scale
    last = max(int(n[len(base + "shard_"):].split(".")[0]) for n in tensors if n.startswith(base + "shard_"))
    del tensors[f"{base}shard_{last}.weight"]
    path = write(tmp_path / "b", FP8, tensors)
    buffers = FP8.hash_buffers(2)
    with pytest.raises(InvalidArgument, match=rf"buffers: layer 2's table has {buffers.rows} rows there, the "
                                              rf"checkpoint's \d+"):
        load_ple_table(path, FP8, 2, disk_dir=str(tmp_path / "ssd"), buffers=buffers)


@pytest.mark.timeout(180)
def test_a_load_into_a_store_that_fails_leaves_nothing_and_a_second_is_refused(tmp_path, monkeypatch):
    path = write_toy_checkpoint(tmp_path / "ckpt", BF16)
    layout = ple_store_config(BF16, 2)
    with DistributedStore.embedded(segment_size="16MiB", timeout_ms=60_000) as store:
        keys = EngramStore(2, layout, store).get_store_keys()
        read_head = ple_checkpoint._read_head

        def fail_at_head_5(fill, out, layer_id, h, progress):
            if h == 5:
                raise OSError("the disk went away")
            return read_head(fill, out, layer_id, h, progress)

        monkeypatch.setattr(ple_checkpoint, "_read_head", fail_at_head_5)
        with pytest.raises(OSError, match="the disk went away"):
            load_ple_table(path, BF16, 2, store)
        assert not any(store.batch_is_exist(keys + ["engram:l2:manifest"]))
        monkeypatch.undo()
        table = open_ple_table(path, BF16, 2, store)                      # not there: streamed in
        table.close()
        with pytest.raises(ObjectExists, match="16 heads are already in the store"):
            load_ple_table(path, BF16, 2, store)
        table = open_ple_table(path, BF16, 2, store)                      # there: opened as it is
        assert table.verify() == list(range(16))
        table.close()


@pytest.mark.timeout(240)
def test_engram_load_reads_the_family_from_config_json(tmp_path, capsys):
    ckpt = write_toy_checkpoint(tmp_path / "ple", FP8)
    assert load_main([ckpt, "--disk-dir", str(tmp_path / "ssd"), "--verify", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "layer 2: 16 heads of 2206 rows of 20 e4m3 values, one scale per table (20 B)" in out
    assert "layer 5: checksums of heads [0, 1," in out
    assert DiskDir(tmp_path / "ssd").layers() == [2, 5]
    assert load_main([ckpt, "--local-dir", str(tmp_path / "shm"), "--layers", "5", "--no-progress"]) == 0
    assert sorted(p.name for p in (tmp_path / "shm").iterdir()) == ["layer-5"]
    assert load_main([ckpt, "--disk-dir", str(tmp_path / "ssd"), "--layers", "2", "--no-progress"]) == 1
    assert "is already published" in capsys.readouterr().err
    with DistributedStore.embedded(segment_size="16MiB", timeout_ms=60_000) as store:
        assert load_main([ckpt, "--master", store.master_address, "--layers", "5", "--verify",
                          "--no-progress"]) == 0
        assert all(store.batch_is_exist(EngramStore(5, ple_store_config(FP8, 5), store).get_store_keys()))
    v41 = write_v41_checkpoint(tmp_path / "v41", V41Config(layer_ids=[1], max_ngram_size=2, n_heads=1, head_dim=32,
                                                           engram_vocab_size=20, compressed_vocab_size=8,
                                                           hidden_size=32, hc_mult=1))
    assert load_main([v41, "--local-dir", str(tmp_path / "v41shm"), "--no-progress"]) == 0
    assert "layer 1: 1 columns" in capsys.readouterr().out
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"model_type": "llama", "text_config": {}}))
    assert load_main([str(tmp_path / "other"), "--disk-dir", str(tmp_path / "x")]) == 1
    assert "neither ple_layer_ids (Qwen4-Exp) nor engram_layer_ids (DeepSeek-V4.1)" in capsys.readouterr().err
    assert load_main([str(tmp_path / "nowhere"), "--disk-dir", str(tmp_path / "x")]) == 2
    assert load_main([ckpt, "--disk-dir", str(tmp_path / "y"), "--layers", "3"]) == 1
    assert "layer_id: expected one of ple_layer_ids = [2, 5], got 3" in capsys.readouterr().err


def test_an_index_that_names_a_shard_outside_the_checkpoint_is_refused(tmp_path, capsys):
    """The V4.1 loader's confinement holds for PLE checkpoints: an index entry that climbs out is refused, naming it,
    before any file is opened."""
    path = write_toy_checkpoint(tmp_path / "ckpt", BF16)
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    name = next(iter(raw["weight_map"]))
    raw["weight_map"][name] = "../elsewhere.safetensors"
    index.write_text(json.dumps(raw))
    assert load_main([path, "--disk-dir", str(tmp_path / "ssd")]) == 2
    assert f"weight_map entry {name!r} names '../elsewhere.safetensors', outside" in capsys.readouterr().err
    assert DiskDir(tmp_path / "ssd").layers() == []


def mapped(directory) -> bool:
    """Whether this process maps a file under ``directory`` (a local_dir table open here)."""
    with open("/proc/self/maps", encoding="utf-8") as f:
        return str(directory) in f.read()


@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps to see what is mapped")
def test_a_layer_from_the_checkpoint_streams_its_table_once_and_closes_it(tmp_path):
    """PLELayer.from_checkpoint: the table streamed into local_dir the first time and opened the second, the
    checkpoint's hash buffers taken, the forward the same as a layer built from its parts; close() closes the table
    it opened, not one it was given; a second place, or none, is refused before anything is read."""
    path = write_toy_checkpoint(tmp_path / "ckpt", FP8)
    shm = tmp_path / "shm"
    ids = PLEHasher(FP8, load_ple_hash_buffers(path, FP8))(np.arange(12).reshape(2, 6) % 500)[:, :, 1]
    hidden = np.random.default_rng(0).standard_normal((2, 6, FP8.hc_count * FP8.hidden_size)).astype(np.float32)
    with PLELayer.from_checkpoint(path, FP8, 5, local_dir=shm) as first:
        assert first.buffers == load_ple_hash_buffers(path, FP8)[5]
        out = first.forward(hidden, first.rows(ids))
        assert mapped(shm)
    assert not mapped(shm)                                                     # closed with the layer
    with open_ple_table(path, FP8, 5, local_dir=shm) as opened:
        built = PLELayer(FP8, 5, load_ple_weights(path, FP8, 5), opened, buffers=load_ple_hash_buffers(path, FP8)[5])
        np.testing.assert_array_equal(built.forward(hidden, built.rows(ids)), out)
        again = PLELayer.from_checkpoint(path, FP8, 5, opened)              # an EngramStore given: not closed
        again.close()
        assert mapped(shm)
    with PLELayer.from_checkpoint(path, FP8, 5, local_dir=shm) as second:   # there already: opened
        np.testing.assert_array_equal(second.forward(hidden, second.rows(ids)), out)
    for places in ({}, {"local_dir": shm, "disk_dir": tmp_path / "ssd"}):
        with pytest.raises(InvalidArgument, match="store, disk_dir, local_dir: expected exactly one place"):
            PLELayer.from_checkpoint(tmp_path / "nowhere", FP8, 5, **places)
    assert not (tmp_path / "ssd").exists()
