"""Checkpoint files: state_dict round trips, and the safetensors reader/writer against the safetensors package."""

import json
import struct

import numpy as np
import pytest

from engram_model import (BackboneConfig, Engram, EngramConfig, load_checkpoint, load_safetensors, save_checkpoint,
                          save_safetensors, split_embedding_table)
from engram_store import InvalidArgument, InvalidType

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def make_engram(seed=0):
    cfg = EngramConfig(engram_vocab_size=[40, 40], max_ngram_size=3, n_embed_per_ngram=8, n_head_per_ngram=2,
                       layer_ids=[1, 3], seed=seed)
    return Engram(1, cfg, BackboneConfig(hidden_size=6, hc_mult=2, vocab_size=300, num_layers=4))


def mixed_tensors():
    rng = np.random.default_rng(0)
    return {
        "f32": rng.standard_normal((3, 4)).astype(np.float32),
        "f64": rng.standard_normal(5),
        "f16": rng.standard_normal((2, 2)).astype(np.float16),
        "i64": np.arange(-3, 3, dtype=np.int64).reshape(2, 3),
        "i32": np.array([1, -2], np.int32),
        "u8": np.arange(7, dtype=np.uint8),
        "bool": np.array([True, False, True]),
        "scalar": np.array(2.5, np.float32),
        "empty": np.zeros((0, 3), np.float32),
    }


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_state_dict_round_trip(tmp_path, suffix):
    a, b = make_engram(seed=1), make_engram(seed=2)
    path = tmp_path / f"layer1{suffix}"
    a.save(str(path))
    b.load(str(path))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k])
    rng = np.random.default_rng(0)
    h = rng.standard_normal((1, 5, 2, 6), dtype=np.float32)
    emb = rng.standard_normal((1, 5, 4, 4), dtype=np.float32)
    np.testing.assert_array_equal(a.forward(h, embeddings=emb), b.forward(h, embeddings=emb))


def test_save_with_tables_and_split(tmp_path):
    engram = make_engram()
    sizes = engram.get_table_vocab_sizes()
    table = np.random.default_rng(0).standard_normal((sum(sizes), 4)).astype(np.float32)
    path = tmp_path / "full.safetensors"
    engram.save(str(path), include_tables=table)
    loaded = load_checkpoint(path)
    np.testing.assert_array_equal(loaded["multi_head_embedding.embedding.weight"], table)
    heads = split_embedding_table(loaded["multi_head_embedding.embedding.weight"], sizes)
    assert [t.shape[0] for t in heads] == sizes and all(t.flags.c_contiguous for t in heads)
    np.testing.assert_array_equal(np.concatenate(heads), table)
    with pytest.raises(InvalidArgument, match="include_tables"):
        engram.save(str(path), include_tables=table[:-1])
    with pytest.raises(InvalidArgument, match="expected .* rows"):
        split_embedding_table(table[:-1], sizes)


def test_our_writer_read_by_safetensors_package(tmp_path):
    tensors = mixed_tensors()
    path = tmp_path / "ours.safetensors"
    save_safetensors(path, tensors, metadata={"format": "np"})
    theirs = safetensors_numpy.load_file(str(path))
    assert theirs.keys() == tensors.keys()
    for k, v in tensors.items():
        assert theirs[k].dtype == v.dtype and theirs[k].shape == v.shape
        np.testing.assert_array_equal(theirs[k], v)
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert n % 8 == 0
    assert json.loads(path.read_bytes()[8:8 + n])["__metadata__"] == {"format": "np"}


def test_safetensors_package_file_read_by_our_reader(tmp_path):
    tensors = mixed_tensors()
    path = tmp_path / "theirs.safetensors"
    safetensors_numpy.save_file(tensors, str(path), metadata={"a": "b"})
    ours = load_safetensors(path)
    assert ours.keys() == tensors.keys()
    for k, v in tensors.items():
        assert ours[k].dtype == v.dtype and ours[k].shape == v.shape
        np.testing.assert_array_equal(ours[k], v)
        assert ours[k].flags.writeable


def test_bf16_is_widened_to_float32(tmp_path):
    values = np.array([1.0, -2.5, 3.140625], np.float32)  # exactly representable in bfloat16
    raw = (values.view(np.uint32) >> 16).astype("<u2").tobytes()
    header = json.dumps({"x": {"dtype": "BF16", "shape": [3], "data_offsets": [0, len(raw)]}}).encode()
    path = tmp_path / "bf16.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw)
    out = load_safetensors(path)["x"]
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, values)


def test_corrupt_files_are_refused(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(InvalidArgument, match="not a safetensors file"):
        load_safetensors(path)
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(InvalidArgument, match="header length"):
        load_safetensors(path)
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(12))
    with pytest.raises(InvalidArgument, match="needs 16"):
        load_safetensors(path)
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(InvalidArgument, match="outside"):
        load_safetensors(path)
    header = json.dumps({"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(InvalidArgument, match="C64"):
        load_safetensors(path)


def test_checkpoint_format_by_extension(tmp_path):
    with pytest.raises(InvalidArgument, match=r"path: expected a file name ending in .npz or .safetensors"):
        save_checkpoint(tmp_path / "x.pt", {})
    with pytest.raises(InvalidType, match="complex"):
        save_safetensors(tmp_path / "c.safetensors", {"c": np.zeros(2, np.complex64)})
    save_checkpoint(tmp_path / "x.npz", {"a.b": np.ones(2, np.float32)})
    assert list(load_checkpoint(tmp_path / "x.npz")) == ["a.b"]


def test_a_named_pipe_or_a_directory_is_refused_without_blocking(tmp_path):
    """A FIFO named as the file hung the reader in its open; a directory raised a raw IsADirectoryError."""
    import os

    from suite_helpers import outcome_within

    os.mkfifo(tmp_path / "pipe.safetensors")
    (tmp_path / "dir.safetensors").mkdir()
    for name, kind in (("pipe", "a named pipe"), ("dir", "a directory")):
        path = tmp_path / f"{name}.safetensors"
        raised = outcome_within(lambda: load_safetensors(path), 20, f"reading {kind}")
        assert isinstance(raised, InvalidArgument), raised
        assert f"{path}: is {kind}, not a checkpoint file" in str(raised)


def test_saving_never_writes_through_a_name_planted_beside_the_file(tmp_path):
    """The writer wrote ``<path>.tmp`` (and ``.tmp.npz``) with a plain open: a link there led its bytes into
    another file. It writes a private temporary now, made exclusively, renamed into place."""
    import os

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    tensors = {"w": np.arange(6, dtype=np.float32)}
    for name, tmp in (("m.safetensors", "m.safetensors.tmp"), ("m.npz", "m.npz.tmp.npz")):
        os.symlink(victim, tmp_path / tmp)
        save_checkpoint(tmp_path / name, tensors)
        np.testing.assert_array_equal(load_checkpoint(tmp_path / name)["w"], tensors["w"])
        assert victim.read_bytes() == b"precious" and (tmp_path / tmp).is_symlink()
    assert sorted(os.listdir(tmp_path)) == ["m.npz", "m.npz.tmp.npz", "m.safetensors", "m.safetensors.tmp", "victim"]
