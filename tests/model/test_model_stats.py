"""engram-stats: per-head collision and occupancy figures, checked by brute force."""
from __future__ import annotations

import json

import numpy as np

from engram_model import BackboneConfig, EngramConfig, NgramHashMapping
from engram_model.stats import head_stats, main


def test_head_stats_match_a_brute_force_count():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 30, size=(3, 40))
    config = EngramConfig(engram_vocab_size=[11, 23], max_ngram_size=3, n_embed_per_ngram=2, n_head_per_ngram=2,
                          layer_ids=[0, 4], pad_id=0)
    mapping = NgramHashMapping.from_config(config, BackboneConfig(vocab_size=30))
    stats = head_stats(mapping, ids)
    assert len(stats) == 2 * 4
    for s in stats:
        rows = mapping.hash_layer(ids, s["layer_id"])[..., s["head"]]
        n = s["order"]
        row_of = {}
        for b in range(ids.shape[0]):
            padded = [0] * (n - 1) + list(ids[b])
            for t in range(ids.shape[1]):
                row_of[tuple(padded[t:t + n])] = int(rows[b, t])
        by_row = {}
        for gram, row in row_of.items():
            by_row.setdefault(row, []).append(gram)
        shared = sum(len(g) for g in by_row.values() if len(g) > 1)
        assert s["distinct_ngrams"] == len(row_of)
        assert s["distinct_rows"] == len(by_row)
        assert s["collision_rate"] == shared / len(row_of)
        assert s["occupancy"] == len(by_row) / s["rows"]
        assert 0 < s["uniform_collision_rate"] < 1


def test_cli_reads_npy_and_text(tmp_path, capsys):
    ids = np.random.default_rng(1).integers(0, 50, size=(2, 30))
    np.save(tmp_path / "t.npy", ids)
    (tmp_path / "t.txt").write_text("\n".join(" ".join(map(str, row)) for row in ids) + "\n")
    reports = []
    for name in ("t.npy", "t.txt"):
        assert main([str(tmp_path / name), "--engram-vocab-size", "97", "101", "--n-head-per-ngram", "2",
                     "--layer-ids", "1", "--vocab-size", "50", "--json"]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert reports[0] == reports[1]
    assert reports[0]["tokens"] == 60 and len(reports[0]["heads"]) == 4
    assert main([str(tmp_path / "t.npy"), "--layer-ids", "1", "--vocab-size", "50"]) == 0
    assert "occupancy" in capsys.readouterr().out


def test_cli_reports_bad_input(tmp_path, capsys):
    (tmp_path / "bad.txt").write_text("1 2 x\n")
    assert main([str(tmp_path / "bad.txt")]) == 2
    assert "whitespace-separated integers" in capsys.readouterr().err
    (tmp_path / "cfg.json").write_text('{"max_ngram": 3}')
    assert main([str(tmp_path / "bad.txt"), "--config", str(tmp_path / "cfg.json")]) == 2
    assert "unknown EngramConfig field" in capsys.readouterr().err
