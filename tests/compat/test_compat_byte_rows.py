"""compat.EngramStore(layers, ...): Mooncake's multi-layer byte-row API.

Ports the behaviours of Mooncake's scripts/test_engram_store.py for this API (store=, store_client=,
bind_local, local_dir, lookup_many_into and the packed lookup), plus the argument checks of its binding.
Every error is the builtin Mooncake raises and also an engram_store error; messages name what was expected
and what came.
"""
from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest

from compat_helpers import (SIZES, byte_config, gather, last_row_ids, next_layer, registered_output,
                            spec_tables)
from engram_store import (DistributedStore, EngramError, InvalidArgument, InvalidType, NotConnected, ObjectExists,
                          ObjectNotFound, StoreError)
from engram_store.compat import EngramStore, EngramStoreConfig, MooncakeDistributedStore, ReplicateConfig

pytestmark = pytest.mark.timeout(120)

RB = 32


@pytest.fixture
def populated(mc_store):
    """A layer populated with Mooncake's fixture tables through ``store=``; removed after the test."""
    layer_id = next_layer()
    table = EngramStore(layers={layer_id: byte_config(SIZES, RB)}, store=mc_store)
    tables = spec_tables(SIZES, RB)
    assert table.populate(layer_id, tables) is None
    try:
        yield table, layer_id, tables
    finally:
        table.remove_from_store(layer_id, force=True)


# ---- construction and metadata ------------------------------------------------------------------


def test_creation_and_metadata(mc_store):
    layer_id = next_layer()
    table = EngramStore(layers={layer_id: byte_config(SIZES, RB)}, store=mc_store)
    assert table.get_layer_ids() == [layer_id]
    assert table.get_num_heads(layer_id) == 4
    assert table.get_row_bytes(layer_id) == RB
    assert table.get_table_vocab_sizes(layer_id) == SIZES
    assert table.get_store_keys(layer_id) == [f"engram:l{layer_id}:h{h}" for h in range(4)]


def test_creation_without_store_keeps_metadata_accessible():
    table = EngramStore({14: byte_config([7, 11], 264), 1: byte_config(SIZES, RB)})
    assert table.get_layer_ids() == [1, 14]
    assert table.get_store_keys(14) == ["engram:l14:h0", "engram:l14:h1"]
    assert (table.get_num_heads(1), table.get_row_bytes(14), table.get_table_vocab_sizes(14)) == (4, 264, [7, 11])


def test_every_constructor_form(mc_store):
    config = byte_config(SIZES, RB)
    with DistributedStore.embedded(segment_size="8MiB") as native:
        forms = [EngramStore({1: config}, mc_store), EngramStore(layers={1: config}, store=mc_store),
                 EngramStore({1: config}, store_client=mc_store), EngramStore(layers={1: config}, store_client=native),
                 EngramStore({1: config}), EngramStore({1: config}, None, ""), EngramStore({1: config}, local_dir="")]
        assert all(form.get_store_keys(1) == ["engram:l1:h0", "engram:l1:h1", "engram:l1:h2", "engram:l1:h3"]
                   for form in forms)
    with pytest.raises(TypeError, match="pass the store once"):
        EngramStore({1: config}, store=mc_store, store_client=mc_store)


def test_row_size_validation():
    for row_bytes in (0, -1):
        with pytest.raises(ValueError, match=rf"layers\[1\]\.row_bytes: expected a positive row width in bytes, "
                                             rf"got {row_bytes}"):
            EngramStore({1: byte_config(SIZES, row_bytes)})
    with pytest.raises(ValueError, match=r"layers\[1\]\.table_vocab_sizes\[0\]: expected at most "
                                         r"34937015291116575 rows of 264 bytes .* got 9223372036854775807"):
        EngramStore({1: byte_config([2**63 - 1], 264)})
    with pytest.raises(ValueError, match=r"layers\[2\]\.table_vocab_sizes: expected a non-empty list"):
        EngramStore({2: byte_config([], 8)})
    with pytest.raises(ValueError, match=r"layers\[3\]\.table_vocab_sizes\[1\]: expected a positive integer, got 0"):
        EngramStore({3: byte_config([5, 0], 8)})
    with pytest.raises(ValueError, match=r"row_bytes.*got 0"):
        EngramStore({1: EngramStoreConfig()})  # Mooncake's default row_bytes must be set


def test_invalid_layer_configuration():
    with pytest.raises(ValueError, match="at least one layer"):
        EngramStore({})
    with pytest.raises(ValueError, match="non-negative layer ids, got -1"):
        EngramStore({-1: byte_config()})
    with pytest.raises(TypeError, match=r"layers\[1\]: expected an EngramStoreConfig, got dict"):
        EngramStore({1: {"row_bytes": 8}})
    with pytest.raises(TypeError, match="integer layer ids"):
        EngramStore({"1": byte_config()})


def test_stores_of_other_kinds_are_refused():
    with pytest.raises(RuntimeError, match="store: expected a MooncakeDistributedStore.*got str") as info:
        EngramStore({1: byte_config()}, "127.0.0.1:50051")
    assert isinstance(info.value, InvalidType)
    with pytest.raises(RuntimeError, match="not set up") as info:
        EngramStore({1: byte_config()}, store_client=MooncakeDistributedStore())
    assert isinstance(info.value, NotConnected)


def test_unknown_layer_raises_value_error_everywhere_and_first(populated):
    table, layer_id, tables = populated
    unknown = layer_id + 1
    output = np.full((1, 1, 4, RB), 17, dtype=np.uint8)
    calls = [lambda: table.get_num_heads(unknown), lambda: table.get_row_bytes(unknown),
             lambda: table.get_table_vocab_sizes(unknown), lambda: table.get_store_keys(unknown),
             lambda: table.populate(unknown, []), lambda: table.populate(unknown, "not even a list"),
             lambda: table.bind_local(unknown, []), lambda: table.remove_from_store(unknown),
             lambda: table.lookup_into(unknown, [[[0]]], output),
             lambda: table.lookup_many_into([layer_id, unknown], [last_row_ids()] * 2, [output, output]),
             lambda: table.lookup([unknown], np.zeros((1, 1), dtype=np.int64), output)]
    for call in calls:
        with pytest.raises(ValueError, match=rf"Unknown Engram layer: {unknown} \(layer_id: expected one of this "
                                             rf"EngramStore's layers \[{layer_id}\]\)") as info:
            call()
        assert isinstance(info.value, InvalidArgument) and not isinstance(info.value, RuntimeError)
    assert (output == 17).all()  # untouched
    with pytest.raises(TypeError, match="layer_id: expected an integer layer id"):
        table.get_num_heads("1")


# ---- populate ------------------------------------------------------------------------------------------


def test_populate_rejects_reusing_existing_layer_keys(populated):
    table, layer_id, tables = populated
    with pytest.raises(RuntimeError, match=f"key 'engram:l{layer_id}:h0' already exists") as info:
        table.populate(layer_id, tables)
    assert isinstance(info.value, ObjectExists)


def test_populate_rejects_wrong_table_shape(mc_store):
    layer_id = next_layer()
    table = EngramStore(layers={layer_id: byte_config(SIZES, RB)}, store=mc_store)
    tables = spec_tables(SIZES, RB)
    tables[0] = tables[0][:-1]
    with pytest.raises(RuntimeError, match=r"embedding_buffers\[0\]: expected shape \(17, 32\) .* got \(16, 32\)"):
        table.populate(layer_id, tables)
    assert [mc_store.is_exist(key) for key in table.get_store_keys(layer_id)] == [0, 0, 0, 0]


def test_populate_does_not_cast(mc_store):
    layer_id = next_layer()
    table = EngramStore(layers={layer_id: byte_config(SIZES, 264)}, store=mc_store)
    floats = [np.zeros((n, 66), dtype=np.float32) for n in SIZES]  # the same bytes, as float32
    with pytest.raises(RuntimeError, match=r"embedding_buffers\[0\]: expected a C-contiguous uint8 array .* got a "
                                           r"float32 array of shape \(17, 66\)"):
        table.populate(layer_id, floats)
    strided = [np.zeros((n, 528), dtype=np.uint8)[:, ::2] for n in SIZES]
    with pytest.raises(RuntimeError, match=r"\(not C-contiguous\)") as info:
        table.populate(layer_id, strided)
    assert isinstance(info.value, InvalidType)
    assert [mc_store.is_exist(key) for key in table.get_store_keys(layer_id)] == [0, 0, 0, 0]


def test_populate_refuses_other_containers_and_counts(mc_store):
    layer_id = next_layer()
    table = EngramStore({layer_id: byte_config(SIZES, RB)}, mc_store)
    tables = spec_tables(SIZES, RB)
    with pytest.raises(TypeError, match="expected a list of 4 uint8 NumPy arrays .* got tuple"):
        table.populate(layer_id, tuple(tables))
    with pytest.raises(RuntimeError, match=f"expected 4 tables \\(one per head of layer {layer_id}\\), got 3"):
        table.populate(layer_id, tables[:3])
    with pytest.raises(RuntimeError, match=r"embedding_buffers\[1\]: expected a NumPy uint8 array, got bytes"):
        table.populate(layer_id, [tables[0], tables[1].tobytes()] + tables[2:])


def test_populate_takes_read_only_arrays_and_any_replicate_config_spelling(mc_store):
    tables = spec_tables(SIZES, RB)
    for table_array in tables:
        table_array.flags.writeable = False
    replica = ReplicateConfig()
    replica.with_hard_pin = True
    for kwargs in ({}, {"config": replica}, {"replicate_config": replica}, {"config": None}):
        layer_id = next_layer()
        table = EngramStore({layer_id: byte_config(SIZES, RB)}, mc_store)
        table.populate(layer_id, tables, **kwargs)
        output = np.empty((1, 1, 4, RB), dtype=np.uint8)
        table.lookup_into(layer_id, last_row_ids(), output)
        np.testing.assert_array_equal(output, gather(tables, last_row_ids()))
        assert table.remove_from_store(layer_id) == 4
    with pytest.raises(TypeError, match="pass the ReplicateConfig once"):
        table.populate(layer_id, tables, replica, replicate_config=replica)
    with pytest.raises(TypeError, match="config: expected a ReplicateConfig or None, got int"):
        table.populate(layer_id, tables, 2)


def test_replica_num_is_honoured(mc_store):
    layer_id = next_layer()
    table = EngramStore({layer_id: byte_config([5], 8)}, mc_store)
    replica = ReplicateConfig()
    replica.replica_num = 2
    with pytest.raises(RuntimeError, match="2 distinct segments|replica") as info:  # one segment here
        table.populate(layer_id, [np.zeros((5, 8), dtype=np.uint8)], replica)
    assert isinstance(info.value, StoreError)
    assert mc_store.is_exist(f"engram:l{layer_id}:h0") == 0


# ---- lookup_into ---------------------------------------------------------------------------------------


def test_populate_and_lookup_batch_shape(populated, mc_store):
    table, layer_id, tables = populated
    ids = np.array([[[0, 1, 2, 3], [4, 5, 6, 7]], [[8, 9, 10, 11], [12, 13, 14, 15]]], dtype=np.int64)
    with registered_output(mc_store, (2, 2, 4, RB)) as output:
        assert table.lookup_into(layer_id, ids, output) is None
        assert output.shape == (2, 2, 4, RB) and output.dtype == np.uint8
        np.testing.assert_array_equal(output, gather(tables, ids))


def test_lookup_matches_stored_rows_from_numpy_ids(populated):
    table, layer_id, tables = populated
    ids = np.array([[[16, 18, 22, 28], [0, 0, 0, 0], [3, 1, 4, 1]]], dtype=np.int64)
    output = np.empty((1, 3, 4, RB), dtype=np.uint8)  # not registered: none is needed
    table.lookup_into(layer_id, ids, output)
    for h in range(4):
        np.testing.assert_array_equal(output[0, :, h], tables[h][ids[0, :, h]])


def test_lookup_rejects_implicit_input_conversion(populated):
    table, layer_id, _ = populated
    ids = np.zeros((1, 2, 4), dtype=np.int64)
    output = np.full((1, 2, 4, RB), 5, dtype=np.uint8)
    for bad, got in [(ids.tolist(), "got list"), (ids.astype(np.int32), "got int32 array of shape"),
                     (ids[..., ::-1], r"got int64 array .*\(not C-contiguous\)")]:
        with pytest.raises(TypeError, match=rf"row_ids: expected a C-contiguous int64 NumPy array \[B, L, 4\] "
                                            rf"\(nothing is converted\), {got}") as info:
            table.lookup_into(layer_id, bad, output)
        assert not isinstance(info.value, RuntimeError)
    with pytest.raises(TypeError, match="output: expected a writable C-contiguous uint8 NumPy array .* got bytearray"):
        table.lookup_into(layer_id, ids, bytearray(output.nbytes))
    assert (output == 5).all()


def test_lookup_into_refuses_outputs_it_cannot_write_in_place(populated, mc_store):
    table, layer_id, tables = populated
    ids = last_row_ids()
    with registered_output(mc_store, (1, 1, 4, RB), fill=99) as output:
        bad_outputs = [
            (output[..., ::-1], r"\(not C-contiguous\)"),
            (output.astype(np.float32), "got a float32 array"),
            (output[..., :-1], r"of shape \(1, 1, 4, 32\) .* got a uint8 array of shape \(1, 1, 4, 31\)"),
            (np.broadcast_to(output, output.shape), r"\(read-only\)"),
        ]
        for bad, got in bad_outputs:
            with pytest.raises(RuntimeError, match=rf"output: expected a writable C-contiguous uint8 array .*{got}"):
                table.lookup_into(layer_id, ids, bad)
        assert (output == 99).all()
        table.lookup_into(layer_id, ids, output)
        np.testing.assert_array_equal(output, gather(tables, ids))


def test_lookup_empty_batch_is_noop(populated):
    table, layer_id, _ = populated
    output = np.empty((1, 0, 4, RB), dtype=np.uint8)
    assert table.lookup_into(layer_id, np.zeros((1, 0, 4), dtype=np.int64), output) is None
    # It needs no backend either: a metadata-only EngramStore does nothing too.
    assert EngramStore({3: byte_config()}).lookup_into(3, np.zeros((0, 2, 4), dtype=np.int64),
                                                       np.empty((0, 2, 4, RB), dtype=np.uint8)) is None


def test_lookup_rejects_wrong_head_dimension(populated):
    table, layer_id, _ = populated
    with pytest.raises(RuntimeError, match=rf"row_ids: expected shape \[B, L, 4\] \(4 heads in layer {layer_id}\), "
                                           r"got \(1, 1, 3\)"):
        table.lookup_into(layer_id, np.zeros((1, 1, 3), dtype=np.int64), np.empty((1, 1, 3, RB), dtype=np.uint8))


def test_lookup_rejects_out_of_range_row_id_and_zeroes_the_output(populated):
    table, layer_id, _ = populated
    output = np.full((1, 2, 4, RB), 99, dtype=np.uint8)
    ids = np.array([[[0, 0, 0, 0], [0, 999, 0, 0]]], dtype=np.int64)
    with pytest.raises(RuntimeError, match=r"row_ids\[0, 1, 1\] = 999 is out of range: head 1 of layer \d+ has 19 "
                                           r"rows \(expected 0 <= id < 19\)") as info:
        table.lookup_into(layer_id, ids, output)
    assert isinstance(info.value, InvalidArgument)
    assert not output.any()


def test_lookup_rejects_missing_tables_and_zeroes_the_output(mc_store):
    layer_id = next_layer()
    table = EngramStore(layers={layer_id: byte_config(SIZES, RB)}, store=mc_store)
    output = np.full((1, 1, 4, RB), 99, dtype=np.uint8)
    with pytest.raises(RuntimeError, match="not in the store") as info:
        table.lookup_into(layer_id, last_row_ids(), output)
    assert isinstance(info.value, ObjectNotFound)
    assert not output.any()


def test_lookup_and_registered_output(mc_store):
    """Mooncake's byte-row test: 264-byte rows, hard-pinned, repeated lookups into one registered output."""
    layer_id = next_layer()
    table = EngramStore(layers={layer_id: byte_config(SIZES, 264)}, store=mc_store)
    tables = spec_tables(SIZES, 264)
    replica = ReplicateConfig()
    replica.with_hard_pin = True
    table.populate(layer_id, tables, replica)
    try:
        ids = np.array([[[16, 18, 22, 28], [0, 1, 2, 3]]], dtype=np.int64)
        with registered_output(mc_store, (1, 2, 4, 264), fill=99) as output:
            for _ in range(3):
                assert table.lookup_into(layer_id, ids, output) is None
                np.testing.assert_array_equal(output, gather(tables, ids))
            bad = ids.copy()
            bad[0, 0, 2] = -1
            with pytest.raises(RuntimeError, match=r"row_ids\[0, 0, 2\] = -1"):
                table.lookup_into(layer_id, bad, output)
            assert not output.any()
            table.lookup_into(layer_id, ids, output)  # the registration is kept
            np.testing.assert_array_equal(output, gather(tables, ids))
    finally:
        assert table.remove_from_store(layer_id, force=True) == 4


def test_remove_from_store(mc_store):
    layer_id = next_layer()
    table = EngramStore(layers={layer_id: byte_config(SIZES, RB)}, store=mc_store)
    table.populate(layer_id, spec_tables(SIZES, RB))
    assert table.remove_from_store(layer_id) == 4
    assert [mc_store.is_exist(key) for key in table.get_store_keys(layer_id)] == [0, 0, 0, 0]
    assert table.remove_from_store(layer_id) == 0
    table.populate(layer_id, spec_tables(SIZES, RB))  # and the layer can be written again
    assert table.remove_from_store(layer_id, force=True) == 4


def test_remove_without_a_store_fails_like_mooncake(tmp_path):
    for table in (EngramStore({1: byte_config()}), EngramStore({1: byte_config()}, local_dir=str(tmp_path))):
        with pytest.raises(RuntimeError, match="remove_from_store failed, rc=-600") as info:
            table.remove_from_store(1)
        assert isinstance(info.value, NotConnected)
    with pytest.raises(RuntimeError, match=f"delete {tmp_path}/layer-1"):
        table.remove_from_store(1, force=True)


# ---- several layers ------------------------------------------------------------------------------------


def test_layer_isolation_and_shared_backend(mc_store):
    first, second = next_layer(), next_layer()
    layers = {first: byte_config(SIZES, 264), second: byte_config([7, 11], 264)}
    table = EngramStore(layers, mc_store)
    peer = EngramStore(layers, mc_store)  # a second handle on the same keys
    assert table.get_layer_ids() == [first, second]
    assert peer.get_store_keys(second) == table.get_store_keys(second)
    try:
        for i, layer_id in enumerate((first, second)):
            sizes = table.get_table_vocab_sizes(layer_id)
            table.populate(layer_id, [np.full((n, 264), h + 31 + 50 * i, dtype=np.uint8) for h, n in enumerate(sizes)])
        for handle in (table, peer):
            for i, layer_id in enumerate((first, second)):
                H = handle.get_num_heads(layer_id)
                output = np.empty((1, 1, H, 264), dtype=np.uint8)
                handle.lookup_into(layer_id, np.zeros((1, 1, H), dtype=np.int64), output)
                assert [int(output[0, 0, h, 0]) for h in range(H)] == [h + 31 + 50 * i for h in range(H)]
                assert all((output[0, 0, h] == output[0, 0, h, 0]).all() for h in range(H))
        assert table.remove_from_store(first) == 4
        output = np.empty((1, 1, 2, 264), dtype=np.uint8)
        peer.lookup_into(second, np.zeros((1, 1, 2), dtype=np.int64), output)
        assert (output[0, 0, 0] == 81).all() and (output[0, 0, 1] == 82).all()
        with pytest.raises(RuntimeError, match="not in the store"):
            table.lookup_into(first, np.zeros((1, 1, 4), dtype=np.int64), np.empty((1, 1, 4, 264), dtype=np.uint8))
    finally:
        table.remove_from_store(first, force=True)
        assert table.remove_from_store(second, force=True) == 2


@pytest.fixture
def two_layers(mc_store):
    """Two populated byte-row layers (4 heads and 2 heads of 264-byte rows): (table, first, second, tables)."""
    first, second = next_layer(), next_layer()
    table = EngramStore({first: byte_config(SIZES, 264), second: byte_config([7, 11], 264)}, store_client=mc_store)
    tables = {first: spec_tables(SIZES, 264), second: spec_tables([7, 11], 264)}
    for layer_id, layer_tables in tables.items():
        table.populate(layer_id, layer_tables)
    yield table, first, second, tables
    table.remove_from_store(first, force=True)
    table.remove_from_store(second, force=True)


def test_lookup_many_into(two_layers):
    table, first, second, tables = two_layers
    rng = np.random.default_rng(0)
    ids = [np.stack([rng.integers(0, n, (2, 3)) for n in SIZES], axis=-1),
           np.stack([rng.integers(0, n, (1, 5)) for n in [7, 11]], axis=-1),
           np.zeros((0, 3, 4), dtype=np.int64),                       # empty: skipped
           np.stack([rng.integers(0, n, (4, 1)) for n in SIZES], axis=-1)]  # a layer may come twice
    layer_ids = [first, second, first, first]
    outputs = [np.full(i.shape + (264,), 17, dtype=np.uint8) for i in ids]
    assert table.lookup_many_into(layer_ids, ids, outputs) is None
    for layer_id, i, output in zip(layer_ids, ids, outputs):
        np.testing.assert_array_equal(output, gather(tables[layer_id], i))

    with pytest.raises(RuntimeError, match="must have equal lengths, got 2, 2 and 1"):
        table.lookup_many_into([first, second], ids[:2], outputs[:1])
    with pytest.raises(RuntimeError, match=r"row_ids\[1\]: expected a C-contiguous int64 NumPy array") as info:
        table.lookup_many_into([first, second], [ids[0], ids[1].tolist()], outputs[:2])
    assert isinstance(info.value, TypeError)  # also an InvalidType
    with pytest.raises(RuntimeError, match=r"outputs\[0\] and outputs\[1\] overlap in memory"):
        table.lookup_many_into([first, first], [ids[0], ids[0]], [outputs[0], outputs[0]])

    for output in outputs:
        output.fill(17)
    bad = ids[1].copy()
    bad[0, 4, 1] = 11
    with pytest.raises(RuntimeError, match=rf"row_ids\[0, 4, 1\] = 11 is out of range: head 1 of layer {second}"):
        table.lookup_many_into([first, second], [ids[0], bad], outputs[:2])
    assert not outputs[0].any() and not outputs[1].any()  # every output zeroed


def test_lookup_many_into_registered_writes_raw_addresses(two_layers):
    table, first, second, tables = two_layers
    rng = np.random.default_rng(1)
    ids = [np.stack([rng.integers(0, n, (2, 3)) for n in SIZES], axis=-1),
           np.stack([rng.integers(0, n, (1, 5)) for n in [7, 11]], axis=-1),
           np.zeros((0, 3, 4), dtype=np.int64)]                        # empty: its address is not used
    layer_ids = [first, second, first]
    # One arena with a guard byte after each output: nothing is written outside the sizes given.
    sizes = [i.size * 264 for i in ids]
    arena = np.full(sum(sizes) + len(sizes), 99, dtype=np.uint8)
    starts = np.cumsum([0] + [n + 1 for n in sizes[:-1]])
    addresses = [arena.ctypes.data + int(s) for s in starts[:2]] + [0]
    assert table.lookup_many_into_registered(layer_ids, ids, addresses, sizes) is None
    for layer_id, i, start, n in zip(layer_ids[:2], ids[:2], starts, sizes):
        got = arena[start:start + n].reshape(i.shape + (264,))
        np.testing.assert_array_equal(got, gather(tables[layer_id], i))
        assert arena[start + n] == 99

    with pytest.raises(RuntimeError, match="must have equal lengths, got 2, 2, 2 and 1"):
        table.lookup_many_into_registered(layer_ids[:2], ids[:2], addresses[:2], sizes[:1])
    with pytest.raises(RuntimeError, match=r"output_addresses\[0\]: registered output address must be nonzero"):
        table.lookup_many_into_registered([first], ids[:1], [0], sizes[:1])
    with pytest.raises(RuntimeError, match=r"output_sizes\[0\]: expected 6336 bytes"):
        table.lookup_many_into_registered([first], ids[:1], addresses[:1], [sizes[0] - 1])
    with pytest.raises(RuntimeError, match=r"requires contiguous int64 IDs \[B,L,H\]: expected row_ids\[0\]"):
        table.lookup_many_into_registered([first], [ids[0].astype(np.int32)], addresses[:1], sizes[:1])
    with pytest.raises(RuntimeError, match=r"output_addresses\[0\] and output_addresses\[1\] overlap"):
        table.lookup_many_into_registered([first, first], [ids[0], ids[0]], [addresses[0]] * 2, [sizes[0]] * 2)
    with pytest.raises(ValueError, match="Unknown Engram layer"):
        table.lookup_many_into_registered([first, 10 ** 6], ids[:2], addresses[:2], sizes[:2])
    bad = ids[1].copy()
    bad[0, 4, 1] = 11
    with pytest.raises(RuntimeError, match=rf"row_ids\[0, 4, 1\] = 11 is out of range: head 1 of layer {second}"):
        table.lookup_many_into_registered([second], [bad], addresses[1:2], sizes[1:2])


def test_packed_lookup_preserves_holes_and_validates_before_writing(mc_store):
    """Mooncake's newest lookup(table_ids, row_ids, output), over two single-head layers."""
    first, second = next_layer(), next_layer()
    table = EngramStore({first: byte_config([17], 264), second: byte_config([17], 264)}, mc_store)
    tables = {first: spec_tables([17], 264)[0], second: (spec_tables([17], 264)[0] + 100).astype(np.uint8)}
    for layer_id, rows in tables.items():
        table.populate(layer_id, [rows])
    try:
        allocation = np.full(2 * 9 * 264 + 1000, 253, dtype=np.uint8)
        for tokens in (9, 1, 5):
            allocation.fill(253)
            used = 2 * tokens * 264
            output = allocation[:used].reshape(2, tokens, 264)
            ids = np.random.default_rng(tokens).integers(0, 17, (2, tokens)).astype(np.int64)
            ids[0, tokens // 2] = -1
            assert table.lookup([first, second], ids, output) is None
            for i, layer_id in enumerate((first, second)):
                for t in range(tokens):
                    want = np.full(264, 253, np.uint8) if ids[i, t] == -1 else tables[layer_id][ids[i, t]]
                    np.testing.assert_array_equal(output[i, t], want)
            assert (allocation[used:] == 253).all()
        allocation.fill(253)
        output = allocation[:2 * 5 * 264].reshape(2, 5, 264)
        for bad_id in (-2, 17):
            ids = np.zeros((2, 5), dtype=np.int64)
            ids[1, 3] = bad_id
            with pytest.raises(RuntimeError, match=rf"row_ids\[1, 3\] = {bad_id} is out of range"):
                table.lookup([first, second], ids, output)
            assert (allocation == 253).all()
        ids = np.zeros((2, 5), dtype=np.int64)
        for bad_ids, bad_output, message in [
                (ids.astype(np.int32), output, "contiguous int64 IDs"),
                (ids, allocation[:2 * 5 * 263].reshape(2, 5, 263), "expected \\(2, 5, 264\\)"),
                (ids, output[..., ::-1], "not C-contiguous")]:
            with pytest.raises(ValueError, match=message):
                table.lookup([first, second], bad_ids, bad_output)
        assert table.lookup([first, second], np.zeros((2, 0), dtype=np.int64),
                            np.empty((2, 0, 264), dtype=np.uint8)) is None
        with pytest.raises(ValueError, match="has 4 heads"):
            EngramStore({1: byte_config(SIZES, 8)}).lookup([1], np.zeros((1, 1), dtype=np.int64),
                                                             np.empty((1, 1, 8), dtype=np.uint8))
    finally:
        table.remove_from_store(first, force=True)
        table.remove_from_store(second, force=True)


# ---- tables on this host: bind_local -------------------------------------------------------------------


def test_local_tables_lifetime_and_bounds():
    layers = {1: byte_config(SIZES, 264), 14: byte_config(SIZES, 264)}
    table = EngramStore(layers)
    tables = spec_tables(SIZES, 264)
    arrays = [t.copy() for t in tables]
    for array in arrays:
        array.flags.writeable = False
    refs = [weakref.ref(array) for array in arrays]
    assert table.bind_local(1, arrays) is None
    del arrays, array
    gc.collect()
    assert all(ref() is not None for ref in refs)  # retained by the EngramStore, not copied
    ids = last_row_ids()
    output = np.empty((1, 1, 4, 264), dtype=np.uint8)  # never registered
    table.lookup_into(1, ids, output)
    np.testing.assert_array_equal(output, gather(tables, ids))
    assert output[0, 0, 0].ctypes.data != refs[0]().ctypes.data
    output.fill(7)
    with pytest.raises(RuntimeError, match="layer 14 has no tables to read") as info:
        table.lookup_into(14, ids, output)  # bound layers only
    assert isinstance(info.value, NotConnected)
    del info  # its traceback holds the EngramStore
    assert (output == 7).all()  # no backend at all: untouched, as in Mooncake
    with pytest.raises(RuntimeError, match=r"row_ids\[0, 0, 3\] = 29 is out of range"):
        table.lookup_into(1, np.array([[[16, 18, 22, 29]]], dtype=np.int64), output)
    assert not output.any()
    del table
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_bind_local_reads_memmaps_in_place(tmp_path):
    tables = spec_tables([5, 6], 3)
    maps = []
    for h, rows in enumerate(tables):
        path = tmp_path / f"head-{h}.bin"
        path.write_bytes(rows.tobytes())
        maps.append(np.memmap(path, dtype=np.uint8, mode="r", shape=rows.shape))
    table = EngramStore({2: byte_config([5, 6], 3)})
    table.bind_local(2, maps)
    ids = np.array([[[4, 5], [0, 0]]], dtype=np.int64)
    output = np.empty((1, 2, 2, 3), dtype=np.uint8)
    table.lookup_into(2, ids, output)
    np.testing.assert_array_equal(output, gather(tables, ids))


def test_bind_local_is_refused_with_a_store_twice_or_for_bad_arrays(mc_store, tmp_path):
    tables = spec_tables(SIZES, RB)
    for table in (EngramStore({1: byte_config(SIZES, RB)}, mc_store),
                  EngramStore({1: byte_config(SIZES, RB)}, local_dir=str(tmp_path))):
        with pytest.raises(RuntimeError, match="bind_local requires an unbound layer and no Store client"):
            table.bind_local(1, tables)
    table = EngramStore({1: byte_config(SIZES, RB)})
    with pytest.raises(RuntimeError, match="expected 4 tables"):
        table.bind_local(1, tables[:2])
    with pytest.raises(RuntimeError, match=r"embedding_buffers\[0\]: expected a C-contiguous uint8 array"):
        table.bind_local(1, [t.astype(np.float32) for t in tables])
    table.bind_local(1, tables)
    with pytest.raises(RuntimeError, match="already bound") as info:
        table.bind_local(1, tables)
    assert isinstance(info.value, InvalidArgument)
    with pytest.raises(RuntimeError, match="populate") as info:
        table.populate(1, tables)  # bound tables are the caller's; there is nowhere to write
    assert isinstance(info.value, NotConnected)


# ---- tables on this host: local_dir --------------------------------------------------------------------


def test_local_tables_own_copies_and_reopen(tmp_path):
    layers = {1: byte_config(SIZES, 264), 14: byte_config(SIZES, 264)}
    writer = EngramStore(layers, local_dir=str(tmp_path))
    reader = EngramStore(layers, local_dir=str(tmp_path))  # built before the layer is published
    ids = last_row_ids()
    output = np.full((1, 1, 4, 264), 7, dtype=np.uint8)
    with pytest.raises(RuntimeError, match="layer 1 is not published under local_dir") as info:
        reader.lookup_into(1, ids, output)
    assert isinstance(info.value, ObjectNotFound)
    assert not output.any()
    tables = spec_tables(SIZES, 264)
    arrays = [t.copy() for t in tables]
    refs = [weakref.ref(array) for array in arrays]
    assert writer.populate(1, arrays) is None
    for array in arrays:
        array.fill(0)
    del arrays, array
    gc.collect()
    assert all(ref() is None for ref in refs)  # copied, not retained
    for handle in (reader, EngramStore({1: byte_config(SIZES, 264)}, local_dir=str(tmp_path)), writer):
        output = np.empty((1, 1, 4, 264), dtype=np.uint8)
        handle.lookup_into(1, ids, output)
        np.testing.assert_array_equal(output, gather(tables, ids))
    with pytest.raises(RuntimeError, match="layer 14 is not published"):
        reader.lookup_into(14, ids, output)
    output.fill(7)
    with pytest.raises(RuntimeError, match=r"row_ids\[0, 0, 0\] = 17 is out of range"):
        reader.lookup_into(1, np.array([[[17, 0, 0, 0]]], dtype=np.int64), output)
    assert not output.any()
    head = tmp_path / "layer-1" / "head-0.bin"
    assert head.stat().st_mode & 0o777 == 0o444 & ~_umask()  # read-only, readable as the umask allows
    assert (tmp_path / "layer-1" / "layout").read_text() == "mooncake-engram-v1\n264\n17\n19\n23\n29\n"


def test_local_publish_validation_and_recovery(tmp_path, mc_store):
    directory = str(tmp_path)
    with pytest.raises(ValueError, match="store_client and local_dir are mutually exclusive"):
        EngramStore({1: byte_config(SIZES, 264)}, mc_store, local_dir=directory)
    with pytest.raises(ValueError, match="mutually exclusive"):
        EngramStore(layers={1: byte_config(SIZES, 264)}, store_client=mc_store, local_dir=directory)
    table = EngramStore({1: byte_config(SIZES, 264)}, local_dir=directory)
    tables = spec_tables(SIZES, 264)
    with pytest.raises(RuntimeError, match="expected 4 tables"):
        table.populate(1, tables[:-1])
    assert not (tmp_path / "layer-1").exists()
    (tmp_path / "layer-1.tmp").mkdir()
    (tmp_path / "layer-1.tmp" / "head-0.bin").write_bytes(b"left by a writer that died")
    table.populate(1, tables)
    assert not (tmp_path / "layer-1.tmp").exists()
    with pytest.raises(RuntimeError, match="layer 1 is already published") as info:
        table.populate(1, tables)
    assert isinstance(info.value, ObjectExists)
    with pytest.raises(RuntimeError, match="published with layout row_bytes=264.*configured with row_bytes=265"):
        EngramStore({1: byte_config(SIZES, 265)}, local_dir=directory)
    head = tmp_path / "layer-1" / "head-0.bin"
    os.chmod(head, 0o600)
    head.write_bytes(b"short")
    with pytest.raises(RuntimeError, match="head-0.bin holds 5 bytes, expected 4488") as info:
        EngramStore({1: byte_config(SIZES, 264)}, local_dir=directory)
    assert isinstance(info.value, EngramError)


def test_a_layer_that_cannot_be_written_fails_with_runtime_error(tmp_path):
    table = EngramStore({1: byte_config([3], 4)}, local_dir=str(tmp_path))
    (tmp_path / "layer-1.lock").mkdir()  # the lock file cannot be opened (root included)
    with pytest.raises(RuntimeError, match=f"cannot publish layer 1 at {tmp_path}/layer-1: .*layer-1.lock") as info:
        table.populate(1, [np.zeros((3, 4), dtype=np.uint8)])
    assert isinstance(info.value, StoreError)
    assert not (tmp_path / "layer-1").exists()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
