"""Files on a host with another local user: directories of layers, the modes of what engram writes, and checkpoints.

The intruder (a second, unprivileged user, see ``security_helpers.py``) makes a ``local_dir`` for the victim, reads
what the victim's umask keeps private, writes a checkpoint whose index names a file of the victim's, and truncates a
checkpoint of its own while the victim loads it. The victim (this process, root) must refuse, keep private, and fail
with named errors, never die of a signal.
"""
import json
import os
import signal
import struct
import subprocess
import sys

import numpy as np
import pytest

from engram_model.v41 import V41Config, load_v41_weights, write_toy_checkpoint
from engram_store import EngramStore, EngramStoreConfig, InvalidArgument, SegmentServer, UnsafeFile
from security_helpers import TIMEOUT_S, intruder

pytestmark = pytest.mark.timeout(120)

CONFIG = EngramStoreConfig([40, 30], 8, row_format="bytes")
LOADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "loader_worker.py")


def _tables() -> list[np.ndarray]:
    rng = np.random.default_rng(2)
    return [rng.integers(0, 255, (n, 8), dtype=np.uint8) for n in CONFIG.table_vocab_sizes]


def test_a_local_dir_another_user_made_is_refused(shared):
    """The intruder makes the directory (mode 0777) before the victim populates into it; had the victim used it, the
    intruder would move the published layer away and put its own in its place."""
    tables = os.path.join(shared, "tables")
    intruder("mkdir", tables)
    with pytest.raises(UnsafeFile, match=rf"local_dir: {tables} belongs to uid 65534; .* use a directory you own"):
        with EngramStore(1, CONFIG, local_dir=tables) as store:
            store.populate(_tables())
            intruder("swap-layer", tables, 1, 0x41)


def test_a_local_dir_others_may_write_is_refused(shared):
    tables = os.path.join(shared, "open")
    os.mkdir(tables)
    os.chmod(tables, 0o777)
    with pytest.raises(UnsafeFile, match=r"may be written by other users \(mode 0777\), who could move a published"):
        EngramStore(1, CONFIG, local_dir=tables)


def test_a_file_another_user_keeps_private_is_refused_by_name_not_with_a_bare_permission_error(shared):
    """Where the system refuses to open another user's file (its mode, or fs.protected_regular in a sticky
    directory), an unprivileged user gets an UnsafeFile naming the file, its owner and what to do."""
    path = os.path.join(shared, "taken")
    intruder("plant", path)
    intruder("chmod", path, "600")
    said = intruder("--uid", 65533, "open-own", path)
    assert said.startswith(f"UnsafeFile: a shared file: {path} belongs to uid 65534 (mode 0600) and this user (uid "
                           "65533) may not open it (Permission denied; in a sticky world-writable directory "
                           "fs.protected_regular"), said
    assert "remove it (as its owner or root)" in said


def _made_under(*roots: str) -> list[str]:
    """Every file and directory below ``roots`` (not the roots themselves)."""
    return sorted(os.path.join(d, name) for root in roots for d, dirs, files in os.walk(root) for name in dirs + files)


def _publish_everything(base: str) -> list[str]:
    """A disk_dir layer, a local_dir layer and a durable segment's files, in directories another user may enter."""
    places = [os.path.join(base, name) for name in ("disk", "memory", "segment")]
    for place in places:
        os.mkdir(place)
        os.chmod(place, 0o755)
    with EngramStore(1, CONFIG, disk_dir=places[0]) as store:
        store.populate(_tables())
    with EngramStore(1, CONFIG, local_dir=places[1]) as store:
        store.populate(_tables())
    SegmentServer(1 << 20, None, file=os.path.join(places[2], "segment.bin"), readers=0, raw_reads=False).close()
    return places


@pytest.mark.parametrize("mask", [0o077, 0o022])
def test_what_engram_writes_follows_the_umask(shared, mask):
    """With umask 077 another user reads (or lists) none of it (local_dir's layer directories were forced to 0755,
    disk_dir's rows and manifests to 0444); with 022 the published tables are readable by all, as the umask says."""
    old = os.umask(mask)
    try:
        places = _publish_everything(shared)
    finally:
        os.umask(old)
    made = _made_under(*places)
    assert any(f.endswith("head-0.bin") for f in made) and any(f.endswith(".manifest") for f in made)
    tried = intruder("read", *made).splitlines()
    readable = [line.split(" ", 1)[1] for line in tried if line.startswith("readable")]
    if mask == 0o077:
        assert readable == [], f"another user read {readable}"
    else:
        assert os.path.join(places[0], "layer-1", "rows.bin") in readable
        assert os.path.join(places[1], "layer-1", "head-0.bin") in readable


def test_a_checkpoint_index_naming_a_file_outside_its_directory_is_refused(tmp_path, shared):
    """The intruder's checkpoint names a root-only file as a shard: the victim refuses the entry before opening
    anything, and quotes nothing of that file (it quoted its first 8 bytes as a header length)."""
    vault = tmp_path / "vault"
    vault.mkdir(mode=0o700)
    secret = vault / "secret"
    secret.write_bytes(b"root:$6$saltsalt$" + bytes(64))
    secret.chmod(0o600)
    quoted = str(struct.unpack("<Q", secret.read_bytes()[:8])[0])
    config = V41Config(layer_ids=[1], max_ngram_size=2, n_heads=1, head_dim=32, engram_vocab_size=2,
                       compressed_vocab_size=8, hidden_size=32, hc_mult=1)
    for entry in (str(secret), "../" * 12 + str(secret).lstrip("/")):
        checkpoint = os.path.join(shared, f"checkpoint-{len(entry)}")
        intruder("mkdir", checkpoint)
        names = ["wkv.weight", "wkv.scale", "q_weight", "k_weight", "embed.weight", "embed.scale"]
        index = {"weight_map": {f"layers.1.engram.{n}": entry for n in names}}
        intruder("write", os.path.join(checkpoint, "model.safetensors.index.json"), json.dumps(index))
        with pytest.raises(InvalidArgument) as refused:
            load_v41_weights(checkpoint, config, 1)
        message = str(refused.value)
        assert "outside the checkpoint's directory" in message and repr(entry)[:40] in message, message
        assert quoted not in message and "root:" not in message


def test_a_checkpoint_truncated_mid_load_is_a_named_error_not_a_signal(tmp_path, shared):
    """The checkpoint is the intruder's; it truncates the shard while the victim packs the table's second column.
    The victim's load ends with an error naming the shard (a mapping of it died of SIGBUS)."""
    config = V41Config(layer_ids=[1], max_ngram_size=3, n_heads=2, head_dim=32, engram_vocab_size=600,
                       compressed_vocab_size=8, hidden_size=32, hc_mult=1)
    checkpoint = write_toy_checkpoint(os.path.join(shared, "checkpoint"), config)
    shard = os.path.join(checkpoint, "model.safetensors")
    for path in (checkpoint, shard, os.path.join(checkpoint, "config.json")):
        os.chown(path, 65534, 65534)
    with open(shard, "rb") as f:
        data_start = 8 + struct.unpack("<Q", f.read(8))[0]
    assert config.offsets(1)[1] * config.head_dim > 3 * 4096  # column 1 lies pages past what is kept
    victim = subprocess.Popen([sys.executable, LOADER, checkpoint, str(tmp_path / "disk")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert victim.stdout.readline().strip() == "paused", victim.stderr.read()[-2000:]
        assert intruder("truncate", shard, data_start + 4096) == "truncated"
        out, err = victim.communicate("go\n", timeout=TIMEOUT_S)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.communicate(timeout=TIMEOUT_S)
    assert victim.returncode != -signal.SIGBUS, "the loader died of SIGBUS"
    assert victim.returncode == 0, err[-2000:]
    assert out.startswith("refused: InvalidArgument") and shard in out and "truncated" in out, out
    assert not (tmp_path / "disk" / "layer-1").exists()
