"""Fixtures every folder of the suite shares.

Folders by room: ``master/``, ``store/`` (client, segments, raw channel), ``tables/`` (EngramStore, engram-layers),
``kernels/``, ``disk/``, ``compat/``, ``model/``, ``mooncake/`` (the Mooncake bridge), ``faults/`` (processes killed,
paused, cut off, disks filled), ``security/`` (another local user, run as a second uid; needs root), ``engines/`` (the
plugins inside vLLM and SGLang, skipped where an engine is missing); at the top, what
spans the house: the CLI, the docs, the layout rules, the fault explorer (``nemesis*.py``,
``python tests/nemesis.py --help``), and, run on demand, the mutation pass over the contract's guards (``mutate.py``,
see ``README.md`` here).

Conventions: a folder's helpers live beside its tests in ``<folder>_helpers.py`` (this folder's in
``suite_helpers.py``): pytest puts a test's folder, and this one, on ``sys.path``, so they are imported by that
unique name (never ``from conftest import``: several folders have one, and the first imported wins); a script a
test runs as a process of its own is named ``*_worker.py``.
"""
import os
import subprocess
import tempfile

import pytest


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_in_the_runs_own_directory(tmp_path_factory):
    """Everything the run writes through ``tempfile`` (its own files, and its child processes' through ``TMPDIR``:
    servers' logs, the explorer's directories) lands in a directory of the session's, which pytest removes with
    the rest when every test passed (``tmp_path_retention_policy = "failed"``): a run leaves nothing in the
    system's temporary directory."""
    directory = str(tmp_path_factory.mktemp("tmp", numbered=False))
    saved = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = os.environ["TMPDIR"] = directory
    try:
        yield directory
    finally:
        tempfile.tempdir = saved[0]
        if saved[1] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved[1]


@pytest.fixture
def embedded():
    """A master and one 64 MiB segment inside the test process; closed after the test."""
    from engram_store import DistributedStore

    with DistributedStore.embedded(segment_size="64MiB") as store:
        yield store


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size)`` mounts a file system of that size (``"1M"``, ``"64k"``) under tmp_path and returns its path,
    for tests of full disks (root only: the test skips elsewhere); every one is unmounted after the test.
    ``options``: more mount options (``"nr_inodes=4"``: a file system that runs out of inodes)."""
    mounted = []

    def mount(size: str, options: str = ""):
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        opts = f"size={size},mode=0755" + (f",{options}" if options else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
                              capture_output=True, timeout=30)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=True, timeout=30)

