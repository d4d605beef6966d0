"""Durable files, checkpoints and generation tables on a host with another local user.

The intruder (a second, unprivileged user, see ``security_helpers.py``) takes the names a master's journal and a
durable segment write beside their files, as links to a file of the victim's or as files and directories of its own;
takes a segment's lock name; writes a checkpoint whose links lead to root's files and whose shard is a named pipe;
and registers a segment whose generation table's header says more than the table holds. The victim (this process,
root) must write through none of it, lose no put it acknowledged, read none of root's files for the intruder, never
block, and never read past a mapping.
"""
import json
import logging
import os
import stat
import struct

import numpy as np
import pytest

from engram_model import load_safetensors, save_safetensors
from engram_model.v41 import SafetensorsCheckpoint
from engram_store import DistributedStore, InvalidArgument, SegmentServer, UnsafeFile
from engram_store.testing import Cluster
from security_helpers import Intruder, intruder
from suite_helpers import outcome_within, wait_for

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("planted", ["link", "file"])
def test_the_journal_never_writes_through_a_name_another_user_took_beside_it(tmp_path, shared, planted):
    """``<journal>.tmp``, planted: a link to a root-only file had the master write its records into that file (and
    go on appending to it); a file writable by all became the journal, the intruder's to forge. Now the journal is
    rewritten through a private temporary, stays root's and not writable by others, and the planted name is left
    as it was."""
    vault = tmp_path / "vault"
    vault.mkdir(mode=0o700)
    precious = vault / "precious"
    precious.write_bytes(b"precious bytes")
    precious.chmod(0o600)
    journal = os.path.join(shared, "m.journal")
    if planted == "link":
        intruder("symlink", precious, journal + ".tmp")
    else:
        intruder("plant", journal + ".tmp")
    with Cluster(segments=1, journal=journal) as c:
        with DistributedStore.connect(c.address, timeout_ms=5000) as store:
            store.put("k", b"k" * 4096)
        assert os.stat(journal, follow_symlinks=False).st_uid == 0, "the journal is the intruder's file"
        c.restart_master(journal=journal)  # a rewrite at start
        with DistributedStore.connect(c.address, timeout_ms=5000) as store:
            assert store.get("k") == b"k" * 4096
    assert precious.read_bytes() == b"precious bytes", "the master wrote its journal into the victim's file"
    st = os.stat(journal, follow_symlinks=False)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o022, (st.st_uid, oct(st.st_mode))
    left = os.lstat(journal + ".tmp")
    assert left.st_uid == 65534 and (stat.S_ISLNK(left.st_mode) or left.st_size == 0)


def _manifest(path: str) -> list[str]:
    try:
        with open(path + ".manifest", encoding="utf-8") as f:
            return sorted(o[0] for o in json.load(f)["objects"])
    except (OSError, ValueError):
        return []


@pytest.mark.parametrize("when", ["before start", "after start"])
def test_a_manifest_temporary_another_user_took_loses_no_put(shared, when):
    """The intruder takes ``<file>.manifest.tmp`` (a directory: not even root may unlink it as a file). Before start,
    the segment refused to start; after, its catalogue stopped being written (a WARNING a heartbeat) while its puts
    were acknowledged, and a master restarted without a journal lost them. Now the catalogue never uses that name."""
    data = os.path.join(shared, "segment.bin")
    with Cluster(segments=0, heartbeat_timeout_s=2.0) as c:
        if when == "before start":
            intruder("mkdir", data + ".manifest.tmp")
        c.add_segment("8MiB", ["--file", data])
        if when == "after start":
            intruder("mkdir", data + ".manifest.tmp")
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            store.put("a", b"a" * 4096)
            wait_for(lambda: _manifest(data) == ["a"], 20, "the catalogue to name the put")
            c.restart_master()  # without a journal: it learns the objects from the catalogues
            wait_for(lambda: store.status()["objects"] == 1, 30, "the segment to offer its object back")
            assert store.get("a") == b"a" * 4096
    assert os.path.isdir(data + ".manifest.tmp") and os.stat(data + ".manifest.tmp").st_uid == 65534


def test_a_segment_lock_name_another_user_took_is_refused(shared):
    """A segment owns its file through ``<file>.lock``: one the intruder made first (writable by all) is never used."""
    data = os.path.join(shared, "segment.bin")
    intruder("plant", data + ".lock")
    with pytest.raises(UnsafeFile, match=r"segment file lock: .*segment\.bin\.lock belongs to uid 65534"):
        SegmentServer(1 << 20, None, file=data, readers=0, raw_reads=False)
    assert not os.path.exists(data), "the segment made its file without owning it"


def test_a_model_saved_where_another_user_planted_a_link_writes_only_its_own_file(tmp_path, shared):
    """save_safetensors wrote ``<path>.tmp`` through the intruder's link into the victim's file."""
    precious = tmp_path / "precious"
    precious.write_bytes(b"precious bytes")
    path = os.path.join(shared, "model.safetensors")
    intruder("symlink", precious, path + ".tmp")
    save_safetensors(path, {"w": np.arange(4, dtype=np.float32)})
    assert precious.read_bytes() == b"precious bytes"
    np.testing.assert_array_equal(load_safetensors(path)["w"], np.arange(4, dtype=np.float32))
    assert os.stat(path).st_uid == 0


def _safetensors(path, values: np.ndarray) -> None:
    blob = json.dumps({"w": {"dtype": "F32", "shape": list(values.shape),
                             "data_offsets": [0, values.nbytes]}}).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + values.tobytes())


def test_a_checkpoint_of_another_user_cannot_lead_a_root_loader_to_roots_files(tmp_path, shared):
    """The intruder's checkpoint links its shard to a root-only checkpoint (or any file of root's): the root loader
    read it. Now a file is read only when it belongs to the checkpoint directory's owner (or, in a directory of the
    loader's own or root's, to the loader): a Hugging Face cache's snapshot links into its blobs keep working."""
    vault = tmp_path / "vault"
    vault.mkdir(mode=0o700)
    secret = vault / "secret.safetensors"
    _safetensors(secret, np.full(4, 7.0, np.float32))
    secret.chmod(0o600)
    hostile = os.path.join(shared, "checkpoint")
    intruder("mkdir", hostile)
    intruder("symlink", secret, os.path.join(hostile, "model.safetensors"))
    with pytest.raises(UnsafeFile, match=rf"{hostile}/model.safetensors: belongs to uid 0, but the checkpoint's "
                                         rf"directory {hostile} belongs to uid 65534"):
        SafetensorsCheckpoint(hostile).raw("w")
    with pytest.raises(UnsafeFile, match="belongs to uid 0, but the checkpoint's directory"):
        SafetensorsCheckpoint(os.path.join(hostile, "model.safetensors")).raw("w")
    # A cache laid out as Hugging Face's (snapshot links into blobs), the victim's own: it loads.
    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "rev"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    _safetensors(blobs / "0123abcd", np.arange(4, dtype=np.float32))
    os.symlink("../../blobs/0123abcd", snapshot / "model.safetensors")
    np.testing.assert_array_equal(SafetensorsCheckpoint(snapshot).raw("w"), np.arange(4, dtype=np.float32))
    # The intruder's own checkpoint, linked to its own file: it loads too.
    own = os.path.join(shared, "own")
    intruder("mkdir", own)
    intruder("write", os.path.join(own, "data"), "not a checkpoint")
    intruder("symlink", os.path.join(own, "data"), os.path.join(own, "model.safetensors"))
    with pytest.raises(InvalidArgument, match="not a safetensors file"):  # read: it is the intruder's to give
        SafetensorsCheckpoint(own)


@pytest.mark.parametrize("shard", ["named pipe", "directory"])
def test_a_shard_that_is_no_file_is_refused_without_blocking(shared, shard):
    """The intruder's checkpoint holds a named pipe as its shard (the loader hung for ever in its open) or a
    directory (a raw IsADirectoryError)."""
    checkpoint = os.path.join(shared, "checkpoint")
    intruder("mkdir", checkpoint)
    intruder("mkfifo" if shard == "named pipe" else "mkdir", os.path.join(checkpoint, "model.safetensors"))
    intruder("write", os.path.join(checkpoint, "model.safetensors.index.json"),
             json.dumps({"weight_map": {"w": "model.safetensors"}}))
    raised = outcome_within(lambda: SafetensorsCheckpoint(checkpoint).info("w"), 20, "the loader")
    assert isinstance(raised, InvalidArgument), raised
    assert f"model.safetensors: is a {shard}, not a checkpoint file" in str(raised)


def test_a_generation_table_whose_header_says_more_than_it_holds_is_refused(shared, monkeypatch, caplog):
    """The intruder's segment hands its memory over (sealed, so a client maps it) with a 4 KiB generation table whose
    header says 2**40 entries: a client that checked the table read past the mapping and died of SIGSEGV. The
    victim now refuses the table by name and reads the segment's memory without it."""
    monkeypatch.setenv("ENGRAM_SHM_DIR", shared)
    caplog.set_level(logging.WARNING)
    with Cluster(segments=0) as c:
        hostile = Intruder("hostile-table", c.address, 1 << 40)
        try:
            assert hostile.ready == "registered"
            with DistributedStore.connect(c.address, timeout_ms=5000) as store:
                store.put("k", b"k" * 4096)
                replica = store.locate(["k"], lease=False)[0].replicas[0]
                assert store.local_segments.view(replica) is not None, "the victim did not map the segment"
                assert store.local_segments.table(replica) is None, "the victim took the hostile table"
        finally:
            hostile.close()
    assert any("handed over a generation table of 4096 bytes that is refused: its header says capacity "
               "1099511627776" in r.getMessage() for r in caplog.records)
