"""A user's script for Mooncake's byte-row EngramStore reading the caller's own tables (bind_local, no store)."""
import gc
import weakref

import numpy as np
from mooncake.store import EngramStore, EngramStoreConfig, ReplicateConfig, MooncakeDistributedStore  # noqa: F401

cfg = EngramStoreConfig()
cfg.table_vocab_sizes = [17, 19, 23, 29]
cfg.row_bytes = 264
table = EngramStore({1: cfg, 14: cfg})

arrays = [(np.arange(n * 264).reshape(n, 264) + 37 * h).astype(np.uint8) for h, n in enumerate(cfg.table_vocab_sizes)]
expected = [a.copy() for a in arrays]
for array in arrays:
    array.flags.writeable = False
refs = [weakref.ref(array) for array in arrays]
table.bind_local(1, arrays)
del arrays, array
gc.collect()
assert all(ref() is not None for ref in refs), "bind_local must retain the arrays"

row_ids = np.array([[[16, 18, 22, 28], [0, 1, 2, 3]]], dtype=np.int64)
output = np.empty((1, 2, 4, 264), dtype=np.uint8)
table.lookup_into(1, row_ids, output)
for h in range(4):
    assert np.array_equal(output[:, :, h], expected[h][row_ids[:, :, h]])
try:
    table.lookup_into(14, row_ids, output)
    raise AssertionError("an unbound layer was looked up")
except RuntimeError:
    pass
try:
    table.lookup_into(1, np.array([[[17, 0, 0, 0]]], dtype=np.int64), output[:, :1])
    raise AssertionError("an out-of-range row id was looked up")
except RuntimeError:
    assert not output[:, :1].any()

del table
gc.collect()
print(f"released={all(ref() is None for ref in refs)}")
