"""The explorer's layers and their rows (``tests/nemesis.py``, client side): every row carries its identity, so every
read path can be checked on the spot, row by row.

Three families of layers, each a *kind* (where it lives) and a layer id:

* **small** (kinds ``store``, ``local``, ``disk``; layers 1-3): three heads of about 340 rows of
  ``[L, G, h, r, G]`` float32 (20 bytes): row ``r`` of head ``h`` of layer ``L`` written by populate ``G``.
* **wide** (kind ``wide``: the store; layers 21, 22): one head of :data:`WIDE_ROWS` rows of :data:`WIDE_DIM` float32
  (256 bytes), ``[L, G, h, r, G]`` and then a pattern of all five. One head lives on one server, so a lookup of
  many ids asks for every row as it is, and its reply is over the 2 MiB past which a segment streams it in pieces.
* **V4.1** (kinds ``v41``: the store, ``v41-local``: ``local_dir``, ``v41-disk``: ``disk_dir``; layers 11, 12):
  :func:`v41`'s layout (eight columns of about 520 rows of 264-byte FP8 rows), read with ``V41Rows`` in every form.
  A row's first eight codes spell ``L, G, h, r`` in base 100 (each digit + 1: positive, finite E4M3 codes); the
  other codes and the scales are a pattern of all four, the first block's scale fixed so that a bf16 row spells
  its identity too.

A check answers which populates (generations) a read saw and describes every row that is not exactly the one
asked for, of the populate it claims.
"""

from __future__ import annotations

import functools

import numpy as np

from engram_store import EngramStoreConfig

SMALL_SIZES = [331, 337, 347]
SMALL_DIM = 5
WIDE_ROWS = 2053
WIDE_DIM = 64
#: kind -> (family, where it lives)
KINDS = {"store": ("small", "store"), "local": ("small", "local"), "disk": ("small", "disk"),
         "wide": ("wide", "store"), "v41": ("v41", "store"), "v41-local": ("v41", "local"),
         "v41-disk": ("v41", "disk")}
LAYERS = {"small": (1, 2, 3), "wide": (21, 22), "v41": (11, 12)}


@functools.cache
def v41():
    """The V4.1 geometry of the explorer's V4.1 layers: eight columns (two n-gram orders of four heads) of primes
    above 500, so a ``local_dir`` open maps eight files and a tensor-parallel shard holds four (imported on first
    use: clients that read no V4.1 layer start faster)."""
    from engram_model.v41 import V41Config
    return V41Config(layer_ids=(11, 12), max_ngram_size=3, n_heads=4, head_dim=256, engram_vocab_size=500)


def kind_of(place_name: str, layer: int) -> str:
    """The kind of the explorer's layer ``layer`` that lives in ``place_name`` (store, local, disk)."""
    fam = next(f for f, layers in LAYERS.items() if layer in layers)
    return next(k for k, (f, p) in KINDS.items() if f == fam and p == place_name)


def family(kind: str) -> str:
    return KINDS[kind][0]


def place(kind: str) -> str:
    return KINDS[kind][1]


def config(kind: str, layer: int) -> EngramStoreConfig:
    fam = family(kind)
    if fam == "small":
        return EngramStoreConfig(table_vocab_sizes=SMALL_SIZES, embedding_dim=SMALL_DIM)
    if fam == "wide":
        return EngramStoreConfig(table_vocab_sizes=[WIDE_ROWS], embedding_dim=WIDE_DIM)
    from engram_model.v41 import v41_store_config
    return v41_store_config(v41(), layer)


def sizes(kind: str, layer: int) -> list[int]:
    return list(config(kind, layer).table_vocab_sizes)


def tables(kind: str, layer: int, generation: int) -> list[np.ndarray]:
    """What populate number ``generation`` writes into ``layer`` of ``kind``: one table per head."""
    if family(kind) == "v41":
        return [v41_rows(layer, generation, h, np.arange(n)) for h, n in enumerate(sizes(kind, layer))]
    dim = config(kind, layer).embedding_dim
    out = []
    for h, n in enumerate(sizes(kind, layer)):
        t = np.empty((n, dim), dtype=np.float32)
        t[:] = float_rows(layer, np.float32(generation), h, np.arange(n), dim)
        out.append(t)
    return out


def float_rows(layer: int, gen, head, row, dim: int) -> np.ndarray:
    """Rows ``[..., dim]`` float32 of the small and wide layers for broadcastable ``gen``, ``head``, ``row``."""
    gen, head, row = np.broadcast_arrays(np.asarray(gen, np.float32), np.asarray(head, np.float32),
                                         np.asarray(row, np.float32))
    out = np.empty(gen.shape + (dim,), dtype=np.float32)
    out[..., 0], out[..., 1], out[..., 2], out[..., 3], out[..., 4] = layer, gen, head, row, gen
    if dim > 5:
        k = np.arange(5, dim, dtype=np.float32)
        out[..., 5:] = np.mod(gen[..., None] * 3 + row[..., None] + head[..., None] * 5 + k * 7, 1000)
    return out


def check_float(rows: np.ndarray, ids: np.ndarray, layer: int) -> dict:
    """Which generations ``rows [B, L, H, D]`` (float32) come from (its right rows), and every row that is not the one
    ``ids`` asked for, whole, of the populate it claims."""
    heads = np.broadcast_to(np.arange(ids.shape[-1], dtype=np.float32), ids.shape)
    expected = float_rows(layer, rows[..., 1], heads, ids, rows.shape[-1])
    wrong = ~(rows == expected).all(axis=-1)
    bad = [f"at {tuple(int(i) for i in where)}: asked layer {layer} head {where[-1]} row {int(ids[where])}, got "
           f"{rows[where][:6].tolist()}" for where in zip(*np.nonzero(wrong))][:5]
    return {"gens": sorted({int(g) for g in np.unique(rows[..., 1][~wrong])}), "bad": bad}


# ---- V4.1 rows ----------------------------------------------------------------------------------------------------

def _digits(value) -> tuple[np.ndarray, np.ndarray]:
    value = np.asarray(value, dtype=np.int64)
    return (value // 100 % 100 + 1).astype(np.uint8), (value % 100 + 1).astype(np.uint8)


def v41_rows(layer: int, gen, head, row) -> np.ndarray:
    """Packed 264-byte rows ``[..., row_bytes]`` for broadcastable ``gen``, ``head``, ``row``."""
    gen, head, row = np.broadcast_arrays(np.asarray(gen, np.int64), np.asarray(head, np.int64),
                                         np.asarray(row, np.int64))
    hd, rb = v41().head_dim, v41().row_bytes
    out = np.empty(gen.shape + (rb,), dtype=np.uint8)
    k = np.arange(hd, dtype=np.int64)
    out[..., :hd] = (gen[..., None] * 31 + row[..., None] * 7 + head[..., None] * 13 + k * 5) % 100 + 1
    for i, value in enumerate((np.full(gen.shape, layer), gen, head, row)):
        out[..., 2 * i], out[..., 2 * i + 1] = _digits(value)
    out[..., hd] = 127  # the first block's scale: 2^0, so a bf16 row spells the codes' values as they are
    out[..., hd + 1:] = 120 + (gen[..., None] + np.arange(1, rb - hd)) % 8
    return out


def _spelled(codes: np.ndarray) -> tuple[np.ndarray, ...]:
    """``(layer, gen, head, row)`` a row's first eight codes spell (garbage for bytes that are no row of ours)."""
    c = codes[..., :8].astype(np.int64) - 1
    return tuple(c[..., 2 * i] * 100 + c[..., 2 * i + 1] for i in range(4))


@functools.cache
def _code_lut() -> np.ndarray:
    """The E4M3 codes 1..100 by the bf16 bits they decode to at scale 2^0 (the first block of every row)."""
    from engram_model.v41 import decode_fp8_rows
    probe = np.zeros((100, v41().row_bytes), dtype=np.uint8)
    probe[:, 0] = np.arange(1, 101)
    probe[:, v41().head_dim:] = 127
    lut = np.zeros(1 << 16, dtype=np.uint8)
    lut[(decode_fp8_rows(probe)[:, 0].view(np.uint32) >> 16).astype(np.uint16)] = np.arange(1, 101)
    return lut


def bf16_of(packed: np.ndarray) -> np.ndarray:
    """The bf16 bits the engines' decode gives for packed rows ``[..., row_bytes]``."""
    from engram_model.v41 import decode_fp8_rows
    flat = packed.reshape(-1, v41().row_bytes)
    bits = (decode_fp8_rows(flat).view(np.uint32) >> 16).astype(np.uint16)
    return bits.reshape(packed.shape[:-1] + (v41().head_dim,))


def check_v41(got: np.ndarray, form: str, layer: int, heads: np.ndarray, rows: np.ndarray) -> dict:
    """Check gathered V4.1 rows: ``got`` is ``[N, row_bytes]`` packed (the packed and split forms) or ``[N,
    head_dim]`` bf16 bits; ``heads``/``rows`` ``[N]`` say which row each slot asked for (-1: padding, which reads
    zeros)."""
    pad = rows < 0
    if form == "bf16":
        codes = _code_lut()[got[..., :8]]
    else:
        codes = got[..., :8]
    spelled = _spelled(codes)
    gen = np.where(pad, 0, spelled[1])
    want = v41_rows(layer, gen, np.where(pad, 0, heads), np.where(pad, 0, rows))
    if form == "bf16":
        want = bf16_of(want)
    want[pad] = 0
    wrong = ~(got == want).all(axis=-1)
    bad = [f"slot {int(i)}: asked layer {layer} head {int(heads[i])} row {int(rows[i])}, got a row spelling "
           f"{[int(s[i]) for s in spelled]} ({got[i][:10].tolist()}...)" for i in np.flatnonzero(wrong)[:5]]
    return {"gens": sorted({int(g) for g in np.unique(gen[~pad & ~wrong])}), "bad": bad}
