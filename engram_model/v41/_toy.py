"""A toy DeepSeek-V4.1 checkpoint: the released file layout and dtypes, any (small) config, random valid values.

For trying the loading path (``engram-load-v41``, :meth:`V41Engram.from_checkpoint`) without the 200 GB release.
"""

from __future__ import annotations

import json
import os

import numpy as np

from engram_store.durable import write_replacing

from .._safetensors import write_safetensors
from ._config import FP8_BLOCK, V41Config


def write_toy_checkpoint(directory: str | os.PathLike, config: V41Config, seed: int = 0) -> str:
    """Write ``config.json`` (fields under ``text_config``, as released) and ``model.safetensors`` holding every
    Engram tensor of ``config``'s layers (``F8_E4M3`` codes, ``F8_E8M0`` scales, ``BF16`` gate weights) into
    ``directory`` (created if missing); returns its path."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    hc, D, K = config.hc_mult, config.hidden_size, config.cols * config.head_dim

    def codes(shape):  # e4m3 codes, never a NaN (0x7F, 0xFF): clearing bit 3 keeps them finite
        return rng.integers(0, 256, size=shape, dtype=np.uint8) & 0xF7

    def bf16(shape):
        return (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)

    tensors = {}
    for layer_id in config.layer_ids:
        rows, base = config.num_embeddings(layer_id), f"layers.{layer_id}.engram."
        tensors[base + "embed.weight"] = ("F8_E4M3", codes((rows, config.head_dim)))
        tensors[base + "embed.scale"] = ("F8_E8M0", rng.integers(115, 135, (rows, config.head_dim // FP8_BLOCK),
                                                                 dtype=np.uint8))
        tensors[base + "wkv.weight"] = ("F8_E4M3", codes(((hc + 1) * D, K)))
        tensors[base + "wkv.scale"] = ("F8_E8M0", rng.integers(118, 124, ((hc + 1) * D // FP8_BLOCK, K // FP8_BLOCK),
                                                               dtype=np.uint8))
        tensors[base + "q_weight"] = ("BF16", bf16((hc, D)))
        tensors[base + "k_weight"] = ("BF16", bf16((hc, D)))
    write_safetensors(os.path.join(directory, "model.safetensors"), tensors)
    text = {"engram_layer_ids": list(config.layer_ids), "engram_max_ngram_size": config.max_ngram_size,
            "engram_n_heads": config.n_heads, "engram_head_dim": config.head_dim,
            "engram_vocab_size": config.engram_vocab_size, "engram_compressed_vocab_size": config.compressed_vocab_size,
            "engram_pad_token_id": config.pad_id, "hidden_size": config.hidden_size, "hc_mult": config.hc_mult,
            "rms_norm_eps": config.rms_norm_eps,
            "engram_num_embeddings": [config.num_embeddings(layer_id) for layer_id in config.layer_ids]}
    write_replacing(os.path.join(directory, "config.json"),
                    lambda f: f.write(json.dumps({"text_config": text}, indent=1).encode()), "write_toy_checkpoint")
    return directory


