"""A segment's memory handed to processes on its host: descriptors over a Unix socket (``wire.handover``), checked
on both sides. (Another user's attempts are in ``tests/security``.)"""
import os
import socket

import pytest

from engram_store import DistributedStore, ProtocolError, SegmentServer, UnsafeFile
from engram_store.wire import handover

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def segment():
    with DistributedStore.embedded(segment_size="8MiB") as store:
        server = store.local_segment
        yield server, server.handover.path


def test_a_reader_gets_the_memory_read_only_and_the_generation_table(segment):
    server, path = segment
    handed = handover.fetch(path, server.segment_id, "read")
    try:
        assert sorted(handed.fds) == ["memory", "table"] and handed.size == server.size
        assert (handed.pid, handed.uid) == (os.getpid(), os.geteuid())
        with pytest.raises(OSError):
            os.pwrite(handed.fds["memory"], b"x", 0)  # read-only: neither written nor sealed through it
        assert os.fstat(handed.fds["memory"]).st_size == server.size
    finally:
        handed.close()
    handed = handover.fetch(path, server.segment_id, "write")
    try:
        assert sorted(handed.fds) == ["memory"]
    finally:
        handed.close()


@pytest.mark.parametrize("segment_id,want,refusal", [("another", "read", "this is segment"),
                                                     (None, "everything", "want: expected one of")])
def test_a_request_for_another_segment_or_thing_is_refused_and_the_segment_serves_on(segment, segment_id, want,
                                                                                     refusal):
    server, path = segment
    with pytest.raises(ProtocolError, match=f"refused the hand-over: {refusal}"):
        handover.fetch(path, segment_id or server.segment_id, want)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:  # not even msgpack
        sock.connect(path)
        sock.send(b"\xc1garbage")
    handover.fetch(path, server.segment_id, "read").close()


def test_a_durable_segment_hands_over_no_memory_for_writes(tmp_path):
    with SegmentServer(1 << 20, None, file=str(tmp_path / "segment.bin"), readers=0, raw_reads=False) as server:
        with pytest.raises(ProtocolError, match="takes no direct writes"):
            handover.fetch(server.handover.path, server.segment_id, "write")
        handover.fetch(server.handover.path, server.segment_id, "read").close()


def test_a_socket_that_is_not_what_its_name_says_is_refused(segment):
    server, path = segment
    with pytest.raises(UnsafeFile, match="is not a segment's hand-over socket"):
        handover.fetch(str(server.memory.name), server.segment_id, "read")
    own = os.path.dirname(path)
    impostor = os.path.join(own, handover.socket_name(os.getpid() + 1, "0123456789abcdef"))
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        listener.bind(impostor)
        listener.listen(1)
        try:
            with pytest.raises(UnsafeFile, match=rf"is pid {os.getpid()} of uid {os.geteuid()}, not pid "
                                                 rf"{os.getpid() + 1}"):
                handover.fetch(impostor, server.segment_id, "read")
        finally:
            os.unlink(impostor)


def test_a_segments_memory_cannot_be_shrunk_even_while_its_pages_are_reserved(monkeypatch):
    """The fault explorer (seed 979004) paused a segment a moment after it started and truncated its memory through
    /proc: it was sealed only once its pages were reserved, so the truncate went through. It is sealed against
    shrinking from the start now: a truncate in the middle of the reservation is refused."""
    from engram_store.segment import _memory

    reserve, tried = _memory.reserve_memory, []

    def truncated_meanwhile(fd, nbytes, what):  # another process of this user, as the pages are reserved
        reserve(fd, nbytes, what)
        other = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.ftruncate(other, 0)
            tried.append(os.fstat(other).st_size)
        finally:
            os.close(other)

    monkeypatch.setattr(_memory, "reserve_memory", truncated_meanwhile)
    fd, sealed = _memory.anonymous_memory(1 << 20, "engram-test", "a test segment")
    try:
        assert sealed and tried == [1 << 20] and os.fstat(fd).st_size == 1 << 20
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)
