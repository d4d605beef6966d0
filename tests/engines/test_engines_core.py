"""What the engine plugins share, without an engine (these run in CI): the variables and their refusals, the table
directory, the checks of a layout against config.json, the step pipeline, the gather counts, the import hook."""
from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
from engines_helpers import CONFIG, hash_ids, load_tables, write_checkpoint

from engram_engines import STATS, ServingRefused, StepGathers, TableDir, settings_from_env
from engram_engines._imports import when_imported
from engram_engines.v41 import LayerReader, check_engine_layout, config_of, open_layer
from engram_model.v41 import V41Config




def test_nothing_is_asked_without_engram_tables():
    assert settings_from_env({}) is None and settings_from_env({"ENGRAM_TABLES": "  "}) is None


def test_the_defaults(toy):
    s = settings_from_env({"ENGRAM_TABLES": str(toy.local)})
    assert (s.row_cache_bytes, s.cache_scope, s.device_read) == (4 << 30, "host", "auto") and s.threads >= 1


@pytest.mark.parametrize("name, value, expected", [
    ("ENGRAM_ROW_CACHE", "lots", "a byte count such as 512MiB, 4GiB or 0"),
    ("ENGRAM_CACHE_SCOPE", "node", "one of host, process"),
    ("ENGRAM_THREADS", "0", "an integer from 1 to 256"),
    ("ENGRAM_THREADS", "four", "an integer from 1 to 256"),
    ("ENGRAM_DEVICE_READ", "uva", "one of auto, host"),
])
def test_a_value_that_does_not_parse_is_refused_naming_the_variable_and_value(toy, name, value, expected):
    with pytest.raises(ServingRefused, match=f"^{name}={value}: expected {expected}"):
        settings_from_env({"ENGRAM_TABLES": str(toy.local), name: value})


def test_a_table_directory_that_is_not_one_is_refused(tmp_path):
    with pytest.raises(ServingRefused, match=r"ENGRAM_TABLES=.*nowhere: .*no such directory"):
        settings_from_env({"ENGRAM_TABLES": str(tmp_path / "nowhere")})
    with pytest.raises(ServingRefused, match=r"ENGRAM_TABLES=.*: holds no published Engram layer"):
        TableDir(settings_from_env({"ENGRAM_TABLES": str(tmp_path)}))


def test_the_kind_of_a_table_directory_is_told_from_its_layers(toy, tmp_path):
    assert TableDir(settings_from_env({"ENGRAM_TABLES": str(toy.local)})).kind == "local_dir"
    disk = TableDir(settings_from_env({"ENGRAM_TABLES": str(toy.disk)}))
    assert disk.kind == "disk_dir" and disk.layers() == [1, 14]
    import shutil
    shutil.copytree(toy.local / "layer-1", tmp_path / "layer-1")
    shutil.copytree(toy.disk / "layer-14", tmp_path / "layer-14")
    with pytest.raises(ServingRefused, match="holds layers of both kinds"):
        TableDir(settings_from_env({"ENGRAM_TABLES": str(tmp_path)}))


def test_missing_layers_and_another_layout_are_refused_naming_both_sides(toy, tmp_path):
    settings = settings_from_env({"ENGRAM_TABLES": str(toy.local)})
    more = V41Config(layer_ids=[1, 14, 20], n_heads=3, head_dim=64, engram_vocab_size=300, compressed_vocab_size=100,
                     hidden_size=64)
    with pytest.raises(ServingRefused, match=r"config.json of m names Engram layers \[1, 14, 20\], but this local_dir"
                                             r" holds layers \[1, 14\] \(missing \[20\]\); load them with "
                                             r"engram-load-v41 CHECKPOINT --local-dir"):
        open_layer(settings, more, 1, "config.json of m")
    other = V41Config(layer_ids=[1, 14], n_heads=3, head_dim=64, engram_vocab_size=900, compressed_vocab_size=100,
                      hidden_size=64)
    from engram_engines._tables import forget_table_dirs
    forget_table_dirs()
    with pytest.raises(ServingRefused, match=r"layer 1 disagrees with config.json of m: .*table_vocab_sizes"):
        open_layer(settings, other, 1, "config.json of m")
    forget_table_dirs()


def test_a_config_that_is_not_v41s_and_an_engine_layout_that_is_not_engrams_are_refused():
    import types

    with pytest.raises(ServingRefused, match="config.json of m: config.json: missing engram_layer_ids"):
        config_of(types.SimpleNamespace(hidden_size=64), "config.json of m")
    primes = [p for order in CONFIG.primes(1) for p in order]
    check_engine_layout(CONFIG, 1, primes, CONFIG.num_embeddings(1), "vLLM's layout")
    with pytest.raises(ServingRefused, match="vLLM's layout: the engine lays layer 1 out as 9 columns"):
        check_engine_layout(CONFIG, 1, primes[::-1], CONFIG.num_embeddings(1), "vLLM's layout")


def test_gathers_are_counted_per_layer_form_and_tier(toy):
    settings = settings_from_env({"ENGRAM_TABLES": str(toy.disk), "ENGRAM_ROW_CACHE": "1MiB",
                                  "ENGRAM_CACHE_SCOPE": "process"})
    reader = LayerReader(settings, open_layer(settings, CONFIG, 14, "m"), CONFIG, 14)
    STATS.reset()
    ids = hash_ids(CONFIG, 6, seed=1)[:, 1]
    reader.gather(ids, np.empty((6, CONFIG.cols, CONFIG.row_bytes), np.uint8))
    reader.gather(ids, np.empty((6, 4, CONFIG.head_dim), np.uint16), head_start=5)
    flat = ids[:5].reshape(-1)
    reader.gather(flat, np.empty((flat.size, 64), np.uint8), scales_out=np.empty((flat.size, 2), np.uint8))
    with pytest.raises(Exception):
        reader.gather(ids + 10**9, np.empty((6, CONFIG.cols, CONFIG.row_bytes), np.uint8))
    got = {(s["layer"], s["form"], s["tier"]): (s["calls"], s["rows"], s["errors"]) for s in STATS.snapshot()}
    assert got == {(14, "packed", "disk_dir"): (2, 2 * 6 * CONFIG.cols, 1), (14, "bf16", "disk_dir"): (1, 24, 0),
                   (14, "split", "disk_dir"): (1, flat.size, 0)}
    assert sum(sum(s["buckets"]) for s in STATS.snapshot()) == 4


def test_a_step_gathers_its_first_layer_first_and_each_layer_waits_for_its_own():
    gathers = StepGathers("test-steps")
    order, release = [], threading.Event()

    def gather(i, wait=False, fail=False):
        def work():
            if wait:
                release.wait(10)
            if fail:
                raise RuntimeError(f"layer {i} failed")
            order.append(i)
        return work

    futures = gathers.start([gather(0), gather(1, wait=True), gather(2, fail=True)], staged=order.append)
    futures[0].result(10)  # the first layer is ready while the second still waits
    assert order == [0, 0] and not futures[1].done()
    release.set()
    futures[1].result(10)
    with pytest.raises(RuntimeError, match="layer 2 failed"):
        futures[2].result(10)
    again = gathers.start([gather(3)], ready=lambda: (_ for _ in ()).throw(OSError("ids lost")))
    with pytest.raises(OSError, match="ids lost"):
        again[0].result(10)
    gathers.close()


def test_a_patch_runs_right_after_its_module_is_imported(tmp_path, monkeypatch):
    (tmp_path / "engram_later_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    when_imported("engram_later_module", lambda module: seen.append(module.VALUE))
    assert seen == []
    import engram_later_module  # noqa: F401
    assert seen == [1]
    when_imported("engram_later_module", lambda module: seen.append(2))  # already imported: at once
    assert seen == [1, 2]
    sys.modules.pop("engram_later_module")


def test_the_host_path_gathers_a_steps_layers_behind_one_ids_copy(toy):
    torch = pytest.importorskip("torch")
    from engram_engines.v41 import HostSteps, ModelLayer
    from engram_model.v41 import V41Rows

    settings = settings_from_env({"ENGRAM_TABLES": str(toy.local), "ENGRAM_DEVICE_READ": "host"})
    steps = HostSteps(2)
    readers = [LayerReader(settings, open_layer(settings, CONFIG, lid, "m"), CONFIG, lid) for lid in (1, 14)]
    for i, reader in enumerate(readers):
        steps.add(ModelLayer(i, reader, 3, 4, torch.zeros((16, 4, CONFIG.head_dim), dtype=torch.bfloat16)))
    hashes = torch.from_numpy(hash_ids(CONFIG, 7, seed=3))
    for i in (0, 1):
        steps.prepare(i, hashes[:, i])
    for i, reader in enumerate(readers):
        steps.finish(i)
        expected = np.empty((7, 4, CONFIG.head_dim), np.uint16)
        V41Rows(reader.table, CONFIG, reader.layer_id).gather_into(hashes[:, i].numpy().copy(), expected,
                                                                    head_start=3)
        assert np.array_equal(steps.layers[i].rows[:7].view(torch.int16).numpy().view(np.uint16), expected)
    steps.close()


def test_a_split_that_leaves_a_rank_no_column_is_refused(toy):
    from engram_engines.v41._layout import check_split

    settings = settings_from_env({"ENGRAM_TABLES": str(toy.local)})
    check_split(CONFIG, 1, 6, 3, 3, settings)  # the last rank's columns 6..8
    with pytest.raises(ServingRefused, match=r"ENGRAM_TABLES=.*: layer 1 has 9 columns .* a split over 4 ranks leaves "
                                             r"this rank columns 9..11, none of them: use at most 9 ranks"):
        check_split(CONFIG, 1, 9, 3, 4, settings)
