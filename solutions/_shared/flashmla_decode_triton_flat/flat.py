"""FlashMLA-form dense MLA decode in Triton, every program given the same number of cache blocks.

Tiles and math are `decode_tiles.py`'s; what differs from `balanced.py` is that a program's keys may
cross from one request into the next, as FlashMLA's scheduler lets them:

  * The batch's cache blocks are laid end to end, request after request (a request of length 0
    counts as one block, so that it too has a program to write its empty row). Program p of P takes
    blocks [p * per, (p + 1) * per) of that line, per = ceil(blocks / P) but at least MIN_BLOCKS:
    every program reads the same number of blocks, whatever the lengths, and no program waits on a
    long request's tail; a short batch leaves the last programs idle rather than cut into pieces
    whose partials cost more to write and merge than their keys cost to read.
  * A program walks the requests its range touches. A request wholly inside the range is finished in
    place (bf16 out, natural-log lse); the piece of a request that spans several programs is left as
    an fp32 partial and base-2 lse in its own slot: request b's pieces take slots first[b] ..
    first[b] + pieces[b] - 1, in the order of the programs. The merge kernel combines them.
  * No host sync: every program derives the layout from cache_seqlens (a vector load over the batch,
    made again for each request it visits rather than kept across the key loop); the grid is P
    programs (about two per SM, counting row tiles) whatever the lengths.
"""

import torch
import triton
import triton.language as tl

from decode_tiles import (BLOCK_SIZE, HEAD_DIM_ROPE, HEAD_DIM_V, LOG2E, MERGE_COLUMNS, MERGE_ROWS, attend, combine,
                          interpreting, num_sms, row_tiling, store_partial, store_rows, strides)

MIN_BLOCKS = 8  # cache blocks a program reads at least (512 keys)


@triton.jit
def _blocks(cache_seqlens, count, BATCH_P2: tl.constexpr, PAGE: tl.constexpr):
    """(cache blocks of each of the first `count` requests (0 past them), batch offsets)."""
    offs_b = tl.arange(0, BATCH_P2)
    lengths = tl.load(cache_seqlens + offs_b, mask=offs_b < count, other=0)
    return tl.where(offs_b < count, tl.maximum(tl.cdiv(lengths, PAGE), 1), 0), offs_b


@triton.jit
def _range(cache_seqlens, batch, programs, BATCH_P2: tl.constexpr, PAGE: tl.constexpr, MIN_BLOCKS: tl.constexpr):
    """(blocks per program, the first request this program's range touches, one past the last)."""
    blocks, offs_b = _blocks(cache_seqlens, batch, BATCH_P2, PAGE)
    per = tl.maximum(tl.cdiv(tl.sum(blocks, axis=0), programs), MIN_BLOCKS)
    ends = tl.cumsum(blocks, axis=0)
    lo = tl.program_id(1) * per
    in_batch = offs_b < batch
    first = tl.sum(((ends <= lo) & in_batch).to(tl.int32), axis=0)
    past_last = tl.sum(((ends - blocks < lo + per) & in_batch).to(tl.int32), axis=0)
    return per, first, past_last


@triton.jit
def _request(cache_seqlens, b, per, BATCH_P2: tl.constexpr, PAGE: tl.constexpr):
    """(first block, end block, first slot, pieces) of request b. Made afresh for each request from
    the lengths of requests 0..b, so that no vector over the batch stays live across the key loop."""
    blocks, offs_b = _blocks(cache_seqlens, b + 1, BATCH_P2, PAGE)
    ends = tl.cumsum(blocks, axis=0)
    pieces = tl.where(offs_b <= b, (ends - 1) // per - (ends - blocks) // per + 1, 0)
    this = offs_b == b
    start = tl.sum(tl.where(offs_b < b, blocks, 0), axis=0)
    return (start, start + tl.sum(tl.where(this, blocks, 0), axis=0),
            tl.sum(tl.where(offs_b < b, pieces, 0), axis=0), tl.sum(tl.where(this, pieces, 0), axis=0))


@triton.jit
def _decode_kernel(q, k_cache, block_table, cache_seqlens, out, lse, o_part, lse_part,
                   qk_scale, batch, programs, rows,
                   stride_qb, stride_qs, stride_qh, stride_kb, stride_kt, stride_tb,
                   stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                   H: tl.constexpr, S_Q: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, BATCH_P2: tl.constexpr,
                   MIN_BLOCKS: tl.constexpr, F32_DOT: tl.constexpr):
    program = tl.program_id(1)
    per, first, past_last = _range(cache_seqlens, batch, programs, BATCH_P2, PAGE, MIN_BLOCKS)
    lo = program * per
    hi = lo + per
    for request in range(first, past_last):
        b = tl.cast(request, tl.int32)  # a tensor under the interpreter too, as the tile code expects
        start, end, first_slot, pieces = _request(cache_seqlens, b, per, BATCH_P2, PAGE)
        first_block = tl.maximum(lo, start) - start
        o, lse2 = attend(q, k_cache, block_table, b, tl.load(cache_seqlens + b), first_block * PAGE,
                         (tl.minimum(hi, end) - start - first_block) * PAGE, qk_scale, rows,
                         stride_qb, stride_qs, stride_qh, stride_kb, stride_kt, stride_tb,
                         H, S_Q, DV, DR, BLOCK_M, BLOCK_N, PAGE, F32_DOT)
        if pieces > 1:
            store_partial(o_part, lse_part, first_slot + program - start // per, o, lse2, rows, DV, BLOCK_M)
        else:
            store_rows(out, lse, b, o, lse2, rows, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                       stride_ls, H, DV, BLOCK_M)


@triton.jit
def _merge_kernel(cache_seqlens, o_part, lse_part, out, lse, batch, programs, rows,
                  stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                  H: tl.constexpr, DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                  BATCH_P2: tl.constexpr, PAGE: tl.constexpr, MIN_BLOCKS: tl.constexpr):
    """Requests in one piece were finished by the decode kernel; the others are combined here."""
    b = tl.program_id(2)
    per, _, _ = _range(cache_seqlens, batch, programs, BATCH_P2, PAGE, MIN_BLOCKS)
    start, end, first_slot, pieces = _request(cache_seqlens, b, per, BATCH_P2, PAGE)
    if pieces > 1:
        combine(o_part, lse_part, out, lse, b, first_slot, pieces, rows,
                stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls, H, DV, BLOCK_R, BLOCK_C)


def launch(q, k_cache, block_table, cache_seqlens, softmax_scale, out, lse, programs=None, min_blocks=MIN_BLOCKS,
           block_m=None, merge_columns=MERGE_COLUMNS):
    """`block_m` rows per program (default: all of a request's rows, up to 64); `merge_columns` value
    columns per merge program."""
    batch, s_q, heads, _ = q.shape
    rows, widest, _ = row_tiling(q, k_cache, out)
    if batch == 0 or s_q == 0:  # no query rows: nothing to write, and no row tiles to size the grid by
        return
    block_m = block_m or widest
    row_tiles = triton.cdiv(rows, block_m)
    if programs is None:  # about two programs per SM, counting the row tiles of each
        programs = max(1, triton.cdiv(2 * num_sms(q.device, interpreted=4), row_tiles))
    slots = programs + batch  # a request's pieces are the programs it touches; neighbours share one each
    o_part = torch.empty(slots * rows * HEAD_DIM_V, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(slots * rows, dtype=torch.float32, device=q.device)
    common = dict(BATCH_P2=triton.next_power_of_2(batch), PAGE=BLOCK_SIZE, MIN_BLOCKS=min_blocks)
    all_strides = strides(q, k_cache, block_table, out, lse)
    _decode_kernel[(row_tiles, programs)](
        q, k_cache, block_table, cache_seqlens, out, lse, o_part, lse_part,
        float(softmax_scale) * LOG2E, batch, programs, rows, *all_strides,
        H=heads, S_Q=s_q, DV=HEAD_DIM_V, DR=HEAD_DIM_ROPE, BLOCK_M=block_m, BLOCK_N=BLOCK_SIZE,
        F32_DOT=interpreting(), num_warps=8 if block_m >= 64 else 4, num_stages=2, **common,
    )
    _merge_kernel[(triton.cdiv(rows, MERGE_ROWS), HEAD_DIM_V // merge_columns, batch)](
        cache_seqlens, o_part, lse_part, out, lse, batch, programs, rows, *all_strides[6:],
        H=heads, DV=HEAD_DIM_V, BLOCK_R=MERGE_ROWS, BLOCK_C=merge_columns, num_warps=4, **common,
    )


def run(q, k_cache, block_table, cache_seqlens, softmax_scale, out, lse):
    launch(q, k_cache, block_table, cache_seqlens, softmax_scale, out, lse)
