"""engram_model: Engram-style n-gram embedding layers in NumPy, their tables in the store, one package per model
family over a shared ground.

The families, each a package with the same inner layout (``_config``, ``_hasher``, ``_kernels``, ``_checkpoint``,
``_layer``, and where the family has them ``_fp8``, ``_rows``, ``_sizing``, ``_toy``, ``demo``, ``load``; each
package's ``warmup()`` compiles its kernels):

    engram_model.demo   DeepSeek's demo architecture (``engram_demo_v1.py``), bit-exact: ``Engram`` and its hash
    engram_model.v41    DeepSeek-V4.1's Engram: its hash, FP8 rows with e8m0 scales, gate, checkpoint loading
    engram_model.ple    Qwen4-Exp's PLE tables (Qwen/Qwen3.8-Flash-Next): hash, rows, forward, loading

The shared ground, at this package's top: how a family's rows are stored (``RowFormat``, ``decode_rows``), the
rows' gathers into the engines' buffers (``_rows_gather``), checkpoint files (``_checkpoint_files``,
``_safetensors``, ``_table_load``), the n-gram hashes' common pieces (``_ngram``), the sizing replay
(``_replay``) and the compressed tokenizer; the console scripts ``engram-load``, ``engram-stats`` and
``engram-warmup``.

Public surface (the demo architecture's names are exported here too: ``from engram_model import Engram``)::

    RowFormat, decode_rows         how a model family's table rows are stored (codes, block / table / no scales),
                                   shared by DeepSeek-V4.1's and Qwen4-Exp's tables; rows without block scales decoded
    CompressedTokenizer            token ids -> ids of normalised token texts
    EngramConfig, BackboneConfig, NgramHashMapping, IncrementalHasher, Engram, EngramPrefetch, prefetch_layers,
    EngramModule(Config), the checkpoint and FP8 helpers      engram_model.demo's (see there)

Quick start: ``engram-demo``; V4.1: ``python -m engram_model.v41.demo``.
"""

from ._rows_format import RowFormat, decode_rows
from ._tokenizer import CompressedTokenizer
from .demo import (FP8_ROWS_F32_SCALES, BackboneConfig, Engram, EngramConfig, EngramModule, EngramModuleConfig,
                   EngramPrefetch, FP8RowFormatF32Scales, IncrementalHasher, NgramHashMapping,
                   dequantize_fp8_rows_f32_scales, get_hash_mapping, load_checkpoint, load_safetensors,
                   prefetch_layers, quantize_fp8_rows_f32_scales, save_checkpoint, save_safetensors,
                   split_embedding_table)

__all__ = [
    "FP8_ROWS_F32_SCALES",
    "BackboneConfig",
    "CompressedTokenizer",
    "Engram",
    "EngramConfig",
    "EngramModule",
    "EngramModuleConfig",
    "EngramPrefetch",
    "FP8RowFormatF32Scales",
    "IncrementalHasher",
    "NgramHashMapping",
    "RowFormat",
    "decode_rows",
    "dequantize_fp8_rows_f32_scales",
    "get_hash_mapping",
    "load_checkpoint",
    "load_safetensors",
    "prefetch_layers",
    "quantize_fp8_rows_f32_scales",
    "save_checkpoint",
    "save_safetensors",
    "split_embedding_table",
]
