"""Removing a layer is all or nothing: a read lease on any of its objects refuses the whole remove."""
import numpy as np
import pytest

from engram_store import DistributedStore, EngramStore, EngramStoreConfig, LeaseActive

pytestmark = pytest.mark.timeout(120)


def test_a_lease_on_one_head_refuses_the_whole_remove_and_the_layer_stays_readable():
    config = EngramStoreConfig(table_vocab_sizes=[101, 103, 107], embedding_dim=8)
    tables = [np.full((n, 8), h, np.float32) for h, n in enumerate(config.table_vocab_sizes)]
    with DistributedStore.embedded(segment_size="16MiB") as store:
        layer = EngramStore(1, config, store)
        layer.populate(tables)
        store.get("engram:l1:h2")  # a reader's lease on the last head
        with pytest.raises(LeaseActive, match="engram:l1:h2.*nothing of the 4 objects was removed"):
            layer.remove_from_store()
        assert sorted(k.key for k in store.list_keys("engram:l1:")) == [
            "engram:l1:h0", "engram:l1:h1", "engram:l1:h2", "engram:l1:manifest"]
        ids = np.zeros((1, 2, 3), np.int64)
        np.testing.assert_array_equal(EngramStore(1, config, store).lookup(ids)[0, 0, :, 0], [0, 1, 2])
        assert layer.remove_from_store(force=True) == 3
        assert store.list_keys("engram:") == []
