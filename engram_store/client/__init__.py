"""The client room: :class:`DistributedStore`, metadata from the master and bytes from segment servers.

* ``_store``: the class itself: construction (``connect``, ``embedded``, ``from_env``), metadata, lifecycle;
* ``_writes``: the write path (tickets, same-host ``pwrite``, write requests in flight, renewals, revokes);
* ``_reads``: the read path (local-direct copies, the raw channel or ZeroMQ, failover);
* ``_objects``: replicas and argument checks;
* ``_embedded``: the embedded cluster's master, started in this process;
* ``_mapped``: the one rule for reading this host's mapped segment memory (:func:`read_mapped`).
"""

from ._embedded import start_master
from ._mapped import MappedCheck, object_checks, read_mapped
from ._objects import KeyInfo, ObjectInfo, Replica, as_bytes_view
from ._store import DistributedStore

__all__ = ["DistributedStore", "KeyInfo", "MappedCheck", "ObjectInfo", "Replica", "as_bytes_view", "object_checks",
           "read_mapped", "start_master"]
