"""The segment's fence, guard by guard: a ticket admits the bytes of its own range and no others, a fenced put stays
refused once the master has its acknowledgement, a new registration fences every earlier ticket, and a same-host
writer of a fenced put holds its range while it lives. Then the same through a real segment server: a write past
its ticket's range is answered with an error and the neighbouring object keeps its bytes.

``tests/faults/test_fencing.py`` shows the contract end to end with stalled and killed writers; these tests name the
guard that breaks, in milliseconds.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from engram_store import DistributedStore, InvalidArgument, WriteFenced
from engram_store.segment import WriteFence
from engram_store.wire import make_ticket

SEGMENT = "seg-1"
START, SIZE = 4096, 1000


def _fence() -> tuple[WriteFence, bytes]:
    fence = WriteFence(SEGMENT)
    _, key = fence.new_registration()
    return fence, key


@pytest.mark.parametrize("offset, nbytes", [(START, SIZE), (START, 0), (START + SIZE, 0), (START + 1, SIZE - 1),
                                            (START + SIZE - 1, 1)])
def test_a_ticket_admits_every_write_inside_its_range(offset, nbytes):
    fence, key = _fence()
    assert fence.check(make_ticket(key, SEGMENT, 7, START, SIZE), offset, nbytes) == (7, START, SIZE)


@pytest.mark.parametrize("offset, nbytes", [(START - 1, 1), (START - 1, SIZE), (START, SIZE + 1),
                                            (START + SIZE - 1, 2), (START + SIZE, 1), (START + SIZE + 1, 0),
                                            (0, 2 * START)])
def test_a_ticket_refuses_a_write_that_leaves_its_range(offset, nbytes):
    fence, key = _fence()
    with pytest.raises(InvalidArgument, match=rf"write: bytes \[{offset}, {offset + nbytes}\) lie outside the range "
                                              rf"\[{START}, {START + SIZE}\) the ticket of put 7 allows"):
        fence.check(make_ticket(key, SEGMENT, 7, START, SIZE), offset, nbytes)


def test_a_fenced_put_stays_refused_after_its_fence_is_acknowledged():
    fence, key = _fence()
    seven, eight = make_ticket(key, SEGMENT, 7, START, SIZE), make_ticket(key, SEGMENT, 8, 0, START)
    fence.fence([7])
    assert fence.heartbeat_fields()["fenced"] == [7]
    with pytest.raises(WriteFenced, match="put 7 was fenced"):
        fence.check(seven, START, 1)
    fence.acknowledged([7])  # the master has the acknowledgement: it frees the put's space now
    assert fence.heartbeat_fields()["fenced"] == []
    with pytest.raises(WriteFenced, match="put 7 was fenced"):
        fence.check(seven, START, 1)
    with pytest.raises(WriteFenced, match="put 7 was fenced"):
        fence.open_direct(seven, os.getpid())
    assert fence.check(eight, 0, START) == (8, 0, START)  # another put writes on


def test_the_oldest_fences_are_forgotten_past_the_bound(monkeypatch):
    from engram_store.segment import _fence as fence_module

    monkeypatch.setattr(fence_module, "MAX_FENCED", 3)
    fence, key = _fence()
    fence.fence([1, 2, 3, 4, 5])
    for put_id in (3, 4, 5):
        with pytest.raises(WriteFenced):
            fence.check(make_ticket(key, SEGMENT, put_id, START, SIZE), START, 1)
    assert fence.check(make_ticket(key, SEGMENT, 2, START, SIZE), START, 1)[0] == 2  # a ticket that old expired


def test_a_new_registration_fences_every_earlier_ticket():
    fence, old_key = _fence()
    old = make_ticket(old_key, SEGMENT, 7, START, SIZE)
    assert fence.ticket_of(old) == (7, START, SIZE)
    _, key = fence.new_registration()
    assert fence.ticket_of(old) is None
    with pytest.raises(WriteFenced, match="did not issue this ticket under its current registration"):
        fence.check(old, START, 1)
    assert fence.check(make_ticket(key, SEGMENT, 9, START, SIZE), START, 1) == (9, START, SIZE)
    with pytest.raises(WriteFenced, match="did not issue this ticket"):
        fence.check(make_ticket(key, "seg-2", 9, START, SIZE), START, 1)  # another segment's ticket


@pytest.mark.timeout(60)
def test_a_live_writer_of_a_fenced_put_holds_its_range_until_it_exits():
    fence, key = _fence()
    writer = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    descriptors = len(os.listdir("/proc/self/fd"))
    try:
        mine, theirs = make_ticket(key, SEGMENT, 7, START, SIZE), make_ticket(key, SEGMENT, 8, 0, START)
        other = make_ticket(key, SEGMENT, 9, START + SIZE, SIZE)
        assert fence.open_direct(mine, os.getpid()) == (7, START, SIZE)
        assert fence.open_direct(theirs, writer.pid) == (8, 0, START)
        assert fence.open_direct(other, os.getpid()) == (9, START + SIZE, SIZE)
        assert fence.heartbeat_fields()["held"] == []  # open puts hold nothing: the master placed them
        fence.fence([7, 8])
        assert sorted(fence.heartbeat_fields()["held"]) == [[0, START], [START, SIZE]]
        assert fence.close_direct(other) is False  # put 9 was not fenced: it may publish
        assert fence.close_direct(mine) is True  # fenced meanwhile: what it wrote must not be published
        assert fence.heartbeat_fields()["held"] == [[0, START]]
        writer.stdin.close()
        writer.wait(timeout=30)
        assert fence.heartbeat_fields()["held"] == [], "an exited writer still holds its range"
        assert len(os.listdir("/proc/self/fd")) == descriptors - 1, "a writer's pidfd outlived it"  # (its stdin)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
        fence.close()


def test_open_direct_keeps_one_descriptor_per_writer_and_none_for_a_refused_one():
    fence, key = _fence()
    ticket, fenced = make_ticket(key, SEGMENT, 7, START, SIZE), make_ticket(key, SEGMENT, 8, 0, START)
    fence.fence([8])
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(WriteFenced):
        fence.open_direct(fenced, os.getpid())
    assert len(os.listdir("/proc/self/fd")) == before, "a refused writer's pidfd was left open"
    fence.open_direct(ticket, os.getpid())
    fence.open_direct(ticket, os.getpid())  # the same writer again (a retried write_open): one pidfd
    assert len(os.listdir("/proc/self/fd")) == before + 1
    fence.close_direct(ticket)
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_writer_that_closes_an_unfenced_put_may_publish_it():
    fence, key = _fence()
    ticket = make_ticket(key, SEGMENT, 7, START, SIZE)
    fence.open_direct(ticket, os.getpid())
    assert fence.close_direct(ticket) is False
    fence.open_direct(ticket, os.getpid())
    fence.new_registration()  # the segment registered again while the writer wrote
    assert fence.close_direct(ticket) is True
    assert fence.close_direct(ticket) is True  # not open (any more): nothing it wrote may be published


@pytest.mark.timeout(60)
def test_a_segment_refuses_a_write_past_its_tickets_range_and_the_neighbour_keeps_its_bytes():
    with DistributedStore.embedded(segment_size="8MiB") as store:
        results, _ = store._put_start(["k"], [4096], 1)
        replica = results[0]["replicas"][0]
        store.put("neighbour", np.full(4096, 0x11, np.uint8))
        assert store.locate(["neighbour"], lease=False)[0].replicas[0].offset == replica["offset"] + 4096
        conn = store._segment_conn(replica["address"])
        write = {"offset": replica["offset"] + 4000, "ticket": replica["ticket"]}
        with pytest.raises(InvalidArgument, match=r"lie outside the range"):
            conn.call("write", write, [np.full(200, 0xEE, np.uint8)])
        assert store.get("neighbour") == b"\x11" * 4096
        assert conn.call("write", write, [np.full(96, 0xEE, np.uint8)])[0]["written"] == 96  # it keeps serving
        store._revoke({"k": results[0]["generation"]}, settled=True)
        assert store.get("neighbour") == b"\x11" * 4096
