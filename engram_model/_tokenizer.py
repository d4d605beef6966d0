"""CompressedTokenizer: token ids mapped onto a smaller vocabulary of normalised token texts.

Follows ``CompressedTokenizer`` of DeepSeek's ``engram_demo_v1.py``. There the key of a token is its decoded
text passed through a Hugging Face ``tokenizers`` normalizer sequence::

    NFKC, NFD, StripAccents, Lowercase, Replace([ \\t\\r\\n]+ -> " "), Replace(^ $ -> U+E000), Strip,
    Replace(U+E000 -> " ")

and tokens with equal keys share one compressed id, numbered in order of first appearance. Here the
normaliser is written in plain Python with the same character-level semantics as the Rust one: accent
stripping drops every combining mark (categories Mn, Mc, Me, as ``is_combining_mark`` does), lowercasing goes
character by character, and stripping removes Unicode ``White_Space``. So the ``tokenizers`` package is
needed only to read a ``tokenizer.json`` file. The two agree on every character whose Unicode data is the
same in Python's ``unicodedata`` and in the Rust crates' tables; the few hundred characters added or changed
by recent Unicode versions (rare combining marks, modifier letters, digits) can get different keys.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import unicodedata
from typing import Any, Iterable, Sequence

import numpy as np

from engram_store.errors import InvalidArgument, InvalidType, describe

#: Stands in for an all-whitespace token while Strip runs, so such a token keeps a single space as its key.
_SENTINEL = "\ue000"
_WHITESPACE_RUN = re.compile(r"[ \t\r\n]+")
#: Unicode White_Space, which Rust's ``char::is_whitespace`` (and so the Strip normalizer) uses. Python's
#: ``str.strip()`` would also remove U+001C..U+001F.
_WHITE_SPACE = ("\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
                "\u2028\u2029\u202f\u205f\u3000")


def normalize_token_text(text: str) -> str:
    """The reference normalizer sequence applied to one token's decoded text."""
    text = unicodedata.normalize("NFKC", text)
    text = unicodedata.normalize("NFD", text)
    text = "".join(c for c in text if unicodedata.category(c)[0] != "M")  # StripAccents: every combining mark
    text = "".join(c.lower() for c in text)  # per character: no final-sigma rule, as in Rust's char::to_lowercase
    text = _WHITESPACE_RUN.sub(" ", text)
    if text == " ":
        text = _SENTINEL
    text = text.strip(_WHITE_SPACE)
    return text.replace(_SENTINEL, " ")


def token_key(text: str, raw_token: str | None) -> str:
    """The key a token is grouped by: its raw token string if decoding was lossy, else its normalised text."""
    if "\ufffd" in text:
        return text if raw_token is None else raw_token
    norm = normalize_token_text(text)
    return norm if norm else text


class CompressedTokenizer:
    """Maps token ids to compressed ids; ``len()`` is the compressed vocabulary size.

    ``tokenizer`` is one of:

    * a Hugging Face style object with ``decode(ids, skip_special_tokens=False)``, ``convert_ids_to_tokens(id)``
      and ``len()`` (``transformers.AutoTokenizer`` and friends);
    * a ``tokenizers.Tokenizer``, a path to a ``tokenizer.json`` file, a directory holding one, or a Hugging
      Face name whose tokenizer.json is already in the local cache (needs ``pip install engram[tokenizers]``;
      nothing is downloaded);
    * a list of token texts, one per token id, as the tokenizer decodes them.

    Calling the object maps an integer array of token ids to compressed ids of the same shape; negative
    ids (padding markers) pass through unchanged.
    """

    def __init__(self, tokenizer: Any):
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = _load_tokenizers_file(os.fspath(tokenizer))  # a file, a directory or a cached Hub name
        if _is_tokenizers_object(tokenizer):
            tokenizer = _TokenizersAdapter(tokenizer)
        if isinstance(tokenizer, (list, tuple)):
            keys = self._keys_from_texts(tokenizer)
            self.source = f"{len(tokenizer)} token texts"
        elif all(hasattr(tokenizer, a) for a in ("decode", "convert_ids_to_tokens", "__len__")):
            keys = self._keys_from_tokenizer(tokenizer)
            self.source = type(tokenizer).__name__
        else:
            raise InvalidType(
                "tokenizer: expected an object with decode/convert_ids_to_tokens/__len__, a tokenizers.Tokenizer, "
                f"a tokenizer.json path or a list of token texts, got {type(tokenizer).__name__}"
            )
        key2new: dict[str, int] = {}
        lookup = np.empty(len(keys), dtype=np.int64)
        for tid, key in enumerate(keys):
            lookup[tid] = key2new.setdefault(key, len(key2new))
        lookup.flags.writeable = False
        self.lookup_table = lookup
        self.num_new_token = len(key2new)
        self.fingerprint = hashlib.blake2b(lookup.tobytes(), digest_size=16).hexdigest()

    @classmethod
    def from_token_texts(cls, texts: Sequence[str], raw_tokens: Sequence[str] | None = None) -> "CompressedTokenizer":
        """Build from decoded token texts; ``raw_tokens`` (the vocabulary's token strings) key the lossy ones."""
        if raw_tokens is None:
            return cls(list(texts))
        if len(raw_tokens) != len(texts):
            raise InvalidArgument(f"raw_tokens: expected one per token text ({len(texts)}), got {len(raw_tokens)}")
        return cls(_ListTokenizer(list(texts), list(raw_tokens)))

    @staticmethod
    def _keys_from_texts(texts: Iterable[Any]) -> list[str]:
        keys = []
        for tid, text in enumerate(texts):
            if not isinstance(text, str):
                raise InvalidType(f"tokenizer[{tid}]: expected the token's text as str, got {describe(text)}")
            keys.append(token_key(text, None))
        if not keys:
            raise InvalidArgument("tokenizer: expected at least one token text, got an empty list")
        return keys

    @staticmethod
    def _keys_from_tokenizer(tokenizer: Any) -> list[str]:
        vocab_size = len(tokenizer)
        if vocab_size <= 0:
            raise InvalidArgument(f"tokenizer: expected a non-empty vocabulary, len(tokenizer) = {vocab_size}")
        keys = []
        for tid in range(vocab_size):
            text = tokenizer.decode([tid], skip_special_tokens=False)
            raw = tokenizer.convert_ids_to_tokens(tid) if "\ufffd" in text else None
            keys.append(token_key(text, raw))
        return keys

    def __len__(self) -> int:
        return self.num_new_token

    @property
    def original_vocab_size(self) -> int:
        """Token ids the tokenizer knows (the length of the lookup table)."""
        return int(self.lookup_table.size)

    @property
    def compression_ratio(self) -> float:
        """Original vocabulary size over compressed vocabulary size (>= 1)."""
        return self.original_vocab_size / self.num_new_token

    def __call__(self, input_ids: Any) -> np.ndarray:
        """Compressed ids as int64, same shape; negative ids unchanged, ids past the vocabulary refused."""
        ids = as_int_ids(input_ids, "input_ids")
        pos_mask = ids >= 0
        if ids.size and int(ids.max(initial=-1)) >= self.lookup_table.size:
            index = tuple(int(i) for i in np.unravel_index(int(np.argmax(ids >= self.lookup_table.size)), ids.shape))
            raise InvalidArgument(
                f"input_ids{list(index)} = {int(ids[index])} is out of range for the tokenizer's vocabulary of "
                f"{self.lookup_table.size} ids (expected id < {self.lookup_table.size}, or negative for padding)"
            )
        out = ids.copy()
        out[pos_mask] = self.lookup_table[ids[pos_mask]]
        return out

    def __repr__(self) -> str:
        return (f"CompressedTokenizer({self.original_vocab_size} -> {self.num_new_token} ids, "
                f"ratio {self.compression_ratio:.3f}, from {self.source})")


@functools.lru_cache(maxsize=4)
def compressed_tokenizer_from_path(path: str, name: str = "tokenizer") -> CompressedTokenizer:
    """A CompressedTokenizer for a tokenizer.json path (or a cached Hub name), built once per path.

    Building one decodes every token id (seconds for a 100k+ vocabulary), and every Engram layer of a
    model configured with ``tokenizer_name_or_path`` needs the same one. ``name`` is the argument or field
    the path came from, for error messages.
    """
    return CompressedTokenizer(_load_tokenizers_file(path, name))


def as_int_ids(input_ids: Any, name: str) -> np.ndarray:
    """Integer token ids (any nesting of lists, or an integer array) as an int64 array; floats are refused."""
    arr = input_ids if isinstance(input_ids, np.ndarray) else _asarray(input_ids, name)
    if arr.dtype == np.bool_ or arr.dtype.kind not in "iu":
        raise InvalidType(f"{name}: expected integer token ids, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise InvalidArgument(f"{name}: token id {int(arr.max())} does not fit in int64")
    return np.asarray(arr, dtype=np.int64)


def _asarray(value: Any, name: str) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except (ValueError, OverflowError) as exc:  # ragged nesting, or ints that fit no dtype
        raise InvalidArgument(f"{name}: expected equal-length lists of integers, got {describe(value)} ({exc})") \
            from None
    if arr.dtype == object:
        raise InvalidArgument(f"{name}: expected equal-length lists of integers, got {describe(value)}")
    if arr.size == 0 and arr.dtype.kind == "f":
        return arr.astype(np.int64)  # np.asarray([]) is float64; callers check the shape
    return arr


class _ListTokenizer:
    """Token texts plus raw token strings presented as a Hugging Face style tokenizer."""

    def __init__(self, texts: list[str], raw_tokens: list[str]):
        self._texts = texts
        self._raw = raw_tokens

    def __len__(self) -> int:
        return len(self._texts)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self._texts[i] for i in ids)

    def convert_ids_to_tokens(self, tid: int) -> str:
        return self._raw[tid]


class _TokenizersAdapter:
    """A ``tokenizers.Tokenizer`` presented with the ``transformers`` method names the reference uses."""

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, tid: int) -> str:
        return self._tok.id_to_token(tid)


def _is_tokenizers_object(obj: Any) -> bool:
    return type(obj).__module__.startswith("tokenizers") and hasattr(obj, "id_to_token")


def _load_tokenizers_file(path: str, name: str = "tokenizer") -> Any:
    """A ``tokenizers.Tokenizer`` from a tokenizer.json file, a directory holding one, or a Hugging Face name
    already in the local cache. Nothing is ever downloaded: engram runs where there is no network."""
    file = _tokenizer_file(path, name)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise InvalidArgument(
            f"{name}: loading {path!r} needs the tokenizers package; install it with "
            "pip install 'engram[tokenizers]', or pass a tokenizer object or a list of token texts"
        ) from None
    return Tokenizer.from_file(file)


def _tokenizer_file(path: str, name: str) -> str:
    """The tokenizer.json that ``path`` names, or an error saying how to fix ``name``."""
    if os.path.isfile(path):
        return path
    if os.path.isdir(path):
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise InvalidArgument(f"{name}: directory {path!r} holds no tokenizer.json")
        return file
    cached = _cached_hub_file(path)
    if cached is not None:
        return cached
    if name == "tokenizer_name_or_path":
        fix = ('set it to "" (or None) to hash raw token ids, which is what Mooncake\'s Engram does (its hashing '
               "never reads this field)")
    else:
        fix = "pass None to hash raw token ids"
    raise InvalidArgument(
        f"{name}: {path!r} is neither a tokenizer.json file, a directory holding one, nor a Hugging Face name "
        f"in the local cache, and tokenizers are never downloaded; {fix}, or point it at a local tokenizer.json "
        f"(for instance fetched beforehand with `huggingface-cli download {path} tokenizer.json`)"
    )


def _cached_hub_file(repo_id: str) -> str | None:
    """``tokenizer.json`` of a Hugging Face repo if it is in the local cache (``HF_HOME``); no network."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # installed with tokenizers; without it nothing can be cached
        return None
    try:
        found = try_to_load_from_cache(repo_id, "tokenizer.json")
    except Exception:  # not a valid repo id (e.g. a mistyped path): nothing cached under it
        return None
    return found if isinstance(found, str) else None
