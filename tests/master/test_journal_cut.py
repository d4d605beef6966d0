"""A journal that lost whole records from its end reads as a shorter valid journal; the segments, which hold the
bytes, tell the master what it lost when they first register with it: nothing they hold is dropped, moved or
given to another object."""

import os

from hypothesis import example, given, settings
from hypothesis import strategies as st

from master import FreeListAllocator, MasterState


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


SEGMENTS = ("s1", "s2")


def _register(state, sid, registration, objects=None):
    state.register_segment(sid, f"127.0.0.1:{sid[1:]}", 8192, "", "h", write_key=b"k" * 32,
                           registration=registration, objects=objects)


def _objects(state):
    return {k: (m.size, m.checksum, sorted((r.segment_id, r.offset, r.generation) for r in m.replicas))
            for k, m in state.objects.items() if m.state == "complete"}


def _restarted_on(records, catalogues, clock):
    """A master started on ``records``, and every segment registering with the catalogue it holds; what it then
    journals rebuilds it exactly."""
    restored = MasterState(clock=clock)
    restored.replay(records)
    journal = restored.snapshot()
    restored.journal = journal.append
    for sid in SEGMENTS:
        _register(restored, sid, f"again-{sid}", catalogues[sid])
    again = MasterState(clock=clock)
    again.replay(journal)
    assert (_objects(again), sorted(again.lost)) == (_objects(restored), sorted(restored.lost))
    return restored


def _no_overlap(state):
    for sid in SEGMENTS:
        space = FreeListAllocator(8192)
        for key, meta in state.objects.items():
            for r in meta.replicas:
                if r.segment_id == sid:
                    assert space.reserve(r.offset, meta.size), f"{key} overlaps another object on {sid}"


_op = st.one_of(
    st.tuples(st.just("put"), st.integers(0, 4), st.integers(1, 3000), st.integers(1, 2)),
    st.tuples(st.just("remove"), st.integers(0, 4)),
    st.tuples(st.just("wait"), st.floats(0, 3)),
)


@settings(max_examples=int(os.environ.get("ENGRAM_EXAMPLES", "150")), deadline=None)
@given(ops=st.lists(_op, max_size=25))
@example(ops=[("put", 1, 3000, 1), ("remove", 1), ("wait", 2.5), ("put", 2, 3000, 1)])  # into the removed space
@example(ops=[("put", 1, 3000, 1), ("remove", 1), ("wait", 2.5), ("put", 1, 2000, 1)])  # the same key anew
def test_a_journal_cut_at_any_record_gives_back_every_object_the_segments_hold(ops):
    clock, journal = Clock(), []
    state = MasterState(clock=clock, journal=journal.append)
    for sid in SEGMENTS:
        _register(state, sid, f"r-{sid}")
    removed = set()
    for n, op in enumerate(ops):
        if op[0] == "put":
            try:
                state.put_start(f"k{op[1]}", op[2], op[3])
            except Exception:
                continue
            state.put_end(f"k{op[1]}", f"c{n}")
        elif op[0] == "remove" and state.exists(f"k{op[1]}"):
            state.remove(f"k{op[1]}", force=True)
            removed.add(f"k{op[1]}")
        elif op[0] == "wait":
            clock.now += op[1]
            state.release_quarantine()
    catalogues = {sid: state.segment_objects(sid)[1] for sid in SEGMENTS}
    want = _objects(state)
    for cut in reversed(range(len(journal) + 1)):
        restored = _restarted_on(journal[:cut], catalogues, Clock())
        got = _objects(restored)
        assert {k: got.get(k) for k in want} == want, f"cut after {cut} of {len(journal)} records"
        # What the journal still names and the segments no longer hold was removed in what it lost: it comes
        # back (where its place is still free), or is reported lost (written over), never on another's bytes.
        assert set(got) - set(want) <= removed and set(restored.lost) <= removed
        _no_overlap(restored)
        generations = [r.generation for m in restored.objects.values() for r in m.replicas]
        assert restored.next_put_id > max(generations, default=0)
