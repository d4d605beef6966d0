"""The contract the explorer (``tests/nemesis.py``) holds every history to.

Each layer (of a kind: store, ``local_dir``, ``disk_dir``) and each key is an object with a history of writes:
populates (puts) and removes, each acknowledged (ok), refused (fail: the store answered with a definite error) or
of unknown outcome (the client was killed, or the master or a segment did not answer: it may have taken effect).

- A read that succeeds returns rows (bytes) of exactly one write of that object whose outcome is not a refusal,
  invoked before the read ended; every row is the row asked for.
- After the faults heal, an object whose latest acknowledged write is a populate, with no other write invoked
  after it, is readable with that write's rows, or reported lost by name where its bytes are truly gone (a
  shared-memory segment that held it died). An object whose latest acknowledged write is a remove, with no
  populate invoked after it, is absent. An undo (``undo_populate``) of populate g removes the layer if it held g
  and changes nothing if it held another populate's rows.
"""

from __future__ import annotations

import re

#: Errors that say a layer or key is absent (not published, never written, removed).
ABSENT = {"ObjectNotFound", "NotPublished", "LayerNotFound"}
#: How often a final read that a server did not answer is tried: every fault has ended, but a segment started a
#: moment ago loads its read kernels on its first read, which on a loaded host outlasts a client's timeout.
FINAL_TRIES = 3
#: Errors that say bytes rotted at rest: what a read of an object whose bytes rotted may end with (never wrong rows).
ROTTED = {"ObjectLost", "DiskReadError"}


def _target(cmd: dict):
    if "key" in cmd:
        return ("key", cmd["key"])
    if "kind" in cmd:
        return (cmd["kind"], cmd["layer"])
    return None


def _writes(history, target) -> list:
    return [op for op in history.ops if op.cmd["op"] in ("populate", "put", "remove", "remove_key", "undo")
            and _target(op.cmd) == target]


def check_read(history, op) -> list[str]:
    """Problems with one finished read (lookup, get); none for other operations."""
    cmd = op.cmd
    if op.outcome != "ok" or cmd["op"] not in ("lookup", "get"):
        return []
    target = _target(cmd)
    problems = []
    if op.reply.get("bad"):
        problems.append(f"{cmd['op']} #{op.id} of {target} returned wrong data: {op.reply['bad']}")
    gens = op.reply.get("gens", [op.reply.get("gen")] if "gen" in op.reply else [])
    if len(gens) > 1:
        problems.append(f"{cmd['op']} #{op.id} of {target} mixed rows of populates {gens}")
    possible = {w.cmd["gen"] for w in _writes(history, target)
                if w.cmd["op"] in ("populate", "put") and w.outcome != "fail" and w.invoked <= op.done}
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
    return _final(_writes(history, target))


def _final(writes: list) -> tuple[str, int | None]:
    acked = [w for w in writes if w.outcome == "ok"]
    if not acked:
        if any(w.outcome == "unknown" and w.cmd["op"] in ("populate", "put") for w in writes):
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
    if last.cmd["op"] in ("populate", "put"):
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
        written = max((w.invoked for w in _writes(history, target) if w.outcome == "ok"), default=0.0)
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
        if op.outcome == "pending":
            history.violation(f"final read of {target} did not finish")
            continue
        error = op.reply.get("error")
        if want == "present" and error in ROTTED and _rotted_since(history, target, written):
            history.log(f"{target}: its bytes rotted at rest, and the read says so ({error}): allowed")
        elif want == "present":
            if op.outcome == "ok":
                got = op.reply.get("gens") or [op.reply.get("gen")]
                if got != [gen] and target[0] in ("store", "key") and _journalless_restart(history) \
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
            elif error in ABSENT or error == "StoreError":
                if target[0] in ("store", "key") and _journalless_restart(history):
                    history.log(f"{target}: gone under a master without a journal while a segment was away "
                                f"({error}): allowed")
                else:
                    _judge(history, target, op, f"{target}: acknowledged populate {gen} is silently gone: {error}: "
                                                f"{op.reply.get('message')}")
            else:
                history.violation(f"{target}: final read failed: {error}: {op.reply.get('message')}")
        elif want == "absent":
            if op.outcome == "ok" and target[0] in ("store", "key") and _journalless_restart(history):
                history.log(f"{target}: back under a master without a journal while a segment was away: allowed")
            elif op.outcome == "ok":
                _judge(history, target, op, f"{target}: its last acknowledged write removed it, but it reads back: "
                                            f"{op.reply}")
            elif error not in ABSENT and error != "ObjectLost":
                _judge(history, target, op, f"{target}: expected absent, final read failed with {error}: "
                                            f"{op.reply.get('message')}")
        # Reads that succeed are held to the per-read contract by check_read already.


def _written_gens(history, target) -> set:
    """The generations of every write of ``target`` that was acknowledged or may have taken effect."""
    return {w.cmd["gen"] for w in _writes(history, target)
            if w.outcome != "fail" and w.cmd["op"] in ("populate", "put")}


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
    if not history.facts.get("journal_cut") or target[0] not in ("store", "key"):
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
