"""The files a durable segment and a master's journal keep: one owner per file, directories checked once and held,
temporaries under private names, and no put acknowledged that a segment's catalogue cannot name."""
from __future__ import annotations

import json
import os
import socket

import numpy as np
import pytest

from suite_helpers import fill_up, wait_for
from engram_store import DistributedStore, SegmentServer, UnsafeFile
from engram_store.testing import Cluster, segment_ready, spawn_segment
from engram_store.master._journal import Journal

pytestmark = pytest.mark.timeout(180)


def _catalogue(path: str) -> list[str]:
    with open(path + ".manifest", encoding="utf-8") as f:
        return sorted(o[0] for o in json.load(f)["objects"])


def test_a_second_segment_on_one_file_refuses_to_start_naming_the_first(tmp_path):
    """Both started, registered under one segment id and each took puts into the other's space (a reader got a blob's
    bytes as rows). The second now refuses before it reads the file, naming the first: pid, host and address."""
    data = str(tmp_path / "segment.bin")
    with Cluster(segments=0) as c:
        first = c.add_segment("8MiB", ["--file", data])
        second = spawn_segment(c.address, "8MiB", ["--file", data])
        try:
            try:
                started = segment_ready(second, 60)
            except RuntimeError:  # it exited, as it should
                started = False
            assert not started, f"a second segment started on the file {first.segment_id} serves"
            assert second.popen.wait(timeout=30) == 2
            said = second.output()
        finally:
            second.close()
        assert (f"segment file {data!r} is in use by another process (pid {first.pid} on {socket.gethostname()} "
                in said), said
        assert f"serving segment {first.segment_id} at {first.address}" in said, said
        with DistributedStore.connect(c.address, timeout_ms=5000) as store:
            store.put("k", b"k" * 4096)
            assert store.get("k") == b"k" * 4096
            assert [s["segment_id"] for s in store.status()["segments"]] == [first.segment_id]
        first.terminate()
        c.add_segment("8MiB", ["--file", data]).terminate()  # its owner gone, the file is free again


def test_puts_a_durable_segment_cannot_list_go_to_another_and_survive_a_master_that_forgot(tmpfs):
    """The durable segment's disk fills up: it acknowledged puts its catalogue could not name, and a master restarted
    without a journal (which learns objects from the segments' catalogues) lost them. Now the first such put is
    taken back and placed again, the segment refuses writes, the master places puts on the other segment, and every
    acknowledged put is still there after the master restarts."""
    tmpfs = tmpfs("16m")
    data = str(tmpfs / "segment.bin")
    with Cluster(segments=0, heartbeat_timeout_s=2.0) as c:
        durable = c.add_segment("8MiB", ["--file", data])  # more free space: puts go here first
        c.add_segment("4MiB")
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            store.put("before", b"b" * 1000)
            wait_for(lambda: _catalogue(data) == ["before"], 20, "the catalogue never named the first object")
            fill_up(str(tmpfs / "filler"))
            keys = [f"k{i}" for i in range(5)]
            for key in keys:
                store.put(key, key.encode() * 500)
            placed = {key: store.locate([key])[0].replicas[0].segment_id for key in keys}
            assert durable.segment_id not in placed.values(), placed
            assert _catalogue(data) == ["before"]
            c.restart_master()  # without a journal: it learns every object from the catalogues offered back
            wait_for(lambda: store.status()["objects"] == 6, 30, "the segments did not offer their objects back")
            for key in ["before", *keys]:
                assert store.get(key) == (b"b" * 1000 if key == "before" else key.encode() * 500), key


def test_durable_files_in_a_directory_others_may_write_are_refused(tmp_path):
    """Another user could rename a segment's manifest (or a journal) away and put their own in its place."""
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(UnsafeFile, match=rf"segment file: the directory {open_dir} may be written by other users "
                                         r"\(mode 0777\) and is not sticky"):
        SegmentServer(1 << 20, None, file=str(open_dir / "segment.bin"), readers=0, raw_reads=False)
    with pytest.raises(UnsafeFile, match=rf"journal: the directory {open_dir} may be written by other users"):
        Journal(str(open_dir / "master.journal"))
    assert os.listdir(open_dir) == []
    open_dir.chmod(0o1777)  # sticky, as /tmp: others may not rename what is ours
    SegmentServer(1 << 20, None, file=str(open_dir / "segment.bin"), readers=0, raw_reads=False).close()
    Journal(str(open_dir / "master.journal")).release()


def test_temporaries_a_crash_left_are_removed_at_start_and_new_ones_are_private(tmp_path):
    """A writer killed mid-rewrite leaves its temporary: the next owner removes it (under the file's lock). Every
    temporary takes a name no one could guess, so none another user made first is ever written."""
    data = str(tmp_path / "segment.bin")
    journal = str(tmp_path / "master.journal")
    left = [data + ".manifest.tmp", data + ".manifest.tmp-0123456789abcdef", journal + ".tmp-fedcba9876543210"]
    for path in left:
        with open(path, "wb") as f:
            f.write(b"half written")
    SegmentServer(1 << 20, None, file=data, readers=0, raw_reads=False).close()
    first = Journal(journal)
    first.rewrite([])
    first.release()
    assert sorted(os.listdir(tmp_path)) == ["master.journal", "segment.bin", "segment.bin.gen",
                                            "segment.bin.manifest"]
    assert _catalogue(data) == []


_MAPPED_READER = """
import sys
import numpy as np
from engram_store import DistributedStore, EngramError, EngramStore, EngramStoreConfig
config = EngramStoreConfig(table_vocab_sizes=[997, 1009], embedding_dim=16)
tables = [np.random.default_rng(h).random((n, 16), dtype=np.float32) for h, n in enumerate(config.table_vocab_sizes)]
ids = np.array([[[996, 1008], [3, 5]]])
with DistributedStore.connect(sys.argv[1], timeout_ms=2000, local_direct=True) as store:
    layer = EngramStore(1, config, store)
    layer.populate(tables)
    store.put("blob", b"b" * 300_000)
    assert np.array_equal(layer.lookup(ids)[0, 0, 1], tables[1][1008])
    assert layer.stats()["local_rows"] > 0, "the layer is not mapped here"
    assert store.get("blob", lease=False) == b"b" * 300_000
    print("ready", flush=True)
    sys.stdin.readline()  # the segment is stopped and its file cut short now
    for what, read in (("lookup", lambda: layer.lookup(ids)), ("get", lambda: store.get("blob", lease=False))):
        try:
            read()
            print(what, "read", flush=True)
        except EngramError as exc:
            print(what, type(exc).__name__, flush=True)
"""


def test_a_durable_segments_file_cut_short_at_rest_is_never_read_past_its_end_where_it_is_mapped(tmp_path):
    """A durable segment's memory is a regular file, which no seal keeps from shrinking. Stopped, and its file cut
    short at rest, a client that still maps it read a layer past the file's end and died of SIGBUS (the explorer,
    seed 972128). Each read of a mapped segment's file now checks its size first: the reads fail over, or fail
    with the store's error, and the client lives."""
    import subprocess
    import sys

    data = str(tmp_path / "segment.bin")
    with Cluster(segments=0, heartbeat_timeout_s=60.0) as c:  # (the master keeps naming the stopped segment)
        durable = c.add_segment("8MiB", ["--file", data])
        reader = subprocess.Popen([sys.executable, "-c", _MAPPED_READER, c.address], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert reader.stdout.readline().strip() == "ready", reader.stderr.read()
            durable.terminate()
            with open(data, "r+b") as f:
                f.truncate(4096)
            out, err = reader.communicate("go\n", timeout=120)
        finally:
            if reader.poll() is None:
                reader.kill()
                reader.wait()
    assert reader.returncode == 0, f"the reader died ({reader.returncode}): {err[-2000:]}"
    said = dict(line.split(" ", 1) for line in out.split("\n") if line)
    assert said.keys() == {"lookup", "get"}, out
    assert said["lookup"] in ("StalePlacement", "SegmentUnavailable"), out
    assert said["get"] in ("SegmentUnavailable", "ObjectLost", "StalePlacement"), out


def _flip(path: str, at: int, old: bytes, new: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        assert f.read(1) == old
        f.seek(at)
        f.write(new)


def test_a_manifest_damaged_at_rest_where_it_is_mapped_is_read_from_another_copy_or_named_lost(tmp_path):
    """A byte of a layer's manifest flipped in a durable segment's file (at rest: the segment stopped) where a
    client maps it: the damaged copy still parsed, with other head sizes, and every open of the layer failed with
    ConfigError, blaming the caller's configuration (the explorer, seed 972214). A manifest's bytes are now checked
    against the checksum the master recorded: the damaged copy is passed over for another, and with every copy
    damaged the layer reads as lost, naming the damage."""
    from engram_store import EngramStore, EngramStoreConfig, ObjectLost

    config = EngramStoreConfig(table_vocab_sizes=[997, 1009], embedding_dim=16)
    tables = [np.random.default_rng(h).random((n, 16), dtype=np.float32)
              for h, n in enumerate(config.table_vocab_sizes)]
    ids = np.array([[[996, 1008], [3, 5]]])
    expected = np.stack([tables[0][ids[..., 0]], tables[1][ids[..., 1]]], axis=-2)
    files = [str(tmp_path / f"segment{i}.bin") for i in range(2)]
    with Cluster(segments=0, heartbeat_timeout_s=60.0) as c:  # (the master keeps naming the stopped segments)
        segments = [c.add_segment("8MiB", ["--file", f]) for f in files]
        with DistributedStore.connect(c.address, timeout_ms=2000, local_direct=True) as store:
            EngramStore(1, config, store).populate(tables, replica_num=2)
            info = store.locate(["engram:l1:manifest"], lease=False)[0]
            at = store.get("engram:l1:manifest", lease=False).index(b"[997") + 1  # 997 -> 897: still JSON
            chosen = store._choose(info, set(), 0)
            assert store.local_view(chosen) is not None, "the manifest is not read from this host's mapping"
            first = next(i for i, s in enumerate(segments) if s.segment_id == chosen.segment_id)
            segments[first].terminate()
            _flip(files[first], chosen.offset + at, b"9", b"8")
            np.testing.assert_array_equal(EngramStore(1, config, store).lookup(ids), expected)

            other = next(r for r in info.replicas if r is not chosen)
            segments[1 - first].terminate()
            _flip(files[1 - first], other.offset + at, b"9", b"8")
            with pytest.raises(ObjectLost, match="'engram:l1:manifest': its bytes no longer match the checksum"):
                EngramStore(1, config, store).lookup(ids)
