import pytest


@pytest.fixture
def embedded():
    """A master and one 64 MiB segment inside the test process; closed after the test."""
    from engram_store import DistributedStore

    with DistributedStore.embedded(segment_size="64MiB") as store:
        yield store
