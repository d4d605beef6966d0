"""The contract the explorer (``tests/nemesis.py``) holds every history to.

Each layer (of a kind: store, ``local_dir``, ``disk_dir``) and each key is an object with a history of writes:
populates (puts) and removes, each acknowledged (ok), refused (fail: the store answered with a definite error) or
of unknown outcome (the client was killed, or the master or a segment did not answer: it may have taken effect).

- A read that succeeds returns rows (bytes) of exactly one write of that object whose outcome is not a refusal,
  invoked before the read ended; every row is the row asked for. This holds for every read path (lookups, bursts,
  ``V41Rows`` in every form, row caches, tables closed under reads in flight) and for the rows a read that failed
  half-way had read before. One table (an ``EngramStore`` a client opened) never goes back: once it has returned
  rows of a populate, it returns none of a populate that had ended before that one began.
- A read of valid ids fails only with an error that says what happened (never InvalidArgument, ProtocolError and
  the like, which blame the caller: after a SIGINT, a misleading one is how another request's reply shows), and a
  write ended by a forced remove fails with WriteFenced;
  nothing stalls: a read answers within READ_BOUND_S, any other operation within OP_BOUND_S, and no wait ends in
  LockTimeout.
- After the faults heal, an object whose latest acknowledged write is a populate, with no other write invoked
  after it, is readable with that write's rows, or reported lost by name where its bytes are truly gone (a
  shared-memory segment that held it died). An object whose latest acknowledged write is a remove, with no
  populate invoked after it, is absent. An undo (``undo_populate``) of populate g removes the layer if it held g
  and changes nothing if it held another populate's rows.
- At the end every layer is published whole or absent: a store layer whose manifest is there has every head it
  names (held or reported lost), a ``local_dir`` layer every head file of its layout, a ``disk_dir`` layer its
  rows file (see :func:`check_published`).
"""

from __future__ import annotations

import os
import re

import nemesis_rows as R

#: Errors that say a layer or key is absent (not published, never written, removed).
ABSENT = {"ObjectNotFound", "NotPublished", "LayerNotFound"}
#: How often a final read that a server did not answer is tried: every fault has ended, but a segment started a
#: moment ago loads its read kernels on its first read, which on a loaded host outlasts a client's timeout.
FINAL_TRIES = 3
#: Errors that say bytes rotted at rest: what a read of an object whose bytes rotted may end with (never wrong rows).
ROTTED = {"ObjectLost", "DiskReadError"}
#: Writes that leave rows (or bytes) of their own, named by their ``gen``: a reload removes the layer first.
WRITES_ROWS = ("populate", "put", "reload")
#: Errors that blame the caller (or say the protocol broke): a read of valid ids never ends with one.
MISLEADING = {"InvalidArgument", "ConfigError", "InvalidType", "ProtocolError", "RemoteError"}
#: Errors that say a wait ran out: a stall.
STALLED = {"LockTimeout"}
#: The longest a read may take (one read of a burst), and any other operation, faults and all: a client's
#: timeout is 2 s and a lookup fails over twice; a paused master or segment is back within 4.5 s.
READ_BOUND_S = 30.0
OP_BOUND_S = 60.0


def _target(cmd: dict):
    if "key" in cmd:
        return ("key", cmd["key"])
    if "kind" in cmd:
        return (cmd["kind"], cmd["layer"])
    return None


def _writes(history, target) -> list:
    """The writes of ``target``: its populates (puts), removes and undos, and every ``remove_all`` of the store."""
    in_store = _in_store(target)
    return [op for op in history.ops if (op.cmd["op"] in ("populate", "put", "remove", "remove_key", "undo",
                                                          "cli_remove", "reload") and _target(op.cmd) == target)
            or (op.cmd["op"] == "remove_all" and in_store)]


def check_op(history, op) -> list[str]:
    """Problems with one finished operation: its error, its time, and (a read, whole or half-way) its rows."""
    problems = _check_error(history, op) + _check_time(op)
    if any(k in op.reply for k in ("gens", "gen", "bad")):
        problems += check_read(history, op)
    return problems


def _check_error(history, op) -> list[str]:
    cmd, error = op.cmd, op.reply.get("error")
    what = f"{cmd['op']} #{op.id} of {_target(cmd)}"
    before = [o.id for o in history.ops if o.worker == op.worker and o.interrupted and o.id < op.id]
    said = ((" (interrupted itself)" if op.interrupted else "")
            + (f" (its client was interrupted in #{before[-1]} before: another call's reply?)" if before else "")
            + f": {op.reply.get('message', '')[:300]}")
    problems = []
    if error in STALLED:
        problems.append(f"{what} stalled: {error}{said}")
    elif error in MISLEADING and cmd["op"] != "undo":  # (an undo with nothing to undo is refused as invalid)
        problems.append(f"{what} failed with {error}, though every argument was valid{said}")
    elif error == "ObjectNotFound" and cmd["op"] in ("populate", "put"):
        problems.append(f"{what} failed with ObjectNotFound: a write whose put was fenced (a forced remove ended "
                        f"it) gets WriteFenced (docs/operating.md){said}")
    said_by = op.reply.get("reader_said", {})
    for name in op.reply.get("reader_errors", []):
        if name in MISLEADING or name in STALLED:
            problems.append(f"{what}: a lookup in flight ended with {name}: {said_by.get(name, '')}")
    return problems


def _check_time(op) -> list[str]:
    """The client's own times (the explorer's clock also counts its own waits, such as a master starting)."""
    if "took" not in op.reply:
        return []  # killed, or hung (a hang is judged apart)
    took, slowest = op.reply["took"], op.reply.get("slowest", 0.0)
    burst = op.cmd.get("repeat", 1) > 1
    bound = READ_BOUND_S if op.cmd["op"] in ("lookup", "get") and not burst else OP_BOUND_S
    what = f"{op.cmd['op']} #{op.id} of {_target(op.cmd)}"
    problems = []
    if took > bound and not burst:
        problems.append(f"{what} took {took:.1f} s, past its bound of {bound:g} s (a stall)")
    if slowest > READ_BOUND_S:
        problems.append(f"{what}: one of its reads took {slowest:.1f} s, past the bound of {READ_BOUND_S:g} s")
    return problems


def check_read(history, op) -> list[str]:
    """Problems with the rows one read returned (a lookup, a get, the reads of a burst or of a table closed under
    them; also those a read that failed half-way returned before)."""
    cmd = op.cmd
    target = _target(cmd)
    problems = []
    if op.reply.get("bad"):
        problems.append(f"{cmd['op']} #{op.id} of {target} returned wrong data: {op.reply['bad']}")
    gens = op.reply.get("gens", [op.reply.get("gen")] if "gen" in op.reply else [])
    reads = op.reply.get("reads")
    mixed = op.reply["mixed"] if "mixed" in op.reply else [gens] if len(gens) > 1 and reads is None else []
    if mixed:
        problems.append(f"{cmd['op']} #{op.id} of {target} mixed rows of populates {mixed[0]}")
    problems += _went_back(history, op, reads or [])
    possible = {w.cmd["gen"] for w in _writes(history, target)
                if w.cmd["op"] in WRITES_ROWS and w.outcome != "fail" and w.invoked <= op.done}
    for g in gens:
        if g not in possible:
            refused = [w for w in _writes(history, target) if w.cmd.get("gen") == g]
            why = f" (that write was refused: {refused[0].reply.get('message', '')[:200]})" if refused else ""
            problems.append(f"{cmd['op']} #{op.id} of {target} returned rows of populate {g}, which is not a "
                            f"write of it that may have taken effect{why}")
    if problems and _reads_rot(history, target, op):
        history.log(f"{cmd['op']} #{op.id} of {target} read bytes that rotted in a durable segment's file, "
                    "local-direct, before the segment started again: allowed")
        return []
    return problems


def _went_back(history, op, reads: list) -> list[str]:
    """Reads of one table that went back to a populate that had ended before one the table had already returned
    (a row cache or a placement that outlived a remove): ``reads`` is ``[[instance, gens], ...]`` in order."""
    if history.facts["journalless_restart"] or history.facts.get("journal_cut"):
        return []  # a restart that forgot a remove may bring an earlier populate back
    seen = history.__dict__.setdefault("table_seen", {})
    populates = {w.cmd["gen"]: w for w in history.ops if w.cmd["op"] in ("populate", "reload")}
    problems = []
    for instance, gens in reads:
        if len(gens) != 1:
            continue
        key, g = (op.worker, instance, _target(op.cmd)), gens[0]
        last = seen.get(key)
        older, newer = populates.get(g), populates.get(last[0]) if last else None
        # (a populate of unknown outcome may still land late, after its client was killed: only acknowledged ones)
        if last and last[0] != g and older and newer and older.outcome == "ok" and older.done < newer.invoked:
            problems.append(f"{op.cmd['op']} #{op.id} of {_target(op.cmd)} read populate {g} from table {instance} "
                            f"of client {op.worker}, which had returned populate {last[0]} (in #{last[1]}), begun "
                            f"after populate {g} had ended: the table went back")
        seen[key] = (g, op.id)
    return problems


def _reads_rot(history, target, op) -> bool:
    """Whether ``op`` read ``target`` local-direct from a durable segment's file while bytes that rotted there were
    not yet known to be damaged (the segment had not started again and the reader not asked the master since):
    a local-direct read copies the page cache as it is (docs/operating.md)."""
    rotted = getattr(history, "rotted", {}).get(target)
    return (rotted is not None and op.worker in history.local_direct_workers and op.done >= rotted
            and op.invoked < history.rot_reads_until.get(target, 0.0))


def _rotted_since(history, target, invoked: float) -> bool:
    """Whether ``target``'s bytes rotted after a write invoked at ``invoked`` (they may be that write's)."""
    rotted = getattr(history, "rotted", {}).get(target)
    return rotted is not None and rotted >= invoked


def expected_final(history, target) -> tuple[str, int | None]:
    """``("present", gen)``, ``("absent", None)`` or ``("any", None)`` for an object after the history."""
    writes = _writes(history, target)
    acked = [w for w in writes if w.outcome == "ok"]
    last = max(acked, key=lambda w: w.done) if acked else None
    if last is not None and last.cmd["op"] == "remove_all" and not last.cmd.get("force") \
            and _leased_during(history, target, last):
        return "any", None  # passed over under a read's lease (the master counts it refused), or removed
    return _final(writes)


def _leased_during(history, target, remove) -> bool:
    """Whether a read of ``target`` may have left a lease in force while ``remove`` ran: a remove without force
    passes over an object under a lease (``MasterState.remove_all``)."""
    return any(op.cmd["op"] in ("get", "lookup") and _target(op.cmd) == target and op.outcome != "fail"
               and op.invoked <= remove.done and (op.done or remove.done) + history.lease_ttl_s >= remove.invoked
               for op in history.ops)


def _final(writes: list) -> tuple[str, int | None]:
    acked = [w for w in writes if w.outcome == "ok"]
    if not acked:
        if any(w.outcome == "unknown" and w.cmd["op"] in WRITES_ROWS for w in writes):
            return "any", None
        return "absent", None
    last = max(acked, key=lambda w: w.done)
    later = [w for w in writes if w is not last and w.outcome != "fail" and w.invoked >= last.invoked]
    # An operation whose outcome is unknown may take effect at any time after it was invoked, even after its
    # client gave up on it (a request held up by a partition arrives when it heals).
    concurrent = [w for w in writes if w is not last and w.outcome != "fail" and w.invoked < last.done
                  and (w.outcome != "ok" or w.done > last.invoked)]
    if later or concurrent:
        return "any", None
    if last.cmd["op"] in WRITES_ROWS:
        return "present", last.cmd["gen"]
    if last.cmd["op"] == "undo":
        # Every other write that may have taken effect ended before it began: it acted on what they left.
        before = _final([w for w in writes if w is not last])
        undid = last.reply.get("undid")
        if before[0] == "present" and (undid is None or before[1] != undid):
            return before  # another populate's rows: not the undo's to remove
        return ("absent", None) if before[0] != "any" else before
    return "absent", None


def final_check(history) -> None:
    """Heal is done: read every object once more from a fresh client and hold the result to the contract."""
    worker = history.start_worker()
    converge(history, worker)
    targets = sorted({_target(op.cmd) for op in history.ops if _target(op.cmd) is not None}, key=str)
    for target in targets:
        want, gen = expected_final(history, target)
        op = _final_read(history, worker, target)
        if op.outcome == "pending":
            history.violation(f"final read of {target} did not finish")
        elif want == "present":
            _judge_present(history, target, op, gen)
        elif want == "absent":
            _judge_absent(history, target, op)
        # Reads that succeed are held to the per-read contract by check_read already.
    check_published(history, worker)


def _in_store(target) -> bool:
    return target[0] == "key" or R.place(target[0]) == "store"


def _final_read(history, worker, target):
    if target[0] == "key":
        cmd = {"op": "get", "key": target[1]}
    else:
        cmd = {"op": "lookup", "kind": target[0], "layer": target[1], "seed": 7, "prefetch": False}
    for _ in range(FINAL_TRIES):
        op = history.issue(worker, dict(cmd))
        history.wait_idle(worker)
        # (a placement refused as stale, after every failover asked the master again, is asked once more too)
        if op.reply.get("error") not in ("SegmentUnavailable", "MasterUnavailable", "StalePlacement"):
            break
    return op


def _judge_present(history, target, op, gen: int) -> None:
    error = op.reply.get("error")
    written = max((w.invoked for w in _writes(history, target) if w.outcome == "ok"), default=0.0)
    if error in ROTTED and _rotted_since(history, target, written):
        history.log(f"{target}: its bytes rotted at rest, and the read says so ({error}): allowed")
    elif op.outcome == "ok":
        got = op.reply.get("gens") or [op.reply.get("gen")]
        if got != [gen] and _in_store(target) and _journalless_restart(history) \
                and len(got) == 1 and got[0] in _written_gens(history, target):
            # The later write undone (its segment gone), and an earlier one back from a segment that was
            # away when the master restarted without a journal (it did not know the key then).
            history.log(f"{target}: the earlier write {got[0]} back under a master without a journal while "
                        f"a segment was away: allowed")
        elif got != [gen]:
            _judge(history, target, op, f"{target}: the last acknowledged write was populate {gen}, but the "
                                        f"final read returned rows of {got}")
    elif error == "ObjectLost":
        # Lost is the truth only while the segment that held it is gone: one that is registered again
        # (the same id: its memory outlived a pause, a partition or a restart on its file) restores it.
        holder = re.search(r"on segment (\w+)", op.reply.get("message", ""))
        if holder is None or holder.group(1) in history.registered:
            history.violation(f"{target} reported lost, though the segment that held it is back: "
                              f"{op.reply.get('message')}")
        else:
            history.log(f"{target}: lost with a segment that is gone, and reported by name")
    elif error in ABSENT or error in ("StoreError", "MixedLayer"):
        if _in_store(target) and _journalless_restart(history):
            # (MixedLayer: heads of two populates taken back from different segments, refused rather than read)
            history.log(f"{target}: gone under a master without a journal while a segment was away "
                        f"({error}): allowed")
        else:
            _judge(history, target, op, f"{target}: acknowledged populate {gen} is silently gone: {error}: "
                                        f"{op.reply.get('message')}")
    else:
        history.violation(f"{target}: final read failed: {error}: {op.reply.get('message')}"
                          + _segment_tail(history, op.reply.get("message", "")))


def _segment_tail(history, message: str) -> str:
    """The end of the log of each segment a failed read's message names (by its address or a reader's)."""
    out = ""
    for i, slot in enumerate(history.segments):
        proc = slot["proc"]
        if proc is not None and any(a and a in message for a in [proc.address, *proc.read_addresses]):
            out += (f"\nsegment{i} (pid {proc.pid}, {proc.address}, readers {proc.read_addresses}, "
                    f"{'alive' if proc.alive() else 'exited'}) log ends:\n" + proc.output()[-1500:])
    if history.network is not None:
        import subprocess
        rules = subprocess.run(["ip", "netns", "exec", history.network.hub, "ip", "rule", "show"],
                               capture_output=True, text=True, timeout=30).stdout
        out += "\nblackhole rules in force: " + (" | ".join(r for r in rules.splitlines() if "blackhole" in r)
                                                  or "none")
    return out


def _judge_absent(history, target, op) -> None:
    error = op.reply.get("error")
    if op.outcome == "ok" and _in_store(target) and _journalless_restart(history):
        history.log(f"{target}: back under a master without a journal while a segment was away: allowed")
    elif op.outcome == "ok":
        _judge(history, target, op, f"{target}: its last acknowledged write removed it, but it reads back: "
                                    f"{op.reply}")
    elif error not in ABSENT and error != "ObjectLost":
        _judge(history, target, op, f"{target}: expected absent, final read failed with {error}: "
                                    f"{op.reply.get('message')}")


def check_published(history, worker) -> None:
    """Every layer is published whole or absent at the end: the store's keys (a manifest names its heads, each held
    or reported lost), and the files of ``local_dir`` and ``disk_dir`` layers."""
    op = history.issue(worker, {"op": "layers"})
    history.wait_idle(worker)
    if op.outcome != "ok":
        history.violation(f"the store's layers could not be listed at the end: {op.reply}")
        return
    # A master that lost records (no journal, or a cut one) may not know heads the segments still hold.
    forgiven = history.facts["journalless_restart"] or history.facts.get("journal_cut")
    for layer, entry in sorted(op.reply["layers"].items(), key=lambda item: int(item[0])):
        if not entry["manifest"]:
            continue
        if "unreadable" in entry:
            history.log(f"store layer {layer}: its manifest could not be read at the end: {entry['unreadable']}")
            continue
        missing = [h for h in range(entry["sizes"]) if h not in entry["heads"] and h not in entry["lost"]]
        if missing:
            problem = (f"store layer {layer}: its manifest is published but heads {missing} of "
                       f"{entry['sizes']} are gone (a half-published layer)")
            history.log(problem + ": allowed after a restart that lost records") if forgiven \
                else history.violation(problem)
    for problem in _files_published(history.files):
        history.violation(problem)


def _files_published(files: str) -> list[str]:
    """Half-published layers under the history's ``local_dir`` and ``disk_dir``."""
    problems = []
    local, disk = os.path.join(files, "local"), os.path.join(files, "disk")
    for name in sorted(os.listdir(local)):
        path = os.path.join(local, name)
        if not re.fullmatch(r"layer-\d+", name) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, "layout"), encoding="utf-8") as f:
                lines = f.read().split()
            row_bytes, sizes = int(lines[1]), [int(n) for n in lines[2:]]
        except (OSError, ValueError, IndexError) as exc:
            problems.append(f"local_dir {name}: published without a readable layout ({exc})")
            continue
        for h, n in enumerate(sizes):
            head = os.path.join(path, f"head-{h}.bin")
            size = os.path.getsize(head) if os.path.exists(head) else None
            if size != n * row_bytes:
                problems.append(f"local_dir {name}: head-{h}.bin is "
                                + ("missing" if size is None else f"{size} bytes, not {n * row_bytes}")
                                + " (a half-published layer)")
    for name in sorted(os.listdir(disk)):
        path = os.path.join(disk, name)
        if re.fullmatch(r"layer-\d+", name) and os.path.isdir(path):
            problems += [f"disk_dir {name}: published without {f} (a half-published layer)"
                         for f in ("manifest.json", "rows.bin") if not os.path.exists(os.path.join(path, f))]
    return problems


def _written_gens(history, target) -> set:
    """The generations of every write of ``target`` that was acknowledged or may have taken effect."""
    return {w.cmd["gen"] for w in _writes(history, target)
            if w.outcome != "fail" and w.cmd["op"] in WRITES_ROWS}


def _journalless_restart(history) -> bool:
    """A master without a journal knows what segments tell it when they register: every segment is away from it
    until it registers again (a heartbeat after the restart), so a write or remove that a segment away at the time
    never heard of may be undone by the restart, and so may one the master answered before the segments came back
    (seed 70108: a remove found nothing, and the layer came back with them; documented in docs/operating.md)."""
    return history.facts["journalless_restart"]


def _judge(history, target, op, violation: str) -> None:
    """A final read that breaks the contract, unless what happened allows it (:func:`journal_cut_allows`)."""
    allowed = journal_cut_allows(history, target, op)
    if allowed:
        history.log(f"{target}: {allowed}: allowed")
    else:
        history.violation(violation)


def journal_cut_allows(history, target, op) -> str:
    """Why a cut journal (whole records lost from its end, ``facts["journal_cut"]``) explains this final read of a
    store object, or "". The master takes back every object a live segment holds, and drops what a segment says it
    no longer holds; what it cannot know is a remove it lost where the segment restarted since (the object comes
    back; reported lost, or StalePlacement, where its segment disowns it), and an object whose every segment died,
    whose loss only the lost records named (it reads as absent; nothing holds its bytes). Nothing else: no wrong
    row, no object a segment holds."""
    if not history.facts.get("journal_cut") or not _in_store(target):
        return ""
    error = op.reply.get("error")
    want, _ = expected_final(history, target)
    if want == "absent" and (op.outcome == "ok" or error in ("StalePlacement", "ObjectLost")):
        return f"a remove the cut journal lost ({error or 'it reads back'})"
    if want == "present" and op.outcome == "ok":
        got = op.reply.get("gens") or [op.reply.get("gen")]
        if len(got) == 1 and got[0] in _written_gens(history, target):
            return f"an earlier write {got[0]} back: the cut journal lost the remove of it"
    if want == "present" and error in ABSENT and history.facts["shm_segment_died"]:
        return "gone with its shared-memory segment, and the cut journal lost the record of that loss"
    return ""


def converge(history, worker, timeout_s: float = 45.0) -> None:
    """Wait until the master knows exactly the live segments, each registered with it (lost objects re-verified):
    a segment killed a moment ago is still listed until its heartbeats are missed."""
    deadline = history.now() + timeout_s
    last = None
    while history.now() < deadline:
        for i in range(len(history.segments)):
            history.segment_started(i)
        live = {s["proc"].segment_id for s in history.segments
                if s["proc"] is not None and not s.get("starting")}
        starting = any(s.get("starting") for s in history.segments if s["proc"] is not None)
        op = history.issue(worker, {"op": "status"})
        history.wait_idle(worker)
        last = op.reply
        if (op.outcome == "ok" and not starting and set(op.reply["segment_ids"]) == live
                and op.reply["confirmed"] == len(live)):
            history.registered = set(op.reply["segment_ids"])
            # One more heartbeat interval: a segment that was dropped re-registers and re-verifies within it.
            history.pump(history.now() + 1.0)
            return
        history.pump(history.now() + 0.2)
    history.violation(f"the cluster did not converge within {timeout_s:g} s after healing: {last}")
