"""PLEConfig: the release's numbers (PLE.md), the layout against a transcription of transformers' code (and the code
itself where it is installed), config.json in its forms, and refusals naming the field."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_model import RowFormat
from engram_model.ple import PLEConfig, PLEHashBuffers, ple_store_config
from engram_store import ConfigError, InvalidArgument

import model_helpers as ref

RELEASE = PLEConfig(ple_layer_ids=[2])


def test_the_release_layout():
    sizes = RELEASE.head_vocab_sizes(2)
    assert len(sizes) == RELEASE.heads == 16 and RELEASE.head_dim == 160
    assert sizes[:2] == [20000003, 20000023] and sizes[-1] == 20000171 and sum(sizes) == 320_001_446
    assert RELEASE.num_embeddings(2) == 320_001_536 and RELEASE.hash_buffers(2).padding == 90
    assert RELEASE.multipliers(2).tolist() == [23703573157769, 20109073645365, 8052911324071]
    assert RELEASE.head_offsets(2).tolist() == [0] + np.cumsum(sizes[:-1]).tolist()
    assert RELEASE.row_format == RowFormat(160, "bf16") and RELEASE.row_bytes == 320
    assert RELEASE.num_embeddings(2) * RELEASE.row_bytes == 102_400_491_520
    fp8 = PLEConfig(ple_layer_ids=[2], ple_embedding_dtype="float8_e4m3fn")
    assert fp8.row_format == RowFormat(160, "e4m3", "table") and fp8.row_bytes == 160
    assert fp8.num_embeddings(2) * fp8.row_bytes == 51_200_245_760
    assert RELEASE.conv_state_len == 9 and RELEASE.context == 2
    layout = ple_store_config(RELEASE, 2)
    assert (layout.row_format, layout.embedding_dim, layout.table_vocab_sizes) == ("bfloat16", 160, sizes)
    assert ple_store_config(fp8, 2).row_format == "bytes" and ple_store_config(fp8, 2).embedding_dim == 160


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=3), st.integers(2, 5), st.integers(1, 4),
       st.integers(2, 3000), st.sampled_from([1, 7, 128]), st.integers(-2 ** 40, 2 ** 40), st.integers(1, 2 ** 40))
def test_layout_equals_the_transcription_of_transformers(layer_ids, ngram_size, heads_per_ngram, base, divisor, seed,
                                                         vocab):
    config = PLEConfig(ple_layer_ids=layer_ids, ngram_size=ngram_size, heads_per_ngram=heads_per_ngram,
                       ngram_vocab_size_base=base, make_ngram_vocab_size_divisible_by=divisor, seed=seed,
                       vocab_size=vocab, hidden_size=(ngram_size - 1) * heads_per_ngram * 2)
    for p, lid in enumerate(sorted(set(layer_ids))):
        sizes, offsets, rows = ref.head_layout(base, config.heads, p, divisor)
        assert config.head_vocab_sizes(lid) == sizes
        assert config.head_offsets(lid).tolist() == offsets
        assert config.num_embeddings(lid) == rows
        assert config.multipliers(lid).tolist() == ref.build_layer_multipliers(vocab, ngram_size, p, seed)
        assert config.ple_index(lid) == p


def test_layout_equals_transformers_own_code():
    torch, M, _ = ref.reference()
    for config in (RELEASE, PLEConfig(ple_layer_ids=[3, 1], ngram_size=4, heads_per_ngram=2, hidden_size=36,
                                      ngram_vocab_size_base=97, seed=-5, vocab_size=1000, eos_token_id=3)):
        for lid in config.ple_layer_ids:
            module, _ = ref.hf_ngram_ids_module(config, lid)
            assert module.head_vocab_sizes == config.head_vocab_sizes(lid)
            assert module.head_offsets == config.head_offsets(lid).tolist()
            assert module.layer_multipliers.tolist() == config.multipliers(lid).tolist()
            padded = -(-module.total_vocab_size // config.make_ngram_vocab_size_divisible_by) * \
                config.make_ngram_vocab_size_divisible_by
            assert padded == config.num_embeddings(lid)


def release_json(**text):
    fields = {"ple_layer_ids": [2], "hidden_size": 2560, "hc_count": 4, "ple_embed_dim": 2560, "ngram_size": 3,
              "heads_per_ngram": 8, "ngram_vocab_size_base": 20000000, "make_ngram_vocab_size_divisible_by": 128,
              "split_ngram_parts": 128, "eos_token_id": 248044, "vocab_size": 248320, "rms_norm_eps": 1e-6,
              "num_hidden_layers": 40}
    fields.update(text)
    return {"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp", "text_config": fields}


def test_from_hf_reads_every_form(tmp_path):
    raw = release_json()
    assert PLEConfig.from_hf(raw) == RELEASE                       # seed absent: 1234, transformers' default
    assert PLEConfig.from_hf(raw["text_config"]) == RELEASE        # the fields at the top
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert PLEConfig.from_hf(tmp_path) == RELEASE == PLEConfig.from_hf(tmp_path / "config.json")
    assert PLEConfig.from_hf(release_json(eos_token_id=[248044, 248046])).eos_token_id == 248044
    fp8 = PLEConfig.from_hf({**release_json(), "ple_embedding_dtype": "float8_e4m3fn"})
    assert fp8.row_format.codes == "e4m3"
    assert PLEConfig.from_hf(release_json(ple_embedding_dtype="float8_e4m3fn")).row_format.scale == "table"
    # Fields left out take transformers' defaults, not the release's.
    bare = PLEConfig.from_hf({"ple_layer_ids": [3, 1, 3], "eos_token_id": 5})
    assert (bare.hidden_size, bare.ple_embed_dim, bare.split_ngram_parts, bare.ple_layer_ids) == (2048, 2048, 512,
                                                                                                  (1, 3))


@pytest.mark.parametrize("change, words", [
    ({"ple_layer_ids": None}, "missing ple_layer_ids"),
    ({"ple_layer_ids": []}, "missing ple_layer_ids"),
    ({"eos_token_id": None}, "missing eos_token_id"),
    ({"ple_layer_ids": [0]}, "ple_layer_ids[0]: expected an integer >= 1"),
    ({"ple_layer_ids": [41]}, "ple_layer_ids: expected one-indexed ids in [1, 40]"),
    ({"ple_embed_dim": 100}, "ple_embed_dim: expected a multiple of the 16 n-gram heads"),
    ({"ngram_size": 1}, "ngram_size: expected an integer >= 2"),
    ({"ple_embedding_dtype": "nvfp4"}, "ple_embedding_dtype: expected one of ['bfloat16', 'float8_e4m3fn']"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps: expected a finite number"),
    ({"seed": 1.5}, "seed: expected an integer"),
])
def test_from_hf_refuses_naming_the_field(change, words):
    with pytest.raises(ConfigError) as info:
        PLEConfig.from_hf(release_json(**change))
    assert words in str(info.value)


def test_refusals_of_the_config_and_its_methods(tmp_path):
    with pytest.raises(ConfigError, match="no config.json in the directory"):
        PLEConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not JSON"):
        PLEConfig.from_hf(tmp_path)
    with pytest.raises(ConfigError, match="text_config: expected an object"):
        PLEConfig.from_hf({"text_config": [1]})
    with pytest.raises(InvalidArgument, match=r"layer_id: expected one of ple_layer_ids = \[2\], got 1"):
        RELEASE.head_vocab_sizes(1)
    with pytest.raises(InvalidArgument, match="layer_id"):
        RELEASE.multipliers("2")


def test_hash_buffers_are_checked():
    good = RELEASE.hash_buffers(2)
    assert PLEHashBuffers(2, good.multipliers, good.sizes, good.offsets, good.rows) == good
    with pytest.raises(InvalidArgument, match="ngram_heads_offsets: expected the running sums"):
        PLEHashBuffers(2, good.multipliers, good.sizes, (0,) * 16, good.rows)
    with pytest.raises(InvalidArgument, match="ngram_heads_vocab_sizes: expected sizes >= 1"):
        PLEHashBuffers(2, good.multipliers, (0,) + good.sizes[1:], good.offsets, good.rows)
    with pytest.raises(InvalidArgument, match="more than the table's"):
        PLEHashBuffers(2, good.multipliers, good.sizes, good.offsets, 1000)
    with pytest.raises(InvalidArgument, match="layer_multipliers: expected int64 values"):
        PLEHashBuffers(2, (2 ** 63, 1, 1), good.sizes, good.offsets, good.rows)
