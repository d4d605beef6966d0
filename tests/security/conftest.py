"""The security suite: every finding of a shared host tried as another local user would try it, by an intruder
running as a second, unprivileged user (``security_helpers.py``, ``intruder_worker.py``); skipped, saying why, where
the suite does not run as root."""
import os
import shutil
import uuid

import pytest

from security_helpers import needs_root


@pytest.fixture
def shared():
    """A fresh directory every user may write in (mode 1777, as /dev/shm and /tmp), removed after the test."""
    needs_root()
    base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    path = os.path.join(base, f"engram-security-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(path)
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
