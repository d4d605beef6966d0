"""Triton kernels that give DeepSeek-V4.1's rows to a GPU as vLLM 0.33.0's ``_engram_lookup_kernel`` does, bit for bit.

* :func:`lookup_in_place`: the GPU reads engram's own table in place. A ``local_dir`` layer is one file per column
  (``[N_c, 264]`` packed rows: 256 e4m3 codes, then 8 e8m0 scale bytes) mapped by every process of the host; the
  kernel takes a table of the columns' addresses (``bases[c]``), finds the column of each id (ids are rows of the
  layer's one table, column offsets added, as the engines' hashers give them) and reads the row where it lies.
  On a GPU the mappings are registered with ``cudaHostRegister`` (read-only) and ``bases`` holds their device
  addresses (UVA: a decode step needs no host round trip, and a CUDA graph captures the kernel). On the CPU,
  Triton's interpreter (``TRITON_INTERPRET=1``) runs the same kernel over the host addresses: how the tests hold
  it to vLLM's own kernel.
* :func:`decode_packed`: packed rows already on the device (staged by the host from a ``disk_dir``) into bf16.

Either writes what vLLM's lookup writes: for each token and local head ``j`` (column ``head_start + j``), zeros
where the column is past the last, the id is ``-1`` or outside the shard's rows; else bf16 ``float32(e4m3) *
float32(scale_byte << 23)`` (or the packed row when ``out`` is uint8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_rows", "vocab_start", "vocab_end", "ids_stride_t", "ids_stride_h"])
def _in_place_kernel(bases, offsets, ids, out, num_rows, vocab_start, vocab_end, ids_stride_t, ids_stride_h,
                     HEAD_START: tl.constexpr, LOCAL_HEADS: tl.constexpr, TOTAL_HEADS: tl.constexpr,
                     DIM: tl.constexpr, QUANT_BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, PACKED: tl.constexpr,
                     OUT_STRIDE: tl.constexpr):
    ROW_BYTES: tl.constexpr = DIM + DIM // QUANT_BLOCK
    cols = tl.arange(0, DIM)
    scale_cols = cols // QUANT_BLOCK
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = rows < num_rows
    head = HEAD_START + rows % LOCAL_HEADS
    token = (rows // LOCAL_HEADS).to(tl.int64)
    index = tl.load(ids + token * ids_stride_t + head * ids_stride_h, mask=valid & (head < TOTAL_HEADS),
                    other=-1).to(tl.int64)
    owned = valid & (head < TOTAL_HEADS) & (index >= vocab_start) & (index < vocab_end)
    # The column holding the id: the shard's columns start at offsets[HEAD_START + c], in order.
    col = tl.full((BLOCK_R,), HEAD_START, tl.int64)
    for c in tl.static_range(1, LOCAL_HEADS):
        if HEAD_START + c < TOTAL_HEADS:
            col += (index >= tl.load(offsets + HEAD_START + c)).to(tl.int64)
    col = tl.where(owned, col, HEAD_START)
    start = tl.load(offsets + col, mask=owned, other=0)
    base = tl.load(bases + col, mask=owned, other=0)
    row = base + tl.where(owned, index - start, 0) * ROW_BYTES
    row_values = row.to(tl.pointer_type(tl.float8e4nv))
    row_scales = (row + DIM).to(tl.pointer_type(tl.uint8))
    values = tl.load(row_values[:, None] + cols[None, :], mask=owned[:, None], other=0.0)
    scale = tl.load(row_scales[:, None] + scale_cols[None, :], mask=owned[:, None], other=0)
    if PACKED:
        dst = rows.to(tl.int64)
        dst = dst // LOCAL_HEADS * OUT_STRIDE + dst % LOCAL_HEADS * ROW_BYTES
        tl.store(out + dst[:, None] + cols[None, :], values.to(tl.uint8, bitcast=True), mask=valid[:, None])
        tl.store(out + dst[:, None] + DIM + scale_cols[None, :], scale,
                 mask=valid[:, None] & (cols[None, :] % QUANT_BLOCK == 0))
    else:
        scale = (scale.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        tl.store(out + rows.to(tl.int64)[:, None] * DIM + cols[None, :],
                 (values.to(tl.float32) * scale).to(tl.bfloat16), mask=valid[:, None])


@triton.jit(do_not_specialize=["num_rows"])
def _decode_kernel(packed, out, num_rows, DIM: tl.constexpr, QUANT_BLOCK: tl.constexpr, BLOCK_R: tl.constexpr):
    ROW_BYTES: tl.constexpr = DIM + DIM // QUANT_BLOCK
    cols = tl.arange(0, DIM)
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    valid = rows < num_rows
    src = packed + rows * ROW_BYTES
    values = tl.load(src.to(tl.pointer_type(tl.float8e4nv))[:, None] + cols[None, :], mask=valid[:, None],
                     other=0.0)
    scale = tl.load(src[:, None] + DIM + (cols // QUANT_BLOCK)[None, :], mask=valid[:, None], other=0)
    scale = (scale.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    tl.store(out + rows[:, None] * DIM + cols[None, :], (values.to(tl.float32) * scale).to(tl.bfloat16),
             mask=valid[:, None])


BLOCK_R = 16


def lookup_in_place(bases: torch.Tensor, offsets: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, *,
                    head_start: int, n_cols: int, vocab_start: int, vocab_end: int, block_size: int = 32) -> None:
    """Rows of ``ids [T, n_cols]`` (int32/int64, any strides) for the local heads ``head_start ..
    head_start + out.shape[1]`` into ``out`` (bf16 ``[T, part, dim]`` or uint8 ``[T, part, dim + dim / 32]``, rows
    contiguous) from the columns at ``bases`` (int64 addresses, ``[n_cols]``); ``offsets`` int64 ``[n_cols]``: the
    first table row of each column. ``[vocab_start, vocab_end)``: the shard's rows."""
    T, part = out.shape[0], out.shape[1]
    packed = out.dtype == torch.uint8
    dim = out.shape[2] * block_size // (block_size + 1) if packed else out.shape[2]
    rows = T * part
    if not rows:
        return
    _in_place_kernel[(triton.cdiv(rows, BLOCK_R),)](
        bases, offsets, ids, out, rows, vocab_start, vocab_end, ids.stride(0), ids.stride(1),
        HEAD_START=head_start, LOCAL_HEADS=part, TOTAL_HEADS=n_cols, DIM=dim, QUANT_BLOCK=block_size,
        BLOCK_R=BLOCK_R, PACKED=packed, OUT_STRIDE=out.stride(0))


def decode_packed(packed: torch.Tensor, out: torch.Tensor, block_size: int = 32) -> None:
    """Packed rows ``[..., dim + dim / 32]`` uint8 (contiguous) into bf16 ``out [..., dim]`` (contiguous)."""
    dim = out.shape[-1]
    rows = out.numel() // dim
    if rows:
        _decode_kernel[(triton.cdiv(rows, BLOCK_R),)](packed, out, rows, DIM=dim, QUANT_BLOCK=block_size,
                                                      BLOCK_R=BLOCK_R)
