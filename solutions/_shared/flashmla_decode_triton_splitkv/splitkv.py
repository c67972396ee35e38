"""FlashMLA-form dense MLA decode in Triton, every request's keys cut into the same number of splits.

Tiles and math are `decode_tiles.py`'s. Split-KV only when the batch leaves SMs idle: the number of
splits (the fewest that fill the SMs) is chosen on the host from the batch size and the number of row
tiles (never from the lengths, so there is no host sync). With one split the kernel writes out / lse
directly; otherwise each split writes an fp32 partial and its base-2 lse, and a merge kernel combines
them.
"""

import torch
import triton
import triton.language as tl

from decode_tiles import (BLOCK_SIZE, HEAD_DIM_ROPE, HEAD_DIM_V, LOG2E, MERGE_COLUMNS, MERGE_ROWS, attend, combine,
                          interpreting, num_sms, row_tiling, store_partial, store_rows, strides)

MAX_SPLITS = 64


@triton.jit
def _decode_kernel(q, k_cache, block_table, cache_seqlens, out, lse, o_part, lse_part,
                   qk_scale, num_splits, rows,
                   stride_qb, stride_qs, stride_qh, stride_kb, stride_kt, stride_tb,
                   stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                   H: tl.constexpr, S_Q: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr,
                   F32_DOT: tl.constexpr):
    split = tl.program_id(1)
    b = tl.program_id(2)
    length = tl.load(cache_seqlens + b)
    chunk = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    o, lse2 = attend(q, k_cache, block_table, b, length, split * chunk, chunk, qk_scale, rows,
                     stride_qb, stride_qs, stride_qh, stride_kb, stride_kt, stride_tb,
                     H, S_Q, DV, DR, BLOCK_M, BLOCK_N, PAGE, F32_DOT)
    if SPLIT:
        store_partial(o_part, lse_part, b * num_splits + split, o, lse2, rows, DV, BLOCK_M)
    else:
        store_rows(out, lse, b, o, lse2, rows, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                   H, DV, BLOCK_M)


@triton.jit
def _merge_kernel(o_part, lse_part, out, lse, num_splits, rows,
                  stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                  H: tl.constexpr, DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(2)
    combine(o_part, lse_part, out, lse, b, b * num_splits, num_splits, rows,
            stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls, H, DV, BLOCK_R, BLOCK_C)


def choose_splits(batch, row_tiles, sms):
    """One split when the batch alone fills the SMs; else the fewest splits that give every SM a
    program. A second wave of splits costs more than it balances: on an H100 at 16 heads, B=128
    L=8192 took 459.5 µs with 3 splits and 413.5 µs with 2 (docs/data/decode_variants_h100/)."""
    programs = batch * row_tiles
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(sms, programs), MAX_SPLITS))


def launch(q, k_cache, block_table, cache_seqlens, softmax_scale, out, lse, num_splits=None, block_n=BLOCK_SIZE):
    batch, s_q, heads, _ = q.shape
    rows, block_m, row_tiles = row_tiling(q, k_cache, out)
    if batch == 0 or s_q == 0:  # no query rows: nothing to write, and no row tiles to size the grid by
        return
    if num_splits is None:
        num_splits = choose_splits(batch, row_tiles, num_sms(q.device, interpreted=8))
    split = num_splits > 1
    if split:
        o_part = torch.empty(batch * num_splits * rows * HEAD_DIM_V, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(batch * num_splits * rows, dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = lse  # unused
    all_strides = strides(q, k_cache, block_table, out, lse)
    _decode_kernel[(row_tiles, num_splits, batch)](
        q, k_cache, block_table, cache_seqlens, out, lse, o_part, lse_part,
        float(softmax_scale) * LOG2E, num_splits, rows, *all_strides,
        H=heads, S_Q=s_q, DV=HEAD_DIM_V, DR=HEAD_DIM_ROPE, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=BLOCK_SIZE,
        SPLIT=split, F32_DOT=interpreting(),
        num_warps=8 if block_m >= 64 else 4, num_stages=2,
    )
    if split:
        _merge_kernel[(triton.cdiv(rows, MERGE_ROWS), HEAD_DIM_V // MERGE_COLUMNS, batch)](
            o_part, lse_part, out, lse, num_splits, rows, *all_strides[6:],
            H=heads, DV=HEAD_DIM_V, BLOCK_R=MERGE_ROWS, BLOCK_C=MERGE_COLUMNS, num_warps=4,
        )


def run(q, k_cache, block_table, cache_seqlens, softmax_scale, out, lse):
    launch(q, k_cache, block_table, cache_seqlens, softmax_scale, out, lse)
