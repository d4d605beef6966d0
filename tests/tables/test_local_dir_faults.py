"""local_dir on a full file system: OutOfSpace naming the file, and nothing published or left behind."""
import os

import numpy as np
import pytest

from engram_store import EngramStore, EngramStoreConfig, OutOfSpace

pytestmark = pytest.mark.timeout(60)


def test_a_layout_file_that_finds_no_room_raises_out_of_space(tmpfs):
    tiny_tmpfs = tmpfs("64k")
    # 16 KiB taken by something else; the three heads take the 48 KiB left, so the layout file finds no page.
    with open(tiny_tmpfs / "other", "wb") as f:
        f.write(b"x" * (16 << 10))
    config = EngramStoreConfig(table_vocab_sizes=[256, 256, 256], embedding_dim=16)
    layer = EngramStore(1, config, local_dir=str(tiny_tmpfs / "layers"))
    with pytest.raises(OutOfSpace, match=r"local_dir: cannot publish layer 1 .* the file system is full .*layout"):
        layer.populate([np.zeros((256, 16), np.float32)] * 3)
    assert os.listdir(tiny_tmpfs / "layers") == []  # nothing published, nothing staged, no lock file
