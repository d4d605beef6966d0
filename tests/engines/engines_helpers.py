"""What the engine tests share: a toy V4.1 checkpoint and its tables, the plugins' entry points as an installed
distribution would declare them, and the environment the engines' own code needs to run on a CPU.

The engines are optional (``pip install 'engram[vllm]'`` / ``'engram[sglang]'``): a test that needs one skips with
the reason where it is missing, so the suite runs without them (CI). Without a GPU the engines' Triton kernels run
in Triton's interpreter (``TRITON_INTERPRET=1``); vLLM keeps Triton on only where no device is visible at all
(``CUDA_VISIBLE_DEVICES=""``). Both are set before an engine is imported, and only on a machine with no GPU.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from engram_model.v41 import V41Config, load_v41_table, write_toy_checkpoint

ROOT = Path(__file__).resolve().parents[2]
#: The toy layout: the released structure (two layers, orders 2..4), 3 heads per order (9 columns: a 2-way split
#: pads a column, as vLLM pads heads), rows of 64 values (72 bytes).
CONFIG = V41Config(layer_ids=[1, 14], n_heads=3, head_dim=64, engram_vocab_size=300, compressed_vocab_size=100,
                   hidden_size=64)
TOKEN_MAP = np.arange(160) % 100


def cpu_engine_environment() -> None:
    """Set what an engine's own code needs to run on this CPU (before the engine is imported)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def require(module: str, extra: str):
    """The engine module, or a skip naming the one command that installs it."""
    import importlib.util

    if importlib.util.find_spec(module.split(".")[0]) is not None:
        cpu_engine_environment()
    return pytest.importorskip(module, reason=f"{module} is not installed: pip install 'engram[{extra}]' (an "
                                              f"optional extra; the engine tests skip without it)")


def write_checkpoint(directory: Path, config: V41Config = CONFIG) -> Path:
    write_toy_checkpoint(directory, config)
    return directory


def load_tables(checkpoint: Path, config: V41Config, *, local_dir: Path | None = None,
                disk_dir: Path | None = None) -> None:
    """Every layer of ``config`` into ``local_dir`` or ``disk_dir``, as ``engram-load-v41`` writes them."""
    for layer_id in config.layer_ids:
        load_v41_table(str(checkpoint), config, layer_id, local_dir=local_dir, disk_dir=disk_dir).close()


def checkpoint_tensors(checkpoint: Path, layer_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The layer's table as the checkpoint holds it: codes ``[rows, head_dim]`` and scale bytes, as uint8."""
    from engram_model.v41 import SafetensorsCheckpoint

    ckpt = SafetensorsCheckpoint(str(checkpoint))
    return (ckpt.raw(f"layers.{layer_id}.engram.embed.weight"), ckpt.raw(f"layers.{layer_id}.engram.embed.scale"))


def hash_ids(config: V41Config, T: int, seed: int, dead_rows: int = 1) -> np.ndarray:
    """Ids of T tokens for every layer, ``[T, n_layers, cols]`` int32, as the engines' hashers give them; the
    last ``dead_rows`` tokens are padding (-1, vLLM's DEAD_ID)."""
    from engram_model.v41 import V41Hasher

    rng = np.random.default_rng(seed)
    ids = V41Hasher(config, TOKEN_MAP)(rng.integers(0, TOKEN_MAP.size, (1, T)))[0].astype(np.int32)
    if dead_rows:
        ids[-dead_rows:] = -1
    return np.ascontiguousarray(ids)


def text_config(checkpoint: Path) -> dict:
    with open(checkpoint / "config.json", encoding="utf-8") as f:
        return json.load(f)["text_config"]


def entry_points_dist(directory: Path) -> Path:
    """A ``*.dist-info`` under ``directory`` declaring the entry points of pyproject.toml, as pip installs them:
    with ``directory`` on ``sys.path``, ``importlib.metadata`` finds them where the engines' loaders look."""
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    info = directory / "engram_plugins-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: engram-plugins\nVersion: 0\n")
    lines = []
    for group, entries in project["entry-points"].items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return directory


def run_script(script: str, env: dict, timeout: float = 600) -> str:
    """Run ``script`` in a fresh interpreter of this one (the engine's globals start clean), the worktree first on
    its path; returns its output, failing the test with it when the script fails."""
    import subprocess

    full_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script], env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"script failed ({proc.returncode}):\n{out[-6000:]}"
    return out


def bits(tensor):
    """A tensor's bytes as integers of its width, for bit-for-bit comparisons (NaN == NaN, -0 != +0)."""
    import torch

    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()])


def names_of(text: str, pattern: str) -> list[str]:
    return re.findall(pattern, text)
