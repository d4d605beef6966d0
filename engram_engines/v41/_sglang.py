"""SGLang 0.5.23's DeepSeek-V4.1 served from engram tables: hooks on ``sglang.srt.layers.engram`` and its staging.

Registered with SGLang's own ``HookRegistry`` (the plugin loader applies them in every process) if
``ENGRAM_TABLES`` is set:

* ``EngramEmbedding.__init__``: no table (neither the fp8 table on the GPU nor the host table: empty parameters
  whose loader does nothing), the layer's reader instead; the refusals are raised here, at start. Every rank holds
  every row through engram, so a rank reads its own tokens: no row shard, no all-reduce, no CP or DP gather.
* ``EngramEmbedding.forward`` (decode, target-verify, CP prefill, DP attention, and extends the scheduler did not
  stage): a ``local_dir`` is read in place by engram's Triton kernel over the registered mapping (CUDA graphs
  capture it, the full decode graph included); otherwise the host path (:class:`HostSteps`: the step's ids to the
  host once for both layers, layer 14's rows gathered while layers 1-13 run) behind SGLang's ``eager_on_graph``,
  which breaks a breakable graph; a full decode graph cannot run host work, so the host path refuses
  ``--cuda-graph-backend-decode full`` at start.
* ``EngramRowStager.from_model``: SGLang's own staging of extend batches (``stage()``: its windows, its hash, the
  copies on its side stream) with the rows gathered by engram (:class:`EngramTableStager`), for every table
  kind, without ``SGLANG_OPT_DSV41_ENGRAM_HOST_STAGING`` or a host table. Under prefill context parallelism SGLang
  stages nothing (its windows would be the whole prompt's); the forward reads each rank's rows.
* The checkpoint's ``engram.embed.weight`` / ``embed.scale`` are skipped before they are read (the weight
  iterators' ``safe_open`` lists them no more), and ``/metrics`` includes engram's collector.
"""

from __future__ import annotations

import logging
import threading
import types
from typing import Any

from .._settings import DEVICE_READ, TABLES, ServingRefused, enabled, refused, settings_from_env
from ._layout import config_of, is_table_weight, open_layer
from ._reader import LayerReader, interpreted, reader_for
from ._steps import HostSteps, ModelLayer

log = logging.getLogger(__name__)

ENGRAM = "sglang.srt.layers.engram"
STAGING = "sglang.srt.layers.engram_staging"
WEIGHTS = "sglang.srt.model_loader.weight_utils"


def install() -> None:
    """Register the hooks with SGLang's HookRegistry (its loader applies them after the plugins ran)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{ENGRAM}.Engram.__init__", _engram_init, HookType.AROUND)
    HookRegistry.register(f"{ENGRAM}.EngramEmbedding.__init__", _init, HookType.AROUND)
    HookRegistry.register(f"{ENGRAM}.EngramEmbedding.forward", _forward, HookType.AROUND)
    HookRegistry.register(f"{STAGING}.EngramRowStager.from_model", _from_model, HookType.AROUND)


# ---- EngramEmbedding ---------------------------------------------------------------------------------------------

_building = threading.local()  # the text config of the Engram layer being built


def _engram_init(original, self, config, *args, **kwargs):
    """``Engram.__init__``: keep the text config at hand while its EngramEmbedding is built."""
    _building.config = config
    try:
        return original(self, config, *args, **kwargs)
    finally:
        _building.config = None


def _text_config() -> Any:
    config = getattr(_building, "config", None)
    if config is None:
        raise ServingRefused(f"{TABLES}: an EngramEmbedding was built outside an Engram layer; the plugin reads the "
                             "layout from the Engram layer's config")
    return config


def _model_path() -> str:
    try:
        from sglang.srt.runtime_context import get_model

        return str(get_model().model_path)
    except Exception:  # no published runtime context (a module built alone)
        return "the model"


def _init(original, self, num_embeddings: int, dim: int, layer_id: int, column_bounds: tuple[int, ...]):
    if not enabled():
        return original(self, num_embeddings, dim, layer_id, column_bounds)
    import torch
    from torch import nn

    from sglang.srt.runtime_context import get_parallel

    settings = settings_from_env()
    nn.Module.__init__(self)
    source = f"config.json of {_model_path()}"
    config = config_of(_text_config(), source)
    table = open_layer(settings, config, layer_id, source)
    if tuple(column_bounds) != tuple(int(x) for x in [*config.offsets(layer_id), config.num_embeddings(layer_id)]):
        raise ServingRefused(f"{source}: SGLang lays layer {layer_id} out with column bounds {list(column_bounds)[:4]}"
                             f"..., engram with {config.offsets(layer_id)[:4].tolist()}...: another prime search")
    self.dim, self.tp_size = dim, get_parallel().tp_size
    self.row_start, self.rows = 0, num_embeddings  # every row, through engram, on every rank
    self.host_table, self.peer, self._sort_host_reads, self.staged_by_scheduler = None, None, False, False
    self.weight = nn.Parameter(torch.empty(0, dim, dtype=torch.float8_e4m3fn), requires_grad=False)
    self.scale = nn.Parameter(torch.empty(0, dim // 32, dtype=torch.float8_e8m0fnu), requires_grad=False)
    self.weight.weight_loader = self.scale.weight_loader = _skip_rows
    self.engram_reader = reader_for(settings, table, config, layer_id)
    self.engram_index = config.layer_index(layer_id)
    self.engram_steps = None
    self.engram_reader.prepare_device()
    if not self.engram_reader.in_place:
        _refuse_full_decode_graphs(settings, table)
        self.engram_steps = _steps(settings, config, self.engram_reader)
    _skip_table_weights(config.layer_ids)
    log.info("engram: layer %d from %s (%s, %s)", layer_id, settings.tables, self.engram_reader.tier,
             "read in place" if self.engram_reader.in_place else "gathered on the host")


def _skip_rows(param, loaded_weight) -> None:
    """The checkpoint's table rows are engram's: nothing to load (they are skipped before being read)."""


def _forward(original, self, indices, forward_batch=None, *, cp_all_tokens: bool = False):
    reader = getattr(self, "engram_reader", None)
    if reader is None:
        return original(self, indices, forward_batch, cp_all_tokens=cp_all_tokens)
    out = self.new_rows(indices)
    if indices.shape[0] == 0:
        return out
    flat = indices.reshape(-1, indices.shape[-1])
    if reader.in_place and (out.is_cuda or interpreted()):
        reader.lookup_in_place(flat, out.view(flat.shape[0], flat.shape[1], self.dim), head_start=0,
                               vocab_start=0, vocab_end=reader.config.num_embeddings(reader.layer_id))
    elif out.device.type == "cpu" and self.engram_steps is None:
        reader.gather(flat, out.view(flat.shape[0], flat.shape[1], self.dim))
    else:
        _host_rows(self, flat, out.view(flat.shape[0], flat.shape[1], self.dim))
    return out


def _host_rows_body(self, ids, out) -> None:
    """The host path of one layer's forward: the first Engram layer of a step starts every layer's gathers."""
    steps = self.engram_steps
    steps.ensure(ids.shape[0], out)
    steps.prepare(self.engram_index, ids)
    steps.finish(self.engram_index)
    out.copy_(steps.layers[self.engram_index].rows[:ids.shape[0]])


def _host_rows(self, ids, out) -> None:
    """:func:`_host_rows_body` behind SGLang's ``eager_on_graph``: a breakable graph breaks here (a module-level
    function, wrapped on first use: SGLang's graph code is imported by then)."""
    global _HOST_ROWS
    if _HOST_ROWS is None:
        from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph import (
            eager_on_graph)

        _HOST_ROWS = eager_on_graph(_host_rows_body)
    _HOST_ROWS(self, ids, out)


_HOST_ROWS = None


# ---- the host path of one model ----------------------------------------------------------------------------------


class SglangSteps(HostSteps):
    """:class:`HostSteps` for SGLang, whose layers look their rows up in their own forward: buffers of their own
    that grow with the largest step seen (a breakable graph's output buffer is copied into from them)."""

    def __init__(self, n_layers: int):
        super().__init__(n_layers, "engram-sglang-steps")
        self.readers: dict[int, LayerReader] = {}

    def ensure(self, tokens: int, like: Any) -> None:
        """Buffers for ``tokens`` rows of every layer, on ``like``'s device."""
        import torch

        first = self.layers.get(min(self.readers))
        if first is not None and first.rows.shape[0] >= tokens and first.rows.device == like.device:
            return
        capacity = max(256, 1 << (max(tokens, 1) - 1).bit_length())
        for index, reader in self.readers.items():
            cols, dim = reader.config.cols, reader.config.head_dim
            self.add(ModelLayer(index, reader, 0, cols,
                                torch.empty((capacity, cols, dim), dtype=torch.bfloat16, device=like.device)))


_STEPS: dict[str, SglangSteps] = {}


def _steps(settings, config, reader: LayerReader) -> SglangSteps:
    """The host path of the model whose tables are ``settings.tables`` (one model per process)."""
    found = _STEPS.get(settings.tables)
    if found is None or found.n_layers != len(config.layer_ids):
        found = _STEPS[settings.tables] = SglangSteps(len(config.layer_ids))
    found.readers[config.layer_index(reader.layer_id)] = reader
    found.layers.clear()  # rebuilt with every reader on the next step
    return found


# ---- start-up checks and the loader --------------------------------------------------------------------------------


def _refuse_full_decode_graphs(settings, table) -> None:
    """The host path runs between decoder layers: a full decode CUDA graph cannot (a breakable one breaks there)."""
    try:
        from sglang.srt.runtime_context import get_exec

        backend = get_exec().graph.cuda_graph_config.decode.backend
    except Exception:  # no published runtime context: nothing to check against
        return
    if backend == "full":
        raise refused(TABLES, settings.tables,
                      f"a {'disk_dir' if table.disk_dir else 'table read on the host'} ({DEVICE_READ}="
                      f"{settings.device_read}) is gathered by the host between decoder layers, which a full decode "
                      "CUDA graph cannot do; start SGLang with --cuda-graph-backend-decode breakable (the graph "
                      "breaks at the Engram lookup) or disabled, or load the tables with engram-load-v41 "
                      "--local-dir for the GPU to read in place")


def _skip_table_weights(layer_ids) -> None:
    """SGLang's safetensors iterators list every tensor of a shard with ``safe_open(...).keys()`` and read each
    one they list: their ``safe_open`` lists the Engram tables of these layers no more."""
    import importlib

    weights = importlib.import_module(WEIGHTS)
    if isinstance(weights.safetensors, _Safetensors):
        weights.safetensors.layers |= {int(lid) for lid in layer_ids}
        return
    weights.safetensors = _Safetensors(weights.safetensors, {int(lid) for lid in layer_ids})


class _Safetensors(types.ModuleType):
    """The ``safetensors`` module as SGLang's weight iterators see it, its ``safe_open`` without the tables."""

    def __init__(self, real: types.ModuleType, layers: set[int]):
        super().__init__(real.__name__)
        self.__dict__.update({k: v for k, v in vars(real).items() if k not in ("__name__", "safe_open")})
        self.real, self.layers = real, layers

    def safe_open(self, *args, **kwargs):
        return _Shard(self.real.safe_open(*args, **kwargs), self.layers)


class _Shard:
    def __init__(self, handle, layers: set[int]):
        self.handle, self.layers = handle, layers

    def __enter__(self):
        self.handle = self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return [k for k in self.handle.keys() if not is_table_weight(k, self.layers)]

    def __getattr__(self, name):
        return getattr(self.handle, name)


# ---- extend batches: SGLang's staging, the rows from engram -----------------------------------------------------


def _from_model(original, cls, model, hasher, device):
    """``EngramRowStager.from_model``: a stager reading engram tables where the model's Engram layers are ours."""
    from sglang.srt.layers.engram import Engram
    from sglang.srt.runtime_context import get_parallel

    engrams = sorted((m for m in model.modules() if isinstance(m, Engram)), key=lambda m: m.layer_hash_index)
    ours = [getattr(m.embed, "engram_reader", None) for m in engrams]
    if not engrams or not all(ours):
        return original(cls, model, hasher, device)
    if _attn_cp_size(get_parallel()) > 1:
        return None  # prefill CP: the forward reads each rank's rows (SGLang stages nothing under CP either)
    for m in engrams:
        m.embed.staged_by_scheduler = True
    return _stager_class()(hasher, ours, device)


def _attn_cp_size(parallel) -> int:
    try:
        return int(parallel.attn_cp_size)
    except (ValueError, RuntimeError):  # no published parallel config (a model built alone): no CP
        return 1


_STAGER = None


def _stager_class() -> type:
    """:class:`EngramTableStager` over SGLang's ``EngramRowStager`` (defined once SGLang is imported)."""
    global _STAGER
    if _STAGER is not None:
        return _STAGER
    import torch

    from sglang.srt.layers.engram_staging import EngramRowStager

    class EngramTableStager(EngramRowStager):
        """SGLang's extend-batch staging (its ``stage()`` runs unchanged) with each layer's codes and scale bytes
        gathered by engram (the split form: SGLang's ``_gather`` of its weight and scale tables, bit for bit)."""

        def __init__(self, hasher, readers: list[LayerReader], device):
            # Not EngramRowStager.__init__: there is no host table to view and no index_select pool.
            self.hasher, self.readers, self.device = hasher, readers, device
            self.tables = [((i, "codes"), (i, "scales")) for i in range(len(readers))]  # what stage() passes _gather
            self.copy_stream = torch.cuda.Stream(device) if torch.device(device).type == "cuda" else None
            self._scales: dict[int, Any] = {}

        def _gather(self, table, ids):
            layer, part = table
            if part == "scales":  # stage() asks for the scales right after the codes of the same layer
                return self._scales.pop(layer)
            pinned = torch.cuda.is_available()
            reader = self.readers[layer]
            nblk = reader.config.head_dim // 32
            codes = torch.empty((ids.numel(), reader.config.head_dim), dtype=torch.uint8, pin_memory=pinned)
            scales = torch.empty((ids.numel(), nblk), dtype=torch.uint8, pin_memory=pinned)
            reader.gather(ids.reshape(-1), codes, scales_out=scales)
            self._scales[layer] = scales
            return codes

    _STAGER = EngramTableStager
    return _STAGER
