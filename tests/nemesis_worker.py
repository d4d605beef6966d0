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

SIZES = [331, 337, 347]
DIM = 5
CONFIG = EngramStoreConfig(table_vocab_sizes=SIZES, embedding_dim=DIM)
#: Bytes of a key-value object: a 16-byte header (generation, length) and a pattern derived from both.
VALUE_BYTES = 3000
#: The row caches of a client's disk layers, by its pid: its own, or the host's asked for at one size or another (a
#: client asking another size attaches to the one there), so clients killed mid-fill, mid-replay of the host's
#: curve or mid-attach leave the others a cache to check every row against.
DISK_CACHES = ((1 << 16, "process"), (1 << 16, "host"), (1 << 17, "host"))


def tables(layer: int, generation: int) -> list[np.ndarray]:
    out = []
    for h, n in enumerate(SIZES):
        t = np.empty((n, DIM), dtype=np.float32)
        t[:, 0], t[:, 1], t[:, 2], t[:, 3], t[:, 4] = layer, generation, h, np.arange(n), generation
        out.append(t)
    return out


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
    heads = np.broadcast_to(np.arange(len(SIZES), dtype=np.float32), ids.shape)
    wrong = ~((rows[..., 0] == layer) & (rows[..., 2] == heads) & (rows[..., 3] == ids.astype(np.float32))
              & (rows[..., 4] == rows[..., 1]))
    bad = [f"at {tuple(int(i) for i in where)}: asked layer {layer} head {where[-1]} row {int(ids[where])}, got "
           f"{rows[where].tolist()}" for where in zip(*np.nonzero(wrong))][:5]
    return {"gens": sorted({int(g) for g in np.unique(rows[..., 1])}), "bad": bad}


class Worker:
    def __init__(self, master: str, local_dir: str, disk_dir: str, local_direct: bool, timeout_ms: int,
                 cache: str = "process"):
        self.master, self.local_dir, self.disk_dir = master, local_dir, disk_dir
        self.local_direct, self.timeout_ms = local_direct, timeout_ms
        self.host_cache = cache.startswith("host")
        if cache.startswith("host-die:"):  # the host cache's test hook: this process dies mid-fill
            os.environ[DIE_MID_FILL_ENV] = cache.split(":", 1)[1]
        self.store: DistributedStore | None = None
        self.layers: dict[tuple[str, int], EngramStore] = {}
        self.populated: dict[tuple[str, int], int] = {}  # the populate each open layer's undo would take back:
        # its last one that succeeded (a refused populate wrote nothing), until a remove

    def _store(self) -> DistributedStore:
        if self.store is None:
            self.store = DistributedStore.connect(self.master, timeout_ms=self.timeout_ms,
                                                  local_direct=self.local_direct)
        return self.store

    def _layer(self, kind: str, layer: int) -> EngramStore:
        es = self.layers.get((kind, layer))
        if es is None:
            if kind == "store":
                es = EngramStore(layer, CONFIG, self._store())
            elif kind == "local":
                es = EngramStore(layer, CONFIG, local_dir=self.local_dir)
            else:
                cache_bytes, scope = DISK_CACHES[os.getpid() % len(DISK_CACHES)]
                if self.host_cache:  # the explorer's stream of faults at rest asked for the host's, at any size
                    scope = "host"
                es = EngramStore(layer, CONFIG, disk_dir=self.disk_dir, row_cache_bytes=cache_bytes, cache_scope=scope)
            self.layers[(kind, layer)] = es
        return es

    def _drop(self, kind: str, layer: int) -> None:
        self.populated.pop((kind, layer), None)
        es = self.layers.pop((kind, layer), None)
        if es is not None:
            es.close()

    def run(self, cmd: dict) -> dict:
        op = cmd["op"]
        if op == "populate":
            self._layer(cmd["kind"], cmd["layer"]).populate(tables(cmd["layer"], cmd["gen"]),
                                                            replica_num=cmd.get("replicas", 1))
            self.populated[(cmd["kind"], cmd["layer"])] = cmd["gen"]
            return {}
        if op == "undo":
            gen = self.populated.get((cmd["kind"], cmd["layer"]))
            removed = self._layer(cmd["kind"], cmd["layer"]).undo_populate()
            self.populated.pop((cmd["kind"], cmd["layer"]), None)
            return {"removed": removed, "undid": gen}
        if op == "lookup":
            return in_child(lambda: self._lookup(cmd)) if cmd.get("fork") else self._lookup(cmd)
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
        if op == "close_midcall":
            return self._close_midcall(cmd)
        if op == "status":
            status = self._store().status()
            return {"objects": status["objects"], "lost": status["lost"], "lost_keys": status["lost_keys"],
                    "segments": len(status["segments"]), "segment_ids": [s["segment_id"] for s in status["segments"]],
                    "confirmed": sum(1 for s in status["segments"] if s.get("confirmed", True))}
        raise ValueError(f"unknown op {op!r}")

    def _lookup(self, cmd: dict) -> dict:
        es = self._layer(cmd["kind"], cmd["layer"])
        rng = np.random.default_rng(cmd["seed"])
        batch = int(rng.integers(1, 5))
        ids = np.stack([rng.integers(0, n, size=(batch, 16)) for n in SIZES], axis=-1)
        rows = es.prefetch(ids).result(timeout=60) if cmd.get("prefetch") else es.lookup(ids)
        return check_rows(rows, ids, cmd["layer"])

    def _close_midcall(self, cmd: dict) -> dict:
        """Close the store (and every layer on it) while another thread is in a lookup; then start afresh."""
        es = self._layer("store", cmd["layer"])
        errors: list[str] = []

        def read():
            ids = np.zeros((1, 8, len(SIZES)), dtype=np.int64)
            try:
                for _ in range(50):
                    es.lookup(ids)
            except EngramError as exc:
                errors.append(type(exc).__name__)

        thread = threading.Thread(target=read)
        thread.start()
        time.sleep(cmd.get("after_s", 0.0))
        for key in [k for k in self.layers if k[0] == "store"]:
            self._drop(*key)
        if self.store is not None:
            self.store.close()
            self.store = None
        thread.join(timeout=60)
        if thread.is_alive():
            raise RuntimeError("a lookup did not return within 60 s of its store closing")
        return {"reader_errors": errors}


def in_child(work) -> dict:
    """``work()`` in a child forked from this process, which has used the store: its answer, or its error raised
    here again (a child that dies or hangs is a crash of ours)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        signal.alarm(60)
        try:
            out = {"ok": True, **work()}
        except EngramError as exc:
            out = {"ok": False, "error": type(exc).__name__, "message": str(exc)[:500]}
        except BaseException:
            out = {"ok": False, "error": "crash", "message": traceback.format_exc()[-2000:]}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 16):
        chunks.append(chunk)
    os.close(r)
    status = os.waitpid(pid, 0)[1]
    if not chunks:
        raise RuntimeError(f"the forked child died without an answer (exit status {os.waitstatus_to_exitcode(status)})")
    out = json.loads(b"".join(chunks))
    if not out.pop("ok"):
        cls = getattr(engram_store, out["error"], None)
        if not (isinstance(cls, type) and issubclass(cls, EngramError)):
            raise RuntimeError(f"the forked child failed: {out['message']}")
        raise cls(f"(in a forked child) {out['message']}")
    return out


def main() -> int:
    master, local_dir, disk_dir, local_direct, timeout_ms = sys.argv[1:6]
    if len(sys.argv) > 7:  # the explorer's: host caches in its directory, gone with it
        os.environ["ENGRAM_SHM_DIR"] = sys.argv[7]
    worker = Worker(master, local_dir, disk_dir, local_direct == "1", int(timeout_ms),
                    sys.argv[6] if len(sys.argv) > 6 else "process")
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            reply = {"id": cmd["id"], "ok": True, **worker.run(cmd)}
        except EngramError as exc:
            reply = {"id": cmd["id"], "ok": False, "error": type(exc).__name__, "message": str(exc)[:500]}
        except Exception as exc:  # a bug of ours, not a store error: the checker reports it
            reply = {"id": cmd["id"], "ok": False, "error": "crash:" + type(exc).__name__,
                     "message": traceback.format_exc()[-2000:]}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
