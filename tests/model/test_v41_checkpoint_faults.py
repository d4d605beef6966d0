"""Malformed V4.1 checkpoints: safetensors headers whose tensors overlap, leave holes, overflow their sizes or nest
too deeply are refused, naming the file and the tensor, by the reader and by engram-load-v41."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from engram_model.v41 import SafetensorsCheckpoint, V41Config
from engram_model.v41.load import main as load_main
from engram_store import InvalidArgument
from suite_helpers import outcome_within

CFG = V41Config(layer_ids=[1], max_ngram_size=2, n_heads=1, head_dim=32, engram_vocab_size=2,
                compressed_vocab_size=8, hidden_size=32, hc_mult=1)
ROWS = CFG.num_embeddings(1)
WEIGHT, SCALE = "layers.1.engram.embed.weight", "layers.1.engram.embed.scale"


def write_raw(path, header: dict | bytes, data: bytes) -> None:
    """A safetensors file of exactly this header (a dict, or JSON text as it is) and data section."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def table_header(weight_offsets, scale_offsets, scale_shape=(ROWS, 1)) -> dict:
    return {WEIGHT: {"dtype": "F8_E4M3", "shape": [ROWS, 32], "data_offsets": list(weight_offsets)},
            SCALE: {"dtype": "F8_E8M0", "shape": list(scale_shape), "data_offsets": list(scale_offsets)}}


def write_config(directory) -> None:
    text = {"engram_layer_ids": [1], "engram_max_ngram_size": 2, "engram_n_heads": 1, "engram_head_dim": 32,
            "engram_vocab_size": 2, "engram_compressed_vocab_size": 8, "engram_pad_id": 2, "hidden_size": 32,
            "hc_mult": 1, "rms_norm_eps": 1e-6, "engram_num_embeddings": [ROWS]}
    (directory / "config.json").write_text(json.dumps({"text_config": text}))


def test_a_well_formed_table_loads(tmp_path):
    write_config(tmp_path)
    data = bytes(ROWS * 32) + bytes([127]) * ROWS
    write_raw(tmp_path / "model.safetensors", table_header((0, ROWS * 32), (ROWS * 32, ROWS * 33)), data)
    assert load_main([str(tmp_path), "--disk-dir", str(tmp_path / "ssd"), "--no-progress"]) == 0


def test_overlapping_tensors_are_refused_naming_both(tmp_path, capsys):
    write_config(tmp_path)
    file = tmp_path / "model.safetensors"
    # the scale bytes are the weight's last ROWS bytes: the table would be built of garbage
    write_raw(file, table_header((0, ROWS * 32), (ROWS * 31, ROWS * 32)), bytes([127]) * (ROWS * 32))
    message = (rf"{file}: tensor '{SCALE}' has data_offsets \[{ROWS * 31}, {ROWS * 32}\], which overlap tensor "
               rf"'{WEIGHT}' at \[0, {ROWS * 32}\]")
    with pytest.raises(InvalidArgument, match=message):
        SafetensorsCheckpoint(file)
    assert load_main([str(tmp_path), "--disk-dir", str(tmp_path / "ssd"), "--no-progress"]) == 2  # a bad CHECKPOINT_DIR: a usage error
    assert "overlap tensor" in capsys.readouterr().err
    assert not (tmp_path / "ssd" / "layer-1").exists()


def test_holes_and_trailing_bytes_are_refused(tmp_path):
    file = tmp_path / "hole.safetensors"
    write_raw(file, table_header((0, ROWS * 32), (ROWS * 32 + 8, ROWS * 33 + 8)), bytes(ROWS * 33 + 8))
    with pytest.raises(InvalidArgument, match=rf"{file}: bytes \[{ROWS * 32}, {ROWS * 32 + 8}\) of the data belong "
                                              rf"to no tensor \(between '{WEIGHT}' and '{SCALE}'\)"):
        SafetensorsCheckpoint(file)
    file = tmp_path / "head.safetensors"
    write_raw(file, table_header((8, ROWS * 32 + 8), (ROWS * 32 + 8, ROWS * 33 + 8)), bytes(ROWS * 33 + 8))
    with pytest.raises(InvalidArgument, match=rf"{file}: bytes \[0, 8\) of the data belong to no tensor \(before "
                                              rf"'{WEIGHT}'\)"):
        SafetensorsCheckpoint(file)
    file = tmp_path / "tail.safetensors"
    write_raw(file, table_header((0, ROWS * 32), (ROWS * 32, ROWS * 33)), bytes(ROWS * 33 + 16))
    with pytest.raises(InvalidArgument, match=rf"{file}: bytes \[{ROWS * 33}, {ROWS * 33 + 16}\) of the data belong "
                                              rf"to no tensor \(after '{SCALE}'\)"):
        SafetensorsCheckpoint(file)


def test_a_shape_whose_size_overflows_int64_is_refused(tmp_path):
    file = tmp_path / "model.safetensors"
    header = {"huge": {"dtype": "U8", "shape": [2 ** 62, 4], "data_offsets": [0, 0]}}  # 2**64 bytes: 0 in int64
    write_raw(file, header, b"")
    with pytest.raises(InvalidArgument, match=rf"{file}: tensor 'huge' spans 0 bytes, but U8 \[{2 ** 62}, 4\] needs "
                                              rf"{2 ** 64}"):
        SafetensorsCheckpoint(file)
    write_raw(file, {"huge": {"dtype": "U8", "shape": [2 ** 64, 0], "data_offsets": [0, 0]}}, b"")
    with pytest.raises(InvalidArgument, match="tensor 'huge' has a bad shape"):
        SafetensorsCheckpoint(file)


def test_a_deeply_nested_header_is_a_clear_error(tmp_path, capsys):
    write_config(tmp_path)
    file = tmp_path / "model.safetensors"
    depth = 200_000
    write_raw(file, b'{"a": ' + b"[" * depth + b"]" * depth + b"}", b"")
    with pytest.raises(InvalidArgument, match=rf"{file}: not a safetensors file \(the header nests deeper than "):
        SafetensorsCheckpoint(file)
    assert load_main([str(tmp_path), "--disk-dir", str(tmp_path / "ssd"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "nests deeper" in err and "Traceback" not in err and "RecursionError" not in err
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(InvalidArgument, match="model.safetensors.index.json: not a safetensors index "
                                              r"\(it nests deeper than "):
        SafetensorsCheckpoint(shards)


def test_a_deeply_nested_config_json_is_a_clear_error(tmp_path):
    from engram_model.v41 import V41Config
    from engram_store import ConfigError

    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match="nested too deeply to be a config.json"):
        V41Config.from_hf_config(tmp_path)


@pytest.mark.parametrize("where", ["shard", "index", "config", "file"])
def test_a_named_pipe_in_a_checkpoint_is_refused_without_blocking(tmp_path, where):
    """A FIFO as a shard (or index, or config.json) hung the loader for ever in its open; each is refused by name."""
    import os

    write_config(tmp_path)
    names = {"shard": "model.safetensors", "index": "model.safetensors.index.json", "config": "config.json",
             "file": "model.safetensors"}
    if where == "index":
        write_raw(tmp_path / "model-1.safetensors", table_header((0, ROWS * 32), (ROWS * 32, ROWS * 33)),
                  bytes(ROWS * 33))
    if where == "config":
        (tmp_path / "config.json").unlink()
    pipe = tmp_path / names[where]
    os.mkfifo(pipe)
    opened = {"config": lambda: V41Config.from_hf_config(tmp_path), "file": lambda: SafetensorsCheckpoint(pipe)}
    raised = outcome_within(opened.get(where, lambda: SafetensorsCheckpoint(tmp_path)), 20, f"opening the {where}")
    assert isinstance(raised, InvalidArgument) and f"{pipe}: is a named pipe, not a checkpoint file" in str(raised), \
        raised


def test_a_directory_as_a_shard_is_refused_by_name(tmp_path):
    """It raised a raw IsADirectoryError."""
    write_config(tmp_path)
    (tmp_path / "model.safetensors").mkdir()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {WEIGHT: "model.safetensors",
                                                                                      SCALE: "model.safetensors"}}))
    with pytest.raises(InvalidArgument, match=rf"{tmp_path}/model.safetensors: is a directory, not a checkpoint file"):
        SafetensorsCheckpoint(tmp_path).info(WEIGHT)
