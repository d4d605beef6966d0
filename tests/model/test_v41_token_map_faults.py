"""load_token_map of a file that is not a saved token map: refused naming the path and what was expected."""
from __future__ import annotations

import numpy as np
import pytest

from engram_model.v41 import load_token_map, save_token_map
from engram_store import InvalidArgument

EXPECTED = "expected a token map saved by save_token_map"


@pytest.mark.parametrize("content, what", [
    (b"", "an empty file"),
    (b"hello, not a token map\n", "a file that is not a .npy file"),
    (b"PK\x03\x04 a zip archive, as np.savez writes", "a file that is not a .npy file"),
    (b"\x93NUMPY\x01\x00", "a damaged .npy file"),
    (b"\x93NUMPY\x01\x00\x10\x00{'descr': '<i8',", "a damaged .npy file"),
])
def test_a_file_that_is_not_a_token_map_is_refused(tmp_path, content, what):
    path = tmp_path / "token_map.npy"
    path.write_bytes(content)
    with pytest.raises(InvalidArgument, match=rf"{path}: {EXPECTED} \(a .npy file of int32\), got {what}"):
        load_token_map(path)


def test_a_truncated_token_map_is_refused(tmp_path):
    path = tmp_path / "token_map.npy"
    save_token_map(path, np.arange(1000))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(InvalidArgument, match=rf"{path}: {EXPECTED} \(a .npy file of int32\), got a damaged .npy "
                                              r"file \(.*"):
        load_token_map(path)


def test_a_directory_is_refused(tmp_path):
    with pytest.raises(InvalidArgument, match=rf"{tmp_path}: {EXPECTED} \(a .npy file of int32\), got a directory"):
        load_token_map(tmp_path)
