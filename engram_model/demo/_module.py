"""EngramModule: the Engram layer for a model with a single residual stream.

It is :class:`Engram` with one hyper-connection channel. Its fields map onto the Engram configs as::

    EngramModuleConfig          EngramConfig / BackboneConfig
    vocab_size              ->  BackboneConfig.vocab_size (bounds the hash multipliers)
    min_n, max_n            ->  EngramConfig.min_ngram_size, max_ngram_size (orders hashed)
    num_hash_heads          ->  EngramConfig.n_head_per_ngram
    embedding_table_size    ->  EngramConfig.engram_vocab_size = [embedding_table_size] * (max_n - min_n + 1)
                                (each head's table is the next unused prime above it)
    embedding_dim           ->  D_head, the width of one table row: n_embed_per_ngram = embedding_dim * heads
    hidden_dim              ->  BackboneConfig.hidden_size, with hc_mult = 1
    layer_id                ->  EngramConfig.layer_ids = [layer_id], BackboneConfig.num_layers = layer_id + 1
    kernel_size, seed, pad_id   as in EngramConfig
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engram_store.errors import ConfigError, InvalidArgument, InvalidType, describe, is_int

from ._config import BackboneConfig, EngramConfig
from ._layer import Engram, EngramPrefetch


@dataclass
class EngramModuleConfig:
    """Geometry of a single-stream Engram layer (see the module docstring for the mapping)."""

    vocab_size: int = 129280
    min_n: int = 2
    max_n: int = 4
    num_hash_heads: int = 4
    embedding_table_size: int = 1_000_000
    # Width of one table row (per head); the gate and value see num_orders * num_hash_heads * embedding_dim.
    embedding_dim: int = 64
    hidden_dim: int = 2048
    kernel_size: int = 4
    seed: int = 0
    pad_id: int = 2
    # Store keys are engram:l{layer_id}:h{head}; give each module of a model its own layer_id.
    layer_id: int = 0

    def __post_init__(self) -> None:
        self.to_engram_configs()

    def to_engram_configs(self) -> tuple[EngramConfig, BackboneConfig]:
        """The equivalent ``(EngramConfig, BackboneConfig)``; raises ConfigError naming a bad field."""
        for name in ("min_n", "max_n", "num_hash_heads", "embedding_table_size", "embedding_dim"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ConfigError(f"{name}: expected a positive integer, got {describe(value)}")
        if not 2 <= self.min_n <= self.max_n:
            raise ConfigError(f"min_n, max_n: expected 2 <= min_n <= max_n, got min_n={self.min_n}, "
                              f"max_n={self.max_n}")
        if isinstance(self.layer_id, bool) or not isinstance(self.layer_id, (int, np.integer)) or self.layer_id < 0:
            raise ConfigError(f"layer_id: expected a non-negative integer, got {describe(self.layer_id)}")
        orders = self.max_n - self.min_n + 1
        engram = EngramConfig(
            engram_vocab_size=[int(self.embedding_table_size)] * orders, max_ngram_size=int(self.max_n),
            min_ngram_size=int(self.min_n), n_embed_per_ngram=int(self.embedding_dim * self.num_hash_heads),
            n_head_per_ngram=int(self.num_hash_heads), layer_ids=[int(self.layer_id)], pad_id=self.pad_id,
            seed=self.seed, kernel_size=self.kernel_size,
        )
        backbone = BackboneConfig(hidden_size=self.hidden_dim, hc_mult=1, vocab_size=self.vocab_size,
                                  num_layers=int(self.layer_id) + 1)
        return engram, backbone


class EngramModule:
    """``forward(hidden_states [B, L, hidden_dim], input_ids)`` -> ``(hidden_states + engram_output, gating)``.

    ``store`` and ``tokenizer`` are as for :class:`Engram`; the underlying layer is ``self.engram``.
    """

    def __init__(self, config: EngramModuleConfig | None = None, store: Any = None, tokenizer: Any = None):
        if config is not None and not isinstance(config, EngramModuleConfig):
            raise InvalidType(f"config: expected an EngramModuleConfig, got {type(config).__name__}")
        self.config = config or EngramModuleConfig()
        engram_cfg, backbone = self.config.to_engram_configs()
        self.engram = Engram(engram_cfg.layer_ids[0], engram_cfg, backbone, store, tokenizer)

    def get_table_vocab_sizes(self) -> list[int]:
        return self.engram.get_table_vocab_sizes()

    def prefetch_embeddings(self, input_ids: Any) -> EngramPrefetch:
        """Start reading the rows for ``input_ids``; pass the handle as ``memory_embeddings``."""
        return self.engram.prefetch(input_ids)

    def forward(self, hidden_states: np.ndarray, input_ids: Any = None, memory_embeddings: Any = None,
                return_gating: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        """Residual output and, with ``return_gating``, the gate of each position (float32 ``[B, L, 1]``).

        ``memory_embeddings`` is a handle from :meth:`prefetch_embeddings` or rows float32
        ``[B, L, H, embedding_dim]``; without it the rows are read for ``input_ids`` now.
        """
        C = self.config.hidden_dim
        if not isinstance(hidden_states, np.ndarray):
            raise InvalidType(f"hidden_states: expected a float32 NumPy array [B, L, {C}], "
                              f"got {type(hidden_states).__name__}")
        if hidden_states.ndim != 3 or hidden_states.shape[2] != C:
            raise InvalidArgument(f"hidden_states: expected shape [B, L, hidden_dim={C}], got {hidden_states.shape}")
        h4 = hidden_states[:, :, None, :]                                 # (B, L, 1, C)
        if isinstance(memory_embeddings, EngramPrefetch):
            out, gates = self.engram.forward_with_gates(h4, input_ids, prefetched=memory_embeddings)
        else:
            out, gates = self.engram.forward_with_gates(h4, input_ids, embeddings=memory_embeddings)
        return hidden_states + out[:, :, 0, :], (gates if return_gating else None)

    __call__ = forward

    def close(self) -> None:
        self.engram.close()
