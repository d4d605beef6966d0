"""A writer process for the fencing tests: puts objects in small chunks and stops after the first one until told.

    python writer_worker.py MASTER PATH KEY_PREFIX HEADS HEAD_BYTES SEED

``PATH`` is ``direct`` (pwrite into a segment file on this host) or ``requests`` (ZeroMQ writes). After the first
chunk it prints ``PAUSED`` and waits for a line on stdin; then it writes the rest and prints ``DONE`` or
``FAILED <exception class>: <message>``.
"""
import sys

import numpy as np

from engram_store import DistributedStore, EngramError
from engram_store.client import _writes as _client


def main() -> int:
    master, path, prefix, heads, head_bytes, seed = sys.argv[1:7]
    heads, head_bytes, seed = int(heads), int(head_bytes), int(seed)
    _client.WRITE_CHUNK_BYTES = _client.LOCAL_WRITE_CHUNK_BYTES = 256 << 10
    _client.WINDOW = 1  # one write in flight: the rest go out after the pause
    rng = np.random.default_rng(seed)
    tables = [rng.integers(0, 256, head_bytes, dtype=np.uint8) for _ in range(heads)]
    paused = []

    def progress(done: int) -> None:
        if not paused:
            paused.append(done)
            print("PAUSED", flush=True)
            sys.stdin.readline()

    with DistributedStore.connect(master, timeout_ms=10_000, local_direct=path == "direct") as store:
        try:
            store.batch_put_from([f"{prefix}{h}" for h in range(heads)], tables, progress=progress)
        except EngramError as exc:
            print(f"FAILED {type(exc).__name__}: {exc}", flush=True)
            return 1
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
