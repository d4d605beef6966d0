"""V41Config: the released layout (primes, offsets, multipliers) and config.json reading."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_model.v41 import V41Config
from engram_store import ConfigError, InvalidArgument

RELEASED = V41Config(layer_ids=[1, 14])
RELEASED_JSON = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "text_config": {
        "engram_layer_ids": [1, 14], "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_head_dim": 256,
        "engram_vocab_size": 16000000, "engram_num_embeddings": [384006168, 384016682],
        "engram_compressed_vocab_size": 99092, "engram_pad_token_id": 2, "hidden_size": 5120, "hc_mult": 4,
        "rms_norm_eps": 1e-20,
    },
}


def naive_is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n ** 0.5) + 1))


def test_released_layout():
    p1, p14 = RELEASED.primes(1), RELEASED.primes(14)
    assert len(p1) == 3 and all(len(heads) == 8 for heads in p1)
    assert (p1[0][0], p1[-1][-1], p14[0][0], p14[-1][-1]) == (16000057, 16000463, 16000477, 16000889)
    assert [RELEASED.num_embeddings(1), RELEASED.num_embeddings(14)] == [384006168, 384016682]
    np.testing.assert_array_equal(RELEASED.offsets(1)[:3], [0, 16000057, 32000136])
    np.testing.assert_array_equal(RELEASED.multipliers(1),
                                  [76632096046245, 4839876093313, 35959672319349, 73987337458391])
    assert RELEASED.multipliers(1).dtype == np.int64 and RELEASED.offsets(14).dtype == np.int64
    assert RELEASED.cols == 24 and RELEASED.row_bytes == 264
    # Offsets are the exclusive prefix sums of the primes in column order.
    flat = [p for heads in p14 for p in heads]
    np.testing.assert_array_equal(RELEASED.offsets(14), np.cumsum([0] + flat[:-1]))


@settings(max_examples=25, deadline=None)
@given(layers=st.lists(st.integers(0, 60), min_size=1, max_size=3, unique=True), max_n=st.integers(2, 5),
       heads=st.integers(1, 4), start=st.integers(1, 300))
def test_primes_are_the_next_unused_primes_above_the_start(layers, max_n, heads, start):
    cfg = V41Config(layer_ids=layers, max_ngram_size=max_n, n_heads=heads, engram_vocab_size=start,
                    compressed_vocab_size=50, hidden_size=8, head_dim=32)
    seen: set[int] = set()
    for lid in layers:  # the search written out with trial division
        primes = cfg.primes(lid)
        assert len(primes) == max_n - 1
        for order in primes:
            candidate, expected = start - 1, []
            for _ in range(heads):
                candidate += 1
                while not naive_is_prime(candidate) or candidate in seen:
                    candidate += 1
                expected.append(candidate)
                seen.add(candidate)
            assert order == expected
        assert cfg.num_embeddings(lid) == sum(map(sum, primes))
        m = cfg.multipliers(lid)
        assert m.shape == (max_n,) and (m % 2 == 1).all() and (m > 0).all()
        assert int(m.max()) * 49 < 2 ** 63  # token * multiplier cannot overflow


def test_validation_names_the_field():
    cases = [({"layer_ids": []}, "layer_ids"), ({"layer_ids": [1, 1]}, "distinct"),
             ({"layer_ids": [-1]}, r"layer_ids\[0\]"), ({"layer_ids": "1"}, "layer_ids"),
             ({"max_ngram_size": 1}, "max_ngram_size"), ({"n_heads": 0}, "n_heads"),
             ({"head_dim": 48}, "head_dim: expected a multiple of 32"), ({"head_dim": True}, "head_dim"),
             ({"compressed_vocab_size": 0}, "compressed_vocab_size"), ({"pad_id": -1}, "pad_id"),
             ({"hidden_size": 2.5}, "hidden_size"), ({"hc_mult": 0}, "hc_mult"),
             ({"rms_norm_eps": 0.0}, "rms_norm_eps"), ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
             ({"engram_vocab_size": 0}, "engram_vocab_size")]
    for kwargs, match in cases:
        with pytest.raises(ConfigError, match=match):
            V41Config(**{"layer_ids": [1], **kwargs})
    with pytest.raises(InvalidArgument, match=r"layer_id: expected one of layer_ids = \[1, 14\], got 2"):
        RELEASED.primes(2)


def test_from_hf_config_dict_file_and_directory(tmp_path):
    assert V41Config.from_hf_config(RELEASED_JSON) == RELEASED
    (tmp_path / "config.json").write_text(json.dumps(RELEASED_JSON))
    assert V41Config.from_hf_config(tmp_path) == RELEASED
    assert V41Config.from_hf_config(str(tmp_path / "config.json")) == RELEASED
    # Top-level fields (no text_config) and the other spelling of the pad id.
    flat = dict(RELEASED_JSON["text_config"])
    flat["engram_pad_id"] = flat.pop("engram_pad_token_id")
    assert V41Config.from_hf_config(flat) == RELEASED
    assert hash(V41Config.from_hf_config(flat)) == hash(RELEASED)


def test_from_hf_config_errors():
    text = RELEASED_JSON["text_config"]
    with pytest.raises(ConfigError, match=r"engram_num_embeddings: expected \[384006168, 384016682\]"):
        V41Config.from_hf_config({**text, "engram_num_embeddings": [384006168, 1]})
    with pytest.raises(ConfigError, match="engram_num_embeddings: .* above engram_vocab_size = 15999000"):
        V41Config.from_hf_config({**text, "engram_vocab_size": 15999000})  # other primes, other sums
    with pytest.raises(ConfigError, match="missing engram_head_dim"):
        V41Config.from_hf_config({k: v for k, v in text.items() if k != "engram_head_dim"})
    with pytest.raises(ConfigError, match="engram_pad_token_id"):
        V41Config.from_hf_config({k: v for k, v in text.items() if k != "engram_pad_token_id"})
    with pytest.raises(ConfigError, match="disagrees with engram_pad_id"):
        V41Config.from_hf_config({**text, "engram_pad_id": 3})
    with pytest.raises(ConfigError, match="head_dim: expected a multiple of 32"):
        V41Config.from_hf_config({**text, "engram_head_dim": 100, "engram_num_embeddings": None})
    with pytest.raises(ConfigError, match="no such file"):
        V41Config.from_hf_config("/nonexistent/config.json")
    with pytest.raises(ConfigError, match="path_or_dict"):
        V41Config.from_hf_config(42)
