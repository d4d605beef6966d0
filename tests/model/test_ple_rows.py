"""PLERows: Qwen4-Exp PLE rows in the engines' conventions, bit for bit, from every table kind into every buffer kind.

The oracles are NumPy transcriptions of the engines' released kernels, line by line (``model_helpers``):
vLLM 0.33.0's ``_lookup_ple_embedding_from_pinned_kernel`` (the raw rows of a rank's contiguous row range, zeros for
other ids) and SGLang 0.5.23's ``_gather_ple_embedding_from_pinned_kernel`` (the rows as bf16, zeros for other ids),
each over the rank's own table (the layer's rows ``[vocab_start, vocab_end)``, padding rows included), and their
vocabulary-parallel cut (``VocabParallelEmbedding._get_indices``). tests/model/test_ple_rows_engines.py holds the
same calls to the engines' own kernels where they are installed.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import model_helpers as ref
from engram_model.ple import (BoundRows, PLEConfig, PLEHasher, PLERows, RowsHandle, load_ple_hash_buffers,
                              load_ple_table, ple_rank_rows, ple_store_config, write_toy_checkpoint)
from engram_model.ple._toy import toy_tensors
from engram_store import DistributedStore, EngramStore, InvalidArgument, InvalidType, TableClosed

LAYER = 2
DTYPES = ["float8_e4m3fn", "bfloat16"]


CONFIGS = {dtype: ref.ple_rows_config(dtype) for dtype in DTYPES}
BUFFERS = CONFIGS[DTYPES[0]].hash_buffers(LAYER)
HEADED = sum(BUFFERS.sizes)                      # rows the heads hold
ROWS = BUFFERS.rows                              # the table's rows, padding included
BOUNDS = np.append(BUFFERS.offsets, HEADED)


TABLES = {dtype: ref.ple_random_table(CONFIGS[dtype]) for dtype in DTYPES}


def heads_of(table: np.ndarray) -> list[np.ndarray]:
    return [table[BOUNDS[h]:BOUNDS[h + 1]] for h in range(16)]


def hasher_ids(rng, T: int) -> np.ndarray:
    """``[T, 16]`` as the hashers give them: head h's ids in head h's rows."""
    return np.stack([rng.integers(BOUNDS[h], BOUNDS[h + 1], T) for h in range(16)], axis=1)


def any_ids(rng, shape, windows=()) -> np.ndarray:
    """Ids anywhere in the heads (other heads', other ranks'), -1, and the rows on both sides of each window's
    ends."""
    ids = rng.integers(-1, HEADED, shape)
    edges = np.array([e + d for w in windows for e in w for d in (-1, 0)] + [-1, 0, HEADED - 1], np.int64)
    edges = edges[(edges >= -1) & (edges < HEADED)]
    flat = ids.reshape(-1)
    at = rng.choice(flat.size, min(flat.size, edges.size), replace=False)
    flat[at] = rng.permutation(edges)[:at.size]
    return ids


def expected(dtype: str, ids: np.ndarray, start: int, end: int, raw: bool, table=None) -> np.ndarray:
    """What the engine gives: vLLM's raw bytes (as the store's dtype) or SGLang's bf16 bits, over the rank's
    table ``table[start:end]``."""
    weight = (TABLES[dtype] if table is None else table)[start:end]
    if raw:
        store = weight.dtype
        return ref.vllm_ple_lookup(weight.view(np.uint8), ids, start, end).view(store)
    return ref.sglang_ple_gather(weight, ids, start, end)


def check_forms(rows: PLERows, dtype: str, rng, windows, calls: int = 3, table=None) -> None:
    """Raw (uint8 bytes) and bf16 forms over each window, ids of both kinds and both dtypes."""
    for i in range(calls):
        T = int(rng.integers(1, 9))
        ids = hasher_ids(rng, T) if i % 2 == 0 else any_ids(rng, (T, 16), windows)
        ids = ids.astype(np.int32 if i == 1 else np.int64)
        for start, end in windows:
            raw = np.full((T, 16, CONFIGS[dtype].row_bytes), 7, np.uint8)
            assert rows.gather_into(ids, raw, row_start=start, row_end=end) is raw
            want = expected(dtype, ids, start, end, True, table)
            np.testing.assert_array_equal(raw.view(want.dtype), want)
            bf16 = np.full((T, 16, 160), 7, ml_dtypes.bfloat16)
            rows.gather_into(ids, bf16, row_start=start, row_end=end)
            np.testing.assert_array_equal(bf16.view(np.uint16), expected(dtype, ids, start, end, False, table))


def rank_windows(ranks: int = 4) -> list[tuple[int, int]]:
    return [(0, ROWS)] + [ple_rank_rows(CONFIGS[DTYPES[0]], LAYER, r, ranks)[:2] for r in range(ranks)]


# ---- from memory: both forms, hypothesis ----------------------------------------------------------------


@pytest.fixture(scope="module", params=DTYPES)
def in_memory(request):
    dtype = request.param
    with EngramStore(LAYER, ple_store_config(CONFIGS[dtype], LAYER), None) as es:
        es.bind_local(heads_of(TABLES[dtype]))
        yield dtype, PLERows(es, CONFIGS[dtype], LAYER, threads=2)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), T=st.integers(1, 10), own=st.booleans(), flat=st.booleans(),
       dtype=st.sampled_from([np.int32, np.int64]), a=st.integers(0, ROWS), b=st.integers(0, ROWS),
       whole=st.booleans())
def test_gathers_match_vllm_and_sglang(in_memory, seed, T, own, flat, dtype, a, b, whole):
    table_dtype, rows = in_memory
    rng = np.random.default_rng(seed)
    start, end = (0, None) if whole else (min(a, b), max(a, b))
    ids = (hasher_ids(rng, T) if own else any_ids(rng, (T, 16), [(start, end or ROWS)])).astype(dtype)
    if flat:
        ids = ids.reshape(-1)
    raw = np.empty(ids.shape + (CONFIGS[table_dtype].row_bytes,), np.uint8)
    rows.gather_into(ids, raw, row_start=start, row_end=end)
    want = expected(table_dtype, ids, start, ROWS if end is None else end, True)
    np.testing.assert_array_equal(raw.view(want.dtype), want)
    bits = np.empty(ids.shape + (160,), np.uint16)
    rows.gather_into(ids, bits, row_start=start, row_end=end)
    np.testing.assert_array_equal(bits, expected(table_dtype, ids, start, ROWS if end is None else end, False))


def test_every_e4m3_code_as_sglangs_bf16():
    """All 256 codes of one row through the bf16 form: ml_dtypes' value for the 254 finite ones, and for the NaN
    codes 0x7FC0 (torch's conversion on the CPU; no loaded table holds them)."""
    config = CONFIGS["float8_e4m3fn"]
    table = np.zeros((ROWS, 160), np.uint8)
    table[:2].reshape(-1)[:256] = np.arange(256)
    with EngramStore(LAYER, ple_store_config(config, LAYER), None) as es:
        es.bind_local(heads_of(table))
        out = np.empty((2, 160), np.uint16)
        PLERows(es, config, LAYER).gather_into(np.array([0, 1]), out)
    got = out.reshape(-1)[:256]
    finite = (np.arange(256) & 0x7F) != 0x7F
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(got[finite], want[finite])
    assert (got[~finite] == 0x7FC0).all()


def test_large_gathers_split_over_threads_give_the_same_rows():
    dtype = "float8_e4m3fn"
    ids = hasher_ids(np.random.default_rng(3), 1500)                          # 24,000 rows: over the threshold
    with EngramStore(LAYER, ple_store_config(CONFIGS[dtype], LAYER), None) as es:
        es.bind_local(heads_of(TABLES[dtype]))
        one, many = PLERows(es, CONFIGS[dtype], LAYER, threads=1), PLERows(es, CONFIGS[dtype], LAYER, threads=3)
        a, b = (np.empty((1500, 16, 160), np.uint16) for _ in range(2))
        one.gather_into(ids, a, row_start=1000, row_end=4000)
        many.gather_into(ids, b, row_start=1000, row_end=4000)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, expected(dtype, ids, 1000, 4000, False))


def test_rows_off_8_byte_boundaries_are_copied_byte_by_byte_alike():
    """Tables and buffers that do not start on an 8-byte boundary take the byte-wise copy (rows are otherwise copied
    a word at a time): the same rows."""
    dtype = "float8_e4m3fn"
    rng = np.random.default_rng(8)
    ids = any_ids(rng, (9, 16), rank_windows())
    odd = np.empty(TABLES[dtype].nbytes + 1, np.uint8)[1:].reshape(TABLES[dtype].shape)   # an odd address
    odd[:] = TABLES[dtype]
    for table in (TABLES[dtype], odd):
        with EngramStore(LAYER, ple_store_config(CONFIGS[dtype], LAYER), None) as es:
            es.bind_local(heads_of(table))
            rows = PLERows(es, CONFIGS[dtype], LAYER)
            for shift in (0, 3):
                out = np.empty(ids.size * 160 + shift, np.uint8)[shift:].reshape(9, 16, 160)
                rows.gather_into(ids, out, row_start=700, row_end=4000)
                np.testing.assert_array_equal(out, expected(dtype, ids, 700, 4000, True))


# ---- every table kind -------------------------------------------------------------------------------------


KINDS = ["local_dir", "disk_dir", "disk_dir_host", "disk_dir_shard", "store_local", "store_remote", "store_shard"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_every_table_kind_gives_the_engines_rows(kind, dtype, tmp_path):
    config, rng = CONFIGS[dtype], np.random.default_rng(len(kind))
    layout = ple_store_config(config, LAYER)
    windows = rank_windows()
    shard = ple_rank_rows(config, LAYER, 1, 4)                                 # rank 1 of 4: heads 4..8
    if kind.endswith("shard"):
        windows = [shard[:2]]
    if kind.startswith("store"):
        with DistributedStore.embedded(segment_size="16MiB", local_direct=kind != "store_remote",
                                       timeout_ms=60_000) as store:
            with EngramStore(LAYER, layout, store) as es:
                es.populate(heads_of(TABLES[dtype]))
            with EngramStore(LAYER, layout, store, heads=shard.heads if kind == "store_shard" else None) as es:
                rows = PLERows(es, config, LAYER)
                check_forms(rows, dtype, rng, windows)
                assert (rows.memory_gathers > 0) == (kind != "store_remote")
                assert (rows.staged_gathers > 0) == (kind == "store_remote")
        return
    where = {"local_dir": tmp_path} if kind == "local_dir" else {"disk_dir": tmp_path}
    with EngramStore(LAYER, layout, None, **where) as es:
        es.populate(heads_of(TABLES[dtype]))
    options = {"disk_dir_host": {"row_cache_bytes": 1 << 20, "cache_scope": "host"},
               "disk_dir_shard": {"heads": shard.heads}}.get(kind, {})
    with EngramStore(LAYER, layout, None, **where, **options) as es:
        rows = PLERows(es, config, LAYER)
        check_forms(rows, dtype, rng, windows)
        assert (rows.memory_gathers > 0) == (kind == "local_dir")


@pytest.mark.timeout(120)
def test_from_the_released_layout_to_vllms_rows(tmp_path):
    """A toy FP8 checkpoint in the released layout, loaded by engram-load's loader; its hash ids (the checkpoint's
    buffers) gathered for each of 2 ranks equal vLLM's lookup over the rank's rows of the checkpoint's shards, and
    the sum of the ranks' rows (vLLM's all-reduce) is the whole table's."""
    config = CONFIGS["float8_e4m3fn"]
    ckpt = write_toy_checkpoint(tmp_path / "ckpt", config)
    prefix = f"model.language_model.layers.{LAYER - 1}.ple.ple_embedding.ngram_embedding.shard_"
    tensors = toy_tensors(config)
    names = sorted((n for n in tensors if n.startswith(prefix)), key=lambda n: int(n[len(prefix):].split(".")[0]))
    whole = np.concatenate([tensors[n][1] for n in names])                       # the checkpoint's table
    buffers = load_ple_hash_buffers(ckpt, config)
    ids = PLEHasher(config, buffers)(np.random.default_rng(1).integers(0, 500, (3, 7)))[:, :, 0]   # [3, 7, 16]
    with load_ple_table(ckpt, config, LAYER, local_dir=str(tmp_path / "shm")) as table:
        rows = PLERows(table, config, LAYER, buffers=buffers[LAYER])
        reduced = np.zeros(ids.shape + (160,), np.uint8)
        for rank in range(2):
            start, end, _ = ple_rank_rows(config, LAYER, rank, 2)
            out = np.empty(ids.shape + (160,), np.uint8)
            rows.gather_into(ids, out, row_start=start, row_end=end)
            np.testing.assert_array_equal(out, ref.vllm_ple_lookup(whole[start:end], ids, start, end))
            reduced += out                                                         # each row has one owner
        np.testing.assert_array_equal(reduced, whole[ids])


class WrittenOver(EngramStore):
    """A store whose in-place read ran but must not be used, as ``EngramStore.read_local`` answers where a store's
    table was removed or written over while it was read."""

    def read_local(self, read, *, layer=None):
        read(self.local_tables(layer=layer))
        return False

    def held_tables(self, *, layer=None):
        return None  # (a store's tables mapped here: read through read_local, never held)


def test_rows_read_in_place_that_the_store_disowns_are_read_again_the_staged_way():
    dtype = "float8_e4m3fn"
    with WrittenOver(LAYER, ple_store_config(CONFIGS[dtype], LAYER), None) as es:
        es.bind_local(heads_of(TABLES[dtype]))
        rows = PLERows(es, CONFIGS[dtype], LAYER)
        ids = any_ids(np.random.default_rng(9), (6, 16), rank_windows())
        out = np.empty((6, 16, 160), np.uint16)
        rows.gather_into(ids, out, row_start=100, row_end=4000)
        np.testing.assert_array_equal(out, expected(dtype, ids, 100, 4000, False))
        assert (rows.memory_gathers, rows.staged_gathers) == (0, 1)


# ---- ranks --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [1, 2, 4, 8, 64])
def test_rank_rows_are_the_engines_cut(ranks):
    config = CONFIGS["bfloat16"]
    for padding, engine_padding in ((None, config.make_ngram_vocab_size_divisible_by), (64, 64)):
        cover = []
        for rank in range(ranks):
            got = ple_rank_rows(config, LAYER, rank, ranks, padding=padding)
            assert got[:2] == ref.vocab_parallel_range(ROWS, engine_padding, rank, ranks)
            assert got.heads == [h for h in range(16) if BOUNDS[h] < got.row_end and BOUNDS[h + 1] > got.row_start]
            cover.append(got[:2])
        assert cover[0][0] == 0 and cover[-1][1] == ROWS
        assert all(a[1] == b[0] for a, b in zip(cover, cover[1:]))
    with pytest.raises(InvalidArgument, match=f"ranks: the engines cut the {ROWS} padded rows of layer 2 into equal "
                                              "shares; 5 does not divide them"):
        ple_rank_rows(config, LAYER, 0, 5)
    with pytest.raises(InvalidArgument, match=r"rank, ranks: expected 0 <= rank < ranks, got rank=4, ranks=4"):
        ple_rank_rows(config, LAYER, 4, 4)


# ---- buffers -----------------------------------------------------------------------------------------------


def test_slices_of_a_batch_buffer_and_ml_dtypes_codes(in_memory):
    dtype, rows = in_memory
    rng = np.random.default_rng(5)
    ids = hasher_ids(rng, 6)
    batch = np.zeros((10, 16, 160), ml_dtypes.bfloat16)                        # a prefetch buffer's first rows
    rows.gather_into(ids, batch[:6])
    np.testing.assert_array_equal(batch[:6].view(np.uint16), expected(dtype, ids, 0, ROWS, False))
    assert not batch[6:].view(np.uint16).any()
    if dtype == "float8_e4m3fn":
        codes = np.empty((6, 16, 160), ml_dtypes.float8_e4m3fn)
        rows.gather_into(ids, codes, row_start=100, row_end=3000)
        np.testing.assert_array_equal(codes.view(np.uint8), expected(dtype, ids, 100, 3000, True))
    layered = np.zeros((6, 2, 16, 160), np.uint16)                             # one layer's slice of two
    with pytest.raises(InvalidArgument, match=r"out: expected a buffer whose leading axes \[6, 16\] can be viewed"):
        rows.gather_into(ids, layered[:, 1])
    assert not layered.any()


def test_torch_ids_and_buffers(in_memory):
    torch = pytest.importorskip("torch", reason="torch is an optional extra (pip install -e '.[torch]')")
    dtype, rows = in_memory
    ids = hasher_ids(np.random.default_rng(6), 5)
    own = torch.float8_e4m3fn if dtype == "float8_e4m3fn" else torch.bfloat16
    out = torch.zeros((5, 16, 160), dtype=own)                                 # vLLM's lookup dtype
    assert rows.gather_into(torch.from_numpy(ids), out, row_start=0, row_end=2000) is out
    want = expected(dtype, ids, 0, 2000, True)
    np.testing.assert_array_equal(out.view(torch.uint8 if own == torch.float8_e4m3fn else torch.int16).numpy()
                                  .view(want.dtype), want)
    bf16 = torch.zeros((5, 16, 160), dtype=torch.bfloat16)                     # SGLang's prefetch buffer
    rows.gather_into(torch.from_numpy(ids.astype(np.int32)), bf16, row_start=2000)
    np.testing.assert_array_equal(bf16.view(torch.int16).numpy().view(np.uint16),
                                  expected(dtype, ids, 2000, ROWS, False))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["memory", "disk_dir"])
def test_a_bound_buffer_gives_what_gather_into_gives(kind, dtype, tmp_path):
    """bind(): a decode step's staging buffer and a rank's rows checked once; each step's ids fill out[:T], bit for
    bit the engines' rows, in both forms, from memory and through staged reads; bad ids and shapes are refused,
    writing nothing; a buffer that cannot be seen as rows is refused at bind."""
    config, layout = CONFIGS[dtype], ple_store_config(CONFIGS[dtype], LAYER)
    row_bytes = config.row_format.row_bytes
    where = {} if kind == "memory" else {"disk_dir": tmp_path}
    if where:
        with EngramStore(LAYER, layout, None, **where) as es:
            es.populate(heads_of(TABLES[dtype]))
    with EngramStore(LAYER, layout, None, **where) as es:
        if not where:
            es.bind_local(heads_of(TABLES[dtype]))
        rows = PLERows(es, config, LAYER)
        start, end, _ = ple_rank_rows(config, LAYER, 2, 4)
        rng = np.random.default_rng(10)
        for buffer, raw in ((np.zeros((8, 16, row_bytes), np.uint8), True),
                            (np.zeros((8, 16, 160), ml_dtypes.bfloat16), dtype == "bfloat16")):
            bound = rows.bind(buffer, row_start=start, row_end=end)
            assert isinstance(bound, BoundRows)
            for T in (1, 5, 8, 5):
                ids = any_ids(rng, (T, 16), [(start, end)])
                assert bound(ids.astype(np.int32 if T == 5 else np.int64)) is buffer
                got = buffer[:T].view(np.uint8).view(TABLES[dtype].dtype) if raw else buffer[:T].view(np.uint16)
                np.testing.assert_array_equal(got, expected(dtype, ids, start, end, raw))
            before = buffer.copy()
            last_bad = any_ids(rng, (2, 16), [(start, end)])
            last_bad[1, 15] = HEADED  # (checked before any row is written, the last id as the first)
            for ids, words in ((np.zeros((9, 16), np.int64), r"1 <= T <= 8"), (np.zeros((2, 15), np.int64),
                                                                                 "heads = 16"),
                               (np.full((2, 16), HEADED, np.int64), "is no row of layer 2's heads"),
                               (last_bad, rf"ids\[1, 15\] = {HEADED} is no row of layer 2's heads"),
                               (np.zeros((2, 16), np.float32), "int32 or int64")):
                with pytest.raises((InvalidArgument, InvalidType), match=words):
                    bound(ids)
            np.testing.assert_array_equal(buffer.view(np.uint8), before.view(np.uint8))
    with pytest.raises(InvalidArgument, match="leading axes"):
        rows.bind(np.zeros((4, 2, 16, row_bytes), np.uint8)[:, 1])
    with pytest.raises(InvalidArgument, match=r"out: expected a \[max_T, 16, width\] buffer"):
        rows.bind(np.zeros((4, row_bytes), np.uint8))


@pytest.mark.parametrize("kind", ["memory", "local_dir"])
def test_a_bound_buffer_over_tables_of_this_process_is_one_kernel_call_until_they_close(kind, tmp_path):
    """Over bound arrays or a local_dir's mapped files (memory a read needs no check of), a bound buffer's steps
    after the first are one kernel call on the tables it holds: the same rows, a refused id writes nothing, and once
    the EngramStore closes the next step raises TableClosed instead of reading what it held."""
    dtype = "float8_e4m3fn"
    config, layout = CONFIGS[dtype], ple_store_config(CONFIGS[dtype], LAYER)
    where = {} if kind == "memory" else {"local_dir": tmp_path}
    if where:
        with EngramStore(LAYER, layout, None, **where) as es:
            es.populate(heads_of(TABLES[dtype]))
    es = EngramStore(LAYER, layout, None, **where)
    if not where:
        es.bind_local(heads_of(TABLES[dtype]))
    rows = PLERows(es, config, LAYER, threads=1)
    buffer = np.zeros((8, 16, 160), np.uint8)
    bound = rows.bind(buffer)
    rng = np.random.default_rng(12)
    for T in (3, 8, 1):
        ids = any_ids(rng, (T, 16))
        assert bound(ids) is buffer
        np.testing.assert_array_equal(buffer[:T], expected(dtype, ids, 0, ROWS, True))
    assert bound._direct is not None and bound._direct.held.holds()
    gathers = rows.memory_gathers
    bad = any_ids(rng, (2, 16))
    bad[1, 7] = HEADED
    before = buffer.copy()
    with pytest.raises(InvalidArgument, match=rf"ids\[1, 7\] = {HEADED} is no row"):
        bound(bad)
    np.testing.assert_array_equal(buffer, before)
    bound(any_ids(rng, (2, 16)))
    assert rows.memory_gathers == gathers + 2
    ids = any_ids(rng, (3, 16))
    out = np.zeros((3, 16, 160), np.uint8)
    rows.gather_into(ids, out)  # (gather_into reads held tables in place too)
    np.testing.assert_array_equal(out, expected(dtype, ids, 0, ROWS, True))
    assert (rows.memory_gathers, rows.staged_gathers) == (gathers + 3, 0)
    es.close()
    assert not bound._direct.held.holds()
    with pytest.raises(TableClosed):
        bound(any_ids(rng, (2, 16)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_into_a_decode_steps_buffer_binds_it_once_and_gives_the_same_rows(dtype):
    """gather_into with NumPy ids [T, heads] and out [T, heads, width] (a decode step's) goes through a buffer bound
    once, kept by its memory: a fresh view of the same rows each step finds it, the rows are the engines', a refused
    id writes nothing and says what gather_into says; a read-only view of the same memory, other strides, or other
    windows are not taken for it."""
    config, layout = CONFIGS[dtype], ple_store_config(CONFIGS[dtype], LAYER)
    row_bytes = config.row_format.row_bytes
    with EngramStore(LAYER, layout, None) as es:
        es.bind_local(heads_of(TABLES[dtype]))
        rows = PLERows(es, config, LAYER, threads=1)
        staging = np.zeros((8, 16, row_bytes), np.uint8)
        rng = np.random.default_rng(31)
        start, end, _ = ple_rank_rows(config, LAYER, 1, 4)
        for step in range(4):
            ids = any_ids(rng, (8, 16), [(0, ROWS)])
            out = staging[:8]  # a fresh view of the same memory each step
            assert rows.gather_into(ids, out) is out
            np.testing.assert_array_equal(out.view(TABLES[dtype].dtype), expected(dtype, ids, 0, ROWS, True))
        assert len(rows._bound) == 1
        ids = any_ids(rng, (8, 16), [(start, end)])
        rows.gather_into(ids.astype(np.int32), staging, row_start=start, row_end=end)  # another window: its own
        np.testing.assert_array_equal(staging.view(TABLES[dtype].dtype), expected(dtype, ids, start, end, True))
        assert len(rows._bound) == 2
        before = staging.copy()
        bad = any_ids(rng, (8, 16), [(0, ROWS)])
        bad[7, 15] = HEADED
        with pytest.raises(InvalidArgument, match=rf"ids\[7, 15\] = {HEADED} is no row of layer 2's heads"):
            rows.gather_into(bad, staging)
        np.testing.assert_array_equal(staging, before)
        frozen = staging.view()
        frozen.flags.writeable = False
        with pytest.raises(InvalidArgument, match="out: "):
            rows.gather_into(ids, frozen)
        np.testing.assert_array_equal(staging, before)
        # the same memory and shape with other strides (every other byte pair of a wider buffer) is its own buffer
        wide = np.zeros((8, 16, 2 * row_bytes), np.uint8)
        strided = np.lib.stride_tricks.as_strided(wide, (8, 16, row_bytes), wide.strides)
        ids = any_ids(rng, (8, 16), [(0, ROWS)])
        rows.gather_into(ids, strided)
        np.testing.assert_array_equal(wide[:, :, :row_bytes].view(TABLES[dtype].dtype),
                                      expected(dtype, ids, 0, ROWS, True))
        assert not wide[:, :, row_bytes:].any()


def test_a_bound_torch_buffer_takes_torch_ids(in_memory):
    """An engine's pinned staging tensor (bf16) bound once, fed torch ids: the same rows as gather_into."""
    torch = pytest.importorskip("torch", reason="torch is an optional extra (pip install -e '.[torch]')")
    dtype, rows = in_memory
    staging = torch.zeros((6, 16, 160), dtype=torch.bfloat16)
    bound = rows.bind(staging, row_start=2000, row_end=ROWS)
    ids = any_ids(np.random.default_rng(11), (4, 16), [(2000, ROWS)])
    assert bound(torch.from_numpy(ids)) is staging
    got = staging[:4].view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(got, expected(dtype, ids, 2000, ROWS, dtype == "bfloat16").view(np.uint16))


def test_background_gathers_copy_the_ids(in_memory):
    dtype, rows = in_memory
    ids = hasher_ids(np.random.default_rng(7), 4)
    want = expected(dtype, ids, 0, ROWS, False)
    out = np.empty((4, 16, 160), np.uint16)
    handle = rows.gather_into(ids, out, background=True)
    ids[:] = -1  # the caller reuses its ids buffer at once
    assert isinstance(handle, RowsHandle)
    assert handle.wait(timeout=30) is out
    np.testing.assert_array_equal(out, want)


def test_empty_steps_write_nothing(in_memory):
    _, rows = in_memory
    out = np.empty((0, 16, 160), np.uint16)
    assert rows.gather_into(np.zeros((0, 16), np.int64), out) is out


# ---- refusals ----------------------------------------------------------------------------------------------


def _ids(value=0, shape=(2, 16), dtype=np.int64):
    return np.full(shape, value, dtype)


REFUSALS = [
    ("ids past the heads", lambda: (_ids(ROWS), np.empty((2, 16, 160), np.uint16)), {}, InvalidArgument,
     rf"ids\[0, 0\] = {ROWS} is no row of layer 2's heads \(expected -1 or 0 <= id < {HEADED}"),
    ("ids of the padding rows", lambda: (_ids(HEADED), np.empty((2, 16, 160), np.uint16)), {}, InvalidArgument,
     rf"ids\[0, 0\] = {HEADED} is no row of layer 2's heads \(a padding row after the last head"),
    ("ids below -1", lambda: (_ids(-2, (3,)), np.empty((3, 160), np.uint16)), {}, InvalidArgument,
     r"ids\[0\] = -2 is no row"),
    ("float ids", lambda: (_ids(0, dtype=np.float32), np.empty((2, 16, 160), np.uint16)), {}, InvalidType,
     "ids: expected dtype int32 or int64, got float32"),
    ("out of another shape", lambda: (_ids(), np.empty((3, 16, 160), np.uint16)), {}, InvalidArgument,
     r"out: expected \[\*ids.shape, 160\] = \[2, 16, 160\] \(ids \[2, 16\]\), got \[3, 16, 160\]"),
    ("a float32 out", lambda: (_ids(), np.empty((2, 16, 160), np.float32)), {}, InvalidArgument,
     r"out: expected \[\.\.\., \d+\] uint8 or \[\.\.\., 160\] .* got float32 \[2, 16, 160\]"),
    ("a uint8 out of values, not bytes", lambda: (_ids(), np.empty((2, 16, 160), np.uint8)), {"dtype": "bfloat16"},
     InvalidArgument, r"out: expected \[\.\.\., 320\] uint8 or \[\.\.\., 160\] bfloat16"),
    ("a read-only out", lambda: (_ids(), np.broadcast_to(np.uint16(1), (2, 16, 160))), {}, InvalidArgument,
     "out: expected a writable buffer"),
    ("a non-contiguous last axis", lambda: (_ids(), np.empty((2, 16, 320), np.uint16)[..., ::2]), {},
     InvalidArgument, "with the last axis contiguous"),
    ("a window past the table", lambda: (_ids(), np.empty((2, 16, 160), np.uint16)), {"row_end": ROWS + 1},
     InvalidArgument, rf"row_start, row_end: expected 0 <= row_start <= row_end <= {ROWS} .* got row_start=0, "
                      rf"row_end={ROWS + 1}"),
    ("a reversed window", lambda: (_ids(), np.empty((2, 16, 160), np.uint16)), {"row_start": 9, "row_end": 3},
     InvalidArgument, "row_start, row_end: expected 0 <= row_start <= row_end"),
]


@pytest.mark.parametrize("name, make, kwargs, error, message", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refused_calls_name_the_argument_and_write_nothing(in_memory, name, make, kwargs, error, message):
    dtype, rows = in_memory
    only = kwargs.pop("dtype", dtype)
    if only != dtype:
        pytest.skip(f"a refusal of {only} tables only")
    ids, out = make()
    before = np.array(out, copy=True)
    with pytest.raises(error, match=message):
        rows.gather_into(ids, out, **kwargs)
    np.testing.assert_array_equal(out, before)


def test_float8_codes_into_a_bf16_table_are_refused(in_memory):
    dtype, rows = in_memory
    if dtype != "bfloat16":
        pytest.skip("e4m3 codes are an FP8 table's raw rows")
    with pytest.raises(InvalidArgument, match=r"\[\.\.\., 160\] bfloat16 \(the table's raw rows: 160 bf16 values"):
        rows.gather_into(_ids(), np.empty((2, 16, 160), ml_dtypes.float8_e4m3fn))


def test_a_head_shard_refuses_rows_it_does_not_hold(tmp_path):
    config = CONFIGS["float8_e4m3fn"]
    layout = ple_store_config(config, LAYER)
    with EngramStore(LAYER, layout, None, disk_dir=tmp_path) as es:
        es.populate(heads_of(TABLES["float8_e4m3fn"]))
    with EngramStore(LAYER, layout, None, disk_dir=tmp_path, heads=[4, 5]) as es:
        rows = PLERows(es, config, LAYER)
        out = np.zeros((2, 16, 160), np.uint8)
        with pytest.raises(InvalidArgument, match=rf"rows {BOUNDS[4]}..{BOUNDS[7] - 1} of layer 2 lie in heads "
                                                  r"\[4, 5, 6\], but this table holds heads \[4, 5\] \(missing \[6\]\)"):
            rows.gather_into(hasher_ids(np.random.default_rng(0), 2), out, row_start=int(BOUNDS[4]),
                             row_end=int(BOUNDS[7]))
        assert not out.any()
        rows.gather_into(hasher_ids(np.random.default_rng(0), 2), out, row_start=int(BOUNDS[4]),
                         row_end=int(BOUNDS[6]))


def test_tables_of_another_layout_are_refused():
    fp8, bf16 = CONFIGS["float8_e4m3fn"], CONFIGS["bfloat16"]
    with EngramStore(LAYER, ple_store_config(bf16, LAYER), None) as es:
        with pytest.raises(InvalidArgument, match=r"table: layer 2 has row_format='bfloat16', expected 'bytes' "
                                                  r"\(build it with ple_store_config\(config, 2\)\)"):
            PLERows(es, fp8, LAYER)
    other = PLEConfig(ple_layer_ids=[LAYER], vocab_size=500, eos_token_id=5, ngram_vocab_size_base=400,
                      hidden_size=8, hc_count=2, ple_embed_dim=2560, ple_embedding_dtype="float8_e4m3fn")
    with EngramStore(LAYER, ple_store_config(other, LAYER), None) as es:
        with pytest.raises(InvalidArgument, match="table: layer 2 has table_vocab_sizes="):
            PLERows(es, fp8, LAYER)
    with pytest.raises(InvalidType, match="table: expected the EngramStore of layer 2"):
        PLERows(object(), fp8, LAYER)
    with pytest.raises(InvalidArgument, match="layer_id: expected one of ple_layer_ids"):
        PLERows(object(), fp8, 3)
