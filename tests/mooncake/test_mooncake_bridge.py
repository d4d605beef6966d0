"""EngramStore and Engram, unchanged, on a real Mooncake store (``mooncake_master`` from Mooncake's wheel).

Two layouts, each with its own ``mooncake_master`` on free loopback ports:

- ``segment-process``: the tables live in a ``mooncake_client`` process; the test's client mounts no memory,
  so every row travels over Mooncake's TCP transfer engine.
- ``in-process``: the test's client mounts the only segment (Mooncake's "embedded" shape).

Skipped, with the reason, where Mooncake's wheel cannot load: ``pip install "engram[mooncake]"`` (the
non-CUDA wheel) and, on Debian/Ubuntu, ``apt-get install libibverbs1``.
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

try:
    import mooncake.store as mooncake_store  # noqa: E402  (fails without the wheel, or without libibverbs.so.1)
except ImportError as exc:
    pytest.skip(f"Mooncake bridge: mooncake.store does not load ({exc}); to run these tests install "
                "Mooncake's wheel with `pip install -e \".[mooncake]\"` (mooncake-transfer-engine-non-cuda) and "
                "its system library with `apt-get install libibverbs1`", allow_module_level=True)

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

from mooncake_procs import MooncakeMaster, MooncakeSegment, connect  # noqa: E402

from engram_model.demo.demo import quick_start_configs  # noqa: E402

from engram_model import Engram  # noqa: E402
from engram_model.demo.example import TransformerWithEngram  # noqa: E402
from engram_store import (DistributedStore, EngramStore, EngramStoreConfig,  # noqa: E402
                          InvalidArgument, InvalidType, LeaseActive, ObjectExists, ObjectNotFound)
from engram_store.testing import Cluster  # noqa: E402

pytestmark = pytest.mark.timeout(180)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module", params=["segment-process", "in-process"])
def mooncake(request):
    """A real ``mooncake.store.MooncakeDistributedStore`` against its own ``mooncake_master``."""
    with MooncakeMaster() as master:
        if request.param == "segment-process":
            with MooncakeSegment(master, size=256 << 20):
                store = connect(master.address, segment_size=0)
                try:
                    yield store
                finally:
                    store.close()
        else:
            store = connect(master.address, segment_size=256 << 20)
            try:
                yield store
            finally:
                store.close()


def tables_for(sizes, dim, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, dim), dtype=np.float32) for n in sizes]


def gather(tables, ids):
    return np.stack([tables[h][ids[..., h]] for h in range(len(tables))], axis=-2)  # (B, L, H, D)


class CountingStore:
    """The real store, with a count of every read and write the EngramStore sends it."""

    READS_AND_WRITES = ("get_into_ranges", "batch_put_from", "remove")

    def __init__(self, store):
        self._store = store
        self.calls = dict.fromkeys(self.READS_AND_WRITES, 0)

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if name in self.READS_AND_WRITES:
            def counted(*args, **kwargs):
                self.calls[name] += 1
                return attr(*args, **kwargs)
            return counted
        return attr


# ---- EngramStore ------------------------------------------------------------------------------------


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_lookup_equals_numpy_fancy_indexing(mooncake, data):
    H = data.draw(st.integers(1, 5), label="H")
    D = data.draw(st.integers(1, 40), label="D")
    sizes = data.draw(st.lists(st.integers(1, 3000), min_size=H, max_size=H), label="sizes")
    B, L = data.draw(st.integers(1, 6), label="B"), data.draw(st.integers(1, 12), label="L")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    # A narrow id range per head makes duplicates (and adjacent rows) likely.
    spans = [min(n, data.draw(st.sampled_from([2, 7, 64, 3000]), label=f"span{h}")) for h, n in enumerate(sizes)]
    ids = np.stack([rng.integers(0, s, size=(B, L)) + rng.integers(0, n - s + 1)
                    for s, n in zip(spans, sizes)], axis=-1)            # (B, L, H)
    tables = tables_for(sizes, D, seed)
    layer = EngramStore(40, EngramStoreConfig(table_vocab_sizes=sizes, embedding_dim=D), mooncake)
    try:
        layer.populate(tables)
        expected = gather(tables, ids)
        got = layer.lookup(ids)
        assert got.dtype == np.float32 and got.shape == (B, L, H, D)
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(layer.lookup(ids.tolist()), expected)
        out = np.full((B, L, H, D), np.nan, dtype=np.float32)
        assert layer.lookup_into(ids.astype(np.int32), out) is out
        np.testing.assert_array_equal(out, expected)
        np.testing.assert_array_equal(layer.prefetch(ids).result(timeout=60), expected)
    finally:
        assert layer.remove_from_store(force=True) == H
        layer.close()


def test_populate_is_create_only_and_remove_counts(mooncake):
    sizes, D = [1009, 1013, 1019, 1021], 16
    tables = tables_for(sizes, D, seed=1)
    layer = EngramStore(41, EngramStoreConfig(table_vocab_sizes=sizes, embedding_dim=D), mooncake)
    keys = layer.get_store_keys()
    assert keys == [f"engram:l41:h{h}" for h in range(4)]
    try:
        # One head already present: refused, naming it, and no other head is written.
        assert mooncake.put(keys[2], b"someone else's bytes") == 0
        with pytest.raises(ObjectExists, match="engram:l41:h2"):
            layer.populate(tables)
        assert mooncake.batch_is_exist(keys) == [0, 0, 1, 0]
        assert mooncake.remove(keys[2], True) == 0

        layer.populate(tables)
        assert mooncake.batch_is_exist(keys) == [1, 1, 1, 1]
        assert [mooncake.get_size(k) for k in keys] == [n * D * 4 for n in sizes]
        with pytest.raises(ObjectExists, match="engram:l41:h0"):
            layer.populate(tables_for(sizes, D, seed=2))
        ids = np.array([[[0, 1, 2, 1020]]])
        np.testing.assert_array_equal(layer.lookup(ids), gather(tables, ids))  # the first tables, unchanged
    finally:
        assert layer.remove_from_store(force=True) == 4
    assert layer.remove_from_store() == 0  # missing keys are skipped
    assert mooncake.batch_is_exist(keys) == [0, 0, 0, 0]
    with pytest.raises(ObjectNotFound, match="layer 41 is not published"):
        layer.lookup(ids)
    layer.close()


def test_remove_is_refused_while_a_read_lease_is_live(mooncake):
    """Mooncake leases every object a read (or an existence check) touches, for ``-default_kv_lease_ttl`` (10 s):
    remove without force works on tables nobody has read, and is refused (nothing removed) after a lookup."""
    sizes, D = [101, 103], 8
    tables = tables_for(sizes, D, seed=3)
    layer = EngramStore(42, EngramStoreConfig(table_vocab_sizes=sizes, embedding_dim=D), mooncake)
    try:
        layer.populate(tables)
        assert layer.remove_from_store() == 2
        assert layer.remove_from_store() == 0
        layer.populate(tables)
        ids = np.array([[[5, 6]]])
        layer.lookup(ids)
        with pytest.raises(LeaseActive, match="engram:l42:manifest"):  # leased by the lookup's layout check
            layer.remove_from_store()
        assert mooncake.batch_is_exist(layer.get_store_keys()) == [1, 1]
        np.testing.assert_array_equal(layer.lookup(ids), gather(tables, ids))
    finally:
        assert layer.remove_from_store(force=True) == 2
        layer.close()


def test_invalid_row_ids_raise_before_any_read(mooncake):
    sizes, D = [50, 60, 70], 4
    counting = CountingStore(mooncake)
    layer = EngramStore(43, EngramStoreConfig(table_vocab_sizes=sizes, embedding_dim=D), counting)
    try:
        layer.populate(tables_for(sizes, D, seed=4))
        # three tables, then the layout manifest
        assert counting.calls == {"get_into_ranges": 0, "batch_put_from": 4, "remove": 0}
        bad = [
            (np.array([[[0, 60, 0]]]), InvalidArgument, r"row_ids\[0, 0, 1\] = 60 is out of range"),
            (np.array([[[0, 0, -1]]]), InvalidArgument, r"row_ids\[0, 0, 2\] = -1"),
            (np.zeros((2, 3, 2), dtype=np.int64), InvalidArgument, "H = 3"),
            (np.zeros((0, 1, 3), dtype=np.int64), InvalidArgument, "non-empty"),
            ([[[0, 1, 2]], [[0, 1]]], InvalidArgument, "ragged"),
            (np.zeros((1, 1, 3), dtype=np.float32), InvalidType, "integer"),
            ([], InvalidArgument, "shape"),
        ]
        for ids, error, message in bad:
            with pytest.raises(error, match=message):
                layer.lookup(ids)
            with pytest.raises(error):
                layer.prefetch(ids)
        with pytest.raises(InvalidArgument, match="out"):
            layer.lookup_into(np.zeros((1, 1, 3), dtype=np.int64), np.empty((1, 1, 3, D + 1), dtype=np.float32))
        assert counting.calls["get_into_ranges"] == 0
    finally:
        assert layer.remove_from_store(force=True) == 3
        layer.close()


def test_interoperates_with_mooncakes_own_engram_store(mooncake):
    """A layer written by either EngramStore reads back the same through the other (same keys, same bytes).

    Mooncake's EngramStore writes no layout manifest, so ours reads its layers with ``require_manifest=False``.
    """
    sizes, D = [1009, 1013, 7], 8
    tables = tables_for(sizes, D, seed=5)
    ids = np.stack([np.random.default_rng(6).integers(0, n, size=(4, 5)) for n in sizes], axis=-1)
    theirs_config = mooncake_store.EngramStoreConfig()
    theirs_config.table_vocab_sizes = sizes
    theirs_config.embedding_dim = D
    ours = EngramStore(44, EngramStoreConfig(table_vocab_sizes=sizes, embedding_dim=D), mooncake)
    theirs = mooncake_store.EngramStore(44, theirs_config, mooncake)
    assert theirs.get_store_keys() == ours.get_store_keys()
    try:
        ours.populate(tables)
        np.testing.assert_array_equal(theirs.lookup(ids), gather(tables, ids))
        assert ours.remove_from_store(force=True) == 3
        theirs.populate(tables)
        with pytest.raises(ObjectNotFound, match="not published"):
            ours.lookup(ids)
        legacy = EngramStore(44, EngramStoreConfig(table_vocab_sizes=sizes, embedding_dim=D), mooncake,
                             require_manifest=False)
        np.testing.assert_array_equal(legacy.lookup(ids), gather(tables, ids))
        legacy.close()
    finally:
        ours.remove_from_store(force=True)
        ours.close()


def test_tables_are_hard_pinned_against_eviction():
    """Filling a segment makes Mooncake evict unpinned objects; an EngramStore's tables are never among them."""
    with MooncakeMaster(lease_ttl_ms=50) as master, MooncakeSegment(master, size=32 << 20):
        store = connect(master.address)
        sizes, D = [20_011, 20_021], 64                                 # 2 x 5 MiB
        tables = tables_for(sizes, D, seed=7)
        layer = EngramStore(45, EngramStoreConfig(table_vocab_sizes=sizes, embedding_dim=D), store)
        filler = np.ones(2 << 20, dtype=np.uint8)
        try:
            layer.populate(tables)
            assert store.register_buffer(filler.ctypes.data, filler.nbytes) == 0
            assert store.batch_put_from(["control"], [filler.ctypes.data], [filler.nbytes]) == [0]
            # Write three segments' worth of unpinned 2 MiB objects. The master evicts in the background once
            # the segment passes its high watermark; a put that finds no space fails (-200) until then, so
            # back off briefly and try again. (No existence checks meanwhile: they grant the key a lease.)
            deadline = time.monotonic() + 60
            puts = 0
            while puts < 3 * 16 and time.monotonic() < deadline:
                if store.batch_put_from([f"filler{puts}"], [filler.ctypes.data], [filler.nbytes]) == [0]:
                    puts += 1
                else:
                    time.sleep(0.02)
            assert puts == 3 * 16, f"only {puts} of {3 * 16} puts went through in 60 s"
            assert store.is_exist("control") == 0, "the unpinned control object outlived three segments of puts"
            assert master.metrics()["master_evicted_key_count"] > 0
            assert store.batch_is_exist(layer.get_store_keys()) == [1, 1]
            ids = np.stack([np.random.default_rng(8).integers(0, n, size=(3, 64)) for n in sizes], axis=-1)
            np.testing.assert_array_equal(layer.lookup(ids), gather(tables, ids))
        finally:
            layer.remove_from_store(force=True)
            layer.close()
            store.unregister_buffer(filler.ctypes.data)
            store.close()


class RegisterCountingStore(CountingStore):
    READS_AND_WRITES = ("register_buffer", "unregister_buffer")


def test_a_dropped_layers_staging_buffer_serves_the_next_layer_still_registered(mooncake):
    """A layer closed or dropped calls nothing on the store (it may be closed): its registered staging buffer
    goes to the next layer on that store, which registers nothing and reads through it."""
    store = RegisterCountingStore(mooncake)
    sizes, D = [1009, 1013], 16
    tables = tables_for(sizes, D, seed=11)
    ids = np.stack([np.random.default_rng(12).integers(0, n, size=(2, 5)) for n in sizes], axis=-1)
    first = EngramStore(47, EngramStoreConfig(table_vocab_sizes=sizes, embedding_dim=D), store)
    try:
        first.populate(tables)
        np.testing.assert_array_equal(first.lookup(ids), gather(tables, ids))
        before = dict(store.calls)  # the populate's own registrations, and the staging buffer's
        first.close()
        del first
        gc.collect()
        second = EngramStore(47, EngramStoreConfig(table_vocab_sizes=sizes, embedding_dim=D), store)
        np.testing.assert_array_equal(second.lookup(ids), gather(tables, ids))
        assert store.calls == before
        del second  # dropped without close: the buffer goes back again
        gc.collect()
        third = EngramStore(47, EngramStoreConfig(table_vocab_sizes=sizes, embedding_dim=D), store)
        np.testing.assert_array_equal(third.lookup(ids), gather(tables, ids))
        assert store.calls == before
    finally:
        third = EngramStore(47, EngramStoreConfig(table_vocab_sizes=sizes, embedding_dim=D), mooncake)
        third.remove_from_store(force=True)
        third.close()


# A layer closed or dropped after its Mooncake store was closed: nothing may call the closed store (its client
# crashes the process).
CLOSED_FIRST = textwrap.dedent('''
    import gc, sys
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from mooncake_procs import MooncakeMaster, connect
    from engram_store import EngramStore, EngramStoreConfig

    with MooncakeMaster() as master:
        store = connect(master.address, segment_size=32 << 20)
        layer = EngramStore(3, EngramStoreConfig(table_vocab_sizes=[17, 19], embedding_dim=8), store)
        layer.populate([np.ones((17, 8), np.float32), np.ones((19, 8), np.float32)])
        assert layer.lookup(np.zeros((1, 2, 2), np.int64)).sum() == 32
        store.close()
        if sys.argv[1] == "close":
            layer.close()
        del layer
        gc.collect()
        print("survived", sys.argv[1])
''')


@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_layer_closed_or_dropped_after_its_store_was_closed_calls_nothing_on_it(tmp_path, how):
    script = tmp_path / "closed_first.py"
    script.write_text(CLOSED_FIRST)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, str(script), how, os.path.dirname(os.path.abspath(__file__))],
                          capture_output=True, text=True, timeout=150, cwd=REPO, env=env)
    assert proc.returncode == 0 and f"survived {how}" in proc.stdout, \
        f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}"


# ---- Engram -----------------------------------------------------------------------------------------


def test_engram_forward_equals_embedded_store(mooncake):
    cfg, bb = quick_start_configs()
    rng = np.random.default_rng(9)
    hidden = rng.standard_normal((2, 8, bb.hc_mult, bb.hidden_size), dtype=np.float32)
    input_ids = rng.integers(0, bb.vocab_size, size=(2, 8))
    with DistributedStore.embedded(segment_size="64MiB") as embedded:
        on_mooncake = Engram(layer_id=1, config=cfg, backbone_cfg=bb, store=mooncake)
        on_embedded = Engram(layer_id=1, config=cfg, backbone_cfg=bb, store=embedded)
        tables = tables_for(on_mooncake.get_table_vocab_sizes(), on_mooncake.get_embedding_dim(), seed=10)
        on_embedded.load_state_dict(on_mooncake.state_dict())
        try:
            on_mooncake.populate_store_from_buffers(tables, [t.nbytes for t in tables])
            on_embedded.populate_store_from_buffers(tables)
            expected = on_embedded.forward(hidden, input_ids)
            np.testing.assert_array_equal(on_mooncake.forward(hidden, input_ids), expected)
            np.testing.assert_array_equal(
                on_mooncake.forward(hidden, input_ids, prefetched=on_mooncake.prefetch(input_ids)), expected)
            np.testing.assert_array_equal(on_mooncake.query_embeddings(input_ids),
                                          gather(tables, on_mooncake.hash_input_ids(input_ids)))
        finally:
            assert on_mooncake.remove_from_store(force=True) == 8
            on_embedded.remove_from_store()
            on_mooncake.close()
            on_embedded.close()


def test_model_with_two_engram_layers_equals_embedded_store(mooncake):
    """Layers 1 and 15 of the demo config, read with prefetch_layers (hash once, every read at once)."""
    cfg, bb = quick_start_configs(num_layers=16)
    bb.hidden_size, bb.hc_mult = 32, 2
    rng = np.random.default_rng(11)
    ids = rng.integers(0, bb.vocab_size, size=(2, 6))
    hidden = rng.standard_normal((2, 6, bb.hc_mult, bb.hidden_size), dtype=np.float32)
    with DistributedStore.embedded(segment_size="64MiB") as embedded:
        models = [TransformerWithEngram(cfg, bb, store) for store in (mooncake, embedded)]
        try:
            for model in models:
                model.populate_random_tables(seed=12)
            np.testing.assert_array_equal(models[0](ids, hidden), models[1](ids, hidden))
        finally:
            for model in models:
                assert sum(e.remove_from_store(force=True) for e in model.engrams.values()) == 16
                model.close()


# A user's script written for Mooncake's API; only its import line differs between the two runs.
QUICK_START = textwrap.dedent('''
    import sys
    import numpy as np
    {store_import}
    from engram_model import BackboneConfig, Engram, EngramConfig

    master, out_path = sys.argv[1], sys.argv[2]
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 64 * 1024 * 1024, 16 * 1024 * 1024, "tcp", "", master)
    assert rc == 0, f"setup returned {{rc}}"

    cfg = EngramConfig(engram_vocab_size=[1000, 1000], max_ngram_size=3, n_embed_per_ngram=64,
                       n_head_per_ngram=4, layer_ids=[1, 15], pad_id=2, seed=0, kernel_size=4)
    bb = BackboneConfig(hidden_size=256, hc_mult=4, vocab_size=128000, num_layers=6)
    engram = Engram(layer_id=1, config=cfg, backbone_cfg=bb, store=store)
    rng = np.random.default_rng(0)
    sizes, dim = engram.get_table_vocab_sizes(), engram.get_embedding_dim()
    tables = [rng.standard_normal((n, dim), dtype=np.float32) for n in sizes]
    engram.populate_store_from_buffers(tables, [t.nbytes for t in tables])
    hidden_states = rng.standard_normal((2, 8, bb.hc_mult, bb.hidden_size), dtype=np.float32)
    input_ids = rng.integers(0, bb.vocab_size, size=(2, 8)).tolist()
    output = engram.forward(hidden_states, input_ids)
    removed = engram.remove_from_store(force=True)
    engram.close()
    store.close()
    np.save(out_path, output)
    print(f"sizes={{sizes}} removed={{removed}} shape={{output.shape}}")
''')


def _run_quick_start(store_import: str, master: str, tmp_path, name: str) -> tuple[np.ndarray, str]:
    script = tmp_path / f"{name}.py"
    script.write_text(QUICK_START.format(store_import=store_import))
    out = tmp_path / f"{name}.npy"
    # PYTHONPATH: the script imports this checkout's packages, not whichever copy is installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, str(script), master, str(out)], capture_output=True, text=True,
                          timeout=150, cwd=REPO, env=env)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return np.load(out), proc.stdout.strip().splitlines()[-1]


def test_quick_start_script_runs_on_mooncake_and_on_compat(tmp_path):
    with MooncakeMaster() as master:
        real, real_line = _run_quick_start("from mooncake.store import MooncakeDistributedStore", master.address,
                                           tmp_path, "on_mooncake")
    with Cluster(segments=0) as cluster:
        compat, compat_line = _run_quick_start("from engram_store.compat import MooncakeDistributedStore",
                                               cluster.address, tmp_path, "on_compat")
    assert real_line == compat_line
    assert "sizes=[1009, 1013, 1019, 1021, 1031, 1033, 1039, 1049] removed=8 shape=(2, 8, 4, 256)" == real_line
    assert real.dtype == np.float32 and np.isfinite(real).all()
    np.testing.assert_array_equal(real, compat)
