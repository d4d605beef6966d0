"""PLEConfig: the per-layer-embedding (PLE) geometry of Qwen4-Exp (Qwen/Qwen3.8-Flash-Next), and the hash layout
derived from it (prime head sizes, offsets, padded table size, SplitMix64 multipliers).

Follows Hugging Face transformers 5.23.0, ``models/qwen4_exp/modeling_qwen4_exp.py`` (``_splitmix64``,
``_build_layer_multipliers``, ``_find_nth_prime_after``, ``Qwen4ExpTextNGramEmbedding.__init__``) and the fields of
``Qwen4ExpTextConfig``. For the PLE layer with index ``p`` (its rank in the sorted ``ple_layer_ids``)::

    heads      = (ngram_size - 1) * heads_per_ngram                   # orders 2..ngram_size, order-major
    size[h]    = the (p * heads + h + 1)-th prime after ngram_vocab_size_base - 1
    offset[h]  = size[0] + ... + size[h - 1]                          # inside the layer's one table
    rows       = ceil(sum(size) / make_ngram_vocab_size_divisible_by) * make_ngram_vocab_size_divisible_by
    m[i]       = 2 * (splitmix64(seed + 10007 * p + 0x9E3779B97F4A7C15 * (i + 1)) % half) + 1,  i < ngram_size
    half       = max(1, ((2**63 - 1) // vocab_size) // 2)             # token * m[i] stays below 2**63

The checkpoint stores the same three arrays per layer (``layer_multipliers``, ``ngram_heads_vocab_sizes``,
``ngram_heads_offsets``) and both engines use those: :class:`PLEHashBuffers` holds one layer's, from the config
(:meth:`PLEConfig.hash_buffers`) or from a checkpoint (:func:`engram_model.ple.load_ple_hash_buffers`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from engram_store import EngramStoreConfig
from engram_store.errors import ConfigError, InvalidArgument, InvalidType, describe, is_int

from .._ngram import is_prime
from .._checkpoint_files import read_json
from .._rows_format import RowFormat

_MASK64 = (1 << 64) - 1
_SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_SPLITMIX_M1 = 0xBF58476D1CE4E5B9
_SPLITMIX_M2 = 0x94D049BB133111EB
#: Spreads the multiplier seeds of different PLE layers apart (the reference's _PRIME_1).
LAYER_SEED_STRIDE = 10007
_INT64_MAX = (1 << 63) - 1
#: ``ple_embedding_dtype`` of the FP8 exports: the table's rows are e4m3 codes with one scale per table.
FP8_DTYPE = "float8_e4m3fn"
TABLE_DTYPES = ("bfloat16", FP8_DTYPE)
#: Qwen4ExpTextConfig's defaults (transformers 5.23.0), which from_hf() takes for the fields config.json leaves out
#: (the release leaves out ``seed``). They differ from the release's values, this dataclass's defaults.
HF_DEFAULTS = {"vocab_size": 248320, "hidden_size": 2048, "hc_count": 4, "ple_embed_dim": None,
               "ple_conv_kernel_size": 4, "ngram_size": 3, "heads_per_ngram": 8,
               "ngram_vocab_size_base": 20_000_000, "make_ngram_vocab_size_divisible_by": 128, "seed": 1234,
               "split_ngram_parts": 512, "rms_norm_eps": 1e-6}


def splitmix64(value: int) -> int:
    """One SplitMix64 step of a 64-bit value, as a Python int in [0, 2**64)."""
    value = (value + _SPLITMIX_GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _SPLITMIX_M1) & _MASK64
    value = ((value ^ (value >> 27)) * _SPLITMIX_M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


@functools.lru_cache(maxsize=32)
def primes_from(start: int, count: int) -> tuple[int, ...]:
    """The first ``count`` primes >= ``start`` (the reference's ``_find_nth_prime_after(start - 1, n)``, n <= count)."""
    out, candidate = [], start
    while len(out) < count:
        if is_prime(candidate):
            out.append(candidate)
        candidate += 1
    return tuple(out)


def _int(name: str, value: Any, minimum: int) -> int:
    if not is_int(value) or value < minimum:
        raise ConfigError(f"{name}: expected an integer >= {minimum}, got {describe(value)}")
    return int(value)


@dataclass(frozen=True)
class PLEHashBuffers:
    """One PLE layer's hash layout: ``multipliers`` int64 ``[ngram_size]``, ``sizes`` and ``offsets`` int64
    ``[heads]`` (rows of each head, where each starts in the layer's one table) and ``rows`` (the table's rows,
    padding included). Heads are contiguous: ``offsets`` are the running sums of ``sizes``."""

    layer_id: int
    multipliers: tuple[int, ...]
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    rows: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "multipliers", tuple(int(m) for m in self.multipliers))
        object.__setattr__(self, "sizes", tuple(int(n) for n in self.sizes))
        object.__setattr__(self, "offsets", tuple(int(o) for o in self.offsets))
        bad = [n for n in self.sizes if n < 1]
        if bad:
            raise InvalidArgument(f"layer {self.layer_id}: ngram_heads_vocab_sizes: expected sizes >= 1, got "
                                  f"{list(self.sizes)}")
        running = tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.sizes[:-1], dtype=np.int64)]))
        if self.offsets != running:
            raise InvalidArgument(f"layer {self.layer_id}: ngram_heads_offsets: expected the running sums of the "
                                  f"head sizes {list(running)} (heads lie one after the other), got "
                                  f"{list(self.offsets)}")
        if sum(self.sizes) > self.rows:
            raise InvalidArgument(f"layer {self.layer_id}: the heads hold {sum(self.sizes)} rows, more than the "
                                  f"table's {self.rows}")
        if any(not -2 ** 63 <= m < 2 ** 63 for m in self.multipliers):
            raise InvalidArgument(f"layer {self.layer_id}: layer_multipliers: expected int64 values, got "
                                  f"{list(self.multipliers)}")

    @property
    def padding(self) -> int:
        """Rows after the last head that no id addresses."""
        return self.rows - sum(self.sizes)


@dataclass(frozen=True)
class PLEConfig:
    """PLE geometry of a Qwen4-Exp model; the defaults are the release's (Qwen/Qwen3.8-Flash-Next, whose
    ple_layer_ids are [2]). Frozen and hashable."""

    # One-indexed decoder layers with a PLE (decoder layer index layer_id - 1); sorted and deduplicated, as the
    # reference does: a layer's rank in this list seeds its multipliers and picks its primes.
    ple_layer_ids: tuple[int, ...]
    hidden_size: int = 2560
    # Hyper-connection streams: hidden states arrive as [.., hc_count * hidden_size].
    hc_count: int = 4
    # Values of the 16 rows concatenated (None: hidden_size); a row has ple_embed_dim / heads values.
    ple_embed_dim: int | None = None
    ple_conv_kernel_size: int = 4
    # N-gram orders 2..ngram_size, heads_per_ngram heads each; also the short convolution's dilation.
    ngram_size: int = 3
    heads_per_ngram: int = 8
    # Where the prime search starts (head sizes are primes >= this).
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    # Row ranges the checkpoint cuts each table into (transformers' default is 512; the release has 128).
    split_ngram_parts: int = 128
    seed: int = 1234
    # Raw token ids are hashed (no compression map): the multipliers are bounded by this vocabulary.
    vocab_size: int = 248320
    # Resets the n-gram context; a sequence starts with it as context.
    eos_token_id: int = 248044
    rms_norm_eps: float = 1e-6
    # How the table is stored: "bfloat16" rows, or e4m3 codes with one scale per table ("float8_e4m3fn").
    ple_embedding_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        ids = self.ple_layer_ids
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)) or not ids:
            raise ConfigError(f"ple_layer_ids: expected a non-empty list of one-indexed layer ids, got "
                              f"{describe(ids)}")
        ids = tuple(sorted({_int(f"ple_layer_ids[{i}]", v, 1) for i, v in enumerate(ids)}))
        fields = {"hidden_size": 1, "hc_count": 1, "ple_conv_kernel_size": 1, "ngram_size": 2, "heads_per_ngram": 1,
                  "ngram_vocab_size_base": 2, "make_ngram_vocab_size_divisible_by": 1, "split_ngram_parts": 1,
                  "vocab_size": 1, "eos_token_id": 0}
        values = {name: _int(name, getattr(self, name), low) for name, low in fields.items()}
        dim = values["hidden_size"] if self.ple_embed_dim is None else _int("ple_embed_dim", self.ple_embed_dim, 1)
        heads = (values["ngram_size"] - 1) * values["heads_per_ngram"]
        if dim % heads:
            raise ConfigError(f"ple_embed_dim: expected a multiple of the {heads} n-gram heads ((ngram_size - 1) * "
                              f"heads_per_ngram), got {dim}")
        if not is_int(self.seed):
            raise ConfigError(f"seed: expected an integer, got {describe(self.seed)}")
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating, np.integer)) \
                or not math.isfinite(eps) or eps < 0:
            raise ConfigError(f"rms_norm_eps: expected a finite number >= 0, got {describe(eps)}")
        if self.ple_embedding_dtype not in TABLE_DTYPES:
            raise ConfigError(f"ple_embedding_dtype: expected one of {list(TABLE_DTYPES)}, got "
                              f"{describe(self.ple_embedding_dtype)}")
        object.__setattr__(self, "ple_layer_ids", ids)
        for name, value in values.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "ple_embed_dim", dim)
        object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "rms_norm_eps", float(eps))

    # ---- derived geometry ---------------------------------------------------------------------

    @property
    def heads(self) -> int:
        """Hash heads (table columns) per layer, order-major: head ``(n - 2) * heads_per_ngram + j``."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def head_dim(self) -> int:
        """Values of one row: ``ple_embed_dim / heads`` (160 for the release)."""
        return self.ple_embed_dim // self.heads

    @property
    def context(self) -> int:
        """Tokens before a chunk that its n-grams reach: ``ngram_size - 1``."""
        return self.ngram_size - 1

    @property
    def conv_state_len(self) -> int:
        """Earlier normed rows the short convolution reads: ``(ple_conv_kernel_size - 1) * ngram_size``."""
        return (self.ple_conv_kernel_size - 1) * self.ngram_size

    @property
    def row_format(self) -> RowFormat:
        """The table's rows: 160 e4m3 codes and one scale per table (FP8 exports), or 160 bf16 values."""
        if self.ple_embedding_dtype == FP8_DTYPE:
            return RowFormat(self.head_dim, "e4m3", "table")
        return RowFormat(self.head_dim, "bf16")

    @property
    def row_bytes(self) -> int:
        return self.row_format.row_bytes

    def ple_index(self, layer_id: Any) -> int:
        """The rank of ``layer_id`` in ``ple_layer_ids`` (the reference's ``ple_layer_index``; the third axis of
        the hasher's output)."""
        if not is_int(layer_id) or int(layer_id) not in self.ple_layer_ids:
            raise InvalidArgument(f"layer_id: expected one of ple_layer_ids = {list(self.ple_layer_ids)}, got "
                                  f"{describe(layer_id)}")
        return self.ple_layer_ids.index(int(layer_id))

    def head_vocab_sizes(self, layer_id: int) -> list[int]:
        """Rows of each head of ``layer_id``: consecutive primes >= ngram_vocab_size_base, layer after layer."""
        p = self.ple_index(layer_id)
        primes = primes_from(self.ngram_vocab_size_base, (p + 1) * self.heads)
        return list(primes[p * self.heads:])

    def head_offsets(self, layer_id: int) -> np.ndarray:
        """int64 ``[heads]``: where each head's rows start in the layer's one table (exclusive running sums)."""
        sizes = np.array(self.head_vocab_sizes(layer_id), dtype=np.int64)
        return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)

    def num_embeddings(self, layer_id: int) -> int:
        """Rows of the layer's table: its heads' rows, padded up to a multiple of
        ``make_ngram_vocab_size_divisible_by`` (320,001,536 for the release)."""
        total, div = sum(self.head_vocab_sizes(layer_id)), self.make_ngram_vocab_size_divisible_by
        return -(-total // div) * div

    def multipliers(self, layer_id: int) -> np.ndarray:
        """int64 ``[ngram_size]``: the odd hash multipliers of ``layer_id``."""
        p = self.ple_index(layer_id)
        half = max(1, (_INT64_MAX // max(self.vocab_size, 1)) // 2)
        base = self.seed + LAYER_SEED_STRIDE * p
        values = [2 * (splitmix64((base + _SPLITMIX_GAMMA * (i + 1)) & _MASK64) % half) + 1
                  for i in range(self.ngram_size)]
        return np.array(values, dtype=np.int64)

    def hash_buffers(self, layer_id: int) -> PLEHashBuffers:
        """The layer's hash layout as this config derives it (a checkpoint's may differ:
        :func:`engram_model.ple.load_ple_hash_buffers`)."""
        return PLEHashBuffers(int(layer_id), tuple(self.multipliers(layer_id).tolist()),
                              tuple(self.head_vocab_sizes(layer_id)), tuple(self.head_offsets(layer_id).tolist()),
                              self.num_embeddings(layer_id))

    # ---- loading ------------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, config: Any) -> "PLEConfig":
        """Read a Qwen4-Exp ``config.json``: a path, a directory holding one, or its parsed dict, with the text
        fields under ``text_config`` or at the top. Fields it leaves out take transformers' defaults
        (:data:`HF_DEFAULTS`); ``ple_layer_ids`` and ``eos_token_id`` (the first, if a list) are required. The
        table's row format comes from ``ple_embedding_dtype`` (under ``text_config`` or at the top)."""
        raw = read_json(config, "from_hf")
        text = raw.get("text_config", raw)
        if not isinstance(text, Mapping):
            raise ConfigError(f"text_config: expected an object, got {describe(text)}")
        missing = [key for key in ("ple_layer_ids", "eos_token_id") if text.get(key) in (None, [])]
        if missing:
            raise ConfigError(f"config.json: missing {', '.join(missing)} (is this a Qwen4-Exp config with PLE "
                              "layers?)")
        eos = text["eos_token_id"]
        fields = {name: text.get(name, default) for name, default in HF_DEFAULTS.items()}
        fields["ple_embedding_dtype"] = text.get("ple_embedding_dtype", raw.get("ple_embedding_dtype", "bfloat16"))
        try:
            parsed = cls(ple_layer_ids=text["ple_layer_ids"], eos_token_id=eos[0] if isinstance(eos, list) else eos,
                         **fields)
        except ConfigError as exc:  # name the config.json key, not only the field
            raise ConfigError(f"config.json: {exc}") from None
        layers = text.get("num_hidden_layers")
        if is_int(layers) and parsed.ple_layer_ids[-1] > layers:
            raise ConfigError(f"config.json: ple_layer_ids: expected one-indexed ids in [1, {layers}] "
                              f"(num_hidden_layers), got {list(parsed.ple_layer_ids)}")
        return parsed


def ple_store_config(config: PLEConfig, layer_id: int, buffers: PLEHashBuffers | None = None) -> EngramStoreConfig:
    """The EngramStore layout of one layer's table: a head per hash head, sized by its prime (by ``buffers``'
    sizes where a checkpoint gave them), rows of the config's row format. The padding rows are not stored."""
    if not isinstance(config, PLEConfig):
        raise InvalidType(f"config: expected a PLEConfig, got {type(config).__name__}")
    sizes: Sequence[int] = config.head_vocab_sizes(layer_id) if buffers is None else buffers.sizes
    return config.row_format.store_config(sizes)
