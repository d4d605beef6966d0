"""A user's script for Mooncake's multi-layer byte-row EngramStore with store= (registered outputs)."""
import sys

import numpy as np
from mooncake.store import EngramStore, EngramStoreConfig, ReplicateConfig, MooncakeDistributedStore

ROW_BYTES = 264  # 256 FP8 values and 8 E8M0 scales per row

master_address = sys.argv[1]
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 64 * 1024 * 1024, 16 * 1024 * 1024, "tcp", "", master_address)
if rc != 0:
    raise SystemExit(f"setup failed: {rc}")

configs = {}
for layer_id, sizes in ((1, [17, 19, 23, 29]), (14, [7, 11])):
    cfg = EngramStoreConfig()
    cfg.table_vocab_sizes = sizes
    cfg.row_bytes = ROW_BYTES
    configs[layer_id] = cfg
table = EngramStore(layers=configs, store=store)

rng = np.random.default_rng(0)
tables = {}
replica = ReplicateConfig()
replica.with_hard_pin = True
for layer_id in table.get_layer_ids():
    tables[layer_id] = [rng.integers(0, 256, (n, ROW_BYTES), dtype=np.uint8)
                        for n in table.get_table_vocab_sizes(layer_id)]
    table.populate(layer_id, tables[layer_id], replica)

B, L = 2, 8
for layer_id in table.get_layer_ids():
    heads = table.get_num_heads(layer_id)
    row_ids = np.stack([rng.integers(0, n, (B, L)) for n in table.get_table_vocab_sizes(layer_id)],
                       axis=-1).astype(np.int64)
    output = np.empty((B, L, heads, ROW_BYTES), dtype=np.uint8)
    store.register_buffer(output.ctypes.data, output.nbytes)
    try:
        for _ in range(3):
            table.lookup_into(layer_id, row_ids, output)
            for h in range(heads):
                assert np.array_equal(output[:, :, h], tables[layer_id][h][row_ids[:, :, h]])
        bad = row_ids.copy()
        bad[1, 7, heads - 1] = -1
        try:
            table.lookup_into(layer_id, bad, output)
            raise AssertionError("row id -1 was looked up")
        except RuntimeError:
            assert not output.any()
    finally:
        store.unregister_buffer(output.ctypes.data)

removed = [table.remove_from_store(layer_id, force=True) for layer_id in table.get_layer_ids()]
left = [store.is_exist(key) for layer_id in table.get_layer_ids() for key in table.get_store_keys(layer_id)]
print(f"layers={table.get_layer_ids()} removed={removed} left={sum(left)}")
del table
store.close()
