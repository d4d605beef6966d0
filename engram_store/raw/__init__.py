"""The raw read room: range reads over plain TCP, both ends of the channel and the one description of its frame.

* ``frame``: the frame (version, ops, statuses, every field, the bounds and deadlines it lives under) and the
  helpers both ends share (whole receives, whole sends, socket timeouts);
* ``limits``: the server's bounds and deadlines, in one place;
* the server, which a segment builds with what it needs (its memory, its generations, its metrics):
  ``_server`` (:class:`RawReadServer`: the listener, the event loop, tokens, caps), ``_receive`` (headers and
  ranges the loop holds), ``_serving`` (the serving threads), ``_state`` (a connection's and a thread's buffers);
* the client: ``_client`` (:class:`RawChannel`: one connection to one segment), ``_routes`` (:class:`RawRoutes`:
  what a client knows of its segments' channels: ports, back-offs, the channels its threads hold).

The round trips of each side are Numba kernels in :mod:`engram_store.kernels.raw_io` (GIL-free; the kinds of the
frame's header are passed in). This room imports the wire, kernels and ground rooms only; the segment and client
rooms import it.
"""

from . import frame, limits
from ._client import RawChannel, RawChannelRefused, raw_reads_default
from ._routes import RawPort, RawRoutes, port_of
from ._server import RawReadServer
from .frame import VERSION

__all__ = [
    "VERSION",
    "RawChannel",
    "RawChannelRefused",
    "RawPort",
    "RawReadServer",
    "RawRoutes",
    "frame",
    "limits",
    "port_of",
    "raw_reads_default",
]
