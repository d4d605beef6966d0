"""The client room: :class:`DistributedStore`, metadata from the master and bytes from segment servers.

* ``_store``: the class itself: construction (``connect``, ``embedded``, ``from_env``), metadata, lifecycle;
* ``_writes``: the write path (tickets, same-host ``pwrite``, write requests in flight, renewals, revokes);
* ``_reads``: the read path (local-direct copies, the raw channel or ZeroMQ, failover);
* ``_raw_client``: a connection to one segment's raw read channel; ``_raw_routes``: what a client knows of its
  segments' raw channels (ports, back-offs, the channels its threads hold);
* ``_objects``: replicas and argument checks;
* ``_mapped``: the one rule for reading this host's mapped segment memory (:func:`read_mapped`).
"""

from ._mapped import object_checks, read_mapped
from ._objects import KeyInfo, ObjectInfo, Replica, as_bytes_view
from ._raw_client import RawChannel, RawChannelRefused, raw_reads_default
from ._raw_routes import RawPort, RawRoutes, port_of
from ._store import DistributedStore

__all__ = ["DistributedStore", "KeyInfo", "ObjectInfo", "RawChannel", "RawChannelRefused", "RawPort", "RawRoutes",
           "Replica", "as_bytes_view", "object_checks", "port_of", "raw_reads_default", "read_mapped"]
