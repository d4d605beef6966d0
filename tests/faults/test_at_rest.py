"""Durable segments across restarts and bytes that rot at rest: a reader never gets another object's rows, and what a
segment finds damaged is lost, not served."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from suite_helpers import TcpProxy, flip_byte, manifest_objects, wait_for
from engram_store import DistributedStore, EngramStore, ObjectLost, OutOfSpace, StalePlacement
from engram_store.testing import Cluster
from faults_helpers import CONFIG, expected_rows, layer_ids, layer_tables

pytestmark = pytest.mark.timeout(120)

#: The master's reuse delay here: a removed layer's space is taken again soon after.
REUSE_DELAY = ["--reuse-delay", "0.3"]


def _tables(seed: int) -> list[np.ndarray]:
    return layer_tables(seed)


def _ids(seed: int) -> np.ndarray:
    return layer_ids(seed, (2, 16))


def test_a_reader_cut_off_from_the_master_never_reads_a_layer_written_where_a_restarted_segment_held_its_own(
        tmp_path):
    """A local-direct reader keeps the mappings of a durable segment across its restart; once it is cut off from
    the master, another client removes the layer and writes another in its place: every lookup of the first layer
    returns its own rows or fails with StalePlacement."""
    path = str(tmp_path / "segment.bin")
    first, second = _tables(1), _tables(2)
    with Cluster(segments=0, heartbeat_timeout_s=30.0, extra=REUSE_DELAY) as c, TcpProxy(c.address) as proxy:
        seg = c.add_segment("16MiB", ["--file", path])
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as writer, \
                DistributedStore.connect(proxy.address, timeout_ms=300, local_direct=True) as reader:
            EngramStore(1, CONFIG, writer).populate(first)
            layer = EngramStore(1, CONFIG, reader)
            ids = _ids(0)
            np.testing.assert_array_equal(layer.lookup(ids), expected_rows(first, ids))
            assert layer.stats()["local_rows"] > 0, "the reader maps the segment's file"
            assert seg.terminate() == 0  # the routine stop: the segment closes its files
            seg = c.add_segment("16MiB", ["--file", path])
            wait_for(lambda: writer.status()["segments"][0]["confirmed"], 20, "the segment to register again")
            np.testing.assert_array_equal(layer.lookup(ids), expected_rows(first, ids))
            proxy.freeze()
            EngramStore(1, CONFIG, writer).remove_from_store(force=True)
            time.sleep(0.5)  # past the reuse delay: the next layer takes the same space
            EngramStore(2, CONFIG, writer).populate(second)
            refused = served = 0
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and refused < 20:  # (once refused, the reader asks the master first)
                ids = _ids(served + refused)
                try:
                    got = layer.lookup(ids)
                except StalePlacement:
                    refused += 1
                    continue
                np.testing.assert_array_equal(got, expected_rows(first, ids))
                served += 1
            assert refused, "the reader went on reading a layer that is gone"
            proxy.thaw()


def test_objects_a_durable_segment_finds_damaged_at_restart_are_lost_or_read_from_another_replica(tmp_path):
    """A byte flipped in one object and the file's tail cut off while the segment was stopped: the segment starts,
    the master drops the damaged replicas, readers read the other replica or get ObjectLost, status names them."""
    files = [str(tmp_path / f"segment-{i}.bin") for i in range(2)]
    tables = _tables(3)
    ids = _ids(3)
    with Cluster(segments=0, heartbeat_timeout_s=30.0) as c:
        segs = [c.add_segment("16MiB", ["--file", f]) for f in files]
        with DistributedStore.connect(c.address, timeout_ms=3000, local_direct=False) as remote, \
                DistributedStore.connect(c.address, timeout_ms=3000, local_direct=True) as local:
            EngramStore(4, CONFIG, remote).populate(tables, replica_num=2)
            remote.put("solo", b"s" * 5000, replica_num=1)
            layers = [EngramStore(4, CONFIG, store) for store in (remote, local)]
            for layer in layers:
                np.testing.assert_array_equal(layer.lookup(ids), expected_rows(tables, ids))
            assert remote.get("solo") == b"s" * 5000
            solo = remote.locate(["solo"])[0].replicas[0]
            i = [s.segment_id for s in segs].index(solo.segment_id)
            head = next(r for r in remote.locate(["engram:l4:h2"])[0].replicas if r.segment_id == solo.segment_id)
            wait_for(lambda: manifest_objects(files[i]) >= 2, 20, "the manifest to list the objects")
            assert segs[i].terminate() == 0
            flip_byte(files[i], head.offset + 17)
            assert solo.offset > head.offset
            os.truncate(files[i], solo.offset + 100)  # and the file loses its tail: the segment reads zeros there
            c.add_segment("16MiB", ["--file", files[i]])
            status = remote.status()
            assert status["lost_keys"] == ["solo"] and status["under_replicated_keys"] == ["engram:l4:h2"]
            assert "damaged" in c.segments[-1].output()
            with pytest.raises(ObjectLost, match="no longer matched its checksum"):
                remote.get("solo")
            for layer in layers:  # the placement each reader holds names the damaged replica: it reads the other
                for seed in range(4):
                    ids = _ids(10 + seed)
                    np.testing.assert_array_equal(layer.lookup(ids), expected_rows(tables, ids))
            assert not remote.is_exist("solo")


def test_a_durable_segments_generation_table_is_taken_over_in_place_by_its_next_run(tmp_path):
    """Readers on the host map the table once: the next run on the same file keeps its inode, and a table it cannot
    keep (another size) is retired, so a reader still mapping it can tell nothing from it."""
    import mmap

    from engram_store.kernels import check_pairs_for, generation_table
    from engram_store.segment._generations import Generations

    path = str(tmp_path / "segment.bin.gen")
    checks = check_pairs_for(np.array([0]), np.array([4096]), np.array([7]))
    first = Generations(None, 16 << 20, table_path=path)
    first.claim(0, 4096, 7)
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ)
    reader = np.frombuffer(mapping, dtype=np.int64)
    try:
        assert generation_table.check_table(reader, checks)[0] == generation_table.HOLDS
        first.close()
        assert os.path.exists(path), "a durable segment's table outlives its run"
        second = Generations(None, 16 << 20, table_path=path)
        assert generation_table.check_table(reader, checks)[0] == generation_table.HOLDS  # not known: not refused
        second.claim(0, 4096, 8)
        assert generation_table.check_table(reader, checks)[0] == 0, "the reader's mapping follows the new run"
        second.close()
        third = Generations(None, 64 << 20, table_path=path)  # a table of another size: a new file
        assert generation_table.check_table(reader, checks)[0] == generation_table.UNKNOWN
        third.close()
        del reader
    finally:
        mapping.close()


def test_the_master_drops_damaged_replicas_and_a_restart_from_its_journal_keeps_the_loss():
    """The master's part, without processes: a replica named damaged leaves its object (the other replica stays),
    an object left without one is lost with a message that says why, and replaying the journal gives the same."""
    from engram_store.master import MasterState

    journal: list[dict] = []
    state = MasterState(journal=journal.append)
    for sid in ("s1", "s2"):
        state.register_segment(sid, f"127.0.0.1:{sid[1:]}", 1 << 20, "", "h", write_key=b"k" * 32,
                               registration=f"r-{sid}")
    for key, replicas in (("pair", 2), ("solo", 1)):
        state.put_start(key, 4096, replicas)
        state.put_end(key, "aa")
    solo = state.objects["solo"].replicas[0]
    pair = next(r for r in state.objects["pair"].replicas if r.segment_id == solo.segment_id)
    damaged = [("solo", solo.offset, solo.generation), ("pair", pair.offset, pair.generation),
               ("pair", pair.offset, pair.generation + 1)]  # (another put's: not this object)
    assert state.drop_damaged(solo.segment_id, damaged) == ["solo"]
    assert [r.segment_id for r in state.objects["pair"].replicas] != [solo.segment_id]
    assert len(state.objects["pair"].replicas) == 1 and "solo" not in state.objects
    with pytest.raises(ObjectLost, match="no longer matched its checksum"):
        state.get("solo")
    restored = MasterState()
    restored.replay(journal)
    assert set(restored.objects) == {"pair"} and list(restored.lost) == ["solo"]
    assert restored.objects["pair"].replicas == state.objects["pair"].replicas


def test_a_layer_every_segment_disowns_while_the_master_still_places_it_is_a_stale_placement():
    """The segments heard of a remove the master does not know (as after a journal that lost its last records, with
    the master still up): every remote read of the master's placement is refused, each failover asks the master
    again and gets the same answer. The lookup names the stale placement, not a segment that did not answer.
    (A local-direct reader trusts a fresh answer of the master: the bytes are the layer's until the master reuses
    them.)"""
    from engram_store.wire import Connection

    tables = _tables(4)
    ids = _ids(4)
    with Cluster(segments=2, segment_size="8MiB", heartbeat_timeout_s=30.0) as c:
        with DistributedStore.connect(c.address, timeout_ms=3000, local_direct=False) as store:
            layer = EngramStore(5, CONFIG, store)
            layer.populate(tables, replica_num=2)
            np.testing.assert_array_equal(layer.lookup(ids), expected_rows(tables, ids))
            for info in store.locate(layer.get_store_keys(), lease=False):
                for replica in info.replicas:
                    Connection(replica.address).call("catalog_drop", {"objects": [
                        [info.key, replica.offset, replica.generation]]})
            with pytest.raises(StalePlacement, match=r"layers \[5\]: every replica refused the master's placement "
                                                     r"as stale 3 times, the last: .*no longer there: it was removed"):
                EngramStore(5, CONFIG, store).lookup(ids)
            with pytest.raises(StalePlacement):
                layer.lookup(ids)


def test_a_journal_torn_in_the_record_of_a_damaged_objects_loss_never_replays_it_gone_without_a_word():
    """Explorer seed 870113: the master dropped a damaged object's last replica and recorded its loss, then died
    with the journal torn in its last record. Dropping the replica and the loss are one record: replayed without
    it, the object is where the journal put it, and the segment, whose catalogue no longer lists it, is asked
    about it and does not hold it intact: it is lost, by name. Never gone without a word."""
    from engram_store.master import MasterState

    journal: list[dict] = []
    state = MasterState(journal=journal.append)
    state.register_segment("s1", "127.0.0.1:1", 1 << 20, "", "h", write_key=b"k" * 32, registration="r-1")
    for key in ("solo", "kept"):
        state.put_start(key, 4096, 1)
        state.put_end(key, "aa")
    solo, kept = state.objects["solo"].replicas[0], state.objects["kept"].replicas[0]
    assert state.drop_damaged("s1", [("solo", solo.offset, solo.generation)]) == ["solo"]
    whole = MasterState()
    whole.replay(journal)
    assert "solo" not in whole.objects and "solo" in whole.lost
    torn = MasterState()
    torn.replay(journal[:-1])  # (a torn last record is dropped at replay)
    assert torn.objects["solo"].replicas == [solo]  # the journal as it was before the drop
    torn.register_segment("s1", "127.0.0.1:1", 1 << 20, "", "h", write_key=b"k" * 32, registration="r-2",
                          objects=[["kept", kept.offset, 4096, 1, "aa", kept.generation]])  # it dropped "solo"
    assert [c[0] for c in torn.verification_candidates("s1")] == ["solo"]
    torn.offer_verified("s1", "r-2", [])  # its bytes no longer match: not held
    assert "solo" not in torn.objects
    with pytest.raises(ObjectLost, match="'solo' was lost"):
        torn.get("solo")
    assert torn.objects["kept"].replicas == [kept]


def test_a_damaged_replicas_space_waits_out_the_reuse_delay_and_only_complete_objects_are_dropped():
    """What drop_damaged leaves alone: a key it does not know, a key whose write is still in progress (its replica
    is the writer's, not the damaged one); and the damaged replica's space is taken again only after the reuse
    delay, as a removed object's is (a reader may still hold its placement)."""
    from engram_store.master import MasterState

    now = [1000.0]
    journal: list[dict] = []
    state = MasterState(journal=journal.append, clock=lambda: now[0], reuse_delay_s=5.0)
    state.register_segment("s1", "127.0.0.1:1", 8192, "", "h", write_key=b"k" * 32, registration="r-1")
    state.put_start("solo", 4096, 1)
    state.put_end("solo", "aa")
    state.put_start("writing", 4096, 1)  # in progress
    solo, writing = state.objects["solo"].replicas[0], state.objects["writing"].replicas[0]
    records = len(journal)
    assert state.drop_damaged("s1", [("nobody", 0, 1), ("writing", writing.offset, writing.generation)]) == []
    assert len(journal) == records and state.objects["writing"].replicas == [writing]
    assert state.drop_damaged("s1", [("solo", solo.offset, solo.generation)]) == ["solo"]
    state.put_end("writing", "bb")
    with pytest.raises(OutOfSpace):  # the only free space is the damaged replica's, held for the reuse delay
        state.put_start("next", 4096, 1)
    now[0] += 6.0
    state.put_start("next", 4096, 1)
    assert state.objects["next"].replicas[0].offset == solo.offset
