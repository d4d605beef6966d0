"""The README's examples run as written."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.timeout(120)
def test_readme_store_example_runs():
    block = next(b for b in _python_blocks() if "DistributedStore.embedded" in b)
    exec(compile(block, str(README), "exec"), {})


@pytest.mark.timeout(120)
def test_readme_model_example_runs():
    block = next(b for b in _python_blocks() if "Engram(layer_id=1" in b)
    exec(compile(block, str(README), "exec"), {})


@pytest.mark.timeout(120)
def test_readme_mooncake_engram_example_runs():
    block = next(b for b in _python_blocks() if "get_query_workspace_size" in b)
    exec(compile(block, str(README), "exec"), {})


@pytest.mark.timeout(120)
def test_readme_step_ahead_prefetch_recipe_runs():
    block = next(b for b in _python_blocks() if "pending = engram.prefetch(steps[0]" in b)
    exec(compile(block, str(README), "exec"), {})


@pytest.mark.timeout(120)
def test_readme_several_layers_example_runs():
    block = next(b for b in _python_blocks() if "lookup_layers({1: ids, 15: ids})" in b)
    exec(compile(block, str(README), "exec"), {})


@pytest.mark.timeout(120)
def test_readme_v41_example_runs():
    block = next(b for b in _python_blocks() if "V41Hasher(config, token_map)" in b)
    exec(compile(block, str(README), "exec"), {})
