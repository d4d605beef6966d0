"""The token map of DeepSeek-V4.1's Engram: raw token id -> compressed id, built from the tokenizer.

Not shipped with the checkpoint; DeepSeek's inference code builds it at load time. For each id in
``range(len(tokenizer))``, the id alone is decoded by the backend (``tokenizers``) tokenizer, special tokens
kept. A text holding U+FFFD (a partial UTF-8 byte token) is keyed by the token's vocabulary string; any other
text by its normalised form::

    NFKC, NFD, StripAccents, Lowercase, Replace([ \\t\\r\\n]+ -> " "), Replace(^ $ -> U+E000), Strip,
    Replace(U+E000 -> " ")

(the sentinel keeps a token that is exactly one space from stripping to ""), or by the raw text when that
normalises to "". Compressed ids are handed out in order of first appearance; the released tokenizer gives
99092 of them (``engram_compressed_vocab_size``).

The normaliser is run by the ``tokenizers`` package itself (an optional extra: ``pip install
'engram[tokenizers]'``), so the keys are the reference's to the byte. :func:`save_token_map` and
:func:`load_token_map` keep a built map in a small ``.npy`` file, so serving does not rebuild it.
"""

from __future__ import annotations

import logging
import os
from tokenize import TokenError
from typing import Any

import numpy as np

from engram_store.durable import write_replacing
from engram_store.errors import InvalidArgument, InvalidType, describe

from .._tokenizer import _load_tokenizers_file

log = logging.getLogger(__name__)

#: The first bytes of every .npy file.
_NPY_MAGIC = b"\x93NUMPY"
#: Keeps a token that is exactly one space through Strip (a private-use character, swapped back afterwards).
SENTINEL = "\ue000"


def _normalizer() -> Any:
    try:
        from tokenizers import Regex, normalizers
    except ImportError:
        raise InvalidArgument("tokenizer: building the V4.1 token map needs the tokenizers package; install it "
                              "with pip install 'engram[tokenizers]', or load a saved map with load_token_map()"
                              ) from None
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), SENTINEL),
        normalizers.Strip(), normalizers.Replace(SENTINEL, " "),
    ])


def _backend(tokenizer: Any) -> tuple[Any, int]:
    """The ``tokenizers.Tokenizer`` doing the decoding, and how many ids to map."""
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = _load_tokenizers_file(os.fspath(tokenizer))
    if type(tokenizer).__module__.startswith("tokenizers") and hasattr(tokenizer, "get_vocab_size"):
        return tokenizer, int(tokenizer.get_vocab_size(with_added_tokens=True))
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a transformers "fast" tokenizer
    if backend is not None and hasattr(tokenizer, "__len__"):
        return backend, len(tokenizer)
    raise InvalidType(f"tokenizer: expected a tokenizers.Tokenizer, a transformers fast tokenizer (with "
                      f".backend_tokenizer) or a tokenizer.json path, got {type(tokenizer).__name__}")


def build_token_map(tokenizer: Any) -> np.ndarray:
    """int64 ``[len(tokenizer)]``: the compressed id of every token id (see the module docstring)."""
    normalizer = _normalizer()
    backend, n = _backend(tokenizer)
    if n <= 0:
        raise InvalidArgument(f"tokenizer: expected a vocabulary of at least one token, got {n}")
    texts = backend.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    keys: dict[str, int] = {}
    token_map = np.empty(n, dtype=np.int64)
    for token_id, text in enumerate(texts):
        if "\ufffd" in text:
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        token_map[token_id] = keys.setdefault(key, len(keys))
    log.info("V4.1 token map: %d token ids -> %d compressed ids", n, len(keys))
    return token_map


def check_token_map(token_map: Any, name: str = "token_map") -> np.ndarray:
    """``token_map`` as a read-only int64 ``[V]`` array, checked: ids handed out in order of first appearance."""
    if not isinstance(token_map, np.ndarray):
        raise InvalidType(f"{name}: expected an integer NumPy array [vocab] (from build_token_map), "
                          f"got {type(token_map).__name__}")
    if token_map.dtype.kind not in "iu":
        raise InvalidType(f"{name}: expected an integer dtype, got {token_map.dtype}")
    if token_map.ndim != 1 or token_map.size == 0:
        raise InvalidArgument(f"{name}: expected a non-empty 1-D array [vocab], got shape {token_map.shape}")
    tm = np.ascontiguousarray(token_map, dtype=np.int64)
    # First appearance order: every id is at most one above the largest id seen before it, and the first is 0.
    running = np.maximum.accumulate(tm)
    if tm[0] != 0 or (tm < 0).any() or (tm[1:] > running[:-1] + 1).any():
        bad = 0 if tm[0] != 0 else int(np.flatnonzero((tm[1:] > running[:-1] + 1) | (tm[1:] < 0))[0]) + 1
        raise InvalidArgument(f"{name}: expected compressed ids 0, 1, 2, ... handed out in order of first "
                              f"appearance, got {describe(int(tm[bad]))} at token id {bad}")
    if tm is token_map:
        tm = tm.copy()
    tm.flags.writeable = False
    return tm


def save_token_map(path: str | os.PathLike, token_map: np.ndarray) -> None:
    """Write ``token_map`` to ``path`` (a ``.npy`` file of int32, about 0.5 MB for the released tokenizer)."""
    tm = check_token_map(token_map)
    if int(tm.max()) > np.iinfo(np.int32).max:
        raise InvalidArgument(f"token_map: compressed ids above int32 cannot be saved, got {int(tm.max())}")
    where = os.fspath(path)
    if not where.endswith(".npy"):
        raise InvalidArgument(f"path: expected a file name ending in .npy, got {where!r}")
    write_replacing(where, lambda f: np.save(f, tm.astype(np.int32), allow_pickle=False), "save_token_map")


def load_token_map(path: str | os.PathLike) -> np.ndarray:
    """Read a map written by :func:`save_token_map`: read-only int64 ``[vocab]``."""
    where = os.fspath(path)
    expected = f"{where}: expected a token map saved by save_token_map (a .npy file of int32), got"
    arr = None
    try:
        with open(where, "rb") as f:
            magic = f.read(len(_NPY_MAGIC))
            if magic == _NPY_MAGIC:  # else np.load would take it for a pickle or an .npz archive
                f.seek(0)
                arr = np.lib.format.read_array(f, allow_pickle=False)
    except FileNotFoundError:
        raise InvalidArgument(f"path: no such file {where!r}") from None
    except IsADirectoryError:
        raise InvalidArgument(f"{expected} a directory") from None
    except OSError as exc:
        raise InvalidArgument(f"{expected} a file that cannot be read ({exc.strerror})") from None
    except (EOFError, ValueError, SyntaxError, TokenError) as exc:  # what NumPy's header parser raises
        raise InvalidArgument(f"{expected} a damaged .npy file ({type(exc).__name__}: {exc})") from None
    if arr is None:
        got = f"a file that is not a .npy file (it starts {describe(magic)})" if magic else "an empty file"
        raise InvalidArgument(f"{expected} {got}")
    return check_token_map(arr, where)
