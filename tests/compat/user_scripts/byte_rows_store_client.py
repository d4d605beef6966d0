"""A user's script for Mooncake's later byte-row EngramStore: store_client=, lookup_many_into, packed lookup."""
import sys

import numpy as np
from mooncake.store import EngramStore, EngramStoreConfig, ReplicateConfig, MooncakeDistributedStore  # noqa: F401

ROW_BYTES = 264

master_address = sys.argv[1]
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 64 * 1024 * 1024, 16 * 1024 * 1024, "tcp", "", master_address)
if rc != 0:
    raise SystemExit(f"setup failed: {rc}")


def config(sizes):
    cfg = EngramStoreConfig()
    cfg.table_vocab_sizes = sizes
    cfg.row_bytes = ROW_BYTES
    return cfg


layers = {2: config([17, 19, 23, 29]), 15: config([31, 37, 41, 43]), 20: config([17]), 21: config([19])}
table = EngramStore(layers, store_client=store)
rng = np.random.default_rng(1)
tables = {layer_id: [rng.integers(0, 256, (n, ROW_BYTES), dtype=np.uint8) for n in cfg.table_vocab_sizes]
          for layer_id, cfg in layers.items()}
for layer_id in table.get_layer_ids():
    table.populate(layer_id, tables[layer_id])

# Both Engram layers of a step in one call.
layer_ids = [2, 15]
row_ids = [np.stack([rng.integers(0, n, (4, 16)) for n in table.get_table_vocab_sizes(layer_id)],
                    axis=-1).astype(np.int64) for layer_id in layer_ids]
outputs = [np.empty(ids.shape + (ROW_BYTES,), dtype=np.uint8) for ids in row_ids]
table.lookup_many_into(layer_ids, row_ids, outputs)
for layer_id, ids, output in zip(layer_ids, row_ids, outputs):
    for h in range(table.get_num_heads(layer_id)):
        assert np.array_equal(output[:, :, h], tables[layer_id][h][ids[:, :, h]])

# Packed lookup of single-head tables; -1 leaves a row as it is.
tokens = 6
packed_ids = np.stack([rng.integers(0, 17, tokens), rng.integers(0, 19, tokens)]).astype(np.int64)
packed_ids[0, 2] = -1
packed = np.full((2, tokens, ROW_BYTES), 253, dtype=np.uint8)
table.lookup([20, 21], packed_ids, packed)
assert (packed[0, 2] == 253).all()
assert np.array_equal(packed[1], tables[21][0][packed_ids[1]])

removed = {layer_id: table.remove_from_store(layer_id, force=True) for layer_id in table.get_layer_ids()}
print(f"removed={removed}")
del table
store.close()
