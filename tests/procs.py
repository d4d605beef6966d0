"""Test-side name for :mod:`engram_store.testing` (the process launchers tests and benchmarks share)."""
from engram_store.testing import (  # noqa: F401
    START_TIMEOUT_S,
    Cluster,
    Proc,
    free_port,
    start_master,
    start_segment,
    wait_ping,
)
