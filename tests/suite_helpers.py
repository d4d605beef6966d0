"""Helpers every folder of the suite may use (see conftest.py for the conventions)."""
import os


def fill_up(path: str) -> None:
    """Take every page left on the file system of ``path`` (a file that grows until the system says no)."""
    fd = os.open(path, os.O_CREAT | os.O_WRONLY)
    try:
        for size in (1 << 20, 64 << 10, 4 << 10):
            while True:
                try:
                    os.posix_fallocate(fd, os.fstat(fd).st_size, size)
                except OSError:
                    break
    finally:
        os.close(fd)
