"""Shared memory on a host with another local user: the host-wide row cache and a segment's memory.

The intruder (a second, unprivileged user, see ``security_helpers.py``) takes the names engram would use in a
directory every user may write, points them at files of the victim's through links, holds their locks, and registers
a segment that names a file of the victim's as its memory. The victim (this process, root) must use none of it.
"""
import fcntl
import os
import stat
import threading

import numpy as np
import pytest
import xxhash

from engram_store import (DistributedStore, EngramError, EngramStore, EngramStoreConfig, LockTimeout, SegmentServer,
                          UnsafeFile)
from engram_store.disk import HostRowCache
from engram_store.disk import _host_cache
from engram_store.testing import Cluster
from security_helpers import Intruder, intruder

pytestmark = pytest.mark.timeout(120)

SIZES, ROW_BYTES, CACHE_BYTES = [50, 70], 16, 1 << 14


def _disk_layer(tmp_path):
    """A published disk_dir layer of the victim's (in its own tmp_path) and its tables."""
    rng = np.random.default_rng(5)
    tables = [rng.integers(0, 255, (n, ROW_BYTES), dtype=np.uint8) for n in SIZES]
    config = EngramStoreConfig(SIZES, ROW_BYTES, row_format="bytes")
    with EngramStore(1, config, disk_dir=tmp_path / "disk") as store:
        store.populate(tables)
    return config, tables


def _cache_name(disk_dir) -> str:
    """The name a host cache of the layer takes (as engram derives it: a hash of what it holds)."""
    key = f"{os.path.realpath(disk_dir)}\0{ROW_BYTES}\0{CACHE_BYTES}\0always\0{_host_cache.LAYOUT_VERSION}"
    return _host_cache.PREFIX + xxhash.xxh3_64_hexdigest(key.encode())


def _lookup_twice(config, tables, disk_dir, between=lambda: None) -> None:
    """Look rows up through the host cache, let ``between`` act, and look them up again (from the cache)."""
    ids = np.stack([np.arange(40) % n for n in SIZES], axis=-1)[None].astype(np.int64)
    want = np.stack([t[ids[0, :, h]] for h, t in enumerate(tables)], axis=1)
    with EngramStore(1, config, disk_dir=disk_dir, row_cache_bytes=CACHE_BYTES, cache_scope="host") as store:
        np.testing.assert_array_equal(store.lookup(ids)[0], want)
        between()
        np.testing.assert_array_equal(store.lookup(ids)[0], want)
        assert store.stats()["cache_hits"] > 0


def test_a_host_cache_name_another_user_took_first_is_never_used(tmp_path, shared, monkeypatch):
    """The intruder creates the cache's files first, writable by all, and writes 0x41 over them once the victim is
    attached: the victim neither initialises nor reads them (its cache lives in a directory of its own)."""
    monkeypatch.setenv("ENGRAM_SHM_DIR", shared)
    config, tables = _disk_layer(tmp_path)
    name = os.path.join(shared, _cache_name(tmp_path / "disk"))
    intruder("plant", name, name + ".lock")
    _lookup_twice(config, tables, tmp_path / "disk", between=lambda: intruder("fill", name, 0x41))
    assert os.stat(name).st_size == 0, "the victim initialised the intruder's file as its cache"
    own = os.stat(os.path.join(shared, f"engram-{os.geteuid()}"))
    assert own.st_uid == os.geteuid() and stat.S_IMODE(own.st_mode) == 0o700


@pytest.mark.parametrize("which", ["data", "lock"])
def test_a_link_at_a_host_cache_name_leads_nowhere(tmp_path, shared, monkeypatch, which):
    """A link at the data name, to a file only the victim may write, would have it truncated and filled with the
    cache; a dangling link at the lock name would have the victim create its target. Neither happens."""
    monkeypatch.setenv("ENGRAM_SHM_DIR", shared)
    config, tables = _disk_layer(tmp_path)
    vault = tmp_path / "vault"
    vault.mkdir(mode=0o700)
    target = vault / "precious"
    if which == "data":
        target.write_bytes(b"precious bytes")
        target.chmod(0o600)
    name = os.path.join(shared, _cache_name(tmp_path / "disk"))
    intruder("symlink", target, name if which == "data" else name + ".lock")
    _lookup_twice(config, tables, tmp_path / "disk")
    if which == "data":
        assert target.read_bytes() == b"precious bytes"
    else:
        assert not target.exists(), "the victim created the file a dangling link pointed at"


def test_a_lock_another_user_holds_blocks_nothing_and_a_held_lock_times_out(tmp_path, shared, monkeypatch):
    """The intruder holds an exclusive flock on a lock file at the cache's name: the victim opens its store all the
    same. Where a process of the victim's own holds the lock for too long, the wait ends in LockTimeout naming it."""
    monkeypatch.setenv("ENGRAM_SHM_DIR", shared)
    config, tables = _disk_layer(tmp_path)
    name = os.path.join(shared, _cache_name(tmp_path / "disk"))
    holder = Intruder("hold-lock", name + ".lock")
    try:
        assert holder.ready == "held"
        opened = threading.Thread(target=_lookup_twice, args=(config, tables, tmp_path / "disk"), daemon=True)
        opened.start()
        opened.join(timeout=30)
        assert not opened.is_alive(), "the victim waited for a lock the intruder holds"
    finally:
        holder.close()
    with HostRowCache(1 << 14, 8, scope="held") as cache:
        fd = os.open(cache.path + ".lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with pytest.raises(LockTimeout, match=r"another process held .*\.lock for more than 0\.2 s"):
                HostRowCache(1 << 14, 8, scope="held", lock_timeout_ms=200)
        finally:
            os.close(fd)


def test_a_directory_another_user_made_at_the_users_name_is_refused(tmp_path, shared, monkeypatch):
    monkeypatch.setenv("ENGRAM_SHM_DIR", shared)
    config, _ = _disk_layer(tmp_path)
    own = os.path.join(shared, f"engram-{os.geteuid()}")
    intruder("mkdir", own)
    with pytest.raises(UnsafeFile, match=rf"{own} belongs to uid 65534 with mode 0777; .* remove it"):
        EngramStore(1, config, disk_dir=tmp_path / "disk", row_cache_bytes=CACHE_BYTES, cache_scope="host")


def test_a_segment_cannot_make_a_client_write_into_a_file_it_names(tmp_path):
    """A segment (run by the intruder) registers with a root-only file of the victim's as its memory: the victim's
    same-host puts must never write into it (they go to the segment through requests)."""
    vault = tmp_path / "vault"
    vault.mkdir(mode=0o700)
    secret = vault / "secret.bin"
    secret.write_bytes(bytes(range(256)) * 4096)
    secret.chmod(0o600)
    with Cluster(segments=0) as c:
        rogue = Intruder("rogue-segment", c.address, secret)
        try:
            assert rogue.ready == "registered"
            with DistributedStore.connect(c.address, timeout_ms=5000) as store:
                try:
                    store.put("k", b"\x41" * 65536)
                except EngramError:
                    pass  # the rogue keeps nothing; what matters is where the bytes went
        finally:
            rogue.close()
    assert secret.read_bytes() == bytes(range(256)) * 4096, "the client wrote its bytes into the named file"


def test_memory_a_segment_hands_over_cannot_be_shrunk_and_others_cannot_have_it():
    """A client holding a segment's memory (even read-write) cannot shrink it under the readers mapping it; another
    user cannot even reach the socket it comes through."""
    from engram_store.wire import handover

    with DistributedStore.embedded(segment_size="16MiB") as store:
        store.put("k", b"k" * 10000)
        (replica,) = store.locate(["k"])[0].replicas
        handed = handover.fetch(replica.shm_path, replica.segment_id, "write")
        try:
            fd = handed.fds["memory"]
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
            assert os.fstat(fd).st_size == replica.segment_size
        finally:
            handed.close()
        assert intruder("connect", replica.shm_path) == "refused Permission denied"
        assert store.get("k") == b"k" * 10000


@pytest.mark.parametrize("planted", ["file", "link"])
def test_a_segment_file_another_user_made_or_linked_is_refused(tmp_path, shared, planted):
    """The intruder makes the --file of a durable segment first (writable by all, so it could truncate it under the
    segment), or a link there to a file of the victim's: the segment refuses to start."""
    path = os.path.join(shared, "segment.bin")
    if planted == "file":
        intruder("plant", path)
        match = r"belongs to uid 65534 .* another user made it first"
    else:
        intruder("symlink", tmp_path / "victim.bin", path)
        match = "is a symbolic link"
    with pytest.raises(UnsafeFile, match=match):
        SegmentServer(1 << 20, None, file=path, readers=0, raw_reads=False).close()
    assert not (tmp_path / "victim.bin").exists()
