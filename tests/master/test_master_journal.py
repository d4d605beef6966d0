"""The journal: replay rebuilds exactly what the running master acknowledged, whatever happened in between, and one
master owns a journal at a time."""

import multiprocessing
import os

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engram_store import ConfigError, ObjectLost
from engram_store.master import MasterState
from engram_store.master._journal import Journal


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _registered(state, *ids, size=4096):
    for sid in ids:
        state.register_segment(sid, f"127.0.0.1:{sid[1:]}", size, "", "h", write_key=b"k" * 32,
                               registration=f"r-{sid}")


def _durable(state):
    """What a restart must give back: every complete object with its replicas (and their generations), and every
    lost object by key."""
    objects = {k: (m.size, m.checksum, sorted((r.segment_id, r.offset, getattr(r, "generation", 0)) for r in m.replicas))
               for k, m in state.objects.items() if m.state == "complete"}
    return objects, sorted(state.lost)


def _replayed(records, clock=None):
    restored = MasterState(clock=clock or Clock())
    restored.replay(records)
    return restored


def test_a_restart_keeps_objects_that_took_the_space_of_removed_ones():
    """Populate, remove, wait out the reuse delay, populate into the freed space, restart: nothing is lost."""
    clock, journal = Clock(), []
    state = MasterState(clock=clock, journal=journal.append)
    _registered(state, "s1")
    state.put_start("old", 2048, 1)
    state.put_end("old", "aa")
    state.remove("old")
    clock.now += 3  # past the reuse delay (2 s)
    state.put_start("new", 2048, 1)
    state.put_end("new", "bb")
    assert state.objects["new"].replicas[0].offset == 0  # it took the removed object's space
    restored = _replayed(journal)
    assert _durable(restored) == _durable(state)
    again = _replayed(restored.snapshot())
    assert _durable(again) == _durable(state)


def test_an_object_journalled_again_with_a_replica_more_keeps_its_first_replica():
    state, journal = MasterState(clock=Clock()), []
    state.journal = journal.append
    _registered(state, "s1")
    state.put_start("k", 100, 1)
    state.put_end("k", "cc")
    state.register_segment("s2", "127.0.0.1:2", 4096, "", "h", write_key=b"x" * 32, registration="r2",
                           objects=[["k", 0, 100, 1, "cc", 77]])  # a copy offered back: journalled again
    assert len(state.objects["k"].replicas) == 2
    assert _durable(_replayed(journal)) == _durable(state)


def test_removed_space_is_quarantined_after_a_replay_for_the_reuse_delay():
    clock, journal = Clock(), []
    state = MasterState(clock=clock, journal=journal.append)
    _registered(state, "s1")
    state.put_start("old", 4096, 1)
    state.put_end("old", "aa")
    state.remove("old")
    restored_clock = Clock()
    restored = _replayed(journal, restored_clock)
    _registered(restored, "s1")
    with pytest.raises(Exception, match="become free within"):
        restored.put_start("new", 4096, 1)  # a reader of the old master may still hold the placement
    restored_clock.now += 2.5
    restored.put_start("new", 4096, 1)


def test_lost_objects_are_journalled_and_restored_by_a_segment_that_still_holds_them():
    clock, journal = Clock(), []
    state = MasterState(clock=clock, journal=journal.append)
    _registered(state, "s1", "s2")
    state.put_start("k", 100, 1)
    state.put_end("k", "cc")
    sid = state.objects["k"].replicas[0].segment_id
    offset, generation = state.objects["k"].replicas[0].offset, state.objects["k"].replicas[0].generation
    state.drop_segment(sid, "missed heartbeats")
    with pytest.raises(ObjectLost, match="'k' was lost"):
        state.get("k")
    restored = _replayed(_replayed(journal).snapshot())  # twice: the snapshot keeps what is lost
    assert sorted(restored.lost) == ["k"]
    # The segment comes back with the bytes (it never learnt of the object: its catalogue does not name it).
    restored.register_segment(sid, "127.0.0.1:9", 4096, "", "h", write_key=b"z" * 32, registration="again")
    assert restored.verification_candidates(sid) == [["k", offset, 100, "cc", generation]]
    assert restored.segments[sid].allocator.used > 0  # reserved while the segment checks: nothing lands there
    assert restored.offer_verified(sid, "again", ["k"]) == 1
    assert restored.get("k").replicas[0].offset == offset
    assert restored.get("k").replicas[0].generation == generation
    assert not restored.lost


def test_a_lost_object_whose_bytes_do_not_verify_stays_lost_and_its_space_is_freed():
    state = MasterState(clock=Clock())
    _registered(state, "s1")
    state.put_start("k", 100, 1)
    state.put_end("k", "cc")
    state.drop_segment("s1", "missed heartbeats")
    state.register_segment("s1", "127.0.0.1:1", 4096, "", "h", write_key=b"z" * 32, registration="again")
    assert len(state.verification_candidates("s1")) == 1
    assert state.segments["s1"].allocator.used > 0
    assert state.offer_verified("s1", "again", []) == 0
    assert state.segments["s1"].allocator.used == 0 and "k" in state.lost


def test_a_journal_of_an_older_master_replays_with_the_defaults_of_the_fields_it_lacks():
    records = [
        {"op": "segment", "segment_id": "s1", "address": "127.0.0.1:1", "size": 8192, "shm_path": "", "host_id": "h"},
        {"op": "segment", "segment_id": "s2", "address": "127.0.0.1:2", "size": 8192, "shm_path": "", "host_id": "h"},
        {"op": "object", "key": "old", "size": 100, "replicas": [["s1", 0]]},  # no checksum, count or generation
        {"op": "object", "key": "two", "size": 100, "replicas": [["s1", 4096], ["s2", 0]]},  # the count: its replicas
        {"op": "object", "key": "three", "size": 100, "replicas": [["s2", 4096]], "replica_num": 3},  # one short
        {"op": "lost", "key": "gone", "size": 100},                             # no message, count, sum or places
    ]
    restored = MasterState(clock=Clock())
    assert restored.replay(records) == 6
    meta = restored.objects["old"]
    assert (meta.replica_num, meta.checksum, meta.replicas[0].generation) == (1, "", 0)
    assert (restored.objects["two"].replica_num, restored.objects["three"].replica_num) == (2, 3)
    lost = restored.lost["gone"]
    assert (lost.message, lost.replica_num, lost.checksum, lost.places) == ("object 'gone' was lost", 1, "", [])
    with pytest.raises(ObjectLost, match="object 'gone' was lost"):
        restored.get("gone")
    restored.replay([{"op": "lost", "key": "gone", "size": 100, "message": "lost with segment s2", "places": []}])
    assert restored.lost["gone"].message == "lost with segment s2"


def test_a_replica_the_journal_places_where_it_cannot_be_is_reported_lost_never_dropped(caplog):
    records = [
        {"op": "segment", "segment_id": "s1", "address": "127.0.0.1:1", "size": 8192, "shm_path": "", "host_id": "h"},
        {"op": "object", "key": "elsewhere", "size": 100, "replicas": [["s9", 0, 5]], "checksum": "aa"},
        {"op": "object", "key": "half", "size": 100, "replicas": [["s1", 0, 6], ["s9", 0, 6]], "checksum": "bb"},
        {"op": "object", "key": "over", "size": 100, "replicas": [["s1", 0, 7]], "checksum": "cc"},
    ]
    restored = _replayed(records)
    assert sorted(restored.objects) == ["half"] and [r.segment_id for r in restored.objects["half"].replicas] == ["s1"]
    assert sorted(restored.lost) == ["elsewhere", "over"]
    assert "segment s9 offset 0" in restored.lost["elsewhere"].message
    assert "segment s1 offset 0" in restored.lost["over"].message  # its space is the object before's
    assert restored.lost["over"].places[0].generation == 7 and restored.lost["over"].checksum == "cc"
    assert restored.lost["elsewhere"].replica_num == 1  # none restored, and the record names no count: one
    assert sum("not restored" in r.getMessage() for r in caplog.records) == 3


def test_removed_space_anywhere_in_a_segment_is_quarantined_after_a_replay():
    clock, journal = Clock(), []
    state = MasterState(clock=clock, journal=journal.append)
    _registered(state, "s1", size=8192)
    for key in ("keep", "old"):
        state.put_start(key, 4096, 1)
        state.put_end(key, "aa")
    assert state.objects["old"].replicas[0].offset == 4096
    state.remove("old")
    restored_clock = Clock()
    restored = _replayed(journal, restored_clock)
    _registered(restored, "s1", size=8192)
    assert restored.quarantined_bytes("s1") == 4096
    with pytest.raises(Exception, match="4096 bytes of removed objects become free within"):
        restored.put_start("new", 4096, 1)
    restored_clock.now += 2.5
    assert restored.release_quarantine() == 1
    assert restored.segments["s1"].allocator.free_blocks() == [(4096, 4096)]
    restored.put_start("new", 4096, 1)
    assert restored.objects["new"].replicas[0].offset == 4096


@pytest.mark.parametrize("then", ["written anew", "restored"])
def test_a_lost_object_replays_as_the_running_master_left_it(then):
    """A lost object written anew under its key is forgotten (its old bytes are remembered as removed, so a segment
    offering them back never brings them over the new object); one a segment restored is simply no longer lost."""
    journal = []
    state = MasterState(clock=Clock(), journal=journal.append)
    _registered(state, "s1", "s2")
    state.put_start("k", 100, 1)
    state.put_end("k", "cc")
    first = state.objects["k"].replicas[0]
    state.drop_segment(first.segment_id, "missed heartbeats")
    if then == "written anew":
        state.put_start("k", 100, 1)
        state.put_end("k", "dd")
    else:
        state.register_segment(first.segment_id, "127.0.0.1:9", 4096, "", "h", write_key=b"z" * 32,
                               registration="again")
        assert len(state.verification_candidates(first.segment_id)) == 1
        assert state.offer_verified(first.segment_id, "again", ["k"]) == 1
    assert not state.lost and ((("k", first.generation) in state.removed) == (then == "written anew"))
    for records in (journal, _replayed(journal).snapshot()):
        restored = _replayed(records)
        assert _durable(restored) == _durable(state)
        assert list(restored.removed) == list(state.removed)


def _journalled_generations(records) -> set[int]:
    """Every put id a journal names: its objects' replicas, its lost objects' places, its removed objects."""
    found = set()
    for record in records:
        found.update(r[2] for r in record.get("replicas", ()) if len(r) > 2)
        found.update(r[2] for r in record.get("places", ()) if len(r) > 2)
        if record["op"] == "removed":
            found.add(record["generation"])
    return found


@pytest.mark.parametrize("start", [1, 1 << 61], ids=["start below", "start above"])
@pytest.mark.parametrize("compacted", [False, True], ids=["journal", "snapshot"])
@pytest.mark.parametrize("newest", ["live", "lost", "removed"])
def test_put_ids_after_a_replay_never_repeat_a_journalled_one(start, compacted, newest):
    """A new master starts its put ids at a random point; replayed below the journal's ids it must move past every
    one the journal names, those of removed and lost objects too: segments refuse reads and writes by put id, and
    a removed object's id marks its range removed there."""
    journal = []
    state = MasterState(clock=Clock(), journal=journal.append, next_put_id=1 << 40)
    _registered(state, "s1", "s2", "s3")
    for key in sorted(("live", "lost", "removed"), key=lambda k: k == newest):  # each on a segment of its own
        state.put_start(key, 100, 1)
        state.put_end(key, "cc")
    state.drop_segment(state.objects["lost"].replicas[0].segment_id, "missed heartbeats")
    state.remove("removed")
    assert sorted(state.objects) == ["live"] and sorted(state.lost) == ["lost"]
    records = _replayed(journal).snapshot() if compacted else journal
    named = _journalled_generations(records)
    assert len(named) >= 3
    restored = MasterState(clock=Clock(), next_put_id=start)
    restored.replay(records)
    _registered(restored, "s1", "s2")
    restored.put_start("next", 100, 1)
    put_id = restored.objects["next"].put_id
    assert put_id not in named
    assert put_id >= max(start, max(named) + 1)


def test_put_ids_handed_out_but_never_journalled_never_repeat_after_a_replay():
    """Explorer seed 810014: a put started before the master died is in no journal record (objects are journalled
    when published), yet its writer holds its id, and revokes its put by that id once told it was fenced. A new
    master that handed the same id to another put of the key would have that put's object removed by the revoke:
    every id handed out lies below a journalled bound, and a replayed master starts past it."""
    journal = []
    state = MasterState(clock=Clock(), journal=journal.append, next_put_id=1 << 40)
    _registered(state, "s1")
    state.put_start("done", 100, 1)
    state.put_end("done", "cc")
    state.put_start("pending", 100, 1)  # its writer is still writing when the master dies
    old_id = state.objects["pending"].put_id
    for records in (journal, _replayed(journal).snapshot()):
        restored = MasterState(clock=Clock(), next_put_id=1)  # a random start below the old master's ids
        restored.replay(records)
        _registered(restored, "s1")
        restored.put_start("pending", 100, 1)
        restored.put_end("pending", "dd")
        assert restored.objects["pending"].replicas[0].generation > old_id
        restored.put_revoke("pending", generation=old_id)  # the old writer gives its put up
        assert restored.exists("pending"), "a revoke of the old master's put removed the new master's object"


def test_every_put_id_handed_out_lies_below_the_journalled_bound(monkeypatch):
    from engram_store.master import _state

    monkeypatch.setattr(_state, "PUT_ID_BLOCK", 3)
    journal = []
    state = MasterState(clock=Clock(), journal=journal.append, next_put_id=1 << 40)
    _registered(state, "s1", size=1 << 20)
    handed = []
    for i in range(7):  # across two block boundaries, nothing published: no object names an id
        state.put_start(f"k{i}", 100, 1)
        handed.append(state.objects[f"k{i}"].put_id)
        bound = max(r["below"] for r in journal if r.get("op") == "put_ids")
        assert handed[-1] < bound, f"put id {handed[-1]} handed out at or past the journalled bound {bound}"
    assert [r["below"] for r in journal if r.get("op") == "put_ids"] == [(1 << 40) + 3, (1 << 40) + 6,
                                                                          (1 << 40) + 9]
    restored = _replayed(journal)
    assert restored.next_put_id > max(handed)


def test_a_put_id_block_that_cannot_be_journalled_hands_out_no_id_and_places_nothing():
    from engram_store import JournalError

    state = MasterState(clock=Clock(), next_put_id=1 << 40)
    _registered(state, "s1")
    free = state.segments["s1"].allocator.free_bytes

    def full(record):
        raise JournalError("journal: no space left on device")

    state.journal = full
    with pytest.raises(JournalError):
        state.put_start("k", 100, 1)
    assert "k" not in state.objects and state.segments["s1"].allocator.free_bytes == free
    assert state.next_put_id == 1 << 40


# ---- the property: replay equals the running state, after any history -------------------------------------

_op = st.one_of(
    st.tuples(st.just("put"), st.integers(0, 7), st.integers(1, 1500), st.integers(1, 2)),
    st.tuples(st.just("remove"), st.integers(0, 7)),
    st.tuples(st.just("wait"), st.floats(0, 3)),
    st.tuples(st.just("drop"), st.integers(1, 3)),
    st.tuples(st.just("register"), st.integers(1, 3)),
    st.tuples(st.just("revoke"), st.integers(0, 7)),
    st.tuples(st.just("restart")),
)


@settings(max_examples=int(os.environ.get("ENGRAM_EXAMPLES", "300")), deadline=None)
@given(ops=st.lists(_op, max_size=40))
def test_replay_gives_back_every_acknowledged_object(ops):
    clock, journal = Clock(), []
    state = MasterState(clock=clock, journal=journal.append)
    _registered(state, "s1", "s2", "s3")
    for op in ops:
        kind = op[0]
        if kind == "put":
            key = f"k{op[1]}"
            try:
                state.put_start(key, op[2], op[3])
            except Exception:
                continue
            state.put_end(key, f"{op[1]:x}")
        elif kind == "remove":
            try:
                state.remove(f"k{op[1]}", force=True)
            except Exception:
                pass
        elif kind == "wait":
            clock.now += op[1]
            state.release_quarantine()
        elif kind == "drop":
            state.drop_segment(f"s{op[1]}", "missed heartbeats")
        elif kind == "register":
            if f"s{op[1]}" not in state.segments:
                _registered(state, f"s{op[1]}")
        elif kind == "revoke":
            try:
                state.put_start(f"p{op[1]}", 100, 1)
                state.put_revoke(f"p{op[1]}", settled=True)
            except Exception:
                pass
        elif kind == "restart":
            restored = _replayed(list(journal), clock)
            assert _durable(restored) == _durable(state)
            journal[:] = restored.snapshot()
            restored.journal = journal.append
            for sid in list(restored.segments):
                _registered(restored, sid)
            state = restored
        # Every step: a restart now would give back what is acknowledged.
        assert _durable(_replayed(list(journal))) == _durable(state)
    assert _durable(_replayed(_replayed(list(journal)).snapshot())) == _durable(state)


# ---- one owner per journal ------------------------------------------------------------------------------------

def _try_open(path, queue):
    try:
        Journal(path)
        queue.put("opened")
    except ConfigError as exc:
        queue.put(f"refused: {exc}")


def test_a_second_process_cannot_open_a_journal_in_use_and_is_told_who_holds_it(tmp_path):
    path = str(tmp_path / "j" / "journal")
    first = Journal(path)
    first.rewrite([{"op": "forget_lost"}])
    inode = os.stat(path).st_ino
    queue = multiprocessing.get_context("spawn").Queue()
    proc = multiprocessing.get_context("spawn").Process(target=_try_open, args=(path, queue))
    proc.start()
    try:
        answer = queue.get(timeout=60)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join()
            pytest.fail("the second process did not finish within 60 s")
    assert answer.startswith("refused: ") and "in use by another process" in answer
    assert f"pid {os.getpid()}" in answer
    assert os.stat(path).st_ino == inode  # untouched
    first.release()
    assert not os.path.exists(path + ".lock")
    second = Journal(path)  # free again
    assert second.read() == [{"op": "forget_lost"}]
    second.release()


# ---- the property: a segment that comes back with an old catalogue never brings back a removed object ---------

_seg_op = st.one_of(
    st.tuples(st.just("put"), st.integers(0, 2), st.integers(1, 700)),
    st.tuples(st.just("remove"), st.integers(0, 2)),
    st.tuples(st.just("sync"), st.integers(1, 2)),        # the segment learns its catalogue
    st.tuples(st.just("away"), st.integers(1, 2)),        # dropped: it missed heartbeats
    st.tuples(st.just("back"), st.integers(1, 2)),        # registers again, offering the catalogue it last learnt
    st.tuples(st.just("wait")),
)


@settings(max_examples=int(os.environ.get("ENGRAM_EXAMPLES", "300")), deadline=None)
@given(ops=st.lists(_seg_op, max_size=40), journalled=st.booleans())
@example(ops=[("put", 0, 100), ("sync", 1), ("away", 1), ("remove", 0), ("back", 1)], journalled=False)
@example(ops=[("put", 0, 100), ("sync", 1), ("remove", 0), ("wait",), ("away", 1), ("back", 1)], journalled=True)
def test_a_segment_offering_an_old_catalogue_never_brings_back_a_removed_object(ops, journalled):
    clock, journal = Clock(), []
    state = MasterState(clock=clock, journal=journal.append)
    _registered(state, "s1", "s2")
    catalogues = {"s1": [], "s2": []}
    removed, away = set(), set()
    for n, op in enumerate(ops):
        kind = op[0]
        if kind == "put":
            key = f"k{op[1]}"
            try:
                state.put_start(key, op[2], 1)
            except Exception:
                continue
            state.put_end(key, f"c{n}")
            removed.discard(key)
        elif kind == "remove":
            try:
                state.remove(f"k{op[1]}", force=True)
                removed.add(f"k{op[1]}")
            except Exception:
                pass
        elif kind == "sync" and f"s{op[1]}" not in away:
            catalogues[f"s{op[1]}"] = state.segment_objects(f"s{op[1]}")[1]
        elif kind == "away" and f"s{op[1]}" not in away:
            state.drop_segment(f"s{op[1]}", "missed heartbeats")
            away.add(f"s{op[1]}")
        elif kind == "back" and f"s{op[1]}" in away:
            if journalled:  # and the master restarted from its journal meanwhile
                restored = _replayed(list(journal), clock)
                journal[:] = restored.snapshot()
                restored.journal = journal.append
                state = restored
            sid = f"s{op[1]}"
            state.register_segment(sid, "127.0.0.1:9", 4096, "", "h", write_key=b"w" * 32,
                                   registration=f"r{n}", objects=catalogues[sid])
            away.discard(sid)
        elif kind == "wait":
            clock.now += 3
        back = {k for k in removed if state.exists(k)}
        assert not back, f"removed objects came back: {back}"


def test_remove_many_is_all_or_nothing_and_list_keys_pages_by_prefix():
    clock = Clock()
    state = MasterState(clock=clock)
    _registered(state, "s1")
    for key in ("engram:l1:manifest", "engram:l1:h0", "engram:l1:h1", "other"):
        state.put_start(key, 64, 1)
        state.put_end(key, "cc")
    state.get("engram:l1:h1")  # a reader's lease
    with pytest.raises(Exception, match="'engram:l1:h1': a read lease is live .* nothing of the 3 objects"):
        state.remove_many(["engram:l1:manifest", "engram:l1:h0", "engram:l1:h1"])
    assert all(state.exists(k) for k in ("engram:l1:manifest", "engram:l1:h0", "engram:l1:h1"))
    rows, more = state.list_keys("engram:l1", "", 2)
    assert [r[0] for r in rows] == ["engram:l1:h0", "engram:l1:h1"] and more
    assert rows[1][5] > 0 and rows[0][4] == "complete"
    rows, more = state.list_keys("engram:l1", "engram:l1:h1", 2)
    assert [r[0] for r in rows] == ["engram:l1:manifest"] and not more
    removed = state.remove_many(["engram:l1:manifest", "engram:l1:h0", "engram:l1:h1", "absent"], force=True)
    assert sorted(removed) == ["engram:l1:h0", "engram:l1:h1", "engram:l1:manifest"]
    assert state.list_keys("engram:", "", 10) == ([], False) and state.exists("other")


@pytest.mark.parametrize("fields, message", [
    ({"port": 70000}, "port: expected an integer in"), ({"lease_ttl_s": 0}, "lease_ttl_s: expected > 0"),
    ({"reuse_delay_s": -1}, "reuse_delay_s: expected >= 0"), ({"metrics_port": "x"}, "metrics_port: expected"),
    ({"host": ""}, "host: expected an address"),
])
def test_a_master_config_refuses_what_cannot_run_naming_the_field(fields, message):
    from engram_store import InvalidArgument
    from engram_store.master import MasterConfig

    with pytest.raises(InvalidArgument, match=message):
        MasterConfig(**fields)
