"""V41Rows.bind: a decode step's gather into a buffer checked once gives what gather_into gives, from memory and
through a disk_dir's cache, and refuses what gather_into refuses, writing nothing."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_model.v41 import V41Config, V41Rows, v41_store_config
from engram_store import EngramStore, InvalidArgument, TableClosed

CFG = V41Config(layer_ids=[1, 4], max_ngram_size=3, n_heads=3, head_dim=64, engram_vocab_size=60,
                compressed_vocab_size=50, hidden_size=8, hc_mult=1)
LAYER = 4
BOUNDS = np.append(CFG.offsets(LAYER), CFG.num_embeddings(LAYER))
ROWS = np.random.default_rng(0).integers(0, 256, (int(BOUNDS[-1]), CFG.row_bytes), dtype=np.uint8)
COLUMNS = [ROWS[BOUNDS[c]:BOUNDS[c + 1]] for c in range(CFG.cols)]
MAX_T = 9


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    memory = EngramStore(LAYER, v41_store_config(CFG, LAYER), None)
    memory.bind_local(COLUMNS)
    disk_dir = tmp_path_factory.mktemp("bind-disk")
    with EngramStore(LAYER, v41_store_config(CFG, LAYER), None, disk_dir=disk_dir) as writer:
        writer.populate(COLUMNS)
    disk = EngramStore(LAYER, v41_store_config(CFG, LAYER), None, disk_dir=disk_dir, row_cache_bytes=1 << 16)
    yield {"memory": V41Rows(memory, CFG, LAYER), "disk": V41Rows(disk, CFG, LAYER)}
    memory.close()
    disk.close()


@settings(max_examples=40, deadline=None)
@given(where=st.sampled_from(["memory", "disk"]), packed=st.booleans(), T=st.integers(1, MAX_T),
       head_start=st.integers(0, CFG.cols - 1), part=st.integers(1, CFG.cols), int32=st.booleans(),
       seed=st.integers(0, 2**16), strided=st.booleans())
def test_a_bound_gather_gives_what_gather_into_gives(tables, where, packed, T, head_start, part, int32, seed,
                                                     strided):
    """Every step: the first (the checked path, which finds tables this process holds) and the next ones (over bound
    arrays: one kernel call), into a buffer whose slots are one axis or one copied back into (``strided``)."""
    rows = tables[where]
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.integers(BOUNDS[c], BOUNDS[c + 1], T) for c in range(CFG.cols)], axis=1)
    ids[rng.random(ids.shape) < 0.2] = -1
    ids = ids.astype(np.int32 if int32 else np.int64)
    width, dtype = (CFG.row_bytes, np.uint8) if packed else (CFG.head_dim, np.uint16)
    expected = np.empty((T, part, width), dtype)
    rows.gather_into(ids, expected, head_start=head_start)
    buffer = np.full((MAX_T, part + 1, width), 7, dtype)[:, 1:] if strided else np.full((MAX_T, part, width), 7, dtype)
    bound = rows.bind(buffer, head_start=head_start)
    for _ in range(2):
        assert bound(ids) is buffer
        assert np.array_equal(buffer[:T], expected) and (buffer[T:] == 7).all()
        buffer[:T] = 7


def test_a_bound_gather_refuses_what_gather_into_refuses_and_writes_nothing(tables):
    rows = tables["memory"]
    buffer = np.full((MAX_T, CFG.cols, CFG.row_bytes), 7, np.uint8)
    bound = rows.bind(buffer)
    ids = np.full((2, CFG.cols), -1, np.int64)
    ids[1, 3] = BOUNDS[-1]
    with pytest.raises(InvalidArgument, match=r"ids\[1, 3\] = .* is no row of layer 4's table"):
        bound(ids)
    with pytest.raises(InvalidArgument, match=r"ids: expected \[T, cols\] with 1 <= T <= 9"):
        bound(np.full((MAX_T + 1, CFG.cols), -1, np.int64))
    with pytest.raises(InvalidArgument, match="ids: expected"):
        bound(np.full((2, CFG.cols - 1), -1, np.int64))
    assert (buffer == 7).all()
    with pytest.raises(InvalidArgument, match="out: expected a bf16"):
        rows.bind(np.empty((MAX_T, CFG.cols, 100), np.uint8))


def test_a_bound_gather_over_tables_of_this_process_is_one_kernel_call_until_they_close():
    """Over bound arrays a step after the first is the id check and one kernel call on the tables held; once the
    EngramStore closes, the next step raises TableClosed instead of reading what it held."""
    table = EngramStore(LAYER, v41_store_config(CFG, LAYER), None)
    table.bind_local(COLUMNS)
    rows = V41Rows(table, CFG, LAYER, threads=1)
    buffer = np.zeros((MAX_T, CFG.cols, CFG.head_dim), np.uint16)
    bound = rows.bind(buffer)
    rng = np.random.default_rng(3)
    for T in (2, 9, 1):
        ids = np.stack([rng.integers(BOUNDS[c], BOUNDS[c + 1], T) for c in range(CFG.cols)], axis=1)
        expected = np.empty((T, CFG.cols, CFG.head_dim), np.uint16)
        rows.gather_into(ids, expected)
        bound(ids)
        np.testing.assert_array_equal(buffer[:T], expected)
    assert bound._held is not None and bound._held[0].holds()
    gathers = rows.memory_gathers
    bound(ids)
    assert rows.memory_gathers == gathers + 1
    table.close()
    assert not bound._held[0].holds()
    with pytest.raises(TableClosed):
        bound(ids)
