"""Reads that name the objects they expect: the kernel against a plain Python reference, the segment's record of
which put wrote which range, and a client's remote read of an old placement refused over either read path."""

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_store import DistributedStore, InvalidArgument, StalePlacement
from engram_store.kernels import check_generations, check_pairs_for
from engram_store.segment import SegmentServer
from engram_store.segment._generations import Generations
from engram_store.master import MasterServer


def _reference(entries: dict, base: int, size: int, gen: int) -> bool:
    """A check passes when every entry that meets [base, base + size) is exactly that object."""
    for b, (n, g) in entries.items():
        if b < base + size and base < b + n and (b, n, g) != (base, size, gen):
            return False
    return True


_claims = st.lists(st.tuples(st.integers(0, 60).map(lambda x: x * 64), st.integers(1, 8).map(lambda x: x * 64),
                             st.integers(1, 5)), max_size=12)


@settings(max_examples=400, deadline=None)
@given(claims=_claims, checks=st.lists(st.tuples(st.integers(0, 60).map(lambda x: x * 64),
                                                 st.integers(1, 8).map(lambda x: x * 64), st.integers(1, 5)),
                                       min_size=1, max_size=4))
def test_checks_pass_exactly_when_no_other_put_wrote_over_the_object(claims, checks):
    generations = Generations()
    entries: dict[int, tuple[int, int]] = {}
    for offset, size, gen in claims:
        generations.claim(offset, size, gen)
        for b in [b for b, (n, _) in entries.items() if b < offset + size and offset < b + n]:
            del entries[b]
        entries[offset] = (size, gen)
    assert {int(b): (int(n), int(g)) for b, n, g in zip(*generations.arrays)} == entries
    named = check_pairs_for(*(np.array(c, dtype=np.int64) for c in zip(*checks)))
    pairs = np.concatenate((named, np.array([[0, 64], [128, 64]], dtype=np.int64)))
    rows, bad = check_generations(pairs, *generations.arrays)
    assert rows == 2 * len(checks)
    expected = next((k for k, c in enumerate(checks) if not _reference(entries, *c)), -1)
    assert bad == expected
    if expected < 0:
        ranges, version = generations.split(pairs, "here")
        assert ranges.tolist() == [[0, 64], [128, 64]] and version == generations.version
    else:
        with pytest.raises(StalePlacement, match=f"at offset {checks[expected][0]} written by put "
                                                 f"{checks[expected][2]} is no longer there"):
            generations.split(pairs, "here")


def test_a_write_during_the_gather_is_caught_by_the_second_check():
    generations = Generations()
    generations.claim(0, 640, 7)
    pairs = np.concatenate((check_pairs_for(np.array([0]), np.array([640]), np.array([7])),
                            np.array([[64, 64]], dtype=np.int64)))
    ranges, version = generations.split(pairs, "here")
    generations.recheck(pairs, version, "here")  # nothing happened
    generations.claim(320, 64, 8)  # another put lands in the object's space while it is gathered
    with pytest.raises(StalePlacement):
        generations.recheck(pairs, version, "here")


def test_objects_never_learnt_of_pass_and_checks_without_sizes_are_refused():
    generations = Generations()
    pairs = np.concatenate((check_pairs_for(np.array([4096]), np.array([64]), np.array([3])),
                            np.array([[4096, 64]], dtype=np.int64)))
    assert generations.split(pairs, "here")[0].tolist() == [[4096, 64]]
    with pytest.raises(InvalidArgument, match="expected an even number"):
        generations.split(np.array([[-1, 3], [0, 8]], dtype=np.int64), "here")
    generations.seed([["k", 4096, 64, 1, "ab", 3], ["old", 0, 64, 1, "cd"]])  # an entry without a generation
    assert generations.arrays[0].tolist() == [4096]
    assert check_generations(pairs, *generations.arrays) == (2, -1)


@settings(max_examples=200, deadline=None)
@given(claims=_claims, checks=st.lists(st.tuples(st.integers(0, 60).map(lambda x: x * 64),
                                                 st.integers(1, 8).map(lambda x: x * 64), st.integers(1, 5)),
                                       min_size=1, max_size=4))
def test_the_shared_table_answers_as_the_segment_does(claims, checks):
    """Readers on the host check the generation table the segment publishes in shared memory: the same answer
    as the segment's own check, and a seq that moves with every claim."""
    import mmap

    from engram_store.kernels import check_table, readonly

    generations = Generations("segment-generations", 1 << 20)
    try:
        fd = generations.table_fd
        table = readonly(np.frombuffer(mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ), dtype=np.int64))
        seqs = [int(table[0])]
        for offset, size, gen in claims:
            generations.claim(offset, size, gen)
            seqs.append(int(table[0]))
        assert all(s % 2 == 0 for s in seqs) and seqs == sorted(seqs)
        named = check_pairs_for(*(np.array(c, dtype=np.int64) for c in zip(*checks)))
        _, expected = check_generations(named, *generations.arrays)
        assert check_table(table, named) == (expected, seqs[-1])
    finally:
        generations.close()
    assert generations.table_fd == -1


def test_an_overflowing_table_says_it_cannot_tell():
    from engram_store.kernels import TABLE_UNKNOWN, check_table

    table = np.zeros(8 + 3 * 2, dtype=np.int64)
    table[2], table[3] = 2, 1  # capacity 2, overflowed
    named = check_pairs_for(np.array([0]), np.array([64]), np.array([1]))
    assert check_table(table, named)[0] == TABLE_UNKNOWN


def test_a_retired_table_says_it_cannot_tell():
    """A table its segment no longer keeps (the next run made a new file in its place) is frozen: its entries hold
    as they were, so a reader that still maps it must be told it cannot tell, not that the objects are there."""
    from engram_store.kernels import TABLE_UNKNOWN, check_table
    from engram_store.kernels import generation_table as gt

    table = np.zeros(gt.table_words(2), dtype=np.int64)
    first = gt.HEADER_WORDS
    table[gt.CAPACITY], table[gt.COUNT] = 2, 1
    table[first], table[first + 2], table[first + 4] = 0, 64, 1  # the entry's base, size and put
    named = check_pairs_for(np.array([0]), np.array([64]), np.array([1]))
    assert check_table(table, named)[0] == -1
    table[gt.RETIRED] = 1
    assert check_table(table, named)[0] == TABLE_UNKNOWN


def test_a_removed_object_is_refused_until_another_put_claims_its_range():
    generations = Generations()
    generations.claim(0, 640, 7)
    generations.claim(1024, 64, 8)
    named = check_pairs_for(np.array([0, 1024]), np.array([640, 64]), np.array([7, 8]))
    assert check_generations(named, *generations.arrays) == (4, -1)
    version = generations.version
    # Only the put named is marked: another put's object, or one never learnt of, is left as it is.
    assert generations.drop([(0, 6), (1024, 8), (4096, 9)]) == 1
    assert generations.version == version + 1 and not generations.holds(8, 1024, 64)
    assert check_generations(named, *generations.arrays) == (4, 1)
    with pytest.raises(StalePlacement, match="at offset 1024 written by put 8 is no longer there: it was removed"):
        generations.split(named[2:], "here")
    generations.claim(1024, 64, 8)  # a late write of the removed put does not bring it back
    assert check_generations(named[2:], *generations.arrays) == (2, 0)
    generations.claim(1024, 64, 9)  # the range's next put replaces the mark
    assert check_generations(check_pairs_for(np.array([1024]), np.array([64]), np.array([9])),
                             *generations.arrays) == (2, -1)
    assert generations.drop([(0, 7)]) == 1 and generations.drop([(0, 7)]) == 0


def test_an_object_a_master_asks_about_is_disowned_once_removed_or_written_over():
    """A master that replayed a journal which lost the records of a remove asks whether the object is still here:
    its bytes may still match its checksum, but the segment that heard of the remove says it is not."""
    generations = Generations()
    generations.claim(0, 128, 7)
    generations.claim(128, 128, 8)
    generations.claim(256, 128, 9)
    generations.drop([(0, 7)])  # removed
    generations.claim(256, 64, 10)  # written over
    assert generations.disowns(["a", 0, 128, "c", 7]) and generations.disowns(["c", 256, 128, "c", 9])
    assert not generations.disowns(["b", 128, 128, "c", 8])
    assert not generations.disowns(["d", 4096, 64, "c", 3])  # never learnt of: its checksum decides
    assert not generations.disowns(["a", 0, 128, "c"]) and not generations.disowns(["a", "x", 1, "c", 7])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("raw_reads", [True, False], ids=["raw channel", "zeromq"])
def test_a_remote_read_of_an_old_placement_never_returns_the_bytes_that_took_its_space(raw_reads):
    """A reader holds a placement of object a; a is removed and b, of the same size, takes its space at once (no
    reuse delay). Reading a through that placement, over either read path, must raise StalePlacement, never return
    b's bytes: the read names a's put, and the segment knows another put wrote there since."""
    with MasterServer("127.0.0.1", 0, reuse_delay_s=0.0).start() as master, \
            SegmentServer(8 << 20, master.address, host="127.0.0.1", port=0).start(), \
            DistributedStore(master.address, local_direct=False, raw_reads=raw_reads) as store:
        store.put("a", np.full(4096, 0xAA, np.uint8))
        old = store.locate(["a"], lease=False)[0]
        out = np.zeros(4096, np.uint8)
        store.read_object(old, out)
        assert (out == 0xAA).all()
        store.remove("a", force=True)
        out[:] = 0
        with pytest.raises(StalePlacement, match="no longer there"):
            store.read_object(old, out)  # removed: the remover told the segment
        store.put("b", np.full(4096, 0xBB, np.uint8))
        assert store.locate(["b"], lease=False)[0].replicas[0].offset == old.replicas[0].offset
        with pytest.raises(StalePlacement, match="no longer there"):
            store.read_object(old, out)  # written over by b's put
        assert not (out == 0xBB).any(), "b's bytes reached a reader of a"
        assert store.get("b") == b"\xbb" * 4096


def test_claims_of_no_bytes_or_no_put_record_nothing():
    generations = Generations()
    generations.claim(0, 640, 7)
    version = generations.version
    for offset, size, put in [(0, 0, 9), (64, 0, 9), (0, 640, 0), (0, 640, -7)]:
        generations.claim(offset, size, put)  # an empty object's write_open, or no put at all
    assert generations.holds(7, 0, 640) and len(generations.arrays[0]) == 1 and generations.version == version
    generations.claim(0, 640, 7)  # a later write of the same put: nothing changes, readers need not check again
    assert generations.version == version


def test_a_removed_object_stays_removed_whatever_generation_a_drop_names():
    generations = Generations()
    generations.claim(0, 640, 7)
    assert generations.drop([(0, 7)]) == 1
    named = check_pairs_for(np.array([0]), np.array([640]), np.array([7]))
    for generation in (-7, 0, 8):
        assert generations.drop([(0, generation)]) == 0
        assert check_generations(named, *generations.arrays) == (2, 0), f"a drop naming {generation} brought it back"


def test_a_catalogue_never_seeds_over_what_a_write_this_segment_saw_claimed():
    """A catalogue older than a put this segment took writes for still lists the object that was there: seeding it
    must not bring that object back (a reader of it would get the new put's bytes), nor hide the new one; objects
    beside it are learnt."""
    generations = Generations()
    generations.claim(1024, 128, 9)  # put 9 writes over [1024, 1152)
    version = generations.version
    generations.seed([["old", 1024, 64, 1, "aa", 5], ["empty", 4096, 0, 1, "", 3], ["unknown", 8192, 64, 1, "dd", 0]])
    assert generations.version == version, "a catalogue that taught nothing moved the version"
    generations.seed([["old", 1024, 64, 1, "aa", 5], ["older", 1088, 64, 1, "bb", 4], ["before", 0, 64, 1, "cc", 3],
                      ["beyond", 4096, 64, 1, "ee", 6], ["next", 1152, 64, 1, "ff", 7], ["prev", 960, 64, 1, "gg", 8]])
    old, new = (check_pairs_for(np.array([b]), np.array([n]), np.array([g])) for b, n, g in [(1024, 64, 5),
                                                                                            (1024, 128, 9)])
    assert check_generations(old, *generations.arrays) == (2, 0)
    assert check_generations(new, *generations.arrays) == (2, -1)
    assert generations.arrays[0].tolist() == [0, 960, 1024, 1152, 4096]
    assert generations.holds(3, 0, 64) and generations.holds(6, 4096, 64)
    assert generations.holds(7, 1152, 64) and generations.holds(8, 960, 64)  # right beside the claim: learnt


def test_the_shared_table_holds_as_many_entries_as_it_has_room_for_then_says_it_cannot_tell(tmp_path, monkeypatch):
    from engram_store.kernels import TABLE_UNKNOWN, check_table
    from engram_store.segment import _generations as generations_module

    monkeypatch.setattr(generations_module, "TABLE_MIN", 3)
    generations = Generations(str(tmp_path / "segment.gen"), 0)
    try:
        table = generations.table
        named = check_pairs_for(np.array([0, 128, 256]), np.array([64, 64, 64]), np.array([1, 2, 3]))
        for k in range(3):
            generations.claim(128 * k, 64, k + 1)
        assert check_table(table, named) == (-1, int(table[0]))  # full, not overflowed
        generations.claim(0, 64, 4)
        assert check_table(table, named) == (0, int(table[0]))
        generations.claim(384, 64, 5)  # a fourth entry
        assert check_table(table, named)[0] == TABLE_UNKNOWN
    finally:
        generations.close()


def test_the_kernels_refuse_a_check_without_its_size_and_pass_no_checks(tmp_path):
    """Both checks (the segment's arrays and the shared table a reader or the raw channel reads) count a read's
    checks themselves: an object named by its place alone is refused, and a read naming none passes."""
    from engram_store.kernels import check_table

    generations = Generations(str(tmp_path / "segment.gen"), 1 << 20)
    try:
        generations.claim(0, 64, 3)
        odd = np.array([[-1, 3], [-65, 3], [-1, 3]], np.int64)  # object (0, 64, put 3), then a place alone
        assert check_generations(np.concatenate((odd, [[0, 8]])), *generations.arrays) == (3, 1)
        seq = int(generations.table[0])
        assert check_table(generations.table, odd) == (1, seq)
        assert check_table(generations.table, odd[:2]) == (-1, seq)
        assert check_table(generations.table, np.zeros((0, 2), np.int64)) == (-1, seq)
    finally:
        generations.close()


def test_a_table_being_written_or_out_of_its_bounds_cannot_tell():
    """A reader never answers from a table a segment is changing (odd seq: it gives up after its spins) or one
    whose count is outside its capacity (a table it cannot trust)."""
    from engram_store.kernels import TABLE_UNKNOWN, check_table

    table = np.zeros(8 + 3 * 2, dtype=np.int64)
    table[2] = 2  # capacity 2
    table[8], table[10], table[12] = 0, 64, 1  # one entry: (0, 64, put 1)
    named = check_pairs_for(np.array([0]), np.array([64]), np.array([2]))  # a check that entry refuses
    table[1] = 1
    assert check_table(table, named) == (0, 0)
    for count in (-1, 3):
        table[1] = count
        assert check_table(table, named)[0] == TABLE_UNKNOWN
    table[1], table[0] = 1, 5  # a writer between its two bumps of seq
    assert check_table(table, named)[0] == TABLE_UNKNOWN


_HEADER_PAST_THE_MAPPING = """
import mmap, sys
import numpy as np
from engram_store.kernels import check_pairs_for, check_table
mapped = mmap.mmap(-1, 4096)  # a 4 KiB table, as a segment hands one over
table = np.frombuffer(mapped, dtype=np.int64)
table[1], table[2] = 500, 1 << 40  # 500 entries of a capacity of 2**40
named = check_pairs_for(np.array([0]), np.array([64]), np.array([1]))
print(check_table(table, named)[0])
"""


def test_a_table_whose_header_disagrees_with_its_size_cannot_tell():
    """A 4 KiB table whose header says capacity 2**40: the kernel took its sizes and generations from past the
    mapping, and the client died of SIGSEGV. It cannot tell now (run in a process of its own, so a crash fails this
    test instead of ending the suite)."""
    import subprocess
    import sys

    from engram_store.kernels import TABLE_UNKNOWN, generation_table

    done = subprocess.run([sys.executable, "-c", _HEADER_PAST_THE_MAPPING], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0 and done.stdout.strip() == str(TABLE_UNKNOWN), (done.returncode, done.stderr[-2000:])
    table = np.zeros(512, np.int64)
    table[2] = 1 << 40
    assert generation_table.header_problem(table) == ("its header says capacity 1099511627776 (26388279066688 bytes "
                                                      "with the header), but it is 4096 bytes")
    table[1], table[2] = 3, 168
    assert generation_table.header_problem(table) == ""
    table[1] = 169
    assert generation_table.header_problem(table) == "its header says 169 entries, outside its capacity 168"


def test_a_client_refuses_a_generation_table_whose_header_disagrees_with_its_size(tmp_path, caplog):
    """The client checked only that a table handed over held 64 bytes; it now refuses one whose header says more
    than its size, by name, and reads the segment's memory all the same (proving a table old placements through
    the segment, as it does for a segment that publishes none)."""
    from engram_store.kernels import generation_table

    with MasterServer("127.0.0.1", 0).start() as master, \
            SegmentServer(8 << 20, master.address, file=str(tmp_path / "segment.bin"), readers=0).start() as segment:
        with DistributedStore(master.address, local_direct=True) as store:
            store.put("k", np.full(4096, 0x5A, np.uint8))
        table = segment.generations.table
        capacity = int(table[generation_table.CAPACITY])
        table[generation_table.CAPACITY] = 1 << 40
        try:
            with DistributedStore(master.address, local_direct=True) as store:
                assert store.get("k") == b"\x5a" * 4096
                replica = store.locate(["k"], lease=False)[0].replicas[0]
                assert store.local_segments.view(replica) is not None
                assert store.local_segments.table(replica) is None
        finally:
            table[generation_table.CAPACITY] = capacity
    assert any(f"segment {segment.segment_id} handed over a generation table of" in r.getMessage()
               and "refused: its header says capacity 1099511627776" in r.getMessage() for r in caplog.records)


def test_the_checks_wrapper_refuses_what_is_not_pairs_and_passes_a_read_that_names_nothing():
    from engram_store.errors import InvalidType

    generations = Generations()
    generations.claim(0, 64, 3)
    for bad in (np.zeros((2, 2), np.float64), np.zeros(4, np.int64), np.zeros((2, 3), np.int64)):
        with pytest.raises(InvalidType, match="pairs: expected int64 \\[R, 2\\]"):
            check_generations(bad, *generations.arrays)
    plain = np.array([[0, 64], [0, 8]], np.int64)
    assert check_generations(plain, *generations.arrays) == (0, -1)
    ranges, _ = generations.split(plain, "here")
    assert ranges.tolist() == plain.tolist()


def test_the_bytes_a_read_returns_are_its_ranges_lengths_whatever_checks_lead_it():
    from engram_store.client._reads import reply_bytes

    assert reply_bytes(np.zeros((0, 2), dtype=np.int64)) == 0  # a read of nothing
    pairs = np.array([[0, 10], [64, 3]], dtype=np.int64)  # a first range at offset 0 is a range, not a check
    assert reply_bytes(pairs) == 13
    checks = check_pairs_for(np.array([0]), np.array([128]), np.array([5]))
    assert reply_bytes(np.concatenate((checks, pairs))) == 13
