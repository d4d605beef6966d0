"""Reads that name the objects they expect: the kernel against a plain Python reference, and the segment's record of
which put wrote which range."""

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_store import InvalidArgument, StalePlacement
from engram_store.kernels import check_generations, check_pairs_for
from engram_store.segment._generations import Generations


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
