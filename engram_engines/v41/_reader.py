"""One DeepSeek-V4.1 Engram layer read from engram tables, for an engine's module: the host's gathers (counted and
timed) and, for a table held in memory, what a GPU needs to read it in place.

Two ways to an engine's rows, chosen per table kind (docs/engines.md says why):

* **in place** (``local_dir``, ``ENGRAM_DEVICE_READ=auto``): the columns' files are mapped by every process of the
  host; on a GPU each mapping is registered with ``cudaHostRegister`` (read-only) and engram's Triton kernel
  (:mod:`._triton`) reads the rows through UVA, as vLLM's own kernel reads its pinned table. No host work per
  step, and a CUDA graph captures it. Triton's interpreter runs the same kernel on the CPU.
* **on the host** (``disk_dir``, or ``ENGRAM_DEVICE_READ=host``): :class:`engram_model.v41.V41Rows` gathers the
  rows (from the host cache, or SSD) into the engine's buffer, or into pinned memory that is then copied to the
  GPU and decoded there.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from typing import Any

import numpy as np

from engram_model.v41 import V41Config, V41Rows
from engram_store import EngramStore

from .._settings import EngineSettings
from .._stats import STATS
from .._tables import LOCAL_DIR, DISK_DIR


def tier_of(table: EngramStore) -> str:
    return LOCAL_DIR if table.local_dir is not None else DISK_DIR if table.disk_dir is not None else "memory"


def form_of(out: Any, scales_out: Any) -> str:
    if scales_out is not None:
        return "split"
    return "packed" if "uint8" in str(getattr(out, "dtype", "")) else "bf16"


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``, Triton installed): on the CPU, over
    host memory."""
    return os.environ.get("TRITON_INTERPRET", "") == "1" and importlib.util.find_spec("triton") is not None


class LayerReader:
    """Layer ``layer_id`` of ``config`` from ``table`` (see the module docstring); shared by the modules of one
    process that read the layer."""

    def __init__(self, settings: EngineSettings, table: EngramStore, config: V41Config, layer_id: int):
        self.settings, self.table, self.config, self.layer_id = settings, table, config, int(layer_id)
        self.rows = V41Rows(table, config, layer_id, threads=settings.threads)
        self.tier = tier_of(table)
        self.offsets = config.offsets(layer_id).astype(np.int64)
        self.in_place = self.tier == LOCAL_DIR and settings.device_read == "auto"
        self._views: list[np.ndarray] | None = None
        self._bases: dict[str, Any] = {}  # device type -> int64 tensor of the columns' addresses there
        self._lock = threading.Lock()

    # ---- the host's gathers -----------------------------------------------------------------------------------

    def gather(self, ids: Any, out: Any, *, scales_out: Any = None, head_start: int = 0) -> Any:
        """:meth:`V41Rows.gather_into`, recorded per layer, form and tier."""
        rows = int(np.prod(getattr(out, "shape", (0,))[:2])) if scales_out is None else int(out.shape[0])
        return STATS.timed(self.layer_id, form_of(out, scales_out), self.tier, rows,
                           lambda: self.rows.gather_into(ids, out, scales_out=scales_out, head_start=head_start))

    def bind(self, out: Any, *, head_start: int = 0):
        """A decode step's gather into ``out`` (checked once: :meth:`V41Rows.bind`): ``gather(ids)`` fills
        ``out[:T]``, recorded as :meth:`gather` records."""
        bound = self.rows.bind(out, head_start=head_start)
        form, part = form_of(out, None), bound.part
        layer_id, tier, record, clock = self.layer_id, self.tier, STATS.record, time.perf_counter

        def gather(ids: Any) -> Any:  # STATS.timed, without its closure: a decode step's cadence
            rows = ids.shape[0] * part
            start = clock()
            ok = False
            try:
                result = bound(ids)
                ok = True
                return result
            finally:
                record(layer_id, form, tier, rows, clock() - start, ok)
        return gather

    # ---- in place -----------------------------------------------------------------------------------------------

    def column_addresses(self) -> np.ndarray:
        """int64 ``[cols]``: where each column's rows start in this process's mapping of the table (host
        addresses; the views stay referenced while this reader lives)."""
        with self._lock:
            if self._views is None:
                views = self.table.local_tables(layer=self.layer_id)
                if views is None or len(views) != self.config.cols:
                    raise RuntimeError(f"layer {self.layer_id}: the table is not whole in this host's memory")
                self._views = views
            return np.array([v.ctypes.data for v in self._views], dtype=np.int64)

    def mapped_columns(self) -> list[np.ndarray]:
        self.column_addresses()
        return list(self._views or [])

    def bases(self, device: Any) -> Any:
        """The columns' addresses as a tensor on ``device`` (registering the mappings with CUDA first on a GPU)."""
        import torch

        key = str(device)
        found = self._bases.get(key)
        if found is None:
            addresses = self.column_addresses()
            if torch.device(device).type == "cuda":
                from .._cuda import register_host_mappings

                addresses = register_host_mappings(self.mapped_columns())
            found = self._bases[key] = torch.from_numpy(addresses).to(device)
        return found

    def prepare_device(self) -> None:
        """On a CUDA device, register the mappings and make the kernel's address and offset tables now, at start:
        the engine's first lookups may run inside a CUDA graph's capture, where neither may happen."""
        import torch

        if self.in_place and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
            self.bases(device)
            self._offsets_on(device)

    def lookup_in_place(self, indices: Any, out: Any, *, head_start: int, vocab_start: int, vocab_end: int) -> None:
        """vLLM's lookup into ``out`` (bf16 or packed) read by the kernel over the mapped columns."""
        from ._triton import lookup_in_place

        offsets = self._offsets_on(out.device)
        rows = out.shape[0] * out.shape[1]
        STATS.timed(self.layer_id, "device", self.tier, rows, lambda: lookup_in_place(
            self.bases(out.device), offsets, indices, out, head_start=head_start, n_cols=self.config.cols,
            vocab_start=vocab_start, vocab_end=vocab_end))

    def _offsets_on(self, device: Any) -> Any:
        import torch

        key = f"offsets:{device}"
        found = self._bases.get(key)
        if found is None:
            found = self._bases[key] = torch.from_numpy(self.offsets).to(device)
        return found

    def __repr__(self) -> str:
        return f"LayerReader(layer {self.layer_id}, {self.tier}, in_place={self.in_place})"


_READERS: dict[tuple[str, int], LayerReader] = {}


def reader_for(settings: EngineSettings, table: EngramStore, config: V41Config, layer_id: int) -> LayerReader:
    """The process's one reader of layer ``layer_id`` of ``settings.tables`` (the modules of every rank of this
    process share it, and with it the mapping's registration)."""
    key = (settings.tables, int(layer_id))
    found = _READERS.get(key)
    if found is None or found.table is not table or found.settings != settings:
        found = _READERS[key] = LayerReader(settings, table, config, layer_id)
    return found
