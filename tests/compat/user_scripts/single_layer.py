"""A user's script for Mooncake's single-layer EngramStore (float32 rows): populate, lookup, remove."""
import sys

import numpy as np
from mooncake.store import EngramStore, EngramStoreConfig, ReplicateConfig, MooncakeDistributedStore  # noqa: F401

master_address = sys.argv[1]
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 64 * 1024 * 1024, 16 * 1024 * 1024, "tcp", "", master_address)
if rc != 0:
    raise SystemExit(f"setup failed: {rc}")

config = EngramStoreConfig()
config.table_vocab_sizes = [17, 19, 23, 29]
config.embedding_dim = 8
engram_store = EngramStore(layer_id=3, config=config, store=store)
print("keys:", engram_store.get_store_keys())

rng = np.random.default_rng(0)
tables = [rng.standard_normal((n, config.embedding_dim)) for n in engram_store.get_table_vocab_sizes()]  # float64
engram_store.populate(tables)

row_ids = [[[0, 1, 2, 3], [16, 18, 22, 28]], [[5, 5, 5, 5], [1, 2, 3, 4]]]
embeddings = engram_store.lookup(row_ids)
ids = np.array(row_ids)
for h in range(engram_store.get_num_heads()):
    assert np.array_equal(embeddings[:, :, h], tables[h][ids[:, :, h]].astype(np.float32))
assert np.array_equal(engram_store.lookup(ids), embeddings)

try:
    engram_store.populate(tables)
    raise AssertionError("a second populate of the same layer succeeded")
except RuntimeError:
    pass
try:
    engram_store.lookup([[[0, 0, 0, 999]]])
    raise AssertionError("an out-of-range row id was looked up")
except RuntimeError:
    pass

removed = engram_store.remove_from_store(force=True)
left = [store.is_exist(key) for key in engram_store.get_store_keys()]
print(f"shape={embeddings.shape} dtype={embeddings.dtype} checksum={float(embeddings.sum()):.4f} "
      f"removed={removed} again={engram_store.remove_from_store(force=True)} left={left}")
del engram_store
store.close()
