"""The one rule for reading mapped segment memory (``client.read_mapped``) and the store row cache's placement tag,
in process and fast: a segment's real generation table, a real master and segment for the placement's age guard.
The same rules under churn, over processes, are ``tests/faults/test_churn_reads.py``."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from engram_store import DistributedStore, EngramStore, EngramStoreConfig, StalePlacement
from engram_store.client import MappedCheck, object_checks, read_mapped
from engram_store.kernels import check_pairs_for
from engram_store.segment import SegmentServer
from engram_store.segment._generations import Generations
from engram_store.master import MasterServer


@pytest.fixture
def table():
    generations = Generations("test-generations", 1 << 20)
    try:
        generations.claim(0, 640, 7)
        generations.claim(1024, 64, 8)
        yield generations
    finally:
        generations.close()


NOT_FRESH = 0.0


def _fresh(s: float = 60.0) -> float:
    """A ``fresh_until`` ``s`` from now."""
    return time.monotonic() + s


def _checks(generations, *objects):
    return (MappedCheck(generations.table, check_pairs_for(*(np.array(c, dtype=np.int64) for c in zip(*objects)))),)


def test_a_fresh_answer_reads_without_looking_and_an_old_one_only_what_its_table_proves(table):
    held = _checks(table, (0, 640, 7), (1024, 64, 8))
    assert read_mapped(lambda: "rows", held, NOT_FRESH, "layer 1") == "rows"
    assert read_mapped(lambda: "rows", (MappedCheck(None, held[0].pairs),), _fresh(), "") == "rows"  # no table needed
    table.claim(0, 64, 9)  # another put took part of the first object's space
    calls = []
    with pytest.raises(StalePlacement, match=r"layer 1: a table mapped on this host \(offset 0, put 7\)"):
        read_mapped(lambda: calls.append(1), held, NOT_FRESH, "layer 1")
    assert not calls, "a read the table already refused was made"
    assert read_mapped(lambda: "rows", held, _fresh(), "") == "rows"  # time alone proves a fresh answer


def test_a_mapped_file_shorter_than_the_read_needs_is_refused_before_anything_is_read(table):
    """A durable segment's file cut short while its segment was down: a read past its end would die of SIGBUS, so
    the one rule asks each mapped file's size first, however fresh the answer (the explorer, seed 972128)."""
    pairs = _checks(table, (0, 640, 7))[0].pairs
    asked = []

    def shrunk(need: int) -> bool:
        asked.append(need)
        return need > 320  # the file holds 320 bytes now

    for fresh in (NOT_FRESH, _fresh()):
        with pytest.raises(StalePlacement, match="layer 1: the file of a segment mapped on this host is shorter "
                                                 "than the 640 bytes the read needs"):
            read_mapped(lambda: pytest.fail("read past the end"), (MappedCheck(table.table, pairs, 640, shrunk),),
                        fresh, "layer 1")
    assert asked == [640, 640]
    whole = (MappedCheck(table.table, pairs, 640, lambda need: need > 4096),)
    assert read_mapped(lambda: "rows", whole, NOT_FRESH, "layer 1") == "rows"
    assert read_mapped(lambda: "rows", object_checks(table.table, 0, 640, 7, lambda need: need > 640), _fresh(),
                       "") == "rows"
    with pytest.raises(StalePlacement, match="shorter than the 640 bytes"):
        read_mapped(lambda: "rows", object_checks(table.table, 0, 640, 7, lambda need: need > 600), _fresh(), "")


def test_a_put_that_claims_the_space_while_it_is_read_fails_the_read(table):
    held = _checks(table, (0, 640, 7))
    with pytest.raises(StalePlacement, match="put 7"):
        read_mapped(lambda: table.claim(320, 64, 9), held, NOT_FRESH, "layer 1")
    other = _checks(table, (1024, 64, 8))  # a claim beside the object read: the seq moves, the checks hold
    assert read_mapped(lambda: table.claim(4096, 64, 10) or "rows", other, NOT_FRESH, "layer 1") == "rows"


def test_an_error_of_a_read_stands_only_where_the_space_was_not_taken_meanwhile(table):
    held = _checks(table, (0, 640, 7))

    def bad_row():
        raise ValueError("a NaN code")

    with pytest.raises(ValueError, match="NaN"):
        read_mapped(bad_row, held, NOT_FRESH, "layer 1")

    def taken_then_bad():
        table.claim(0, 640, 11)
        bad_row()

    with pytest.raises(StalePlacement) as caught:
        read_mapped(taken_then_bad, held, NOT_FRESH, "layer 1")
    assert isinstance(caught.value.__context__, ValueError)


def test_a_fresh_read_that_outlasts_its_proof_is_checked_after_it(table):
    """A read begun while the master's answer was fresh but ended after (a thread descheduled on a loaded host): the
    space may have been given to another put meanwhile, so the table must prove the object still there at its end."""
    held = _checks(table, (0, 640, 7))

    def slow(claim):
        def read():
            deadline = time.monotonic() + 0.05
            if claim:
                table.claim(320, 64, 12)  # another put took the space while the read went on
            while time.monotonic() < deadline:
                pass
            return "rows"
        return read

    assert read_mapped(slow(False), held, _fresh(0.01), "layer 1") == "rows"  # outlasted, and the table holds
    with pytest.raises(StalePlacement, match="put 7"):
        read_mapped(slow(True), held, _fresh(0.01), "layer 1")
    no_table = (MappedCheck(None, held[0].pairs),)
    assert read_mapped(lambda: "rows", no_table, _fresh(), "") == "rows"  # ended in time: no table needed
    with pytest.raises(StalePlacement, match="nothing here can"):
        read_mapped(slow(False), no_table, _fresh(0.01), "layer 1")


def test_what_cannot_be_proven_past_a_fresh_answer_is_refused(table):
    """No table, a master that named no put (generation 0), a table that overflowed: the read is not made."""
    for checks in (MappedCheck(None, check_pairs_for(np.array([0]), np.array([640]), np.array([7]))),), \
            object_checks(table.table, 0, 640, 0):
        with pytest.raises(StalePlacement, match="nothing here can"):
            read_mapped(lambda: pytest.fail("read"), checks, NOT_FRESH, "object 'k'")
    assert read_mapped(lambda: "rows", object_checks(table.table, 0, 640, 7), NOT_FRESH, "object 'k'") == "rows"
    assert read_mapped(lambda: "rows", (), NOT_FRESH, "nothing mapped") == "rows"
    overflowed = np.array(table.table)
    overflowed[3] = 1
    with pytest.raises(StalePlacement, match="cannot tell"):
        read_mapped(lambda: pytest.fail("read"), (MappedCheck(overflowed, _checks(table, (0, 640, 7))[0].pairs),),
                    NOT_FRESH, "l")


CONFIG = EngramStoreConfig(table_vocab_sizes=[101, 103], embedding_dim=16)


def test_a_lookups_mapped_tables_are_checked_from_half_the_reuse_delay_on():
    """A placement younger than half the reuse delay is read as it is (the master keeps a removed table's space
    unused that long); from half the delay on, through the generation table: a layer removed since is refused."""
    rng = np.random.default_rng(0)
    tables = [rng.standard_normal((n, 16), dtype=np.float32) for n in CONFIG.table_vocab_sizes]
    with MasterServer("127.0.0.1", 0, reuse_delay_s=2.0).start() as master, \
            SegmentServer(8 << 20, master.address, host="127.0.0.1", port=0).start(), \
            DistributedStore(master.address, local_direct=True) as store:
        layer = EngramStore(1, CONFIG, store)
        layer.populate(tables)
        ids = np.array([[[3, 7], [100, 0]]])
        np.testing.assert_array_equal(layer.lookup(ids)[0, 1, 0], tables[0][100])
        lay = layer._layer(None)
        placement, placements = lay.state.placement, layer._source.placements
        assert placement.memory.sources and placement.local_checked, "the layer is mapped here"
        assert layer.stats()["placement_refreshes"] == 1  # built once
        safe = placements.local_safe_s()
        assert safe == store.reuse_delay_s / 2 == 1.0
        assert placements.read_mapped(lay, placement, lambda: "rows", age=safe * 2) == "rows"
        EngramStore(1, CONFIG, store).remove_from_store(force=True)  # the segment hears of it at once
        assert placements.read_mapped(lay, placement, lambda: "rows", age=safe * 0.99) == "rows"
        for age in (safe, safe * 2, 1e9):
            with pytest.raises(StalePlacement, match="layer 1: a table mapped on this host"):
                placements.read_mapped(lay, placement, lambda: pytest.fail("read"), age=age)
        out = np.zeros((2, 2, 16), np.float32)
        with pytest.raises(StalePlacement):
            placements.gather(lay, placement, ids.reshape(-1, 2), out.reshape(-1).view(np.uint8), 1, age=safe)
        # Without an age, the placement's own: a fresh one is read as it is, though nothing here could prove it.
        fresh = dataclasses.replace(placement, checked_at=time.monotonic(),
                                    local_checks=tuple(c._replace(table=None) for c in placement.local_checks))
        assert placements.read_mapped(lay, fresh, lambda: "rows") == "rows"
        with pytest.raises(StalePlacement, match="nothing here can"):
            placements.read_mapped(lay, dataclasses.replace(fresh, checked_at=time.monotonic() - safe),
                                   lambda: pytest.fail("read"))


def test_the_row_cache_serves_and_keeps_only_rows_of_the_placement_it_holds():
    from engram_store.tables._source_store import _RowCache

    cache = _RowCache(1 << 16, 8)
    keys = np.array([5, 6, 7], dtype=np.int64)
    rows = np.arange(6, dtype=np.float32).reshape(3, 2)
    out = np.zeros((3, 2), np.float32)
    assert cache.probe(("p1",), keys, out)[1] == 0 and cache.tag is None
    cache.fill(("p1",), keys, np.arange(3), rows, out)  # no placement held yet: kept out
    assert cache.probe(("p1",), keys, out)[1] == 0
    np.testing.assert_array_equal(out, rows)  # (the reader's own rows are laid out all the same)
    cache.clear(("p1",))
    cache.fill(("p1",), keys, np.arange(3), rows, np.zeros((3, 2), np.float32))
    got = np.zeros((3, 2), np.float32)
    hit, hits = cache.probe(("p1",), keys, got)
    assert hits == 3 and hit.all()
    np.testing.assert_array_equal(got, rows)
    assert cache.probe(("p2",), keys, got)[1] == 0, "a reader of another placement took rows of the first"
    cache.clear(("p2",))  # the layer moved: a fill of a read begun under p1 must not land
    cache.fill(("p1",), keys, np.arange(3), rows, np.zeros((3, 2), np.float32))
    assert cache.probe(("p2",), keys, got)[1] == 0 and cache.probe(("p1",), keys, got)[1] == 0


def test_only_tables_that_lie_wholly_in_a_mapped_segment_are_read_in_place():
    """A head whose table ends exactly at the segment's end is read in place; a master answer that names a place
    running past the mapping (or before it) is read through the segment, never from beyond the mapped memory."""
    one = EngramStoreConfig(table_vocab_sizes=[16384], embedding_dim=16)  # 1 MiB: the whole segment
    rows = np.random.default_rng(1).standard_normal((16384, 16), dtype=np.float32)
    with MasterServer("127.0.0.1", 0).start() as master, \
            SegmentServer(1 << 20, master.address, host="127.0.0.1", port=0).start(), \
            DistributedStore(master.address, local_direct=True) as store:
        store.put("engram:l2:h0", rows)  # the table alone (no room for a manifest): read without one
        layer = EngramStore(2, one, store, require_manifest=False)
        ids = np.array([[[0], [16383]]])
        np.testing.assert_array_equal(layer.lookup(ids)[0, :, 0], rows[[0, 16383]])
        assert layer.stats()["local_rows"] == 2, "a table filling its segment is read in place"
        lay, placements = layer._layer(None), layer._source.placements
        (info,) = store.locate(lay.keys, lease=False)
        for offset in (64, -64):  # past the end of the mapping, before its start
            moved = dataclasses.replace(info, replicas=tuple(dataclasses.replace(r, offset=offset)
                                                             for r in info.replicas))
            placement = placements._build(lay, [moved], set(), ("moved", offset), time.monotonic())
            assert not placement.memory.sources and [h for h in placement.order] == [0], \
                f"a table at offset {offset} of a mapped segment of its own size was read in place"
