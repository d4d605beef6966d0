"""The master's journal in the fault explorer (``tests/nemesis.py``): on a small file system of its own that fills,
and damaged at rest between master restarts.

- **Full.** Where this run may mount (root), the journal lives on a tmpfs of a few MiB, which a fault fills for a
  while: every change the master cannot record is refused (``JournalError``, a definite failure the checker holds
  to "nothing changed"), and a master started meanwhile refuses to start, saying why, and is started again once
  there is room. A tmpfs still takes bytes into the last, partly used page of a file, so the running master is
  also held to its journal's size meanwhile (RLIMIT_FSIZE: the kernel refuses every byte past it). Elsewhere the
  journal lives in the history's directory and never fills.
- **Rot.** The master is killed and its journal damaged before it starts again: a bit flipped anywhere (it must
  refuse to start, naming the line; then the journal is restored, as an operator restores a copy), the last record
  torn, or the last whole records cut (it must start; it cannot know what it lost, and the segments, which it
  compares with the journal when they register, give back what they hold). A cut journal is a fact the checker
  knows (``facts["journal_cut"]``).

Journal faults draw from a stream of their own (``journal {seed}``), beside the fault the schedule chose, so a
seed's schedule of operations and other faults is what it was without them.
"""

from __future__ import annotations

import os
import random
import re

from nemesis_net import FileSystem


class JournalDisk(FileSystem):
    """The journal's own small tmpfs (root only)."""

    SIZE = "4m"


class JournalFaults:
    """Mixed into ``History``: where the journal lives, starting the master on it, and its faults."""

    def setup_journal(self, enabled: bool) -> None:
        """Call once ``self.dir`` exists; ``enabled``: journal faults in the schedule (seeds found before them
        replay without)."""
        self.journal_rng = random.Random(f"journal {self.seed}") if enabled else None
        self.journal_disk = None
        if enabled and self.plan.journal:
            self.journal_disk = JournalDisk.maybe(os.path.join(self.dir, "journal-fs"))
        self.facts["journal_cut"] = False

    @property
    def journal_file(self) -> str:
        where = self.journal_disk.path if getattr(self, "journal_disk", None) else self.dir
        return os.path.join(where, "master.journal")

    def start_master_or_refusal(self) -> bool:
        """Start the master; a refusal because its journal's disk is full is allowed (False: try again later)."""
        try:
            self.start_master()
            return True
        except RuntimeError as exc:
            text = str(exc)
            full = self.journal_disk is not None and self.journal_disk.full_until
            if not (full and "exit" in text and "code 2" in text and _names_the_journal(text)):
                raise
        self.log("the master refused to start (its journal's disk is full); again soon")
        self.master_down_until = self.now() + 0.3
        return False

    def journal_fault(self) -> None:
        """Maybe a journal fault, beside the fault the schedule chose (from the journal's own stream)."""
        if self.journal_rng is None or not self.plan.journal:
            return
        r = self.journal_rng.random()
        running = self.master is not None and self.master.alive() and not self.master_stopped_until
        if r < 0.12 and self.journal_disk is not None and not self.journal_disk.full_until:
            self.journal_disk.fill(self.now() + self.journal_rng.uniform(0.5, 4.0))
            self._hold_journal(os.path.getsize(self.journal_file) if os.path.exists(self.journal_file) else None)
            self.log(f"FAULT the journal's file system is full until {self.journal_disk.full_until:.3f}")
        elif r < 0.24 and running and os.path.exists(self.journal_file) and not (
                self.journal_disk is not None and self.journal_disk.full_until):  # a start must be possible
            self.fault_journal_rot()

    def fault_journal_rot(self) -> None:
        """SIGKILL the master, damage its journal at rest, start it on what is left (see the module)."""
        self.master.expected_exit = True
        self.master.kill()
        self.master.close()
        self.master = None
        with open(self.journal_file, "rb") as f:
            whole = f.read()
        damaged, what, refuse = _damage(self.journal_rng, whole)
        with open(self.journal_file, "wb") as f:
            f.write(damaged)
        self.log(f"FAULT master killed (SIGKILL), its journal {what}")
        try:
            self.start_master()
        except RuntimeError as exc:
            if not refuse or not _names_the_journal(str(exc)) or "Traceback" in str(exc):
                self.violation(f"the master did not start on a journal {what}:\n{str(exc)[-2000:]}")
            else:
                self.log("the master refused the journal: " + _names_the_journal(str(exc)))
            with open(self.journal_file, "wb") as f:
                f.write(whole)  # restored from a copy
            self.master_down_until = self.now()
            return
        if refuse:
            self.violation(f"the master started on a journal {what}, which it cannot have read as written")
        self.facts["journal_cut"] = True

    def heal_journal(self) -> None:
        if getattr(self, "journal_disk", None) and self.journal_disk.full_until:
            self.journal_disk.free()
            self._hold_journal(None)
            self.log("the journal's file system has room again")

    def _hold_journal(self, size: int | None) -> None:
        """Hold the running master's files to ``size`` bytes (None: let go); a master started since has no hold."""
        import resource

        if self.master is None or not self.master.alive():
            return
        limit = resource.RLIM_INFINITY if size is None else size
        try:
            resource.prlimit(self.master.pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        except (ProcessLookupError, PermissionError):
            pass

    def tend_journal(self, now: float) -> None:
        if getattr(self, "journal_disk", None) and self.journal_disk.full_until and now >= self.journal_disk.full_until:
            self.heal_journal()

    def release_journal(self) -> None:
        if getattr(self, "journal_disk", None):
            self.journal_disk.close()
            self.journal_disk = None


def _damage(rng: random.Random, whole: bytes) -> tuple[bytes, str, bool]:
    """``(damaged bytes, what was done, whether the master must refuse it)``."""
    lines = whole.splitlines(keepends=True)
    kind = rng.choice(["flip", "torn", "cut"]) if len(lines) > 1 else "flip"
    if kind == "flip":
        at, bit = rng.randrange(len(whole)), rng.randrange(8)
        damaged = bytearray(whole)
        damaged[at] ^= 1 << bit
        # The last newline flipped leaves a torn last record, which is dropped: the one flip it may start on.
        return bytes(damaged), f"with bit {bit} of byte {at} of {len(whole)} flipped", at != len(whole) - 1
    if kind == "torn":
        cut = len(whole) - rng.randint(1, len(lines[-1]) - 1)
        return whole[:cut], f"torn in its last record (cut at byte {cut} of {len(whole)})", False
    records = rng.randint(1, min(3, len(lines) - 1))
    return b"".join(lines[:-records]), f"without its last {records} record(s)", False


def _names_the_journal(text: str) -> str:
    """The master's refusal line, if it names the journal (and, for damage, the line)."""
    found = re.search(r"engram-master: journal .*", text)
    return found.group(0)[:300] if found else ""
