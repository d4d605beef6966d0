"""V41Config: the Engram geometry of DeepSeek-V4.1, and the layout derived from it (primes, offsets, multipliers).

Follows DeepSeek's V4.1 inference code (``inference/engram.py``) and the fields of the released ``config.json``
(under ``text_config``). Everything here is derived from the config alone: the prime table sizes (unique across
all Engram layers, searched upwards from ``engram_vocab_size``), each layer's column offsets inside its one table,
and the hash multipliers (a fixed seed, ``10007 * layer_id``). The token map, which also shapes the hash, comes
from the tokenizer (:mod:`engram_model.v41._tokens`).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from engram_store import EngramStoreConfig
from engram_store.errors import ConfigError, InvalidArgument, InvalidType, describe, is_int

from .._checkpoint_files import read_json
from .._ngram import find_next_prime
from .._rows_format import RowFormat

#: Spreads the multiplier seeds of different layers apart (the reference seeds ``10007 * layer_id``, no base seed).
LAYER_SEED_STRIDE = 10007
#: Values per e8m0 scale byte in a table row: a row is head_dim e4m3 bytes, then head_dim // 32 scale bytes.
FP8_BLOCK = 32
_INT64_MAX = int(np.iinfo(np.int64).max)


def _int(name: str, value: Any, minimum: int) -> int:
    if not is_int(value) or value < minimum:
        raise ConfigError(f"{name}: expected an integer >= {minimum}, got {describe(value)}")
    return int(value)


@dataclass(frozen=True)
class V41Config:
    """Engram geometry of a DeepSeek-V4.1 model; the defaults are the released model's (whose layer_ids are [1, 14]).

    Frozen and hashable, so the layout derived from it (primes take a few milliseconds) is cached per config.
    """

    # 0-based decoder layers that carry an Engram. Primes are unique across all of them, in this order, so the
    # list matters even to a single layer.
    layer_ids: tuple[int, ...]
    # N-gram orders 2..max_ngram_size; each order has n_heads hash heads, one table column each.
    max_ngram_size: int = 4
    n_heads: int = 8
    # Values per table row; a multiple of 32 (one e8m0 scale byte per 32 values).
    head_dim: int = 256
    # Where the prime search starts for every order (not a table size: each column's size is a prime above it).
    engram_vocab_size: int = 16_000_000
    # Distinct keys of the token map: bounds the multipliers so that token * multiplier never overflows int64.
    compressed_vocab_size: int = 99092
    # Raw token id whose compressed id fills the n-gram slots before a sequence or document start.
    pad_id: int = 2
    hidden_size: int = 5120
    # Hyper-connection streams: hidden states arrive as [B, L, hc_mult, hidden_size].
    hc_mult: int = 4
    # Inside the gate's two RMS statistics (1e-20 in the release: practically none).
    rms_norm_eps: float = 1e-20

    def __post_init__(self) -> None:
        ids = self.layer_ids
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)) or not ids:
            raise ConfigError(f"layer_ids: expected a non-empty list of layer indices, got {describe(ids)}")
        ids = tuple(_int(f"layer_ids[{i}]", v, 0) for i, v in enumerate(ids))
        if len(set(ids)) != len(ids):
            raise ConfigError(f"layer_ids: expected distinct layer indices, got {list(ids)}")
        fields = {"max_ngram_size": 2, "n_heads": 1, "head_dim": FP8_BLOCK, "engram_vocab_size": 1,
                  "compressed_vocab_size": 1, "pad_id": 0, "hidden_size": 1, "hc_mult": 1}
        values = {name: _int(name, getattr(self, name), low) for name, low in fields.items()}
        if values["head_dim"] % FP8_BLOCK:
            raise ConfigError(f"head_dim: expected a multiple of {FP8_BLOCK} (one e8m0 scale per {FP8_BLOCK} "
                              f"values), got {values['head_dim']}")
        if values["compressed_vocab_size"] > _INT64_MAX // 2:
            raise ConfigError(f"compressed_vocab_size: expected at most {_INT64_MAX // 2} (the multiplier bound "
                              f"int64_max // size // 2 must be >= 1), got {values['compressed_vocab_size']}")
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating, np.integer)) \
                or not math.isfinite(eps) or eps <= 0:
            raise ConfigError(f"rms_norm_eps: expected a finite number > 0, got {describe(eps)}")
        object.__setattr__(self, "layer_ids", ids)
        for name, value in values.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "rms_norm_eps", float(eps))

    # ---- derived geometry ---------------------------------------------------------------------

    @property
    def cols(self) -> int:
        """Columns (hash heads) per layer, ``(max_ngram_size - 1) * n_heads``; column ``(n - 2) * n_heads + h``."""
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def row_format(self) -> RowFormat:
        """A table row: ``head_dim`` e4m3 codes, then one e8m0 scale byte per 32 values."""
        return RowFormat(self.head_dim, "e4m3", "block", FP8_BLOCK)

    @property
    def row_bytes(self) -> int:
        """Bytes of one packed FP8 row: ``head_dim`` e4m3 codes, then ``head_dim // 32`` e8m0 scale bytes."""
        return self.row_format.row_bytes

    def layer_index(self, layer_id: Any) -> int:
        """Position of ``layer_id`` in ``layer_ids`` (the third axis of the hasher's output)."""
        if not is_int(layer_id) \
                or int(layer_id) not in self.layer_ids:
            raise InvalidArgument(f"layer_id: expected one of layer_ids = {list(self.layer_ids)}, "
                                  f"got {describe(layer_id)}")
        return self.layer_ids.index(int(layer_id))

    def primes(self, layer_id: int) -> list[list[int]]:
        """Column sizes of ``layer_id``: ``[order - 2][head]`` primes, unique across all layers."""
        return [list(heads) for heads in _primes(self)[self.layer_index(layer_id)]]

    def offsets(self, layer_id: int) -> np.ndarray:
        """int64 ``[cols]``: where each column's rows start in the layer's one table (exclusive prefix sums)."""
        flat = np.array([p for heads in self.primes(layer_id) for p in heads], dtype=np.int64)
        return np.concatenate([[0], np.cumsum(flat)[:-1]]).astype(np.int64)

    def num_embeddings(self, layer_id: int) -> int:
        """Rows of the layer's table: the sum of its primes (``engram_num_embeddings`` in ``config.json``)."""
        return sum(sum(heads) for heads in self.primes(layer_id))

    def multipliers(self, layer_id: int) -> np.ndarray:
        """int64 ``[max_ngram_size]``: the odd hash multipliers of ``layer_id``."""
        self.layer_index(layer_id)
        bound = (_INT64_MAX // self.compressed_vocab_size) // 2
        rng = np.random.default_rng(LAYER_SEED_STRIDE * int(layer_id))
        return 2 * rng.integers(0, bound, size=self.max_ngram_size, dtype=np.int64) + 1

    # ---- loading ------------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> "V41Config":
        """Read a V4.1 ``config.json`` (a path, a directory holding one, or its parsed dict).

        Fields are read under ``text_config`` when the file has one. The pad id may be spelled
        ``engram_pad_token_id`` or ``engram_pad_id``. ``engram_num_embeddings``, where present, must equal the
        sums of the primes this config derives: a mismatch means the tables were laid out differently.
        """
        raw = read_json(path_or_dict)
        text = raw.get("text_config", raw)
        if not isinstance(text, Mapping):
            raise ConfigError(f"text_config: expected an object, got {describe(text)}")
        names = {"layer_ids": "engram_layer_ids", "max_ngram_size": "engram_max_ngram_size",
                 "n_heads": "engram_n_heads", "head_dim": "engram_head_dim",
                 "engram_vocab_size": "engram_vocab_size", "compressed_vocab_size": "engram_compressed_vocab_size",
                 "hidden_size": "hidden_size", "hc_mult": "hc_mult", "rms_norm_eps": "rms_norm_eps"}
        missing = [key for key in names.values() if key not in text]
        pads = {key: text[key] for key in ("engram_pad_token_id", "engram_pad_id") if key in text}
        if not pads:
            missing.append("engram_pad_token_id (or engram_pad_id)")
        if missing:
            raise ConfigError(f"config.json: missing {', '.join(missing)} (is this a DeepSeek-V4.1 config?)")
        if len(set(pads.values())) > 1:
            raise ConfigError(f"engram_pad_token_id: {pads['engram_pad_token_id']!r} disagrees with "
                              f"engram_pad_id: {pads['engram_pad_id']!r}")
        try:
            config = cls(pad_id=next(iter(pads.values())), **{field: text[key] for field, key in names.items()})
        except ConfigError as exc:  # name the config.json key, not only the field
            raise ConfigError(f"config.json: {exc}") from None
        counts = text.get("engram_num_embeddings")
        if counts is not None:
            expected = [config.num_embeddings(lid) for lid in config.layer_ids]
            if not isinstance(counts, (list, tuple)) or [c for c in counts] != expected:
                raise ConfigError(f"engram_num_embeddings: expected {expected} (the sums of each layer's primes "
                                  f"above engram_vocab_size = {config.engram_vocab_size}), got {describe(counts)}")
        return config


@functools.lru_cache(maxsize=32)
def _primes(config: V41Config) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``[layer][order - 2][head]`` primes: per layer and order, n_heads times the next prime not yet taken."""
    seen: set[int] = set()
    layers = []
    for _ in config.layer_ids:
        orders = []
        for _ in range(2, config.max_ngram_size + 1):
            current, heads = config.engram_vocab_size - 1, []
            for _ in range(config.n_heads):
                current = find_next_prime(current, seen)
                seen.add(current)
                heads.append(current)
            orders.append(tuple(heads))
        layers.append(tuple(orders))
    return tuple(layers)


def v41_store_config(config: V41Config, layer_id: int) -> EngramStoreConfig:
    """The EngramStore layout of one layer's table: a head per column, sized by its prime, rows of row_bytes."""
    if not isinstance(config, V41Config):
        raise InvalidType(f"config: expected a V41Config, got {type(config).__name__}")
    return config.row_format.store_config([p for heads in config.primes(layer_id) for p in heads])
