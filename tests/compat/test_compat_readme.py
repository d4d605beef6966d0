"""The README sends Mooncake users to the compatibility guide, and the guide's examples are there to run
(tests/test_docs.py runs every block of docs/*.md)."""
from __future__ import annotations

import re

from compat_helpers import REPO

GUIDE = "docs/mooncake-compat.md"


def test_the_readme_links_the_compat_guide_and_the_guide_holds_the_examples():
    with open(f"{REPO}/README.md", encoding="utf-8") as readme, open(f"{REPO}/{GUIDE}", encoding="utf-8") as guide:
        readme_text, guide_text = readme.read(), guide.read()
    assert GUIDE in readme_text, f"README.md does not link {GUIDE}"
    blocks = re.findall(r"```python\n(.*?)```", guide_text, flags=re.S)
    assert len(blocks) >= 5, f"{GUIDE} lost its examples ({len(blocks)} python blocks)"
    assert any("from engram_store.compat import" in block for block in blocks)
