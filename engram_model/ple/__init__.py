"""engram_model.ple: Qwen4-Exp's PLE tables (Qwen/Qwen3.8-Flash-Next: hash, rows, forward), in the store.

Public surface::

    PLEConfig                        geometry: prime head sizes, offsets, padded rows, SplitMix64 multipliers, row
                                     format (bf16, or e4m3 with one scale per table); from_hf()
    PLEHashBuffers                   one layer's multipliers, head sizes and offsets (the config's, or a checkpoint's)
    ple_store_config                 a layer's EngramStore layout: a head per hash head, 160-value rows
    PLEHasher, PLEHashState          token ids -> rows of every PLE layer's table in one pass (EOS resets, an EOS
                                     start, a context of ngram_size - 1 tokens); begin/step/copy for decode,
                                     step_ragged/commit/reset for continuous batching (requests in slots, drafts)
    PLELayer, PLEConvState           one layer's forward in NumPy (grouped (1 + w) norms, the per-stream gate, the
                                     dilated short convolution with per-request state); rows() reads its table
    PLERows, RowsHandle, BoundRows   a layer's rows for the serving engines, bit for bit in their conventions
                                     (vLLM's raw rows of a rank's row range, SGLang's bf16 gather), from any table;
                                     bind() checks a decode step's buffer once
    ple_rank_rows, RankRows          a tensor-parallel rank's contiguous rows as the engines cut the table
    load_ple_table, open_ple_table   a layer's table streamed from the checkpoint's row-range shards into a store,
                                     a disk_dir or a local_dir (re-sliced into heads)
    load_ple_weights                 a layer's projections, norms, convolution and table scale (float32)
    load_ple_hash_buffers            the checkpoint's hash buffers, which take precedence over the config's
    write_toy_checkpoint             a small checkpoint in the released layout (bf16 or FP8)
    replay_tokens, sizing_geometry   a corpus hashed and replayed into a hit-rate curve (engram-stats --ple)
    warmup                           compile the family's kernels (engram-warmup)

Loading a checkpoint: ``engram-load`` (the family from config.json). Sizing a hot-row cache: ``engram-stats --ple``.
Serving: PLERows is the call an engine's PLE embedding makes per step; the engine plugins do not make it yet
(docs/ple.md, "Serving", says where it goes in each engine).
"""

from ._checkpoint import load_ple_hash_buffers, load_ple_table, load_ple_weights, open_ple_table
from ._config import PLEConfig, PLEHashBuffers, ple_store_config
from ._hasher import PLEHasher, PLEHashState
from ._layer import PLEConvState, PLELayer
from ._rows import BoundRows, PLERows, RankRows, RowsHandle, ple_rank_rows
from ._sizing import replay_tokens, sizing_geometry
from ._toy import write_toy_checkpoint
from ._warmup import warmup

__all__ = [
    "BoundRows",
    "PLEConfig",
    "PLEConvState",
    "PLEHashBuffers",
    "PLEHashState",
    "PLEHasher",
    "PLELayer",
    "PLERows",
    "RankRows",
    "RowsHandle",
    "load_ple_hash_buffers",
    "load_ple_table",
    "load_ple_weights",
    "open_ple_table",
    "ple_rank_rows",
    "ple_store_config",
    "replay_tokens",
    "sizing_geometry",
    "warmup",
    "write_toy_checkpoint",
]
