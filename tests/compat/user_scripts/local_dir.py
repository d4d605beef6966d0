"""A user's script for Mooncake's byte-row EngramStore with tables owned under local_dir (no store)."""
import os
import sys

import numpy as np
from mooncake.store import EngramStore, EngramStoreConfig, ReplicateConfig, MooncakeDistributedStore  # noqa: F401

local_dir = sys.argv[1]
cfg = EngramStoreConfig()
cfg.table_vocab_sizes = [17, 19, 23, 29]
cfg.row_bytes = 264
layers = {1: cfg, 14: cfg}

writer = EngramStore(layers, local_dir=local_dir)
reader = EngramStore(layers, local_dir=local_dir)
row_ids = np.array([[[16, 18, 22, 28]]], dtype=np.int64)
output = np.empty((1, 1, 4, 264), dtype=np.uint8)
try:
    reader.lookup_into(1, row_ids, output)
    raise AssertionError("an unpublished layer was looked up")
except RuntimeError:
    pass

arrays = [(np.arange(n * 264).reshape(n, 264) + 37 * h).astype(np.uint8) for h, n in enumerate(cfg.table_vocab_sizes)]
expected = [a.copy() for a in arrays]
writer.populate(1, arrays)
for array in arrays:
    array.fill(0)  # populate copied them
del arrays

for handle in (reader, EngramStore({1: cfg}, local_dir=local_dir)):
    handle.lookup_into(1, row_ids, output)
    for h in range(4):
        assert np.array_equal(output[0, 0, h], expected[h][row_ids[0, 0, h]])
try:
    writer.populate(1, expected)
    raise AssertionError("a published layer was populated twice")
except RuntimeError:
    pass
try:
    writer.remove_from_store(1)
    raise AssertionError("remove_from_store removed local files")
except RuntimeError as exc:
    removed = str(exc).split(":")[0]
print(f"published={sorted(os.listdir(local_dir))} remove={removed}")
