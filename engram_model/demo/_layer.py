"""Engram: one conditional-memory layer whose N-gram tables live in the store.

Follows ``Engram`` of DeepSeek's ``engram_demo_v1.py`` (https://github.com/deepseek-ai/Engram), with its
``MultiHeadEmbedding`` replaced by an :class:`engram_store.EngramStore` (one float32 table per head, keys
``engram:l{layer_id}:h{head}``). For hidden states ``h [B, L, hc, C]`` and token ids ``[B, L]``::

    e      = rows of the hashed ids, flattened to [B, L, H * D_head]
    gate_i = sigmoid(signed_sqrt(<RMSNorm1_i(W_k,i e + b), RMSNorm2_i(h_i)> / sqrt(C)))
    v      = gate * (W_v e + b_v)
    out    = v + SiLU(causal depthwise conv(RMSNorm_i(v_i)), dilation = max_ngram_size)

``forward`` returns ``out``; as in the reference, the caller adds it to the residual stream.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any, Mapping, Sequence

import numpy as np

from engram_store import EngramStore, EngramStoreConfig, LookupHandle, prefetch_many
from engram_store.errors import InvalidArgument, InvalidType, describe, is_int

from .._tokenizer import CompressedTokenizer, as_int_ids, compressed_tokenizer_from_path
from ._checkpoint import load_checkpoint, save_checkpoint
from ._config import BackboneConfig, EngramConfig, check_layer
from ._forward import EngramWeights, engram_output
from ._hasher import NgramHashMapping, get_hash_mapping, token_ids_2d

log = logging.getLogger(__name__)

#: The reference keeps all head tables stacked in one embedding; a checkpoint stores them under this name.
EMBEDDING_KEY = "multi_head_embedding.embedding.weight"
#: Bytes of one table value: tables are float32 (Mooncake's workspace sizes count 4 bytes per value).
_FLOAT32_BYTES = 4
#: The reference's row offset of each head in the stacked table (a buffer, so it is in its state dict).
OFFSETS_KEY = "multi_head_embedding.offsets"


class EngramPrefetch(LookupHandle):
    """Rows of one layer being read in the background; pass it to ``forward(..., prefetched=handle)``.
    ``result()`` is the rows, float32 ``[B, L, H, D_head]``, or raises what the read raised."""

    def __init__(self, layer_id: int, input_ids: np.ndarray, handle: LookupHandle):
        super().__init__(handle.future, handle.row_ids)
        self.layer_id = layer_id
        self.input_ids = input_ids  # the (uncompressed) [B, L] ids the rows belong to

    def __repr__(self) -> str:
        return f"EngramPrefetch(layer_id={self.layer_id}, shape={self.input_ids.shape}, done={self.done()})"


def split_embedding_table(weight: np.ndarray, table_sizes: Sequence[int]) -> list[np.ndarray]:
    """Cut the stacked ``[sum(table_sizes), D_head]`` table into one contiguous float32 table per head."""
    if not isinstance(weight, np.ndarray) or weight.ndim != 2:
        raise InvalidArgument(f"{EMBEDDING_KEY}: expected a 2-D array [sum of head table sizes, D_head], "
                              f"got {describe(getattr(weight, 'shape', weight))}")
    if weight.shape[0] != sum(table_sizes):
        raise InvalidArgument(f"{EMBEDDING_KEY}: expected {sum(table_sizes)} rows (the sum of "
                              f"get_table_vocab_sizes() = {list(table_sizes)}), got shape {weight.shape}")
    offsets = np.concatenate([[0], np.cumsum(table_sizes)])
    return [np.ascontiguousarray(weight[offsets[h]:offsets[h + 1]], dtype=np.float32)
            for h in range(len(table_sizes))]


class Engram:
    """One Engram layer: hashing, store-backed tables, gate and short convolution (float32 NumPy).

    ``store`` is a :class:`engram_store.DistributedStore`, an ``engram_store.compat.MooncakeDistributedStore``
    (or Mooncake's own), or None for an Engram that only hashes and computes from rows it is given.
    ``tokenizer`` is a :class:`CompressedTokenizer`, anything it accepts (a Hugging Face style tokenizer,
    a tokenizer.json path, a list of token texts), or None to use ``config.tokenizer_name_or_path``
    (raw token ids are hashed when that is None or ``""`` too; a name that is neither a local file nor in the
    Hugging Face cache is refused, since nothing is downloaded).

    Mooncake's first Engram API is covered: ``Engram(layer_id, config, backbone_cfg, store)``, ``forward``,
    ``populate_store_from_buffers(buffers[, buffer_sizes])``, ``hash_input_ids``, ``query(input_ids,
    workspace=None)``, the workspace-size getters and ``remove_from_store``.

    Weights start from a seeded initialisation (``numpy.random.default_rng((config.seed, layer_id))``;
    see :class:`engram_model.demo._forward.EngramWeights`) until :meth:`load_state_dict` or :meth:`load` replaces them.
    """

    def __init__(self, layer_id: int, config: EngramConfig | None = None, backbone_cfg: BackboneConfig | None = None,
                 store: Any = None, tokenizer: Any = None):
        if config is not None and not isinstance(config, EngramConfig):
            raise InvalidType(f"config: expected an EngramConfig, got {type(config).__name__}")
        if backbone_cfg is not None and not isinstance(backbone_cfg, BackboneConfig):
            raise InvalidType(f"backbone_cfg: expected a BackboneConfig, got {type(backbone_cfg).__name__}")
        # Copies, so later edits to the caller's configs cannot change a built layer.
        self.config = copy.deepcopy(config or EngramConfig()).validate()
        self.backbone_cfg = copy.deepcopy(backbone_cfg or BackboneConfig()).validate()
        self.layer_id = check_layer(layer_id, self.config, self.backbone_cfg)
        if tokenizer is None and self.config.tokenizer_path is not None:
            tokenizer = compressed_tokenizer_from_path(self.config.tokenizer_path, "tokenizer_name_or_path")
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = compressed_tokenizer_from_path(os.fspath(tokenizer))
        elif tokenizer is not None and not isinstance(tokenizer, CompressedTokenizer):
            tokenizer = CompressedTokenizer(tokenizer)
        self.hash_mapping: NgramHashMapping = get_hash_mapping(self.config, self.backbone_cfg, tokenizer)
        self.engram_store = EngramStore(
            self.layer_id,
            EngramStoreConfig(table_vocab_sizes=self.hash_mapping.get_table_vocab_sizes(self.layer_id),
                              embedding_dim=self.config.head_dim),
            store,
        )
        cfg, bb = self.config, self.backbone_cfg
        self.weights = EngramWeights.initial(bb.hc_mult, bb.hidden_size, cfg.engram_hidden_size, cfg.kernel_size,
                                             np.random.default_rng((cfg.seed, self.layer_id)))
        self._fuse()

    def _fuse(self) -> None:
        self._proj_w, self._proj_b = self.weights.fused_projection()

    # ---- geometry -----------------------------------------------------------------------------

    def get_table_vocab_sizes(self) -> list[int]:
        """Rows of each head's table (primes, n-gram major then head): size the tables from these."""
        return self.engram_store.get_table_vocab_sizes()

    def get_num_heads(self) -> int:
        return self.engram_store.get_num_heads()

    def get_embedding_dim(self) -> int:
        """Columns of every table row, ``D_head = n_embed_per_ngram // n_head_per_ngram``."""
        return self.engram_store.get_embedding_dim()

    def get_store_keys(self) -> list[str]:
        """One key per head, ``engram:l{layer_id}:h{head}``."""
        return self.engram_store.get_store_keys()

    def get_embedding_tables_workspace_size(self) -> int:
        """Bytes of all this layer's tables: ``sum_h N_h * D_head * 4`` (what a populate uploads)."""
        return sum(self.get_table_vocab_sizes()) * self.get_embedding_dim() * _FLOAT32_BYTES

    def get_query_workspace_size(self, B: int, L: int) -> int:
        """Bytes of the scratch Mooncake's ``query`` may use: ``sum_h min(N_h, max(1, B * L)) * D_head * 4``.

        The size of a buffer to pass as ``query(..., workspace=)``; see :meth:`query` for what this
        implementation does with it.
        """
        for name, value in (("B", B), ("L", L)):
            if not is_int(value) or value < 0:
                raise InvalidArgument(f"{name}: expected a non-negative integer, got {describe(value)}")
        positions = max(1, int(B) * int(L))
        return sum(min(n, positions) for n in self.get_table_vocab_sizes()) * self.get_embedding_dim() \
            * _FLOAT32_BYTES

    # ---- tables -------------------------------------------------------------------------------

    def populate_store_from_buffers(self, embedding_buffers: Sequence[np.ndarray],
                                    buffer_sizes: Sequence[int] | None = None, replica_num: int = 1) -> None:
        """Upload one float32 ``[get_table_vocab_sizes()[h], D_head]`` table per head (create-only).

        ``buffer_sizes`` (bytes per table, ``[t.nbytes for t in embedding_buffers]`` as in Mooncake's API) is
        optional and checked if given. Tables of another floating dtype (float64, float16) are cast to float32,
        as Mooncake's binding does; the store holds float32 rows. Tables sized from ``engram_vocab_size``
        instead of :meth:`get_table_vocab_sizes` are refused: head h hashes into ``[0, N_h)``, so rows past a
        short table would have no data. Tables already in the store are never replaced: a second populate
        raises ``ObjectExists`` (call :meth:`remove_from_store` first).
        """
        sizes, dim = self.get_table_vocab_sizes(), self.get_embedding_dim()
        if isinstance(embedding_buffers, np.ndarray) or not isinstance(embedding_buffers, (list, tuple)):
            raise InvalidType(f"embedding_buffers: expected a list of {len(sizes)} float32 arrays (one per head), "
                              f"got {type(embedding_buffers).__name__}")
        if len(embedding_buffers) != len(sizes):
            raise InvalidArgument(f"embedding_buffers: expected {len(sizes)} tables ((max_ngram_size - 1) x "
                                  f"n_head_per_ngram heads), got {len(embedding_buffers)}")
        for h, table in enumerate(embedding_buffers):
            if not isinstance(table, np.ndarray):
                raise InvalidType(f"embedding_buffers[{h}]: expected a float32 NumPy array, got {type(table).__name__}")
            if table.dtype.kind != "f":
                raise InvalidType(f"embedding_buffers[{h}]: expected a floating-point dtype (float32; float64 "
                                  f"and float16 are cast), got {table.dtype}")
            if table.shape != (sizes[h], dim):
                raise InvalidArgument(
                    f"embedding_buffers[{h}]: expected shape ({sizes[h]}, {dim}) = (get_table_vocab_sizes()[{h}], "
                    f"D_head), got {table.shape}; size each head's table from get_table_vocab_sizes() (the prime "
                    f"above engram_vocab_size), not from engram_vocab_size"
                )
        if buffer_sizes is not None:
            if len(buffer_sizes) != len(sizes):
                raise InvalidArgument(f"buffer_sizes: expected {len(sizes)} byte counts, got {len(buffer_sizes)}")
            for h, (table, nbytes) in enumerate(zip(embedding_buffers, buffer_sizes)):
                if nbytes != table.nbytes:
                    raise InvalidArgument(f"buffer_sizes[{h}]: expected {table.nbytes} (embedding_buffers[{h}]"
                                          f".nbytes), got {describe(nbytes)}")
        tables = [np.ascontiguousarray(t, dtype=np.float32) for t in embedding_buffers]  # copies only to cast
        self.engram_store.populate(tables, replica_num=replica_num)

    def populate_store_from_embedding(self, weight: np.ndarray, replica_num: int = 1) -> None:
        """Upload the reference's stacked table (``multi_head_embedding.embedding.weight``), split by head."""
        if not isinstance(weight, np.ndarray) or weight.dtype.kind != "f":
            raise InvalidType(f"{EMBEDDING_KEY}: expected a floating-point NumPy array, "
                              f"got {getattr(weight, 'dtype', type(weight).__name__)}")
        if weight.ndim != 2 or weight.shape[1] != self.get_embedding_dim():
            raise InvalidArgument(f"{EMBEDDING_KEY}: expected shape ({sum(self.get_table_vocab_sizes())}, "
                                  f"{self.get_embedding_dim()}), got {weight.shape}")
        self.populate_store_from_buffers(split_embedding_table(weight, self.get_table_vocab_sizes()),
                                         replica_num=replica_num)

    def remove_from_store(self, force: bool = False) -> int:
        """Remove this layer's tables from the store; returns how many were removed."""
        return self.engram_store.remove_from_store(force=force)

    # ---- hashing and lookup -------------------------------------------------------------------

    @staticmethod
    def _ids(input_ids: Any) -> np.ndarray:
        """Token ids as int64 ``[B, L]`` with B, L >= 1 (not yet compressed)."""
        ids = as_int_ids(input_ids, "input_ids")
        if ids.size == 0:
            raise InvalidArgument(f"input_ids: expected a non-empty [B, L] list or array of token ids, "
                                  f"got shape {ids.shape}")
        return token_ids_2d(ids)

    def hash_input_ids(self, input_ids: Any) -> np.ndarray:
        """Row ids of this layer, int64 ``[B, L, H]``; head h's ids are in ``[0, get_table_vocab_sizes()[h])``.

        Empty input (``[]``, or B or L = 0) gives an empty ``[B, L, H]`` array, ``(0, 0, H)`` for ``[]``.
        """
        ids = as_int_ids(input_ids, "input_ids")
        if ids.size == 0:
            shape = ids.shape if ids.ndim == 2 else (0, 0) if ids.ndim == 1 else None
            if shape is None:
                raise InvalidArgument(f"input_ids: expected shape [B, L] (2 dimensions), got shape {ids.shape}")
            return np.empty((*shape, self.get_num_heads()), dtype=np.int64)
        return self.hash_mapping.hash_layer(ids, self.layer_id)

    def query_embeddings(self, input_ids: Any) -> np.ndarray:
        """Rows for the ids from the store, float32 ``[B, L, H, D_head]``."""
        return self.engram_store.lookup(self.hash_input_ids(self._ids(input_ids)))

    def query(self, input_ids: Any, workspace: np.ndarray | None = None) -> np.ndarray:
        """The rows of the hashed ids, a new float32 ``[B, L, H, D_head]`` array (Mooncake's ``query``).

        ``output[b, l, h] = table_h[hash_input_ids(input_ids)[b, l, h]]``. ``input_ids`` is ``[B, L]`` (nested
        lists or an integer array) and must not be empty. Ids are never clamped: hashing keeps every row id in
        its head's range, so each row read is a stored row.

        ``workspace`` is the optional caller scratch of Mooncake's API (a NumPy array, normally
        ``np.empty(get_query_workspace_size(B, L), np.uint8)``). In Mooncake it is staging space for the
        distinct rows and never the output; here rows are gathered straight into the returned array, so
        no scratch is needed: the workspace is checked to be a NumPy array, then neither read nor written.
        Any size is accepted (Mooncake too ignores one that is too small).
        """
        if workspace is not None and not isinstance(workspace, np.ndarray):
            raise InvalidType(f"workspace: expected a NumPy array (e.g. np.empty(get_query_workspace_size(B, L), "
                              f"np.uint8)) or None, got {type(workspace).__name__}")
        return self.query_embeddings(input_ids)

    def prefetch(self, input_ids: Any, out: Any = None, background: bool | None = None) -> EngramPrefetch:
        """Hash now and start reading the rows; hand the result to :meth:`forward`.

        ``out``: a caller buffer for the rows (float32 ``[B, L, H, D_head]``, writable and C-contiguous, e.g. a
        pinned host buffer's ``.numpy()`` view), filled in place, nothing allocated. ``background=True`` always
        returns at once with the read running in a background thread (see :meth:`EngramStore.prefetch`).
        """
        ids = self._ids(input_ids)
        return self.prefetch_rows(ids, self.hash_input_ids(ids), out=out, background=background)

    def prefetch_rows(self, input_ids: np.ndarray, row_ids: np.ndarray, out: Any = None,
                      background: bool | None = None) -> EngramPrefetch:
        """Start reading rows already hashed for ``input_ids`` (see :func:`prefetch_layers`), into ``out`` if given."""
        return EngramPrefetch(self.layer_id, np.asarray(input_ids, dtype=np.int64),
                              self.engram_store.prefetch(row_ids, out=out, background=background))

    # ---- forward ------------------------------------------------------------------------------

    def forward(self, hidden_states: np.ndarray, input_ids: Any = None, prefetched: EngramPrefetch | None = None,
                embeddings: np.ndarray | None = None, row_ids: np.ndarray | None = None) -> np.ndarray:
        """The Engram branch for ``hidden_states`` float32 ``[B, L, hc_mult, hidden_size]``: the same shape.

        The output is float32. Hidden states of another floating dtype (float64, float16) are cast to float32
        once on entry, as Mooncake's ``forward`` does; that copy costs a pass over ``hidden_states``, little
        next to the projections. ``input_ids`` is ``[B, L]``: nested lists or an integer array.

        Rows come from ``prefetched`` (a handle from :meth:`prefetch` for these ``input_ids``), else from
        ``embeddings`` (float32 ``[B, L, H, D_head]``, rows the caller already has), else from the store for
        ``row_ids`` (int64 ``[B, L, H]`` hashed by the caller, e.g. by an :class:`IncrementalHasher` once per
        decode step for every layer), else from the store for ``input_ids``.
        """
        return self.forward_with_gates(hidden_states, input_ids, prefetched, embeddings, row_ids)[0]

    __call__ = forward

    def forward_with_gates(self, hidden_states: np.ndarray, input_ids: Any = None,
                           prefetched: EngramPrefetch | None = None, embeddings: np.ndarray | None = None,
                           row_ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`forward` plus the gate of every position and channel, float32 ``[B, L, hc_mult]``."""
        h = self._check_hidden(hidden_states)
        B, L = h.shape[:2]
        rows = self._rows(B, L, input_ids, prefetched, embeddings, row_ids)
        return engram_output(rows, h, self.weights, self._proj_w, self._proj_b, self.config.max_ngram_size)

    def _check_hidden(self, hidden_states: Any) -> np.ndarray:
        hc, C = self.backbone_cfg.hc_mult, self.backbone_cfg.hidden_size
        if not isinstance(hidden_states, np.ndarray):
            raise InvalidType(f"hidden_states: expected a float32 NumPy array [B, L, {hc}, {C}], "
                              f"got {type(hidden_states).__name__}")
        if hidden_states.dtype.kind != "f":
            raise InvalidType(f"hidden_states: expected a floating-point dtype (float32; float64 and float16 are "
                              f"cast), got {hidden_states.dtype}")
        if hidden_states.ndim != 4 or hidden_states.shape[2:] != (hc, C) or 0 in hidden_states.shape[:2]:
            raise InvalidArgument(f"hidden_states: expected shape [B, L, hc_mult={hc}, hidden_size={C}] with "
                                  f"B, L >= 1, got {hidden_states.shape}")
        return hidden_states.astype(np.float32, copy=False)

    def _rows(self, B: int, L: int, input_ids: Any, prefetched: EngramPrefetch | None,
              embeddings: np.ndarray | None, row_ids: np.ndarray | None = None) -> np.ndarray:
        H, D = self.get_num_heads(), self.get_embedding_dim()
        if prefetched is not None:
            if not isinstance(prefetched, EngramPrefetch):
                raise InvalidType(f"prefetched: expected the EngramPrefetch returned by prefetch(), "
                                  f"got {type(prefetched).__name__}")
            if prefetched.layer_id != self.layer_id:
                raise InvalidArgument(f"prefetched: the handle is for layer {prefetched.layer_id}, "
                                      f"this Engram is layer {self.layer_id}")
            if input_ids is not None and not np.array_equal(self._ids(input_ids), prefetched.input_ids):
                raise InvalidArgument("prefetched: the handle was made for other input_ids than the ones passed")
            rows = prefetched.result()
        elif embeddings is not None:
            if not isinstance(embeddings, np.ndarray) or embeddings.dtype != np.float32:
                raise InvalidType(f"embeddings: expected a float32 NumPy array [B, L, {H}, {D}], "
                                  f"got {getattr(embeddings, 'dtype', type(embeddings).__name__)}")
            rows = embeddings
        elif row_ids is not None:
            rows = self.engram_store.lookup(row_ids)
        elif input_ids is None:
            raise InvalidArgument("input_ids: expected [B, L] token ids (or pass prefetched=, embeddings= or "
                                  "row_ids=), got None")
        else:
            ids = self._ids(input_ids)
            if ids.shape != (B, L):
                raise InvalidArgument(f"input_ids: expected shape {(B, L)} (the B, L of hidden_states), "
                                      f"got {ids.shape}")
            rows = self.query_embeddings(ids)
        if rows.shape != (B, L, H, D):
            source = "prefetched" if prefetched is not None else "embeddings" if embeddings is not None else "row_ids"
            raise InvalidArgument(f"{source}: expected rows of "
                                  f"shape {(B, L, H, D)} (B, L of hidden_states, H heads, D_head), got {rows.shape}")
        return rows

    # ---- weights ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of the weights under the reference module's names (the tables stay in the store)."""
        return self.weights.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        populate_tables: bool = False) -> None:
        """Replace the weights; every name and shape is checked before anything changes.

        With ``strict`` a missing or unexpected name is an error (the message lists all of them); a wrong
        shape always is. The reference's table entries (``multi_head_embedding.*``) are recognised: their
        shapes are checked, and with ``populate_tables`` the stacked table is split by head and uploaded.
        """
        if not isinstance(state_dict, Mapping):
            raise InvalidType(f"state_dict: expected a mapping of name -> array, got {type(state_dict).__name__}")
        expected = self.weights.expected_shapes()
        table_entries = {k: state_dict[k] for k in (EMBEDDING_KEY, OFFSETS_KEY) if k in state_dict}
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected and k not in table_entries]
        wrong, arrays = [], {}
        for name, shape in expected.items():
            if name not in state_dict:
                continue
            value = np.asarray(state_dict[name])
            if value.dtype.kind != "f":
                raise InvalidType(f"state_dict[{name!r}]: expected a floating-point array, got dtype {value.dtype}")
            if value.shape != shape:
                wrong.append(f"{name}: expected {shape}, got {value.shape}")
            arrays[name] = value.astype(np.float32, copy=False)
        wrong += self._check_table_entries(table_entries)
        problems = []
        if wrong:
            problems.append("wrong shape: " + "; ".join(wrong))
        if strict and missing:
            problems.append("missing: " + ", ".join(missing))
        if strict and unexpected:
            problems.append("unexpected: " + ", ".join(unexpected))
        if problems:
            raise InvalidArgument(f"state_dict for Engram layer {self.layer_id} does not match "
                                  f"(hc_mult={self.backbone_cfg.hc_mult}, hidden_size={self.backbone_cfg.hidden_size}, "
                                  f"engram hidden={self.config.engram_hidden_size}, "
                                  f"kernel_size={self.config.kernel_size}): " + " | ".join(problems))
        if populate_tables and EMBEDDING_KEY not in table_entries:
            raise InvalidArgument(f"populate_tables: the state_dict holds no {EMBEDDING_KEY!r} to populate from")
        if populate_tables:
            self.populate_store_from_embedding(np.asarray(table_entries[EMBEDDING_KEY]))
        self.weights.assign(arrays)
        self._fuse()

    def _check_table_entries(self, entries: Mapping[str, Any]) -> list[str]:
        sizes = self.get_table_vocab_sizes()
        wrong = []
        if EMBEDDING_KEY in entries:
            shape = np.shape(entries[EMBEDDING_KEY])
            if shape != (sum(sizes), self.get_embedding_dim()):
                wrong.append(f"{EMBEDDING_KEY}: expected {(sum(sizes), self.get_embedding_dim())} "
                             f"(sum of get_table_vocab_sizes(), D_head), got {shape}")
        if OFFSETS_KEY in entries:
            offsets = np.asarray(entries[OFFSETS_KEY])
            want = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            if offsets.shape != want.shape or not np.array_equal(offsets, want):
                wrong.append(f"{OFFSETS_KEY}: expected the head offsets {want.tolist()[:4]}... of this layer's "
                             f"tables, got {offsets.tolist()[:4]}... (trained with another hashing config?)")
        return wrong

    def save(self, path: str, include_tables: np.ndarray | None = None) -> None:
        """Write the weights to a ``.npz`` or ``.safetensors`` file (by extension).

        ``include_tables`` optionally adds a stacked ``[sum of table sizes, D_head]`` table under the
        reference's name, so the file is a complete checkpoint.
        """
        tensors = self.state_dict()
        if include_tables is not None:
            wrong = self._check_table_entries({EMBEDDING_KEY: include_tables})
            if wrong:
                raise InvalidArgument(f"include_tables: {wrong[0]}")
            tensors[EMBEDDING_KEY] = np.asarray(include_tables, dtype=np.float32)
        save_checkpoint(path, tensors)

    def load(self, path: str, strict: bool = True, populate_tables: bool = False) -> None:
        """Load weights (and with ``populate_tables`` the stacked table) from a ``.npz`` or ``.safetensors`` file."""
        self.load_state_dict(load_checkpoint(path), strict=strict, populate_tables=populate_tables)

    def close(self) -> None:
        """Stop background reads; the tables stay in the store."""
        self.engram_store.close()

    def __enter__(self) -> "Engram":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Engram(layer_id={self.layer_id}, heads={self.get_num_heads()}, D_head={self.get_embedding_dim()}, "
                f"hc_mult={self.backbone_cfg.hc_mult}, hidden_size={self.backbone_cfg.hidden_size})")


def prefetch_layers(engrams: Sequence[Engram], input_ids: Any) -> dict[int, EngramPrefetch]:
    """Hash ``input_ids`` once for every layer and start all their reads: ``{layer_id: handle}``.

    Layers that share a hash mapping (the usual case: one config for the model) are hashed in one pass.
    """
    groups: dict[int, tuple[NgramHashMapping, list[Engram]]] = {}
    for engram in engrams:
        groups.setdefault(id(engram.hash_mapping), (engram.hash_mapping, []))[1].append(engram)
    order: list[tuple[Engram, np.ndarray, np.ndarray]] = []
    for mapping, members in groups.values():
        ids = members[0]._ids(input_ids)
        rows = mapping.hash_layers(ids, [e.layer_id for e in members])
        order += [(engram, ids, rows[engram.layer_id]) for engram in members]
    # One read for all layers: layers whose tables share a segment server share its request.
    reads = prefetch_many([(engram.engram_store, row_ids) for engram, _, row_ids in order])
    return {engram.layer_id: EngramPrefetch(engram.layer_id, ids, handle)
            for (engram, ids, _), handle in zip(order, reads)}
