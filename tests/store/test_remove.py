"""Removing a layer is all or nothing: a read lease on any of its objects refuses the whole remove; a populate is
undone by what its puts wrote, never by key."""
import numpy as np
import pytest

from engram_store import DistributedStore, EngramStore, EngramStoreConfig, InvalidArgument, LeaseActive, ObjectExists

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
        # The refused remove left the populate to undo; an undo goes through leases, as a forced remove does.
        assert layer.undo_populate() == 3
        assert store.list_keys("engram:") == []


def test_a_populate_that_cannot_publish_undoes_its_own_heads_and_never_another_writers(monkeypatch):
    """Writer A has put its heads and started its manifest when writer B removes the layer with force (which ends
    A's manifest put) and populates it again. A's populate must fail, and undoing it must leave B's acknowledged
    layer whole: A removes the objects its own puts wrote, not whatever is under its keys by then."""
    from engram_store import ObjectNotFound, WriteFenced
    from engram_store.testing import Cluster

    config = EngramStoreConfig(table_vocab_sizes=[101, 103, 107], embedding_dim=8)
    a_tables = [np.full((n, 8), 1 + h, np.float32) for h, n in enumerate(config.table_vocab_sizes)]
    b_tables = [np.full((n, 8), 10 + h, np.float32) for h, n in enumerate(config.table_vocab_sizes)]
    with Cluster(segments=1) as cluster, DistributedStore(cluster.address) as sa, \
            DistributedStore(cluster.address) as sb:
        a, b = EngramStore(1, config, sa), EngramStore(1, config, sb)
        put_start = sa._put_start

        def b_goes_between(keys, sizes, replica_num):
            started = put_start(keys, sizes, replica_num)
            if keys == ["engram:l1:manifest"]:
                b.remove_from_store(force=True)
                b.populate(b_tables)
            return started

        monkeypatch.setattr(sa, "_put_start", b_goes_between)
        with pytest.raises((WriteFenced, ObjectNotFound)):
            a.populate(a_tables)
        monkeypatch.undo()
        ids = np.zeros((1, 2, 3), np.int64)
        np.testing.assert_array_equal(EngramStore(1, config, sa).lookup(ids)[0, 0, :, 0], [10, 11, 12])
        assert b.verify() == [0, 1, 2]  # every head matches its manifest
        assert sorted(k.key for k in sa.list_keys("engram:l1:")) == [
            "engram:l1:h0", "engram:l1:h1", "engram:l1:h2", "engram:l1:manifest"]


def test_undo_populate_takes_back_what_the_populate_wrote_and_nothing_written_since():
    config = EngramStoreConfig(table_vocab_sizes=[101, 103, 107], embedding_dim=8)
    ones = [np.full((n, 8), 1 + h, np.float32) for h, n in enumerate(config.table_vocab_sizes)]
    twos = [np.full((n, 8), 10 + h, np.float32) for h, n in enumerate(config.table_vocab_sizes)]
    ids = np.zeros((1, 2, 3), np.int64)
    with DistributedStore.embedded(segment_size="16MiB") as store:
        a, b = EngramStore(1, config, store), EngramStore(1, config, store)
        with pytest.raises(InvalidArgument, match="undo_populate: layer 1: this EngramStore has no populate of it"):
            a.undo_populate()
        # Its own populate: manifest and heads go.
        a.populate(ones)
        assert a.undo_populate() == 3
        assert store.list_keys("engram:") == []
        with pytest.raises(InvalidArgument, match="undone already"):
            a.undo_populate()
        # A refused populate wrote nothing: the undo still takes back the one that succeeded before it.
        a.populate(ones)
        with pytest.raises(ObjectExists):
            a.populate(twos)
        assert a.undo_populate() == 3 and store.list_keys("engram:") == []
        # A layer this EngramStore removed leaves nothing to undo.
        a.populate(ones)
        assert a.remove_from_store() == 3
        with pytest.raises(InvalidArgument, match="last removed it"):
            a.undo_populate()
        # Another writer removed the layer with force and populated it again: A's undo leaves it whole.
        a.populate(ones)
        b.remove_from_store(force=True)
        b.populate(twos)
        assert a.undo_populate() == 0
        assert b.verify() == [0, 1, 2]
        np.testing.assert_array_equal(EngramStore(1, config, store).lookup(ids)[0, 0, :, 0], [10, 11, 12])
        assert b.remove_from_store(force=True) == 3
        # Head shards: only the one that published the layer takes the manifest back with its head.
        shards = [EngramStore(1, config, store, heads=[h]) for h in range(3)]
        for h, shard in enumerate(shards):
            shard.populate([ones[h]])
        assert store.batch_is_exist(["engram:l1:manifest"]) == [True]
        assert shards[2].undo_populate() == 1
        assert sorted(k.key for k in store.list_keys("engram:l1:")) == ["engram:l1:h0", "engram:l1:h1"]
        assert shards[0].undo_populate() == 1 and shards[1].undo_populate() == 1
        assert store.list_keys("engram:") == []
        for layer in [a, b, *shards]:
            layer.close()


def test_undo_populate_of_a_layer_kept_in_memory_is_a_clear_error():
    config = EngramStoreConfig(table_vocab_sizes=[11], embedding_dim=4)
    layer = EngramStore(1, config, None)
    layer.bind_local([np.zeros((11, 4), np.float32)])
    with pytest.raises(InvalidArgument, match="undo_populate: layer 1 of this EngramStore is not kept in a store"):
        layer.undo_populate()
    layer.close()
