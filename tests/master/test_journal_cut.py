"""A journal that lost whole records from its end reads as a shorter valid journal; the segments, which hold the
bytes, tell the master what it lost when they first register with it: nothing they hold is dropped, moved or
given to another object."""

import os

from hypothesis import example, given, settings
from hypothesis import strategies as st

from engram_store.master import FreeListAllocator, MasterState


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


def _restarted_on(records, catalogues, held, clock):
    """A master started on ``records``, and every segment registering with the catalogue it offers, then answering
    which of the objects the master asks about it holds (``held``: ``(key, offset, generation)`` of each); what the
    master journals meanwhile rebuilds it exactly."""
    restored = MasterState(clock=clock)
    restored.replay(records)
    journal = restored.snapshot()
    restored.journal = journal.append
    for sid in SEGMENTS:
        _register(restored, sid, f"again-{sid}", catalogues[sid])
        asked = restored.verification_candidates(sid)
        restored.offer_verified(sid, f"again-{sid}", [c[0] for c in asked if (c[0], c[1], c[4]) in held[sid]])
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
@given(ops=st.lists(_op, max_size=25), lagging=st.sets(st.integers(0, 4)))
@example(ops=[("put", 1, 3000, 1), ("remove", 1), ("wait", 2.5), ("put", 2, 3000, 1)], lagging=set())
@example(ops=[("put", 1, 3000, 1), ("remove", 1), ("wait", 2.5), ("put", 1, 2000, 1)], lagging=set())
@example(ops=[("put", 1, 3000, 1), ("put", 2, 100, 1), ("remove", 2)], lagging={1})
@example(ops=[("put", 1, 1, 1), ("remove", 1), ("put", 0, 1, 1), ("wait", 2.0), ("remove", 0), ("put", 0, 1, 1),
              ("put", 1, 1, 1)], lagging=set())  # an adoption placing k0 where the journal still had k1, moved
def test_a_journal_cut_at_any_record_gives_back_every_object_the_segments_hold(ops, lagging):
    """``lagging``: keys whose publication the segments' catalogues do not list yet (the writer could not tell
    them, and no heartbeat came before the master restarted): they hold them all the same, and keep them where the
    journal still names them (where it lost them too, nothing names them: that double fault is not recoverable)."""
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
    held = {sid: {(o[0], o[1], o[5]) for o in state.segment_objects(sid)[1]} for sid in SEGMENTS}
    catalogues = {sid: [o for o in state.segment_objects(sid)[1] if int(o[0][1:]) not in lagging]
                  for sid in SEGMENTS}
    want = _objects(state)
    for cut in reversed(range(len(journal) + 1)):
        restored = _restarted_on(journal[:cut], catalogues, held, Clock())
        got = _objects(restored)
        named = MasterState(clock=Clock())
        named.replay(journal[:cut])  # what the journal that is left names
        named = _objects(named)
        unknowable = {k for k in want if int(k[1:]) in lagging and named.get(k) != want[k]}
        assert {k: got.get(k) for k in want if k not in unknowable} == \
            {k: v for k, v in want.items() if k not in unknowable}, f"cut after {cut} of {len(journal)} records"
        # What the journal still names and the segments no longer hold was removed in what it lost: the segment
        # says so when asked, and it is dropped (reported lost, by name), never read on another's bytes.
        assert set(got) <= set(want) and set(restored.lost) <= removed | unknowable
        _no_overlap(restored)
        generations = [r.generation for m in restored.objects.values() for r in m.replicas]
        assert restored.next_put_id > max(generations, default=0)
