"""Mooncake's own processes, from its wheel, on 127.0.0.1: for the bridge tests and ``bench --backend mooncake``.

Needs ``pip install "engram[mooncake]"`` (Mooncake's non-CUDA wheel) and, on Debian/Ubuntu, ``libibverbs1``.
Every process runs on free loopback ports, is waited on until it accepts connections (never a fixed sleep),
and is killed and reaped by ``close()`` (or the ``with`` block)::

    with MooncakeMaster() as master, MooncakeSegment(master, size=256 << 20) as segment:
        store = connect(master.address)            # a client that mounts no memory: every read is remote
        ...
        store.close()

Transfer engines find each other with ``P2PHANDSHAKE`` (they exchange segment descriptors directly), so no
HTTP metadata server or etcd is started.
"""
from __future__ import annotations

import os
import socket
import time
import urllib.request

from engram_store.testing import Proc, free_port

#: Longest wait for a process to accept connections, or for a client's ``setup`` to succeed.
START_TIMEOUT_S = 60.0
#: Transfer engines handshake peer to peer: no metadata service to run.
METADATA_SERVER = "P2PHANDSHAKE"
#: Mooncake's default read lease (``-default_kv_lease_ttl``): ``remove`` without force is refused this long
#: after a read. Leases never drop data; eviction does, and tables are hard-pinned against it.
DEFAULT_LEASE_TTL_MS = 10_000
#: Port-allocation races (a free port taken before the process binds it) are retried this many times.
START_ATTEMPTS = 3


def wheel_binary(name: str) -> str:
    """The path of ``name`` (``mooncake_master``, ``mooncake_client``) inside the installed ``mooncake`` package.

    The console scripts of the same names are Python shims that ``exec`` these; calling the binary keeps the
    child's pid the one we kill.
    """
    import mooncake

    path = os.path.join(os.path.dirname(os.path.abspath(mooncake.__file__)), name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{name}: not found in the mooncake package at {path} "
                                "(install engram[mooncake]: the mooncake-transfer-engine-non-cuda wheel)")
    if not os.access(path, os.X_OK):
        os.chmod(path, os.stat(path).st_mode | 0o111)
    return path


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _wait_accepting(proc: Proc, port: int, what: str, timeout_s: float) -> None:
    """Until ``port`` accepts a TCP connection; raise (with the process log) if ``proc`` dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    delay_s = 0.01
    while not _accepts(port):
        if not proc.alive():
            raise RuntimeError(f"{what} exited with code {proc.popen.returncode} before accepting on "
                               f"127.0.0.1:{port}:\n{proc.output()[-4000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not accept on 127.0.0.1:{port} within {timeout_s:.0f} s:\n"
                               f"{proc.output()[-4000:]}")
        time.sleep(delay_s)
        delay_s = min(delay_s * 2, 0.2)


def _start(make_args, name: str, timeout_s: float) -> tuple[Proc, int]:
    """Start ``make_args(port)`` on a fresh free port until it accepts (retrying a lost port race)."""
    for attempt in range(START_ATTEMPTS):
        port = free_port(reserve=False)  # mooncake_master may bind without SO_REUSEADDR
        proc = Proc(make_args(port), name)
        try:
            _wait_accepting(proc, port, name, timeout_s)
            return proc, port
        except RuntimeError:
            proc_alive = proc.alive()
            proc.close()
            if proc_alive or attempt == START_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


class MooncakeMaster:
    """``mooncake_master`` on 127.0.0.1 with free RPC and metrics ports; ``close()`` kills and reaps it.

    ``lease_ttl_ms``: how long a read protects an object from ``remove`` without force.
    """

    def __init__(self, *, lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS, extra: list[str] | None = None,
                 timeout_s: float = START_TIMEOUT_S):
        binary = wheel_binary("mooncake_master")

        def args(port: int) -> list[str]:
            self.metrics_port = free_port(reserve=False)
            return [binary, f"-rpc_port={port}", "-rpc_address=127.0.0.1",
                    f"-metrics_port={self.metrics_port}", "-metrics_host=127.0.0.1",
                    "-enable_http_metadata_server=false", f"-default_kv_lease_ttl={int(lease_ttl_ms)}",
                    *(extra or [])]

        self.proc, self.port = _start(args, "mooncake-master", timeout_s)
        self.address = f"127.0.0.1:{self.port}"

    def metrics(self) -> dict[str, float]:
        """The master's Prometheus gauges and counters (``name{labels}`` -> value) from its metrics port."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    values[name] = float(value)
                except ValueError:
                    pass
        return values

    def close(self) -> None:
        self.proc.close()

    def __enter__(self) -> "MooncakeMaster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MooncakeSegment:
    """``mooncake_client`` holding a ``size``-byte segment for ``master``: table bytes in another process."""

    def __init__(self, master: MooncakeMaster, size: int = 256 << 20, timeout_s: float = START_TIMEOUT_S):
        binary = wheel_binary("mooncake_client")
        self.size = int(size)

        def args(port: int) -> list[str]:
            return [binary, "-host=127.0.0.1", f"-port={port}", f"-global_segment_size={self.size}",
                    f"-master_server_address={master.address}", f"-metadata_server={METADATA_SERVER}",
                    "-protocol=tcp", "-local_buffer_size=0"]

        # It mounts its segment with the master before it starts serving on its port.
        self.proc, self.port = _start(args, "mooncake-segment", timeout_s)

    def close(self) -> None:
        self.proc.close()

    def __enter__(self) -> "MooncakeSegment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(master_address: str, *, segment_size: int = 0, local_buffer_size: int = 16 << 20,
            timeout_s: float = START_TIMEOUT_S):
    """A ``mooncake.store.MooncakeDistributedStore`` set up against ``master_address`` over TCP on loopback.

    ``segment_size`` bytes of this process are mounted as a segment (0: none, so tables live in other
    processes). ``setup`` is retried until it succeeds or ``timeout_s`` passes.
    """
    from mooncake.store import MooncakeDistributedStore

    deadline = time.monotonic() + timeout_s
    delay_s = 0.05
    while True:
        store = MooncakeDistributedStore()
        code = store.setup("127.0.0.1", METADATA_SERVER, int(segment_size), int(local_buffer_size), "tcp", "",
                           master_address)
        if code == 0:
            return store
        store.close()
        if time.monotonic() > deadline:
            raise RuntimeError(f"MooncakeDistributedStore.setup against {master_address} returned {code} "
                               f"for {timeout_s:.0f} s")
        time.sleep(delay_s)
        delay_s = min(delay_s * 2, 1.0)
