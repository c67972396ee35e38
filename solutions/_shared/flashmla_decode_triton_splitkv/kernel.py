"""FlashMLA-form dense MLA decode (bf16 paged cache, 64-token blocks, causal over draft tokens) in Triton.

Work decomposition
  * Rows are (query token, head) pairs of one request, row r = s * H + h (FlashMLA's order: q viewed
    as [batch, s_q * H, 576]). A program owns a tile of BLOCK_M rows (64 at 128 heads, 16 or 32 at 16
    heads) of one request and one split of its keys, so every KV tile it gathers serves all those rows.
  * The KV loop walks one 64-token cache block per step (BLOCK_N = page_block_size), so a step reads
    one block id from the table and then a contiguous 64 x 576 tile. The latent part (first 512) is
    loaded once and used both as the key part of q.k^T and as the value of p.v, both on tensor cores
    (tl.dot); the rope part (last 64) joins q.k^T as a second dot into the same accumulator.
  * Causal rule (FlashMLA's): row token s sees keys j <= L - s_q + s; the tile stops at the last key
    its newest token can see. Tokens past L in the last block are masked on load (they may hold
    anything), so 0 * garbage never reaches the accumulator.
  * Base-2 online softmax with softmax_scale * log2(e) folded into one multiply; lse is converted to
    natural log on the way out.
  * Split-KV only when the batch leaves SMs idle: the number of splits (the fewest that fill the SMs)
    is chosen on the host from the batch size and the number of row tiles (never from the lengths, so there is no host sync). With
    one split the kernel writes out / lse directly; otherwise each split writes an fp32 partial and its
    base-2 lse, and a merge kernel combines them.
"""

import math
import os

import torch
import triton
import triton.language as tl

HEAD_DIM = 576
HEAD_DIM_V = 512
HEAD_DIM_ROPE = HEAD_DIM - HEAD_DIM_V
BLOCK_SIZE = 64
LOG2E = 1.4426950408889634
LN2 = math.log(2.0)
MAX_SPLITS = 64
MERGE_ROWS = 16  # rows per merge program


@triton.jit
def _decode_kernel(q, k_cache, block_table, cache_seqlens, out, lse, o_part, lse_part,
                   qk_scale, num_splits, rows,
                   stride_qb, stride_qs, stride_qh, stride_kb, stride_kt, stride_tb,
                   stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                   H: tl.constexpr, S_Q: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, F32_DOT: tl.constexpr):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    length = tl.load(cache_seqlens + b)

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows
    tok = offs_m // H
    head = offs_m % H
    limit = tl.where(row_ok, length - S_Q + tok + 1, 0)  # keys [0, limit) are visible to the row
    tile_hi = tl.max(limit, axis=0)

    chunk = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    k_lo = split * chunk
    k_hi = tl.minimum(k_lo + chunk, tile_hi)

    offs_v = tl.arange(0, DV)
    offs_r = tl.arange(0, DR)
    q_row = q + b.to(tl.int64) * stride_qb + tok * stride_qs + head * stride_qh
    qn = tl.load(q_row[:, None] + offs_v[None, :], mask=row_ok[:, None], other=0.0)
    qr = tl.load(q_row[:, None] + DV + offs_r[None, :], mask=row_ok[:, None], other=0.0)
    if F32_DOT:
        qn = qn.to(tl.float32)
        qr = qr.to(tl.float32)

    acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    table_row = block_table + b.to(tl.int64) * stride_tb
    for start in range(k_lo, k_hi, BLOCK_N):
        block = tl.load(table_row + start // BLOCK_N).to(tl.int64)
        kv = k_cache + block * stride_kb + offs_n[:, None] * stride_kt
        in_cache = (start + offs_n) < length
        ckv = tl.load(kv + offs_v[None, :], mask=in_cache[:, None], other=0.0)  # [BLOCK_N, 512]
        kpe = tl.load(kv + DV + offs_r[None, :], mask=in_cache[:, None], other=0.0)  # [BLOCK_N, 64]
        if F32_DOT:
            ckv = ckv.to(tl.float32)
            kpe = kpe.to(tl.float32)
        s = tl.dot(qn, tl.trans(ckv))
        s = tl.dot(qr, tl.trans(kpe), s)
        s = s * qk_scale
        s = tl.where((start + offs_n)[None, :] < limit[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if F32_DOT:
            acc = tl.dot(p, ckv, acc)
        else:
            acc = tl.dot(p.to(ckv.dtype), ckv, acc)
        m_i = m_new

    seen = l_i > 0.0
    inv_l = tl.where(seen, 1.0 / tl.where(seen, l_i, 1.0), 0.0)
    o = acc * inv_l[:, None]
    lse2 = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    if SPLIT:
        part = (b * num_splits + split).to(tl.int64) * rows + offs_m
        tl.store(o_part + part[:, None] * DV + offs_v[None, :], o, mask=row_ok[:, None])
        tl.store(lse_part + part, lse2, mask=row_ok)
    else:
        o_row = out + b.to(tl.int64) * stride_ob + tok * stride_os + head * stride_oh
        tl.store(o_row[:, None] + offs_v[None, :], o.to(out.dtype.element_ty), mask=row_ok[:, None])
        tl.store(lse + b.to(tl.int64) * stride_lb + head * stride_lh + tok * stride_ls, lse2 * 0.6931471805599453,
                 mask=row_ok)


@triton.jit
def _merge_kernel(o_part, lse_part, out, lse, num_splits, rows,
                  stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                  H: tl.constexpr, DV: tl.constexpr, BLOCK_R: tl.constexpr):
    """Combines the splits of BLOCK_R rows of one request, one split at a time, weighting each
    partial by exp2(its lse - the running max)."""
    b = tl.program_id(1)
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = offs_r < rows
    offs_v = tl.arange(0, DV)
    m = tl.full([BLOCK_R], -1.0e30, dtype=tl.float32)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, DV], dtype=tl.float32)
    for split in range(0, num_splits):
        part = (b * num_splits + split).to(tl.int64) * rows + offs_r
        lse_s = tl.load(lse_part + part, mask=row_ok, other=float("-inf"))  # -inf: the split saw no key
        o_s = tl.load(o_part + part[:, None] * DV + offs_v[None, :], mask=row_ok[:, None], other=0.0)
        m_new = tl.maximum(m, lse_s)
        alpha = tl.math.exp2(m - m_new)
        w = tl.math.exp2(lse_s - m_new)
        total = total * alpha + w
        acc = acc * alpha[:, None] + o_s * w[:, None]
        m = m_new
    total = tl.where(row_ok, total, 1.0)
    tok = offs_r // H
    head = offs_r % H
    o_row = out + b.to(tl.int64) * stride_ob + tok * stride_os + head * stride_oh
    tl.store(o_row[:, None] + offs_v[None, :], (acc / total[:, None]).to(out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse + b.to(tl.int64) * stride_lb + head * stride_lh + tok * stride_ls,
             (m + tl.math.log2(total)) * 0.6931471805599453, mask=row_ok)


def _interpreting():
    return os.environ.get("TRITON_INTERPRET") == "1"


def _num_sms(device):
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter: small, so tiny batches still take the split path


def choose_splits(batch, row_tiles, num_sms):
    """One split when the batch alone fills the SMs; else the fewest splits that give every SM a
    program. A second wave of splits costs more than it balances: on an H100 at 16 heads, B=128
    L=8192 took 459.5 µs with 3 splits and 413.5 µs with 2 (docs/data/decode_variants_h100/)."""
    programs = batch * row_tiles
    if programs >= num_sms:
        return 1
    return max(1, min(triton.cdiv(num_sms, programs), MAX_SPLITS))


def launch(q, k_cache, block_table, cache_seqlens, softmax_scale, out, lse, num_splits=None):
    batch, s_q, heads, head_dim = q.shape
    assert head_dim == HEAD_DIM and k_cache.shape[1] == BLOCK_SIZE and k_cache.shape[2] == 1
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and out.stride(-1) == 1
    if batch == 0 or s_q == 0:  # no query rows: nothing to write, and no row tiles to size the grid by
        return
    rows = s_q * heads
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    row_tiles = triton.cdiv(rows, block_m)
    if num_splits is None:
        num_splits = choose_splits(batch, row_tiles, _num_sms(q.device))
    split = num_splits > 1
    interp = _interpreting()
    if split:
        o_part = torch.empty(batch * num_splits * rows * HEAD_DIM_V, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(batch * num_splits * rows, dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = lse  # unused
    _decode_kernel[(row_tiles, num_splits, batch)](
        q, k_cache, block_table, cache_seqlens, out, lse, o_part, lse_part,
        float(softmax_scale) * LOG2E, num_splits, rows,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        H=heads, S_Q=s_q, DV=HEAD_DIM_V, DR=HEAD_DIM_ROPE, BLOCK_M=block_m, BLOCK_N=BLOCK_SIZE,
        SPLIT=split, F32_DOT=interp,
        num_warps=8 if block_m >= 64 else 4, num_stages=2,
    )
    if split:
        _merge_kernel[(triton.cdiv(rows, MERGE_ROWS), batch)](
            o_part, lse_part, out, lse, num_splits, rows,
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
            H=heads, DV=HEAD_DIM_V, BLOCK_R=MERGE_ROWS, num_warps=4,
        )


def run(q, k_cache, block_table, cache_seqlens, softmax_scale, out, lse):
    launch(q, k_cache, block_table, cache_seqlens, softmax_scale, out, lse)
