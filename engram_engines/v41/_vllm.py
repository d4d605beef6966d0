"""vLLM 0.33.0's DeepSeek-V4.1 served from engram tables: the patches of ``vllm.models.deepseek_v41.common.engram``.

Applied when vLLM imports that module, in every process, if ``ENGRAM_TABLES`` is set:

* ``Engram.__init__`` keeps the text config at hand while the layer is built; ``Engram._create_embedding`` builds
  :class:`EngramTableEmbedding` instead of ``ParallelEngramEmbedding``. The refusals are raised there, at start.
  It holds no table (neither on the GPU nor in host memory: empty buffers, no parameters to load), keeps vLLM's
  tensor-parallel head shard (``head_start``, ``part_n_hash_cols``: the same arithmetic), and reads every DP
  replica's own tokens (``dp_size`` 1: the tables are the host's, so no DP exchange and no raw-pointer peer path).
* Its ``lookup`` reads a ``local_dir`` in place (engram's Triton kernel over the registered mapping, on vLLM's own
  prefetch stream, as its ``cpu_offload`` lookup; CUDA graphs capture it) or, on the host path, is served by
  ``Engram.prepare_embeddings`` / ``Engram._ready_rows``, replaced for such layers by :class:`HostSteps` behind
  vLLM's own ``eager_break_during_capture``: piecewise (breakable) CUDA graphs break there. FULL graphs cannot run
  host work between layers, so the host path refuses a ``cudagraph_mode`` with FULL graphs at start.
* ``weight_utils.should_skip_weight`` also skips the checkpoint's ``engram.embed.weight`` / ``embed.scale``, before
  the loader reads them (about 200 GB that the tables hold already).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

from .._imports import when_imported
from .._settings import DEVICE_READ, TABLES, ServingRefused, enabled, refused, settings_from_env
from ._layout import check_engine_layout, check_split, config_of, is_table_weight, open_layer
from ._reader import LayerReader, interpreted, reader_for
from ._steps import HostSteps, ModelLayer

log = logging.getLogger(__name__)

MODULE = "vllm.models.deepseek_v41.common.engram"

_building = threading.local()  # the text config of the Engram layer being built


def install() -> None:
    """Patch vLLM's V4.1 Engram classes once its module is imported (now, if it is)."""
    when_imported(MODULE, patch)


def patch(E: Any) -> None:
    if getattr(E.Engram, "_engram_tables", False):
        return
    Embedding = embedding_class(E)
    original = {name: getattr(E.Engram, name) for name in ("__init__", "_create_embedding", "_init_staging",
                                                           "prepare_embeddings", "_ready_rows")}
    break_eagerly = E.eager_break_during_capture

    def __init__(self, config, *args, **kwargs):
        _building.config = config
        try:
            original["__init__"](self, config, *args, **kwargs)
        finally:
            _building.config = None

    def _create_embedding(self, layout, layer_hash_index):
        if not enabled():  # ENGRAM_TABLES unset where this model is built: vLLM's own tables
            return original["_create_embedding"](self, layout, layer_hash_index)
        return _table_embedding(E, Embedding, layout, layer_hash_index)

    def _init_staging(self, max_tokens, head_dim):
        original["_init_staging"](self, max_tokens, head_dim)
        if isinstance(self.embed_tokens, Embedding) and self.embed_tokens.steps is not None:
            embed = self.embed_tokens
            embed.steps.add(ModelLayer(self.layer_hash_index, embed.reader, embed.head_start, embed.part_n_hash_cols,
                                       self.staged_rows))

    @break_eagerly
    def _host_prepare(steps, index, hash_ids):
        steps.prepare(index, hash_ids)

    @break_eagerly
    def _host_finish(steps, index):
        steps.finish(index)

    def prepare_embeddings(self, hash_ids):
        steps = getattr(self.embed_tokens, "steps", None)
        if steps is None:
            return original["prepare_embeddings"](self, hash_ids)
        assert hash_ids.shape[0] <= self.staged_rows.shape[0], "engram staging buffer too small"
        _host_prepare(steps, self.layer_hash_index, hash_ids)

    def _ready_rows(self, num_tokens):
        steps = getattr(self.embed_tokens, "steps", None)
        if steps is None:
            return original["_ready_rows"](self, num_tokens)
        _host_finish(steps, self.layer_hash_index)
        return self.staged_rows[:num_tokens]

    for name, fn in (("__init__", __init__), ("_create_embedding", _create_embedding),
                     ("_init_staging", _init_staging), ("prepare_embeddings", prepare_embeddings),
                     ("_ready_rows", _ready_rows)):
        setattr(E.Engram, name, fn)
    E.Engram._engram_tables = True
    E.EngramTableEmbedding = Embedding


def embedding_class(E: Any) -> type:
    """:class:`EngramTableEmbedding` over vLLM's ``ParallelEngramEmbedding`` (module ``E``)."""
    import torch
    from torch import nn

    class EngramTableEmbedding(E.ParallelEngramEmbedding):
        """vLLM's ``ParallelEngramEmbedding`` with its rows in an engram table (see the module docstring)."""

        def __init__(self, num_embeddings: int, dim: int, head_sizes: tuple[int, ...], reader: LayerReader,
                     block_size: int = 32, device_read: str = "auto"):
            nn.Module.__init__(self)
            self.reader, self.steps = reader, None
            self.num_embeddings, self.dim, self.block_size = num_embeddings, dim, block_size
            self.n_hash_cols = len(head_sizes)
            self.dp_size, self.peer_rows = 1, 0  # each DP replica reads its own tokens from the host's tables
            self.tp_size = E.get_tensor_model_parallel_world_size()
            # vLLM's split of the hash heads over the TP ranks (ParallelEngramEmbedding.__init__).
            self.part_n_hash_cols = -(-self.n_hash_cols // self.tp_size)
            self.head_start = E.get_tensor_model_parallel_rank() * self.part_n_hash_cols
            head_end = self.head_start + self.part_n_hash_cols
            self.vocab_start_idx = sum(head_sizes[:self.head_start])
            self.vocab_end_idx = sum(head_sizes[:head_end])
            self.part_num_embeddings = self.vocab_end_idx - self.vocab_start_idx
            # Where vLLM's cpu_offload lookup runs (a prefetch stream) the in-place kernel runs too.
            self.cpu_offload = reader.in_place and torch.cuda.is_available()
            self.dp_shared_memory, self.use_thp = False, False
            self._shared_memory = self._packed = None
            self.register_buffer("weight", torch.empty(0, dim, dtype=torch.float8_e4m3fn), persistent=False)
            self.register_buffer("weight_scale_inv", torch.empty(0, dim // block_size, dtype=torch.uint8),
                                 persistent=False)

        def _allocate_weights(self):
            scale_dim = self.dim // self.block_size
            return (torch.empty(0, self.dim, dtype=torch.float8_e4m3fn), torch.empty(0, scale_dim, dtype=torch.uint8))

        def _storage(self):
            raise ServingRefused(f"{TABLES}: layer {self.reader.layer_id}'s rows are in an engram table; vLLM's "
                                 "raw-pointer paths (EngramBatch, EngramPeerExchange) cannot read it")

        def collapse_huge_pages(self) -> None:
            pass

        def lookup(self, indices, out, background: bool = False) -> None:
            if not indices.shape[0] * self.part_n_hash_cols:
                return
            if self.reader.in_place and (out.is_cuda or interpreted()):
                self.reader.lookup_in_place(indices, out, head_start=self.head_start,
                                            vocab_start=self.vocab_start_idx, vocab_end=self.vocab_end_idx)
            elif out.device.type == "cpu":
                self.reader.gather(indices, out, head_start=self.head_start)
            else:  # the device, one layer at a time (host path outside prepare_embeddings)
                staged = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
                self.reader.gather(indices.cpu(), staged, head_start=self.head_start)
                out.copy_(staged, non_blocking=True)

    return EngramTableEmbedding


def _table_embedding(E: Any, Embedding: type, layout: Any, index: int) -> Any:
    """The layer's EngramTableEmbedding, after every check of the start (raising :class:`ServingRefused`)."""
    settings = settings_from_env()
    vllm_config = E.get_current_vllm_config()
    source = f"config.json of {_model_name(vllm_config)}"
    hf_config = getattr(_building, "config", None)
    if hf_config is None:
        hf_config = vllm_config.model_config.hf_text_config
    config = config_of(hf_config, source)
    layer_id = layout.layer_ids[index]
    table = open_layer(settings, config, layer_id, source)
    head_sizes = tuple(size for order in layout.primes[index] for size in order)
    check_engine_layout(config, layer_id, head_sizes, layout.num_embeddings[index], f"vLLM's EngramLayout ({source})")
    reader = reader_for(settings, table, config, layer_id)
    embed = Embedding(layout.num_embeddings[index], layout.head_dim, head_sizes, reader)
    check_split(config, layer_id, embed.head_start, embed.part_n_hash_cols, embed.tp_size, settings)
    reader.prepare_device()
    if not reader.in_place:
        _refuse_full_graphs(vllm_config, settings, table)
        embed.steps = _model_steps(layout)
    log.info("engram: layer %d from %s (%s, %s), columns %d..%d of %d", layer_id, settings.tables, reader.tier,
             "read in place" if reader.in_place else "gathered on the host", embed.head_start,
             embed.head_start + embed.part_n_hash_cols - 1, config.cols)
    _skip_table_weights(config.layer_ids)
    return embed




def _model_steps(layout: Any) -> HostSteps:
    """The host path shared by the Engram layers of the model that ``layout`` belongs to."""
    steps = getattr(layout, "_engram_steps", None)
    if steps is None:
        steps = HostSteps(len(layout.layer_ids), "engram-vllm-steps")
        layout._engram_steps = steps
    return steps


def _refuse_full_graphs(vllm_config: Any, settings: Any, table: Any) -> None:
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    if mode is not None and mode.has_full_cudagraphs():
        raise refused(TABLES, settings.tables,
                      f"a {'disk_dir' if table.disk_dir else 'table read on the host'} ({DEVICE_READ}="
                      f"{settings.device_read}) is gathered by the host between decoder layers, which a FULL CUDA "
                      f"graph cannot do (cudagraph_mode={mode}); start vLLM with --compilation-config "
                      "'{\"cudagraph_mode\": \"PIECEWISE\"}' (breakable graphs break at the Engram lookup), or load "
                      "the tables with engram-load-v41 --local-dir for the GPU to read in place")


def _model_name(vllm_config: Any) -> str:
    model_config = getattr(vllm_config, "model_config", None)
    return getattr(model_config, "model", None) or "the model"


def _skip_table_weights(layer_ids: Any) -> None:
    """Make vLLM's weight iterators skip the checkpoint's Engram tables before reading them."""
    with contextlib.suppress(ImportError):
        import vllm.model_executor.model_loader.weight_utils as W

        if getattr(W.should_skip_weight, "_engram_tables", False):
            return
        original = W.should_skip_weight
        layers = {int(lid) for lid in layer_ids}

        def should_skip_weight(name, *args, **kwargs):
            return is_table_weight(name, layers) or original(name, *args, **kwargs)

        should_skip_weight._engram_tables = True
        W.should_skip_weight = should_skip_weight
