"""The tile work of the FlashMLA-form Triton decode kernels (bf16 paged cache, 64-token blocks, causal
over draft tokens). The kernels, `splitkv.py`, `balanced.py` and `flat.py`, differ only in how they cut
the keys among programs; each lives in a shared folder of its own beside this one, so that changing
one leaves the others' content hashes, and their traces, as they are.

  * Rows are (query token, head) pairs of one request, row r = s * H + h (FlashMLA's order: q viewed
    as [batch, s_q * H, 576]). A program owns a tile of BLOCK_M rows (64 at 128 heads, 16 or 32 at 16
    heads) of one request and one span of its keys, so every KV tile it gathers serves all those rows.
  * The KV loop walks one 64-token cache block (PAGE) per step, or half of one (BLOCK_N = 32: half the
    shared memory, so two programs fit on an SM where 32-row tiles leave room for one), so a step
    reads one block id from the table and then a contiguous BLOCK_N x 576 tile. The latent part (first 512) is
    loaded once and used both as the key part of q.k^T and as the value of p.v, both on tensor cores
    (tl.dot); the rope part (last 64) joins q.k^T as a second dot into the same accumulator.
  * Causal rule (FlashMLA's): row token s sees keys j <= L - s_q + s; the tile stops at the last key
    its newest token can see. Tokens past L in the last block are masked on load (they may hold
    anything), so 0 * garbage never reaches the accumulator.
  * Base-2 online softmax with softmax_scale * log2(e) folded into one multiply; lse is converted to
    natural log on the way out.
  * A request whose keys were cut into several spans leaves an fp32 partial and its base-2 lse per
    span; `combine` merges them: first the largest lse of each row, then every partial weighted by
    exp2(its lse - that largest). Without a running rescale the loads of the second pass do not wait
    on one another, and a program takes BLOCK_C of the 512 value columns, so the partials of one long
    request are read by several SMs at once.
"""

import os

import torch
import triton
import triton.language as tl

HEAD_DIM = 576
HEAD_DIM_V = 512
HEAD_DIM_ROPE = HEAD_DIM - HEAD_DIM_V
BLOCK_SIZE = 64
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # read inside kernels, so a constexpr
MERGE_ROWS = 16  # rows per merge program
MERGE_COLUMNS = 128  # value columns per merge program


@triton.jit
def attend(q, k_cache, block_table, b, length, k_lo, span, qk_scale, rows,
           stride_qb, stride_qs, stride_qh, stride_kb, stride_kt, stride_tb,
           H: tl.constexpr, S_Q: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, F32_DOT: tl.constexpr):
    """(o, base-2 lse) of this program's row tile over keys [k_lo, k_lo + span) of request b; a row
    that saw no key has o = 0 and lse = -inf. k_lo is a multiple of BLOCK_N, which divides PAGE."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows
    tok = offs_m // H
    head = offs_m % H
    limit = tl.where(row_ok, length - S_Q + tok + 1, 0)  # keys [0, limit) are visible to the row
    k_hi = tl.minimum(k_lo + span, tl.max(limit, axis=0))

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
        block = tl.load(table_row + start // PAGE).to(tl.int64)
        kv = k_cache + block * stride_kb + (start % PAGE + offs_n)[:, None] * stride_kt
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
    lse2 = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    return acc * inv_l[:, None], lse2


@triton.jit
def store_rows(out, lse, b, o, lse2, rows, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
               H: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr):
    """The finished rows of this program's tile: bf16 out, natural-log lse."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows
    tok = offs_m // H
    head = offs_m % H
    o_row = out + b.to(tl.int64) * stride_ob + tok * stride_os + head * stride_oh
    tl.store(o_row[:, None] + tl.arange(0, DV)[None, :], o.to(out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse + b.to(tl.int64) * stride_lb + head * stride_lh + tok * stride_ls, lse2 * LN2, mask=row_ok)


@triton.jit
def store_partial(o_part, lse_part, slot, o, lse2, rows, DV: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's fp32 partial and base-2 lse, in span slot `slot` (rows x DV values a slot)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows
    part = (offs_m + slot * rows).to(tl.int64)
    tl.store(o_part + part[:, None] * DV + tl.arange(0, DV)[None, :], o, mask=row_ok[:, None])
    tl.store(lse_part + part, lse2, mask=row_ok)


@triton.jit
def combine(o_part, lse_part, out, lse, b, first, count, rows,
            stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
            H: tl.constexpr, DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Merges slots [first, first + count) of request b for BLOCK_R rows (program axis 0) and BLOCK_C
    value columns (program axis 1); the lse is written by the programs of the first columns."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = offs_r < rows
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    for slot in range(first, first + count):
        lse_s = tl.load(lse_part + (offs_r + slot * rows), mask=row_ok, other=float("-inf"))
        m = tl.maximum(m, lse_s)  # -inf: no span saw a key
    seen = m > float("-inf")
    m = tl.where(seen, m, 0.0)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for slot in range(first, first + count):
        part = (offs_r + slot * rows).to(tl.int64)
        w = tl.math.exp2(tl.load(lse_part + part, mask=row_ok, other=float("-inf")) - m)
        total += w
        acc += tl.load(o_part + part[:, None] * DV + offs_c[None, :], mask=row_ok[:, None], other=0.0) * w[:, None]
    total = tl.where(seen, total, 1.0)
    tok = offs_r // H
    head = offs_r % H
    o_row = out + b.to(tl.int64) * stride_ob + tok * stride_os + head * stride_oh
    tl.store(o_row[:, None] + offs_c[None, :], (acc / total[:, None]).to(out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse + b.to(tl.int64) * stride_lb + head * stride_lh + tok * stride_ls,
             tl.where(seen, (m + tl.math.log2(total)) * LN2, float("-inf")), mask=row_ok & (tl.program_id(1) == 0))


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def num_sms(device, interpreted: int) -> int:
    """The device's SM count; `interpreted` under the interpreter (small, so tiny batches still split)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return interpreted


def row_tiling(q, k_cache, out) -> tuple[int, int, int]:
    """(rows, BLOCK_M, row tiles) of a request, after checking the layout the kernels assume."""
    batch, s_q, heads, head_dim = q.shape
    assert head_dim == HEAD_DIM and k_cache.shape[1] == BLOCK_SIZE and k_cache.shape[2] == 1
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and out.stride(-1) == 1
    rows = s_q * heads
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    return rows, block_m, triton.cdiv(rows, block_m)


def strides(q, k_cache, block_table, out, lse) -> tuple[int, ...]:
    """The strides every decode kernel takes, in the order `attend` and `store_rows` name them."""
    return (q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), block_table.stride(0),
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), lse.stride(2))
