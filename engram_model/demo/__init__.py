"""engram_model.demo: DeepSeek's demo architecture (``engram_demo_v1.py``) in NumPy, bit-exact, its tables in the
store.

Public surface::

    EngramConfig, BackboneConfig   hashing/table geometry and the backbone it sits in
    NgramHashMapping               token ids -> per-head table rows (Numba), prime table sizes, multipliers
    IncrementalHasher              per-request n-gram context for decode steps (rollback, export/import)
    dequantize_fp8_rows_f32_scales FP8 (e4m3fn) rows with float32 block scales (not DeepSeek-V4.1's rows:
    quantize_fp8_rows_f32_scales   those have e8m0 scales per 32 values, see engram_model.v41)
    Engram                         one layer: tables in an EngramStore, gate, short convolution, weights I/O
                                   (also Mooncake's first Engram API: forward, query, populate_store_from_buffers)
    EngramPrefetch                 a background row read, accepted by ``Engram.forward(prefetched=...)``
    prefetch_layers                hash once for several layers and start all their reads
    EngramModule(Config)           the same layer for a single residual stream ``[B, L, hidden_dim]``
    save_checkpoint, load_checkpoint, save_safetensors, load_safetensors, split_embedding_table
    warmup                         compile the family's kernels (``engram-warmup``)

:mod:`engram_model` exports these names too. The quick start is ``engram-demo`` (``demo.py``); a model that
prefetches its Engram layers' rows is ``python -m engram_model.demo.example``.
"""

from ._checkpoint import load_checkpoint, load_safetensors, save_checkpoint, save_safetensors
from ._config import BackboneConfig, EngramConfig
from ._fp8 import (FP8_ROWS_F32_SCALES, FP8RowFormatF32Scales, dequantize_fp8_rows_f32_scales,
                   quantize_fp8_rows_f32_scales)
from ._hasher import NgramHashMapping, get_hash_mapping
from ._incremental import IncrementalHasher
from ._layer import Engram, EngramPrefetch, prefetch_layers, split_embedding_table
from ._module import EngramModule, EngramModuleConfig
from ._warmup import warmup

__all__ = [
    "FP8_ROWS_F32_SCALES",
    "BackboneConfig",
    "Engram",
    "EngramConfig",
    "EngramModule",
    "EngramModuleConfig",
    "EngramPrefetch",
    "FP8RowFormatF32Scales",
    "IncrementalHasher",
    "NgramHashMapping",
    "dequantize_fp8_rows_f32_scales",
    "get_hash_mapping",
    "load_checkpoint",
    "load_safetensors",
    "prefetch_layers",
    "quantize_fp8_rows_f32_scales",
    "save_checkpoint",
    "save_safetensors",
    "split_embedding_table",
    "warmup",
]
