"""A client process of the fault explorer (``tests/nemesis.py``): reads one JSON command per line on stdin, runs it
against the store, and answers one JSON line on stdout.

Rows carry their identity, so every read can be checked on the spot: row ``r`` of head ``h`` of layer ``L``,
written by populate number ``G`` (its generation), is ``[L, G, h, r, G]`` as float32 (exact below 2**24): 20
bytes, so that a ``disk_dir`` page of them has room for its checksum. A lookup
answers which generations it saw and describes every row that is not exactly the one asked for; a get answers the
generation of the bytes it read, after checking that they are the pattern that generation writes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback

import numpy as np

import engram_store
from engram_store import DistributedStore, EngramError, EngramStore, EngramStoreConfig
from engram_store.disk._host_cache import DIE_MID_FILL_ENV

import nemesis_ops as ops
import nemesis_rows as R

SIZES = R.SMALL_SIZES
DIM = R.SMALL_DIM
CONFIG = EngramStoreConfig(table_vocab_sizes=SIZES, embedding_dim=DIM)
#: Bytes of a key-value object: a 16-byte header (generation, length) and a pattern derived from both.
VALUE_BYTES = 3000
#: The row caches of a client's disk layers, by its pid: its own, or the host's asked for at one size or another (a
#: client asking another size attaches to the one there), so clients killed mid-fill, mid-replay of the host's
#: curve or mid-attach leave the others a cache to check every row against.
DISK_CACHES = ((1 << 16, "process"), (1 << 16, "host"), (1 << 17, "host"))
#: The row cache of a store table opened as the "cache" variant.
STORE_CACHE_BYTES = 1 << 20


def tables(layer: int, generation: int) -> list[np.ndarray]:
    """The small layers' tables (``nemesis_rows.tables`` has every kind's)."""
    return R.tables("store", layer, generation)


def value(key: str, generation: int) -> bytes:
    body = np.frombuffer((f"{key}|{generation}|" * VALUE_BYTES).encode()[:VALUE_BYTES - 16], dtype=np.uint8)
    return np.array([generation, VALUE_BYTES], dtype=np.int64).tobytes() + body.tobytes()


def read_value(key: str, data: bytes) -> dict:
    if len(data) < 16:
        return {"bad": f"{len(data)} bytes"}
    generation = int(np.frombuffer(data[:8], dtype=np.int64)[0])
    if data != value(key, generation):
        return {"bad": f"bytes of generation {generation} differ from what it wrote"}
    return {"gen": generation}


def check_rows(rows: np.ndarray, ids: np.ndarray, layer: int) -> dict:
    """Which generations ``rows [B, L, H, D]`` come from, and every row that is not the one ``ids`` asked for."""
    return R.check_float(rows, ids, layer)


def _shard(variant: str) -> tuple[int, int] | None:
    """``(head_start, part)`` of a variant's head shard: "h3" is column 3, "t1" the second half of the columns."""
    if variant[:1] == "h":
        return int(variant[1:]), 1
    if variant[:1] == "t":
        half = R.v41().cols // 2
        return int(variant[1:]) * half, half
    return None


class Table:
    """One ``EngramStore`` a client opened (``instance`` numbers them in the client), with its ``V41Rows`` for the
    V4.1 kinds (``shard``: ``(head_start, part)``, the columns a head shard holds, else None)."""

    def __init__(self, es: EngramStore, instance: int, kind: str, layer: int, shard: tuple[int, int] | None,
                 worker: "Worker"):
        self.es, self.instance, self.shard, self.worker = es, instance, shard, worker
        self.rows = None
        if R.family(kind) == "v41":
            from engram_model.v41 import V41Rows
            self.rows = V41Rows(es, R.v41(), layer, threads=1)

    def close(self) -> None:
        try:
            if self.rows is not None:
                self.rows.close()
        finally:
            self.es.close()


class Worker:
    def __init__(self, master: str, local_dir: str, disk_dir: str, local_direct: bool, timeout_ms: int,
                 cache: str = "process"):
        self.master, self.local_dir, self.disk_dir = master, local_dir, disk_dir
        self.local_direct, self.timeout_ms = local_direct, timeout_ms
        self.host_cache = cache.startswith("host")
        if cache.startswith("host-die:"):  # the host cache's test hook: this process dies mid-fill
            os.environ[DIE_MID_FILL_ENV] = cache.split(":", 1)[1]
        self.store: DistributedStore | None = None
        self.tables: dict[tuple[str, int, str], Table] = {}  # (kind, layer, variant) -> its open table
        self.instances = 0
        self._numbering = threading.Lock()
        self.populated: dict[tuple[str, int], int] = {}  # the populate each open layer's undo would take back:
        # its last one that succeeded (a refused populate wrote nothing), until a remove
        self.cli = None  # an engram-layers process waiting for its arguments (nemesis_ops.cli_remove)

    def _store(self) -> DistributedStore:
        if self.store is None:
            self.store = DistributedStore.connect(self.master, timeout_ms=self.timeout_ms,
                                                  local_direct=self.local_direct)
        return self.store

    def table(self, kind: str, layer: int, variant: str = "") -> Table:
        """The layer's open table of ``variant``: "" (plain), "cache" (a store table with a row cache), "h0" or
        "h1" (a V4.1 layer's head shard of that column), "t0" or "t1" (half its columns: a tensor-parallel rank of
        two)."""
        table = self.tables.get((kind, layer, variant))
        if table is None:
            table = self.tables[(kind, layer, variant)] = self.open_table(kind, layer, variant)
        return table

    def open_table(self, kind: str, layer: int, variant: str = "") -> Table:
        """A table of the layer of its own, numbered, not kept: the caller closes it."""
        shard = _shard(variant)
        with self._numbering:  # (a reload's reader opens tables on a thread of its own)
            self.instances += 1
            instance = self.instances
        return Table(self._open(kind, layer, variant, shard), instance, kind, layer, shard, self)

    def _open(self, kind: str, layer: int, variant: str, shard: tuple[int, int] | None) -> EngramStore:
        config, place = R.config(kind, layer), R.place(kind)
        heads = None if shard is None else list(range(shard[0], shard[0] + shard[1]))
        if place == "store":
            return EngramStore(layer, config, self._store(), heads=heads,
                               row_cache_bytes=STORE_CACHE_BYTES if variant == "cache" else 0)
        if place == "local":
            return EngramStore(layer, config, local_dir=self.local_dir, heads=heads)
        cache_bytes, scope = DISK_CACHES[os.getpid() % len(DISK_CACHES)]
        if self.host_cache:  # the explorer's stream of faults at rest asked for the host's, at any size
            scope = "host"
        return EngramStore(layer, config, disk_dir=self.disk_dir, heads=heads, row_cache_bytes=cache_bytes,
                           cache_scope=scope)

    def _layer(self, kind: str, layer: int) -> EngramStore:
        return self.table(kind, layer).es

    def drop_table(self, kind: str, layer: int, variant: str) -> None:
        if not variant:
            self.populated.pop((kind, layer), None)
        table = self.tables.pop((kind, layer, variant), None)
        if table is not None:
            table.close()

    def _drop(self, kind: str, layer: int) -> None:
        for key in [k for k in self.tables if k[:2] == (kind, layer)]:
            self.drop_table(*key)
        self.populated.pop((kind, layer), None)

    def run(self, cmd: dict) -> dict:
        op = cmd["op"]
        if op in OPS:
            return OPS[op](self, cmd)
        if op == "populate":
            self._layer(cmd["kind"], cmd["layer"]).populate(R.tables(cmd["kind"], cmd["layer"], cmd["gen"]),
                                                            replica_num=cmd.get("replicas", 1))
            self.populated[(cmd["kind"], cmd["layer"])] = cmd["gen"]
            return {}
        if op == "undo":
            gen = self.populated.get((cmd["kind"], cmd["layer"]))
            removed = self._layer(cmd["kind"], cmd["layer"]).undo_populate()
            self.populated.pop((cmd["kind"], cmd["layer"]), None)
            return {"removed": removed, "undid": gen}
        if op == "lookup":
            return in_child(lambda: self._child_lookup(cmd)) if cmd.get("fork") else ops.lookup(self, cmd)
        if op == "remove":
            try:
                removed = self._layer(cmd["kind"], cmd["layer"]).remove_from_store(force=cmd.get("force", False))
            finally:
                self._drop(cmd["kind"], cmd["layer"])
            return {"removed": removed}
        if op == "verify":
            return {"heads": self._layer(cmd["kind"], cmd["layer"]).verify()}
        if op == "reopen":
            self._drop(cmd["kind"], cmd["layer"])
            return {}
        if op == "put":
            self._store().put(cmd["key"], value(cmd["key"], cmd["gen"]), replica_num=cmd.get("replicas", 1))
            return {}
        if op == "get":
            return read_value(cmd["key"], bytes(self._store().get(cmd["key"])))
        if op == "remove_key":
            self._store().remove(cmd["key"])
            return {}
        if op == "remove_all":
            return {"removed": self._store().remove_all(force=cmd.get("force", False))}
        if op == "pause":  # (a scenario's wait between two writes: past the master's reuse delay)
            time.sleep(cmd["s"])
            return {}
        raise ValueError(f"unknown op {op!r}")

    def _child_lookup(self, cmd: dict) -> dict:
        """A lookup in a forked child: tables it opens are numbered apart from its parent's (and other children's)."""
        self.instances = os.getpid() << 20
        return ops.lookup(self, cmd)

    def status(self, cmd: dict) -> dict:
        status = self._store().status()
        return {"objects": status["objects"], "lost": status["lost"], "lost_keys": status["lost_keys"],
                "segments": len(status["segments"]), "segment_ids": [s["segment_id"] for s in status["segments"]],
                "confirmed": sum(1 for s in status["segments"] if s.get("confirmed", True))}

    def store_layers(self, cmd: dict) -> dict:
        """The store's layer objects: ``{layer: {"manifest": bool, "heads": [h, ...], "lost": [...], "sizes": n}}``
        (``sizes``: how many heads the manifest names)."""
        import re
        out: dict[str, dict] = {}
        for info in self._store().list_keys("engram:l"):
            m = re.match(r"^engram:l(\d+):(?:h(\d+)|(manifest))$", info.key)
            if not m or info.state == "pending":
                continue
            entry = out.setdefault(m.group(1), {"manifest": False, "heads": [], "lost": []})
            if m.group(3):
                entry["manifest"] = True
            else:
                entry["lost" if info.state == "lost" else "heads"].append(int(m.group(2)))
        for layer, entry in out.items():
            if entry["manifest"]:
                try:
                    manifest = json.loads(bytes(self._store().get(f"engram:l{layer}:manifest", lease=False)))
                    entry["sizes"] = len(manifest["table_vocab_sizes"])
                except (EngramError, ValueError, KeyError, TypeError) as exc:
                    entry["unreadable"] = f"{type(exc).__name__}: {exc}"[:300]
        return {"layers": out}

    def _close_midcall(self, cmd: dict) -> dict:
        """Close the store (and every layer on it) while another thread is in a lookup; then start afresh."""
        es = self._layer("store", cmd["layer"])
        errors = ops.ReaderErrors()

        def read():
            ids = np.zeros((1, 8, len(SIZES)), dtype=np.int64)
            try:
                for _ in range(50):
                    es.lookup(ids)
            except EngramError as exc:
                errors.add(exc)

        thread = threading.Thread(target=read)
        thread.start()
        time.sleep(cmd.get("after_s", 0.0))
        for key in {k[:2] for k in self.tables if R.place(k[0]) == "store"}:
            self._drop(*key)
        if self.store is not None:
            self.store.close()
            self.store = None
        thread.join(timeout=60)
        if thread.is_alive():
            raise RuntimeError("a lookup did not return within 60 s of its store closing")
        return errors.reply()


#: Operations by name, beyond those ``Worker.run`` spells out.
OPS = {"status": Worker.status, "layers": Worker.store_layers, "close_midcall": Worker._close_midcall,
       "close_table": ops.close_table, "cli_remove": ops.cli_remove, "reload": ops.reload}


def in_child(work) -> dict:
    """``work()`` in a child forked from this process, which has used the store: its answer, or its error raised
    here again (a child that dies or hangs is a crash of ours). Interrupted (SIGINT), the child is killed."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        signal.alarm(60)
        try:
            out = {"ok": True, **work()}
        except EngramError as exc:
            out = {"ok": False, "error": type(exc).__name__, "message": str(exc)[:500],
                   **getattr(exc, "nemesis_partial", {})}
        except BaseException:
            out = {"ok": False, "error": "crash", "message": traceback.format_exc()[-2000:]}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    chunks = []
    try:
        while chunk := os.read(r, 1 << 16):
            chunks.append(chunk)
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        raise
    finally:
        os.close(r)
        status = os.waitpid(pid, 0)[1]
    if not chunks:
        raise RuntimeError(f"the forked child died without an answer (exit status {os.waitstatus_to_exitcode(status)})")
    out = json.loads(b"".join(chunks))
    if not out.pop("ok"):
        cls = getattr(engram_store, out["error"], None)
        if not (isinstance(cls, type) and issubclass(cls, EngramError)):
            raise RuntimeError(f"the forked child failed: {out['message']}")
        exc = cls(f"(in a forked child) {out.pop('message')}")
        exc.nemesis_partial = {k: v for k, v in out.items() if k != "error"}
        raise exc
    return out


class Interrupts:
    """SIGINT raises KeyboardInterrupt only inside an operation (the explorer sends it to a client mid-call); one
    that comes between operations is counted and ignored, so a reply line is never cut short."""

    def __init__(self):
        self.armed = False
        self.between = 0
        signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum, frame) -> None:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        self.between += 1


def answer(worker: Worker, cmd: dict, interrupts: Interrupts) -> dict:
    """The reply to one command: its result, or the error it ended with (and what it read before, if a read)."""
    start = time.monotonic()
    try:
        interrupts.armed = True
        result = worker.run(cmd)
        interrupts.armed = False
        return {"id": cmd["id"], "ok": True, **result, "took": round(time.monotonic() - start, 3)}
    except KeyboardInterrupt as exc:
        error, message, partial = "Interrupted", traceback.format_exc()[-1500:], getattr(exc, "nemesis_partial", {})
    except EngramError as exc:
        error, message, partial = type(exc).__name__, str(exc)[:500], getattr(exc, "nemesis_partial", {})
    except Exception as exc:  # a bug of ours, not a store error: the checker reports it
        error, message = "crash:" + type(exc).__name__, traceback.format_exc()[-2000:]
        partial = getattr(exc, "nemesis_partial", {})
    finally:
        interrupts.armed = False
    return {"id": cmd["id"], "ok": False, "error": error, "message": message, **partial,
            "took": round(time.monotonic() - start, 3)}


def main() -> int:
    master, local_dir, disk_dir, local_direct, timeout_ms = sys.argv[1:6]
    if len(sys.argv) > 7:  # the explorer's: host caches in its directory, gone with it
        os.environ["ENGRAM_SHM_DIR"] = sys.argv[7]
    ops.env_path()
    worker = Worker(master, local_dir, disk_dir, local_direct == "1", int(timeout_ms),
                    sys.argv[6] if len(sys.argv) > 6 else "process")
    role = sys.argv[8] if len(sys.argv) > 8 else "0"  # "1": a churn client, "2": SIGINT may come (nemesis_churn)
    if role in ("1", "2"):
        # Numba loads its registries (modules it imports) on the first cached kernel a process loads: a SIGINT in
        # that import leaves them half-made, and every kernel loaded after fails with KeyError: "duplicate
        # registration" (Numba's, not the store's: seed 960002). So they are loaded before the client is ready.
        from numba.core.registry import cpu_target
        cpu_target.target_context.refresh()
    if role == "1":  # a churn client: its first engram-layers starts importing now
        worker.cli = ops.spawn_cli()
    interrupts = Interrupts()
    print(json.dumps({"ready": os.getpid()}), flush=True)
    while line := sys.stdin.readline():
        reply = answer(worker, json.loads(line), interrupts)
        print(json.dumps(reply), flush=True)
    ops.stop_cli(worker)
    return 0


if __name__ == "__main__":
    sys.exit(main())
