"""``engram-load-v41 --local-dir``: a checkpoint's Engram tables as files in memory, the directory that
``ENGRAM_TABLES`` serves to the engines."""
from __future__ import annotations

import numpy as np
import pytest

from engram_model.v41 import SafetensorsCheckpoint, V41Config, V41Rows, v41_store_config, write_toy_checkpoint
from engram_model.v41.load import main as load_main
from engram_store import EngramStore

CONFIG = V41Config(layer_ids=[1, 14], n_heads=2, head_dim=64, engram_vocab_size=300, compressed_vocab_size=100,
                   hidden_size=64)


@pytest.mark.timeout(120)
def test_local_dir_holds_the_checkpoints_rows_and_refuses_a_second_load(tmp_path, capsys):
    write_toy_checkpoint(tmp_path / "ckpt", CONFIG)
    target = tmp_path / "tables"
    assert load_main([str(tmp_path / "ckpt"), "--local-dir", str(target), "--no-progress"]) == 0
    out = capsys.readouterr()
    assert f"layer 14: 6 columns, {CONFIG.num_embeddings(14)} rows" in out.out
    ckpt = SafetensorsCheckpoint(str(tmp_path / "ckpt"))
    for layer_id in CONFIG.layer_ids:
        codes = ckpt.raw(f"layers.{layer_id}.engram.embed.weight")
        scales = ckpt.raw(f"layers.{layer_id}.engram.embed.scale")
        with EngramStore(layer_id, v41_store_config(CONFIG, layer_id), local_dir=target) as table:
            ids = np.arange(CONFIG.num_embeddings(layer_id))
            got_codes, got_scales = np.empty_like(codes), np.empty_like(scales)
            V41Rows(table, CONFIG, layer_id).gather_into(ids, got_codes, scales_out=got_scales)
            assert np.array_equal(got_codes, codes) and np.array_equal(got_scales, scales)
    assert load_main([str(tmp_path / "ckpt"), "--local-dir", str(target), "--layers", "1", "--no-progress"]) == 1
    assert "engram-layers remove --local-dir" in capsys.readouterr().err


def test_local_dir_refuses_what_it_cannot_hold_before_writing_and_warns_off_memory(tmp_path, capsys, monkeypatch):
    import os

    write_toy_checkpoint(tmp_path / "ckpt", CONFIG)
    target = tmp_path / "tables"
    statvfs = os.statvfs(tmp_path)
    tiny = os.statvfs_result((statvfs.f_bsize, 4096, *statvfs[2:3], 0, 0, *statvfs[5:]))
    monkeypatch.setattr(os, "statvfs", lambda path: tiny)
    assert load_main([str(tmp_path / "ckpt"), "--local-dir", str(target), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "--local-dir" in err and "the layers need" in err and "--shm-size" in err and not target.exists()


def test_verify_is_refused_with_local_dir(tmp_path, capsys):
    assert load_main([str(tmp_path), "--local-dir", str(tmp_path / "t"), "--verify"]) == 2
    assert "--verify" in capsys.readouterr().err
