"""The explorer's reads and its operations beyond populate and remove, as a client process runs them
(``tests/nemesis_worker.py``): lookups of every layer kind (``tests/nemesis_rows.py``) through every read path,
in bursts, of many rows; tables closed under lookups in flight; ``engram-layers remove`` as a process.

A read answers ``gens`` (the populates it saw), ``bad`` (rows that are not the ones asked for), ``mixed`` (the
populates of each read that saw more than one), ``reads`` (per table instance, in order, the populates each read
saw: one instance is one ``EngramStore`` the client opened; the last hundred changes) and ``slowest`` (seconds,
the longest single read). A read that fails half-way raises with what it read before
attached (``exc.nemesis_partial``), so those rows are checked too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import traceback

import numpy as np

from engram_store import EngramError

import nemesis_rows as R

#: Ids of a lookup of "many" rows: over 2 MiB of reply from one server (streamed in pieces).
MANY_SMALL = 40000      # x 3 heads x 20 bytes: 2.4 MB
MANY_WIDE = 16000       # x 1 head x 256 bytes: 4 MB, four pieces
MANY_V41 = 1200         # x 8 columns x 264 bytes: 2.5 MB
#: A byte no gather writes into a buffer it fills: a buffer left partly unwritten shows.
SENTINEL = 0xEE


class CliFailed(EngramError):
    """``engram-layers`` exited with an error that does not say whether it removed anything."""


class ReloadFailed(EngramError):
    """A reload failed part-way: the layer may be removed, populated again, or neither."""


class Reads:
    """What the reads of one operation saw."""

    def __init__(self):
        self.gens: set[int] = set()
        self.bad: list[str] = []
        self.reads: list[list] = []
        self.mixed: list[list[int]] = []  # the populates of each read that saw more than one (the first few)
        self.slowest = 0.0
        self.count = 0

    def add(self, instance: int, check: dict, seconds: float) -> None:
        self.gens |= set(check["gens"])
        self.bad += check["bad"][:5 - len(self.bad)] if len(self.bad) < 5 else []
        entry = [instance, check["gens"]]
        if not self.reads or self.reads[-1] != entry:
            self.reads.append(entry)
        if len(check["gens"]) > 1 and len(self.mixed) < 5:
            self.mixed.append(check["gens"])
        self.slowest = max(self.slowest, seconds)
        self.count += 1

    def reply(self) -> dict:
        return {"gens": sorted(self.gens), "bad": self.bad, "mixed": self.mixed, "reads": self.reads[-100:],
                "slowest": round(self.slowest, 3), "n": self.count}


# ---- reads ----------------------------------------------------------------------------------------------------------

class ReaderErrors(list):
    """The names of the store's errors a burst of reads met (``reader_errors``), and what the first of each name
    said (``reader_said``: the checker quotes it where the error is one a read should never end with)."""

    def __init__(self):
        super().__init__()
        self.said: dict[str, str] = {}

    def add(self, exc: BaseException) -> None:
        self.append(type(exc).__name__)
        self.said.setdefault(type(exc).__name__, str(exc)[:300])

    def reply(self) -> dict:
        return {"reader_errors": list(self), "reader_said": self.said}


def lookup(worker, cmd: dict) -> dict:
    """``cmd["repeat"]`` reads (default 1) of the layer, ``pace_s`` apart; ``reopen``: each from an ``EngramStore``
    opened anew. A burst (more than one) goes on past a read that fails with the store's error (``reader_errors``
    names them): a layer removed under it fails some reads, and the next populate's may follow."""
    kind, layer, variant = cmd["kind"], cmd["layer"], cmd.get("variant", "")
    rng = np.random.default_rng(cmd["seed"])
    reads, errors = Reads(), ReaderErrors()
    repeat = int(cmd.get("repeat", 1))
    try:
        for i in range(repeat):
            if i:
                time.sleep(cmd.get("pace_s", 0.0))  # (a burst spread out: removes and populates land inside it)
            if cmd.get("reopen") and i:
                worker.drop_table(kind, layer, variant)
            try:
                table = worker.table(kind, layer, variant)
                start = time.monotonic()
                check = read_once(table, cmd, rng)
            except EngramError as exc:
                if repeat == 1:
                    raise
                errors.add(exc)
                continue
            reads.add(table.instance, check, time.monotonic() - start)
    except BaseException as exc:
        exc.nemesis_partial = reads.reply()
        raise
    return {**reads.reply(), **errors.reply()} if repeat > 1 else reads.reply()


def read_once(table, cmd: dict, rng: np.random.Generator) -> dict:
    """One read of ``table`` (a worker's ``Table``) as ``cmd`` says, checked."""
    if R.family(cmd["kind"]) == "v41":
        return _gather(table, cmd, rng)
    es, layer = table.es, cmd["layer"]
    sizes = R.sizes(cmd["kind"], layer)
    if cmd.get("many"):
        n = MANY_WIDE if R.family(cmd["kind"]) == "wide" else MANY_SMALL
        ids = np.stack([rng.integers(0, s, size=(1, n)) for s in sizes], axis=-1)
    else:
        batch = int(rng.integers(1, 5))
        ids = np.stack([rng.integers(0, s, size=(batch, 16)) for s in sizes], axis=-1)
    api = cmd.get("api") or ("prefetch" if cmd.get("prefetch") else "lookup")
    if api == "layers":
        return _with_other_layers(table, cmd, ids)
    if api == "prefetch":
        rows = es.prefetch(ids).result(timeout=60)
    elif api == "into":
        rows = np.empty(ids.shape + (es.get_embedding_dim(),), dtype=np.float32)
        rows.view(np.uint8).fill(SENTINEL)
        es.lookup_into(ids, rows)
    else:
        rows = es.lookup(ids)
    return R.check_float(rows, ids, layer)


def _with_other_layers(table, cmd: dict, ids: np.ndarray) -> dict:
    """The layer read together with the family's other layers (``lookup_many``: one request per segment server for
    all of them, as an engine reads its Engram layers): this layer's rows checked as a lookup's, the others' rows
    for what they are (their populates are not this layer's)."""
    from engram_store import lookup_many

    kind, layer = cmd["kind"], cmd["layer"]
    others = [o for o in R.LAYERS[R.family(kind)] if o != layer]
    tables = [table.es] + [table.worker.table(kind, o, cmd.get("variant", "")).es for o in others]
    rows = lookup_many([(es, ids) for es in tables]).result(timeout=60)
    check = R.check_float(rows[0], ids, layer)
    for other, got in zip(others, rows[1:]):
        seen = R.check_float(got, ids, other)
        check["bad"] += [f"(layer {other}, read with layer {layer}) {b}" for b in seen["bad"]]
        if len(seen["gens"]) > 1:
            check["bad"].append(f"(layer {other}, read with layer {layer}) rows of populates {seen['gens']}")
    return check


def _gather(table, cmd: dict, rng: np.random.Generator) -> dict:
    """A ``V41Rows.gather_into`` in the form ``cmd`` names (bf16, packed, split; a head shard; in the background),
    into buffers filled with a sentinel first, every slot checked."""
    cfg, layer, form = R.v41(), cmd["layer"], cmd.get("form", "packed")
    offsets, sizes = cfg.offsets(layer), R.sizes(cmd["kind"], layer)
    T = MANY_V41 if cmd.get("many") else int(rng.integers(1, 64))
    ids = np.stack([offsets[c] + rng.integers(0, sizes[c], size=T) for c in range(cfg.cols)], axis=1)
    ids[rng.random(ids.shape) < 0.05] = -1  # padding (the engines' DEAD_ID)
    ids = ids.astype(np.int32 if rng.random() < 0.5 else np.int64)
    head_start, part = table.shard or (0, cfg.cols)
    background = bool(cmd.get("background"))
    if form == "split":
        flat = ids.reshape(-1)
        codes = np.full((flat.size, cfg.head_dim), SENTINEL, np.uint8)
        scales = np.full((flat.size, cfg.row_bytes - cfg.head_dim), SENTINEL, np.uint8)
        _wait(table.rows.gather_into(flat, codes, scales_out=scales, background=background), background)
        got = np.concatenate([codes, scales], axis=1)
        cols = np.searchsorted(offsets, flat, side="right") - 1
        heads, rows = cols, np.where(flat < 0, -1, flat - offsets[np.maximum(cols, 0)])
    else:
        width = cfg.row_bytes if form == "packed" else cfg.head_dim
        out = np.full((T, part, width), SENTINEL, np.uint8 if form == "packed" else np.uint16)
        _wait(table.rows.gather_into(ids, out, head_start=head_start, background=background), background)
        got = out.reshape(T * part, width)
        window = ids[:, head_start:head_start + part]
        heads = np.broadcast_to(np.arange(head_start, head_start + part), window.shape).reshape(-1)
        rows = np.where(window < 0, -1, window - offsets[head_start:head_start + part]).reshape(-1)
    return R.check_v41(got, form, layer, heads, rows)


def _wait(done, background: bool) -> None:
    if background:
        done.wait(60)


# ---- tables closed under lookups ------------------------------------------------------------------------------------

def close_table(worker, cmd: dict) -> dict:
    """Close the layer's table while another thread is in a lookup of it, open another layer's table at once (its
    files may take the closed one's descriptor numbers) and read that; the lookups in flight end with the store's
    error or right rows."""
    kind, layer = cmd["kind"], cmd["layer"]
    table = worker.table(kind, layer, "")
    reads, errors, crashes = Reads(), ReaderErrors(), []
    stop = threading.Event()

    def reader():
        rng = np.random.default_rng(cmd["seed"])
        try:
            while not stop.is_set():
                start = time.monotonic()
                check = read_once(table, cmd, rng)
                reads.add(table.instance, check, time.monotonic() - start)
        except EngramError as exc:
            errors.add(exc)
        except Exception:
            crashes.append(traceback.format_exc()[-1500:])

    thread = threading.Thread(target=reader, name="nemesis-reader")
    thread.start()
    time.sleep(cmd.get("after_s", 0.0))
    worker.tables.pop((kind, layer, ""), None)
    worker.populated.pop((kind, layer), None)
    table.es.close()  # the table only: its V41Rows (which the reader uses too) closes once the reader is done
    other = _read_other(worker, cmd)
    stop.set()
    thread.join(timeout=60)
    if table.rows is not None and not thread.is_alive():
        table.rows.close()
    if thread.is_alive():
        raise RuntimeError("a lookup did not return within 60 s of its table closing")
    if crashes:
        raise RuntimeError(f"a lookup in flight raised outside the store's errors when its table closed:\n{crashes[0]}")
    reply = reads.reply()
    reply["bad"] += other
    return {**reply, **errors.reply()}


def _read_other(worker, cmd: dict) -> list[str]:
    """Open another layer of the family and read it a few times: the rows that are not the ones asked for."""
    kind = cmd["kind"]
    others = [lay for lay in R.LAYERS[R.family(kind)] if lay != cmd["layer"]]
    other = {**cmd, "layer": others[0]}
    rng = np.random.default_rng(cmd["seed"] + 1)
    bad: list[str] = []
    try:
        table = worker.table(kind, other["layer"], "")
        for _ in range(3):
            bad += [f"(layer {other['layer']}, opened as layer {cmd['layer']} closed) {b}"
                    for b in read_once(table, other, rng)["bad"]]
    except EngramError:
        pass  # not published, or gone: what matters is what the closed table's readers saw
    return bad[:5]


# ---- a layer reloaded while this process reads it -------------------------------------------------------------------

def reload(worker, cmd: dict) -> dict:
    """Remove the layer and populate it again (populate ``gen``) while another thread of this process reads it in
    a burst (``cmd["read"]``: a lookup's fields; each read from a table of its own with ``reopen``): a serving
    process that reloads a layer it serves. The reads are checked as a lookup's; a write that fails part-way
    raises ReloadFailed (its outcome is unknown)."""
    kind, layer = cmd["kind"], cmd["layer"]
    read = {**cmd["read"], "kind": kind, "layer": layer}
    reads, errors, crashes = Reads(), ReaderErrors(), []
    stop = threading.Event()

    def reader():
        rng = np.random.default_rng(read["seed"])
        table = None
        try:
            while not stop.is_set() and reads.count + len(errors) < 2000:
                time.sleep(0.005)  # (reads until the rewrite is done, however long it takes)
                if table is not None and read.get("reopen"):
                    table.close()
                    table = None
                try:
                    table = table or worker.open_table(kind, layer, read.get("variant", ""))
                    start = time.monotonic()
                    check = read_once(table, read, rng)
                except EngramError as exc:
                    errors.add(exc)
                    time.sleep(0.01)
                    continue
                reads.add(table.instance, check, time.monotonic() - start)
        except Exception:
            crashes.append(traceback.format_exc()[-1500:])
        finally:
            if table is not None:
                table.close()

    thread = threading.Thread(target=reader, name="nemesis-reload-reader")
    thread.start()
    start = time.monotonic()
    try:
        time.sleep(cmd.get("after_s", 0.0))
        _rewrite(worker, cmd)
    except BaseException as exc:
        exc.nemesis_partial = {**getattr(exc, "nemesis_partial", {}), "rewrite_s": round(time.monotonic() - start, 3),
                               **_stop_reader(stop, thread)}
        raise
    timings = {"rewrite_s": round(time.monotonic() - start, 3), **_stop_reader(stop, thread)}
    if thread.is_alive() or crashes:
        raise RuntimeError("the reader of a reloaded layer " + (f"raised:\n{crashes[0]}" if crashes else
                                                                f"hung: {timings}"))
    return {**reads.reply(), **errors.reply(), **timings}


def _stop_reader(stop: threading.Event, thread: threading.Thread) -> dict:
    """Stop a reload's reader: how long it took to stop, and where it was when it had not after 5 s (a read that
    does not end is what the explorer is after: its stack says which)."""
    stop.set()
    start = time.monotonic()
    thread.join(timeout=5)
    out: dict = {}
    if thread.is_alive():
        frame = sys._current_frames().get(thread.ident)
        out["reader_stack"] = "".join(traceback.format_stack(frame)[-12:])[-3000:] if frame is not None else "?"
        thread.join(timeout=55)
    out["reader_stop_s"] = round(time.monotonic() - start, 3)
    return out


def _rewrite(worker, cmd: dict) -> None:
    kind, layer = cmd["kind"], cmd["layer"]
    try:
        if R.place(kind) == "local":  # (what engram-layers remove runs, in this process)
            from engram_store.tables._inventory import LocalDirLayers
            try:
                LocalDirLayers(worker.local_dir).remove(layer, True)
            except EngramError as exc:
                if type(exc).__name__ != "ObjectNotFound":
                    raise
        else:
            worker.table(kind, layer).es.remove_from_store(force=True)
        worker.populated.pop((kind, layer), None)
        worker.table(kind, layer).es.populate(R.tables(kind, layer, cmd["gen"]), replica_num=cmd.get("replicas", 1))
        worker.populated[(kind, layer)] = cmd["gen"]
    except EngramError as exc:
        raise ReloadFailed(f"{type(exc).__name__}: {exc}"[:500]) from None


# ---- engram-layers remove, as a process ------------------------------------------------------------------------------

#: A CLI process that has imported everything and waits for its arguments on stdin (so that it acts at once).
CLI = ("import json, sys\n"
       "from engram_store.tables.cli import main\n"
       "from engram_store.client import DistributedStore\n"
       "line = sys.stdin.readline()\n"
       "sys.exit(main(json.loads(line)) if line else 0)\n")


def spawn_cli() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CLI], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def cli_remove(worker, cmd: dict) -> dict:
    """``engram-layers remove LAYER --yes [--force]`` of the layer's place, after ``delay_s``."""
    kind, layer = cmd["kind"], cmd["layer"]
    where = {"store": ["--master", worker.master], "local": ["--local-dir", worker.local_dir],
             "disk": ["--disk-dir", worker.disk_dir]}[R.place(kind)]
    argv = ["remove", str(layer), "--yes", *where] + (["--force"] if cmd.get("force") else [])
    proc, worker.cli = worker.cli or spawn_cli(), None
    try:
        time.sleep(cmd.get("delay_s", 0.0))
        out, err = proc.communicate(json.dumps(argv) + "\n", timeout=120)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        worker.cli = spawn_cli()  # the next one imports while this answer goes out
    if proc.returncode == 0:
        return {"said": out.strip()[-200:]}
    if "Traceback" in err or proc.returncode not in (1, 2):
        raise RuntimeError(f"engram-layers remove exited with {proc.returncode}:\n{err[-2000:]}")
    message = err.strip()[-400:]
    if "no object of it" in err or "is not published" in err:
        from engram_store import ObjectNotFound
        raise ObjectNotFound(message)
    if "nothing was removed" in err:
        from engram_store import LeaseActive
        raise LeaseActive(message)
    raise CliFailed(message)


def stop_cli(worker) -> None:
    if worker.cli is not None:
        worker.cli.kill()
        worker.cli.wait()
        worker.cli = None


def env_path() -> None:
    """The CLI process imports this worktree's packages (the explorer's own path)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.environ.get("PYTHONPATH", "")
    if root not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = root + (os.pathsep + path if path else "")
