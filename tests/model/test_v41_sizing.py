"""engram-stats --v41: a V4.1 hot-row cache sized before serving, from tokens or a profile, checked against an
exact LRU over the rows the hasher gives; and a disk_dir store's curves by n-gram order."""
from __future__ import annotations

import json

import numpy as np
import pytest

from engram_model.stats import main
from engram_model.v41 import V41Config, V41Hasher, hit_rate_by_order, save_token_map, v41_store_config
from engram_store import EngramStore, InvalidArgument
from engram_store.disk import SIZE_LADDER, bytes_for_rows
from suite_helpers import exact_lru_hits

VOCAB = 300
CONFIG = V41Config(layer_ids=(3, 7), max_ngram_size=3, n_heads=2, head_dim=32, engram_vocab_size=500,
                   compressed_vocab_size=VOCAB, pad_id=0)


def _write_config(path, config: V41Config) -> str:
    text = {"engram_layer_ids": list(config.layer_ids), "engram_max_ngram_size": config.max_ngram_size,
            "engram_n_heads": config.n_heads, "engram_head_dim": config.head_dim,
            "engram_vocab_size": config.engram_vocab_size, "engram_compressed_vocab_size": config.compressed_vocab_size,
            "engram_pad_token_id": config.pad_id, "hidden_size": config.hidden_size, "hc_mult": config.hc_mult,
            "rms_norm_eps": config.rms_norm_eps}
    path.write_text(json.dumps({"text_config": text}))
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Token ids with locality (each sequence repeats bits of itself and of a shared pool), a token map, a config."""
    where = tmp_path_factory.mktemp("sizing")
    rng = np.random.default_rng(4)
    pool = rng.integers(1, VOCAB, 400)
    seqs = []
    for _ in range(6):
        own = rng.integers(1, VOCAB, 60)
        picks = [own[rng.integers(0, 50):][:rng.integers(3, 10)] if rng.random() < 0.6
                 else pool[(rng.zipf(1.3) - 1) % 390:][:rng.integers(3, 10)] for _ in range(80)]
        seqs.append(np.concatenate(picks))
    ids = np.full((len(seqs), max(map(len, seqs))), -1, dtype=np.int64)
    for i, seq in enumerate(seqs):
        ids[i, :seq.size] = seq
    np.save(where / "tokens.npy", ids)
    token_map = np.arange(VOCAB, dtype=np.int64)
    save_token_map(where / "map.npy", token_map)
    return where, ids, token_map


def _stream(ids, token_map, config):
    """Every lookup in replay order (layer after layer within a step of 256 tokens), as (layer, table row)."""
    hasher = V41Hasher(config, token_map)
    out = []
    for seq in ids:
        seq = seq[seq >= 0]
        rows = hasher(seq[None, :])[0]  # [L, layers, cols]
        for a in range(0, seq.size, 256):
            for j, lid in enumerate(config.layer_ids):
                out += [(lid, int(r)) for r in rows[a:a + 256, j].reshape(-1)]
    return out


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_tokens_give_the_working_set_the_bound_and_an_exact_lru_curve(corpus, tmp_path, capsys):
    where, ids, token_map = corpus
    config_json = _write_config(tmp_path / "config.json", CONFIG)
    code, out, err = _run(capsys, where / "tokens.npy", "--v41", "--tokenizer", where / "map.npy", "--config",
                          config_json, "--hit-rate", 0.3, "--json")
    assert code == 0, err
    report = json.loads(out)
    stream = _stream(ids, token_map, CONFIG)
    distinct = len(set(stream))
    assert report["lookups"] == len(stream) and report["working_set_rows"] == distinct
    assert report["first_touch_bound"] == pytest.approx(1 - distinct / len(stream))
    assert report["rows"] == sum(CONFIG.num_embeddings(lid) for lid in CONFIG.layer_ids)
    for f, entry in zip(SIZE_LADDER, report["hit_rate_by_size"]):
        assert entry["rows"] == round(max(1.0, f * distinct))
        assert entry["bytes"] == bytes_for_rows(entry["rows"], CONFIG.row_bytes)
        assert entry["hit_rate"] == pytest.approx(exact_lru_hits(stream, entry["rows"]) / len(stream), abs=0.01), f
    target = report["target"]
    assert exact_lru_hits(stream, target["rows"]) / len(stream) >= 0.3 - 0.01 > exact_lru_hits(stream, int(target["rows"] * 0.85)) / len(stream)
    assert target["bytes"] == bytes_for_rows(target["rows"], CONFIG.row_bytes)
    layer = report["layers"]["3"]
    assert set(layer["hit_rate_by_order"]) == {"2", "3"} and layer["lookups"] == len(stream) // 2
    # the same config from flags, with the text report
    code, out, err = _run(capsys, where / "tokens.npy", "--v41", "--tokenizer", where / "map.npy", "--layer-ids", 3, 7,
                          "--max-ngram-size", 3, "--n-head-per-ngram", 2, "--engram-vocab-size", 500, "--pad-id", 0,
                          "--hit-rate", 0.99)
    assert code == 0, err
    assert f"{distinct:,} distinct rows" in out and "order 3" in out
    assert "out of reach: the first-touch bound is" in out


def test_a_profile_gives_the_same_working_set_and_the_most_frequent_rows_curve(corpus, tmp_path, capsys):
    where, ids, token_map = corpus
    config_json = _write_config(tmp_path / "config.json", CONFIG)
    profile = tmp_path / "profile.npz"
    code, _, err = _run(capsys, where / "tokens.npy", "--v41", "--tokenizer", where / "map.npy", "--config",
                        config_json, "--profile", profile, "--json")
    assert code == 0, err
    code, out, err = _run(capsys, "--v41", "--from-profile", profile, "--config", config_json, "--json",
                          "--hit-rate", 0.2)
    assert code == 0, err
    report = json.loads(out)
    stream = _stream(ids, token_map, CONFIG)
    counts = sorted(np.unique(np.array([hash(k) for k in stream]), return_counts=True)[1].tolist(), reverse=True)
    assert report["working_set_rows"] == len(counts) and report["lookups"] == len(stream)
    for entry in report["hit_rate_by_size"]:
        top = counts[:entry["rows"]]
        assert entry["hit_rate"] == pytest.approx((sum(top) - len(top)) / len(stream))
    assert report["target"]["rows"] is not None


@pytest.mark.parametrize("argv, message", [
    (["--v41"], "expected TOKENS"),
    (["TOKENS", "--v41", "--from-profile", "p.npz"], "one of them"),
    (["TOKENS", "--v41"], "--tokenizer"),
    (["TOKENS", "--v41", "--tokenizer", "MAP", "--hit-rate", "1.5"], "--hit-rate"),
    (["TOKENS", "--v41", "--tokenizer", "MAP", "--engram-vocab-size", "5", "7"], "one size for every order"),
    (["--v41", "--from-profile", "PROFILE", "--layer-ids", "3", "9"], "no layer [9]"),
    ([], "TOKENS: expected a token file"),
])
def test_bad_requests_are_refused_naming_the_flag(corpus, tmp_path, capsys, argv, message):
    where, _, _ = corpus
    profile = tmp_path / "p.npz"
    assert main([str(where / "tokens.npy"), "--v41", "--tokenizer", str(where / "map.npy"), "--layer-ids", "3", "7",
                 "--max-ngram-size", "3", "--n-head-per-ngram", "2", "--engram-vocab-size", "500", "--pad-id", "0",
                 "--profile", str(profile), "--json"]) == 0
    capsys.readouterr()
    names = {"TOKENS": where / "tokens.npy", "MAP": where / "map.npy", "PROFILE": profile}
    code, _, err = _run(capsys, *[names.get(a, a) for a in argv])
    assert code == 2 and message in err, err


def test_a_stores_curves_by_order(tmp_path):
    primes = [p for heads in CONFIG.primes(3) for p in heads]
    rng = np.random.default_rng(1)
    with EngramStore(3, v41_store_config(CONFIG, 3), disk_dir=tmp_path) as store:
        store.populate([np.zeros((p, CONFIG.row_bytes), np.uint8) for p in primes])
        for _ in range(30):
            store.lookup(np.stack([rng.integers(0, 5 + 20 * c, (1, 20)) for c in range(CONFIG.cols)], axis=-1))
        stats = store.stats()
    by_order = hit_rate_by_order(stats, CONFIG.n_heads)
    per_head = stats["hit_rate_by_size_per_head"]
    assert sorted(by_order) == [2, 3]
    for n, curve in by_order.items():
        cols = range((n - 2) * CONFIG.n_heads, (n - 1) * CONFIG.n_heads)
        for i, entry in enumerate(curve):
            assert entry["bytes"] == stats["hit_rate_by_size"][i]["bytes"]
            assert entry["hit_rate"] == pytest.approx(np.mean([per_head[c][i] for c in cols]))
    assert by_order[2][-1]["hit_rate"] > by_order[3][-1]["hit_rate"]  # order 2's columns draw from fewer rows
    assert hit_rate_by_order(stats, CONFIG.n_heads, heads=[2, 3, 4, 5]).keys() == {3, 4}
    with pytest.raises(InvalidArgument, match="heads"):
        hit_rate_by_order(stats, CONFIG.n_heads, heads=[0])
    with pytest.raises(InvalidArgument, match="hit_rate_by_size"):
        hit_rate_by_order({"lookups": 1}, CONFIG.n_heads)
