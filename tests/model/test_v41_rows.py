"""V41Rows: rows in the engines' conventions, bit for bit, from every table kind and into every buffer kind.

The oracles are NumPy transcriptions of the engines' released code, written here:
* vLLM 0.33.0, ``vllm/models/deepseek_v41/common/engram.py``, ``_engram_lookup_kernel`` (unsorted, no peers): for
  token t and local head j, column ``head = head_start + j``; an id is owned where ``head < total_heads`` and
  ``vocab_start <= id < vocab_end`` (the shard's rows), its row ``id - vocab_start`` of the shard's tables; others
  load zeros. Packed: the 256 code bytes then the 8 scale bytes. bf16: ``float32(e4m3 code) * float32 from the
  bits scale << 23``, rounded to bf16 (Triton's ``.to(tl.bfloat16)``: nearest even; a NaN is the canonical
  0x7FFF of the GPU's conversion).
* SGLang 0.5.23, ``sglang/srt/layers/engram_staging.py``, ``EngramRowStager._gather``: ``index_select(table, 0,
  ids)`` of the weight table and of the scale table (engram gives zeros for -1, which SGLang never passes).
``ml_dtypes`` decodes e4m3 and rounds to bf16 for the oracle.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_model.v41 import RowsHandle, V41Config, V41Rows, v41_store_config
from engram_store import DistributedStore, EngramStore, InvalidArgument, InvalidType

CFG = V41Config(layer_ids=[1, 4], max_ngram_size=3, n_heads=3, head_dim=64, engram_vocab_size=60,
                compressed_vocab_size=50, hidden_size=8, hc_mult=1)
LAYER = 4
COLS = CFG.cols                                    # 6
BOUNDS = np.append(CFG.offsets(LAYER), CFG.num_embeddings(LAYER))
TOTAL = int(BOUNDS[-1])


def random_rows(seed: int = 0) -> np.ndarray:
    """The layer's table: random bytes, NaN codes and scale bytes 0 and 255 included (passed through as vLLM)."""
    return np.random.default_rng(seed).integers(0, 256, (TOTAL, CFG.row_bytes), dtype=np.uint8)


ROWS = random_rows()
COLUMNS = [ROWS[BOUNDS[c]:BOUNDS[c + 1]] for c in range(COLS)]


# ---- the engines' semantics, in NumPy ---------------------------------------------------------------------


def vllm_lookup(table: np.ndarray, ids: np.ndarray, head_start: int, part: int, packed: bool) -> np.ndarray:
    """``ParallelEngramEmbedding.lookup`` of a rank whose shard is columns head_start .. head_start + part."""
    T = ids.shape[0]
    vocab_start = BOUNDS[min(head_start, COLS)]
    vocab_end = BOUNDS[min(head_start + part, COLS)]
    weight = table[vocab_start:vocab_end, :CFG.head_dim]     # the rank's tables
    scales = table[vocab_start:vocab_end, CFG.head_dim:]
    values = np.zeros((T, part, CFG.head_dim), np.uint8)
    scale = np.zeros((T, part, CFG.head_dim // 32), np.uint8)
    for t in range(T):
        for j in range(part):
            head = head_start + j
            index = ids[t, head] if head < COLS else -1
            if head < COLS and vocab_start <= index < vocab_end:
                values[t, j] = weight[index - vocab_start]
                scale[t, j] = scales[index - vocab_start]
    if packed:
        return np.concatenate([values, scale], axis=-1)
    as_f32 = values.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    factor = np.repeat((scale.astype(np.uint32) << 23).view(np.float32), 32, axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):
        product = as_f32 * factor
    bits = product.astype(ml_dtypes.bfloat16).view(np.uint16)
    return np.where(np.isnan(product), np.uint16(0x7FFF), bits)


def sglang_gather(table: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    weight, scale = table[:, :CFG.head_dim], table[:, CFG.head_dim:]
    codes = np.where((ids >= 0)[:, None], weight[np.maximum(ids, 0)], 0).astype(np.uint8)
    scales = np.where((ids >= 0)[:, None], scale[np.maximum(ids, 0)], 0).astype(np.uint8)
    return codes, scales


def hasher_ids(rng, T: int, pad: float = 0.2) -> np.ndarray:
    """Ids as hashers give them: column c's ids in column c's rows, -1 for padding."""
    ids = np.stack([rng.integers(BOUNDS[c], BOUNDS[c + 1], T) for c in range(COLS)], axis=1)
    ids[rng.random(ids.shape) < pad] = -1
    return ids


def any_ids(rng, shape) -> np.ndarray:
    """Ids anywhere in the table (other columns', other shards'), and -1."""
    return rng.integers(-1, TOTAL, shape)


def check_all_forms(rows: V41Rows, rng, calls: int = 4, head_starts=(0, 2, 5), table=ROWS) -> None:
    for i in range(calls):
        T = int(rng.integers(1, 9))
        ids = (hasher_ids if i % 2 else any_ids)(rng, (T, COLS) if i % 2 == 0 else T)
        if i % 2:
            ids = ids.astype(np.int32)
        for head_start in head_starts:
            part = int(rng.integers(1, COLS - head_start + 2))
            if any(rows.col_head[c] < 0 for c in range(head_start, min(head_start + part, COLS))):
                continue
            packed = np.full((T, part, CFG.row_bytes), 7, np.uint8)
            assert rows.gather_into(ids, packed, head_start=head_start) is packed
            np.testing.assert_array_equal(packed, vllm_lookup(table, ids, head_start, part, True))
            bf16 = np.full((T, part, CFG.head_dim), 7, ml_dtypes.bfloat16)
            rows.gather_into(ids, bf16, head_start=head_start)
            np.testing.assert_array_equal(bf16.view(np.uint16), vllm_lookup(table, ids, head_start, part, False))
        if rows.heads == list(range(COLS)):
            flat = any_ids(rng, T * COLS)
            codes, scales = np.empty((flat.size, CFG.head_dim), np.uint8), np.empty((flat.size, 2), np.uint8)
            rows.gather_into(flat, codes, scales_out=scales)
            want = sglang_gather(table, flat)
            np.testing.assert_array_equal(codes, want[0])
            np.testing.assert_array_equal(scales, want[1])


# ---- from memory: every form, hypothesis ------------------------------------------------------------------


@pytest.fixture(scope="module")
def in_memory():
    with EngramStore(LAYER, v41_store_config(CFG, LAYER), None) as es:
        es.bind_local(COLUMNS)
        yield V41Rows(es, CFG, LAYER, threads=2)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), T=st.integers(1, 12), head_start=st.integers(0, COLS - 1),
       extra=st.integers(0, 3), dtype=st.sampled_from([np.int32, np.int64]), own=st.booleans())
def test_window_forms_match_vllm(in_memory, seed, T, head_start, extra, dtype, own):
    rng = np.random.default_rng(seed)
    ids = (hasher_ids(rng, T) if own else any_ids(rng, (T, COLS))).astype(dtype)
    part = max(1, COLS - head_start - 1 + extra)  # a shard, up to heads padded past the last column
    packed = np.empty((T, part, CFG.row_bytes), np.uint8)
    in_memory.gather_into(ids, packed, head_start=head_start)
    np.testing.assert_array_equal(packed, vllm_lookup(ROWS, ids, head_start, part, True))
    bits = np.empty((T, part, CFG.head_dim), np.uint16)
    in_memory.gather_into(ids, bits, head_start=head_start)
    np.testing.assert_array_equal(bits, vllm_lookup(ROWS, ids, head_start, part, False))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), N=st.integers(1, 80), dtype=st.sampled_from([np.int32, np.int64]))
def test_split_form_matches_sglang(in_memory, seed, N, dtype):
    ids = any_ids(np.random.default_rng(seed), N).astype(dtype)
    codes, scales = np.empty((N, CFG.head_dim), np.uint8), np.empty((N, 2), np.uint8)
    in_memory.gather_into(ids, codes, scales_out=scales)
    want = sglang_gather(ROWS, ids.astype(np.int64))
    np.testing.assert_array_equal(codes, want[0])
    np.testing.assert_array_equal(scales, want[1])


def test_every_scale_and_code_decodes_as_vllm(in_memory):
    """All 256 x 256 (scale byte, code) pairs, through a table whose rows hold them all."""
    rows = np.zeros((256 * 2, CFG.row_bytes), np.uint8)
    for s in range(256):
        for half in range(2):
            rows[2 * s + half, :CFG.head_dim] = np.arange(64) + 64 * (2 * (s % 2) + half) % 256
            rows[2 * s + half, CFG.head_dim:] = s
    big = np.zeros((TOTAL, CFG.row_bytes), np.uint8)
    big[:rows.shape[0]] = rows
    cols = [big[BOUNDS[c]:BOUNDS[c + 1]] for c in range(COLS)]
    with EngramStore(LAYER, v41_store_config(CFG, LAYER), None) as es:
        es.bind_local(cols)
        ids = np.full((rows.shape[0], COLS), -1, np.int64)
        ids[:, 0] = np.arange(rows.shape[0])  # column 0's rows, and rows of the next columns through slot 0
        out = np.empty((rows.shape[0], 1, CFG.head_dim), np.uint16)
        V41Rows(es, CFG, LAYER).gather_into(ids, out)
    np.testing.assert_array_equal(out, vllm_lookup(big, ids, 0, 1, False))


def test_large_gathers_split_over_threads_give_the_same_rows():
    rng = np.random.default_rng(3)
    ids = hasher_ids(rng, 3000)
    with EngramStore(LAYER, v41_store_config(CFG, LAYER), None) as es:
        es.bind_local(COLUMNS)
        one, many = V41Rows(es, CFG, LAYER, threads=1), V41Rows(es, CFG, LAYER, threads=3)
        a, b = (np.empty((3000, COLS, CFG.head_dim), np.uint16) for _ in range(2))
        one.gather_into(ids, a)
        many.gather_into(ids, b)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, vllm_lookup(ROWS, ids, 0, COLS, False))


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_after_a_threaded_gather_gathers_with_threads_of_its_own():
    """A data loader's worker forked from a process whose V41Rows gathered on threads and in the background: the
    child's copies of those pools have no threads, so a gather handed to one would never end; the child makes
    pools of its own."""
    ids = hasher_ids(np.random.default_rng(5), 3000)
    with EngramStore(LAYER, v41_store_config(CFG, LAYER), None) as es:
        es.bind_local(COLUMNS)
        rows = V41Rows(es, CFG, LAYER, threads=3)
        out = np.empty((3000, COLS, CFG.head_dim), np.uint16)
        rows.gather_into(ids, out)  # the pools' threads start here, in the parent
        rows.gather_into(ids, np.empty_like(out), background=True).wait()
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if its gathers end with the same rows
            try:
                again, later = np.zeros_like(out), np.zeros_like(out)
                rows.gather_into(ids, again)
                rows.gather_into(ids, later, background=True).wait()
                os._exit(0 if np.array_equal(again, out) and np.array_equal(later, out) else 1)
            finally:
                os._exit(2)
        deadline = time.monotonic() + 30
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's threaded gather never ended")
        assert os.waitstatus_to_exitcode(done[1]) == 0


# ---- every table kind ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["local_dir", "disk_dir", "disk_dir_host", "disk_dir_shard", "store_local",
                                  "store_remote"])
def test_every_table_kind_gives_the_engines_rows(kind, tmp_path):
    rng = np.random.default_rng(len(kind))
    layout = v41_store_config(CFG, LAYER)
    if kind.startswith("store"):
        with DistributedStore.embedded(segment_size="8MiB", local_direct=kind == "store_local") as store:
            with EngramStore(LAYER, layout, store) as es:
                es.populate(COLUMNS)
                rows = V41Rows(es, CFG, LAYER)
                check_all_forms(rows, rng)
                assert (rows.memory_gathers > 0) == (kind == "store_local")
                assert (rows.staged_gathers > 0) == (kind == "store_remote")
        return
    where = {"local_dir": {"local_dir": tmp_path}}.get(kind, {"disk_dir": tmp_path})
    with EngramStore(LAYER, layout, None, **where) as es:
        es.populate(COLUMNS)
    options = {"disk_dir_host": {"row_cache_bytes": 1 << 20, "cache_scope": "host"},
               "disk_dir_shard": {"heads": [2, 3, 4]}}.get(kind, {})
    with EngramStore(LAYER, layout, None, **where, **options) as es:
        rows = V41Rows(es, CFG, LAYER)
        check_all_forms(rows, rng, head_starts=(2,) if kind == "disk_dir_shard" else (0, 2, 5))
        assert (rows.memory_gathers > 0) == (kind == "local_dir")


# ---- buffers -----------------------------------------------------------------------------------------------


def test_strided_outputs_and_ml_dtypes_codes(in_memory):
    """A packed out that is one layer's slice of [T, layers, part, 264] (vLLM's EngramBatch), and float8 codes."""
    rng = np.random.default_rng(5)
    ids = hasher_ids(rng, 6)
    batch = np.zeros((6, 2, COLS, CFG.row_bytes), np.uint8)
    in_memory.gather_into(ids, batch[:, 1])
    np.testing.assert_array_equal(batch[:, 1], vllm_lookup(ROWS, ids, 0, COLS, True))
    assert not batch[:, 0].any()
    flat = ids.reshape(-1)
    codes = np.empty((flat.size, CFG.head_dim), ml_dtypes.float8_e4m3fn)
    scales = np.empty((flat.size, 2), np.uint8)
    in_memory.gather_into(flat, codes, scales_out=scales)
    np.testing.assert_array_equal(codes.view(np.uint8), sglang_gather(ROWS, flat)[0])


def test_torch_ids_and_buffers(in_memory):
    torch = pytest.importorskip("torch", reason="torch is an optional extra (pip install -e '.[torch]')")
    rng = np.random.default_rng(6)
    ids = hasher_ids(rng, 5)
    t_ids = torch.from_numpy(ids.astype(np.int32))
    out = torch.zeros((5, COLS, CFG.head_dim), dtype=torch.bfloat16)
    assert in_memory.gather_into(t_ids, out) is out
    np.testing.assert_array_equal(out.view(torch.int16).numpy().view(np.uint16),
                                  vllm_lookup(ROWS, ids, 0, COLS, False))
    packed = torch.zeros((5, COLS, CFG.row_bytes), dtype=torch.uint8)
    in_memory.gather_into(t_ids, packed)
    np.testing.assert_array_equal(packed.numpy(), vllm_lookup(ROWS, ids, 0, COLS, True))
    flat = torch.from_numpy(ids.reshape(-1))
    codes = torch.empty((flat.numel(), CFG.head_dim), dtype=torch.float8_e4m3fn)
    scales = torch.empty((flat.numel(), 2), dtype=torch.uint8)
    in_memory.gather_into(flat, codes, scales_out=scales)
    want = sglang_gather(ROWS, ids.reshape(-1))
    np.testing.assert_array_equal(codes.view(torch.uint8).numpy(), want[0])
    np.testing.assert_array_equal(scales.numpy(), want[1])


def test_background_gathers_copy_the_ids(in_memory):
    rng = np.random.default_rng(7)
    ids = hasher_ids(rng, 4)
    want = vllm_lookup(ROWS, ids, 0, COLS, False)
    out = np.empty((4, COLS, CFG.head_dim), np.uint16)
    handle = in_memory.gather_into(ids, out, background=True)
    ids[:] = -1  # the caller reuses its ids buffer at once
    assert isinstance(handle, RowsHandle)
    assert handle.wait(timeout=30) is out
    np.testing.assert_array_equal(out, want)


def test_importing_engram_never_imports_torch():
    code = ("import sys, engram_store, engram_model, engram_model.v41\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# ---- refusals ----------------------------------------------------------------------------------------------


REFUSALS = [
    ("ids outside the table", lambda: (np.full((2, COLS), TOTAL), np.empty((2, COLS, 64), np.uint16)), {},
     InvalidArgument, rf"ids\[0, 0\] = {TOTAL} is no row of layer 4's table"),
    ("ids below -1", lambda: (np.full((2, COLS), -2), np.empty((2, COLS, 64), np.uint16)), {},
     InvalidArgument, r"ids\[0, 0\] = -2 is no row"),
    ("float ids", lambda: (np.zeros((2, COLS)), np.empty((2, COLS, 64), np.uint16)), {},
     InvalidType, "ids: expected dtype int32 or int64, got float64"),
    ("ids of the wrong shape", lambda: (np.zeros((3, COLS), np.int64), np.empty((2, COLS, 64), np.uint16)), {},
     InvalidArgument, r"ids: expected \[T, cols\] = \[2, 6\]"),
    ("a float32 out", lambda: (np.zeros((2, COLS), np.int64), np.empty((2, COLS, 64), np.float32)), {},
     InvalidArgument, "out: expected a bf16 .* got float32"),
    ("a read-only out", lambda: (np.zeros((2, COLS), np.int64), np.broadcast_to(np.uint16(1), (2, COLS, 64))), {},
     InvalidArgument, "out: expected a writable buffer"),
    ("head_start past the columns", lambda: (np.zeros((2, COLS), np.int64), np.empty((2, 2, 66), np.uint8)),
     {"head_start": COLS}, InvalidArgument, r"head_start: expected a column index in \[0, 6\), got 6"),
    ("head_start with the split form", lambda: (np.zeros(4, np.int64), np.empty((4, 64), np.uint8)),
     {"head_start": 1, "scales_out": np.empty((4, 2), np.uint8)}, InvalidArgument, "head_start: the split form"),
    ("scales of the wrong shape", lambda: (np.zeros(4, np.int64), np.empty((4, 64), np.uint8)),
     {"scales_out": np.empty((4, 3), np.uint8)}, InvalidArgument, r"scales_out: expected uint8 .* \[4, 2\]"),
]


@pytest.mark.parametrize("name, make, kwargs, error, message", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refused_calls_name_the_argument_and_write_nothing(in_memory, name, make, kwargs, error, message):
    ids, out = make()
    before = np.array(out, copy=True)
    scales = kwargs.get("scales_out")
    scales_before = None if scales is None else scales.copy()
    with pytest.raises(error, match=message):
        in_memory.gather_into(ids, out, **kwargs)
    np.testing.assert_array_equal(out, before)
    if scales is not None:
        np.testing.assert_array_equal(scales, scales_before)


def test_a_shard_table_refuses_columns_it_does_not_hold(tmp_path):
    layout = v41_store_config(CFG, LAYER)
    with EngramStore(LAYER, layout, None, disk_dir=tmp_path) as es:
        es.populate(COLUMNS)
    with EngramStore(LAYER, layout, None, disk_dir=tmp_path, heads=[2, 3]) as es:
        rows = V41Rows(es, CFG, LAYER)
        with pytest.raises(InvalidArgument, match=r"columns 2..4 of layer 4 are read, but this table holds columns "
                                                  r"\[2, 3\] \(missing \[4\]\)"):
            rows.gather_into(hasher_ids(np.random.default_rng(0), 2), np.empty((2, 3, 64), np.uint16),
                             head_start=2)


def test_tables_of_another_layout_are_refused():
    with EngramStore(LAYER, v41_store_config(CFG, 1), None) as es:  # layer 1's sizes under layer 4's id
        with pytest.raises(InvalidArgument, match="table: layer 4 has table_vocab_sizes="):
            V41Rows(es, CFG, LAYER)
    with pytest.raises(InvalidType, match="table: expected the EngramStore of layer 4"):
        V41Rows(object(), CFG, LAYER)
