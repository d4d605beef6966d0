"""DeepSeek-V4.1's kernels compiled ahead of time (``engram-warmup``), through the wrappers serving uses: the hash
and its continuous-batching step, FP8 row decoding fused with the gather (for 24 columns, the release, and 12,
``engram_model.v41.demo``), the gate, the sizing replay, checkpoint packing and the engines' row gathers."""

from __future__ import annotations

import os
import tempfile

import numpy as np

from engram_store import EngramStore

from .._replay import sizing_report
from .._rows_gather import warm_kernels
from .._safetensors import SafetensorsCheckpoint, write_safetensors
from . import _kernels
from ._checkpoint import load_v41_weights
from ._config import V41Config, v41_store_config
from ._fp8 import decode_fp8_rows, encode_fp8_rows
from ._hasher import V41Hasher
from ._layer import V41Engram
from ._sizing import replay_tokens


def warmup() -> None:
    """Run the family's kernels once on tiny inputs."""
    for n_heads in (8, 4):
        config = V41Config(layer_ids=[1, 14], max_ngram_size=4, n_heads=n_heads, head_dim=32, engram_vocab_size=40,
                           compressed_vocab_size=8, hidden_size=8, hc_mult=4)
        hasher = V41Hasher(config, np.arange(16, dtype=np.int64) % 8)
        layout = v41_store_config(config, 1)
        table = EngramStore(1, layout, None)
        table.bind_local([encode_fp8_rows(np.ones((n, 32), dtype=np.float32)) for n in layout.table_vocab_sizes])
        K = config.cols * config.head_dim
        engram = V41Engram(config, 1, np.zeros((40, K), np.float32), np.ones((4, 8), np.float32),
                           np.ones((4, 8), np.float32), table, hasher)
        ids = np.arange(6, dtype=np.int64).reshape(2, 3)
        hidden = np.zeros((2, 3, 4, 8), dtype=np.float32)
        engram.forward(hidden, ids, token_mask=np.ones((2, 3), dtype=bool), position_ids=np.zeros((2, 3), np.int64))
        engram.forward(hidden, ids)
        hasher.step(hasher.begin(2), ids)
        state = hasher.begin(4)  # continuous batching: a draft hashed, then its accepted tokens committed
        flags = np.zeros(6, dtype=bool)
        hasher.step_ragged(state, ids.ravel(), [3, 0], [0, 2, 6], token_mask=~flags, doc_start=flags, commit=False)
        hasher.commit(state, ids.ravel()[:3], [3, 0], [0, 1, 3])
        table.close()
        if n_heads == 8:  # engram-stats --v41: a corpus replayed into the curve, first touches counted
            sizing_report(replay_tokens(config, np.arange(16, dtype=np.int64) % 8, ids, max_keys=4), 0.5)
    decode_fp8_rows(encode_fp8_rows(np.ones((2, 32), dtype=np.float32)))
    warm_kernels()  # the engines' row gathers (V41Rows)
    _warm_checkpoint()


def _warm_checkpoint() -> None:
    """Checkpoint reading: a one-layer file with the dtypes of the release, read as load_v41_table reads it."""
    config = V41Config(layer_ids=[1], max_ngram_size=2, n_heads=1, head_dim=32, engram_vocab_size=2,
                       compressed_vocab_size=8, hidden_size=32, hc_mult=1)
    rows = config.num_embeddings(1)
    tensors = {"layers.1.engram.embed.weight": ("F8_E4M3", np.zeros((rows, 32), np.uint8)),
               "layers.1.engram.embed.scale": ("F8_E8M0", np.full((rows, 1), 127, np.uint8)),
               "layers.1.engram.wkv.weight": ("F8_E4M3", np.zeros((64, 32), np.uint8)),
               "layers.1.engram.wkv.scale": ("F8_E8M0", np.full((2, 1), 127, np.uint8)),
               "layers.1.engram.q_weight": ("BF16", np.zeros((1, 32), np.uint16)),
               "layers.1.engram.k_weight": ("BF16", np.zeros((1, 32), np.uint16))}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        write_safetensors(path, tensors)
        ckpt = SafetensorsCheckpoint(path)
        load_v41_weights(ckpt, config, 1)
        weight, scale = (np.asarray(ckpt.raw(n)) for n in list(tensors)[:2])
        _kernels.pack_rows(weight, scale, np.empty((rows, config.row_bytes), np.uint8))
        del ckpt, weight, scale
