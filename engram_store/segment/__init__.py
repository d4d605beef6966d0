"""The segment room: one memory segment behind a server (``engram-segment``).

* ``_server``: :class:`SegmentServer`, its ZeroMQ handlers (writes, reads, pings), reader sockets, registration
  and heartbeats with the master;
* ``_memory``: the segment's memory (a sealed memfd, or a durable file); ``_handover``: that memory handed to
  processes on the host as descriptors; ``_catalog``: the objects it holds, offered back when it registers again;
  ``_fence``: the checks a write passes before it lands;
* ``cli``: the ``engram-segment`` command.
"""

from ._catalog import Catalog
from ._fence import WriteFence
from ._memory import SegmentMemory, host_id, pwrite_all, reap_orphans
from ._server import DEFAULT_READERS, MAX_RANGES, MAX_READ_BYTES, MAX_READERS, SegmentServer, default_readers

__all__ = [
    "DEFAULT_READERS",
    "MAX_RANGES",
    "MAX_READERS",
    "MAX_READ_BYTES",
    "Catalog",
    "SegmentMemory",
    "SegmentServer",
    "WriteFence",
    "default_readers",
    "host_id",
    "pwrite_all",
    "reap_orphans",
]
