"""local_dir on a full file system: OutOfSpace naming the file, and nothing published or left behind."""
import os
import subprocess

import numpy as np
import pytest

from engram_store import EngramStore, EngramStoreConfig, OutOfSpace

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 64 KiB tmpfs at tmp_path/fs (root only), unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "fs"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True,
                             timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True, timeout=30)


def test_a_layout_file_that_finds_no_room_raises_out_of_space(tiny_tmpfs):
    # 16 KiB taken by something else; the three heads take the 48 KiB left, so the layout file finds no page.
    with open(tiny_tmpfs / "other", "wb") as f:
        f.write(b"x" * (16 << 10))
    config = EngramStoreConfig(table_vocab_sizes=[256, 256, 256], embedding_dim=16)
    layer = EngramStore(1, config, local_dir=str(tiny_tmpfs / "layers"))
    with pytest.raises(OutOfSpace, match=r"local_dir: cannot publish layer 1 .* the file system is full .*layout"):
        layer.populate([np.zeros((256, 16), np.float32)] * 3)
    assert os.listdir(tiny_tmpfs / "layers") == []  # nothing published, nothing staged, no lock file
