"""Faults at rest and of inheritance for the explorer (``tests/nemesis.py``): bytes that rot in files, durable
segments restarted under readers cut off from the master, host caches whose users die mid-fill, forked children.

They come from a random stream of their own (``History.rest_rng``), drawn after the fault the main stream chose at
the same step, so a seed's schedule of operations and main faults is what it was before them (and ``--no-rest``
replays a seed found before them exactly):

* ``restart_cut_off``: a durable segment is stopped with SIGTERM and started again on its file while a client is
  cut off from the master (a partition where this run has network namespaces, else its proxy to the master frozen);
* ``rot_segment``: a durable segment is stopped with SIGTERM; a byte of one object its manifest lists is flipped,
  or the file is cut short inside an object; it starts again on its file;
* ``rot_disk``: a byte of a published ``disk_dir`` layer's data file is flipped, or the file is cut short;
* ``die_mid_fill``: a client whose host row cache (``cache_scope="host"``, chosen per seed) kills itself half way
  through a fill (the cache's test hook), leaving a set half-written for the others;
* forked lookups: some lookups run in a child the client forks after it has used the store.

What rotted is recorded (``History.rotted``: target -> when); the checker (``nemesis_check``) allows a named error
for it (ObjectLost, DiskReadError), never a wrong row, except from the page cache of a durable segment's file that
a local-direct reader maps: it reads the rotted bytes until the segment has started again and the master has
dropped the damaged replica (``rot_reads_until``), as ``docs/operating.md`` says.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np

from nemesis_check import _target
from nemesis_rows import kind_of, place
from suite_helpers import TcpProxy, flip_byte
from engram_store.kernels import generation_table

#: How long after a rotted segment registers again local-direct readers may still read its bytes (their placement
#: names the damaged replica until they check it with the master: at most PLACEMENT_STALE_S, and a check).
ROT_GRACE_S = 3.0
#: The chance that a step of the schedule also gets a fault of this module, and each one's weight.
REST_FAULT_P = 0.4
REST_FAULTS = {"restart_cut_off": 3, "rot_segment": 2, "rot_disk": 2, "die_mid_fill": 1}
#: The chance that a lookup runs in a forked child.
FORK_P = 0.15


class RestFaults:
    """Mixed into ``History``: the faults of this module, and the proxies that cut clients off where there are no
    network namespaces."""

    def rest_init(self, rest: bool) -> None:
        self.rest_rng = random.Random(f"at rest {self.seed}") if rest else None
        self.host_cache = rest and self.rest_rng.random() < 0.5
        self.rotted: dict[tuple, float] = {}          # target -> when its bytes last rotted
        self.rot_reads_until: dict[tuple, float] = {}  # target -> until when local-direct reads may see the rot
        self.local_direct_workers: set[str] = set()
        self.proxies: dict[str, TcpProxy] = {}        # worker -> its proxy to the master (no namespaces only)
        self.thaw_at: dict[str, float] = {}

    # ---- hooks the History calls ------------------------------------------------------------------

    def worker_master(self, name: str, local_direct: bool) -> str:
        """The master address a new client connects to: through a proxy of its own where this run has no network
        namespaces (so that it can be cut off), else the master's."""
        if local_direct:
            self.local_direct_workers.add(name)
        if self.rest_rng is None or self.network is not None:
            return self.master_address
        proxy = self.proxies[name] = TcpProxy(self.master_address)
        return proxy.address

    def worker_cache(self, dies_at: int = 0) -> str:
        """The row cache argument of a new client (``nemesis_worker.py``'s sixth)."""
        if not self.host_cache:
            return "process"
        return f"host-die:{dies_at}" if dies_at else "host"

    def rest_cmd(self, worker, cmd: dict) -> dict:
        """``cmd`` as ``worker`` runs it: some lookups in a forked child (not where a child would inherit the
        cache's test hook and die mid-fill in its parent's place; not the churn clients', which draw nothing from
        this stream)."""
        if self.rest_rng is not None and cmd["op"] == "lookup" and not worker.churn \
                and self.rest_rng.random() < FORK_P and not getattr(worker, "dies", False):
            cmd["fork"] = True
        return cmd

    def rest_fault(self) -> None:
        if self.rest_rng is None or self.rest_rng.random() >= REST_FAULT_P:
            return
        names = list(REST_FAULTS)
        name = self.rest_rng.choices(names, weights=[REST_FAULTS[n] for n in names])[0]
        getattr(self, "rest_" + name)()

    def rest_tend(self, now: float) -> None:
        for name, until in list(self.thaw_at.items()):
            if now >= until:
                del self.thaw_at[name]
                if name in self.proxies:
                    self.proxies[name].thaw()
                self.log(f"client {name} reaches the master again")
        for slot in self.segments:
            if slot.get("rotted") is not None and slot["proc"] is not None and not slot.get("starting"):
                for target in slot.pop("rotted"):
                    self.rot_reads_until[target] = now + ROT_GRACE_S
                slot.pop("truncated", None)
        for worker in [w for w in self.workers.values() if getattr(w, "dies", False) and not w.proc.alive()]:
            self.kill_worker(worker, "killed itself half way through a host-cache fill (the test hook)")
            self.log(f"client {worker.name} died mid-fill (its cache's test hook)")

    def rest_refused(self, i: int) -> bool:
        """Whether segment ``i`` failed to start as it must: its file was cut short and the file system has no room
        to make it whole again (it says so, and is started again later)."""
        slot = self.segments[i]
        if not slot.get("truncated") or "No space left" not in slot["proc"].output():
            return False
        slot["proc"].expected_exit = True
        slot["proc"].close()
        slot["proc"] = None
        slot["starting"] = False
        slot["down_until"] = self.now() + 0.5
        self.log(f"segment{i} refused to start: its file was cut short and the file system has no room to make it "
                 "whole; starting it again later")
        return True

    def rest_heal(self) -> None:
        self.rest_tend(float("inf"))

    def rest_close(self) -> None:
        for proxy in self.proxies.values():
            proxy.close()
        self.proxies = {}

    # ---- the faults -------------------------------------------------------------------------------

    def _durable_up(self) -> int | None:
        up = [i for i, s in enumerate(self.segments) if s["file"] and s["proc"] is not None
              and not s["stopped_until"] and not s.get("starting")]
        return self.rest_rng.choice(up) if up else None

    def _stop_durable(self, i: int) -> None:
        """SIGTERM durable segment ``i``; it starts again on its file after a while (``tend_faults``)."""
        self.terminate_segment(i)
        self.segments[i]["down_until"] = self.now() + self.rest_rng.uniform(0.0, 1.5)

    def rest_restart_cut_off(self) -> None:
        i = self._durable_up()
        if i is None or not self.main_workers:
            return
        names = sorted(self.main_workers)
        local = [n for n in names if n in self.local_direct_workers]
        name = self.rest_rng.choice(local or names)
        cut_s = self.rest_rng.uniform(1.0, 4.0)
        if self.network is not None:
            worker = self.workers[name]
            rules = [(worker.node, "master"), ("master", worker.node)]
            for src, dst in rules:
                self.network.block(src, dst)
        elif name in self.proxies:
            self.proxies[name].freeze()
        self._stop_durable(i)  # (a clean stop takes a while: the cut lasts from its end)
        until = self.now() + cut_s
        if self.network is not None:
            self.network.cuts.append((until, rules, f"{worker.node} x master"))
        elif name in self.proxies:
            self.thaw_at[name] = max(until, self.thaw_at.get(name, 0.0))
        self.log(f"FAULT client {name} cut off from the master until {until:.3f}; segment{i} stopped (SIGTERM) to "
                 "start again on its file")

    def rest_rot_segment(self) -> None:
        i = self._durable_up()
        if i is None:
            return
        slot = self.segments[i]
        self._stop_durable(i)
        try:
            with open(slot["file"] + ".manifest", encoding="utf-8") as f:
                objects = json.load(f)["objects"]
        except (OSError, ValueError, KeyError):
            objects = []
        if not objects:
            self.log(f"FAULT segment{i} stopped (SIGTERM); its manifest lists nothing to rot")
            return
        key, offset, size = (lambda e: (e[0], int(e[1]), int(e[2])))(self.rest_rng.choice(objects))
        at = offset + self.rest_rng.randrange(max(1, size))
        cut = self.rest_rng.random() >= 0.7
        if not cut:
            flip_byte(slot["file"], at)
            hit = [key]
            what = f"a byte of {key!r} at offset {at} flipped"
        else:
            os.truncate(slot["file"], at)
            slot["truncated"] = True
            hit = [e[0] for e in objects if int(e[1]) + int(e[2]) > at]
            what = f"cut short at offset {at} ({len(hit)} object(s) past it)"
        targets = {_target_of(k) for k in hit} - {None}
        if _unnamed_hit(slot["file"], objects, at, cut):
            # The manifest lags what the segment holds (it keeps its old file when the disk is full: seed 860097),
            # and the rot hit an object it does not name: any object written to the store may be that one.
            targets |= {_target(op.cmd) for op in self.ops
                        if op.cmd["op"] in ("populate", "put", "reload")
                        and place(op.cmd.get("kind", "store")) == "store"}
            what += "; it hit an object the manifest does not name yet, so every object written counts as hit"
        for target in targets:
            self.rotted[target] = self.now()
            self.rot_reads_until[target] = float("inf")  # until the segment has registered again
        slot["rotted"] = sorted(targets)
        self.log(f"FAULT segment{i} stopped (SIGTERM) and its file rotted: {what}")

    def rest_rot_disk(self) -> None:
        disk = os.path.join(self.files, "disk")
        try:
            layers = sorted(n for n in os.listdir(disk) if n.startswith("layer-") and n[6:].isdigit())
        except OSError:
            return
        if not layers:
            return
        name = self.rest_rng.choice(layers)
        file = os.path.join(disk, name, "rows.bin")
        try:
            size = os.path.getsize(file)
            if size < 4096:
                return  # cut short already
            os.chmod(file, 0o644)
            if self.rest_rng.random() < 0.7:
                at = self.rest_rng.randrange(size)
                flip_byte(file, at)
                what = f"a byte flipped at offset {at}"
            else:
                at = self.rest_rng.randrange(size // 4096) * 4096
                os.truncate(file, at)
                what = f"cut short at offset {at}"
        except OSError as exc:  # removed meanwhile
            self.log(f"disk layer {name}: could not rot it ({exc})")
            return
        self.rotted[(kind_of("disk", int(name[6:])), int(name[6:]))] = self.now()
        self.log(f"FAULT disk layer {name[6:]}'s data file rotted: {what}")

    def rest_die_mid_fill(self) -> None:
        if not self.host_cache:
            return
        worker = self.start_worker(dies_at=self.rest_rng.randint(1, 40))
        worker.dies = True
        worker.proc.expected_exit = True
        self.log(f"FAULT client {worker.name} started to die half way through one of its host-cache fills")


def _unnamed_hit(path: str, objects: list, at: int, cut: bool) -> bool:
    """Whether rot at byte ``at`` of a durable segment's file (a flip there, or ``cut``: the file cut short there)
    hits an object its manifest (``objects``) does not name: one its generation table (``<file>.gen``, the segment
    stopped) records as written and not removed, at a place and size no manifest entry has. True where the table
    cannot tell (missing, overflowed)."""
    try:
        table = np.fromfile(path + ".gen", dtype=np.int64)
        n, cap = int(table[generation_table.COUNT]), int(table[generation_table.CAPACITY])
        if table[generation_table.OVERFLOW] or not 0 <= n <= cap or table.size < generation_table.table_words(cap):
            return True
    except (OSError, ValueError, IndexError):
        return True
    first = generation_table.HEADER_WORDS
    named = {(int(e[1]), int(e[2])) for e in objects}
    for base, size, put in zip(table[first:first + n].tolist(), table[first + cap:first + cap + n].tolist(),
                               table[first + 2 * cap:first + 2 * cap + n].tolist()):
        hit = base + size > at if cut else base <= at < base + size
        if hit and put > 0 and (base, size) not in named:
            return True
    return False


def _target_of(key: str):
    """The explorer's target an object of the store belongs to: a key, or a store layer (its heads, its manifest)."""
    if not key.startswith("engram:"):
        return ("key", key)
    part = key.split(":")[1]
    return (kind_of("store", int(part[1:])), int(part[1:])) if part[1:].isdigit() else None

