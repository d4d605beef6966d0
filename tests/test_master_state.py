"""The master's allocator and metadata state, without sockets."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_store import InvalidArgument, LeaseActive, ObjectExists, ObjectLost, ObjectNotFound, OutOfSpace
from master import ALIGNMENT, FreeListAllocator, MasterState


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
    state.put_revoke("r")
    assert "r" not in state.objects
    assert sum(s.allocator.used for s in state.segments.values()) == 2 * _align(100)


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
    # A revoked (never visible) write frees its space at once.
    state.put_start("pending", 2000, 1)
    state.put_revoke("pending")
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
