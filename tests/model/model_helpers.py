"""Helpers of the model tests: NumPy transcriptions of transformers 5.23.0's Qwen4-Exp PLE code
(``models/qwen4_exp/modeling_qwen4_exp.py``: ``_splitmix64``, ``_build_layer_multipliers``, ``_find_nth_prime_after``,
``Qwen4ExpTextNGramEmbedding``, ``Qwen4ExpTextPLELayer``), written line by line from it so that the suite checks
``engram_model.ple`` exactly where transformers is not installed; and the bridge to the real code where it is
(``reference()`` skips, saying why, without it)."""
from __future__ import annotations

import math

import numpy as np
import pytest

MASK64 = (1 << 64) - 1


# ---- configuration (modeling_qwen4_exp.py, lines 1035-1071) ------------------------------------------------------

def splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
    return (value ^ (value >> 31)) & MASK64


def build_layer_multipliers(unigram_vocab_size: int, ngram_size: int, ple_layer_index: int, seed: int) -> list[int]:
    max_long = (1 << 63) - 1
    multiplier_max = max_long // max(unigram_vocab_size, 1)
    half_bound = max(1, multiplier_max // 2)
    base_seed = seed + 10007 * ple_layer_index
    out = []
    for index in range(ngram_size):
        value = (base_seed + 0x9E3779B97F4A7C15 * (index + 1)) & MASK64
        out.append(2 * (splitmix64(value) % half_bound) + 1)
    return out


def is_prime(value: int) -> bool:
    if value < 2:
        return False
    if value % 2 == 0:
        return value == 2
    for divisor in range(3, math.isqrt(value) + 1, 2):
        if value % divisor == 0:
            return False
    return True


def find_nth_prime_after(start: int, count: int) -> int:
    prime = start
    for _ in range(count):
        prime += 1
        while not is_prime(prime):
            prime += 1
    return prime


def head_layout(base: int, heads: int, ple_layer_index: int, divisor: int) -> tuple[list[int], list[int], int]:
    """``(head_vocab_sizes, head_offsets, padded rows)`` as ``Qwen4ExpTextNGramEmbedding.__init__`` builds them."""
    sizes, offsets, total = [], [], 0
    for head_idx in range(heads):
        size = find_nth_prime_after(base - 1, ple_layer_index * heads + head_idx + 1)
        sizes.append(size)
        offsets.append(total)
        total += size
    return sizes, offsets, math.ceil(total / divisor) * divisor


# ---- the hash (Qwen4ExpTextNGramEmbedding._shift_right_ignore_eos and forward) ----------------------------------

def shift_right_ignore_eos(token_ids: np.ndarray, shift: int, eos: int) -> np.ndarray:
    if shift == 0:
        return token_ids
    batch_size, seq_len = token_ids.shape
    positions = np.arange(seq_len)
    eos_positions = np.where(token_ids == eos, positions, -1)
    previous_eos_inclusive = np.maximum.accumulate(eos_positions, axis=1)
    previous_eos = np.concatenate([np.full((batch_size, 1), -1), previous_eos_inclusive[:, :-1]], axis=1)
    position_in_segment = positions[None, :] - (previous_eos + 1)
    source_positions = positions - shift
    shifted = token_ids[:, np.clip(source_positions, 0, None)]
    valid = (position_in_segment >= shift) & (source_positions[None, :] >= 0)
    return np.where(valid, shifted, eos)


def ngram_ids(input_ids: np.ndarray, previous_context: np.ndarray, multipliers, sizes, offsets, heads_per_ngram: int,
              ngram_size: int, eos: int) -> np.ndarray:
    """Global rows ``[B, T, heads]`` of ``input_ids`` after ``previous_context`` (int64, wrapping, floor mod)."""
    m = np.asarray(multipliers, dtype=np.int64)
    token_history = np.concatenate([previous_context, input_ids], axis=-1).astype(np.int64)
    shifted = [shift_right_ignore_eos(token_history, s, eos) for s in range(ngram_size)]
    blocks = []
    with np.errstate(over="ignore"):
        for ngram in range(2, ngram_size + 1):
            start = (ngram - 2) * heads_per_ngram
            mixed = shifted[0] * m[0]
            for position in range(1, ngram):
                mixed = np.bitwise_xor(mixed, shifted[position] * m[position])
            size = np.asarray(sizes[start:start + heads_per_ngram], dtype=np.int64)
            blocks.append(np.mod(mixed[..., None], size) + np.asarray(offsets[start:start + heads_per_ngram]))
    return np.concatenate(blocks, axis=-1)[:, -input_ids.shape[1]:]


# ---- the forward (Qwen4ExpTextPLELayer.forward), in float64 ---------------------------------------------------

def grouped_rms_norm(x: np.ndarray, weight: np.ndarray, group: int, eps: float) -> np.ndarray:
    g = x.reshape(*x.shape[:-1], -1, group)
    out = g / np.sqrt(np.mean(g ** 2, axis=-1, keepdims=True) + eps)
    return out.reshape(x.shape) * (1.0 + weight)


def ple_forward(w: dict, hidden: np.ndarray, emb: np.ndarray, hc: int, H: int, eps: float, dilation: int,
                conv_state: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(output, conv state after)`` of whole sequences ``hidden [B, T, hc * H]``, ``emb [B, T, E]`` in float64;
    ``conv_state [B, (K - 1) * dilation, hc * H]`` the normed rows before (zeros: a fresh sequence)."""
    B, T, _ = hidden.shape
    K = w["conv1d"].shape[-1]
    key = grouped_rms_norm(emb @ w["key_proj"].T, w["norm_key"], H, eps).reshape(B, T, hc, H)
    value = emb @ w["value_proj"].T
    query = grouped_rms_norm(hidden, w["norm_query"], H, eps).reshape(B, T, hc, H)
    gate = (key * query).sum(-1, keepdims=True) / math.sqrt(H)
    gate = np.sqrt(np.maximum(np.abs(gate), 1e-6)) * np.sign(gate)
    gated = (1.0 / (1.0 + np.exp(-gate))) * value[:, :, None, :]
    normed = grouped_rms_norm(gated.reshape(B, T, hc * H), w["norm_conv"], H, eps)
    gated = gated.reshape(B, T, hc * H)
    state_len = (K - 1) * dilation
    state = np.zeros((B, state_len, hc * H)) if conv_state is None else conv_state
    padded = np.concatenate([state, normed], axis=1)[:, -(state_len + T):]       # (B, L + T, C)
    conv = np.zeros_like(gated)
    for t in range(T):                                   # F.conv1d, kernel K, dilation, no padding, depthwise
        for k in range(K):
            conv[:, t] += w["conv1d"][:, k] * padded[:, t + k * dilation]
    silu = conv / (1.0 + np.exp(-conv))
    return gated + silu, padded[:, -state_len:]


# ---- the real code -------------------------------------------------------------------------------------------

def reference():
    """``(torch, modeling_qwen4_exp module, DynamicCache)`` of transformers 5.23.0, or a skip saying what is missing
    (``PYTHONPATH=$PWD /work/venvs/hf/bin/python -m pytest ...`` runs them)."""
    torch = pytest.importorskip("torch", reason="torch is not installed: the comparisons with transformers' own "
                                               "Qwen4-Exp code skip (the NumPy transcriptions still run)")
    try:
        from transformers.cache_utils import DynamicCache
        from transformers.models.qwen4_exp import modeling_qwen4_exp
    except ImportError as exc:
        pytest.skip(f"transformers with models/qwen4_exp (5.23.0) is not importable ({exc}): the comparisons with "
                    "transformers' own code skip (the NumPy transcriptions still run)")
    return torch, modeling_qwen4_exp, DynamicCache


def hf_text_config(config, layers: int | None = None):
    """transformers' ``Qwen4ExpTextConfig`` of a PLEConfig (the parts around the PLE layers as small as allowed)."""
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=layers or max(4, max(
            config.ple_layer_ids)), hc_count=config.hc_count, ple_layer_ids=list(config.ple_layer_ids),
        ple_embed_dim=config.ple_embed_dim, ple_conv_kernel_size=config.ple_conv_kernel_size,
        ngram_size=config.ngram_size, heads_per_ngram=config.heads_per_ngram,
        ngram_vocab_size_base=config.ngram_vocab_size_base,
        make_ngram_vocab_size_divisible_by=config.make_ngram_vocab_size_divisible_by, seed=config.seed,
        split_ngram_parts=config.split_ngram_parts, eos_token_id=config.eos_token_id,
        rms_norm_eps=config.rms_norm_eps, layer_types=["linear_attention"] * (layers or max(4, max(
            config.ple_layer_ids))), num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=8, shared_expert_intermediate_size=8, hc_lowrank=4)


def hf_ngram_ids_module(config, layer_id: int):
    """transformers' ``Qwen4ExpTextNGramEmbedding`` of ``layer_id`` whose "embedding" returns the row ids it looks
    up (float64, exact): built on the meta device (the release's table would take 205 GB), then its buffers made
    by transformers' own functions and attributes."""
    torch, M, _ = reference()
    hc = hf_text_config(config)
    with torch.device("meta"):
        module = M.Qwen4ExpTextNGramEmbedding(hc, hc.ple_embed_dim, layer_id - 1, config.ple_layer_ids.index(layer_id))
    module.layer_multipliers = M._build_layer_multipliers(module.unigram_vocab_size, module.ngram_size,
                                                          module.ple_layer_index, module.seed)
    module.ngram_heads_vocab_sizes = torch.tensor(module.head_vocab_sizes, dtype=torch.long)
    module.ngram_heads_offsets = torch.tensor(module.head_offsets, dtype=torch.long)

    class RowIds(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1), requires_grad=False)

        def forward(self, ids):
            return ids.unsqueeze(-1).to(torch.float64)

    module.ngram_embedding = RowIds()
    return module, hc


# ---- the engines' PLE row gathers (vLLM 0.33.0, SGLang 0.5.23), line by line --------------------------------------

def vllm_ple_lookup(weight: np.ndarray, ids: np.ndarray, vocab_start: int, vocab_end: int) -> np.ndarray:
    """vLLM's ``_lookup_ple_embedding_from_pinned_kernel`` (``vllm/models/qwen4_exp/common/ngram_embedding.py``),
    one program per id: ``weight`` the rank's table as bytes (uint8 ``[vocab_end - vocab_start, row_bytes]``: its
    ``weight`` viewed through the kernel's byte pointers); ids outside ``[vocab_start, vocab_end)`` store zeros.
    Returns uint8 ``[*ids.shape, row_bytes]`` (the bytes of vLLM's ``[T, 16, 160]`` output)."""
    row_bytes = weight.shape[1]
    flat = ids.reshape(-1).astype(np.int64)
    out = np.empty((flat.size, row_bytes), np.uint8)
    for row_id in range(flat.size):
        global_idx = flat[row_id]
        in_range = vocab_start <= global_idx < vocab_end
        local_idx = global_idx - vocab_start if in_range else 0
        values = weight[local_idx] if in_range else np.zeros(row_bytes, np.uint8)   # load(mask=in_range, other=0)
        out[row_id] = values
    return out.reshape(*ids.shape, row_bytes)


def sglang_ple_gather(weight: np.ndarray, ids: np.ndarray, vocab_start: int, vocab_end: int) -> np.ndarray:
    """SGLang's ``_gather_ple_embedding_from_pinned_kernel`` (``sglang/srt/models/qwen4_exp.py``), one program per
    id: ``weight`` the rank's table, uint8 e4m3 codes (``is_fp8``) or uint16 bf16 bits ``[rows, embedding_dim]``;
    the row ``.to(tl.bfloat16)``, zeros where the id is outside ``[vocab_start, vocab_end)``. Returns uint16 bf16
    bits ``[*ids.shape, embedding_dim]``. (e4m3 NaN codes, which no loaded table holds, are left to ml_dtypes.)"""
    import ml_dtypes

    dim = weight.shape[1]
    flat = ids.reshape(-1).astype(np.int64)
    out = np.empty((flat.size, dim), np.uint16)
    for row_id in range(flat.size):
        global_idx = flat[row_id]
        in_range = vocab_start <= global_idx < vocab_end
        local_idx = global_idx - vocab_start if in_range else 0
        if not in_range:                                                              # load(mask=...), then
            out[row_id] = 0                                                           # tl.where(in_range, v, 0.0)
            continue
        row = weight[local_idx]
        out[row_id] = row.view(ml_dtypes.float8_e4m3fn).astype(ml_dtypes.bfloat16).view(np.uint16) \
            if weight.dtype == np.uint8 else row
    return out.reshape(*ids.shape, dim)


def vocab_parallel_range(rows: int, padding_size: int, rank: int, ranks: int) -> tuple[int, int]:
    """``VocabParallelEmbedding._get_indices`` (vLLM's and SGLang's ``vocab_parallel_embedding.py``) for a table of
    ``rows`` without added rows: ``org_vocab_start_index``, ``org_vocab_end_index`` of ``rank``."""
    padded = ((rows + padding_size - 1) // padding_size) * padding_size            # pad_vocab_size
    assert padded % ranks == 0                                                      # divide()
    per_partition = padded // ranks
    start, end = rank * per_partition, rank * per_partition + per_partition
    return min(start, rows), min(end, rows)


def ple_rows_config(dtype: str):
    """The release's rows (160 values, 16 heads) over small prime heads (5,632 rows, the last 20 padding), of
    ``dtype`` ("float8_e4m3fn" or "bfloat16"), PLE layer 2."""
    from engram_model.ple import PLEConfig

    return PLEConfig(ple_layer_ids=[2], vocab_size=500, eos_token_id=5, ngram_vocab_size_base=300, hidden_size=8,
                     hc_count=2, ple_embed_dim=2560, split_ngram_parts=64, ple_embedding_dtype=dtype)


def ple_random_table(config, seed: int = 0) -> np.ndarray:
    """Layer 2's whole table as the engines hold it (padding rows included), in the store's dtype: e4m3 codes
    without NaN (no loaded table has one), or bf16 bits without NaN or infinity."""
    rows, rng = config.num_embeddings(2), np.random.default_rng(seed)
    if config.row_format.codes == "e4m3":
        codes = rng.integers(0, 256, (rows, config.head_dim), dtype=np.uint8)
        return np.where((codes & 0x7F) == 0x7F, codes ^ 1, codes).astype(np.uint8)
    bits = rng.integers(0, 1 << 16, (rows, config.head_dim), dtype=np.uint16)
    return np.where((bits & 0x7F80) == 0x7F80, bits ^ 0x0080, bits).astype(np.uint16)
