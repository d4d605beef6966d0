import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from engram_store.testing import Cluster  # noqa: E402


@pytest.fixture
def cluster():
    """A master and two 64 MiB segments as real processes on 127.0.0.1; killed and reaped after the test."""
    with Cluster(segments=2, heartbeat_timeout_s=3.0, lease_ttl_s=2.0) as c:
        yield c


@pytest.fixture
def embedded():
    from engram_store import DistributedStore

    with DistributedStore.embedded(segment_size="64MiB") as store:
        yield store
