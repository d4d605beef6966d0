"""CompressedTokenizer: normalisation, grouping by first appearance, the three ways to build it."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_model import BackboneConfig, CompressedTokenizer, Engram, EngramConfig
from engram_model._tokenizer import normalize_token_text
from engram_store import InvalidArgument, InvalidType


class FakeHFTokenizer:
    """The three methods of a transformers tokenizer the reference calls."""

    def __init__(self, texts, raw):
        self.texts, self.raw = texts, raw
        self.decoded = []

    def __len__(self):
        return len(self.texts)

    def decode(self, ids, skip_special_tokens=True):
        assert skip_special_tokens is False
        self.decoded.extend(ids)
        return "".join(self.texts[i] for i in ids)

    def convert_ids_to_tokens(self, tid):
        return self.raw[tid]


@pytest.mark.parametrize("text, key", [
    (" Hello", "hello"),
    ("HELLO\t", "hello"),
    ("café", "cafe"),
    ("Ĉ", "c"),
    ("\ufb01", "fi"),            # NFKC: the ligature becomes two letters
    ("Ａ", "a"),                  # NFKC: full-width
    (" ", " "),                   # all-whitespace tokens keep one space
    ("\n\n", " "),
    ("  \t ", " "),
    ("\r\n", " "),
    ("a  b", "a b"),              # inner runs collapse
    ("\u00a0", " "),              # NFKC turns NBSP into a space, which then stays as the whole token
    ("ΟΔΟΣ", "οδοσ"),             # lowercased per character: no final sigma
    ("\x1c", "\x1c"),             # not Unicode White_Space, so Strip keeps it (Python's strip would not)
    ("\u3000x", "x"),
    ("", ""),
])
def test_normalize_token_text(text, key):
    assert normalize_token_text(text) == key


def test_keys_grouped_in_order_of_first_appearance():
    texts = ["<pad>", "The", " the", "THE", "\u0301", "x", "\u0301", "é", "e", "\n", " "]
    tok = CompressedTokenizer(texts)
    # keys: <pad> the the the \u0301 x \u0301 e e " " " "   (\u0301 normalises to "" and keeps its text)
    np.testing.assert_array_equal(tok.lookup_table, [0, 1, 1, 1, 2, 3, 2, 4, 4, 5, 5])
    assert len(tok) == 6 and tok.original_vocab_size == 11
    assert tok.compression_ratio == pytest.approx(11 / 6)
    assert not tok.lookup_table.flags.writeable


def test_hf_style_object_and_replacement_character():
    texts = ["<s>", "a\ufffd", "b\ufffd", "A", "ab\ufffd"]
    raw = ["<s>", "Ġa", "Ġb", "A", "Ġa"]  # two lossy decodes share a raw token, so they share an id
    fake = FakeHFTokenizer(texts, raw)
    tok = CompressedTokenizer(fake)
    assert fake.decoded == [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(tok.lookup_table, [0, 1, 2, 3, 1])
    assert CompressedTokenizer.from_token_texts(texts, raw).fingerprint == tok.fingerprint
    # From texts alone, a lossy token is keyed by its text.
    np.testing.assert_array_equal(CompressedTokenizer(texts).lookup_table, [0, 1, 2, 3, 4])


def test_call_maps_ids_and_passes_negatives():
    tok = CompressedTokenizer(["a", "A", "b", "B", "c"])
    ids = np.array([[0, 1, -1, 4], [3, -100, 2, 2]])
    out = tok(ids)
    assert out.dtype == np.int64 and out.shape == ids.shape
    np.testing.assert_array_equal(out, [[0, 0, -1, 2], [1, -100, 1, 1]])
    np.testing.assert_array_equal(ids, [[0, 1, -1, 4], [3, -100, 2, 2]])  # input untouched
    np.testing.assert_array_equal(tok([[1, 2]]), [[0, 1]])
    with pytest.raises(InvalidArgument, match=r"input_ids\[1, 0\] = 5 is out of range.*5 ids"):
        tok([[0, 1], [5, 0]])
    with pytest.raises(InvalidType, match="input_ids: expected integer token ids, got dtype float64"):
        tok(np.array([0.0, 1.0]))


def test_build_errors():
    with pytest.raises(InvalidType, match="tokenizer"):
        CompressedTokenizer(42)
    with pytest.raises(InvalidType, match=r"tokenizer\[1\]"):
        CompressedTokenizer(["a", 3])
    with pytest.raises(InvalidArgument, match="empty"):
        CompressedTokenizer([])
    with pytest.raises(InvalidArgument, match="raw_tokens"):
        CompressedTokenizer.from_token_texts(["a", "b"], ["a"])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(max_size=4), min_size=1, max_size=30))
def test_lookup_is_first_appearance_numbering(texts):
    tok = CompressedTokenizer(texts)
    keys = [normalize_token_text(t) or t for t in texts]
    first = {}
    for k in keys:
        first.setdefault(k, len(first))
    np.testing.assert_array_equal(tok.lookup_table, [first[k] for k in keys])
    assert len(tok) == len(first)


def test_tokenizer_json_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Regex, normalizers
    from tokenizers.models import WordLevel

    words = ["<pad>", "<s>", "Hello", "hello", "HÉLLO", "world", "▁", "Ａ", "a", "ΟΔΟΣ", "\ufb01"]
    model = WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>")
    path = tmp_path / "tokenizer.json"
    tokenizers.Tokenizer(model).save(str(path))
    tok = CompressedTokenizer(str(path))
    assert tok.original_vocab_size == len(words)
    assert CompressedTokenizer(str(tmp_path)).fingerprint == tok.fingerprint  # a directory holding one
    cfg = EngramConfig(tokenizer_name_or_path=str(path), engram_vocab_size=[30, 30], n_embed_per_ngram=4,
                       n_head_per_ngram=2, layer_ids=[0])
    engram = Engram(0, cfg, BackboneConfig(hidden_size=4, hc_mult=1))
    assert engram.hash_mapping.compressed_tokenizer.fingerprint == tok.fingerprint
    assert engram.hash_mapping.tokenizer_vocab_size == len(tok) < len(words)

    # The reference's normalizer, run by the tokenizers package itself, agrees with the Python one.
    sentinel = "\ue000"
    reference = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])
    samples = words + [" ", "\n\n", " a b ", "\x1c", "\u3000x", "café", "\u0301", "İ", "ß", "Σ"]
    assert [normalize_token_text(s) for s in samples] == [reference.normalize_str(s) for s in samples]


def test_tokenizer_json_without_package(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "tokenizers" or name.startswith("tokenizers."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({}))
    with pytest.raises(InvalidArgument, match=r"pip install 'engram\[tokenizers\]'"):
        CompressedTokenizer(str(path))


def small_engram_config(**kwargs):
    return EngramConfig(engram_vocab_size=[30, 30], n_embed_per_ngram=4, n_head_per_ngram=2, layer_ids=[0], **kwargs)


def test_empty_tokenizer_name_hashes_raw_ids():
    # Mooncake's configs set tokenizer_name_or_path = "": no tokenizer, as None.
    bb = BackboneConfig(hidden_size=4, hc_mult=1, vocab_size=1000)
    empty = Engram(0, small_engram_config(tokenizer_name_or_path=""), bb)
    none = Engram(0, small_engram_config(), bb)
    assert empty.hash_mapping.compressed_tokenizer is None
    assert empty.config.tokenizer_name_or_path == ""
    ids = np.random.default_rng(0).integers(0, 1000, size=(2, 7))
    np.testing.assert_array_equal(empty.hash_input_ids(ids), none.hash_input_ids(ids))


def test_uncached_hub_name_is_refused_without_network(tmp_path, monkeypatch):
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    cfg = small_engram_config(tokenizer_name_or_path="deepseek-ai/DeepSeek-V3")
    with pytest.raises(InvalidArgument, match=r"tokenizer_name_or_path: 'deepseek-ai/DeepSeek-V3' is neither a "
                                              r"tokenizer.json file.*never downloaded; set it to \"\" \(or None\) to "
                                              r"hash raw token ids"):
        Engram(0, cfg, BackboneConfig(hidden_size=4, hc_mult=1))
    with pytest.raises(InvalidArgument, match=r"tokenizer: 'no/such-tokenizer' .* pass None"):
        CompressedTokenizer("no/such-tokenizer")


def test_hub_name_in_local_cache_is_loaded(tmp_path, monkeypatch):
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants
    from tokenizers.models import WordLevel

    words = ["<pad>", "<s>", "Hello", "hello", "world", "World"]
    # The layout huggingface_hub leaves after a download: refs/main names a snapshot holding the file.
    repo = tmp_path / "hub" / "models--acme--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    tokenizers.Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>")).save(
        str(snapshot / "tokenizer.json"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    engram = Engram(0, small_engram_config(tokenizer_name_or_path="acme/tiny"),
                    BackboneConfig(hidden_size=4, hc_mult=1))
    tok = engram.hash_mapping.compressed_tokenizer
    assert tok is not None and tok.original_vocab_size == 6 and len(tok) == 4
    assert tok.fingerprint == CompressedTokenizer(str(snapshot / "tokenizer.json")).fingerprint
