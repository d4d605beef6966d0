"""PLERows and PLEHasher against the engines' own code, where an engine is installed (each test skips, saying why,
where it is not; CI runs the NumPy transcriptions of tests/model/test_ple_rows.py instead):

* vLLM 0.33.0: ``_lookup_ple_embedding_from_pinned_kernel`` (run by Triton's interpreter on a machine without a
  GPU, with the byte pointers its signature declares), the vocabulary-parallel cut of its PLE table
  (``VocabParallelEmbedding._get_indices``, padded to ``make_ngram_vocab_size_divisible_by``), and
  ``Qwen4ExpNGramEmbedding.compute_ngram_ids`` on the CPU (its step hash after each request's ``ngram_context``);
* SGLang 0.5.23: ``_gather_ple_embedding_from_pinned_kernel`` (interpreted too) and its cut (padded to 64).

Run them with an engine's environment, e.g.
``PYTHONPATH=$PWD /work/venvs/vllm/bin/python -m pytest tests/model/test_ple_rows_engines.py`` (the interpreter is
switched on here, before an engine is imported, where no GPU is visible). Importing an engine takes up to a minute.
"""
from __future__ import annotations

import os
import types

import numpy as np
import pytest

import model_helpers as ref
from engram_model.ple import PLEHasher, PLERows, ple_rank_rows, ple_store_config
from engram_store import EngramStore

LAYER = 2
DTYPES = ["float8_e4m3fn", "bfloat16"]
pytestmark = pytest.mark.timeout(600)


def engine(module: str, name: str):
    """The engine module, or a skip saying what is missing. Without a GPU its Triton kernels run in Triton's
    interpreter (vLLM keeps Triton on only where no device is visible at all)."""
    torch = pytest.importorskip("torch", reason=f"torch is not installed: {name}'s kernels need it")
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    return pytest.importorskip(module, reason=f"{name} is not installed (an optional engine; run this file with "
                                              "its environment)")


@pytest.fixture(scope="module", params=DTYPES)
def tables(request, tmp_path_factory):
    """One table per dtype, read through PLERows from local_dir (in place) and from disk_dir (staged)."""
    config = ref.ple_rows_config(request.param)
    table = ref.ple_random_table(config)
    buffers = config.hash_buffers(LAYER)
    heads = [table[o:o + n] for o, n in zip(buffers.offsets, buffers.sizes)]
    layout = ple_store_config(config, LAYER)
    opened = []
    for kind in ("local_dir", "disk_dir"):
        where = {kind: tmp_path_factory.mktemp(kind)}
        with EngramStore(LAYER, layout, None, **where) as es:
            es.populate(heads)
        opened.append(EngramStore(LAYER, layout, None, **where))
    yield config, table, [PLERows(es, config, LAYER) for es in opened]
    for es in opened:
        es.close()


def step_ids(config, seed: int) -> np.ndarray:
    """A step's ids as the engine's hasher gives them ([T, 16]), a few of another head, and -1."""
    b = config.hash_buffers(LAYER)
    bounds = np.append(b.offsets, sum(b.sizes))
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.integers(bounds[h], bounds[h + 1], 4) for h in range(16)], axis=1)
    ids[1, 3], ids[2, 5], ids[3, 0] = bounds[9] + 1, -1, 0
    return ids


def test_vllms_kernel_gives_the_raw_rows(tables):
    M = engine("vllm.models.qwen4_exp.common.ngram_embedding", "vLLM")
    import torch
    from vllm.triton_utils import triton

    config, table, readers = tables
    ids = step_ids(config, 1)
    row_bytes = config.row_bytes
    for rank in range(4):
        start, end, _ = ple_rank_rows(config, LAYER, rank, 4)
        weight = torch.from_numpy(table[start:end].view(np.uint8).copy())   # the rank's pinned table, as bytes
        out = torch.full((ids.size, row_bytes), 7, dtype=torch.uint8)      # its [T, 16, 160] output, as bytes
        M._lookup_ple_embedding_from_pinned_kernel[(ids.size,)](
            weight, torch.from_numpy(ids.reshape(-1)), out, row_bytes, start, end,
            BLOCK_D=triton.next_power_of_2(row_bytes))
        want = out.numpy().reshape(*ids.shape, row_bytes)
        for rows in readers:
            got = np.empty(ids.shape + (row_bytes,), np.uint8)
            rows.gather_into(ids, got, row_start=start, row_end=end)
            np.testing.assert_array_equal(got, want)


def test_sglangs_kernel_gives_the_bf16_rows(tables):
    M = engine("sglang.srt.models.qwen4_exp", "SGLang")
    import torch

    config, table, readers = tables
    ids = step_ids(config, 2)
    fp8 = config.row_format.codes == "e4m3"
    for rank in range(2):
        start, end, _ = ple_rank_rows(config, LAYER, rank, 2, padding=64)
        weight = torch.from_numpy(table[start:end].copy()).view(torch.float8_e4m3fn if fp8 else torch.bfloat16)
        out = torch.full((ids.size, config.head_dim), 7, dtype=torch.bfloat16)
        M._gather_ple_embedding_from_pinned_kernel[(ids.size,)](
            weight.data_ptr(), torch.from_numpy(ids.reshape(-1)), out, embedding_dim=config.head_dim,
            tp_vocab_start=start, tp_vocab_end=end, is_fp8=fp8, BLOCK_D=256)
        want = out.view(torch.int16).numpy().view(np.uint16).reshape(*ids.shape, config.head_dim)
        for rows in readers:
            got = torch.empty(ids.shape + (config.head_dim,), dtype=torch.bfloat16)
            rows.gather_into(torch.from_numpy(ids), got, row_start=start, row_end=end)
            np.testing.assert_array_equal(got.view(torch.int16).numpy().view(np.uint16), want)


@pytest.mark.parametrize("name, padding", [("vLLM", None), ("SGLang", 64)])
def test_the_engines_vocabulary_cut_is_ple_rank_rows(name, padding):
    module = {"vLLM": "vllm.model_executor.layers.vocab_parallel_embedding",
              "SGLang": "sglang.srt.layers.vocab_parallel_embedding"}[name]
    M = engine(module, name)
    config = ref.ple_rows_config("bfloat16")
    rows = config.num_embeddings(LAYER)
    pad = config.make_ngram_vocab_size_divisible_by if padding is None else padding
    for ranks in (1, 2, 4, 8):
        padded = M.pad_vocab_size(rows, pad)
        for rank in range(ranks):
            shard = M.VocabParallelEmbedding._get_indices(padded, padded, rows, rows, rank, ranks)
            got = ple_rank_rows(config, LAYER, rank, ranks, padding=padding)
            assert got[:2] == (shard.org_vocab_start_index, shard.org_vocab_end_index)


def test_vllms_cpu_step_hash_is_hash_ragged():
    """vLLM's ``compute_ngram_ids`` on the CPU (the release's hash layout; requests with EOS in their context and
    tokens; a request with no tokens) against PLEHasher.hash_ragged."""
    M = engine("vllm.models.qwen4_exp.nvidia.ngram_embedding", "vLLM")
    import torch

    config = ref.ple_rows_config("float8_e4m3fn")
    b = config.hash_buffers(LAYER)
    cls = M.Qwen4ExpNGramEmbedding
    module = types.SimpleNamespace(
        eos_token_id=config.eos_token_id, ngram_size=config.ngram_size, heads_per_ngram=config.heads_per_ngram,
        layer_multipliers=torch.tensor(b.multipliers), ngram_heads_vocab_sizes=torch.tensor(b.sizes),
        ngram_heads_offsets=torch.tensor(b.offsets), _shift_precompute=cls._shift_precompute,
        _shift_apply=cls._shift_apply)
    rng = np.random.default_rng(3)
    lengths = [5, 1, 0, 3, 1]
    tokens = rng.integers(0, config.vocab_size, sum(lengths))
    tokens[[2, 7]] = config.eos_token_id
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    context = rng.integers(0, config.vocab_size, (len(lengths), config.ngram_size - 1)).astype(np.int32)
    context[1, 1] = context[3, 0] = config.eos_token_id
    theirs = cls.compute_ngram_ids(module, torch.from_numpy(tokens), torch.from_numpy(qsl),
                                   torch.from_numpy(context)).numpy()
    ours = PLEHasher(config).hash_ragged(tokens, qsl, context)[:, 0]
    np.testing.assert_array_equal(ours, theirs)
