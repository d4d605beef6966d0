"""A client that has almost no file descriptor left, for ``test_resources.py``.

    python fd_worker.py MASTER LOCAL_DIRECT SPARE

Sets ``ulimit -n`` to 64, holds every descriptor but SPARE, then connects and looks up layer 1 (2 heads of 101 and
103 rows of 8 float32). Prints one JSON line: ``{"outcome": "ok"}`` or the error's class and message. A process
that libzmq aborts prints nothing.
"""
from __future__ import annotations

import json
import os
import resource
import sys

import numpy as np

from engram_store import DistributedStore, EngramStore, EngramStoreConfig

CONFIG = EngramStoreConfig(table_vocab_sizes=[101, 103], embedding_dim=8)

if __name__ == "__main__":
    master, local_direct, spare = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    for fd in held[:spare]:
        os.close(fd)
    try:
        with DistributedStore.connect(master, timeout_ms=1000, local_direct=local_direct) as store, \
                EngramStore(1, CONFIG, store) as layer:
            layer.lookup(np.zeros((1, 1, 2), dtype=np.int64))
        result = {"outcome": "ok"}
    except BaseException as exc:  # what the caller sees is the point
        result = {"outcome": type(exc).__name__, "message": str(exc)}
    print(json.dumps(result), flush=True)
