"""The master's allocator and metadata state, without sockets."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_store import (
    InvalidArgument,
    LeaseActive,
    ObjectExists,
    ObjectLost,
    ObjectNotFound,
    OutOfSpace,
    SegmentUnavailable,
    WriteFenced,
)
from engram_store.wire import make_ticket, read_ticket
from engram_store.master import ALIGNMENT, FreeListAllocator, MasterState


def _align(n):
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(0, 1 << 16), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 5000)), max_size=60))
def test_allocator_never_overlaps_and_coalesces_back(capacity, ops):
    alloc = FreeListAllocator(capacity)
    live = {}
    for is_alloc, n in ops:
        if is_alloc or not live:
            offset = alloc.allocate(n)
            if offset is None:
                assert alloc.largest_free() < _align(n)
                continue
            if n:
                assert offset % ALIGNMENT == 0 and offset + _align(n) <= capacity
                for o, m in live.items():  # no overlap with any live block
                    assert offset + _align(n) <= o or o + _align(m) <= offset
                live[offset] = n
        else:
            offset = sorted(live)[n % len(live)]
            alloc.free(offset, live.pop(offset))
        assert alloc.used == sum(_align(m) for m in live.values())
        blocks = alloc.free_blocks()
        for (o1, s1), (o2, _) in zip(blocks, blocks[1:]):
            assert o1 + s1 < o2, "adjacent free blocks were not merged"
    for offset, n in list(live.items()):
        alloc.free(offset, n)
    usable = capacity // ALIGNMENT * ALIGNMENT
    assert alloc.used == 0
    assert alloc.free_blocks() == ([(0, usable)] if usable else [])


def test_allocator_reserve_and_double_free():
    alloc = FreeListAllocator(1024)
    assert alloc.reserve(128, 100)
    assert not alloc.reserve(128, 10)  # already taken
    assert alloc.allocate(1024) is None
    assert alloc.allocate(64) == 0
    with pytest.raises(ValueError, match="overlaps"):
        alloc.free(256, 64)  # never allocated: it is free already


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _state(**kw):
    clock = Clock()
    journal = []
    state = MasterState(clock=clock, journal=journal.append, **kw)
    state.register_segment("s1", "127.0.0.1:1", 4096, "", "h")
    state.register_segment("s2", "127.0.0.1:2", 4096, "", "h")
    return state, clock, journal


def test_put_lifecycle_and_visibility():
    state, _, journal = _state()
    placed = state.put_start("k", 100, 2)
    assert {s.segment_id for s, _ in placed} == {"s1", "s2"}
    assert not state.exists("k")  # invisible until put_end
    with pytest.raises(ObjectNotFound):
        state.get("k")
    with pytest.raises(ObjectExists, match="in progress"):
        state.put_start("k", 100, 1)
    state.put_end("k")
    assert state.exists("k")
    assert journal[-1]["op"] == "object"
    state.put_start("r", 10, 1)
    state.put_revoke("r", settled=True)  # its writer has no write in flight: the space is free at once
    assert "r" not in state.objects
    assert sum(s.allocator.used for s in state.segments.values()) == 2 * _align(100)


def test_a_writer_that_names_its_put_acts_on_that_put_only():
    """A forced remove ends writer A's put and writer B puts the key again: A's put_end, renew, revoke and undo
    (remove_many by generation) must not touch B's object, whatever state it is in."""
    state, _, _ = _state()
    state.put_start("k", 100, 1)
    a = state.objects["k"].put_id
    state.remove("k", force=True)  # another writer's forced remove fences A's put
    state.put_start("k", 100, 1)
    b = state.objects["k"].put_id
    assert a != b
    assert not state.put_renew("k", a) and state.put_renew("k", b)
    with pytest.raises(WriteFenced, match="put_end 'k': no write in progress for put"):
        state.put_end("k", "aa", a)  # (the docs promise a fenced writer WriteFenced)
    state.put_revoke("k", generation=a)
    assert state.objects["k"].state == "pending"  # B's put goes on
    state.put_end("k", "bb", b)
    state.put_end("k", "bb", b)  # a retried put_end of one's own put is answered again
    with pytest.raises(WriteFenced):
        state.put_end("k", "aa", a)
    assert state.remove_many(["k"], force=True, generations=[a]) == {}
    assert state.exists("k") and state.objects["k"].checksum == "bb"
    state.put_revoke("k", generation=a)
    assert state.exists("k")
    # A call whose put_end failed on another key revokes every key it wrote: the ones published go too.
    state.put_revoke("k", generation=b)
    assert not state.exists("k") and state.list_keys("", "", 10) == ([], False)
    state.put_start("k", 100, 1)
    c = state.objects["k"].put_id
    state.put_end("k", "cc", c)
    assert list(state.remove_many(["k", "absent"], force=True, generations=[c, 5])) == ["k"]


def test_out_of_space_leaves_nothing():
    state, _, _ = _state()
    with pytest.raises(OutOfSpace, match="no room"):
        state.put_start("big", 5000, 1)
    with pytest.raises(OutOfSpace, match="distinct segments"):
        state.put_start("many", 10, 3)
    state.put_start("a", 3000, 1)
    with pytest.raises(OutOfSpace):
        state.put_start("b", 3000, 2)  # fits on one segment only: the partial placement is released
    assert sorted(s.allocator.used for s in state.segments.values()) == [0, _align(3000)]
    assert list(state.objects) == ["a"]


def test_lease_blocks_remove_until_expiry():
    state, clock, _ = _state(lease_ttl_s=5.0)
    state.put_start("k", 10, 1)
    state.put_end("k")
    state.get("k")
    with pytest.raises(LeaseActive):
        state.remove("k")
    clock.now += 5.1
    state.remove("k")
    assert not state.exists("k")


def test_dead_segment_drops_replicas_and_reports_lost_objects():
    state, clock, _ = _state(heartbeat_timeout_s=10.0)
    state.put_start("both", 10, 2)
    state.put_end("both")
    state.put_start("one", 10, 1)
    state.put_end("one")
    seg_of_one = state.objects["one"].replicas[0].segment_id
    other = "s2" if seg_of_one == "s1" else "s1"
    clock.now += 6
    state.heartbeat(other)
    clock.now += 6
    assert state.expire_segments() == [seg_of_one]
    with pytest.raises(ObjectLost, match=seg_of_one):
        state.get("one")
    assert [r.segment_id for r in state.get("both").replicas] == [other]


def test_a_lost_object_is_removable_and_writable_again():
    state, _, journal = _state()
    for key in ("a", "b", "c"):
        state.put_start(key, 10, 1)
        state.put_end(key)
    state.drop_segment("s1", "shut down")
    state.drop_segment("s2", "shut down")
    for key in ("a", "b", "c"):
        assert not state.exists(key)
        with pytest.raises(ObjectLost, match="shut down"):
            state.get(key)
    state.remove("a")  # forgets the loss: the key is absent, as exists() said
    with pytest.raises(ObjectNotFound):
        state.get("a")
    with pytest.raises(ObjectNotFound):
        state.remove("a")  # a second remove finds nothing
    assert state.remove_all() == (0, 0)  # forgets every other loss too
    with pytest.raises(ObjectNotFound):
        state.get("b")
    state.register_segment("s3", "127.0.0.1:3", 4096, "", "h")
    state.put_start("c", 10, 1)
    state.put_end("c")
    assert state.exists("c")
    restored = MasterState()
    restored.replay(journal)  # the journal replays the losses and their removal
    assert not restored.lost and restored.exists("c")


def test_master_stall_is_not_counted_against_segments():
    state, clock, _ = _state(heartbeat_timeout_s=10.0)
    clock.now += 35  # the master was paused for 35 s; no heartbeat could be processed
    assert state.expire_segments(running_gap_s=35) == []
    clock.now += 11  # but 11 s of running time without a heartbeat is a death
    assert sorted(state.expire_segments()) == ["s1", "s2"]


def test_replay_restores_objects_and_space():
    state, _, journal = _state()
    for i in range(5):
        state.put_start(f"k{i}", 100 * (i + 1), 1 + i % 2)
        state.put_end(f"k{i}")
    state.remove("k2")
    state.put_start("pending", 10, 1)  # never finished: absent after replay
    restored = MasterState()
    restored.replay(journal)
    assert sorted(restored.objects) == ["k0", "k1", "k3", "k4"]
    for key in restored.objects:
        assert [(r.segment_id, r.offset) for r in restored.objects[key].replicas] == \
               [(r.segment_id, r.offset) for r in state.objects[key].replicas]
    used = {sid: s.allocator.used for sid, s in restored.segments.items()}
    expected = {sid: s.allocator.used for sid, s in state.segments.items()}
    expected[state.objects["pending"].replicas[0].segment_id] -= _align(10)
    assert used == expected
    again = MasterState()
    again.replay(restored.snapshot())
    assert sorted(again.objects) == sorted(restored.objects)


def test_reader_addresses_are_journalled_replayed_and_replaced_on_re_registration():
    state, _, journal = _state()
    state.register_segment("r", "127.0.0.1:10", 4096, "", "h", read_addresses=("127.0.0.1:11", "127.0.0.1:12"))
    assert state.segments["r"].describe()["read_addresses"] == ["127.0.0.1:11", "127.0.0.1:12"]
    assert state.segments["s1"].read_addresses == ()  # registered without any: an older segment
    for records in (journal, state.snapshot()):
        restored = MasterState()
        restored.replay(records)
        assert restored.segments["r"].read_addresses == ("127.0.0.1:11", "127.0.0.1:12")
        assert restored.segments["s1"].read_addresses == ()
    state.register_segment("r", "127.0.0.1:20", 4096, "", "h", read_addresses=("127.0.0.1:21",))  # restarted
    assert state.segments["r"].read_addresses == ("127.0.0.1:21",)
    restored = MasterState()
    restored.replay(journal)
    assert restored.segments["r"].read_addresses == ("127.0.0.1:21",)
    # A journal written before reader sockets existed replays with none.
    restored = MasterState()
    restored.replay([{"op": "segment", "segment_id": "old", "address": "127.0.0.1:30", "size": 4096,
                      "shm_path": "", "host_id": "h"}])
    assert restored.segments["old"].read_addresses == ()


def test_segment_size_change_is_refused():
    state, _, _ = _state()
    with pytest.raises(InvalidArgument, match="size"):
        state.register_segment("s1", "127.0.0.1:1", 8192, "", "h")


def test_removed_space_is_reused_only_after_the_delay():
    state, clock, _ = _state(reuse_delay_s=2.0)
    state.put_start("old", 4000, 2)
    state.put_end("old")
    state.remove("old", force=True)
    # Readers may still hold the old placement: the space stays out of reach for the delay.
    with pytest.raises(OutOfSpace, match="become free within 2 s"):
        state.put_start("new", 4000, 1)
    assert state.quarantined_bytes() == 2 * 4000
    clock.now += 2.01
    state.put_start("new", 4000, 1)
    # A revoked (never visible) write whose writer has nothing in flight frees its space at once.
    state.put_start("pending", 2000, 1)
    state.put_revoke("pending", settled=True)
    state.put_start("again", 2000, 1)


def test_quarantine_of_a_dropped_segment_is_forgotten():
    state, clock, _ = _state(reuse_delay_s=1.0, heartbeat_timeout_s=10.0)
    state.put_start("x", 1000, 1)
    state.put_end("x")
    seg = state.objects["x"].replicas[0].segment_id
    state.remove("x", force=True)
    state.drop_segment(seg, "test")
    state.register_segment(seg, "127.0.0.1:9", 4096, "", "h")  # a new segment under the same id
    state.put_start("fill", 4000, 2)  # takes all of both segments
    clock.now += 1.5
    assert state.release_quarantine() == 1
    assert sorted(s.allocator.used for s in state.segments.values()) == [_align(4000)] * 2  # nothing freed twice


# ---- fencing ---------------------------------------------------------------------------------------------------


def _used(state):
    return {sid: s.allocator.used for sid, s in state.segments.items()}


def _ack(state, segment_id, held=()):
    """A heartbeat of ``segment_id`` acknowledging every fence the master sent it."""
    seg = state.segments[segment_id]
    return state.heartbeat(segment_id, seg.registration, sorted(seg.fences), [list(r) for r in held])


def test_an_abandoned_put_keeps_its_space_until_every_segment_acknowledges_its_fence():
    state, _, _ = _state()
    state.put_start("w", 1000, 2)
    put_id = state.objects["w"].put_id
    state.put_revoke("w")  # its writer may still have writes in flight
    assert "w" not in state.objects and not state.exists("w")
    assert _used(state) == {"s1": _align(1000), "s2": _align(1000)}
    assert state.segments["s1"].fences == {put_id} == state.segments["s2"].fences
    assert state.fencing_bytes() == 2 * 1000
    state.put_start("w", 100, 1)  # the key is free at once, for another object in other space
    _ack(state, "s1")
    assert state.segments["s1"].fences == set()
    assert state.segments["s2"].fences == {put_id}  # still sent with every heartbeat reply until acknowledged
    _ack(state, "s2")
    assert sorted(_used(state).values()) == [0, _align(100)]
    assert not state.fencing


def test_a_range_still_written_by_a_live_writer_stays_reserved_until_it_is_released():
    state, _, _ = _state()
    state.put_start("w", 1000, 1)
    replica = state.objects["w"].replicas[0]
    state.remove("w", force=True)  # a forced remove fences a put in progress
    _ack(state, replica.segment_id, held=[(replica.offset, 1000)])  # its writer pwrites into the file: held
    assert _used(state)[replica.segment_id] == _align(1000)
    assert state.segments[replica.segment_id].held == {(replica.offset, 1000)}
    _ack(state, replica.segment_id, held=[(replica.offset, 1000)])
    assert _used(state)[replica.segment_id] == _align(1000)
    _ack(state, replica.segment_id)  # the writer closed its put or exited
    assert _used(state)[replica.segment_id] == 0 and state.fencing_bytes() == 0


def test_a_put_whose_writer_stops_renewing_it_expires_and_its_key_is_free():
    state, clock, _ = _state(put_timeout_s=30.0)
    state.put_start("w", 10, 1)
    with pytest.raises(ObjectExists, match="in progress.*force=True"):
        state.put_start("w", 10, 1)
    with pytest.raises(LeaseActive, match="write is in progress"):
        state.remove("w")
    clock.now += 20
    assert state.put_renew("w") and state.expire_puts() == []
    clock.now += 25
    assert state.expire_puts() == []  # renewed 25 s ago
    state.expire_segments(running_gap_s=60)  # a stalled master does not count its stall against writers
    clock.now += 60
    assert state.expire_puts() == []
    clock.now += 6
    assert state.expire_puts() == ["w"]
    assert not state.put_renew("w")  # its writer learns it must stop
    state.put_start("w", 10, 1)
    with pytest.raises(ObjectNotFound, match="no write in progress"):
        state.put_end("nothing")


def test_segments_restored_from_the_journal_take_no_puts_until_they_register_again():
    state, _, journal = _state()
    state.put_start("k", 100, 1)
    state.put_end("k", checksum="00ff")
    restored = MasterState()
    restored.replay(journal)
    assert restored.objects["k"].checksum == "00ff" and restored.get("k")
    assert not any(s.confirmed for s in restored.segments.values())
    with pytest.raises(SegmentUnavailable, match="have not registered with this master since it restarted"):
        restored.put_start("new", 10, 1)
    assert restored.heartbeat("s1", "old-registration") is None  # it must register again
    restored.register_segment("s1", "127.0.0.1:1", 4096, "", "h", write_key=b"k" * 32, registration="r2",
                              held=[(2048, 500)])  # a writer of the old master still pwrites there
    assert restored.segments["s1"].held == {(2048, 500)}
    placed = restored.put_start("new", 10, 1)
    assert [s.segment_id for s, _ in placed] == ["s1"]
    gap = restored.segments["s1"].allocator.largest_free() + 512  # the held range and the block before it
    with pytest.raises(OutOfSpace):
        restored.put_start("big", gap, 1)  # the held range is not free
    restored.heartbeat("s1", "r2", [], [])  # the writer is gone
    restored.put_start("big", gap, 1)


def test_a_segment_that_registers_again_ends_the_puts_writing_to_it():
    state, _, _ = _state()
    state.put_start("w", 1000, 2)
    put_id = state.objects["w"].put_id
    state.register_segment("s1", "127.0.0.1:1", 4096, "", "h", write_key=b"n" * 32, registration="again")
    assert "w" not in state.objects
    assert _used(state)["s1"] == 0  # the segment's new key already refuses the old tickets
    assert state.segments["s2"].fences == {put_id}  # the other replica's writer may still send
    _ack(state, "s2")
    assert _used(state) == {"s1": 0, "s2": 0}


def test_a_dropped_segment_fences_the_other_replicas_of_puts_in_progress():
    state, _, _ = _state()
    state.put_start("w", 1000, 2)
    put_id = state.objects["w"].put_id
    state.drop_segment("s1", "missed heartbeats")
    assert "w" not in state.objects and state.segments["s2"].fences == {put_id}
    _ack(state, "s2")
    assert _used(state) == {"s2": 0}


def test_a_segment_that_registers_again_ends_its_own_puts_and_no_others():
    state, _, _ = _state()
    state.put_start("a", 1000, 1)
    state.put_start("b", 1000, 1)
    assert [state.objects[k].replicas[0].segment_id for k in "ab"] == ["s1", "s2"]
    state.register_segment("s1", "127.0.0.1:1", 4096, "", "h", write_key=b"n" * 32, registration="again")
    with pytest.raises(ObjectNotFound, match="no write in progress"):
        state.put_end("a", "aa")  # its writes were refused by the new key: publishing it would publish nothing
    state.put_end("b", "bb")
    assert state.exists("b") and not state.exists("a") and _used(state) == {"s1": 0, "s2": _align(1000)}


def test_fences_a_segment_had_not_acknowledged_are_settled_when_it_registers_again():
    state, _, _ = _state()
    state.put_start("w", 1000, 1)
    state.put_revoke("w")  # its writer may have writes in flight: the space waits for the segment's fence
    assert state.fencing_bytes() == 1000 and state.segments["s1"].fences
    state.register_segment("s1", "127.0.0.1:1", 4096, "", "h", write_key=b"n" * 32, registration="again")
    assert state.fencing_bytes() == 0 and not state.segments["s1"].fences and not state.fencing
    assert _used(state) == {"s1": 0, "s2": 0}


def test_a_held_range_the_master_never_placed_is_reserved_even_beside_a_fence_of_its_size():
    state, _, _ = _state()
    state.put_start("w", 1000, 1)
    state.put_revoke("w")  # fenced at offset 0 of s1, 1000 bytes, not yet acknowledged
    seg = state.segments["s1"]
    state.heartbeat("s1", seg.registration, [], [[2048, 1000]])  # a writer of an earlier registration
    assert seg.held == {(2048, 1000)} and _used(state)["s1"] == 2 * _align(1000)
    assert state.fencing_bytes() == 2000  # the fence's and the held range's
    state.heartbeat("s1", seg.registration, [], [[0, 1000], [2048, 1000]])  # the fenced put's writer, live
    assert seg.held == {(0, 1000), (2048, 1000)} and _used(state)["s1"] == 2 * _align(1000)
    _ack(state, "s1", held=[(0, 1000)])  # the fence applied; the earlier writer exited
    assert seg.held == {(0, 1000)} and _used(state)["s1"] == _align(1000)
    _ack(state, "s1")
    assert _used(state)["s1"] == 0 and state.fencing_bytes() == 0


def test_a_fence_still_waiting_on_other_segments_outlives_a_dropped_one():
    state, _, _ = _state()
    state.put_start("w", 1000, 2)
    state.put_revoke("w")  # fenced on s1 and s2
    state.drop_segment("s1", "missed heartbeats")
    assert state.fencing_bytes() == 1000 and _used(state) == {"s2": _align(1000)}
    _ack(state, "s2")
    assert _used(state) == {"s2": 0} and not state.fencing
    assert state.heartbeat("s1", "any") is None and state.heartbeat("s9") is None  # segments it does not know


def test_objects_offered_back_by_a_segment_are_adopted_unless_another_object_has_the_key():
    state, _, _ = _state()
    state.put_start("mine", 100, 1)
    state.put_end("mine", checksum="aa")
    state.register_segment("s9", "127.0.0.1:9", 4096, "", "h", write_key=b"x" * 32, registration="r", objects=[
        ["held", 0, 100, 1, "bb"], ["mine", 128, 100, 1, "cc"], ["old", 256, 50, 1]])
    assert state.get("held").checksum == "bb" and state.get("old").checksum == ""
    assert [r.segment_id for r in state.get("mine").replicas] != ["s9"]  # another object: the copy is ignored
    assert state.segment_objects("s9")[1] == [["held", 0, 100, 1, "bb", 0], ["old", 256, 50, 1, "", 0]]


def test_repair_targets_that_fail_are_fenced_and_those_that_were_answered_free_at_once():
    state, _, _ = _state()
    state.put_start("x", 100, 2)
    state.put_end("x")
    state.drop_segment("s2", "died")
    state.register_segment("s3", "127.0.0.1:3", 4096, "", "h", write_key=b"y" * 32, registration="r3")
    state.register_segment("s4", "127.0.0.1:4", 4096, "", "h", write_key=b"z" * 32, registration="r4")
    job = state.plan_repairs(set(), 1)[0]
    assert read_ticket((b"z" if job.target_id == "s4" else b"y") * 32, job.target_id, job.ticket)[1:] == (job.target_offset, 100)
    assert not state.finish_repair(job, ok=False)  # a write may still be queued there: fenced
    assert state.segments[job.target_id].fences == {job.put_id}
    job2 = state.plan_repairs(set(), 1)[0]
    state.remove("x", force=True)  # the object went away meanwhile
    used = state.segments[job2.target_id].allocator.used
    assert not state.finish_repair(job2, ok=True)  # every write of the copy was answered: freed at once
    assert job2.put_id not in state.segments[job2.target_id].fences
    assert state.segments[job2.target_id].allocator.used == used - _align(100)


@settings(max_examples=100, deadline=None)
@given(key=st.binary(min_size=1, max_size=64), segment=st.text(min_size=1, max_size=32),
       put_id=st.integers(0, 2**64 - 1), offset=st.integers(0, 2**64 - 1), size=st.integers(0, 2**64 - 1),
       flip=st.integers(0, 39))
def test_tickets_verify_only_under_their_key_segment_and_bytes(key, segment, put_id, offset, size, flip):
    ticket = make_ticket(key, segment, put_id, offset, size)
    assert read_ticket(key, segment, ticket) == (put_id, offset, size)
    assert read_ticket(key + b"!", segment, ticket) is None
    assert read_ticket(key, segment + "!", ticket) is None
    forged = bytearray(ticket)
    forged[flip] ^= 1
    assert read_ticket(key, segment, bytes(forged)) is None
    assert read_ticket(b"", segment, ticket) is None and read_ticket(key, segment, ticket[:-1]) is None
