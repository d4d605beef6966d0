"""The README's examples run as written: every python block, and every shell block but the two set-up commands
(which CI itself runs: the install, then the tests). So do the python blocks of the guides in docs/.

Shell blocks start servers in the background on port 50051; here each runs with a free port in its place and a
home directory of its own, and everything it started is killed when it ends.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engram_store.testing import free_port

README = Path(__file__).resolve().parent.parent / "README.md"
SETUP_COMMANDS = ("pip install -e", "python -m pytest")


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def _first_line(block: str) -> str:
    return next((line for line in block.splitlines() if line.strip() and not line.startswith("#")), "")[:60]


PYTHON = _blocks("python")
SHELL = [b for b in _blocks("bash") if not any(command in b for command in SETUP_COMMANDS)]


def test_the_readme_has_the_blocks_it_promises():
    assert len(PYTHON) >= 10 and len(SHELL) >= 2
    setup = [b for b in _blocks("bash") if any(command in b for command in SETUP_COMMANDS)]
    assert any("engram-demo" in b for b in setup) and any("pytest" in b for b in setup)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("block", PYTHON, ids=[_first_line(b) for b in PYTHON])
def test_python_block_runs(block):
    exec(compile(block, str(README), "exec"), {"__name__": "__readme__"})


@pytest.mark.timeout(240)
@pytest.mark.parametrize("block", SHELL, ids=[_first_line(b) for b in SHELL])
def test_shell_block_runs(block, tmp_path):
    script = block.replace("50051", str(free_port()))
    segments = len(re.findall(r"^engram-segment ", block, flags=re.M))
    log = tmp_path / "out.log"
    # Every command must succeed, and every segment it starts must come up (print its ready line); whatever the
    # block started in the background is stopped at the end.
    wrapped = (f"set -euo pipefail\nexec >{log} 2>&1\ntrap 'kill $(jobs -p) 2>/dev/null; wait' EXIT\n{script}\n"
               f"for i in $(seq 1200); do [ \"$(grep -c 'engram-segment ready' {log})\" -ge {segments} ] && exit 0; "
               "sleep 0.1; done; echo 'segments did not come up'; exit 1\n")
    # the console scripts installed beside this interpreter, also when its venv is not activated
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONUNBUFFERED": "1", "PATH": path}
    env.pop("ENGRAM_AUTH_DIR", None)
    result = subprocess.run(["bash", "-c", wrapped], cwd=tmp_path, env=env, timeout=200)
    out = log.read_text()
    assert result.returncode == 0, f"exit {result.returncode}\n{out}"
    if "engram-master status" in block:
        assert "segment(s)" in out, out


DOCS = sorted((README.parent / "docs").glob("*.md"))
DOCS_PYTHON = [(path, block) for path in DOCS
               for block in re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("path, block", DOCS_PYTHON, ids=[f"{p.name}: {_first_line(b)}" for p, b in DOCS_PYTHON])
def test_docs_python_block_runs(path, block):
    exec(compile(block, str(path), "exec"), {"__name__": "__docs__"})
