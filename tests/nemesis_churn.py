"""Ordinary churn for the fault explorer (``tests/nemesis.py``): layers removed and populated again while every read
path is busy with them, and the faults that come with it.

Two more clients (``x0``, ``x1``, one local-direct and one not, or as the seed draws) run these one after another
all through the history (an idle client gets the next action at once), drawn from a random stream of their own
(``churn {seed}``), so a seed's schedule of operations and faults is what it was without them (``--no-churn``
replays a seed found before them exactly); its faults come at the schedule's steps:

* **layers of every shape** (``tests/nemesis_rows.py``): the small layers; ``wide`` store layers (one head of
  256-byte rows, so a lookup of many ids is one reply of 4 MB, which a segment streams in pieces over the raw
  channel); V4.1-shaped layers (264-byte rows) in the store, under ``local_dir`` and under ``disk_dir``;
* **reads** in bursts of up to a dozen (some paced over a few seconds), of few or many rows, through every path:
  ``lookup``, ``prefetch``, ``lookup_into`` (a buffer filled with a sentinel first), ``lookup_many`` of a family's
  layers together (one request per segment server for all, as an engine reads its layers), a store table with a row
  cache (``row_cache_bytes``), ``V41Rows.gather_into`` in the bf16, packed and split forms, on head shards
  (``head_start``) and in the background; a table opened anew before each read (``local_dir`` and ``disk_dir``
  opens under churn);
* **remove and populate again** of one layer by one client, back to back, through ``remove_from_store`` or
  ``engram-layers remove`` (a process; ``local_dir`` layers are removed only so), with or without ``--force``;
* **overlaps**: one client reads a layer in a burst while the other removes it and populates it again;
* **reloads**: one client removes a layer and populates it again while a thread of its own reads it;
* **races**: a populate and an ``engram-layers remove`` of the same layer started together;
* **resets**: ``remove_all`` (every object of the store, no segment told), and the focus layer populated again;
* **tables closed** under lookups in flight from another thread, another layer's table opened at once;
* faults: **SIGINT** to a client mid-call (its next call must answer right or fail cleanly); a **second segment**
  started on a durable segment's ``--file`` (it must be refused; while it runs, every read is held to the same
  contract); a churn client **cut off** from the master for a while;
* **cut-offs**: one client cut off from the master while it reads a store layer slowly, and the other removes it
  and another layer, and past the reuse delay populates the other (which may take its space) and it again.
"""

from __future__ import annotations

import random
import signal
import subprocess

from engram_store.testing import segment_ready, spawn_segment

import nemesis_rows as R

#: The churn clients' actions, how often, and how many idle clients each takes (an idle client gets the next one
#: at once: churn goes on all through the history, not a step at a time).
ACTIONS = {"repopulate": 2, "read": 3, "overlap": 2, "reload": 3, "race": 2, "close": 1.5, "reset": 0.7,
           "cutoff": 1.5}
CLIENTS = {"overlap": 2, "race": 2, "cutoff": 2}
#: The chance that a step of the schedule also gets a churn fault.
FAULT_P = 0.12
FAULTS = {"sigint": 2, "second_segment": 1, "cut_off": 1.5}
#: Kinds the churn acts on, and how often.
KIND_WEIGHTS = {"wide": 2, "v41": 2, "v41-local": 1.5, "v41-disk": 1, "store": 1, "local": 1, "disk": 1}
CHURN_WORKERS = 2
#: A short history's churn (``tour=True``, for CI): every action and fault, on every kind of layer, through each
#: read path, one a step, in this order.
TOUR = [
    ("populate", "wide", 21), ("populate", "v41", 11), ("populate", "v41-local", 12), ("populate", "v41-disk", 11),
    ("populate", "wide", 22), ("read", {"kind": "wide", "layer": 21, "many": True, "api": "into", "repeat": 6}),
    ("read", {"kind": "wide", "layer": 22, "many": True, "api": "layers", "repeat": 4}),
    ("overlap", "wide", 21), ("reload", "wide", 21),
    ("read", {"kind": "v41", "layer": 11, "many": True, "form": "bf16", "variant": "t1", "background": True}),
    ("race", "v41", 11),
    ("read", {"kind": "v41-local", "layer": 12, "form": "split", "reopen": True, "repeat": 6}),
    ("repopulate", "v41-local", 12),
    ("read", {"kind": "v41-disk", "layer": 11, "form": "packed", "reopen": True, "repeat": 4}),
    ("close", {"kind": "v41-disk", "layer": 11, "form": "packed"}),
    ("read", {"kind": "wide", "layer": 21, "variant": "cache", "api": "prefetch", "repeat": 4}), ("reset",),
    ("sigint",), ("cutoff",), ("second_segment",),
]
#: A tour's steps of the main schedule: the tour's, and a few more while the last of it runs.
TOUR_STEPS = len(TOUR) + 4
#: How long a second segment on a live segment's file has to be refused or to register (it must be refused as soon
#: as it starts, but starting takes a process's imports: tens of seconds on a loaded 2-core machine).
INTRUDER_VERDICT_S = 60.0


class Churn:
    """Mixed into ``History``: the churn stream's clients, operations and faults."""

    def churn_init(self, enabled: bool, tour: bool = False) -> None:
        self.churn_rng = random.Random(f"churn {self.seed}") if enabled else None
        self.tour = enabled and tour  # every action and fault in turn (a short history for CI)
        self._tour_step = 0
        self.intruders: list[dict] = []
        self._next_churn = 0
        self._started = False
        self._churning = False  # from the first step until the faults heal
        self._acting = False
        self._next_action: str | None = None
        if self.churn_rng is not None:  # the layer most churn acts on (half of it), so that its races meet
            kind = self._kind()
            self.focus = (kind, self.churn_rng.choice(R.LAYERS[R.family(kind)]))

    @property
    def main_workers(self) -> dict:
        """The workers of the main schedule (churn clients aside: the main stream's choices stay what they were)."""
        return {name: w for name, w in self.workers.items() if not w.churn}

    def churn_workers(self) -> list:
        return [w for w in self.workers.values() if w.churn and w.proc.alive()]

    def churn_worker_args(self) -> tuple[str, bool, str]:
        """The name, local-direct flag and network node of the next churn client."""
        n = self._next_churn
        self._next_churn += 1
        local_direct = n % 2 == 0 if self.churn_rng.random() < 0.7 else self.churn_rng.random() < 0.5
        return f"x{n}", local_direct, self.churn_rng.choice(["client0", "client1", "client2"])

    def churn_role(self, churn: bool) -> str:
        """A client's last argument: "1" a churn client, "2" another client of a history with churn (SIGINT may
        reach it), "0" a history without churn."""
        return "1" if churn else "2" if self.churn_rng is not None else "0"

    def churn_setup(self) -> list:
        if self.churn_rng is None:
            return []
        return [self.start_worker(wait=False, churn=True) for _ in range(CHURN_WORKERS)]

    # ---- the stream -------------------------------------------------------------------------------------------

    def churn_step(self) -> None:
        """At a step of the schedule: maybe a churn fault (a tour: its next action or fault)."""
        if self.churn_rng is None:
            return
        if not self._started:
            self._churn_start()
        if self.tour:
            if self._tour_step < len(TOUR):
                name, *args = TOUR[self._tour_step]
                self._tour_step += 1
                (getattr(self, "_churn_" + name, None) or getattr(self, "_fault_" + name))(*args)
            return
        if self.churn_rng.random() < FAULT_P:
            name = self.churn_rng.choices(list(FAULTS), weights=list(FAULTS.values()))[0]
            self._acting = True  # (a fault may wait a moment: no action starts meanwhile)
            try:
                getattr(self, "_fault_" + name)()
            finally:
                self._acting = False

    def churn_keep_busy(self) -> None:
        """Called as the history waits: the next action for the churn clients once enough of them are idle."""
        if not self._churning or self._acting or self.tour:
            return
        if self._next_action is None:
            self._next_action = self.churn_rng.choices(list(ACTIONS), weights=list(ACTIONS.values()))[0]
        if len(self._idle_now()) < CLIENTS.get(self._next_action, 1):
            return
        self._acting = True  # (an action may wait a moment itself: no action starts inside another)
        try:
            name, self._next_action = self._next_action, None
            getattr(self, "_churn_" + name)()
        finally:
            self._acting = False

    def _churn_start(self) -> None:
        """The churn clients' first operations: populate the focus layer and three more, so that reads find rows."""
        self._started = True
        if self.tour:
            return
        self._churning = True
        targets = [self.focus]
        while len(targets) < 4:
            kind = self._kind()
            target = (kind, self.churn_rng.choice(R.LAYERS[R.family(kind)]))
            if target not in targets:
                targets.append(target)
        for i, worker in enumerate(sorted(self.churn_workers(), key=lambda w: w.name)):
            self.issue_queue(worker, [self._populate(*t) for t in targets[i::CHURN_WORKERS]])

    def _kind(self) -> str:
        return self.churn_rng.choices(list(KIND_WEIGHTS), weights=list(KIND_WEIGHTS.values()))[0]

    def _target(self) -> tuple[str, int]:
        if self.churn_rng.random() < 0.5:
            return self.focus
        kind = self._kind()
        return kind, self.churn_rng.choice(R.LAYERS[R.family(kind)])

    def _idle_now(self) -> list:
        return sorted((w for w in self.churn_workers() if w.op is None and not w.queue), key=lambda w: w.name)

    def _idle(self, n: int = 1) -> list:
        """``n`` idle churn clients, or none (a tour waits for them)."""
        deadline = self.now() + (60.0 if self.tour else 0.0)
        while True:
            idle = self._idle_now()
            if len(idle) >= n or self.now() >= deadline:
                return self.churn_rng.sample(idle, n) if len(idle) >= n else []
            self.pump(self.now() + 0.05)

    def _populate(self, kind: str, layer: int) -> dict:
        self.generation += 1
        return {"op": "populate", "kind": kind, "layer": layer, "gen": self.generation,
                "replicas": self.plan.replicas if R.place(kind) == "store" else 1}

    def _remove(self, kind: str, layer: int) -> dict:
        force = self.churn_rng.random() < 0.5
        if R.place(kind) == "local" or self.churn_rng.random() < 0.4:
            return {"op": "cli_remove", "kind": kind, "layer": layer, "force": force}
        return {"op": "remove", "kind": kind, "layer": layer, "force": force}

    def _read_cmd(self, kind: str, layer: int) -> dict:
        rng = self.churn_rng
        cmd = {"op": "lookup", "kind": kind, "layer": layer, "seed": rng.randrange(1 << 30),
               "many": rng.random() < 0.5}
        if R.family(kind) == "v41":
            cmd["form"] = rng.choice(["bf16", "packed", "split"])
            cmd["background"] = rng.random() < 0.3
            if cmd["form"] != "split" and rng.random() < 0.3:
                cmd["variant"] = rng.choice([f"h{rng.randrange(R.v41().cols)}", "t0", "t1"])
        else:
            cmd["api"] = rng.choice(["lookup", "prefetch", "into", "layers"])
        if R.place(kind) == "store" and "variant" not in cmd and rng.random() < 0.35:
            cmd["variant"] = "cache"
        return cmd

    # ---- actions ----------------------------------------------------------------------------------------------

    def _churn_populate(self, kind: str, layer: int) -> None:
        idle = self._idle()
        if idle:
            self.issue(idle[0], self._populate(kind, layer))

    def _churn_repopulate(self, kind: str | None = None, layer: int | None = None) -> None:
        """One client removes the layer and populates it again, back to back."""
        idle = self._idle()
        if idle:
            if kind is None:
                kind, layer = self._target()
            self.issue_queue(idle[0], [self._remove(kind, layer), self._populate(kind, layer)])

    def _churn_read(self, given: dict | None = None) -> None:
        idle = self._idle()
        if idle:
            cmd = self._read_cmd(*self._target()) if given is None else {"op": "lookup", "seed": 1, **given}
            cmd.setdefault("repeat", self.churn_rng.randint(1, 12))
            cmd.setdefault("reopen", self.churn_rng.random() < (0.6 if R.place(cmd["kind"]) != "store" else 0.2))
            cmd.setdefault("fork", self.churn_rng.random() < 0.1)  # in a child forked after the client used the store
            cmd.setdefault("pace_s", self.churn_rng.choice([0.0, self.churn_rng.uniform(0.02, 0.25)]))
            self.issue(idle[0], cmd)

    def _churn_overlap(self, kind: str | None = None, layer: int | None = None) -> None:
        """One client reads the layer in a burst (streamed replies, row caches, opens: whatever the draw gives) and
        the other removes it and populates it again while it does."""
        pair = self._idle(2)
        if pair:
            if kind is None:
                kind, layer = self._target()
            read = self._read_cmd(kind, layer)
            read.update(repeat=12, pace_s=self.churn_rng.uniform(0.0, 0.1), fork=False,
                        reopen=R.place(kind) != "store" and self.churn_rng.random() < 0.7)
            self.issue(pair[0], read)
            self.pump(self.now() + self.churn_rng.uniform(0.0, 0.3))
            self.issue_queue(pair[1], [self._remove(kind, layer), self._populate(kind, layer)])

    def _churn_reload(self, kind: str | None = None, layer: int | None = None) -> None:
        """One client removes the layer and populates it again while a thread of its own reads it (a serving
        process reloading a layer it serves: its reads meet the remove at any point, its row cache and opens too)."""
        idle = self._idle()
        if idle:
            if kind is None:
                kind, layer = self._target()
            read = self._read_cmd(kind, layer)
            read["reopen"] = R.place(kind) != "store" and self.churn_rng.random() < 0.7
            self.issue(idle[0], {**self._populate(kind, layer), "op": "reload", "read": read,
                                 "after_s": self.churn_rng.uniform(0.0, 0.2)})

    def _churn_reset(self) -> None:
        """One client removes every object of the store (``remove_all``, which tells no segment: readers see it at
        their next check with the master) and populates the focus layer again, with the same sizes."""
        idle = self._idle()
        if idle:
            kind, layer = self.focus if R.place(self.focus[0]) == "store" else ("wide", 21)
            self.issue_queue(idle[0], [{"op": "remove_all", "force": self.churn_rng.random() < 0.5},
                                       self._populate(kind, layer)])

    def _churn_race(self, kind: str | None = None, layer: int | None = None) -> None:
        """A populate (after a remove, so that it writes) and an ``engram-layers remove`` of the same layer, started
        together: the remove lands while the populate writes, or just before or after."""
        pair = self._idle(2)
        if pair:
            if kind is None:
                kind, layer = self._target()
            self.issue_queue(pair[0], [{"op": "remove", "kind": kind, "layer": layer, "force": True}
                                       if R.place(kind) != "local" else
                                       {"op": "cli_remove", "kind": kind, "layer": layer, "force": True},
                                       self._populate(kind, layer)])
            self.issue(pair[1], {"op": "cli_remove", "kind": kind, "layer": layer,
                                 "force": self.churn_rng.random() < 0.5, "delay_s": self.churn_rng.uniform(0, 0.3)})

    def _churn_close(self, given: dict | None = None) -> None:
        idle = self._idle()
        if idle:
            cmd = self._read_cmd(*self._target()) if given is None else {"seed": 1}
            cmd.update(op="close_table", after_s=self.churn_rng.uniform(0, 0.05), variant="", **(given or {}))
            self.issue(idle[0], cmd)

    # ---- faults -----------------------------------------------------------------------------------------------

    def _fault_sigint(self) -> None:
        """SIGINT to a client in the middle of a call (a tour starts a long read for it)."""
        if self.tour:
            self._churn_read({"kind": "wide", "layer": 21, "many": True, "repeat": 12, "fork": False})
            self.pump(self.now() + 0.1)
        busy = sorted((w for w in self.workers.values() if w.op is not None and w.proc.alive()), key=lambda w: w.name)
        if not busy:
            return
        worker = self.churn_rng.choice(busy)
        worker.op.interrupted = True
        worker.proc.popen.send_signal(signal.SIGINT)
        self.log(f"FAULT client {worker.name} interrupted (SIGINT) while {worker.op.cmd['op']} #{worker.op.id}")

    def _churn_cutoff(self) -> None:
        """One churn client reads a store layer in a slow burst and is cut off from the master (its reads go on from
        the placement it has) while the other removes that layer and another, and past the master's reuse delay
        populates the other (which may take the first one's space) and the first again."""
        pair = self._idle(2)
        if not pair or not self._can_cut():
            return
        kind, layer = self._target()
        if R.place(kind) != "store":
            kind, layer = self.churn_rng.choice([("v41", 11), ("v41", 12), ("wide", 21), ("store", 1)])
        read = self._read_cmd(kind, layer)
        read.update(repeat=12, pace_s=0.25, reopen=False, fork=False)
        self.issue(pair[0], read)
        self.pump(self.now() + 0.3)
        other = self.churn_rng.choice([k for k in R.LAYERS[R.family(kind)] if k != layer])
        self.issue_queue(pair[1], [self._remove(kind, layer), self._remove(kind, other),
                                   {"op": "pause", "s": 0.4},  # (past the reuse delay: the space may go)
                                   self._populate(kind, other), self._populate(kind, layer)])
        self._cut(pair[0])

    def _fault_cut_off(self) -> None:
        """A churn client cut off from the master for a while, whatever it is doing."""
        workers = sorted(self.churn_workers(), key=lambda w: w.name)
        if workers and self._can_cut():
            self._cut(self.churn_rng.choice(workers))

    def _can_cut(self) -> bool:
        return self.network is not None or bool(self.proxies)

    def _cut(self, worker) -> None:
        until = self.now() + self.churn_rng.uniform(1.0, 4.0)
        if self.network is not None:
            rules = [(worker.node, "master"), ("master", worker.node)]
            for src, dst in rules:
                self.network.block(src, dst)
            self.network.cuts.append((until, rules, f"{worker.node} x master"))
        elif worker.name in self.proxies:
            self.proxies[worker.name].freeze()
            self.thaw_at[worker.name] = max(until, self.thaw_at.get(worker.name, 0.0))
        else:
            return
        self.log(f"FAULT client {worker.name} cut off from the master until {until:.3f}")

    def _fault_second_segment(self) -> None:
        """Start a second segment on a live durable segment's file: it must be refused."""
        taken = {it["i"] for it in self.intruders}
        live = [i for i, s in enumerate(self.segments) if s["file"] and s["proc"] is not None and i not in taken
                and not s["stopped_until"] and not s.get("starting")]
        if not live:
            return
        i = self.churn_rng.choice(live)
        slot = self.segments[i]
        node = f"segment{i}"
        proc = spawn_segment(self.master_address, self.segment_size, ["--file", slot["file"], "--register-timeout",
                                                                       "600"],
                             prefix=self._prefix(node), host=self._host(node))
        self.intruders.append({"i": i, "proc": proc, "first": slot["proc"], "since": self.now(), "verdict": None,
                               "until": self.now() + self.churn_rng.uniform(0.5, 3.0)})
        self.log(f"FAULT a second segment (pid {proc.pid}) started on segment{i}'s file")

    # ---- hooks the History calls ------------------------------------------------------------------------------

    def churn_tend(self, now: float) -> None:
        """Judge the second segments: refused (an error exit that says why), or running (a violation; it is killed
        after a while, and at once when the segment whose file it took stops, so that segment can start again)."""
        for it in list(self.intruders):
            slot = self.segments[it["i"]]
            if it["verdict"] is None:
                self._judge_intruder(it, now)
            if it["verdict"] is not None and (now >= it["until"] or slot["proc"] is not it["first"]
                                              or it["verdict"] != "running"):
                it["proc"].expected_exit = True
                it["proc"].close()
                self.intruders.remove(it)
                if it["verdict"] == "running":
                    self.log(f"the second segment on segment{it['i']}'s file killed (SIGKILL)")

    def _judge_intruder(self, it: dict, now: float) -> None:
        slot, proc = self.segments[it["i"]], it["proc"]
        first_held = slot["proc"] is it["first"] and it["first"].alive()
        try:
            ready = segment_ready(proc, 0.0)
        except RuntimeError:
            try:  # its output ended: it is exiting (its code comes a moment after, from a command as from a fork)
                proc.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            out = proc.output()
            if proc.popen.poll() not in (0, None) and "Traceback" not in out:
                it["verdict"] = "refused"
                self.log(f"the second segment on segment{it['i']}'s file was refused: "
                         + (out.strip().splitlines() or ["?"])[-1][:300])
            else:
                it["verdict"] = "failed"
                self.violation(f"a second segment on segment{it['i']}'s file exited with "
                               f"{proc.popen.returncode} without saying why:\n{out[-2000:]}")
            return
        if ready and first_held:
            it["verdict"] = "running"
            self.violation(f"a second segment on segment{it['i']}'s file started and registered "
                           f"(segment_id={proc.segment_id}) beside the segment that has it open (pid "
                           f"{it['first'].pid}): it was not refused")
        elif not first_held:
            it["verdict"] = "moot"  # the file's segment stopped meanwhile: the second may own the file now
            self.log(f"segment{it['i']} stopped while a second segment started on its file: that one is killed")
        elif now - it["since"] > INTRUDER_VERDICT_S:
            it["verdict"] = "running"
            self.violation(f"a second segment on segment{it['i']}'s file was neither refused nor registered within "
                           f"{INTRUDER_VERDICT_S:g} s")

    def churn_heal(self) -> None:
        self._churning = False
        deadline = self.now() + INTRUDER_VERDICT_S + 5
        while any(it["verdict"] is None for it in self.intruders) and self.now() < deadline:
            self.pump(self.now() + 0.1)
        for it in self.intruders:
            it["until"] = 0.0
        self.churn_tend(self.now())

    def churn_close(self) -> None:
        for it in self.intruders:
            it["proc"].expected_exit = True
            it["proc"].close()
        self.intruders = []
