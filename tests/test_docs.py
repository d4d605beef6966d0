"""The README's and the guides' examples run as written: every python block, and every bash block but the README's
two set-up commands (which CI itself runs: the install, then the tests).

A block that cannot run in a test (it needs a real checkpoint, or runs for minutes) is marked on the line before
it with ``<!-- docs-test: skip (why) -->``; it is still compiled (python) or syntax-checked (bash). A block that
needs an optional package (a serving engine) is marked ``<!-- docs-test: needs sglang -->``: it runs where the
package imports and is skipped, saying so, elsewhere. Code blocks are
``python`` or ``bash``; output shown in a block has no language (or ``text``).

Shell blocks start servers in the background on port 50051; here each runs with a free port in its place and a
home directory of its own, and everything it started is killed when it ends. A reader runs them one after the
other in one shell, on the one port: so each block stops the servers it starts (``kill`` with the ``$!`` it
kept). Every block runs in a working directory, a home and a temporary directory of its own and must leave them
empty: examples clean up what they make.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from engram_store.testing import free_port

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
GUIDES = sorted((ROOT / "docs").glob("*.md"))
SETUP_COMMANDS = ("pip install -e", "python -m pytest")
SKIP = "<!-- docs-test: skip"
NEEDS = "<!-- docs-test: needs "
#: Fence languages: code that runs, and output that does not.
RUNS, SHOWN = ("python", "bash"), ("", "text")


@dataclass
class Block:
    path: Path
    line: int        # where the fence opens, 1-based
    language: str
    text: str
    skip: bool       # marked: compiled or syntax-checked only
    needs: tuple = ()  # optional packages it imports: skipped where one is missing

    @property
    def id(self) -> str:
        first = next((s for s in self.text.splitlines() if s.strip() and not s.startswith("#")), "")[:50]
        return f"{self.path.name}:{self.line}: {first}"


def _blocks(path: Path) -> list[Block]:
    out, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            language, start = lines[i][3:].strip(), i
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            needs = tuple(before[len(NEEDS):].rstrip(" ->").split(",")) if before.startswith(NEEDS) else ()
            out.append(Block(path, start + 1, language, "\n".join(lines[start + 1:end]) + "\n",
                             before.startswith(SKIP), tuple(n.strip() for n in needs)))
            i = end
        i += 1
    return out


ALL = [b for path in [README, *GUIDES] for b in _blocks(path)]
SETUP = [b for b in ALL if b.path == README and b.language == "bash" and any(c in b.text for c in SETUP_COMMANDS)]
PYTHON = [b for b in ALL if b.language == "python"]
SHELL = [b for b in ALL if b.language == "bash" and b not in SETUP]


def test_the_readme_has_the_blocks_it_promises():
    assert any("engram-demo" in b.text for b in SETUP) and any("pytest" in b.text for b in SETUP)
    assert any("engram-master" in b.text and "engram-layers" in b.text for b in SHELL if b.path == README), \
        "the README's quick path: start a cluster, load a layer, read it, remove it"
    text = README.read_text()
    unlinked = [g.name for g in GUIDES if f"docs/{g.name}" not in text]
    assert not unlinked, f"guides the README's map does not link: {unlinked}"
    assert re.search(r"suite takes\s+about \d+ minutes", text), "the README says how long the tests run"


#: A server started in the background: ``engram-master ... &`` or ``engram-segment ... &`` (a comment may follow).
_BACKGROUND_SERVER = re.compile(r"^(engram-master|engram-segment)\b[^\n]*&\s*(#.*)?$", re.M)


def test_every_block_that_starts_servers_stops_them():
    """Each server a block starts with ``&`` has its pid kept on the next line (``NAME=$!``) and killed later in
    the block: a reader running the guides in one shell would otherwise find port 50051 taken by the last block's
    master, and a new master that cannot bind exits while the block goes on against the old one."""
    unstopped = []
    for block in SHELL:
        lines = block.text.splitlines()
        for i, line in enumerate(lines):
            if not _BACKGROUND_SERVER.match(line):
                continue
            kept = re.match(r"^(\w+)=\$!$", lines[i + 1].strip()) if i + 1 < len(lines) else None
            later = "\n".join(lines[i + 2:])
            if kept is None or not re.search(rf"^kill\b[^\n]*\${kept.group(1)}\b", later, re.M):
                unstopped.append(f"{block.id}: {line.strip()}")
    assert not unstopped, "servers started in the background and never stopped:\n" + "\n".join(unstopped)


def test_every_code_block_is_python_or_bash():
    other = [b.id + f" ({b.language})" for b in ALL if b.language not in RUNS + SHOWN]
    assert not other, "code blocks the docs test would not run (use python or bash, or mark output as text):\n" + \
        "\n".join(other)


@pytest.fixture
def own_tmp(tmp_path):
    """A temporary directory for the block alone (tempfile's and $TMPDIR); it must be empty afterwards."""
    directory = tmp_path / "tmp"
    directory.mkdir()
    saved = tempfile.tempdir
    tempfile.tempdir = str(directory)
    try:
        yield directory
    finally:
        tempfile.tempdir = saved
    left = sorted(p.name for p in directory.iterdir())
    assert not left, f"the example left temporary files or directories behind: {left}"


@pytest.fixture
def own_cwd(tmp_path, monkeypatch):
    """A working directory for the block alone; it must be empty afterwards."""
    directory = tmp_path / "cwd"
    directory.mkdir()
    monkeypatch.chdir(directory)
    yield directory
    left = sorted(p.name for p in directory.iterdir())
    assert not left, f"the example left files or directories in its working directory: {left}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_python_block_runs(block, own_tmp, own_cwd):
    code = compile(block.text, str(block.path), "exec")
    if block.skip:
        return
    missing = [name for name in block.needs if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}, which is not installed here (an optional serving engine)")
    if block.needs:  # engines write caches into the temporary directory as they import: theirs, not the example's
        imports = [node for node in ast.parse(block.text).body if isinstance(node, (ast.Import, ast.ImportFrom))]
        saved, tempfile.tempdir = tempfile.tempdir, None
        try:
            with warnings.catch_warnings():  # and on a CPU some warn that their GPU kernels are not there
                warnings.simplefilter("ignore")
                exec(compile(ast.Module(imports, []), str(block.path), "exec"), {})
        finally:
            tempfile.tempdir = saved
    exec(code, {"__name__": "__docs__"})


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("block", SHELL, ids=[b.id for b in SHELL])
def test_shell_block_runs(block, tmp_path, own_tmp):
    checked = subprocess.run(["bash", "-n"], input=block.text, text=True, capture_output=True)
    assert checked.returncode == 0, checked.stderr
    if block.skip:
        return
    script = block.text.replace("50051", str(free_port()))
    segments = len(re.findall(r"^engram-segment ", block.text, flags=re.M))
    log = tmp_path / "out.log"
    # Every command must succeed, and every segment it starts must come up (print its ready line); whatever the
    # block started in the background is stopped at the end.
    wrapped = (f"set -euo pipefail\nexec >{log} 2>&1\n"
               f"trap 'kill $(jobs -p) 2>/dev/null || true; wait' EXIT\n{script}\n"
               f"for i in $(seq 1200); do [ \"$(grep -c 'engram-segment ready' {log})\" -ge {segments} ] && exit 0; "
               "sleep 0.1; done; echo 'segments did not come up'; exit 1\n")
    # the console scripts installed beside this interpreter, also when its venv is not activated
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "PYTHONUNBUFFERED": "1", "PATH": path, "TMPDIR": str(own_tmp)}
    env.pop("ENGRAM_AUTH_DIR", None)
    result = subprocess.run(["bash", "-c", wrapped], cwd=home, env=env, timeout=200)
    out = log.read_text()
    assert result.returncode == 0, f"exit {result.returncode}\n{out}"
    left = sorted(p.name for p in home.iterdir())
    assert not left, f"the example left files or directories in its home and working directory: {left}"
    if "engram-master status" in block.text:
        assert "segment(s)" in out, out
