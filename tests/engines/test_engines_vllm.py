"""vLLM 0.33.0's own DeepSeek-V4.1 Engram code serving from engram tables, on the CPU.

``Engram.prepare_embeddings`` (and ``_ready_rows``, where the layer reads the rows) of a layer built by vLLM with
the plugin gives the rows of the same layer built by vLLM without it, reading its own table filled from the same
toy checkpoint by its own weight loader: bit for bit, for prefill and decode steps, for every tensor-parallel
rank, from a ``local_dir`` read in place (engram's Triton kernel, in Triton's interpreter) and from a ``disk_dir``
and a ``local_dir`` gathered on the host (the step pipeline, the packed rows decoded by the kernel). Stubbed:
only what needs a GPU (the device's multiprocessor count of vLLM's own constructor).
"""
from __future__ import annotations

import socket
import types
from unittest import mock

import numpy as np
import pytest
from engines_helpers import (CONFIG, bits, checkpoint_tensors, hash_ids, load_tables, require, run_script,
                             text_config, write_checkpoint, entry_points_dist)

vllm = require("vllm", "vllm")
torch = pytest.importorskip("torch")
E = pytest.importorskip("vllm.models.deepseek_v41.common.engram")

from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.config.engram import EngramConfig  # noqa: E402

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def distributed():
    """vLLM's process groups for one rank on gloo (what Engram's projection asks of them)."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if not model_parallel_is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with set_current_vllm_config(_vllm_config()):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            initialize_model_parallel(1, 1)
    yield




@pytest.fixture(scope="module")
def plugin(distributed):
    """The plugin's patches, as vLLM's loader applies them (register() with ENGRAM_TABLES set)."""
    from engram_engines import vllm as plugin_module

    with mock.patch.dict("os.environ", {"ENGRAM_TABLES": "/"}):
        plugin_module.register()
    assert E.Engram._engram_tables
    return plugin_module


def _vllm_config(cudagraph_mode=None) -> VllmConfig:
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    config.engram_config = EngramConfig(cpu_offload=False)
    if cudagraph_mode is not None:
        config.compilation_config.cudagraph_mode = cudagraph_mode
    return config


def _hf_config(checkpoint):
    from transformers import PretrainedConfig

    return PretrainedConfig(**text_config(checkpoint))


def _model(checkpoint, tp: tuple[int, int], tables: str | None, device_read: str = "auto", cudagraph_mode=None):
    """Both Engram modules of a model, sharing its layout as vLLM's model does."""
    layout = E.EngramLayout(_hf_config(checkpoint))
    return [_build(checkpoint, i, tp, tables, device_read, cudagraph_mode, layout) for i in range(2)]


def _build(checkpoint, index: int, tp: tuple[int, int], tables: str | None, device_read: str = "auto",
           cudagraph_mode=None, layout=None):
    """vLLM's Engram module of layer ``index`` on TP rank ``tp[1]`` of ``tp[0]``, with ENGRAM_TABLES=tables (None:
    vLLM's own table, filled from the checkpoint by its weight loader)."""
    hf = _hf_config(checkpoint)
    layout = E.EngramLayout(hf) if layout is None else layout
    env = {"ENGRAM_DEVICE_READ": device_read}
    if tables is not None:
        env["ENGRAM_TABLES"] = str(tables)
    props = types.SimpleNamespace(multi_processor_count=8)
    with mock.patch.dict("os.environ", env), mock.patch.object(E, "get_tensor_model_parallel_world_size",
                                                               lambda: tp[0]), \
            mock.patch.object(E, "get_tensor_model_parallel_rank", lambda: tp[1]), \
            mock.patch.object(torch.cuda, "get_device_properties", lambda index: props), \
            mock.patch.object(torch.accelerator, "current_device_index", lambda: 0), \
            set_current_vllm_config(_vllm_config(cudagraph_mode)):
        if tables is None:
            import os
            os.environ.pop("ENGRAM_TABLES", None)
        engram = E.Engram(hf, None, layout, index, False, f"model.layers.{layout.layer_ids[index]}.engram")
    if tables is None:
        codes, scales = checkpoint_tensors(checkpoint, layout.layer_ids[index])
        embed = engram.embed_tokens
        embed.weight.weight_loader(embed.weight, torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn))
        embed.weight_scale_inv.weight_loader(embed.weight_scale_inv,
                                             torch.from_numpy(scales.copy()).view(torch.float8_e8m0fnu))
    return engram


def _rows(engrams: list, hashes: np.ndarray) -> list:
    """Each module's rows of one step, through vLLM's own calls: prepare_embeddings for every layer (before the
    decoder layers, as the model does), then _ready_rows where each layer reads them."""
    ids = torch.from_numpy(hashes)
    for engram in engrams:
        engram.prepare_embeddings(ids[:, engram.layer_hash_index])
    return [engram._ready_rows(hashes.shape[0]).clone() for engram in engrams]


SPLITS = [(1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]


@pytest.mark.parametrize("where, device_read", [("local", "auto"), ("local", "host"), ("disk", "auto")])
def test_prepare_embeddings_gives_the_rows_of_vllms_own_table_for_every_tp_rank(plugin, toy, where, device_read):
    tables = getattr(toy, where)
    steps = {"prefill": hash_ids(CONFIG, 37, seed=1, dead_rows=3), "decode": hash_ids(CONFIG, 4, seed=2)}
    for tp in SPLITS:
        theirs, ours = _model(toy.checkpoint, tp, None), _model(toy.checkpoint, tp, tables, device_read)
        assert all(type(e.embed_tokens).__name__ == "EngramTableEmbedding" for e in ours)
        for a, b in zip(theirs, ours):  # the same head shard, and no table in ours
            assert (a.embed_tokens.head_start, a.embed_tokens.part_n_hash_cols) == \
                (b.embed_tokens.head_start, b.embed_tokens.part_n_hash_cols)
            assert b.embed_tokens.weight.numel() == 0 and not list(b.embed_tokens.parameters())
        for step, hashes in steps.items():
            expected, got = _rows(theirs, hashes), _rows(ours, hashes)
            for layer, (x, y) in enumerate(zip(expected, got)):
                assert torch.equal(bits(x), bits(y)), f"{where} {device_read} tp {tp} {step} layer {layer}"
            assert bits(expected[0]).any()  # rows, not zeros on both sides


def test_the_host_path_copies_a_steps_ids_once_for_every_layer(plugin, toy):
    ours = _model(toy.checkpoint, (1, 0), toy.disk)
    steps = ours[0].embed_tokens.steps
    assert steps is ours[1].embed_tokens.steps  # one pipeline for the model's layers
    copies = []
    hashes = hash_ids(CONFIG, 5, seed=3)
    _rows(ours, hashes)  # sets up the buffers
    original = steps._copies.ids_to_host
    with mock.patch.object(steps._copies, "ids_to_host", lambda src, dst: (copies.append(tuple(src.shape)),
                                                                          original(src, dst))):
        _rows(ours, hash_ids(CONFIG, 6, seed=4))
    assert copies == [(6, 2, CONFIG.cols)]


def test_vllms_raw_pointer_paths_are_refused_by_name_not_read_out_of_bounds(plugin, toy):
    from engram_engines import ServingRefused

    embed = _build(toy.checkpoint, 0, (1, 0), toy.local).embed_tokens
    assert embed.dp_size == 1 and E.EngramBatch.create([_build(toy.checkpoint, 0, (1, 0), toy.local)], 16) is None
    with pytest.raises(ServingRefused, match="EngramBatch, EngramPeerExchange"):
        embed._storage()


def test_without_engram_tables_vllm_builds_its_own_tables(plugin, toy):
    engram = _build(toy.checkpoint, 0, (1, 0), None)
    assert type(engram.embed_tokens) is E.ParallelEngramEmbedding
    assert engram.embed_tokens.weight.shape[0] == CONFIG.num_embeddings(1)


def test_the_loader_skips_the_checkpoints_engram_tables(plugin, toy):
    import vllm.model_executor.model_loader.weight_utils as W

    _build(toy.checkpoint, 0, (1, 0), toy.local)
    assert W.should_skip_weight("layers.1.engram.embed.weight", None)
    assert W.should_skip_weight("model.layers.14.engram.embed.scale", None)
    assert not W.should_skip_weight("layers.1.engram.wkv.weight", None)
    assert not W.should_skip_weight("layers.2.engram.embed.weight", None)  # not an Engram layer of the model


@pytest.mark.parametrize("case", ["unparsable", "missing layer", "other layout", "full graphs"])
def test_a_configuration_the_tables_cannot_serve_is_refused_where_vllm_builds_the_layer(plugin, toy, tmp_path,
                                                                                         case):
    from vllm.config.compilation import CUDAGraphMode

    from engram_engines import ServingRefused
    from engram_model.v41 import V41Config

    kwargs, tables, match = {}, toy.local, ""
    if case == "unparsable":
        kwargs, match = {"device_read": "gpu"}, r"ENGRAM_DEVICE_READ=gpu: expected one of auto, host"
    elif case == "missing layer":
        tables = tmp_path / "one-layer"
        from engram_model.v41 import load_v41_table
        load_v41_table(str(toy.checkpoint), CONFIG, 1, local_dir=tables).close()
        match = r"ENGRAM_TABLES=.*one-layer: config.json .* names Engram layers \[1, 14\].* \(missing \[14\]\)"
    elif case == "other layout":
        other = V41Config(layer_ids=[1, 14], n_heads=3, head_dim=64, engram_vocab_size=500,
                          compressed_vocab_size=100, hidden_size=64)
        tables = tmp_path / "other"
        checkpoint = write_checkpoint(tmp_path / "other-checkpoint", other)
        load_tables(checkpoint, other, local_dir=tables)
        match = r"ENGRAM_TABLES=.*other: layer 1 disagrees with config.json"
    else:
        tables, kwargs = toy.disk, {"cudagraph_mode": CUDAGraphMode.FULL_AND_PIECEWISE}
        match = r"ENGRAM_TABLES=.*disk: .* FULL CUDA graph .*cudagraph_mode"
    with pytest.raises(ServingRefused, match=match):
        _build(toy.checkpoint, 0, (1, 0), tables, **kwargs)


def test_the_plugin_loads_through_vllms_own_loader_and_does_nothing_without_engram_tables(toy, tmp_path):
    site = entry_points_dist(tmp_path / "site")
    script = f"""
import sys
sys.path.insert(0, {str(site)!r})
import vllm.plugins as P
import vllm.models.deepseek_v41.common.engram as E
before = dict(vars(E.Engram))
P.load_general_plugins()
import os
if os.environ.get("ENGRAM_TABLES"):
    assert E.Engram._engram_tables and "EngramTableEmbedding" in vars(E), "not patched"
    print("PATCHED", "ENGRAM_METRICS_DIR" in os.environ)
else:
    assert dict(vars(E.Engram)) == before and not hasattr(E, "EngramTableEmbedding"), "changed without tables"
    print("UNCHANGED")
"""
    assert "UNCHANGED" in run_script(script, {"ENGRAM_TABLES": ""})
    assert "PATCHED True" in run_script(script, {"ENGRAM_TABLES": str(toy.local)})


def test_the_registry_vllm_serves_metrics_from_has_engrams_collector(plugin):
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    from engram_engines import STATS
    from engram_engines._prometheus import EngramCollector

    registry = get_prometheus_registry()
    assert any(isinstance(c, EngramCollector) for c in registry._collector_to_names)
    STATS.record(14, "device", "local_dir", 24, 0.00002)
    from prometheus_client import generate_latest
    assert 'engram_gathers_total{form="device",layer="14",tier="local_dir"}' in generate_latest(registry).decode()
