"""``engram-layers list|verify|remove`` on the three kinds of place: a store (real master and segment processes),
a ``local_dir`` and a ``disk_dir``; states published, partial, under-replicated and lost."""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from engram_store import DistributedStore, EngramStore, EngramStoreConfig
from engram_store.tables.cli import main
from engram_store.testing import Cluster

pytestmark = pytest.mark.timeout(180)

CONFIG = EngramStoreConfig(table_vocab_sizes=[101, 103, 107], embedding_dim=16)


def _tables(config: EngramStoreConfig = CONFIG, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, config.embedding_dim), dtype=np.float32) for n in config.table_vocab_sizes]


def layers(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def listed(capsys, *place: str) -> dict[int, dict]:
    code, out, err = layers(capsys, "list", *place, "--json")
    assert code == 0, err
    return {info["layer_id"]: info for info in json.loads(out)["layers"]}


def test_disk_dir_list_verify_remove(tmp_path, capsys, monkeypatch):
    directory = str(tmp_path / "ssd")
    bytes_config = EngramStoreConfig(table_vocab_sizes=[300, 301], embedding_dim=264, row_format="bytes")
    rng = np.random.default_rng(1)
    for layer_id in (1, 14):
        with EngramStore(layer_id, bytes_config, disk_dir=directory) as writer:
            writer.populate([rng.integers(0, 256, (n, 264), dtype=np.uint8) for n in bytes_config.table_vocab_sizes])
    os.mkdir(os.path.join(directory, "layer-5.tmp"))  # a writer that died half-way

    code, out, _ = layers(capsys, "list", "--disk-dir", directory)
    assert code == 0 and "2 layer(s)" not in out and "3 layer(s)" in out
    assert "bytes (264 B)" in out and "published" in out and "partial" in out
    found = listed(capsys, "--disk-dir", directory)
    assert found[1] == {"layer_id": 1, "state": "published", "heads": 2, "rows": 601, "row_format": "bytes",
                        "row_bytes": 264, "bytes": 601 * 264, "replicas": 1, "table_vocab_sizes": [300, 301],
                        "detail": ""}
    assert found[5]["state"] == "partial" and "layer-5.tmp" in found[5]["detail"]

    code, out, _ = layers(capsys, "verify", "--disk-dir", directory)
    assert code == 0 and "layer 1:" in out and "layer 14:" in out
    rows = os.path.join(directory, "layer-14", "rows.bin")
    os.chmod(rows, 0o644)
    with open(rows, "r+b") as f:  # a damaged file: one byte of head 0 changes
        f.seek(10)
        f.write(bytes([f.read(1)[0] ^ 0xFF]))
    code, out, err = layers(capsys, "verify", "--disk-dir", directory, "14")
    assert code == 1 and "checksum" in err and "layer 14" in err

    # No terminal to ask on and no --yes: refused, nothing removed.
    monkeypatch.setattr("sys.stdin.isatty", lambda: False, raising=False)
    code, _, err = layers(capsys, "remove", "--disk-dir", directory, "14")
    assert code == 2 and "--yes" in err and os.path.isdir(os.path.join(directory, "layer-14"))
    code, out, _ = layers(capsys, "remove", "--disk-dir", directory, "14", "--yes")
    assert code == 0 and "removed" in out
    assert not [name for name in os.listdir(directory) if name.startswith("layer-14")]  # nothing left, no lock file
    code, _, err = layers(capsys, "remove", "--disk-dir", directory, "14", "--yes")
    assert code == 1 and "not published" in err


def test_remove_asks_on_a_terminal(tmp_path, capsys, monkeypatch):
    directory = str(tmp_path / "ssd")
    with EngramStore(1, CONFIG, disk_dir=directory) as writer:
        writer.populate(_tables())

    class Terminal:
        @staticmethod
        def isatty() -> bool:
            return True

    monkeypatch.setattr("sys.stdin", Terminal())
    answers = iter(["n", "y"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(answers))
    code, out, _ = layers(capsys, "remove", "--disk-dir", directory, "1")
    assert code == 1 and "nothing removed" in out and os.path.isdir(os.path.join(directory, "layer-1"))
    code, out, _ = layers(capsys, "remove", "--disk-dir", directory, "1")
    assert code == 0 and not os.path.exists(os.path.join(directory, "layer-1"))


def test_a_missing_directory_is_refused_and_not_created(tmp_path, capsys):
    for flag in ("--disk-dir", "--local-dir"):
        code, _, err = layers(capsys, "list", flag, str(tmp_path / "typo"))
        assert code == 2 and f"{flag}: expected a directory" in err and "no such directory" in err
        assert not (tmp_path / "typo").exists()


def test_local_dir_list_verify_remove(tmp_path, capsys):
    directory = str(tmp_path / "shm")
    with EngramStore({1: CONFIG, 3: CONFIG}, local_dir=directory) as writer:
        writer.populate(_tables(), layer=1)
        writer.populate(_tables(seed=3), layer=3)
    found = listed(capsys, "--local-dir", directory)
    assert found[1]["state"] == "published" and found[1]["heads"] == 3 and found[1]["row_bytes"] == 64
    assert found[1]["bytes"] == sum(CONFIG.table_vocab_sizes) * 64

    code, out, _ = layers(capsys, "verify", "--local-dir", directory, "1", "3")
    assert code == 0 and "no checksums" in out
    head = os.path.join(directory, "layer-3", "head-1.bin")
    os.chmod(head, 0o644)
    os.truncate(head, 64)
    code, _, err = layers(capsys, "verify", "--local-dir", directory, "3")
    assert code == 1 and "head-1.bin" in err

    code, out, _ = layers(capsys, "remove", "--local-dir", directory, "1", "3", "--yes")
    assert code == 0, out
    assert sorted(os.listdir(directory)) == ["layer-1.lock", "layer-3.lock"]  # Mooncake's lock files stay
    assert listed(capsys, "--local-dir", directory) == {}


def test_store_states_and_removal(capsys):
    with Cluster(segments=2, segment_size="32MiB", heartbeat_timeout_s=2.0) as c:
        with DistributedStore.connect(c.address, timeout_ms=5000) as store:
            EngramStore(1, CONFIG, store).populate(_tables(), replica_num=2)
            lone = EngramStore(2, CONFIG, store)
            lone.populate(_tables(seed=2))
            shard = EngramStore(3, CONFIG, store, heads=[0])
            shard.populate(_tables()[:1])  # one shard of three: no manifest yet
            store.put("not-a-layer", b"x")
            place = ("--master", c.address)

            found = listed(capsys, *place)
            assert sorted(found) == [1, 2, 3]
            assert found[1]["state"] == "published" and found[1]["replicas"] == 2
            assert found[1]["rows"] == sum(CONFIG.table_vocab_sizes) and found[1]["row_format"] == "float32"
            assert found[1]["bytes"] == sum(CONFIG.table_vocab_sizes) * 64
            assert found[3]["state"] == "partial" and "no manifest" in found[3]["detail"]
            code, out, _ = layers(capsys, "list", *place)
            assert code == 0 and "float32 x 16" in out and "3 layer(s)" in out

            code, out, err = layers(capsys, "verify", *place)
            assert code == 0 and "layer 1:" in out and "layer 2:" in out, err

            store.get("engram:l2:h0")  # a read lease on one head
            code, _, err = layers(capsys, "remove", *place, "2", "--yes")
            assert code == 1 and "read lease" in err and "--force" in err and "force=True" not in err
            assert "nothing was removed" in err  # all or nothing: readers never see a half layer
            assert listed(capsys, *place)[2]["state"] == "published"
            code, out, _ = layers(capsys, "remove", *place, "2", "3", "--yes", "--force")
            assert code == 0 and "layer 2: removed 4 object(s)" in out and "layer 3: removed 1" in out
            assert sorted(listed(capsys, *place)) == [1]

            lone.populate(_tables(seed=2))
            dead = c.segments[0]
            keys = ["engram:l2:manifest"] + [f"engram:l2:h{h}" for h in range(3)]
            on_dead = [info.key for info in store.locate(keys, lease=False)
                       if any(r.address == dead.address for r in info.replicas)]
            dead.kill()
            deadline = time.monotonic() + 60
            while len(store.status()["segments"]) > 1:
                assert time.monotonic() < deadline, "the master did not drop the killed segment"
                time.sleep(0.1)
            found = listed(capsys, *place)
            assert found[1]["state"] == "under-replicated" and found[1]["replicas"] == 1
            assert found[2]["state"] == ("lost" if on_dead else "published")
            code, out, _ = layers(capsys, "remove", *place, "1", "2", "--yes", "--force")
            assert code == 0, out
            assert listed(capsys, *place) == {}


def test_no_master_at_the_address(capsys):
    from engram_store.testing import free_port

    start = time.monotonic()
    code, _, err = layers(capsys, "list", "--master", f"127.0.0.1:{free_port()}")
    assert code == 1 and "--master" in err and "--auth DIR" in err and "auth_dir=" not in err
    assert time.monotonic() - start < 10
