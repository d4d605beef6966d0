import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="module")
def mc_store():
    """engram_store.compat's MooncakeDistributedStore, set up as Mooncake's users do (embedded: no master given)."""
    from engram_store.compat import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "", 64 << 20, 0, "tcp", "", "") == 0
    try:
        yield store
    finally:
        store.close()
