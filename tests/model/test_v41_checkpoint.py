"""V4.1 checkpoints written here (F8_E4M3 / F8_E8M0 / BF16 safetensors, sharded or not): weights read and
dequantised, the table streamed into the store column by column, failures rolled back, and engram-load-v41."""
from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest

from engram_model.v41 import (SafetensorsCheckpoint, V41Config, V41Engram, V41Hasher, load_v41_table, load_v41_weights,
                              v41_store_config)
from engram_model.v41.load import main as load_main
from engram_store import DistributedStore, EngramStore, InvalidArgument, InvalidType, ObjectExists

CFG = V41Config(layer_ids=[1, 3], max_ngram_size=3, n_heads=2, head_dim=64, engram_vocab_size=300,
                compressed_vocab_size=100, hidden_size=32, hc_mult=2)


def write_safetensors(path, tensors):
    """tensors: name -> (safetensors dtype name, array holding the raw values)."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + b"".join(blobs))


def e4m3(code):
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    value = math.ldexp(mantissa, -9) if exponent == 0 else math.ldexp(8 + mantissa, exponent - 10)
    return -value if code & 0x80 else value


def layer_tensors(layer_id, rng, prefix="", scale_name="scale"):
    """Random but valid tensors of one layer, under the names a checkpoint uses."""
    hc, D, K = CFG.hc_mult, CFG.hidden_size, CFG.cols * CFG.head_dim
    rows = CFG.num_embeddings(layer_id)
    no_nan = lambda shape: rng.integers(0, 256, size=shape, dtype=np.uint8) & 0xF7  # noqa: E731 (clears a bit)
    bf16_bits = lambda shape: (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16  # noqa: E731
                               ).astype(np.uint16)
    base = f"{prefix}layers.{layer_id}.engram."
    return {
        base + "embed.weight": ("F8_E4M3", no_nan((rows, CFG.head_dim))),
        base + f"embed.{scale_name}": ("F8_E8M0", rng.integers(110, 140, (rows, CFG.head_dim // 32), dtype=np.uint8)),
        base + "wkv.weight": ("F8_E4M3", no_nan(((hc + 1) * D, K))),
        base + f"wkv.{scale_name}": ("F8_E8M0", rng.integers(118, 124, ((hc + 1) * D // 32, K // 32), dtype=np.uint8)),
        base + "q_weight": ("BF16", bf16_bits((hc, D))),
        base + "k_weight": ("BF16", bf16_bits((hc, D))),
    }


def write_checkpoint(directory, rng, sharded=True, **names):
    tensors = {**layer_tensors(1, rng, **names), **layer_tensors(3, rng, **names),
               "embed.weight": ("BF16", np.zeros((4, 4), np.uint16))}
    if sharded:
        shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
        for i, (name, value) in enumerate(tensors.items()):
            shards[sorted(shards)[i % 2]][name] = value
        for file, part in shards.items():
            write_safetensors(directory / file, part)
        weight_map = {name: file for file, part in shards.items() for name in part}
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        write_safetensors(directory / "model.safetensors", tensors)
    return {name: arr for name, (_, arr) in tensors.items()}


def expected_wkv(codes, scale_bytes):
    values = np.array([e4m3(c) for c in range(256)], dtype=np.float64)[codes]
    scales = np.ldexp(1.0, scale_bytes.astype(np.int64) - 127)
    return (values * np.repeat(np.repeat(scales, 32, axis=0), 32, axis=1)).astype(np.float32)


@pytest.mark.parametrize("sharded,names", [(True, {}), (False, {"prefix": "model.", "scale_name": "weight_scale_inv"})])
def test_weights_are_read_and_dequantised(tmp_path, sharded, names):
    raw = write_checkpoint(tmp_path, np.random.default_rng(0), sharded, **names)
    prefix, scale = names.get("prefix", ""), names.get("scale_name", "scale")
    got = load_v41_weights(tmp_path, CFG, 3)
    base = f"{prefix}layers.3.engram."
    np.testing.assert_array_equal(got["wkv"], expected_wkv(raw[base + "wkv.weight"], raw[base + f"wkv.{scale}"]))
    for part in ("q_weight", "k_weight"):
        np.testing.assert_array_equal(got[part], (raw[base + part].astype(np.uint32) << 16).view(np.float32))
        assert got[part].dtype == np.float32
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert ckpt.info(base + "embed.weight") == ("F8_E4M3", (CFG.num_embeddings(3), 64))
    np.testing.assert_array_equal(ckpt.raw(base + "embed.weight"), raw[base + "embed.weight"])
    rows = np.empty((7, 64), np.uint8)  # a table is read a run of rows at a time, never mapped
    np.testing.assert_array_equal(ckpt.read_rows(base + "embed.weight", 100, rows), raw[base + "embed.weight"][100:107])
    ckpt.close()


@pytest.mark.timeout(120)
def test_from_checkpoint_streams_the_table_and_matches_a_layer_built_by_hand(tmp_path, embedded):
    rng = np.random.default_rng(1)
    raw = write_checkpoint(tmp_path, rng)
    engram = V41Engram.from_checkpoint(tmp_path, CFG, 1, embedded)
    try:
        table = EngramStore(1, v41_store_config(CFG, 1), embedded)
        # Every row of every column is the checkpoint's codes followed by its scale bytes.
        packed = np.concatenate([raw["layers.1.engram.embed.weight"], raw["layers.1.engram.embed.scale"]], axis=1)
        offsets = CFG.offsets(1)
        for c, prime in enumerate(v41_store_config(CFG, 1).table_vocab_sizes):
            ids = np.zeros((prime, 1, CFG.cols), dtype=np.int64)
            ids[:, 0, c] = np.arange(prime)
            np.testing.assert_array_equal(table.lookup(ids)[:, 0, c], packed[offsets[c]:offsets[c] + prime])
        weights = load_v41_weights(tmp_path, CFG, 1)
        by_hand = V41Engram(CFG, 1, weights["wkv"], weights["q_weight"], weights["k_weight"], table)
        row_ids = offsets + rng.integers(0, 300, size=(2, 5, CFG.cols))
        h = rng.standard_normal((2, 5, 2, 32)).astype(np.float32)
        np.testing.assert_array_equal(engram.forward(h, row_ids=row_ids), by_hand.forward(h, row_ids=row_ids))
        # A second from_checkpoint finds the table in the store and only reads the weights.
        again = V41Engram.from_checkpoint(tmp_path, CFG, 1, embedded)
        np.testing.assert_array_equal(again.forward(h, row_ids=row_ids), by_hand.forward(h, row_ids=row_ids))
        again.close()
        with pytest.raises(ObjectExists, match="layer 1: 4 of 4 columns are already in the store"):
            load_v41_table(tmp_path, CFG, 1, embedded)
        table.close()
    finally:
        engram.close()
        EngramStore(1, v41_store_config(CFG, 1), embedded).remove_from_store()


@pytest.mark.timeout(120)
def test_a_failing_column_removes_the_columns_written(tmp_path, embedded):
    raw = write_checkpoint(tmp_path, np.random.default_rng(2))
    bad_row = int(CFG.offsets(3)[2]) + 7  # a NaN code in column 2: columns 0 and 1 are already written
    raw["layers.3.engram.embed.weight"][bad_row, 5] = 0x7F
    write_checkpoint_from(tmp_path, raw)
    layer = EngramStore(3, v41_store_config(CFG, 3), embedded)
    with pytest.raises(InvalidArgument, match=f"layer 3: table row {bad_row} \\(column 2\\) holds an e4m3 NaN"):
        load_v41_table(tmp_path, CFG, 3, embedded)
    assert embedded.batch_is_exist(layer.get_store_keys()) == [False] * CFG.cols
    assert not embedded.batch_is_exist(["engram:l3:manifest"])[0]
    layer.close()


@pytest.mark.timeout(120)
def test_a_failed_load_takes_back_its_own_columns_and_never_another_loads(tmp_path, embedded, monkeypatch):
    """Load A has written columns 0 and 1 of layer 3 when another process removes the layer with force and loads
    it whole. A's column 2 is then refused, and taking A back must leave the other load's layer whole: A removes
    the objects its own puts wrote, not whatever is under its keys by then."""
    from engram_model.v41 import _checkpoint as checkpoint

    raw = write_checkpoint(tmp_path, np.random.default_rng(3))
    pack = checkpoint._pack_column
    raced = []

    def pack_after_another_load(table, offset, out, layer_id, c, *rest):
        if c == 2 and not raced:
            raced.append(c)
            EngramStore(3, v41_store_config(CFG, 3), embedded).remove_from_store(force=True)
            load_v41_table(tmp_path, CFG, 3, embedded).close()
        return pack(table, offset, out, layer_id, c, *rest)

    monkeypatch.setattr(checkpoint, "_pack_column", pack_after_another_load)
    with pytest.raises(ObjectExists, match="engram:l3:h2"):
        load_v41_table(tmp_path, CFG, 3, embedded)
    assert raced == [2]
    table = EngramStore(3, v41_store_config(CFG, 3), embedded)
    assert embedded.batch_is_exist(table.get_store_keys() + ["engram:l3:manifest"]) == [True] * (CFG.cols + 1)
    packed = np.concatenate([raw["layers.3.engram.embed.weight"], raw["layers.3.engram.embed.scale"]], axis=1)
    for c, (offset, prime) in enumerate(zip(CFG.offsets(3).tolist(), v41_store_config(CFG, 3).table_vocab_sizes)):
        ids = np.zeros((prime, 1, CFG.cols), dtype=np.int64)
        ids[:, 0, c] = np.arange(prime)
        np.testing.assert_array_equal(table.lookup(ids)[:, 0, c], packed[offset:offset + prime])
    assert table.verify() == list(range(CFG.cols))
    table.remove_from_store()
    table.close()


def write_checkpoint_from(directory, raw):
    """Rewrite the sharded checkpoint with (modified) raw arrays, same dtypes and shards as write_checkpoint."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    dtypes = {}
    for file in set(index.values()):
        ckpt = SafetensorsCheckpoint(directory / file)
        dtypes.update({name: ckpt.info(name)[0] for name in ckpt.names()})
    for file in set(index.values()):
        write_safetensors(directory / file, {n: (dtypes[n], np.array(raw[n])) for n, f in index.items() if f == file})


def test_refusals_name_the_tensor(tmp_path):
    rng = np.random.default_rng(3)
    tensors = layer_tensors(1, rng)
    write_safetensors(tmp_path / "a.safetensors", {k: v for k, v in tensors.items() if "k_weight" not in k})
    with pytest.raises(InvalidArgument, match=r"no Engram tensor 'k_weight' \(tried layers.1.engram.k_weight, "
                                              r"model.layers.1.engram.k_weight\)"):
        load_v41_weights(tmp_path / "a.safetensors", CFG, 1)
    tensors["layers.1.engram.q_weight"] = ("BF16", np.zeros((2, 31), np.uint16))
    write_safetensors(tmp_path / "b.safetensors", tensors)
    with pytest.raises(InvalidArgument, match=r"layers.1.engram.q_weight: expected shape \[2, 32\] for this config, "
                                              r"got \[2, 31\]"):
        load_v41_weights(tmp_path / "b.safetensors", CFG, 1)
    tensors = layer_tensors(1, rng)
    tensors["layers.1.engram.wkv.scale"][1][0, 3] = 255
    write_safetensors(tmp_path / "c.safetensors", tensors)
    with pytest.raises(InvalidArgument, match=r"wkv.scale: block \[0, 3\] has e8m0 byte 255"):
        load_v41_weights(tmp_path / "c.safetensors", CFG, 1)
    tensors = layer_tensors(1, rng)
    tensors["layers.1.engram.embed.weight"] = ("I32", np.zeros((CFG.num_embeddings(1), 64), np.int32))
    write_safetensors(tmp_path / "d.safetensors", tensors)
    with pytest.raises(InvalidArgument, match="embed.weight: expected dtype F8_E4M3 or U8, got I32"):
        load_v41_table(tmp_path / "d.safetensors", CFG, 1, None)
    write_safetensors(tmp_path / "f.safetensors", layer_tensors(1, rng))
    with pytest.raises(InvalidArgument, match="store, disk_dir, local_dir: expected exactly one place for the table "
                                              "of layer 1, got none"):
        load_v41_table(tmp_path / "f.safetensors", CFG, 1, None)
    with pytest.raises(InvalidType, match="store: expected a DistributedStore"):
        load_v41_table(tmp_path / "f.safetensors", CFG, 1, object())
    (tmp_path / "e.safetensors").write_bytes(struct.pack("<Q", 10 ** 6) + b"{}")
    with pytest.raises(InvalidArgument, match="not a safetensors file"):
        SafetensorsCheckpoint(tmp_path / "e.safetensors")
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "missing.safetensors"}}))
    with pytest.raises(InvalidArgument, match="shard listed in the index does not exist"):
        SafetensorsCheckpoint(shard_dir).info("x")
    with pytest.raises(InvalidArgument, match="no such checkpoint"):
        SafetensorsCheckpoint(tmp_path / "nothing")


@pytest.mark.timeout(120)
def test_engram_load_v41_cli(tmp_path, capsys):
    write_checkpoint(tmp_path, np.random.default_rng(4))
    text = {"engram_layer_ids": [1, 3], "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 64,
            "engram_vocab_size": 300, "engram_compressed_vocab_size": 100, "engram_pad_id": 2, "hidden_size": 32,
            "hc_mult": 2, "rms_norm_eps": 1e-20,
            "engram_num_embeddings": [CFG.num_embeddings(1), CFG.num_embeddings(3)]}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": text}))
    with DistributedStore.embedded(segment_size="16MiB") as store:
        assert load_main([str(tmp_path), "--master", store.master_address, "--layers", "3", "--verify",
                          "--no-progress"]) == 0
        out = capsys.readouterr().out
        assert f"layer 3: 4 columns, {CFG.num_embeddings(3)} rows" in out and "checksums of columns [0, 1, 2, 3]" in out
        layer = EngramStore(3, v41_store_config(CFG, 3), store)
        assert all(store.batch_is_exist(layer.get_store_keys()))
        assert load_main([str(tmp_path), "--master", store.master_address, "--layers", "3"]) == 1
        assert "already in the store" in capsys.readouterr().err
        layer.remove_from_store()
        layer.close()


@pytest.mark.timeout(120)
def test_a_checkpoint_loads_onto_ssd_and_matches_the_store(tmp_path, embedded):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    write_checkpoint(ckpt, np.random.default_rng(9))
    in_store = V41Engram.from_checkpoint(ckpt, CFG, 3, embedded)
    on_disk = V41Engram.from_checkpoint(ckpt, CFG, 3, disk_dir=tmp_path / "ssd", row_cache_bytes=1 << 16)
    rng = np.random.default_rng(10)
    ids = rng.integers(0, 100, size=(2, 9))
    hidden = rng.standard_normal((2, 9, CFG.hc_mult, CFG.hidden_size), dtype=np.float32)
    hasher = V41Hasher(CFG, np.arange(100))
    rows = hasher(ids)
    np.testing.assert_array_equal(on_disk.forward(hidden, row_ids=rows), in_store.forward(hidden, row_ids=rows))
    assert on_disk.store.disk_dir == str(tmp_path / "ssd") and on_disk.store.verify() == [0, 1, 2, 3]
    again = V41Engram.from_checkpoint(ckpt, CFG, 3, disk_dir=tmp_path / "ssd")  # published: opened, not rewritten
    np.testing.assert_array_equal(again.forward(hidden, row_ids=rows), in_store.forward(hidden, row_ids=rows))
    with pytest.raises(ObjectExists, match="already published under disk_dir"):
        load_v41_table(ckpt, CFG, 3, disk_dir=tmp_path / "ssd")
    with pytest.raises(InvalidArgument, match="exactly one place"):
        load_v41_table(ckpt, CFG, 3, embedded, disk_dir=tmp_path / "ssd")
    for engram in (in_store, on_disk, again):
        engram.close()
    text = {"engram_layer_ids": [1, 3], "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 64,
            "engram_vocab_size": 300, "engram_compressed_vocab_size": 100, "engram_pad_id": 2, "hidden_size": 32,
            "hc_mult": 2, "rms_norm_eps": 1e-20,
            "engram_num_embeddings": [CFG.num_embeddings(1), CFG.num_embeddings(3)]}
    (ckpt / "config.json").write_text(json.dumps({"text_config": text}))
    assert load_main([str(ckpt), "--disk-dir", str(tmp_path / "cli"), "--layers", "3", "--verify",
                      "--no-progress"]) == 0
    with EngramStore(3, v41_store_config(CFG, 3), disk_dir=tmp_path / "cli") as layer:
        assert layer.verify() == [0, 1, 2, 3]
    assert load_main([str(ckpt), "--disk-dir", str(tmp_path / "cli"), "--layers", "3", "--no-progress"]) == 1


@pytest.mark.timeout(180)
def test_a_layer_the_store_lost_is_loaded_again_with_a_warning_naming_the_loss(tmp_path, caplog):
    import logging
    import time

    from engram_store.testing import Cluster

    write_checkpoint(tmp_path, np.random.default_rng(2))
    with Cluster(segments=1, segment_size="64MiB", heartbeat_timeout_s=1.5) as c:
        with DistributedStore.connect(c.address, timeout_ms=5000) as store:
            V41Engram.from_checkpoint(tmp_path, CFG, 1, store).close()
            c.segments[0].kill()  # its shared memory, and the layer with it, are gone
            c.add_segment("64MiB")
            deadline = time.monotonic() + 30
            while not store.status()["lost"]:
                assert time.monotonic() < deadline, "the master never dropped the killed segment"
                time.sleep(0.1)
            caplog.set_level(logging.INFO, logger="engram_model._table_load")
            V41Engram.from_checkpoint(tmp_path, CFG, 1, store).close()
            assert "layer 1: the store lost" in caplog.text and "engram:l1:" in caplog.text


def test_every_table_option_reaches_the_layer_from_a_checkpoint(tmp_path, embedded):
    """local_dir, and a host-wide cache over disk_dir, straight from the constructors; the same rows everywhere."""
    from engram_model.v41 import V41Rows, open_v41_table

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    write_checkpoint(ckpt, np.random.default_rng(11))
    ids = V41Hasher(CFG, np.arange(100))(np.random.default_rng(12).integers(0, 100, size=(3, 5)))[:, :, 1]
    ids = ids.reshape(-1, CFG.cols)
    in_store = V41Engram.from_checkpoint(ckpt, CFG, 3, embedded)
    in_shm = V41Engram.from_checkpoint(ckpt, CFG, 3, local_dir=tmp_path / "shm")
    on_ssd = V41Engram.from_checkpoint(ckpt, CFG, 3, disk_dir=tmp_path / "ssd", row_cache_bytes=1 << 20,
                                       cache_scope="host")
    want = in_store.rows(ids[None])
    for engram in (in_shm, on_ssd):
        np.testing.assert_array_equal(engram.rows(ids[None]), want)
    assert in_shm.store.local_dir == str(tmp_path / "shm") and in_shm.store.local_tables() is not None
    assert on_ssd.store.stats()["host_cache_attaches"] >= 1
    packed = [np.empty((ids.shape[0], CFG.cols, CFG.row_bytes), np.uint8) for _ in range(3)]
    for engram, out in zip((in_store, in_shm, on_ssd), packed):
        V41Rows(engram.store, CFG, 3).gather_into(ids, out)
    np.testing.assert_array_equal(packed[1], packed[0])
    np.testing.assert_array_equal(packed[2], packed[0])
    again = open_v41_table(ckpt, CFG, 3, local_dir=tmp_path / "shm")  # published: opened, not written again
    assert again.local_tables() is not None
    again.close()
    with pytest.raises(InvalidArgument, match="cache_scope: 'host' shares the row cache of disk_dir layers"):
        V41Engram.from_checkpoint(ckpt, CFG, 3, local_dir=tmp_path / "shm", cache_scope="host")
    with pytest.raises(InvalidArgument, match="store, disk_dir, local_dir: expected exactly one place"):
        open_v41_table(ckpt, CFG, 3, disk_dir=tmp_path / "ssd", local_dir=tmp_path / "shm")
    for engram in (in_store, in_shm, on_ssd):
        engram.close()
