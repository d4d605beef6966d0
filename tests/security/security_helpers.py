"""Helpers of the security tests: another local user (the intruder, an unprivileged uid that
``intruder_worker.py`` drops to) and a directory every user may write in, as ``/dev/shm`` and ``/tmp`` are."""
import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "intruder_worker.py")
INTRUDER_UID = 65534
TIMEOUT_S = 30


def needs_root() -> None:
    """Skip, saying why, where this process cannot act as a second user (dropping to another uid needs root)."""
    if os.geteuid() != 0:
        pytest.skip("the security tests run an intruder as a second, unprivileged user, which needs root "
                    "(os.setuid); run them as root, e.g. in a container")


def intruder(*args: str, timeout_s: float = TIMEOUT_S) -> str:
    """Run one action of the intruder (see intruder_worker.py) as the other user; what it printed."""
    done = subprocess.run([sys.executable, WORKER, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


class Intruder:
    """A long action of the intruder (``hold-lock``, ``rogue-segment``) running beside the test: started and waited
    for until it prints its first line (``ready``); :meth:`close` ends it (stdin closed, then killed) and reaps it."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, WORKER, *map(str, args)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.ready = self.proc.stdout.readline().strip()  # the worker prints it once it stands where it should
        if not self.ready:
            self.close()
            raise AssertionError(f"the intruder did not start: {self.proc.stderr.read()[-2000:]}")

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=TIMEOUT_S)
        for stream in (self.proc.stdout, self.proc.stderr):
            stream.close()
