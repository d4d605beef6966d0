"""The faults of the explorer (``tests/nemesis.py``): each is a method of its History, chosen by the seed's random
generator with a weight, where it applies."""

from __future__ import annotations

import os
import signal


class Faults:
    """Mixed into ``History``: ``fault_<name>`` methods (the faults), applied at a step of the schedule."""

    def fault_master_kill(self) -> None:
        """SIGKILL the master; it starts again (from its journal, or empty) after a pause."""
        self.master.expected_exit = True
        self.master.kill()
        self.master.close()
        self.master = None
        if not self.plan.journal:
            self.facts["journalless_restart"] = True
        self.master_down_until = self.now() + self.rng.uniform(0.0, 1.5)
        self.master_stopped_until = 0.0
        self.log("FAULT master killed (SIGKILL)")

    def fault_master_term(self) -> None:
        """SIGTERM: the routine stop; it starts again at once."""
        self.master.expected_exit = True
        self.master.popen.send_signal(signal.SIGCONT)
        code = self.master.terminate()
        if code != 0:
            self.violation(f"master exited with {code} on SIGTERM:\n{self.master.output()[-2000:]}")
        self.master.close()
        self.master = None
        if not self.plan.journal:
            self.facts["journalless_restart"] = True
        self.master_down_until = self.now()
        self.master_stopped_until = 0.0
        self.log("FAULT master stopped (SIGTERM)")

    def fault_master_pause(self) -> None:
        """SIGSTOP the master for up to three heartbeat timeouts."""
        self.master.signal(signal.SIGSTOP)
        self.master_stopped_until = self.now() + self.rng.uniform(0.2, 4.5)
        self.log(f"FAULT master paused (SIGSTOP) until {self.master_stopped_until:.3f}")

    def fault_second_master(self) -> None:
        """Start a second master on the same journal: it must refuse and leave the journal alone."""
        import subprocess
        import sys
        journal = self.journal_file
        before = os.stat(journal).st_ino if os.path.exists(journal) else None
        second = subprocess.run(self._prefix("master") + [sys.executable, "-m", "engram_store.master", "--host",
                                self._host("master"), "--port", "0", "--journal", journal],
                                capture_output=True, text=True, timeout=60)
        after = os.stat(journal).st_ino if os.path.exists(journal) else None
        if second.returncode == 0 or before != after:
            self.violation(f"a second master on the live journal did not refuse it (rc {second.returncode}, "
                           f"journal {'replaced' if before != after else 'kept'}):\n{second.stderr[-2000:]}")
        self.log("FAULT a second master tried the journal: " + (second.stderr.strip().splitlines() or ["?"])[-1])

    def _segment(self, registered: bool = False) -> int | None:
        live = [i for i, s in enumerate(self.segments) if s["proc"] is not None and not s["stopped_until"]
                and not (registered and s.get("starting"))]
        return self.rng.choice(live) if live else None

    def fault_segment_kill(self) -> None:
        """SIGKILL a segment; a durable one starts again on its file, a shared-memory one starts empty."""
        i = self._segment()
        slot = self.segments[i]
        slot["proc"].expected_exit = True
        slot["proc"].kill()
        slot["proc"].close()
        slot["proc"] = None
        if not slot["file"]:
            self.facts["shm_segment_died"] = True
        slot["down_until"] = self.now() + self.rng.uniform(0.0, 3.0)
        self.log(f"FAULT segment{i} killed (SIGKILL)" + ("" if slot["file"] else ": its shared memory is gone"))

    def fault_segment_term(self) -> None:
        """SIGTERM a segment (it unregisters; a shared-memory one takes its objects with it). Only one that has
        started: a process that has not yet run its own code dies of SIGTERM, as any does."""
        i = self._segment(registered=True)
        if i is None:
            return
        slot = self.segments[i]
        self.terminate_segment(i)
        if not slot["file"]:
            self.facts["shm_segment_died"] = True
        slot["down_until"] = self.now() + self.rng.uniform(0.0, 2.0)
        self.log(f"FAULT segment{i} stopped (SIGTERM)")

    def terminate_segment(self, i: int) -> None:
        """SIGTERM segment ``i`` and wait for it to exit; anything but a clean exit is a violation."""
        slot = self.segments[i]
        slot["proc"].expected_exit = True
        code = slot["proc"].terminate()
        if code != 0:
            self.violation(f"segment{i} exited with {code} on SIGTERM:\n{slot['proc'].output()[-2000:]}")
        slot["proc"].close()
        slot["proc"] = None

    def fault_segment_pause(self) -> None:
        """SIGSTOP a segment, often past the master's heartbeat timeout (it is dropped and comes back). A process of
        its user then tries to shrink a shared-memory segment's memory and generation table under the clients
        mapping them (no random draw: the schedules of older seeds stay as they were)."""
        i = self._segment()
        slot = self.segments[i]
        slot["proc"].signal(signal.SIGSTOP)
        slot["stopped_until"] = self.now() + self.rng.uniform(0.1, 4.0)
        self.log(f"FAULT segment{i} paused (SIGSTOP) until {slot['stopped_until']:.3f}")
        if not slot["file"]:
            self._shrink_memory(i, slot["proc"].pid)

    def _shrink_memory(self, i: int, pid: int) -> None:
        """Truncate every memfd of segment ``i`` (through /proc, as its user or root may): the seals must refuse.
        Had one shrunk, the clients mapping it would die of SIGBUS (which the checker reports too)."""
        tried = 0
        for name in os.listdir(f"/proc/{pid}/fd"):
            path = f"/proc/{pid}/fd/{name}"
            try:
                if not os.readlink(path).startswith("/memfd:engram-"):
                    continue
                fd = os.open(path, os.O_RDWR)
            except OSError:
                continue
            try:
                os.ftruncate(fd, 0)
                self.violation(f"segment{i}'s memory {os.readlink(path)} was shrunk under its readers")
            except PermissionError:
                tried += 1
            finally:
                os.close(fd)
        self.log(f"FAULT segment{i}: shrinking its memory refused ({tried} memfd(s) sealed)")

    def fault_client_kill(self) -> None:
        """SIGKILL a client, often mid-operation (a writer killed mid-populate or mid-remove); a new one starts."""
        busy = [w for w in self.main_workers.values() if w.op is not None]
        worker = self.rng.choice(busy or list(self.main_workers.values()))
        what = worker.op.cmd["op"] if worker.op is not None else "idle"
        self.kill_worker(worker, "killed by the explorer")
        self.log(f"FAULT client {worker.name} killed (SIGKILL) while {what}")
        self.start_worker()

    def fault_disk_full(self) -> None:
        """Fill the file system the layers and durable segments write to, for a while."""
        self.fs.fill(self.now() + self.rng.uniform(0.5, 4.0))
        self.log(f"FAULT the file system is full until {self.fs.full_until:.3f}")

    def fault_partition(self) -> None:
        """Cut two processes (or groups) apart for a while."""
        self.network.partition(self.rng, self.now(), self.log)


def _master_alive(h) -> bool:
    return h.master is not None and h.master.alive()


def _master_running(h) -> bool:
    return _master_alive(h) and not h.master_stopped_until


def _segment_live(h) -> bool:
    return any(s["proc"] is not None and not s["stopped_until"] for s in h.segments)


# name -> (weight, applies(history))
FAULTS = {
    "master_kill": (2, _master_alive),
    "master_term": (1, _master_running),
    "master_pause": (2, _master_running),
    "second_master": (0.5, lambda h: h.plan.journal and _master_running(h)),
    "segment_kill": (2, lambda h: sum(s["proc"] is not None for s in h.segments) > 1 and _segment_live(h)),
    "segment_term": (1, lambda h: sum(s["proc"] is not None for s in h.segments) > 1 and _segment_live(h)),
    "segment_pause": (3, _segment_live),
    "client_kill": (3, lambda h: any(w.op is not None for w in h.main_workers.values())),
    "partition": (3, lambda h: h.network is not None),
    "disk_full": (1.5, lambda h: h.fs is not None and not h.fs.full_until),
}
