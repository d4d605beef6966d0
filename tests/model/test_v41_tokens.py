"""build_token_map on a byte-level tokenizer built here (no downloads), and its file round trip."""
from __future__ import annotations

import builtins

import numpy as np
import pytest

from engram_model._tokenizer import normalize_token_text
from engram_model.v41 import build_token_map, check_token_map, load_token_map, save_token_map
from engram_store import InvalidArgument, InvalidType

tokenizers = pytest.importorskip("tokenizers")

WORDS = ["the", " the", "The", " THE", "café", "cafe", " Café", "é", "e\u0301", " ", "  ", "\n", "\t\n", " \u00a0",
         "ﬁ", "fi", "naïve", "\u2167", "viii", "日本", "\U0001f600", "<b>", " x "]
SPECIALS = ["<|bos|>", "<|EOS|>", "<｜User｜>"]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the ByteLevel decoder inverts)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def make_tokenizer():
    """Every single byte (so lone UTF-8 lead/continuation bytes), whole words, then special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    table = bytes_to_unicode()
    vocab: dict[str, int] = {}
    for b in range(256):
        vocab.setdefault(table[b], len(vocab))
    for word in WORDS:
        vocab.setdefault("".join(table[b] for b in word.encode("utf-8")), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    return tok, vocab


def expected_map(vocab: dict[str, int]) -> np.ndarray:
    """The reference rule written out with Python's unicodedata (an independent normaliser)."""
    inverse = {c: b for b, c in bytes_to_unicode().items()}
    by_id = sorted(vocab, key=vocab.get)
    entries = [(bytes(inverse[c] for c in tok).decode("utf-8", errors="replace"), tok) for tok in by_id]
    entries += [(s, s) for s in SPECIALS]
    keys: dict[str, int] = {}
    out = []
    for text, raw in entries:
        key = raw if "\ufffd" in text else (normalize_token_text(text) or text)
        out.append(keys.setdefault(key, len(keys)))
    return np.array(out, dtype=np.int64)


def test_token_map_matches_the_reference_rule():
    tok, vocab = make_tokenizer()
    got = build_token_map(tok)
    assert got.dtype == np.int64 and got.shape == (len(vocab) + len(SPECIALS),)
    np.testing.assert_array_equal(got, expected_map(vocab))

    table = bytes_to_unicode()

    def cid(text):  # the compressed id of the token whose bytes are text's
        return got[vocab["".join(table[b] for b in text.encode("utf-8"))]]

    # Case, accents, a leading space, ligatures and compatibility forms all collapse.
    assert cid("the") == cid(" the") == cid("The") == cid(" THE")
    assert cid("café") == cid("cafe") == cid(" Café") and cid("é") == cid("e\u0301") == cid("e")
    assert cid("ﬁ") == cid("fi") and cid("\u2167") == cid("viii")
    # Whitespace-only tokens keep one space as their key; " x " strips to "x".
    assert cid(" ") == cid("  ") == cid("\n") == cid("\t\n") == cid(" \u00a0")
    assert cid(" x ") == cid("x") and cid("<b>") != cid("b")
    # A lone UTF-8 lead byte decodes to U+FFFD: keyed by its raw token string, so distinct lead bytes stay apart.
    lead_a, lead_b = vocab[table[0xC3]], vocab[table[0xE6]]
    assert got[lead_a] != got[lead_b]
    # Special tokens are decoded (not skipped) and normalised like any text.
    specials = got[len(vocab):]
    assert specials[0] != specials[1] and len(set(specials.tolist())) == 3


def test_transformers_style_tokenizer_and_a_tokenizer_json(tmp_path):
    tok, _ = make_tokenizer()

    class FastTokenizer:  # what build_token_map reads of a transformers fast tokenizer
        backend_tokenizer = tok

        def __len__(self):
            return tok.get_vocab_size(with_added_tokens=True)

    np.testing.assert_array_equal(build_token_map(FastTokenizer()), build_token_map(tok))
    tok.save(str(tmp_path / "tokenizer.json"))
    np.testing.assert_array_equal(build_token_map(str(tmp_path)), build_token_map(tok))
    with pytest.raises(InvalidType, match="tokenizer: expected a tokenizers.Tokenizer"):
        build_token_map(["a", "b"])


def test_missing_tokenizers_package_says_how_to_install(monkeypatch):
    tok, _ = make_tokenizer()
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "tokenizers" or name.startswith("tokenizers."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(InvalidArgument, match=r"pip install 'engram\[tokenizers\]'"):
        build_token_map(tok)


def test_save_and_load(tmp_path):
    tok, _ = make_tokenizer()
    token_map = build_token_map(tok)
    path = tmp_path / "token_map.npy"
    save_token_map(path, token_map)
    loaded = load_token_map(path)
    np.testing.assert_array_equal(loaded, token_map)
    assert loaded.dtype == np.int64 and not loaded.flags.writeable
    with pytest.raises(InvalidArgument, match="ending in .npy"):
        save_token_map(tmp_path / "map.bin", token_map)
    np.save(tmp_path / "bad.npy", np.array([0, 2, 1]))
    with pytest.raises(InvalidArgument, match="order of first appearance, got 2 at token id 1"):
        load_token_map(tmp_path / "bad.npy")
    with pytest.raises(InvalidArgument, match="no such file"):
        load_token_map(tmp_path / "missing.npy")
    for bad, err, match in ((np.array([[0]]), InvalidArgument, "1-D"), (np.array([0.0]), InvalidType, "integer"),
                            ([0, 1], InvalidType, "NumPy array"), (np.array([1, 0]), InvalidArgument, "token id 0"),
                            (np.array([0, -1]), InvalidArgument, "-1 at token id 1")):
        with pytest.raises(err, match=match):
            check_token_map(bad)
