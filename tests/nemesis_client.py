"""The explorer's record of an operation and its client processes (``tests/nemesis.py``): each client runs
``tests/nemesis_worker.py``, one JSON command a line on its stdin, one JSON reply a line on its stdout."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field

from engram_store.testing import FORKED_SCRIPTS, Proc

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "nemesis_worker.py")
FORKED_SCRIPTS.add(WORKER)  # forked from a fork server in its node's namespace: no second of imports a client


@dataclass
class Op:
    """One operation of the history: what was asked, by whom, when, and how it ended."""
    id: int
    worker: str
    cmd: dict
    invoked: float
    done: float | None = None
    outcome: str = "pending"   # ok, fail (a definite refusal), unknown (may have taken effect)
    reply: dict = field(default_factory=dict)
    interrupted: bool = False  # a SIGINT reached its client while it ran (nemesis_churn)

    def describe(self) -> str:
        args = " ".join(f"{k}={v}" for k, v in self.cmd.items() if k not in ("op", "id"))
        end = "" if self.done is None else f"{self.done:7.3f}"
        result = {k: v for k, v in self.reply.items() if k not in ("id", "ok", "message")}
        message = self.reply.get("message", "")
        return (f"{self.invoked:7.3f}..{end:>7} {self.worker:<3} {self.cmd['op']:<13} {args:<34} -> {self.outcome}"
                + (f" {result}" if result else "") + (f" ({message[:160]})" if message else ""))


class Worker:
    """A client process and the operation it is running."""

    def __init__(self, name: str, args: list[str], prefix: list[str], wait: bool = True):
        self.name = name
        self.proc = Proc(prefix + [sys.executable, WORKER, *args],
                         f"client-{name}", stdout_pipe=True, stdin_pipe=True)
        self.buffer = b""
        self.op: Op | None = None
        self.node = ""
        self.churn = False  # a client of the churn stream (nemesis_churn)
        self.queue: list[dict] = []  # commands it runs next, one after the other
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait for the process's ready line (it has imported everything and will answer)."""
        line = self.read_line(time.monotonic() + 60)
        if line is None or "ready" not in json.loads(line):
            out = self.proc.output()
            self.proc.close()
            raise RuntimeError(f"client {self.name} did not start:\n{out[-3000:]}")

    def read_line(self, deadline: float) -> str | None:
        import select
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([self.proc.popen.stdout], [], [], remaining)
            if not ready:
                return None
            chunk = os.read(self.proc.popen.stdout.fileno(), 1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()

    def send(self, op: Op) -> None:
        self.op = op
        self.proc.popen.stdin.write((json.dumps({**op.cmd, "id": op.id}) + "\n").encode())
        self.proc.popen.stdin.flush()
