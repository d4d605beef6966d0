"""NgramHashMapping: token ids to per-head table rows, bit-exact with DeepSeek's ``engram_demo_v1.py``.

For each Engram layer the reference draws odd multipliers ``m_k`` (one per n-gram position) from
``numpy.random.default_rng(seed + 10007 * layer_id)`` and gives every head a table whose size is a prime,
unique across all heads of all layers. At position t the order-n mix is
``token[t] * m_0 ^ token[t-1] * m_1 ^ ... ^ token[t-n+1] * m_{n-1}`` (int64, wrapping; positions before the
start read the pad id) and head j of that order reads row ``mix % prime_j``.

The hashing itself runs in the Numba kernel of :mod:`engram_model.demo._kernels`; :func:`ngram_hashes_numpy` is
the reference's NumPy formulation, kept for tests and the benchmark.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

from engram_store.errors import InvalidArgument, InvalidType, describe, is_int

from .._ngram import find_next_prime
from .._tokenizer import CompressedTokenizer, as_int_ids
from . import _kernels
from ._config import BackboneConfig, EngramConfig

#: Spreads the multiplier seeds of different layers apart (the reference's PRIME_1).
LAYER_SEED_STRIDE = 10007
#: NgramHashMapping instances kept by :func:`get_hash_mapping` (each holds a few small arrays).
HASH_MAPPING_CACHE_SIZE = 32

def layer_multipliers(seed: int, layer_id: int, max_ngram_size: int, tokenizer_vocab_size: int) -> np.ndarray:
    """The odd int64 multipliers ``m_0..m_{max_ngram_size-1}`` of one layer.

    They are bounded so that ``token * m`` stays below int64 max for tokens of the vocabulary.
    """
    max_long = np.iinfo(np.int64).max
    half_bound = max(1, int(max_long // tokenizer_vocab_size) // 2)
    g = np.random.default_rng(int(seed + LAYER_SEED_STRIDE * int(layer_id)))
    r = g.integers(low=0, high=half_bound, size=(max_ngram_size,), dtype=np.int64)
    return r * 2 + 1


def table_sizes_across_layers(engram_vocab_size: Sequence[int], max_ngram_size: int, n_head_per_ngram: int,
                              layer_ids: Sequence[int], min_ngram_size: int = 2) -> dict[int, list[list[int]]]:
    """Prime table sizes per layer, per n-gram order, per head (unique across everything listed)."""
    seen_primes: set[int] = set()
    out: dict[int, list[list[int]]] = {}
    for layer_id in layer_ids:
        per_ngram = []
        for ngram in range(min_ngram_size, max_ngram_size + 1):
            start = engram_vocab_size[ngram - min_ngram_size] - 1
            heads = []
            for _ in range(n_head_per_ngram):
                start = find_next_prime(start, seen_primes)
                seen_primes.add(start)
                heads.append(start)
            per_ngram.append(heads)
        out[int(layer_id)] = per_ngram
    return out


def ngram_hashes_numpy(x: np.ndarray, pad_id: int, multipliers: np.ndarray,
                       sizes_per_ngram: Sequence[Sequence[int]], max_ngram_size: int,
                       min_ngram_size: int = 2) -> np.ndarray:
    """The reference's ``_get_ngram_hashes`` in plain NumPy: int64 ``[B, T]`` ids -> ``[B, T, H]`` rows."""
    x = np.asarray(x, dtype=np.int64)
    B, T = x.shape

    def shift_k(k: int) -> np.ndarray:
        if k == 0:
            return x
        return np.pad(x, ((0, 0), (k, 0)), mode="constant", constant_values=pad_id)[:, :T]

    base_shifts = [shift_k(k) for k in range(max_ngram_size)]
    all_hashes = []
    for n in range(min_ngram_size, max_ngram_size + 1):
        tokens = base_shifts[:n]
        mix = tokens[0] * multipliers[0]
        for k in range(1, n):
            mix = np.bitwise_xor(mix, tokens[k] * multipliers[k])
        for mod in sizes_per_ngram[n - min_ngram_size]:
            all_hashes.append((mix % int(mod)).astype(np.int64, copy=False))
    return np.stack(all_hashes, axis=2)  # (B, T, H)


def token_ids_2d(input_ids: Any) -> np.ndarray:
    """``input_ids`` (integer array or nested lists) as int64 ``[B, L]``, or an error naming the argument."""
    ids = as_int_ids(input_ids, "input_ids")
    if ids.ndim != 2:
        raise InvalidArgument(f"input_ids: expected shape [B, L] (2 dimensions), got shape {ids.shape}")
    return ids


class NgramHashMapping:
    """Multipliers, prime table sizes and the hash of every Engram layer of a model.

    Without a tokenizer raw token ids are hashed and ``vocab_size`` (the backbone's) bounds the multipliers;
    with one, ids (and ``pad_id``) are compressed first and its compressed size bounds them.
    """

    def __init__(self, engram_vocab_size: Sequence[int], max_ngram_size: int, n_embed_per_ngram: int,
                 n_head_per_ngram: int, layer_ids: Sequence[int], tokenizer: CompressedTokenizer | None = None,
                 pad_id: int = 2, seed: int = 0, vocab_size: int | None = None, min_ngram_size: int = 2):
        config = EngramConfig(engram_vocab_size=list(engram_vocab_size), max_ngram_size=max_ngram_size,
                              n_embed_per_ngram=n_embed_per_ngram, n_head_per_ngram=n_head_per_ngram,
                              layer_ids=list(layer_ids), pad_id=pad_id, seed=seed, min_ngram_size=min_ngram_size)
        if tokenizer is not None and not isinstance(tokenizer, CompressedTokenizer):
            raise InvalidType(f"tokenizer: expected a CompressedTokenizer or None, got {type(tokenizer).__name__}")
        self.vocab_size_per_ngram = config.ngram_vocab_sizes  # entries past the last order are ignored
        self.max_ngram_size = config.max_ngram_size
        self.min_ngram_size = config.min_ngram_size
        self.n_embed_per_ngram = config.n_embed_per_ngram
        self.n_head_per_ngram = config.n_head_per_ngram
        self.layer_ids = config.layer_ids
        self.seed = config.seed
        self.compressed_tokenizer = tokenizer
        if tokenizer is not None:
            self.tokenizer_vocab_size = len(tokenizer)
            if config.pad_id >= tokenizer.original_vocab_size:
                raise InvalidArgument(f"pad_id: {config.pad_id} is not a token id of the tokenizer "
                                      f"(vocabulary of {tokenizer.original_vocab_size} ids)")
            self.pad_id = int(tokenizer.lookup_table[config.pad_id])
        else:
            if vocab_size is None:
                raise InvalidArgument("vocab_size: needed when no tokenizer is given (pass the backbone's "
                                      "vocab_size), got None")
            self.tokenizer_vocab_size = BackboneConfig(vocab_size=vocab_size).vocab_size
            self.pad_id = config.pad_id
        self.layer_multipliers = {
            layer_id: layer_multipliers(self.seed, layer_id, self.max_ngram_size, self.tokenizer_vocab_size)
            for layer_id in self.layer_ids
        }
        self.vocab_size_across_layers = table_sizes_across_layers(
            self.vocab_size_per_ngram, self.max_ngram_size, self.n_head_per_ngram, self.layer_ids,
            self.min_ngram_size)
        self._multipliers = {lid: m.reshape(1, -1) for lid, m in self.layer_multipliers.items()}  # (1, max_n)
        self._primes = {lid: np.asarray([p for heads in sizes for p in heads], dtype=np.int64).reshape(1, -1)
                        for lid, sizes in self.vocab_size_across_layers.items()}       # (1, H)

    @classmethod
    def from_config(cls, config: EngramConfig, backbone: BackboneConfig,
                    tokenizer: CompressedTokenizer | None = None) -> "NgramHashMapping":
        return cls(config.ngram_vocab_sizes, config.max_ngram_size, config.n_embed_per_ngram,
                   config.n_head_per_ngram, config.layer_ids, tokenizer, config.pad_id, config.seed,
                   backbone.vocab_size, config.min_ngram_size)

    @property
    def num_heads(self) -> int:
        return (self.max_ngram_size - self.min_ngram_size + 1) * self.n_head_per_ngram

    def get_table_vocab_sizes(self, layer_id: int) -> list[int]:
        """Rows of each head's table for ``layer_id``, n-gram major then head (the primes)."""
        return [int(p) for p in self._primes[self._check_layer(layer_id)][0]]

    def _check_layer(self, layer_id: Any) -> int:
        if not is_int(layer_id) \
                or int(layer_id) not in self._primes:
            raise InvalidArgument(f"layer_id: expected one of layer_ids = {self.layer_ids}, got {describe(layer_id)}")
        return int(layer_id)

    def prepare_ids(self, input_ids: Any) -> np.ndarray:
        """Validate ``[B, L]`` token ids and compress them if a tokenizer is set: int64 ``[B, L]``."""
        ids = token_ids_2d(input_ids)
        if self.compressed_tokenizer is not None:
            ids = self.compressed_tokenizer(ids)
        return ids

    def hash(self, input_ids: Any) -> dict[int, np.ndarray]:
        """Row ids of every layer: ``{layer_id: int64 [B, L, H]}``, as the reference's ``hash``."""
        return self.hash_layers(input_ids, self.layer_ids)

    def hash_layers(self, input_ids: Any, layer_ids: Sequence[int]) -> dict[int, np.ndarray]:
        """Row ids of the listed layers, hashed in one pass over the ids."""
        return self.hash_prepared(self.prepare_ids(input_ids), layer_ids)

    def hash_prepared(self, ids: np.ndarray, layer_ids: Sequence[int]) -> dict[int, np.ndarray]:
        """:meth:`hash_layers` for ids already through :meth:`prepare_ids` (int64 ``[B, L]``, compressed)."""
        layer_ids = [self._check_layer(lid) for lid in layer_ids]
        multipliers = np.concatenate([self._multipliers[lid] for lid in layer_ids])  # (n_layers, max_n)
        primes = np.concatenate([self._primes[lid] for lid in layer_ids])             # (n_layers, H)
        rows = _kernels.hash_layers(ids, self.pad_id, multipliers, primes, self.min_ngram_size,
                                    self.n_head_per_ngram)
        return {lid: rows[i] for i, lid in enumerate(layer_ids)}

    def hash_layer(self, input_ids: Any, layer_id: int) -> np.ndarray:
        """Row ids of one layer: int64 ``[B, L, H]``."""
        return self.hash_layers(input_ids, [layer_id])[int(layer_id)]

    def hash_numpy(self, input_ids: Any, layer_id: int) -> np.ndarray:
        """The same as :meth:`hash_layer`, computed by the reference's NumPy formulation."""
        layer_id = self._check_layer(layer_id)
        return ngram_hashes_numpy(self.prepare_ids(input_ids), self.pad_id, self.layer_multipliers[layer_id],
                                  self.vocab_size_across_layers[layer_id], self.max_ngram_size,
                                  self.min_ngram_size)

    def __repr__(self) -> str:
        return (f"NgramHashMapping(layers={self.layer_ids}, max_ngram_size={self.max_ngram_size}, "
                f"heads={self.num_heads}, tokenizer_vocab_size={self.tokenizer_vocab_size})")


_cache: OrderedDict[tuple, NgramHashMapping] = OrderedDict()
_cache_lock = threading.Lock()


def get_hash_mapping(config: EngramConfig, backbone: BackboneConfig,
                     tokenizer: CompressedTokenizer | None = None) -> NgramHashMapping:
    """A shared NgramHashMapping for this configuration, so the Engram layers of one model build it once.

    The cache is keyed by every field the mapping depends on (the tokenizer by the fingerprint of its lookup
    table), holds at most :data:`HASH_MAPPING_CACHE_SIZE` entries and is safe to use from several threads.
    """
    key = (tuple(config.ngram_vocab_sizes), config.max_ngram_size, config.min_ngram_size, config.n_embed_per_ngram,
           config.n_head_per_ngram, tuple(config.layer_ids), config.pad_id, config.seed,
           None if tokenizer is not None else backbone.vocab_size,
           tokenizer.fingerprint if tokenizer is not None else None)
    with _cache_lock:
        mapping = _cache.get(key)
        if mapping is not None:
            _cache.move_to_end(key)
            return mapping
    mapping = NgramHashMapping.from_config(config, backbone, tokenizer)  # outside the lock: primes take a while
    with _cache_lock:
        mapping = _cache.setdefault(key, mapping)
        _cache.move_to_end(key)
        while len(_cache) > HASH_MAPPING_CACHE_SIZE:
            _cache.popitem(last=False)
    return mapping
