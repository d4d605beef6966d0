"""A worker process of the host-cache tests: opens an EngramStore on a disk_dir with a host row cache and checks
every lookup against NumPy indexing of the tables (rebuilt here from the seed that wrote them).

    python host_cache_worker.py DISK_DIR CACHE_BYTES TABLE_SEED SCHEDULE_SEED STEPS [--wait-file PATH]

Prints ``ok <hits> <misses>`` and exits 0 when every row matched; exits 1 naming the first wrong row. With
``ENGRAM_TEST_DIE_MID_FILL`` set, the first fill that reaches that insertion kills the process (SIGKILL).
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from disk_helpers import make_tables  # noqa: E402

from engram_store import EngramStore, EngramStoreConfig  # noqa: E402

SIZES = [97, 40, 300]
ROW_BYTES = 24
LAYER = 3


def config() -> EngramStoreConfig:
    return EngramStoreConfig(SIZES, ROW_BYTES, row_format="bytes")


def tables(seed: int) -> list[np.ndarray]:
    return make_tables(np.random.default_rng(seed), SIZES, ROW_BYTES)


def main() -> int:
    disk_dir, cache_bytes, table_seed, schedule_seed, steps = sys.argv[1:6]
    wait_file = sys.argv[7] if len(sys.argv) > 7 and sys.argv[6] == "--wait-file" else None
    want_tables = tables(int(table_seed))
    rng = np.random.default_rng(int(schedule_seed))
    with EngramStore(LAYER, config(), disk_dir=disk_dir, row_cache_bytes=int(cache_bytes),
                     cache_scope="host") as store:
        if wait_file:  # start together with the other workers: the interleavings are the point
            deadline = time.monotonic() + 30
            while not os.path.exists(wait_file) and time.monotonic() < deadline:
                time.sleep(0.005)
        for step in range(int(steps)):
            B, L = int(rng.integers(1, 4)), int(rng.integers(1, 12))
            hot = int(rng.integers(2, 60))  # a few hot rows and some cold ones: hits, misses and evictions
            ids = np.stack([rng.integers(0, min(n, hot) if rng.random() < 0.7 else n, (B, L)) for n in SIZES],
                           axis=-1).astype(np.int64)
            got = store.lookup(ids)
            want = np.stack([want_tables[h][ids[..., h]] for h in range(len(SIZES))], axis=-2)
            if not np.array_equal(got, want):
                b, l, h = np.argwhere((got != want).any(-1))[0]
                print(f"wrong row at step {step}: ids[{b}, {l}, {h}] = {ids[b, l, h]}", flush=True)
                return 1
        s = store.stats()
        print(f"ok {s['cache_hits']} {s['cache_misses']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
