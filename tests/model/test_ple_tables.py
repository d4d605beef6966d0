"""Rows without per-row scales through every table kind: a toy Qwen4-Exp checkpoint (160-byte e4m3 rows with one
table scale, and 320-byte bf16 rows) loaded into in-process arrays, local_dir, disk_dir (no cache, a process cache,
the host cache, a head shard), store segments (mapped here, read remotely, head shards) and read back bit for bit;
the RowFormat description and the decode of table-scaled rows (against ml_dtypes, and the engines' formula in torch
where it is installed)."""
from __future__ import annotations

import numpy as np
import pytest

from engram_model import RowFormat, decode_rows
from engram_model.ple import PLEConfig, load_ple_table, ple_store_config, write_toy_checkpoint
from engram_model.ple._toy import toy_tensors
from engram_store import DistributedStore, EngramStore, InvalidArgument, InvalidType

LAYER = 2


def config_of(dtype: str) -> PLEConfig:
    """The release's row width (160 values) over small prime heads; 64 row-range shards crossing head bounds."""
    return PLEConfig(ple_layer_ids=[LAYER], vocab_size=500, eos_token_id=5, ngram_vocab_size_base=300, hidden_size=8,
                     hc_count=2, ple_embed_dim=2560, split_ngram_parts=64, ple_embedding_dtype=dtype)


def checkpoint_table(config: PLEConfig) -> np.ndarray:
    """The layer's whole table as the checkpoint's shards hold it (rows of the store's dtype)."""
    prefix = f"model.language_model.layers.{LAYER - 1}.ple.ple_embedding.ngram_embedding.shard_"
    tensors = toy_tensors(config)
    shards = sorted((n for n in tensors if n.startswith(prefix)), key=lambda n: int(n[len(prefix):].split(".")[0]))
    return np.concatenate([tensors[n][1] for n in shards])


def read_every_row(table: EngramStore, config: PLEConfig, heads: list[int]) -> list[np.ndarray]:
    """Every row of each of ``heads`` (the store's own heads), read by lookup."""
    sizes = table.get_table_vocab_sizes()
    out = []
    for j, _ in enumerate(heads):
        ids = np.zeros((sizes[j], 1, len(heads)), dtype=np.int64)
        ids[:, 0, j] = np.arange(sizes[j])
        out.append(table.lookup(ids)[:, 0, j])
    return out


def check(table: EngramStore, config: PLEConfig, heads: list[int] | None = None) -> None:
    heads = list(range(config.heads)) if heads is None else heads
    full = checkpoint_table(config)
    buffers = config.hash_buffers(LAYER)
    for h, got in zip(heads, read_every_row(table, config, heads)):
        expect = full[buffers.offsets[h]:buffers.offsets[h] + buffers.sizes[h]]
        assert got.dtype == config.row_format.dtype and got.shape == expect.shape
        np.testing.assert_array_equal(got, expect)
    assert table.get_row_bytes() == config.row_bytes


KINDS = ["arrays", "local_dir", "disk_dir", "disk_dir_cache", "disk_dir_host", "disk_dir_shard", "store_local",
         "store_remote", "store_shard"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_table_kind_reads_back_the_checkpoints_rows(kind, dtype, tmp_path):
    config = config_of(dtype)
    ckpt = write_toy_checkpoint(tmp_path / "ckpt", config)
    layout = ple_store_config(config, LAYER)
    assert layout.row_format == config.row_format.store_row_format
    if kind == "arrays":
        full, b = checkpoint_table(config), config.hash_buffers(LAYER)
        with EngramStore(LAYER, layout, None) as table:
            table.bind_local([full[o:o + n] for o, n in zip(b.offsets, b.sizes)])
            check(table, config)
        return
    if kind.startswith("store"):
        with DistributedStore.embedded(segment_size="16MiB", local_direct=kind != "store_remote",
                                       timeout_ms=60_000) as store:  # reads wait out a loaded machine
            load_ple_table(ckpt, config, LAYER, store, progress=False).close()
            heads = [3, 7, 15] if kind == "store_shard" else None
            with EngramStore(LAYER, layout, store, heads=heads) as table:
                check(table, config, heads)
                assert table.verify() == (heads or list(range(16)))
        return
    where = {"local_dir": tmp_path / "shm"} if kind == "local_dir" else {"disk_dir": tmp_path / "ssd"}
    load_ple_table(ckpt, config, LAYER, progress=False, **{k: str(v) for k, v in where.items()}).close()
    options = {"disk_dir_cache": {"row_cache_bytes": 1 << 20}, "disk_dir_host": {"row_cache_bytes": 1 << 20,
                                                                                 "cache_scope": "host"},
               "disk_dir_shard": {"heads": [0, 8, 9]}}.get(kind, {})
    with EngramStore(LAYER, layout, None, **where, **options) as table:
        for _ in range(2):  # a cache fills on the first pass and serves the second
            check(table, config, options.get("heads"))
        if "row_cache_bytes" in options:
            assert table.stats()["cache_hits"] > 0


def test_bf16_rows_fill_an_engines_bf16_tensor_in_place(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is not installed: the bf16 tensor buffer case skips")
    config = config_of("bfloat16")
    table = load_ple_table(write_toy_checkpoint(tmp_path / "ckpt", config), config, LAYER,
                           local_dir=str(tmp_path / "shm"))
    with table:
        ids = np.zeros((5, 1, 16), dtype=np.int64)
        ids[:, 0, :] = np.arange(5)[:, None]
        out = torch.empty((5, 1, 16, 160), dtype=torch.bfloat16)
        table.lookup_into(ids, out)
        np.testing.assert_array_equal(out.view(torch.int16).numpy().view(np.uint16), table.lookup(ids))


def test_the_row_format_description():
    v41 = RowFormat(256, "e4m3", "block", 32)
    assert (v41.row_bytes, v41.scale_bytes, v41.store_row_format, v41.store_dim) == (264, 8, "bytes", 264)
    fp8, bf16 = RowFormat(160, "e4m3", "table"), RowFormat(160, "bf16")
    assert (fp8.row_bytes, fp8.store_row_format, fp8.store_dim, fp8.dtype) == (160, "bytes", 160, np.uint8)
    assert (bf16.row_bytes, bf16.store_row_format, bf16.store_dim, bf16.dtype) == (320, "bfloat16", 160, np.uint16)
    assert bf16.store_config([3, 4]).row_bytes == 320 and fp8.store_config([3, 4]).row_bytes == 160
    assert RowFormat.blocks_of(264, 32) == v41 and str(fp8) == "160 e4m3 values, one scale per table (160 B)"
    for kwargs, words in [(dict(values=0), "values: expected an integer >= 1"),
                          (dict(values=8, codes="e5m2"), "codes: expected one of"),
                          (dict(values=8, scale="row"), "scale: expected one of"),
                          (dict(values=8, codes="bf16", scale="table"), "bf16 rows carry no scales"),
                          (dict(values=8, scale="block", block=3), "block: expected a divisor of values = 8"),
                          (dict(values=8, scale="table", block=4), "only block scales have a block size")]:
        with pytest.raises(InvalidArgument, match=words):
            RowFormat(**kwargs)
    with pytest.raises(InvalidArgument, match="a multiple of 33"):
        RowFormat.blocks_of(260, 32)
    rows = np.zeros((4, 8), np.uint8)
    rows[2, 5] = 0xFF
    assert RowFormat(8, "e4m3", "table").first_bad_row(rows) == 2
    assert "e4m3 NaN code 0xFF at value 5" in RowFormat(8, "e4m3", "table").why_bad(rows[2])
    bits = np.zeros((3, 8), np.uint16)
    bits[1, 2] = 0xFF80  # -infinity
    assert RowFormat(8, "bf16").first_bad_row(bits) == 1 and "infinity" in RowFormat(8, "bf16").why_bad(bits[1])
    scaled = np.zeros((2, 10), np.uint8)
    scaled[1, 8] = 255
    assert RowFormat(8, "e4m3", "block", 4).first_bad_row(scaled) == 1


def test_table_scaled_rows_decode_as_the_engines_do():
    """``bf16(e4m3) * bf16(scale)``, rounded to bf16: every code, scales of every kind."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes (the test extra) is the oracle of float8/bf16")
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].reshape(1, -1)
    fmt = RowFormat(codes.shape[1], "e4m3", "table")
    for scale in (1.0, 0.0123456, 3.7e-5, 250.0):
        got = decode_rows(codes, fmt, scale)
        values = codes.view(ml_dtypes.float8_e4m3fn).astype(ml_dtypes.bfloat16)
        expect = (values * np.array(scale, dtype=ml_dtypes.bfloat16)).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(got, expect)
    torch = pytest.importorskip("torch", reason="torch is not installed: the engines' formula in torch skips")
    scale = 0.0123456
    engine = (torch.from_numpy(codes).view(torch.float8_e4m3fn).to(torch.bfloat16)
              * torch.tensor([scale], dtype=torch.float32).to(torch.bfloat16)).float().numpy()
    np.testing.assert_array_equal(decode_rows(codes, fmt, scale), engine)
    bits = np.array([[0x3F80, 0xC040, 0x0001]], dtype=np.uint16)
    np.testing.assert_array_equal(decode_rows(bits, RowFormat(3, "bf16")), np.array([[1.0, -3.0, 2.0 ** -133]],
                                                                                   np.float32))


def test_decode_refusals():
    fmt = RowFormat(4, "e4m3", "table")
    with pytest.raises(InvalidArgument, match="table_scale: expected the table's finite scale"):
        decode_rows(np.zeros((1, 4), np.uint8), fmt)
    with pytest.raises(InvalidArgument, match="has block scales"):
        decode_rows(np.zeros((1, 5), np.uint8), RowFormat(4, "e4m3", "block", 4))
    with pytest.raises(InvalidType, match="rows: expected a uint8 NumPy array"):
        decode_rows(np.zeros((1, 4), np.uint16), fmt, 1.0)
    with pytest.raises(InvalidArgument, match="rows: expected a last axis of 4"):
        decode_rows(np.zeros((1, 5), np.uint8), fmt, 1.0)
    with pytest.raises(InvalidArgument, match="table_scale: bf16 rows have no scale"):
        decode_rows(np.zeros((1, 4), np.uint16), RowFormat(4, "bf16"), 2.0)
