"""One of several processes racing to publish layer 1 under the same local_dir: exit 0 if it won, 3 if not."""
import sys

import numpy as np
from mooncake.store import EngramStore, EngramStoreConfig, ReplicateConfig, MooncakeDistributedStore  # noqa: F401

local_dir, fill = sys.argv[1], int(sys.argv[2])
cfg = EngramStoreConfig()
cfg.table_vocab_sizes = [17, 19, 23, 29]
cfg.row_bytes = 264
table = EngramStore({1: cfg}, local_dir=local_dir)
arrays = [np.full((n, 264), fill, dtype=np.uint8) for n in cfg.table_vocab_sizes]

print("ready", flush=True)
sys.stdin.readline()  # the start signal: every writer is built before any populates
try:
    table.populate(1, arrays)
except RuntimeError as exc:
    print(f"lost: {exc}", flush=True)
    sys.exit(3)
print("won", flush=True)
