"""A toy Qwen4-Exp checkpoint: the released file layout and dtypes, any (small) PLEConfig, random valid values.

For trying the loading path (``engram-load``, :func:`engram_model.ple.load_ple_table`) and the forward without the
102 GB release: ``config.json`` with its fields under ``text_config``, and every PLE tensor under the release's
names (``model.language_model.layers.{L - 1}.ple.``): the table cut into ``split_ngram_parts`` contiguous row
ranges (``ngram_embedding.shard_{k}.weight``, ``ceil(rows / parts)`` rows each but the last, crossing head
boundaries), ``weight_scale`` for FP8 tables, the hash buffers, the projections, norms and convolution, spread
over safetensors files with an index as the release is.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from engram_store.durable import write_replacing
from .._safetensors import write_safetensors
from ._config import PLEConfig

#: Tensors of the ``ple_embedding`` module that are not the table (transformers' buffers).
BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


def _bf16(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    """bf16 bit patterns of normal values times ``scale``, rounded to nearest even."""
    bits = (rng.standard_normal(shape) * scale).astype(np.float32).view(np.uint32).astype(np.uint64)
    return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF).astype(np.uint16)


def toy_tensors(config: PLEConfig, seed: int = 0) -> dict[str, tuple[str, np.ndarray]]:
    """Every PLE tensor of ``config``'s layers under the release's names: ``{name: (safetensors dtype, raw
    values)}`` (bf16 as uint16 bits, float8 as uint8 codes, never a NaN)."""
    rng = np.random.default_rng(seed)
    hc_hidden, E, fmt = config.hc_count * config.hidden_size, config.ple_embed_dim, config.row_format
    tensors: dict[str, tuple[str, np.ndarray]] = {}
    for layer_id in config.ple_layer_ids:
        base = f"model.language_model.layers.{layer_id - 1}.ple."
        rows, parts = config.num_embeddings(layer_id), config.split_ngram_parts
        if fmt.codes == "bf16":
            table = ("BF16", _bf16(rng, (rows, fmt.values), 0.5))
        else:  # e4m3 codes: clearing bit 3 keeps them off the NaN codes 0x7F and 0xFF
            table = ("F8_E4M3", rng.integers(0, 256, size=(rows, fmt.values), dtype=np.uint8) & 0xF7)
        per = -(-rows // parts)
        for k in range(-(-rows // per)):
            shard = table[1][k * per:(k + 1) * per]
            tensors[f"{base}ple_embedding.ngram_embedding.shard_{k}.weight"] = (table[0], shard)
        if fmt.scale == "table":
            tensors[f"{base}ple_embedding.ngram_embedding.weight_scale"] = (
                "F32", np.array([rng.uniform(0.01, 0.1)], dtype=np.float32))
        hashing = config.hash_buffers(layer_id)
        for name, values in zip(BUFFERS, (hashing.multipliers, hashing.sizes, hashing.offsets)):
            tensors[f"{base}ple_embedding.{name}"] = ("I64", np.array(values, dtype=np.int64))
        tensors[base + "key_proj.weight"] = ("BF16", _bf16(rng, (hc_hidden, E), E ** -0.5))
        tensors[base + "value_proj.weight"] = ("BF16", _bf16(rng, (config.hidden_size, E), E ** -0.5))
        for norm in ("norm_key", "norm_query", "norm_conv"):
            tensors[f"{base}{norm}.weight"] = ("BF16", _bf16(rng, (hc_hidden,), 0.1))
        tensors[base + "conv1d.weight"] = ("BF16", _bf16(rng, (hc_hidden, 1, config.ple_conv_kernel_size), 0.5))
    return tensors


def hf_config(config: PLEConfig) -> dict[str, Any]:
    """``config.json`` of ``config`` as the release writes it: the text fields under ``text_config``."""
    text = {"model_type": "qwen4_exp_text", "ple_layer_ids": list(config.ple_layer_ids),
            "hidden_size": config.hidden_size, "hc_count": config.hc_count, "ple_embed_dim": config.ple_embed_dim,
            "ple_conv_kernel_size": config.ple_conv_kernel_size, "ngram_size": config.ngram_size,
            "heads_per_ngram": config.heads_per_ngram, "ngram_vocab_size_base": config.ngram_vocab_size_base,
            "make_ngram_vocab_size_divisible_by": config.make_ngram_vocab_size_divisible_by,
            "split_ngram_parts": config.split_ngram_parts, "seed": config.seed, "vocab_size": config.vocab_size,
            "eos_token_id": config.eos_token_id, "rms_norm_eps": config.rms_norm_eps,
            "num_hidden_layers": max(config.ple_layer_ids)}
    if config.ple_embedding_dtype != "bfloat16":
        text["ple_embedding_dtype"] = config.ple_embedding_dtype
    return {"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp", "text_config": text}


def write_toy_checkpoint(directory: str | os.PathLike, config: PLEConfig, seed: int = 0, files: int = 2) -> str:
    """Write ``config.json`` and ``config``'s PLE tensors (:func:`toy_tensors`) over ``files`` safetensors files
    with a ``model.safetensors.index.json`` into ``directory`` (created if missing); returns its path."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    tensors = toy_tensors(config, seed)
    names = [f"model-{i + 1:05d}-of-{files:05d}.safetensors" for i in range(files)]
    parts: list[dict[str, tuple[str, np.ndarray]]] = [{} for _ in names]
    for i, (name, value) in enumerate(tensors.items()):
        parts[i * files // len(tensors)][name] = value
    for file, part in zip(names, parts):
        write_safetensors(os.path.join(directory, file), part)
    weight_map = {name: file for file, part in zip(names, parts) for name in part}
    index = json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1).encode()
    write_replacing(os.path.join(directory, "model.safetensors.index.json"), lambda f: f.write(index),
                    "write_toy_checkpoint")
    text = json.dumps(hf_config(config), indent=1).encode()
    write_replacing(os.path.join(directory, "config.json"), lambda f: f.write(text), "write_toy_checkpoint")
    return directory
