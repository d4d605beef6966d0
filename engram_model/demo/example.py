"""TransformerWithEngram: how a model uses Engram layers whose tables live in the store.

Engram rows depend only on the token ids, not on hidden states, so a model can hash the ids for every Engram
layer once and start all table reads before its first block runs; by the time the forward pass reaches an
Engram layer its rows are (usually) already here. The blocks between are stand-ins (a residual tanh MLP on
each hyper-connection stream) in place of attention and MoE, as in the reference's ``TransformerBlock``.

Run ``python -m engram_model.demo.example`` for a small model on an embedded store.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Sequence

import numpy as np

from ._config import BackboneConfig, EngramConfig
from ._layer import Engram, prefetch_layers


class TransformerWithEngram:
    """``backbone_cfg.num_layers`` blocks; the blocks in ``config.layer_ids`` add an Engram branch first."""

    def __init__(self, config: EngramConfig, backbone_cfg: BackboneConfig, store: Any, tokenizer: Any = None,
                 seed: int = 0):
        self.config = config.validate()
        self.backbone_cfg = backbone_cfg.validate()
        self.engrams = {lid: Engram(lid, config, backbone_cfg, store, tokenizer) for lid in config.layer_ids}
        rng = np.random.default_rng(seed)
        C = backbone_cfg.hidden_size
        # One (C, C) matrix per block, scaled so the stand-in blocks keep activations O(1).
        self.block_weights = [(rng.standard_normal((C, C)) / np.sqrt(C)).astype(np.float32)
                              for _ in range(backbone_cfg.num_layers)]

    def populate_random_tables(self, seed: int = 0) -> None:
        """Fill every Engram layer's tables with N(0, 1) rows (stand-in for trained tables)."""
        rng = np.random.default_rng(seed)
        for engram in self.engrams.values():
            D = engram.get_embedding_dim()
            engram.populate_store_from_buffers([rng.standard_normal((n, D), dtype=np.float32)
                                                for n in engram.get_table_vocab_sizes()])

    def forward(self, input_ids: Any, hidden_states: np.ndarray) -> np.ndarray:
        """``hidden_states`` float32 ``[B, L, hc_mult, hidden_size]`` through every block; the same shape."""
        handles = prefetch_layers(list(self.engrams.values()), input_ids)  # hash once, start every read
        h = hidden_states
        for layer_id, w in enumerate(self.block_weights):
            engram = self.engrams.get(layer_id)
            if engram is not None:
                h = h + engram.forward(h, prefetched=handles[layer_id])
            h = h + np.tanh(h @ w)                                      # (B, L, hc, C)
        return h

    __call__ = forward

    def remove_from_store(self) -> int:
        return sum(e.remove_from_store() for e in self.engrams.values())

    def close(self) -> None:
        for engram in self.engrams.values():
            engram.close()


def main(argv: Sequence[str] | None = None) -> int:
    from engram_store import DistributedStore

    parser = argparse.ArgumentParser(description="Run a small TransformerWithEngram on an embedded store.")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args(argv)
    cfg = EngramConfig(engram_vocab_size=[20_000, 20_000], max_ngram_size=3, n_embed_per_ngram=64,
                       n_head_per_ngram=4, layer_ids=[1, 4])
    bb = BackboneConfig(hidden_size=128, hc_mult=2, vocab_size=32_000, num_layers=6)
    rng = np.random.default_rng(0)
    with DistributedStore.embedded(segment_size="256MiB") as store:
        model = TransformerWithEngram(cfg, bb, store)
        try:
            model.populate_random_tables()
            input_ids = rng.integers(0, bb.vocab_size, size=(args.batch, args.seq_len))
            hidden = rng.standard_normal((args.batch, args.seq_len, bb.hc_mult, bb.hidden_size), dtype=np.float32)
            start = time.perf_counter()
            out = model(input_ids, hidden)
            print(f"output {out.shape} in {1e3 * (time.perf_counter() - start):.2f} ms "
                  f"({len(model.engrams)} Engram layers of {bb.num_layers})")
        finally:
            model.remove_from_store()
            model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
