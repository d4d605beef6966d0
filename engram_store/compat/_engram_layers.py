"""Mooncake's current EngramStore: several layers of opaque byte rows, in a store, bound, or under ``local_dir``."""

from __future__ import annotations

import ctypes
import os
from typing import Any, Mapping, Sequence

import numpy as np

from ..tables import EngramStore as NativeEngramStore
from ..tables import EngramStoreConfig as NativeEngramStoreConfig
from ..tables import lookup_many
from ..errors import (
    EngramError,
    InvalidArgument,
    InvalidType,
    NotConnected,
    describe,
)
from ._engram import API_VERSIONS, EngramStore, EngramStoreConfig, _store_client
from ._errors import (
    _UNSET,
    _lookup_error,
    _describe_array,
    _is_int,
    _runtime_errors,
    _RuntimeInvalidArgument,
    _RuntimeInvalidType,
)



class _MultiLayerEngramStore(EngramStore):
    """Mooncake's multi-layer EngramStore of opaque byte rows: ``EngramStore(layers, store, local_dir)``."""

    def __init__(self, layers: Mapping[int, EngramStoreConfig], store: Any = None,
                 local_dir: str | os.PathLike | None = "", *, store_client: Any = None):
        if store is not None and store_client is not None:
            raise InvalidType("EngramStore: pass the store once, as store= (Mooncake's first byte-row API) or "
                              "store_client= (the later one), not both")
        client = store if store is not None else store_client
        if local_dir is not None and not isinstance(local_dir, (str, os.PathLike)):
            raise InvalidType(f"local_dir: expected a directory path (str), got {describe(local_dir)}")
        local = os.fspath(local_dir) if local_dir is not None else ""
        if client is not None and local:
            raise InvalidArgument(f"store_client and local_dir are mutually exclusive: tables are read from a store "
                                  f"or from files under local_dir, got a {type(client).__name__} and "
                                  f"local_dir={local!r}")
        if not isinstance(layers, Mapping):
            raise InvalidType(f"layers: expected a {{layer_id: EngramStoreConfig}} dict, got {describe(layers)}")
        if not layers:
            raise InvalidArgument("layers: EngramStore requires at least one layer, got an empty dict")
        configs = {}
        for layer_id, config in layers.items():
            if not _is_int(layer_id):
                raise InvalidType(f"layers: expected integer layer ids, got {describe(layer_id)}")
            if layer_id < 0:
                raise InvalidArgument(f"layers: expected non-negative layer ids, got {int(layer_id)}")
            configs[int(layer_id)] = _byte_rows_config(int(layer_id), config)
        self._client = _store_client(client)
        with _runtime_errors():  # a published layer under local_dir that does not match is checked now
            self._es = NativeEngramStore(configs, store=self._client, local_dir=local or None,
                                         require_manifest=False)
        self._layer_ids = frozenset(configs)

    def _layer(self, layer_id: Any) -> int:
        if not _is_int(layer_id):
            raise InvalidType(f"layer_id: expected an integer layer id, got {describe(layer_id)}")
        if int(layer_id) not in self._layer_ids:
            raise InvalidArgument(f"Unknown Engram layer: {int(layer_id)} (layer_id: expected one of this "
                                  f"EngramStore's layers {sorted(self._layer_ids)})")
        return int(layer_id)

    # ---- metadata (no store needed) ---------------------------------------------------------------

    def get_layer_ids(self) -> list[int]:
        return self._es.get_layer_ids()

    def get_num_heads(self, layer_id: int) -> int:
        return self._es.get_num_heads(layer=self._layer(layer_id))

    def get_row_bytes(self, layer_id: int) -> int:
        return self._es.get_row_bytes(layer=self._layer(layer_id))

    def get_table_vocab_sizes(self, layer_id: int) -> list[int]:
        return self._es.get_table_vocab_sizes(layer=self._layer(layer_id))

    def get_store_keys(self, layer_id: int) -> list[str]:
        return self._es.get_store_keys(layer=self._layer(layer_id))

    # ---- tables ---------------------------------------------------------------------------------

    def populate(self, layer_id: int, embedding_buffers: list, config: Any = _UNSET, *,
                 replicate_config: Any = _UNSET) -> None:
        """Copy the layer's head tables into the store, or into files under ``local_dir``; create-only and
        all-or-nothing.

        ``embedding_buffers``: a list of one C-contiguous uint8 ``[N_h, row_bytes]`` NumPy array per head
        (read-only arrays are fine; nothing is cast). ``config`` (or ``replicate_config=``): a ReplicateConfig
        whose ``replica_num`` copies go to distinct segments (None: one; ignored under ``local_dir``). The arrays
        may be released or changed once this returns.
        """
        layer_id = self._layer(layer_id)
        replicas = _replica_num(config, replicate_config)
        tables = self._check_tables(layer_id, embedding_buffers)
        with _runtime_errors():
            self._es.populate(tables, replicas, layer=layer_id)

    def bind_local(self, layer_id: int, embedding_buffers: list) -> None:
        """Read the layer from the caller's own immutable uint8 ``[N_h, row_bytes]`` arrays, in place (no copy).

        The arrays are retained for this EngramStore's lifetime; do not modify, resize or unmap them while bound.
        Only for an EngramStore built without a store or ``local_dir``, once per layer.
        """
        layer_id = self._layer(layer_id)
        tables = self._check_tables(layer_id, embedding_buffers)
        if self._client is not None or self._es.local_dir is not None:
            source = "a store" if self._client is not None else f"local_dir {self._es.local_dir}"
            raise _RuntimeInvalidArgument(f"bind_local requires an unbound layer and no Store client: layer "
                                          f"{layer_id} of this EngramStore is read from {source}; bind_local is for "
                                          "EngramStore(layers) built without one")
        with _runtime_errors():
            self._es.bind_local(tables, layer=layer_id)

    def _check_tables(self, layer_id: int, buffers: Any) -> list[np.ndarray]:
        sizes = self._es.get_table_vocab_sizes(layer=layer_id)
        row_bytes = self._es.get_row_bytes(layer=layer_id)
        H = len(sizes)
        if not isinstance(buffers, list):
            raise InvalidType(f"embedding_buffers: expected a list of {H} uint8 NumPy arrays (one per head of layer "
                              f"{layer_id}), got {type(buffers).__name__}")
        if len(buffers) != H:
            raise _RuntimeInvalidArgument(f"embedding_buffers: expected {H} tables (one per head of layer "
                                          f"{layer_id}), got {len(buffers)}")
        for h, (table, n) in enumerate(zip(buffers, sizes)):
            if not isinstance(table, np.ndarray):
                raise _RuntimeInvalidType(f"embedding_buffers[{h}]: expected a NumPy uint8 array, "
                                          f"got {type(table).__name__}")
            if table.dtype != np.uint8 or not table.flags.c_contiguous:
                raise _RuntimeInvalidType(f"embedding_buffers[{h}]: expected a C-contiguous uint8 array (rows are "
                                          f"opaque bytes; nothing is cast or copied to fit), "
                                          f"got a {_describe_array(table)}")
            if table.shape != (n, row_bytes):
                raise _RuntimeInvalidArgument(f"embedding_buffers[{h}]: expected shape ({n}, {row_bytes}) "
                                              f"(table_vocab_sizes[{h}] rows x row_bytes of layer {layer_id}), "
                                              f"got {table.shape}")
        return buffers

    # ---- lookups --------------------------------------------------------------------------------

    def lookup_into(self, layer_id: int, row_ids: np.ndarray, output: np.ndarray) -> None:
        """``output[b, l, h] = row row_ids[b, l, h] of head h``: int64 ``[B, L, H]`` ids, uint8
        ``[B, L, H, row_bytes]`` output, both C-contiguous NumPy arrays (nothing is converted).

        Every id is checked before anything is read; a failed lookup leaves ``output`` zeroed. An empty batch
        does nothing. The output needs no registration (a registered one works the same).
        """
        layer_id = self._layer(layer_id)
        row_ids, output = self._check_pair(layer_id, row_ids, output, "row_ids", "output", InvalidType)
        if row_ids.size:
            self._read([layer_id], [row_ids], [output])

    def lookup_many_into(self, layer_ids: Sequence[int], row_ids: Sequence[np.ndarray],
                         outputs: Sequence[np.ndarray]) -> None:
        """:meth:`lookup_into` for several (layer, ids, output) at once; the reads of all of them go out together
        (one request per segment server). A bad id anywhere fails them all and leaves every output zeroed."""
        lists = {"layer_ids": layer_ids, "row_ids": row_ids, "outputs": outputs}
        _check_lists(lists)
        layers = [self._layer(layer_id) for layer_id in layer_ids]
        _check_equal_lengths(lists)
        pairs = [self._check_pair(layer_id, ids, out, f"row_ids[{i}]", f"outputs[{i}]", _RuntimeInvalidType)
                 for i, (layer_id, ids, out) in enumerate(zip(layers, row_ids, outputs))]
        _check_disjoint([out for _, out in pairs])
        jobs = [(layer_id, ids, out) for layer_id, (ids, out) in zip(layers, pairs) if ids.size]
        if jobs:
            self._read(*(list(column) for column in zip(*jobs)))

    def lookup_many_into_registered(self, layer_ids: Sequence[int], row_ids: Sequence[np.ndarray],
                                    output_addresses: Sequence[int], output_sizes: Sequence[int]) -> None:
        """:meth:`lookup_many_into` with each output given as a raw address and its size in bytes: memory the
        caller owns (a framework's pinned or registered buffer), written as ``[B, L, H, row_bytes]`` uint8.

        The addresses must stay valid for the call; nothing checks that they point at memory the caller may
        write. This store reads into any memory, so registering it with the store is not required."""
        lists = {"layer_ids": layer_ids, "row_ids": row_ids, "output_addresses": output_addresses,
                 "output_sizes": output_sizes}
        _check_lists(lists)
        layers = [self._layer(layer_id) for layer_id in layer_ids]
        _check_equal_lengths(lists)
        jobs, outs = [], []
        for i, (layer_id, ids, address, size) in enumerate(zip(layers, row_ids, output_addresses, output_sizes)):
            H = self._es.get_num_heads(layer=layer_id)
            row_bytes = self._es.get_row_bytes(layer=layer_id)
            if not (isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.flags.c_contiguous
                    and ids.ndim == 3 and ids.shape[2] == H):
                raise _RuntimeInvalidArgument(f"lookup_many_into_registered requires contiguous int64 IDs [B,L,H]: "
                                              f"expected row_ids[{i}] of shape [B, L, {H}] (layer {layer_id}), got "
                                              f"{_describe_array(ids)}")
            for name, value in (("output_addresses", address), ("output_sizes", size)):
                if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                    raise _RuntimeInvalidArgument(f"{name}[{i}]: expected a non-negative integer, got {value!r}")
            outs.append(np.empty(0, dtype=np.uint8))
            if ids.size == 0:
                continue
            if address == 0:
                raise _RuntimeInvalidArgument(f"output_addresses[{i}]: registered output address must be nonzero")
            shape = ids.shape + (row_bytes,)
            need = ids.size * row_bytes
            if size != need:
                raise _RuntimeInvalidArgument(f"output_sizes[{i}]: expected {need} bytes ([B, L, H, row_bytes] = "
                                              f"{list(shape)} for layer {layer_id}), got {size}")
            out = np.ctypeslib.as_array((ctypes.c_uint8 * need).from_address(int(address))).reshape(shape)
            jobs.append((layer_id, ids, out))
            outs[i] = out
        if jobs:
            _check_disjoint(outs, "output_addresses")
            self._read(*(list(column) for column in zip(*jobs)))

    def lookup(self, table_ids: Sequence[int], row_ids: np.ndarray, output: np.ndarray) -> None:
        """Mooncake's packed lookup: ``output[i, t] = row row_ids[i, t] of layer table_ids[i]``, for layers of
        one head each; an id of -1 leaves ``output[i, t]`` as it is.

        ``row_ids``: C-contiguous int64 ``[len(table_ids), tokens]``; ``output``: writable C-contiguous uint8
        ``[len(table_ids), tokens, row_bytes]``. Every id is checked before anything is written.
        """
        layers, row_bytes = self._packed_layers(table_ids)
        n = len(layers)
        if not (isinstance(row_ids, np.ndarray) and row_ids.dtype == np.int64 and row_ids.flags.c_contiguous
                and row_ids.ndim == 2 and row_ids.shape[0] == n):
            raise InvalidArgument(f"lookup requires contiguous int64 IDs [heads,tokens]: expected row_ids of shape "
                                  f"({n}, tokens), got {_describe_array(row_ids)}")
        T = row_ids.shape[1]
        if not (isinstance(output, np.ndarray) and output.dtype == np.uint8 and output.flags.c_contiguous
                and output.flags.writeable and output.shape == (n, T, row_bytes)):
            raise InvalidArgument(f"output must be contiguous writable uint8 of shape [heads,tokens,row_bytes]: "
                                  f"expected ({n}, {T}, {row_bytes}), got {_describe_array(output)}")
        if T == 0:
            return
        for i, layer_id in enumerate(layers):
            rows = self._es.get_table_vocab_sizes(layer=layer_id)[0]
            bad = np.flatnonzero((row_ids[i] < -1) | (row_ids[i] >= rows))
            if bad.size:
                t = int(bad[0])
                raise _RuntimeInvalidArgument(f"row_ids[{i}, {t}] = {int(row_ids[i, t])} is out of range: layer "
                                              f"{layer_id} has {rows} rows (expected -1 to skip, or 0 <= id < "
                                              f"{rows})")
        self._read_packed(layers, row_ids, output, row_bytes)

    def _packed_layers(self, table_ids: Any) -> tuple[list[int], int]:
        """The layers a packed lookup names, checked: one head each, rows of one width (returned)."""
        if not isinstance(table_ids, (list, tuple)):
            raise InvalidType(f"table_ids: expected a list of layer ids, got {type(table_ids).__name__}")
        layers = [self._layer(layer_id) for layer_id in table_ids]
        if not layers:
            raise InvalidArgument("table_ids: expected at least one layer id, got an empty list")
        for layer_id in layers:
            if self._es.get_num_heads(layer=layer_id) != 1:
                raise InvalidArgument(f"table_ids: layer {layer_id} has {self._es.get_num_heads(layer=layer_id)} "
                                      "heads; lookup(table_ids, ...) reads layers of one head (lookup_into reads "
                                      "[B, L, H] ids of any layer)")
        row_bytes = self._es.get_row_bytes(layer=layers[0])
        for layer_id in layers[1:]:
            if self._es.get_row_bytes(layer=layer_id) != row_bytes:
                raise InvalidArgument(f"table_ids: layer {layer_id} has rows of "
                                      f"{self._es.get_row_bytes(layer=layer_id)} bytes, layer {layers[0]} of "
                                      f"{row_bytes}; one output holds rows of one width")
        return layers, row_bytes

    def _read_packed(self, layers: list[int], row_ids: np.ndarray, output: np.ndarray, row_bytes: int) -> None:
        """Read checked packed ids into ``output``: a layer without -1 straight into its rows, others around their
        holes; every layer in one ``lookup_many``."""
        T = row_ids.shape[1]
        requests, request_layers, targets, holes = [], [], [], []
        for i, layer_id in enumerate(layers):
            keep = row_ids[i] != -1
            if keep.all():  # read straight into the output
                requests.append((self._es, row_ids[i].reshape(1, T, 1)))
                targets.append(output[i].reshape(1, T, 1, row_bytes))
            elif keep.any():  # read the rows asked for, then put them in place around the holes
                positions = np.flatnonzero(keep)
                requests.append((self._es, np.ascontiguousarray(row_ids[i, positions]).reshape(1, -1, 1)))
                targets.append(np.empty((1, positions.size, 1, row_bytes), dtype=np.uint8))
                holes.append((i, positions, targets[-1]))
            else:
                continue
            request_layers.append(layer_id)
        if requests:
            with _runtime_errors():
                lookup_many(requests, layers=request_layers, out=targets).result()
        for i, positions, rows in holes:
            output[i, positions] = rows.reshape(-1, row_bytes)

    def _check_pair(self, layer_id: int, row_ids: Any, output: Any, ids_name: str, out_name: str,
                    type_error: type) -> tuple[np.ndarray, np.ndarray]:
        """Validate one lookup's ids and output as Mooncake does: no conversion, no copy."""
        H = self._es.get_num_heads(layer=layer_id)
        row_bytes = self._es.get_row_bytes(layer=layer_id)
        if not (isinstance(row_ids, np.ndarray) and row_ids.dtype == np.int64 and row_ids.flags.c_contiguous):
            raise type_error(f"{ids_name}: expected a C-contiguous int64 NumPy array [B, L, {H}] (nothing is "
                             f"converted), got {_describe_array(row_ids)}")
        if not isinstance(output, np.ndarray):
            raise type_error(f"{out_name}: expected a writable C-contiguous uint8 NumPy array [B, L, {H}, "
                             f"{row_bytes}], got {type(output).__name__}")
        if row_ids.ndim != 3 or row_ids.shape[2] != H:
            raise _RuntimeInvalidArgument(f"{ids_name}: expected shape [B, L, {H}] ({H} heads in layer {layer_id}), "
                                          f"got {row_ids.shape}")
        shape = row_ids.shape + (row_bytes,)
        if (output.dtype != np.uint8 or output.shape != shape or not output.flags.c_contiguous
                or not output.flags.writeable):
            raise _RuntimeInvalidArgument(f"{out_name}: expected a writable C-contiguous uint8 array of shape "
                                          f"{shape} (row_bytes = {row_bytes} for layer {layer_id}), "
                                          f"got a {_describe_array(output)}")
        return row_ids, output

    def _read(self, layer_ids: list[int], row_ids: list[np.ndarray], outputs: list[np.ndarray]) -> None:
        """Read checked lookups; on failure zero every output (as Mooncake) unless the layer has no tables at all."""
        try:
            if len(layer_ids) == 1:
                self._es.lookup_into(row_ids[0], outputs[0], layer=layer_ids[0])
            else:
                lookup_many([(self._es, ids) for ids in row_ids], layers=layer_ids, out=outputs).result()
        except NotConnected:
            raise  # no store, and the layer neither bound nor under local_dir: nothing was read or written
        except EngramError as exc:
            for output in outputs:
                output[...] = 0  # never a partly written output
            raise _lookup_error(exc, from_store=self._client is not None) from exc

    def remove_from_store(self, layer_id: int, force: bool = False) -> int:
        """Remove the layer's head tables from the store; the number removed (missing ones are skipped).

        Other layers are untouched. Without a store this fails (rc=-600, as in Mooncake): layers published under
        ``local_dir`` are files, removed by deleting their directory.
        """
        return self._remove(force, self._layer(layer_id))


def _byte_rows_config(layer_id: int, config: Any) -> NativeEngramStoreConfig:
    """The native config of a byte-row layer, its fields checked (and named) as this layer's."""
    if not isinstance(config, EngramStoreConfig):
        raise InvalidType(f"layers[{layer_id}]: expected an EngramStoreConfig, got {type(config).__name__}")
    if config.row_bytes <= 0:
        raise InvalidArgument(f"layers[{layer_id}].row_bytes: expected a positive row width in bytes, "
                              f"got {config.row_bytes}")
    try:
        return NativeEngramStoreConfig(config.table_vocab_sizes, config.row_bytes, row_format="bytes")
    except InvalidArgument as exc:
        raise InvalidArgument(f"layers[{layer_id}].{exc}") from None


def _replica_num(config: Any, alias: Any) -> int:
    """``replica_num`` of populate's ReplicateConfig, given as ``config`` or ``replicate_config`` (None: 1)."""
    if config is not _UNSET and alias is not _UNSET:
        raise InvalidType("populate: pass the ReplicateConfig once, as config= or replicate_config=")
    chosen = alias if config is _UNSET else config
    if chosen is _UNSET or chosen is None:
        return 1
    replicas = getattr(chosen, "replica_num", None)
    if not _is_int(replicas):
        raise InvalidType(f"config: expected a ReplicateConfig or None, got {type(chosen).__name__}")
    if replicas < 1:
        raise InvalidArgument(f"config.replica_num: expected an integer >= 1, got {int(replicas)}")
    return int(replicas)


def _check_lists(lists: dict[str, Any]) -> None:
    """Each named argument of a many-lookup call is a list (or tuple)."""
    for name, value in lists.items():
        if not isinstance(value, (list, tuple)):
            raise _RuntimeInvalidType(f"{name}: expected a list, got {type(value).__name__}")


def _check_equal_lengths(lists: dict[str, Any]) -> None:
    """The named lists of a many-lookup call are of one length (one entry per lookup)."""
    lengths = [len(value) for value in lists.values()]
    if len(set(lengths)) > 1:
        names = list(lists)
        raise _RuntimeInvalidArgument(f"{', '.join(names[:-1])} and {names[-1]} must have equal lengths, got "
                                      f"{', '.join(map(str, lengths[:-1]))} and {lengths[-1]}")


def _check_disjoint(outputs: list[np.ndarray], name: str = "outputs") -> None:
    """Refuse outputs that share memory: one lookup would overwrite another's rows."""
    spans = sorted((out.ctypes.data, out.ctypes.data + out.nbytes, i) for i, out in enumerate(outputs) if out.nbytes)
    for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
        if start < end:
            raise _RuntimeInvalidArgument(f"{name}[{min(i, j)}] and {name}[{max(i, j)}] overlap in memory; each "
                                          "lookup needs its own output")


API_VERSIONS["layers"] = _MultiLayerEngramStore
