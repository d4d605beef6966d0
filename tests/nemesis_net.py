"""Network partitions and full disks for the fault explorer: every process in a network namespace of its own, all routed through
one hub namespace, where a partition is a pair of ``ip rule ... blackhole`` rules.

Only root can make namespaces; elsewhere :meth:`Network.maybe` returns None and histories run on 127.0.0.1 without
partitions (the explorer says so). Every address is inside namespaces this run made itself (10.N.i.2, one /24 per
process, N chosen per run), and the root namespace joins the hub too, so the explorer can ping what it starts.
Shared memory is not touched: a client partitioned from a segment's network address still maps its file when both
are on this host, as clients on one machine do.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import shutil
import subprocess
import sys

NODES = ["master", "segment0", "segment1", "segment2", "client0", "client1", "client2"]
ROOT = len(NODES)  # the explorer's own namespace joins the hub as one more node
NETNS_LOCK = "/run/lock/engram-nemesis-net.lock"  # root only, as namespaces are


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", netns] if netns else []) + ["ip", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


@contextlib.contextmanager
def _netns_lock():
    """Held while a network picks its 10.N and routes it, so that networks built side by side (a test beside this
    one, another run on the host) never pick the same N: an exclusive lock on a file of the host's lock directory
    (``ip netns`` itself locks ``/run/netns``, so that one cannot serve)."""
    os.makedirs(os.path.dirname(NETNS_LOCK), exist_ok=True)
    fd = os.open(NETNS_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (lets go of the lock)


class Network:
    """The namespaces of one history, and the partitions in force."""

    @classmethod
    def maybe(cls, seed: int) -> "Network | None":
        if os.geteuid() != 0 or shutil.which("ip") is None:
            return None
        try:
            return cls(seed)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            print(f"nemesis: no network namespaces, so no partitions: {detail}", file=sys.stderr)
            return None

    def __init__(self, seed: int):
        rng = random.Random(os.getpid() * 7919 + seed)
        self.tag = f"{rng.randrange(16 ** 4):04x}"
        self.hub = f"engram-{self.tag}-hub"
        self.namespaces: list[str] = []
        self.cuts: list[tuple[float, list[tuple[str, str]], str]] = []  # (heal at, rule pairs, description)
        self._rules: dict[tuple[str, str], int] = {}  # how many cuts in force block src -> dst
        try:
            with _netns_lock():  # another network built at the same time (a test beside this one) takes another N
                taken = subprocess.run(["ip", "route"], capture_output=True, text=True, timeout=30).stdout
                free = [n for n in range(100, 250) if f"10.{n}.0.0/16" not in taken]
                self.net = rng.choice(free)  # the run's 10.N.0.0/16
                self._build()
        except BaseException:
            self.close()
            raise

    def _ns(self, node: str) -> str:
        return f"engram-{self.tag}-{node}"

    def address(self, node: str) -> str:
        return f"10.{self.net}.{NODES.index(node) + 1}.2"

    def prefix(self, node: str) -> list[str]:
        return ["ip", "netns", "exec", self._ns(node)]

    def _build(self) -> None:
        _ip("netns", "add", self.hub)
        self.namespaces.append(self.hub)
        _ip("link", "set", "lo", "up", netns=self.hub)
        subprocess.run(["ip", "netns", "exec", self.hub, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"],
                       check=True, capture_output=True, timeout=30)
        for i, node in enumerate(NODES + ["root"]):
            subnet = f"10.{self.net}.{i + 1}"
            inner, outer = f"en{self.tag}{i}a", f"en{self.tag}{i}b"
            if node == "root":
                _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
                _ip("link", "set", outer, "netns", self.hub)
                _ip("addr", "add", f"{subnet}.2/24", "dev", inner)
                _ip("link", "set", inner, "up")
                _ip("route", "add", f"10.{self.net}.0.0/16", "via", f"{subnet}.1")
            else:
                ns = self._ns(node)
                _ip("netns", "add", ns)
                self.namespaces.append(ns)
                _ip("link", "set", "lo", "up", netns=ns)
                _ip("link", "add", inner, "netns", ns, "type", "veth", "peer", "name", outer, "netns", self.hub)
                _ip("addr", "add", f"{subnet}.2/24", "dev", inner, netns=ns)
                _ip("link", "set", inner, "up", netns=ns)
                _ip("route", "add", "default", "via", f"{subnet}.1", netns=ns)
            _ip("addr", "add", f"{subnet}.1/24", "dev", outer, netns=self.hub)
            _ip("link", "set", outer, "up", netns=self.hub)

    # ---- partitions -----------------------------------------------------------------------------

    def partition(self, rng: random.Random, now: float, log) -> None:
        """Cut a pair of processes apart (both ways), or one process from all others, for a while."""
        clients = [n for n in NODES if n.startswith("client")]
        segments = [n for n in NODES if n.startswith("segment")]
        shape = rng.choice(["client-master", "client-master", "segment-master", "client-segment", "isolate"])
        if shape == "client-master":
            pairs = [(rng.choice(clients), "master")]
        elif shape == "segment-master":
            pairs = [(rng.choice(segments), "master")]
        elif shape == "client-segment":
            pairs = [(rng.choice(clients), rng.choice(segments))]
        else:
            lone = rng.choice(NODES)
            pairs = [(lone, other) for other in NODES if other != lone]
        rules = []
        for a, b in pairs:
            for src, dst in ((a, b), (b, a)):
                self.block(src, dst)
                rules.append((src, dst))
        heal_at = now + rng.uniform(0.3, 4.0)
        what = " | ".join(f"{a} x {b}" for a, b in pairs) if shape != "isolate" else f"{pairs[0][0]} isolated"
        self.cuts.append((heal_at, rules, what))
        log(f"FAULT partition {what} until {heal_at:.3f}")

    def block(self, src: str, dst: str) -> None:
        """Drop every packet from ``src`` to ``dst`` (until as many :meth:`unblock` calls)."""
        self._rules[(src, dst)] = self._rules.get((src, dst), 0) + 1
        if self._rules[(src, dst)] == 1:
            _ip("rule", "add", "from", self.address(src), "to", self.address(dst), "blackhole", "pref", "100",
                netns=self.hub)

    def unblock(self, src: str, dst: str) -> None:
        self._rules[(src, dst)] -= 1
        if not self._rules[(src, dst)]:
            del self._rules[(src, dst)]
            _ip("rule", "del", "from", self.address(src), "to", self.address(dst), "blackhole", "pref", "100",
                netns=self.hub, check=False)

    def tend(self, now: float, log) -> None:
        for cut in [c for c in self.cuts if c[0] <= now]:
            self._heal(cut, log)

    def heal(self, log) -> None:
        for cut in list(self.cuts):
            self._heal(cut, log)

    def _heal(self, cut, log) -> None:
        self.cuts.remove(cut)
        for src, dst in cut[1]:
            self.unblock(src, dst)
        log(f"partition healed: {cut[2]}")

    def close(self) -> None:
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.namespaces = []


class FileSystem:
    """A small tmpfs of the history's own (root only) where layers and durable segments keep their files; a fault
    fills it to the last byte for a while."""

    SIZE = "48m"

    @classmethod
    def maybe(cls, path: str) -> "FileSystem | None":
        if os.geteuid() != 0:
            return None
        os.makedirs(path)
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={cls.SIZE}", "tmpfs", path],
                                 capture_output=True, timeout=30)
        if mounted.returncode != 0:
            print(f"nemesis: no tmpfs, so no full disks: {mounted.stderr.decode().strip()}", file=sys.stderr)
            return None
        return cls(path)

    def __init__(self, path: str):
        self.path = path
        self.full_until = 0.0
        self._filler = os.path.join(path, ".filler")

    def fill(self, until: float) -> None:
        free = shutil.disk_usage(self.path).free
        fd = os.open(self._filler, os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            for size in (free, free // 2, free // 4):  # tmpfs may refuse the last pages: take what it gives
                try:
                    os.posix_fallocate(fd, 0, max(size, 1))
                    break
                except OSError:
                    continue
            while True:  # and the crumbs
                try:
                    os.posix_fallocate(fd, os.fstat(fd).st_size, 4096)
                except OSError:
                    break
        finally:
            os.close(fd)
        self.full_until = until

    def free(self) -> None:
        try:
            os.unlink(self._filler)
        except FileNotFoundError:
            pass
        self.full_until = 0.0

    def close(self) -> None:
        subprocess.run(["umount", "-l", self.path], capture_output=True, timeout=30)
