"""The README's Mooncake compatibility examples run as written (one namespace, in order)."""
from __future__ import annotations

import re

import pytest

from compat_helpers import REPO

pytestmark = pytest.mark.timeout(120)


def _section_blocks() -> list[str]:
    text = open(f"{REPO}/README.md").read()
    section = text[text.index("### Mooncake compatibility"):text.index("### Errors")]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_readme_compat_examples_run(tmp_path):
    blocks = _section_blocks()
    assert len(blocks) >= 5
    namespace: dict = {}
    for block in blocks:
        if "127.0.0.1:50051" in block:  # needs a master started by hand
            compile(block, "README.md", "exec")
            continue
        exec(compile(block.replace("/dev/shm/engram", str(tmp_path)), "README.md", "exec"), namespace)
