"""position_ids are positions in a document: a negative one is refused naming the argument, the bound and the value."""
import numpy as np
import pytest

from engram_model.v41 import V41Config, V41Engram, V41Hasher, v41_store_config
from engram_store import EngramStore, InvalidArgument

CFG = V41Config(layer_ids=[1], max_ngram_size=3, n_heads=1, head_dim=32, engram_vocab_size=2,
                compressed_vocab_size=8, hidden_size=8, hc_mult=2)


def test_negative_position_ids_are_refused():
    hasher = V41Hasher(CFG, np.arange(16, dtype=np.int64) % 8)
    ids = np.arange(6, dtype=np.int64).reshape(1, 6)
    bad = np.array([[0, 1, 2, -5, 4, 5]])
    message = r"position_ids: expected positions >= 0 \(each token's position in its document\), got -5 at \[0, 3\]"
    for call in (lambda: hasher(ids, position_ids=bad), lambda: hasher.step(hasher.begin(1), ids, position_ids=bad),
                 lambda: hasher.hash_numpy(ids, position_ids=bad)):
        with pytest.raises(InvalidArgument, match=message):
            call()
    table = EngramStore(1, v41_store_config(CFG, 1), None)
    table.bind_local([np.zeros((n, CFG.row_bytes), np.uint8) for n in v41_store_config(CFG, 1).table_vocab_sizes])
    K = CFG.cols * CFG.head_dim
    engram = V41Engram(CFG, 1, np.zeros(((CFG.hc_mult + 1) * CFG.hidden_size, K), np.float32),
                       np.ones((CFG.hc_mult, CFG.hidden_size), np.float32),
                       np.ones((CFG.hc_mult, CFG.hidden_size), np.float32), table, hasher)
    hidden = np.zeros((1, 6, CFG.hc_mult, CFG.hidden_size), np.float32)
    with pytest.raises(InvalidArgument, match=message):
        engram.forward(hidden, ids, position_ids=bad)
    with pytest.raises(InvalidArgument, match=message):
        engram.prefetch(ids, position_ids=bad)
    engram.forward(hidden, ids, position_ids=np.array([[0, 1, 2, 0, 1, 2]]))  # a second document from the 4th token
    engram.close()
    table.close()
