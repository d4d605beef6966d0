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
import contextlib
import os
import shutil
import subprocess
import tempfile

import pytest


#: Workers per CPU for ``-n auto`` (pyproject.toml's addopts): tests spend much of their time waiting on the servers
#: they start, so two per CPU keep the CPUs busy (on 2 cores: 6 minutes against 9 with one per CPU). The fault tests
#: that cannot run beside each other run in one worker (ALONE).
WORKERS_PER_CPU = 2
#: Test files whose tests run in one worker, one after another (``--dist loadgroup``): they failed beside each other.
ALONE = ("tests/faults/test_partitions.py", "tests/faults/test_master_outage.py", "tests/faults/test_raw_limits.py",
         "tests/faults/test_resources.py")
MAX_WORKERS = 16


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: WORKERS_PER_CPU workers per CPU this process may run on, at least 2, at most 16."""
    return max(2, min(WORKERS_PER_CPU * len(os.sched_getaffinity(0)), MAX_WORKERS))


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, each worker's first share of the run starts with its part of the tests marked ``slow``
    (the fault explorer's histories, the docs' shell blocks: up to a minute or two each when the workers share two
    cores). Work stealing (``--dist worksteal``, and loadgroup alike) gives each worker a run of tests to begin with
    and moves the ends of long queues to idle workers, so a slow test at the end of the collection would start last
    and hold up the run's end; one at the start of every share starts at once, and the rest of the suite fills in
    around it. Run without workers, the order stays the collection's."""
    for item in items:
        if item.nodeid.startswith(ALONE):
            item.add_marker(pytest.mark.xdist_group("alone"))
    workers = getattr(config, "workerinput", {}).get("workercount", 0)
    slow = [item for item in items if item.get_closest_marker("slow")]
    if workers < 2 or not slow:
        return
    rest = [item for item in items if not item.get_closest_marker("slow")]
    ordered, pending = [], len(items)
    for worker in range(workers):
        share = pending // (workers - worker)  # as work stealing splits the tests among idle workers at the start
        mine = slow[worker::workers]
        ordered += mine + rest[:max(0, share - len(mine))]
        rest = rest[max(0, share - len(mine)):]
        pending -= share
    items[:] = ordered + rest


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_in_the_runs_own_directory(tmp_path_factory):
    """Everything the run writes through ``tempfile`` (its own files, and its child processes' through ``TMPDIR``:
    servers' logs, the explorer's directories) lands in a directory of the session's, which pytest removes with
    the rest when every test passed (``tmp_path_retention_policy = "failed"``): a run leaves nothing in the
    system's temporary directory. Under pytest-xdist each worker is a session of its own, with its own directory."""
    directory = str(tmp_path_factory.mktemp("tmp", numbered=False))
    with _environment(TMPDIR=directory):
        saved, tempfile.tempdir = tempfile.tempdir, directory
        try:
            yield directory
        finally:
            tempfile.tempdir = saved


@pytest.fixture(scope="session", autouse=True)
def _bytecode_in_the_runs_own_directory(tmp_path_factory):
    """Where ``PYTHONDONTWRITEBYTECODE`` is set (so no ``__pycache__`` lands in the tree), every process the run
    starts (servers, the docs' commands, the explorer's clients: hundreds) would compile engram's sources again,
    a third of a short process's time. The run's processes write their bytecode to a directory of the run's own
    instead (``PYTHONPYCACHEPREFIX``, shared by pytest-xdist's workers), removed with it; the tree stays clean."""
    if "PYTHONDONTWRITEBYTECODE" not in os.environ:
        yield None
        return
    base = tmp_path_factory.getbasetemp()
    directory = str((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "bytecode")
    saved = os.environ.pop("PYTHONDONTWRITEBYTECODE")
    try:
        with _environment(PYTHONPYCACHEPREFIX=directory):
            yield directory
    finally:
        os.environ["PYTHONDONTWRITEBYTECODE"] = saved


@pytest.fixture(scope="session", autouse=True)
def _shared_files_in_the_runs_own_directory():
    """What engram shares between the processes of a host (``engram-<uid>`` under ``ENGRAM_SHM_DIR``, else
    ``/dev/shm``: segments' hand-over sockets, host row caches) goes to a directory of this test run's own, in memory
    too: tests running side by side (pytest-xdist's workers, another run on the host) never see, reap or attach
    each other's, and whatever a test leaves there is its own run's to find. Removed at the end."""
    base = os.environ.get("ENGRAM_SHM_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    directory = tempfile.mkdtemp(prefix="engram-tests-", dir=base)
    try:
        with _environment(ENGRAM_SHM_DIR=directory):
            yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def _environment(**values):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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

