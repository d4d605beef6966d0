"""The fault explorer in the test suite: a fixed set of seeds, each a history of operations and faults held to the
store's contract (see ``tests/nemesis.py``; run more with ``python tests/nemesis.py --seeds A-B --minutes M``).

Seeds that once broke the contract stay here as examples, with what they found.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from nemesis import run_seed  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

#: Seeds that broke the contract once, and what they found.
FOUND = {
    2: "a durable segment restarted (SIGTERM) while a key and a layer were removed offered them back from its "
       "catalogue, and the master adopted them: removed objects came back",
    5: "a durable segment's generation table, a sparse file on a file system that filled up, killed the segment "
       "with SIGBUS at its next write",
    345: "a layer whose manifest's segment died (its heads lived) read as never published, not as lost",
    606: "a populate fenced by another client's forced remove undid its upload by key, after that client had "
         "populated the layer again: the acknowledged layer was removed (writers now name their put ids)",
    60022: "a key written again while its first object's segment was away from a master restarted without a "
           "journal read back that first object once the second was lost with its segment: what a restart "
           "without a journal may undo (docs/operating.md), which the checker now allows, and nothing more",
    70108: "a remove answered by a master restarted without a journal before the segments registered again "
           "removed nothing, and the layer came back with them: every segment is away from such a master until "
           "it registers, which the checker now counts",
    100017: "undo_populate after a populate refused with ObjectExists took back the layer's last populate that "
            "succeeded, while the explorer's client had forgotten it at the refused one: a refused populate now "
            "leaves what undo would take back as it was, in the client and in the model alike",
    424236: "a put of a key lost with its segment failed (another segment paused past the heartbeat timeout: "
            "WriteFenced) and erased the loss, so the lost object's segment came back with it intact and it was not "
            "restored (put_start forgot the loss; publication does now)",
    810014: "a populate started before the master was killed (its journal's disk full) was revoked by its writer "
            "after the master restarted from its journal, by put id; the new master had handed those ids to "
            "another client's populate of the same layer, whose heads the revoke removed: acknowledged rows "
            "silently gone (the journal named only published puts' ids; it now bounds every id handed out)",
    870113: "a durable segment found a byte flipped in a head's only replica; the master journalled the replica "
            "dropped and, in a second record, the loss, then died with its journal torn in that last record: "
            "replayed, the head was gone with no loss to name (ObjectNotFound); the drop and the loss are one "
            "record now",
    860097: "not the store's: a durable segment's manifest kept its old file while the disk was full, the file "
            "was then cut short before the objects written meanwhile, and the explorer, which took what rotted from "
            "the manifest alone, called their loss a violation; it reads the segment's generation table too now",
}
#: Seeds found before undo_populate was in the schedule: they replay the schedule they were found with
#: (``--no-undo``).
BEFORE_UNDO = {2, 5, 345, 606, 60022, 70108}
#: Seeds found before the explorer made faults of the master's journal: they replay without them
#: (``--no-journal-faults``).
BEFORE_JOURNAL = {2, 5, 345, 606, 60022, 70108, 100017, 424236}
#: Seeds found before the faults at rest and forks (``tests/nemesis_rest.py``): they replay without them
#: (``--no-rest``); the explored seeds run with them.
BEFORE_REST = {2, 5, 345, 606, 60022, 70108, 100017, 424236}
#: Further seeds explored on every run (CI's share of the exploration; each takes 5-20 s, so two and the churn tour
#: below keep the suite inside CI's time; explore more with ``python tests/nemesis.py --seeds A-B``).
EXPLORED = [101, 404]
#: Seeds that run without the churn stream (``tests/nemesis_churn.py``, ``--no-churn``): those found before it, which
#: replay as they were found, and the explored ones (a history with churn takes two or three times as long: the
#: tour is the churn stream's share of CI's time).
NO_CHURN = set(FOUND) | set(EXPLORED)
#: The churn stream's tour (every churn operation and fault once, in a short history) runs on this seed: its plan
#: has a durable segment, for the second segment started on its file.
TOUR_SEED = 962


def _assert_held(history, replay: str) -> None:
    assert not history.violations, (f"seed {history.seed} broke the contract (replay it with `python "
                                    f"tests/nemesis.py {replay}`):\n" + "\n".join(history.violations)
                                    + "\n\nhistory:\n" + "\n".join(op.describe() for op in history.ops[-60:]))


@pytest.mark.parametrize("seed", sorted(FOUND) + EXPLORED)
def test_history_holds_to_the_contract(seed):
    history = run_seed(seed, undo=seed not in BEFORE_UNDO, journal=seed not in BEFORE_JOURNAL,
                       rest=seed not in BEFORE_REST, churn=seed not in NO_CHURN)
    _assert_held(history, f"--seed {seed}" + (" --no-undo" if seed in BEFORE_UNDO else "")
                 + (" --no-journal-faults" if seed in BEFORE_JOURNAL else "")
                 + (" --no-rest" if seed in BEFORE_REST else "") + (" --no-churn" if seed in NO_CHURN else ""))


def test_the_churn_tour_holds_to_the_contract():
    """Every operation and fault of the churn stream, once, in a short history: streamed lookups of wide layers
    removed and populated again by the other client and by a thread of the reader's own, V41Rows in each form over
    the store, local_dir and disk_dir, a row cache, a
    populate racing engram-layers remove, a table closed under lookups, SIGINT mid-call, a client cut off, a
    second segment on a durable segment's file. The history must hold, and must have done each of these."""
    history = run_seed(TOUR_SEED, tour=True)
    ran = [op.cmd for op in history.ops if op.worker.startswith("x")]
    done = {(c["op"], c["kind"]) for c in ran if "kind" in c}
    assert {("populate", k) for k in ("wide", "v41", "v41-local", "v41-disk")} <= done, done
    assert {("cli_remove", "v41"), ("cli_remove", "v41-local"), ("close_table", "v41-disk")} <= done, done
    reads = [c for c in ran if c["op"] == "lookup"]
    assert {c.get("form") for c in reads} >= {"bf16", "packed", "split"}
    assert any(c.get("many") for c in reads) and any(c.get("variant") == "cache" for c in reads)
    assert any(c.get("api") == "layers" for c in reads)
    assert any(c.get("variant", "")[:1] in ("h", "t") for c in reads) and any(c.get("background") for c in reads)
    assert any(op.interrupted for op in history.ops), "no call was interrupted"
    assert any(c["op"] == "reload" for c in ran) and any(c["op"] == "remove_all" for c in ran)
    wide = [op for op in history.ops if op.cmd.get("kind") == "wide" and op.worker.startswith("x")]
    assert any(r.cmd["op"] in ("remove", "cli_remove") and r.worker != q.worker and q.cmd["op"] == "lookup"
               and q.invoked < r.invoked < (q.done or float("inf")) for q in wide for r in wide), \
        "no remove of a wide layer while the other client was reading it"
    events = "\n".join(history.events)
    assert "cut off from the master" in events and "a second segment" in events, events
    _assert_held(history, f"--seed {TOUR_SEED} --tour")


@pytest.mark.parametrize("kind", ["store", "wide", "v41"])
def test_every_row_carries_its_identity_and_a_wrong_one_shows(kind):
    """The rows the explorer writes say which layer, populate, head and row they are, in every form a read returns
    them (float32; V4.1's packed, split and bf16): the right rows pass, and a row of another populate, another row,
    another layer, or one never written (a buffer's sentinel) shows."""
    import numpy as np

    import nemesis_rows as R

    layer = R.LAYERS[R.family(kind)][0]
    gen3, gen4 = R.tables(kind, layer, 3), R.tables(kind, layer, 4)
    ids = np.array([[[5, 7, 9][:len(gen3)], [0, 1, 2][:len(gen3)]]])  # [B=1, L=2, H]
    if R.family(kind) != "v41":
        rows = np.stack([np.stack([gen3[h][ids[0, t, h]] for h in range(ids.shape[-1])]) for t in range(2)])[None]
        assert R.check_float(rows, ids, layer) == {"gens": [3], "bad": []}
        mixed = rows.copy()
        mixed[0, 1, 0] = gen4[0][ids[0, 1, 0]]
        assert R.check_float(mixed, ids, layer)["gens"] == [3, 4]
        for wrong in (gen3[0][ids[0, 0, 0] + 1], R.tables(kind, layer + 1, 3)[0][ids[0, 0, 0]]):
            bad = rows.copy()
            bad[0, 0, 0] = wrong
            assert len(R.check_float(bad, ids, layer)["bad"]) == 1
        return
    heads, rows = np.array([0, 1, 7, -1]), np.array([5, 7, 499, -1])
    packed = np.stack([gen3[h][r] if r >= 0 else np.zeros(R.v41().row_bytes, np.uint8) for h, r in zip(heads, rows)])
    for form, got in (("packed", packed), ("split", packed), ("bf16", R.bf16_of(packed))):
        assert R.check_v41(got, form, layer, heads, rows) == {"gens": [3], "bad": []}, form
        for wrong in (np.full_like(got[0], 0xEE), got[1], R.bf16_of(gen4[0][5]) if form == "bf16" else gen4[0][5]):
            bad = got.copy()
            bad[0] = wrong
            check = R.check_v41(bad, form, layer, heads, rows)
            assert len(check["bad"]) == 1 or check["gens"] == [3, 4], (form, check)


def _history(tmp_path, ops):
    from types import SimpleNamespace

    for d in ("local", "disk"):
        os.makedirs(tmp_path / d, exist_ok=True)
    events = []
    return SimpleNamespace(ops=ops, facts={"journalless_restart": False, "journal_cut": False}, log=events.append,
                           files=str(tmp_path), local_direct_workers=set(), rotted={}, rot_reads_until={},
                           lease_ttl_s=0.5)


def test_the_checker_holds_reads_errors_and_stalls_to_the_contract(tmp_path):
    """What the checker flags in one operation: a read of two populates, a table that goes back to a populate that
    had ended before one it returned, a misleading error after an interrupt, a fenced write that does not say so,
    a LockTimeout, a read past its bound; and what it lets be (a burst that saw one populate, then the next)."""
    from nemesis_check import check_op
    from nemesis_client import Op

    def op(i, cmd, invoked, done, reply, outcome="ok", worker="x0"):
        return Op(i, worker, cmd, invoked, done, outcome, reply)

    read = {"op": "lookup", "kind": "v41", "layer": 11}
    populates = [op(1, {"op": "populate", "kind": "v41", "layer": 11, "gen": 1}, 0.0, 1.0, {}),
                 op(2, {"op": "remove", "kind": "v41", "layer": 11}, 2.0, 3.0, {}),
                 op(3, {"op": "populate", "kind": "v41", "layer": 11, "gen": 2}, 4.0, 5.0, {})]
    history = _history(tmp_path, list(populates))

    def problems(new):
        history.ops.append(new)
        return check_op(history, new)

    assert not problems(op(4, read, 5.5, 6.0, {"gens": [1, 2], "bad": [], "reads": [[7, [1]], [7, [2]]], "took": 1}))
    assert not problems(op(5, read, 6.5, 7.0, {"gens": [2], "bad": [], "reads": [[7, [2]]], "took": 1}))
    assert any("went back" in p for p in problems(op(6, read, 7.5, 8.0, {"gens": [1], "bad": [],
                                                                         "reads": [[7, [1]]], "took": 1})))
    assert not problems(op(7, read, 7.5, 8.0, {"gens": [1], "bad": [], "reads": [[8, [1]]], "took": 1}))
    assert any("mixed" in p for p in problems(op(8, read, 8.5, 9.0, {"gens": [1, 2], "bad": [], "mixed": [[1, 2]],
                                                                     "reads": [[9, [1, 2]]], "took": 1})))
    interrupted = op(9, {"op": "get", "key": "k1"}, 9.0, 9.5, {"error": "Interrupted", "took": 0.1}, "unknown")
    interrupted.interrupted = True
    assert not problems(interrupted)
    assert any("interrupted in #9" in p for p in problems(
        op(10, {"op": "get", "key": "k1"}, 10.0, 10.5, {"error": "ProtocolError", "message": "bad reply",
                                                        "took": 0.1}, "fail")))
    assert problems(op(11, {"op": "populate", "kind": "wide", "layer": 21, "gen": 3}, 11, 12,
                       {"error": "ObjectNotFound", "took": 1}, "fail"))
    assert problems(op(12, read, 12, 43, {"error": "LockTimeout", "took": 31}, "fail"))
    assert problems(op(13, read, 13, 50, {"gens": [2], "bad": [], "reads": [[10, [2]]], "took": 36}))
    assert not problems(op(14, {"op": "undo", "kind": "store", "layer": 1}, 14, 15,
                           {"error": "InvalidArgument", "took": 0.1}, "fail"))


def test_a_remove_all_without_force_may_pass_over_an_object_a_read_leased(tmp_path):
    """Seed 972463: a get of a key 0.12 s before a remove_all without force left the key under its lease (0.5 s),
    so the master passed over it; the checker expected the key gone."""
    from nemesis_check import expected_final
    from nemesis_client import Op

    def history(read_at, force=False):
        return _history(tmp_path, [
            Op(1, "c0", {"op": "put", "key": "k2", "gen": 15}, 4.30, 4.31, "ok", {}),
            Op(2, "c1", {"op": "get", "key": "k2"}, read_at, read_at + 0.01, "ok", {"gen": 15}),
            Op(3, "x1", {"op": "remove_all", "force": force}, 5.91, 5.92, "ok", {"removed": 32})])

    assert expected_final(history(5.78), ("key", "k2")) == ("any", None)
    assert expected_final(history(5.78, force=True), ("key", "k2")) == ("absent", None)
    assert expected_final(history(4.50), ("key", "k2")) == ("absent", None)  # its lease was over


def test_the_checker_finds_half_published_layer_files(tmp_path):
    """A local_dir layer whose layout names a head file that is not there, and a disk_dir layer without its rows,
    are half-published; whole layers and staging directories are not."""
    from nemesis_check import _files_published

    for d in ("local", "disk"):
        os.makedirs(tmp_path / d)
    whole, half = tmp_path / "local" / "layer-1", tmp_path / "local" / "layer-2"
    for path in (whole, half):
        path.mkdir()
        (path / "layout").write_text("mooncake-engram-v1\n20\n3\n2\n")
        (path / "head-0.bin").write_bytes(b"x" * 60)
    (whole / "head-1.bin").write_bytes(b"x" * 40)
    (tmp_path / "local" / "layer-3.tmp").mkdir()
    (tmp_path / "disk" / "layer-4").mkdir()
    (tmp_path / "disk" / "layer-4" / "manifest.json").write_text("{}")
    problems = _files_published(str(tmp_path))
    assert len(problems) == 2 and "layer-2: head-1.bin is missing" in problems[0] and "layer-4" in problems[1]


@pytest.mark.timeout(120)
def test_the_explorer_counts_rot_of_objects_a_lagging_manifest_does_not_name(tmp_path):
    """Seed 860097: a durable segment's manifest kept its old file while the disk was full, so it did not name the
    layer written meanwhile; the file was cut short before that layer's objects, which were then lost, as they
    must be. The explorer took the rotted objects from the manifest alone and called the loss a violation. It now
    reads the segment's generation table too: rot that reaches an object the manifest does not name is seen."""
    import json

    import numpy as np

    from engram_store import DistributedStore
    from engram_store.testing import Cluster
    from nemesis_rest import _unnamed_hit
    from suite_helpers import manifest_objects, wait_for

    path = str(tmp_path / "segment.bin")
    with Cluster(segments=0) as c:
        segment = c.add_segment("1MiB", ["--file", path])
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            for key in ("a", "b"):
                store.put(key, np.full(5000, ord(key), np.uint8))
            places = {info.key: info.replicas[0].offset for info in store.locate(["a", "b"])}
        wait_for(lambda: manifest_objects(path) == 2, 20, "the manifest to name both objects")
        assert segment.terminate() == 0
    with open(path + ".manifest", encoding="utf-8") as f:
        objects = json.load(f)["objects"]
    assert places["a"] < places["b"]
    for cut in (True, False):
        assert not _unnamed_hit(path, objects, places["b"] + 10, cut)
        assert not _unnamed_hit(path, objects, places["a"] + 10, cut)
    lagging = [e for e in objects if e[0] == "a"]  # as if "b" was written while the disk was full
    assert _unnamed_hit(path, lagging, places["a"] + 10, cut=True)  # the cut reaches "b" too
    assert not _unnamed_hit(path, lagging, places["a"] + 10, cut=False)  # a flip in "a" does not
    assert _unnamed_hit(path, lagging, places["b"] + 10, cut=False)
    assert _unnamed_hit(str(tmp_path / "missing.bin"), objects, 0, cut=False)  # no table: it cannot tell


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["master", "segment"])
def test_a_stop_signal_while_a_server_starts_stops_the_explorer_and_is_not_a_failed_start(what, monkeypatch):
    """The explorer stops on SIGTERM by raising KeyboardInterrupt wherever it is; one that came while a master or
    segment started was turned into "did not start" (a RuntimeError), counted as the explorer's own failure, and
    the explorer went on with the next seed, ignoring every later signal. The server is killed and reaped, and the
    interrupt goes on."""
    from engram_store import testing

    started = []

    def interrupted(*args, proc=None, **kwargs):
        started.append(args[0])
        raise KeyboardInterrupt

    with testing.Cluster(segments=0) as c:
        monkeypatch.setattr(testing, "wait_ping", interrupted)
        with pytest.raises(KeyboardInterrupt):
            if what == "master":
                testing.start_master()
            else:
                testing.start_segment(c.address, "1MiB")
        assert started  # it got as far as waiting for the server's ping


@pytest.mark.timeout(60)
@pytest.mark.parametrize("truncated", [True, False])
def test_a_segment_that_refuses_to_start_on_a_full_file_system_is_not_a_death_unasked(truncated):
    """Seed 972996: a segment started again on its cut-short file while the file system was full refused to start
    (no room to make the file whole), as it must; it exited between the explorer's look at its start and its look
    at the processes, which called that a death unasked. A start that fails otherwise is still a violation."""
    from nemesis import History
    from engram_store.testing import Proc

    proc = Proc([sys.executable, "-c", "import sys; sys.stderr.write('segment size: cannot reserve 8388608 bytes: "
                 "No space left on device\\n'); sys.exit(2)"], "segment", stdout_pipe=True)
    proc.ready_line = b""  # (as spawn_segment starts one)
    try:
        proc.popen.wait(30)
        history = History.__new__(History)
        history.t0, history.verbose, history.events, history.violations = 0.0, False, [], []
        history.master, history.workers = None, {}
        history.segments = [{"proc": proc, "file": "segment-0.bin", "stopped_until": 0.0, "down_until": 0.0,
                             "starting": True, **({"truncated": True} if truncated else {})}]
        history.check_processes()
        if truncated:
            assert not history.violations, history.violations
            assert history.segments[0]["proc"] is None and any("refused to start" in e for e in history.events)
        else:
            assert len(history.violations) == 1 and "did not start" in history.violations[0]
    finally:
        proc.close()
