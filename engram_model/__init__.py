"""engram_model: the Engram layer in NumPy, bit-exact with DeepSeek's ``engram_demo_v1.py``, tables in the store.

Public surface::

    EngramConfig, BackboneConfig   hashing/table geometry and the backbone it sits in
    CompressedTokenizer            token ids -> ids of normalised token texts
    NgramHashMapping               token ids -> per-head table rows (Numba), prime table sizes, multipliers
    IncrementalHasher              per-request n-gram context for decode steps (rollback, export/import)
    dequantize_fp8_rows, ...       FP8 (e4m3fn) rows with float32 block scales, as DeepSeek stores them
    Engram                         one layer: tables in an EngramStore, gate, short convolution, weights I/O
                                   (also Mooncake's first Engram API: forward, query, populate_store_from_buffers)
    EngramPrefetch                 a background row read, accepted by ``Engram.forward(prefetched=...)``
    prefetch_layers                hash once for several layers and start all their reads
    EngramModule(Config)           the same layer for a single residual stream ``[B, L, hidden_dim]``
    save_checkpoint, load_checkpoint, save_safetensors, load_safetensors, split_embedding_table

Quick start: ``engram-demo`` (or ``python -m engram_model.demo``).
"""

from ._checkpoint import load_checkpoint, load_safetensors, save_checkpoint, save_safetensors
from ._config import BackboneConfig, EngramConfig
from ._engram import Engram, EngramPrefetch, prefetch_layers, split_embedding_table
from ._fp8 import DEEPSEEK_FP8_ROWS, FP8RowFormat, dequantize_fp8_rows, quantize_fp8_rows
from ._hashing import NgramHashMapping, get_hash_mapping
from ._incremental import IncrementalHasher
from ._module import EngramModule, EngramModuleConfig
from ._tokenizer import CompressedTokenizer

__all__ = [
    "DEEPSEEK_FP8_ROWS",
    "BackboneConfig",
    "CompressedTokenizer",
    "Engram",
    "EngramConfig",
    "EngramModule",
    "EngramModuleConfig",
    "EngramPrefetch",
    "FP8RowFormat",
    "IncrementalHasher",
    "NgramHashMapping",
    "dequantize_fp8_rows",
    "get_hash_mapping",
    "load_checkpoint",
    "load_safetensors",
    "prefetch_layers",
    "quantize_fp8_rows",
    "save_checkpoint",
    "save_safetensors",
    "split_embedding_table",
]
