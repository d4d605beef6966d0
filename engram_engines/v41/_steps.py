"""The host path of one model's Engram layers: a step's ids reach the host once for every layer; each layer's rows
are gathered on the host (packed, into pinned memory), copied to the device and decoded into the layer's buffer;
a layer waits only for its own rows.

Used for tables the GPU cannot read in place (``disk_dir``) or where ``ENGRAM_DEVICE_READ=host``. Per step::

    prepare(first layer, its ids)   # the engine's thread: one copy of [T, n_layers, cols] ids to pinned memory
      worker: wait for the ids; for each layer in order: gather its packed rows; copy them to the device and
              decode them there (a copy stream), record the layer's event
    finish(layer)                    # the engine's thread, where the layer reads its rows: wait for that layer

so the first Engram layer's rows are gathered while the engine launches (and the GPU runs) the decoder layers
before it, and every later layer's while the layers between run. Works on any device: on the CPU the copies are
synchronous (:class:`engram_engines._cuda.HostSteps`) and Triton's interpreter runs the decode.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np

from .._pipeline import WAIT_TIMEOUT_S, StepGathers
from ._reader import LayerReader, interpreted


class ModelLayer:
    """One Engram layer of the model, as the host path serves it."""

    def __init__(self, index: int, reader: LayerReader, head_start: int, part: int, rows: Any):
        self.index = index          # the layer's position in the hasher's output (layer_hash_index)
        self.reader = reader
        self.head_start, self.part = head_start, part
        self.rows = rows            # the engine's persistent bf16 buffer [max_tokens, part, dim] (static address)
        self.staged = None          # pinned packed rows [max_tokens, part, row_bytes]
        self.device_packed = None   # the same on the device
        self.gather = None          # the reader's gather bound to the layer's host buffer


class HostSteps:
    """The host path of one model (see the module docstring); one per model, shared by its Engram modules.
    ``n_layers``: the Engram layers the model's hasher gives ids for (its output's second axis)."""

    def __init__(self, n_layers: int, name: str = "engram-steps"):
        self.n_layers = n_layers
        self.layers: dict[int, ModelLayer] = {}
        self.gathers = StepGathers(name)
        self._copies: Any = None
        self._ids: Any = None                  # pinned [max_tokens, n_layers, cols], the hasher's dtype
        self._futures: dict[int, Future] = {}  # layer index -> its rows of the step started last

    def add(self, layer: ModelLayer) -> None:
        self.layers[layer.index] = layer
        self._copies = None  # buffers are made on the first step

    def _order(self) -> list[int]:
        return sorted(self.layers)

    def _setup(self, hash_ids: Any) -> None:
        import torch

        from .._cuda import DeviceSteps
        from .._cuda import HostSteps as CpuSteps

        first = self.layers[self._order()[0]]
        device = first.rows.device
        self._copies = DeviceSteps(device, len(self.layers)) if device.type == "cuda" else CpuSteps()
        config = first.reader.config
        max_tokens = first.rows.shape[0]
        self._ids = self._copies.pinned((max_tokens, self.n_layers, config.cols), hash_ids.dtype)
        self._decode = device.type == "cuda" or interpreted()  # else rows are gathered as bf16 straight in
        for layer in self.layers.values():
            if self._decode:
                layer.staged = self._copies.pinned((max_tokens, layer.part, config.row_bytes), torch.uint8)
                layer.device_packed = torch.empty_like(layer.staged, device=device)
            layer.gather = layer.reader.bind(layer.staged if self._decode else layer.rows, head_start=layer.head_start)

    def prepare(self, index: int, hash_ids: Any) -> None:
        """Layer ``index``'s ``prepare_embeddings(hash_ids)``: the model's first Engram layer starts the step for
        every layer (one copy of the ids); a later one only where the ids are not laid out for that."""
        order = self._order()
        if index != order[0] and index in self._futures:
            return  # started with the step's first layer
        if self._copies is None or self._ids.dtype != hash_ids.dtype:
            self._setup(hash_ids)
        T = hash_ids.shape[0]
        full = _all_layers(hash_ids, index, self.n_layers)
        if full is not None:
            self._copies.ids_to_host(full, self._ids[:T])
            step = order
        else:  # not sliced from one [T, n_layers, cols] tensor: this layer's ids alone
            self._copies.ids_to_host(hash_ids, self._ids[:T, index])
            step = [index]
        if index == order[0]:
            self._futures = {}
        ids = self._ids.numpy()
        futures = self.gathers.start([self._gather_fn(self.layers[i], ids, T) for i in step],
                                     ready=self._copies.wait_ids,
                                     staged=lambda k: self._staged(self.layers[step[k]], T))
        self._futures.update(zip(step, futures))

    def _gather_fn(self, layer: ModelLayer, ids: np.ndarray, T: int):
        def gather() -> None:
            layer.gather(np.ascontiguousarray(ids[:T, layer.index]))
        return gather

    def _staged(self, layer: ModelLayer, T: int) -> None:
        if not self._decode:
            return
        from ._triton import decode_packed

        self._copies.rows_to_device(self._order().index(layer.index), layer.staged[:T], layer.device_packed[:T],
                                    layer.rows[:T], decode_packed)

    def finish(self, index: int, timeout_s: float = WAIT_TIMEOUT_S) -> None:
        """Where layer ``index`` reads its rows: wait for them (the worker for the gather, the device's stream
        for the copy); raises what the gather raised."""
        future = self._futures.get(index)
        if future is None:
            raise RuntimeError(f"engram: Engram layer {index} reads its rows before prepare_embeddings started them")
        future.result(timeout_s)
        self._copies.wait_rows(self._order().index(index))

    def close(self) -> None:
        self.gathers.close()


def _all_layers(hash_ids: Any, index: int, n_layers: int) -> Any:
    """The ``[T, n_layers, cols]`` tensor ``hash_ids`` (``[T, cols]``, column ``index`` of it) was sliced from,
    as a view, or None where it was not sliced so."""
    import torch

    if hash_ids.dim() != 2:
        return None
    T, cols = hash_ids.shape
    if hash_ids.stride() != (n_layers * cols, 1) or hash_ids.storage_offset() < index * cols:
        return None
    base = hash_ids.storage_offset() - index * cols
    full = torch.as_strided(hash_ids, (T, n_layers, cols), (n_layers * cols, cols, 1), base)
    if full.untyped_storage().nbytes() < (base + T * n_layers * cols) * full.element_size():
        return None
    return full
