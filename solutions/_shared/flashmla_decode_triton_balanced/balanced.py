"""FlashMLA-form dense MLA decode in Triton, with the keys of the whole batch cut into units of one size.

Tiles and math are `decode_tiles.py`'s; what differs from `splitkv.py` is the partition of the keys:

  * Work units: the batch's keys are cut into chunks of one size, chosen so that the units fit in
    TARGET, the programs that run at once (one wave): the chunk starts at an even share of all keys
    (whole cache blocks, at least MIN_CHUNK keys) and grows by eighths while the units are more
    than TARGET. Request b gets n_b = ceil(L_b / chunk) units, which share its keys evenly (whole
    cache blocks), so a 64k request among 1k ones is cut into many units while the short ones stay
    whole, and every unit does about the same work. (`fit=False` gives the older rule: 5/4 of an
    even share, whatever the count; it keeps a uniform batch that nearly fills the GPU unsplit.)
  * No host sync: every program loads all cache_seqlens (one vector load), computes the chunk,
    the n_b and their running sum, and finds which (request, split) its unit index is. The grid
    is sized on the host from shapes alone (TARGET + batch units bound the total), and programs
    past the last unit return at once.
  * A request in one unit is finished in place (bf16 out, natural-log lse); a split one leaves an
    fp32 partial and base-2 lse per unit in slot `unit` (unique), combined by a merge kernel that
    recomputes the same schedule.
"""

import torch
import triton
import triton.language as tl

from decode_tiles import (BLOCK_SIZE, HEAD_DIM_ROPE, HEAD_DIM_V, LOG2E, MERGE_COLUMNS, MERGE_ROWS, attend, combine,
                          interpreting, num_sms, row_tiling, store_partial, store_rows, strides)

MIN_CHUNK = 256  # keys: shorter units would spend more on their partial than on their keys


@triton.jit
def _units(lengths, in_batch, chunk):
    """Units of each request at this chunk (a request of length 0 still has one, to write its empty rows)."""
    return tl.where(in_batch, tl.maximum(tl.cdiv(lengths, chunk), 1), 0)


@triton.jit
def _schedule(cache_seqlens, batch, target_units, BATCH_P2: tl.constexpr, BLOCK_N: tl.constexpr,
              MIN_KEYS: tl.constexpr, FIT: tl.constexpr):
    """(units of each request, exclusive running sum of those units, batch offsets) as vectors. With FIT the
    chunk starts at an even share and grows by eighths until the units fit in target_units (one wave)."""
    offs_b = tl.arange(0, BATCH_P2)
    in_batch = offs_b < batch
    lengths = tl.load(cache_seqlens + offs_b, mask=in_batch, other=0)
    total = tl.sum(lengths, axis=0)
    slack = 4 if FIT else 5
    chunk = tl.cdiv(tl.cdiv(total * slack, target_units * 4), BLOCK_N) * BLOCK_N
    chunk = tl.maximum(chunk, MIN_KEYS)
    if FIT:
        for _ in tl.static_range(8):
            over = tl.sum(_units(lengths, in_batch, chunk), axis=0) > target_units
            chunk = tl.where(over, chunk + tl.cdiv(chunk, 8 * BLOCK_N) * BLOCK_N, chunk)
    units = _units(lengths, in_batch, chunk)
    ends = tl.cumsum(units, axis=0)
    return units, ends - units, offs_b


@triton.jit
def _decode_kernel(q, k_cache, block_table, cache_seqlens, out, lse, o_part, lse_part,
                   qk_scale, batch, target_units, rows,
                   stride_qb, stride_qs, stride_qh, stride_kb, stride_kt, stride_tb,
                   stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                   H: tl.constexpr, S_Q: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, BATCH_P2: tl.constexpr,
                   MIN_KEYS: tl.constexpr, FIT: tl.constexpr,
                   F32_DOT: tl.constexpr):
    unit = tl.program_id(1)
    units, starts, offs_b = _schedule(cache_seqlens, batch, target_units, BATCH_P2, BLOCK_N, MIN_KEYS, FIT)
    b = tl.sum((starts + units <= unit) & (offs_b < batch), axis=0)  # requests wholly before this unit
    if b < batch:
        split = unit - tl.sum(tl.where(offs_b == b, starts, 0), axis=0)
        n_b = tl.sum(tl.where(offs_b == b, units, 0), axis=0)
        length = tl.load(cache_seqlens + b)
        span = tl.cdiv(tl.cdiv(length, n_b), BLOCK_N) * BLOCK_N
        o, lse2 = attend(q, k_cache, block_table, b, length, split * span, span, qk_scale, rows,
                         stride_qb, stride_qs, stride_qh, stride_kb, stride_kt, stride_tb,
                         H, S_Q, DV, DR, BLOCK_M, BLOCK_N, PAGE, F32_DOT)
        if n_b > 1:
            store_partial(o_part, lse_part, unit, o, lse2, rows, DV, BLOCK_M)
        else:
            store_rows(out, lse, b, o, lse2, rows, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                       H, DV, BLOCK_M)


@triton.jit
def _merge_kernel(cache_seqlens, o_part, lse_part, out, lse, batch, target_units, rows,
                  stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                  H: tl.constexpr, DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                  BATCH_P2: tl.constexpr, BLOCK_N: tl.constexpr, MIN_KEYS: tl.constexpr,
                  FIT: tl.constexpr):
    """Requests in one unit were finished by the decode kernel; the others are combined here."""
    b = tl.program_id(2)
    units, starts, offs_b = _schedule(cache_seqlens, batch, target_units, BATCH_P2, BLOCK_N, MIN_KEYS, FIT)
    n_b = tl.sum(tl.where(offs_b == b, units, 0), axis=0)
    if n_b > 1:
        combine(o_part, lse_part, out, lse, b, tl.sum(tl.where(offs_b == b, starts, 0), axis=0), n_b, rows,
                stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls, H, DV, BLOCK_R, BLOCK_C)


def launch(q, k_cache, block_table, cache_seqlens, softmax_scale, out, lse, target_units=None, min_chunk=MIN_CHUNK,
           block_n=BLOCK_SIZE, fit=True):
    batch, s_q, heads, _ = q.shape
    rows, block_m, row_tiles = row_tiling(q, k_cache, out)
    if batch == 0 or s_q == 0:  # no query rows: nothing to write, and no row tiles to size the grid by
        return
    if target_units is None:  # about two programs per SM, counting the row tiles of each unit
        target_units = max(1, triton.cdiv(2 * num_sms(q.device, interpreted=4), row_tiles))
    max_units = target_units + batch  # sum of ceil(L_b / chunk) with chunk >= total / target_units
    o_part = torch.empty(max_units * rows * HEAD_DIM_V, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(max_units * rows, dtype=torch.float32, device=q.device)
    common = dict(BATCH_P2=triton.next_power_of_2(batch), BLOCK_N=block_n, MIN_KEYS=min_chunk, FIT=fit)
    all_strides = strides(q, k_cache, block_table, out, lse)
    _decode_kernel[(row_tiles, max_units)](
        q, k_cache, block_table, cache_seqlens, out, lse, o_part, lse_part,
        float(softmax_scale) * LOG2E, batch, target_units, rows, *all_strides,
        H=heads, S_Q=s_q, DV=HEAD_DIM_V, DR=HEAD_DIM_ROPE, BLOCK_M=block_m, PAGE=BLOCK_SIZE, F32_DOT=interpreting(),
        num_warps=8 if block_m >= 64 else 4, num_stages=2, **common,
    )
    _merge_kernel[(triton.cdiv(rows, MERGE_ROWS), HEAD_DIM_V // MERGE_COLUMNS, batch)](
        cache_seqlens, o_part, lse_part, out, lse, batch, target_units, rows, *all_strides[6:],
        H=heads, DV=HEAD_DIM_V, BLOCK_R=MERGE_ROWS, BLOCK_C=MERGE_COLUMNS, num_warps=4, **common,
    )


def run(q, k_cache, block_table, cache_seqlens, softmax_scale, out, lse):
    launch(q, k_cache, block_table, cache_seqlens, softmax_scale, out, lse)
