"""Configuration of an Engram layer and of the backbone it sits in.

Field names and defaults follow DeepSeek's ``engram_demo_v1.py`` (``EngramConfig``, ``BackBoneConfig``) and
Mooncake's Python Engram API, so configs written for either work unchanged; the one default that differs is
``tokenizer_name_or_path`` (None: raw ids, since nothing is downloaded here). Both dataclasses validate when
they are built; because they may also be filled in by attribute (``cfg.max_ngram_size = 3``), code that uses
them calls :meth:`validate` again, which checks the fields together and says which one to change.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engram_store.errors import ConfigError, describe, is_int

log = logging.getLogger(__name__)

#: DeepSeek-V3's tokenizer vocabulary; the reference sizes each n-gram's tables at five times it.
DEEPSEEK_V3_VOCAB_SIZE = 129280

# engram_vocab_size lists already warned about (their extra entries are ignored), so the warning shows once
# per distinct config rather than once per layer built from it. Bounded: forgotten past this many.
_WARNED_MAX = 64
_warned_extra_sizes: set[tuple] = set()
_warned_lock = threading.Lock()


def _positive_int(name: str, value: Any) -> int:
    if not is_int(value) or value <= 0:
        raise ConfigError(f"{name}: expected a positive integer, got {describe(value)}")
    return int(value)


def _non_negative_int(name: str, value: Any) -> int:
    if not is_int(value) or value < 0:
        raise ConfigError(f"{name}: expected a non-negative integer, got {describe(value)}")
    return int(value)


def _int_list(name: str, value: Any) -> list[Any]:
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ConfigError(f"{name}: expected a list of integers, got {describe(value)}")
    return list(value)


@dataclass
class EngramConfig:
    """Hashing and table geometry of the Engram layers of one model (shared by all its Engram layers)."""

    # None or "" hashes raw token ids; a tokenizer.json path, a directory holding one, or a Hugging Face name
    # already in the local cache enables compression. Nothing is downloaded: any other name is an error when a
    # layer is built. (Mooncake's default "deepseek-ai/DeepSeek-V3" is not used here: its hashing ignores it.)
    tokenizer_name_or_path: str | None = None
    # One base table size per n-gram order 2..max_ngram_size; each head's table is the next unused prime above it.
    # Entries past the last order are ignored (with a warning), as in the reference.
    engram_vocab_size: list[int] = field(default_factory=lambda: [DEEPSEEK_V3_VOCAB_SIZE * 5] * 2)
    max_ngram_size: int = 3
    # Embedding width of one n-gram order, split evenly over its heads (D_head = n_embed_per_ngram // n_head).
    n_embed_per_ngram: int = 512
    n_head_per_ngram: int = 8
    # Every Engram layer of the model: prime table sizes are unique across all of them, so the list matters
    # even to a single layer.
    layer_ids: list[int] = field(default_factory=lambda: [1, 15])
    # Token id used to left-pad the sequence for the first n-1 positions (compressed when a tokenizer is set).
    pad_id: int = 2
    # Seeds the hash multipliers (seed + 10007 * layer_id) and the weight initialisation.
    seed: int = 0
    # Taps of the causal depthwise convolution that fuses the gated values.
    kernel_size: int = 4
    # Lowest n-gram order hashed. Not in the reference, which always starts at bigrams (2, the default); a
    # higher value drops the low orders, and engram_vocab_size then lists orders min_ngram_size..max_ngram_size.
    min_ngram_size: int = 2

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "EngramConfig":
        """Check every field and their combinations, normalise them in place (plain ints, lists); return self."""
        max_n = _positive_int("max_ngram_size", self.max_ngram_size)
        if max_n < 2:
            raise ConfigError(f"max_ngram_size: expected >= 2 (n-grams of orders 2..max_ngram_size), got {max_n}")
        min_n = _positive_int("min_ngram_size", self.min_ngram_size)
        if not 2 <= min_n <= max_n:
            raise ConfigError(f"min_ngram_size: expected 2 <= min_ngram_size <= max_ngram_size = {max_n}, got {min_n}")
        orders = max_n - min_n + 1
        sizes = _int_list("engram_vocab_size", self.engram_vocab_size)
        if len(sizes) < orders:
            what = "max_ngram_size - 1" if min_n == 2 else "max_ngram_size - min_ngram_size + 1"
            raise ConfigError(
                f"engram_vocab_size: expected one base size per n-gram order {min_n}..{max_n}, i.e. at least "
                f"{what} = {orders} entries, got {len(sizes)} ({describe(sizes)}); change engram_vocab_size or "
                "max_ngram_size"
            )
        sizes = [_positive_int(f"engram_vocab_size[{i}]", v) for i, v in enumerate(sizes)]
        if len(sizes) > orders:
            _warn_extra_sizes(sizes, min_n, max_n)
        n_embed = _positive_int("n_embed_per_ngram", self.n_embed_per_ngram)
        n_head = _positive_int("n_head_per_ngram", self.n_head_per_ngram)
        if n_embed % n_head:
            raise ConfigError(
                f"n_embed_per_ngram: expected a multiple of n_head_per_ngram = {n_head} (each head gets "
                f"n_embed_per_ngram // n_head_per_ngram columns), got {n_embed}"
            )
        layer_ids = [_non_negative_int(f"layer_ids[{i}]", v)
                     for i, v in enumerate(_int_list("layer_ids", self.layer_ids))]
        if not layer_ids:
            raise ConfigError("layer_ids: expected at least one layer id, got []")
        if len(set(layer_ids)) != len(layer_ids):
            raise ConfigError(f"layer_ids: expected distinct layer ids, got {layer_ids}")
        pad_id = _non_negative_int("pad_id", self.pad_id)
        seed = _non_negative_int("seed", self.seed)
        kernel_size = _positive_int("kernel_size", self.kernel_size)
        path = self.tokenizer_name_or_path
        if path is not None and not isinstance(path, str):
            raise ConfigError(f"tokenizer_name_or_path: expected a string or None, got {describe(path)}")
        self.tokenizer_name_or_path = path
        self.engram_vocab_size = sizes
        self.max_ngram_size = max_n
        self.n_embed_per_ngram = n_embed
        self.n_head_per_ngram = n_head
        self.layer_ids = layer_ids
        self.pad_id = pad_id
        self.seed = seed
        self.kernel_size = kernel_size
        self.min_ngram_size = min_n
        return self

    @property
    def ngram_vocab_sizes(self) -> list[int]:
        """The base sizes in use: the first ``num_orders`` entries of ``engram_vocab_size``."""
        return list(self.engram_vocab_size[:self.num_orders])

    @property
    def tokenizer_path(self) -> str | None:
        """``tokenizer_name_or_path``, or None when it is None or ``""`` (raw token ids are hashed)."""
        return self.tokenizer_name_or_path or None

    @property
    def num_orders(self) -> int:
        """N-gram orders hashed: ``max_ngram_size - min_ngram_size + 1`` (``max_ngram_size - 1`` by default)."""
        return self.max_ngram_size - self.min_ngram_size + 1

    @property
    def num_heads(self) -> int:
        """Tables per layer: ``num_orders * n_head_per_ngram``."""
        return self.num_orders * self.n_head_per_ngram

    @property
    def head_dim(self) -> int:
        """Columns of every table row (``D_head``)."""
        return self.n_embed_per_ngram // self.n_head_per_ngram

    @property
    def engram_hidden_size(self) -> int:
        """Width of the concatenated rows of one position: ``num_orders * n_embed_per_ngram``."""
        return self.num_orders * self.n_embed_per_ngram


@dataclass
class BackboneConfig:
    """The transformer an Engram layer is inserted into."""

    hidden_size: int = 1024
    # Hyper-connection streams: hidden states arrive as [B, L, hc_mult, hidden_size], one gate per stream.
    hc_mult: int = 4
    # Hash input range when no tokenizer compresses the ids (sets the multiplier bound).
    vocab_size: int = DEEPSEEK_V3_VOCAB_SIZE
    num_layers: int = 30

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "BackboneConfig":
        """Check every field, normalise them in place (plain ints); return self."""
        self.hidden_size = _positive_int("hidden_size", self.hidden_size)
        self.hc_mult = _positive_int("hc_mult", self.hc_mult)
        self.vocab_size = _positive_int("vocab_size", self.vocab_size)
        self.num_layers = _positive_int("num_layers", self.num_layers)
        return self


def _warn_extra_sizes(sizes: list[int], min_n: int, max_n: int) -> None:
    key = (tuple(sizes), min_n, max_n)
    with _warned_lock:
        if key in _warned_extra_sizes:
            return
        if len(_warned_extra_sizes) >= _WARNED_MAX:
            _warned_extra_sizes.clear()
        _warned_extra_sizes.add(key)
    used = max_n - min_n + 1
    log.warning("engram_vocab_size has %d entries but n-gram orders %d..%d use only the first %d (%s); the "
                "rest (%s) are ignored, as in DeepSeek's reference", len(sizes), min_n, max_n, used,
                sizes[:used], sizes[used:])


def check_layer(layer_id: Any, config: EngramConfig, backbone: BackboneConfig) -> int:
    """Validate ``layer_id`` against both configs: it must be one of ``layer_ids`` and below ``num_layers``."""
    if not is_int(layer_id):
        raise ConfigError(f"layer_id: expected an integer, got {describe(layer_id)}")
    layer_id = int(layer_id)
    if layer_id not in config.layer_ids:
        raise ConfigError(f"layer_id: {layer_id} is not in config.layer_ids = {config.layer_ids}; add it there "
                          "(table sizes and multipliers are derived from the full list) or pick one of them")
    if layer_id >= backbone.num_layers:
        raise ConfigError(f"layer_id: {layer_id} is not below backbone_cfg.num_layers = {backbone.num_layers}; "
                          "raise num_layers or pick a lower layer")
    return layer_id
