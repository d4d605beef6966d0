"""A seeded fault explorer: from one integer seed, a history of store operations from several client processes,
interleaved with faults, checked against the store's contract.

In the spirit of Jepsen and of FoundationDB's simulation tests: examples pin the cases someone thought of, this
finds the ones nobody did. One seed fixes the cluster (journal or not, durable or shared-memory segments, replica
count) and the schedule of operations (populate, lookup, prefetch, remove, verify of store, ``local_dir`` and
``disk_dir`` layers, behind a client's own row cache or the host's, shared and asked for at different sizes; undo
of a client's own populate of a store layer; put, get and remove of objects; clients closing mid-call) and faults
(SIGKILL, SIGSTOP and restarts of the master, with and without its journal, and of segments; clients killed
mid-populate and mid-remove; a paused segment's shared memory truncated under its readers, which its seals must
refuse; network partitions between processes, where the machine lets this run make network namespaces). Streams
of their own add faults of the journal (``nemesis_journal``), faults at rest and forks (``nemesis_rest``) and
ordinary churn (``nemesis_churn``): layers of every shape (256-byte rows whose lookups stream, V4.1's 264-byte
rows read with ``V41Rows`` in every form) removed and populated again, also by ``engram-layers remove``, while
every read path reads them in bursts (row caches, head shards, the background, tables opened anew); tables closed
under lookups in flight; SIGINT to clients mid-call; a second segment started on a durable segment's file.
Processes are real (``engram-master``, ``engram-segment``, client processes running ``tests/nemesis_worker.py``,
``engram-layers``); timings are not, so a seed replays the same schedule, not the same interleaving.

The checker holds the history to the contract (``tests/nemesis_check.py``):

- every row a read returns, by any path (lookups, ``V41Rows`` gathers, row caches, reads in flight when their
  table closed, the reads a failed burst made before), is exactly the row asked for, of one populate of that
  layer that was acknowledged or may have taken effect (never another layer's or object's, never a mix of two
  populates, never one that was refused), and a table never goes back to a populate older than one it returned;
- a read of valid ids fails only with an error that says what happened (never one that blames the caller, such as
  InvalidArgument after a SIGINT), and no operation stalls past its bound (a LockTimeout is a stall);
- every acknowledged object is readable at the end, or reported lost by name when the bytes are truly gone (every
  segment that held it died); a removal that was acknowledged stays removed; every layer ends published whole or
  absent (never a manifest without its heads: the store's keys and the layer files are checked at the end);
- a second segment on a live segment's file is refused; no process of ours dies by a signal it was not sent, and
  none is left behind.

    python tests/nemesis.py --seed 17                # replay one history and print it
    python tests/nemesis.py --seeds 0-999 --minutes 60   # explore; prints each seed that broke the contract
    python tests/nemesis.py --seed 962 --tour        # the churn stream's short tour, as CI runs it
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))

from engram_store.testing import Proc, free_port, segment_ready, spawn_segment, start_master  # noqa: E402
from engram_store.segment import reap_orphans  # noqa: E402

from nemesis_churn import TOUR_STEPS, Churn  # noqa: E402
from nemesis_client import Op, Worker  # noqa: E402,F401 (Op and Worker: the tests that start clients of their own)
from nemesis_faults import FAULTS, Faults  # noqa: E402
from nemesis_journal import JournalFaults  # noqa: E402
from nemesis_rest import RestFaults  # noqa: E402
from nemesis_net import FileSystem, Network  # noqa: E402

#: The master's timing, short so that faults bite within a history of a few seconds.
HEARTBEAT_TIMEOUT_S = 1.5
MASTER_EXTRA = ["--reuse-delay", "0.3", "--put-timeout", "4"]
LEASE_TTL_S = 0.5
SEGMENT_SIZE = "4MiB"
#: With the churn stream's larger layers (nemesis_churn), twice as much.
CHURN_SEGMENT_SIZE = "8MiB"
CLIENT_TIMEOUT_MS = 2000
#: An operation still unanswered after this long is a hang (a violation).
OP_HANG_S = 90.0
#: Errors that leave an operation's outcome unknown: it may or may not have taken effect.
INDETERMINATE = {"MasterUnavailable", "SegmentUnavailable", "Unavailable", "killed", "RawChannelRefused",
                 "Interrupted", "CliFailed", "ReloadFailed"}
KINDS = ("store", "local", "disk")
LAYERS = (1, 2, 3)
KEYS = ("k1", "k2")


@dataclass
class Plan:
    """What one seed fixes about the cluster."""
    journal: bool
    segments: int
    durable: list[bool]
    replicas: int
    local_direct: list[bool]
    partitions: bool
    steps: int

    @classmethod
    def of(cls, rng: random.Random, partitions: bool) -> "Plan":
        segments = rng.choice([2, 2, 3])
        return cls(journal=rng.random() < 0.75, segments=segments,
                   durable=[rng.random() < 0.4 for _ in range(segments)], replicas=rng.choice([1, 1, 2]),
                   local_direct=[rng.random() < 0.5 for _ in range(3)], partitions=partitions,
                   steps=rng.randint(25, 45))


class History(Faults, JournalFaults, RestFaults, Churn):
    """Runs one seed: the cluster, the clients, the schedule of operations and faults, and the record of it."""

    def __init__(self, seed: int, verbose: bool = False, partitions: bool | None = None, undo: bool = True,
                 journal: bool = True, rest: bool = True, churn: bool = True, tour: bool = False,
                 steps: int | None = None):
        self.seed = seed
        self.rng = random.Random(seed)
        # Undos come from a stream of their own, so that without them (undo=False: how the seeds that found
        # something before undo_populate existed replay their histories) the schedule is what it was.
        self.undo_rng = random.Random(f"undo {seed}") if undo else None
        self.rest_init(rest)  # faults at rest, from a stream of their own too (see nemesis_rest)
        self.verbose = verbose
        self.network = self.fs = None
        self.dir = ""
        try:  # interrupted half-way (Ctrl-C, SIGTERM), nothing is left behind
            self.network = Network.maybe(seed) if partitions is not False else None
            self.dir = tempfile.mkdtemp(prefix=f"engram-nemesis-{seed}-")
            self.fs = FileSystem.maybe(os.path.join(self.dir, "fs"))  # where files live: a small tmpfs that can fill
        except BaseException:
            self.release()
            raise
        self.plan = Plan.of(self.rng, self.network is not None)
        if steps is not None or tour:
            self.plan.steps = steps or TOUR_STEPS
        self.churn_init(churn, tour)  # churn, from a stream of its own too (see nemesis_churn)
        self.segment_size = CHURN_SEGMENT_SIZE if churn else SEGMENT_SIZE
        self.files = self.fs.path if self.fs else self.dir
        self.t0 = time.monotonic()
        self.ops: list[Op] = []
        self.events: list[str] = []
        self.violations: list[str] = []
        self.lease_ttl_s = LEASE_TTL_S  # (the checker's: a remove without force passes over leased objects)
        self.generation = 0
        self.master: Proc | None = None
        self.master_port = free_port()
        self.segments: list[dict] = []  # {"proc", "file", "stopped_until", "down_until"}
        self.workers: dict[str, Worker] = {}
        self.master_stopped_until = 0.0
        self.master_down_until = 0.0
        #: What happened that the contract allows for: a shared-memory segment died (its objects are truly gone);
        #: a master restarted without a journal (it knows only what segments tell it, and every segment is away
        #: from it until it registers again: what it was told of writes and removes meanwhile it may not know).
        self.facts = {"shm_segment_died": False, "journalless_restart": False}
        try:
            self.setup_journal(journal)  # where the journal lives, and its faults (tests/nemesis_journal.py)
        except BaseException:
            self.release()
            raise
        self.registered: set[str] = set()  # segment ids the master knows once the faults have healed
        self._next_op = 1
        self._next_worker = 0

    # ---- the record ---------------------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.t0

    def log(self, text: str) -> None:
        line = f"{self.now():7.3f}          {text}"
        self.events.append(line)
        if self.verbose:
            print(line, flush=True)

    def violation(self, text: str) -> None:
        self.violations.append(text)
        self.log(f"VIOLATION: {text}")

    # ---- processes ----------------------------------------------------------------------------

    def _host(self, node: str) -> str:
        return self.network.address(node) if self.network else "127.0.0.1"

    def _prefix(self, node: str) -> list[str]:
        return self.network.prefix(node) if self.network else []

    @property
    def master_address(self) -> str:
        return f"{self._host('master')}:{self.master_port}"

    def start_master(self) -> None:
        journal = self.journal_file if self.plan.journal else None
        self.master = start_master(port=self.master_port, journal=journal, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
                                   lease_ttl_s=LEASE_TTL_S, extra=MASTER_EXTRA, prefix=self._prefix("master"),
                                   host=self._host("master"))

    def start_segment(self, i: int, wait: bool = True) -> None:
        """Start segment ``i`` (on its file, if durable); it counts as up once it has registered (it may have to
        wait for a master that is down, paused or cut off)."""
        slot = self.segments[i]
        extra = ["--file", slot["file"]] if slot["file"] else []
        node = f"segment{i}"
        slot["proc"] = spawn_segment(self.master_address, self.segment_size, extra + ["--register-timeout", "600"],
                                     prefix=self._prefix(node), host=self._host(node))
        slot["starting"] = True
        slot["stopped_until"] = slot["down_until"] = 0.0
        if wait:
            self.segment_started(i, timeout_s=60.0)

    def segment_started(self, i: int, timeout_s: float = 0.0) -> bool:
        slot = self.segments[i]
        if not slot.get("starting") or slot["proc"] is None:
            slot["starting"] = False
            return True
        try:
            if not segment_ready(slot["proc"], timeout_s):
                if timeout_s:
                    raise RuntimeError(f"no ready line within {timeout_s:g} s")
                return False
        except RuntimeError as exc:
            if self.rest_refused(i):  # a file cut short on a full file system: it starts once there is room
                return False
            self.violation(f"segment{i} did not start ({exc}):\n{slot['proc'].output()[-2500:]}")
            slot["proc"].expected_exit = True
        slot["starting"] = False
        return True

    def start_worker(self, wait: bool = True, dies_at: int = 0, churn: bool = False) -> Worker:
        if churn:
            name, local_direct, node = self.churn_worker_args()
        else:
            name = f"c{self._next_worker}"
            local_direct = self.plan.local_direct[self._next_worker % len(self.plan.local_direct)]
            self._next_worker += 1
            node = f"client{len(self.main_workers) % 3}"
        worker = Worker(name, [self.worker_master(name, local_direct), os.path.join(self.files, "local"),
                               os.path.join(self.files, "disk"), "1" if local_direct else "0", str(CLIENT_TIMEOUT_MS),
                               self.worker_cache(dies_at), os.path.join(self.dir, "shm"), self.churn_role(churn)],
                        self._prefix(node), wait)
        worker.node = node
        worker.churn = churn
        self.workers[name] = worker
        if churn:
            self.log(f"client {name} (churn) on {node}, " + ("local-direct" if local_direct else "reads remote"))
        return worker

    def all_procs(self) -> list[tuple[str, Proc]]:
        procs = [("master", self.master)] if self.master else []
        procs += [(f"segment{i}", s["proc"]) for i, s in enumerate(self.segments) if s["proc"] is not None]
        procs += [(f"client {w.name}", w.proc) for w in self.workers.values()]
        return procs

    def check_processes(self) -> None:
        """A process of ours that exited without being told to is a violation (a crash, an abort, a hang-up); a
        segment that exits while it starts is judged as a start (it may refuse as it must: see rest_refused)."""
        for i, slot in enumerate(self.segments):
            if slot.get("starting") and slot["proc"] is not None and not slot["proc"].alive():
                self.segment_started(i)
        for name, proc in self.all_procs():
            if getattr(proc, "expected_exit", False) or proc.alive():
                continue
            code = proc.popen.returncode
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            self.violation(f"{name} (pid {proc.pid}) died unasked: {how}\n{proc.output()[-2500:]}")
            proc.expected_exit = True  # said once

    # ---- operations ---------------------------------------------------------------------------

    def issue(self, worker: Worker, cmd: dict) -> Op:
        if worker.op is not None:  # its reply would be taken for the one in flight
            raise RuntimeError(f"the explorer sent {cmd} to client {worker.name}, busy with #{worker.op.id}")
        op = Op(self._next_op, worker.name, self.rest_cmd(worker, cmd), self.now())
        self._next_op += 1
        self.ops.append(op)
        worker.send(op)
        return op

    def issue_queue(self, worker: Worker, cmds: list[dict]) -> None:
        """Run ``cmds`` on ``worker`` one after the other, each as soon as the one before has ended."""
        worker.queue = list(cmds[1:])
        self.issue(worker, cmds[0])

    def pump(self, until: float) -> None:
        """Collect replies, resume paused processes when their time is up, restart what is due, until ``until``."""
        import select
        while True:
            self.tend_faults()
            self.check_processes()
            self.churn_keep_busy()
            busy = {w.proc.popen.stdout: w for w in self.workers.values() if w.op is not None and w.proc.alive()}
            now = self.now()
            for w in list(self.workers.values()):  # (killing one takes it out of the dict)
                if w.op is not None and now - w.op.invoked > OP_HANG_S:
                    self.violation(f"client {w.name}: {w.op.cmd} unanswered after {OP_HANG_S:g} s (a hang)")
                    self.kill_worker(w, "hung")
            timeout = max(0.0, min(until - now, 0.05))
            ready = select.select(list(busy), [], [], timeout)[0] if busy else (time.sleep(timeout) or [])
            for stream in ready:
                worker = busy[stream]
                line = worker.read_line(time.monotonic() + 10)
                if line is None:
                    continue  # it died: check_processes says so
                self.finish(worker, json.loads(line))
            if self.now() >= until:
                return

    def finish(self, worker: Worker, reply: dict) -> None:
        op, worker.op = worker.op, None
        if reply.get("id") != op.id:
            raise RuntimeError(f"client {worker.name} answered #{reply.get('id')} while #{op.id} was in flight")
        op.done, op.reply = self.now(), reply
        if reply.get("ok"):
            op.outcome = "ok"
        elif reply.get("error") in INDETERMINATE or op.interrupted:
            op.outcome = "unknown"
        else:
            op.outcome = "fail"
        if str(reply.get("error", "")).startswith("crash:"):
            self.violation(f"client {worker.name}: {op.cmd['op']} raised outside the store's errors:\n"
                           f"{reply.get('message')}")
        if self.verbose:
            print(op.describe(), flush=True)
        self.check_read(op)
        if worker.queue and worker.proc.alive():
            self.issue(worker, worker.queue.pop(0))

    def wait_idle(self, worker: Worker, timeout_s: float = OP_HANG_S) -> None:
        deadline = self.now() + timeout_s
        while worker.op is not None and self.now() < deadline and worker.proc.alive():
            self.pump(self.now() + 0.05)

    # ---- the schedule -------------------------------------------------------------------------

    def next_op(self) -> dict:
        rng = self.rng
        kind = rng.choices(KINDS, weights=[6, 2, 2])[0]
        layer = rng.choice(LAYERS)
        r = rng.random()
        if r < 0.25:
            self.generation += 1
            return {"op": "populate", "kind": kind, "layer": layer, "gen": self.generation,
                    "replicas": self.plan.replicas if kind == "store" else 1}
        if r < 0.55:
            return {"op": "lookup", "kind": kind, "layer": layer, "seed": rng.randrange(1 << 30),
                    "prefetch": rng.random() < 0.4}
        if r < 0.67:
            force = rng.random() < 0.5
            if kind == "store" and self.undo_rng is not None and self.undo_rng.random() < 0.3:
                return {"op": "undo", "kind": kind, "layer": layer}  # a loader taking back what it wrote
            return {"op": "remove", "kind": "store" if kind == "local" else kind, "layer": layer,
                    "force": force}  # local_dir layers are files: a deployment removes them
        if r < 0.72:
            return {"op": "verify", "kind": kind, "layer": layer}
        if r < 0.75:
            return {"op": "reopen", "kind": kind, "layer": layer}
        key = rng.choice(KEYS)
        if r < 0.82:
            self.generation += 1
            return {"op": "put", "key": key, "gen": self.generation, "replicas": self.plan.replicas}
        if r < 0.91:
            return {"op": "get", "key": key}
        if r < 0.96:
            return {"op": "remove_key", "key": key}
        return {"op": "close_midcall", "layer": layer, "after_s": rng.uniform(0, 0.05)}

    def run(self) -> list[str]:
        try:
            self.setup()
            for _ in range(self.plan.steps):
                self.pump(self.now() + self.rng.uniform(0.0, 0.3))
                self.churn_step()
                if self.rng.random() < 0.85:
                    idle = [w for w in self.main_workers.values() if w.op is None and w.proc.alive()]
                    if idle:
                        self.issue(self.rng.choice(idle), self.next_op())
                        continue
                if not self.tour:  # (a tour's faults are its own: it covers the churn stream in a short history)
                    self.fault()
                    self.rest_fault()
            self.heal()
            self.final_check()
        finally:
            self.teardown()
        return self.violations

    def setup(self) -> None:
        self.log(f"seed {self.seed}: {self.plan}")
        for d in ("local", "disk"):
            os.makedirs(os.path.join(self.files, d))
        workers = [self.start_worker(wait=False) for _ in range(3)]  # they import while the cluster starts
        workers += self.churn_setup()
        self.start_master()
        for i in range(self.plan.segments):
            self.segments.append({"proc": None, "file": os.path.join(self.files, f"segment-{i}.bin")
                                  if self.plan.durable[i] else None})
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(self.plan.segments) as pool:
            list(pool.map(self.start_segment, range(self.plan.segments)))
        for worker in workers:
            worker.wait_ready()

    # ---- faults -------------------------------------------------------------------------------

    def fault(self) -> None:
        names = [n for n, (weight, applies) in FAULTS.items() if applies(self)]
        if names:
            weights = [FAULTS[n][0] for n in names]
            name = self.rng.choices(names, weights=weights)[0]
            getattr(self, "fault_" + name)()
        self.journal_fault()

    def kill_worker(self, worker: Worker, why: str) -> None:
        worker.proc.expected_exit = True
        worker.proc.kill()
        worker.queue = []
        if worker.op is not None:
            op, worker.op = worker.op, None
            op.done, op.outcome, op.reply = self.now(), "unknown", {"error": "killed", "message": why}
            if self.verbose:
                print(op.describe(), flush=True)
        del self.workers[worker.name]
        worker.proc.close()

    def master_up(self) -> bool:
        return (self.master is not None and self.master.alive() and self.now() >= self.master_stopped_until)

    def tend_faults(self) -> None:
        """Resume what was paused and restart what was killed, when its time comes."""
        now = self.now()
        self.churn_tend(now)  # (before a segment starts again: a second segment on its file goes first)
        if self.master is not None and self.master_stopped_until and now >= self.master_stopped_until:
            self.master.signal(signal.SIGCONT)
            self.master_stopped_until = 0.0
            self.log("master resumed (SIGCONT)")
        self.tend_journal(now)
        if self.master is None and now >= self.master_down_until and self.start_master_or_refusal():
            self.log(f"master started again{' from its journal' if self.plan.journal else ' without a journal'}")
        for i, slot in enumerate(self.segments):
            if slot["proc"] is not None and slot["stopped_until"] and now >= slot["stopped_until"]:
                slot["proc"].signal(signal.SIGCONT)
                slot["stopped_until"] = 0.0
                self.log(f"segment{i} resumed (SIGCONT)")
            if slot["proc"] is None and now >= slot["down_until"]:
                self.start_segment(i, wait=False)
                self.log(f"segment{i} starting again" + (" on its file" if slot["file"] else " (empty)"))
            elif slot.get("starting") and self.segment_started(i):
                self.log(f"segment{i} registered")
        if self.network:
            self.network.tend(now, self.log)
        if self.fs and self.fs.full_until and now >= self.fs.full_until:
            self.fs.free()
            self.log("the file system has room again")
        self.rest_tend(now)

    def heal(self) -> None:
        """End every fault: resume, restart, reconnect; then let every operation in flight finish."""
        self.log("healing: every fault ends")
        if self.network:
            self.network.heal(self.log)
        self.rest_heal()
        if self.fs and self.fs.full_until:
            self.fs.free()
            self.log("the file system has room again")
        self.heal_journal()
        self.master_stopped_until = min(self.master_stopped_until, self.now()) if self.master_stopped_until else 0
        self.master_down_until = min(self.master_down_until, self.now())
        for slot in self.segments:
            if slot["stopped_until"]:
                slot["stopped_until"] = self.now()
            slot["down_until"] = min(slot["down_until"], self.now())
        self.tend_faults()
        self.tend_faults()
        self.churn_heal()
        for worker in list(self.workers.values()):
            self.wait_idle(worker)

    def teardown(self) -> None:
        self.churn_close()
        for worker in list(self.workers.values()):
            worker.proc.expected_exit = True
            worker.proc.close()
        for _, proc in self.all_procs():
            proc.expected_exit = True
            proc.close()
        reap_orphans()
        self.rest_close()
        self.release()

    def release(self) -> None:
        """Give back the namespaces, the file system and the directory of the history."""
        if self.network:
            self.network.close()
        if self.fs:
            self.fs.close()
        self.release_journal()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def transcript(self) -> str:
        """The whole history: operations and events in time order, then the violations."""
        lines = sorted(self.events + [op.describe() for op in self.ops], key=lambda line: float(line.split()[0]
                                                                                                 .split("..")[0]))
        return "\n".join(lines + ["", "violations:"] + [f"  - {v}" for v in self.violations]) + "\n"

    # ---- the contract -------------------------------------------------------------------------

    def check_read(self, op: Op) -> None:
        from nemesis_check import check_op
        for problem in check_op(self, op):
            self.violation(problem)

    def final_check(self) -> None:
        from nemesis_check import final_check
        final_check(self)


def run_seed(seed: int, verbose: bool = False, partitions: bool | None = None, undo: bool = True,
             journal: bool = True, rest: bool = True, churn: bool = True, tour: bool = False,
             steps: int | None = None) -> History:
    history = History(seed, verbose=verbose, partitions=partitions, undo=undo, journal=journal, rest=rest,
                      churn=churn, tour=tour, steps=steps)
    try:
        history.run()
    except Exception as exc:  # the explorer's own failure: what happened before it is kept for the record
        exc.nemesis_history = history
        raise
    return history


def main(argv: list[str] | None = None) -> int:
    from nemesis_cli import main as explore
    return explore(argv, run_seed, __doc__)


if __name__ == "__main__":
    sys.exit(main())
