"""SGLang 0.5.23's own DeepSeek-V4.1 Engram code serving from engram tables, on the CPU.

With the plugin's hooks applied by SGLang's own ``HookRegistry``: ``EngramEmbedding.forward`` of a layer built by
SGLang gives the rows of the same layer built without the plugin, reading its own table filled from the same toy
checkpoint by its own loader (every tensor-parallel rank's shard summed, as its all-reduce does), for extend and
decode batches, from a ``local_dir`` read in place (engram's Triton kernel, in Triton's interpreter) and from a
``disk_dir`` gathered on the host (one ids copy for both layers, the second layer behind the first); and SGLang's own
``EngramRowStager.stage`` of an extend batch stages the same bytes. Stubbed: only what needs a GPU (CUDA streams
and events, pinned allocations).
"""
from __future__ import annotations

import contextlib
import types
from unittest import mock

import numpy as np
import pytest
from engines_helpers import (CONFIG, TOKEN_MAP, bits, checkpoint_tensors, entry_points_dist, hash_ids, load_tables,
                             require, run_script, text_config, write_checkpoint)

sglang = require("sglang", "sglang")
torch = pytest.importorskip("torch")
SE = pytest.importorskip("sglang.srt.layers.engram")

from sglang.srt.layers import engram_staging as ST  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

pytestmark = pytest.mark.timeout(900)




@pytest.fixture(scope="module")
def plugin():
    """The plugin's hooks, registered by its entry function and applied by SGLang's own HookRegistry."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from engram_engines import sglang as plugin_module

    with mock.patch.dict("os.environ", {"ENGRAM_TABLES": "/"}):
        plugin_module.register()
    HookRegistry.apply_hooks()
    return plugin_module


def _hf_config(checkpoint):
    from transformers import PretrainedConfig

    return PretrainedConfig(**text_config(checkpoint))


def _engrams(checkpoint, tables=None, tp=(1, 0), device_read="auto"):
    """SGLang's Engram layers of the toy model on TP rank ``tp[1]`` of ``tp[0]`` (ENGRAM_TABLES=tables; None:
    SGLang's own tables, loaded by its own loader from the checkpoint)."""
    hf = _hf_config(checkpoint)
    layout = SE.EngramLayout.from_config(hf)
    env = {"ENGRAM_DEVICE_READ": device_read, "ENGRAM_TABLES": str(tables) if tables is not None else ""}
    with mock.patch.dict("os.environ", env), get_parallel().override(tp_size=tp[0], tp_rank=tp[1]):
        engrams = [SE.Engram(hf, lid, layout, prefix=f"model.layers.{lid}.engram") for lid in layout.layer_ids]
    if tables is None:
        for engram, lid in zip(engrams, layout.layer_ids):
            codes, scales = checkpoint_tensors(checkpoint, lid)
            embed = engram.embed
            embed.weight.weight_loader(embed.weight, torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn))
            embed.scale.weight_loader(embed.scale, torch.from_numpy(scales.copy()).view(torch.float8_e8m0fnu))
    return engrams


def _theirs(checkpoint, hashes, tp_size):
    """SGLang's own rows: each rank's shard of its table (zeros elsewhere), reassembled as its all-reduce does
    where it keeps every bit (integer addition: exactly one rank owns each row; a float sum would turn -0 to +0)."""
    total = None
    for rank in range(tp_size):
        engrams = _engrams(checkpoint, None, (tp_size, rank))
        with get_parallel().override(tp_size=tp_size, tp_rank=rank):
            rows = [bits(e.embed._owned_rows(torch.from_numpy(hashes[:, i]).long())) for i, e in enumerate(engrams)]
        total = rows if total is None else [a + b for a, b in zip(total, rows)]
    return [t.view(torch.bfloat16) for t in total]


def _ours(engrams, hashes, tp_size):
    ids = torch.from_numpy(hashes).long()
    with get_parallel().override(tp_size=tp_size, tp_rank=0):
        return [e.embed.forward(ids[:, i], None) for i, e in enumerate(engrams)]


@pytest.mark.parametrize("where, device_read", [("local", "auto"), ("disk", "auto"), ("local", "host")])
@pytest.mark.parametrize("tp_size", [1, 2, 3])
def test_embedding_forward_gives_the_rows_of_sglangs_own_table(plugin, toy, where, device_read, tp_size):
    steps = {"extend": hash_ids(CONFIG, 29, seed=5, dead_rows=0), "decode": _decode_ids(4)}
    ours = _engrams(toy.checkpoint, getattr(toy, where), (tp_size, 0), device_read)
    assert all(e.embed.weight.numel() == 0 and e.embed.scale.numel() == 0 for e in ours)  # no table of its own
    for step, hashes in steps.items():
        expected, got = _theirs(toy.checkpoint, hashes, tp_size), _ours(ours, hashes, tp_size)
        for layer, (x, y) in enumerate(zip(expected, got)):
            assert torch.equal(bits(x), bits(y)), f"{where} {device_read} tp {tp_size} {step} layer {layer}"


def _decode_ids(requests: int) -> np.ndarray:
    """A decode step's ids: one new token per request after a history, as SGLang's decode hash gives them."""
    from engram_model.v41 import V41Hasher

    hasher = V41Hasher(CONFIG, TOKEN_MAP)
    state = hasher.begin(requests)
    rng = np.random.default_rng(6)
    hasher.step(state, rng.integers(0, TOKEN_MAP.size, (requests, 7)))
    return np.ascontiguousarray(hasher.step(state, rng.integers(0, TOKEN_MAP.size, (requests, 1)))[:, 0])


def test_the_host_path_copies_a_steps_ids_once_for_both_layers(plugin, toy):
    ours = _engrams(toy.checkpoint, toy.disk)
    steps = ours[0].embed.engram_steps
    assert steps is ours[1].embed.engram_steps
    _ours(ours, _decode_ids(3), 1)  # buffers made
    copies, original = [], steps._copies.ids_to_host
    with mock.patch.object(steps._copies, "ids_to_host", lambda src, dst: (copies.append(tuple(src.shape)),
                                                                          original(src, dst))):
        _ours(ours, _decode_ids(5), 1)
    assert copies == [(5, 2, CONFIG.cols)]


class _Tokenizer:
    """A tokenizer whose ids decode to 100 distinct normalised texts (id % 100): SGLang builds the toy model's
    token map (TOKEN_MAP) from it, as it builds the release's from DeepSeek's tokenizer."""

    def __init__(self, size: int):
        self.size = size
        self.backend_tokenizer = types.SimpleNamespace(decode=lambda ids, skip_special_tokens=False: f"t{ids[0] % 100}",
                                                       id_to_token=lambda i: f"t{i}")

    def __len__(self) -> int:
        return self.size


@contextlib.contextmanager
def _no_gpu():
    """What SGLang's staging needs of a GPU, on the CPU: its side stream and events, and pinned allocations."""
    empty = torch.empty

    def cpu_empty(*args, pin_memory=False, **kwargs):
        return empty(*args, **kwargs)

    stream = types.SimpleNamespace(wait_stream=lambda other: None)
    with mock.patch.object(torch.cuda, "Stream", lambda *a, **k: stream), \
            mock.patch.object(torch.cuda, "stream", lambda s: contextlib.nullcontext()), \
            mock.patch.object(torch.cuda, "Event", lambda *a, **k: types.SimpleNamespace(record=lambda *x: None)), \
            mock.patch.object(torch, "empty", cpu_empty):
        yield


def _extend_batch(rng, lengths, prefixes):
    reqs = [types.SimpleNamespace(full_untruncated_fill_ids=rng.integers(0, TOKEN_MAP.size, p + n).tolist())
            for n, p in zip(lengths, prefixes)]
    return types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, encoder_swa_reset=None, reqs=reqs,
                                 prefix_lens=list(prefixes), extend_lens=list(lengths))


@pytest.mark.parametrize("where", ["local", "disk"])
def test_sglangs_stager_stages_the_bytes_of_its_own_host_table(plugin, toy, where):
    hf = _hf_config(toy.checkpoint)
    layout = SE.EngramLayout.from_config(hf)
    hasher = SE.EngramHasher(layout, _Tokenizer(TOKEN_MAP.size), hf.engram_pad_token_id,
                             hf.engram_compressed_vocab_size)
    theirs, ours = _engrams(toy.checkpoint), _engrams(toy.checkpoint, getattr(toy, where))
    batch = _extend_batch(np.random.default_rng(7), lengths=[5, 9, 1], prefixes=[0, 4, 2])
    with _no_gpu(), get_parallel().override(tp_size=1, tp_rank=0):
        stock = ST.EngramRowStager(hasher, [e.embed for e in theirs], torch.device("cpu"))
        stager = ST.EngramRowStager.from_model(torch.nn.ModuleList(ours), hasher, torch.device("cpu"))
        assert type(stager).__name__ == "EngramTableStager" and all(e.embed.staged_by_scheduler for e in ours)
        expected, got = stock.stage(batch), stager.stage(batch)
    assert len(expected) == len(got) == 2
    for (rows, scales, _), (our_rows, our_scales, _) in zip(expected, got):
        assert torch.equal(rows.view(torch.uint8), our_rows) and torch.equal(scales.view(torch.uint8), our_scales)
    assert stager.stage(types.SimpleNamespace(forward_mode=ForwardMode.DECODE)) is None  # decode: the forward's


def test_without_engram_tables_sglang_builds_its_own_tables(plugin, toy):
    engrams = _engrams(toy.checkpoint)
    assert not hasattr(engrams[0].embed, "engram_reader")
    assert engrams[0].embed.weight.shape[0] == CONFIG.num_embeddings(1)


def test_the_weight_iterators_never_list_the_checkpoints_engram_tables(plugin, toy):
    from sglang.srt.model_loader import weight_utils

    _engrams(toy.checkpoint, toy.local)
    names = [name for name, _ in weight_utils.safetensors_weights_iterator([str(toy.checkpoint /
                                                                               "model.safetensors")])]
    assert "layers.1.engram.wkv.weight" in names
    assert not [n for n in names if ".engram.embed." in n]


@pytest.mark.parametrize("case", ["unparsable", "missing layer", "other layout", "full decode graphs"])
def test_a_configuration_the_tables_cannot_serve_is_refused_where_sglang_builds_the_layer(plugin, toy, tmp_path,
                                                                                           case):
    from engram_engines import ServingRefused
    from engram_model.v41 import V41Config, load_v41_table

    tables, device_read, graphs = toy.local, "auto", contextlib.nullcontext()
    if case == "unparsable":
        device_read, match = "gpu", r"ENGRAM_DEVICE_READ=gpu: expected one of auto, host"
    elif case == "missing layer":
        tables = tmp_path / "one-layer"
        load_v41_table(str(toy.checkpoint), CONFIG, 14, local_dir=tables).close()
        match = r"ENGRAM_TABLES=.*one-layer: .* \(missing \[1\]\)"
    elif case == "other layout":
        other = V41Config(layer_ids=[1, 14], n_heads=3, head_dim=64, engram_vocab_size=500, compressed_vocab_size=100,
                          hidden_size=64)
        tables = tmp_path / "other"
        load_tables(write_checkpoint(tmp_path / "other-checkpoint", other), other, local_dir=tables)
        match = r"ENGRAM_TABLES=.*other: layer 1 disagrees with config.json"
    else:
        tables, match = toy.disk, r"ENGRAM_TABLES=.*disk: .*full decode CUDA graph.*--cuda-graph-backend-decode"
        decode = types.SimpleNamespace(backend="full")
        graphs = mock.patch("sglang.srt.runtime_context.get_exec", lambda: types.SimpleNamespace(
            graph=types.SimpleNamespace(cuda_graph_config=types.SimpleNamespace(decode=decode))))
    with graphs, pytest.raises(ServingRefused, match=match):
        _engrams(toy.checkpoint, tables, device_read=device_read)


def test_the_plugin_loads_through_sglangs_own_loader_and_does_nothing_without_engram_tables(toy, tmp_path):
    site = entry_points_dist(tmp_path / "site")
    script = f"""
import os, sys
sys.path.insert(0, {str(site)!r})
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
import sglang.srt.layers.engram as SE
before = id(SE.EngramEmbedding.__init__)  # an id: the registry rebinds every module global that held the function
load_plugins()
if os.environ.get("ENGRAM_TABLES"):
    assert id(SE.EngramEmbedding.__init__) != before, "not hooked"
    assert "sglang.srt.layers.engram.EngramEmbedding.forward" in HookRegistry._patched
    print("HOOKED", "ENGRAM_METRICS_DIR" in os.environ)
else:
    ours = [t for t, hooks in HookRegistry._hooks.items() if any(src and src.plugin_name == "engram" for *_, src in hooks)]
    assert id(SE.EngramEmbedding.__init__) == before and not ours, f"changed without tables: {{ours}}"
    print("UNCHANGED")
"""
    assert "UNCHANGED" in run_script(script, {"ENGRAM_TABLES": ""})
    assert "HOOKED True" in run_script(script, {"ENGRAM_TABLES": str(toy.local)})


def test_sglangs_metrics_route_serves_engrams_collector_beside_its_own(plugin, toy, tmp_path, monkeypatch):
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    import sglang.srt.utils.common as common
    from engram_engines import STATS

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))  # as SGLang sets it with --enable-metrics
    STATS.record(1, "split", "local_dir", 72, 0.0004)
    app = Starlette()
    common.add_prometheus_middleware(app)  # SGLang's function, as the plugin's hook left it
    text = TestClient(app).get("/metrics").text
    assert 'engram_gathers_total{form="split",layer="1",tier="local_dir"}' in text
