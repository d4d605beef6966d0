"""engram_model.v41: DeepSeek-V4.1's Engram (hash, FP8 table rows, gate), its tables in the store.

Public surface::

    V41Config                        geometry: primes, column offsets, multipliers, row bytes; from_hf_config()
    build_token_map                  tokenizer -> compressed ids; save_token_map / load_token_map / check_token_map
    V41Hasher, V41HashState          token ids -> rows of every layer's table in one pass; begin/step/copy for decode
                                     step_ragged/commit/reset for continuous batching (requests in slots, drafts)
    decode_fp8_rows, encode_fp8_rows packed FP8 rows (e4m3 + an e8m0 scale per 32 values) <-> bf16-exact float32
    V41Engram, V41Prefetch           one layer: the FP8 table in an EngramStore (v41_store_config), rows gathered
                                     and decoded in one kernel, the gate; prefetch() reads in the background
    V41Rows, RowsHandle              a layer's rows for a serving engine, in SGLang's and vLLM's conventions (global
                                     ids, -1 padding), into the engine's own buffers: bf16, packed or split
    V41Engram.from_checkpoint        a layer from safetensors shards, its table streamed into the store
    load_v41_weights, load_v41_table the same in parts; SafetensorsCheckpoint reads F8/BF16 tensors (pread)
    hit_rate_by_order, order_labels  a disk_dir EngramStore's stats() curves by n-gram order; metrics labelled so
    replay_tokens                    a corpus hashed and replayed into a hit-rate curve (engram-stats --v41)
    write_toy_checkpoint             a small checkpoint in the released layout
    warmup                           compile the family's kernels (engram-warmup)

Demo: ``python -m engram_model.v41.demo``. Loading a checkpoint into a running store: ``engram-load-v41``.
"""

from ._checkpoint import SafetensorsCheckpoint, load_v41_table, load_v41_weights, open_v41_table
from ._config import V41Config, v41_store_config
from ._layer import V41Engram, V41Prefetch
from ._fp8 import decode_fp8_rows, encode_fp8_rows
from ._hasher import V41Hasher, V41HashState
from ._rows import BoundRows, RowsHandle, V41Rows
from ._sizing import hit_rate_by_order, order_labels, replay_tokens
from ._tokens import build_token_map, check_token_map, load_token_map, save_token_map
from ._toy import write_toy_checkpoint
from ._warmup import warmup

__all__ = [
    "BoundRows",
    "SafetensorsCheckpoint",
    "V41Config",
    "V41Engram",
    "V41HashState",
    "V41Hasher",
    "V41Prefetch",
    "V41Rows",
    "RowsHandle",
    "build_token_map",
    "check_token_map",
    "decode_fp8_rows",
    "encode_fp8_rows",
    "hit_rate_by_order",
    "order_labels",
    "load_token_map",
    "load_v41_table",
    "open_v41_table",
    "replay_tokens",
    "load_v41_weights",
    "save_token_map",
    "v41_store_config",
    "warmup",
    "write_toy_checkpoint",
]
