"""How many reader threads a segment starts: each serves reads on a socket of its own."""

from __future__ import annotations

import os

#: Reader threads a segment starts by default on a host with spare cores (see :func:`default_readers`): each
#: serves reads on a socket of its own, so several clients' requests are received, gathered and answered at
#: once (the gather and the socket I/O release the GIL).
DEFAULT_READERS = 2
#: Below this many CPUs a segment starts one reader: the clients and the segment already share every core,
#: and two readers' GIL hand-offs cost more than the second brings (2-core VM: 13-36% fewer raw reads/s with
#: 2 and 4 client processes, within noise with 1 and 8; bench/bench_store.py's readers section).
READERS_MIN_CPUS = 4
MAX_READERS = 64

def default_readers() -> int:
    """Reader threads a segment starts unless told: :data:`DEFAULT_READERS`, or 1 on a host with fewer than
    :data:`READERS_MIN_CPUS` CPUs available to this process."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return DEFAULT_READERS if cpus >= READERS_MIN_CPUS else 1
