"""The README's Mooncake compatibility examples run as written (one namespace, in order).

The guide docs/mooncake-compat.md holds the full story (tests/test_docs.py runs its blocks); the README's section
may shrink to a link to it, and then runs whatever blocks it still has.
"""
from __future__ import annotations

import re

import pytest

from compat_helpers import REPO

pytestmark = pytest.mark.timeout(120)

GUIDE = "docs/mooncake-compat.md"


def _section() -> str:
    """The README's Mooncake compatibility section, up to the next heading of its level ("" if it has none)."""
    text = open(f"{REPO}/README.md").read()
    lines, level, in_code = [], 0, False
    for line in text.splitlines(keepends=True):
        in_code ^= line.startswith("```")
        heading = re.match(r"(#{1,6}) ", line) if not in_code and not line.startswith("```") else None
        if heading and level and len(heading.group(1)) <= level:
            break
        if heading and not level and "Mooncake compatibility" in line:
            level = len(heading.group(1))
        elif level:
            lines.append(line)
    assert level or GUIDE in text, f"README.md has no Mooncake compatibility section and no link to {GUIDE}"
    return "".join(lines)


def test_readme_compat_examples_run(tmp_path):
    text = open(f"{REPO}/README.md").read()
    blocks = re.findall(r"```python\n(.*?)```", _section(), flags=re.S)
    assert len(blocks) >= 5 or GUIDE in text, f"the README's examples moved: link {GUIDE} from the README"
    namespace: dict = {}
    for block in blocks:
        if "127.0.0.1:50051" in block:  # needs a master started by hand
            compile(block, "README.md", "exec")
            continue
        exec(compile(block.replace("/dev/shm/engram", str(tmp_path)), "README.md", "exec"), namespace)
