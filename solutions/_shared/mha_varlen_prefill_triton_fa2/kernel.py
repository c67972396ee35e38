"""Causal varlen MHA prefill (flash_attn_varlen_func semantics, bottom-right causal) in Triton.

Work decomposition (FlashAttention-2 forward)
  * A program owns BLOCK_M consecutive queries of one sequence and one head; the grid is
    (heads, query tiles) so all heads of a tile start together. A small kernel maps tile slots to
    (sequence, tile) on the device from cu_seqlens_q (per-sequence tile counts and a prefix sum), so
    nothing is read back to the host: the grid is an upper bound and spare programs exit at once.
    Within a sequence the last tile, which sees the most keys, is handed out first.
  * The keys loop runs over BLOCK_N keys at a time: q.k^T and p.v on tensor cores (tl.dot, bf16 in,
    fp32 accumulate). A key dimension that is not a power of two (192 = 128 + 64) is split into two
    dots into the same accumulator.
  * Bottom-right causal: query i of q_len sees keys j <= k_len - q_len + i. Key blocks every row of
    the tile sees run without masks; only the blocks crossing the diagonal are masked, and blocks
    after the tile's last visible key are never visited.
  * Base-2 online softmax with softmax_scale * log2(e) folded into one multiply; lse is written as a
    natural log, [total_q, heads].
"""

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# Launch configuration on the GPU (BLOCK_M queries x BLOCK_N keys per step).
BLOCK_M = 128
BLOCK_N = 64
NUM_WARPS = 8
NUM_STAGES = 2


@triton.jit
def _attend(acc, l_i, m_i, qa, qb, k_head, v_head, stride_kt, stride_vt, start, kv_hi, offs_m, diag, qk_scale,
            DA: tl.constexpr, DB: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
            F32_DOT: tl.constexpr):
    """One block of BLOCK_N keys starting at `start`. Pointer tiles are formed here from the head's
    base pointers: carried through the loop they would hold a 64-bit address per element."""
    offs_n = start + tl.arange(0, BLOCK_N)
    k_rows = k_head + offs_n.to(tl.int64)[:, None] * stride_kt
    ka_ptrs = k_rows + tl.arange(0, DA)[None, :]
    v_ptrs = v_head + offs_n.to(tl.int64)[:, None] * stride_vt + tl.arange(0, DV)[None, :]
    if MASKED:
        in_range = (offs_n < kv_hi)[:, None]
        ka = tl.load(ka_ptrs, mask=in_range, other=0.0)
        vv = tl.load(v_ptrs, mask=in_range, other=0.0)
    else:
        ka = tl.load(ka_ptrs)
        vv = tl.load(v_ptrs)
    if F32_DOT:
        ka = ka.to(tl.float32)
        vv = vv.to(tl.float32)
    s = tl.dot(qa, tl.trans(ka))
    if DB > 0:
        kb_ptrs = k_rows + DA + tl.arange(0, DB)[None, :]
        if MASKED:
            kb = tl.load(kb_ptrs, mask=in_range, other=0.0)
        else:
            kb = tl.load(kb_ptrs)
        if F32_DOT:
            kb = kb.to(tl.float32)
        s = tl.dot(qb, tl.trans(kb), s)
    s = s * qk_scale
    if MASKED:
        s = tl.where(offs_n[None, :] <= diag + offs_m[:, None], s, float("-inf"))  # also hides keys >= kv_hi
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if F32_DOT:
        acc = tl.dot(p, vv, acc)
    else:
        acc = tl.dot(p.to(vv.dtype), vv, acc)
    return acc, l_i, m_new


TILE_INFO = 2  # int32 slots per query tile in the schedule: sequence, tile index


@triton.jit
def _schedule_kernel(cu_seqlens_q, sched, num_seqs, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
    """Maps query-tile slot `pid` to (sequence, tile): tiles of sequence b come after all tiles of
    sequences < b, and inside a sequence the last (heaviest) tile comes first. Spare slots get -1."""
    pid = tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_B)
    valid = offs_b < num_seqs
    q_lo = tl.load(cu_seqlens_q + offs_b, mask=valid, other=0)
    q_hi = tl.load(cu_seqlens_q + offs_b + 1, mask=valid, other=0)
    tiles = tl.where(valid, (q_hi - q_lo + BLOCK_M - 1) // BLOCK_M, 0)
    ends = tl.cumsum(tiles, axis=0)
    seq = tl.sum((ends <= pid).to(tl.int32), axis=0)
    first = tl.sum(tl.where(offs_b == seq, ends - tiles, 0), axis=0)
    count = tl.sum(tl.where(offs_b == seq, tiles, 0), axis=0)
    has = pid < tl.sum(tiles, axis=0)
    tl.store(sched + pid * 2, tl.where(has, seq, -1))
    tl.store(sched + pid * 2 + 1, count - 1 - (pid - first))


@triton.jit
def _prefill_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, sched, out, lse, qk_scale,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_ot, stride_oh, stride_lt, stride_lh,
                    DA: tl.constexpr, DB: tl.constexpr, DV: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr):
    head = tl.program_id(0)
    pid = tl.program_id(1)
    seq = tl.load(sched + pid * 2)
    if seq >= 0:
        tile = tl.load(sched + pid * 2 + 1)
        q_start = tl.load(cu_seqlens_q + seq)
        q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
        k_start = tl.load(cu_seqlens_k + seq)
        k_len = tl.load(cu_seqlens_k + seq + 1) - k_start
        diag = k_len - q_len  # query i sees keys j <= diag + i
        m0 = tile * BLOCK_M
        kv_hi = tl.minimum(k_len, diag + m0 + BLOCK_M)  # keys the tile's last row can see: [0, kv_hi)
        full_hi = tl.minimum(kv_hi, tl.maximum(diag + m0 + 1, 0))  # keys every row sees: [0, full_hi)
        n_full = (full_hi // BLOCK_N) * BLOCK_N

        offs_m = m0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m < q_len
        q_rows = (q_start + offs_m).to(tl.int64)
        q_ptrs = q + q_rows[:, None] * stride_qt + head * stride_qh
        offs_a = tl.arange(0, DA)
        qa = tl.load(q_ptrs + offs_a[None, :], mask=row_ok[:, None], other=0.0)
        if DB > 0:
            qb = tl.load(q_ptrs + DA + tl.arange(0, DB)[None, :], mask=row_ok[:, None], other=0.0)
        else:
            qb = qa
        if F32_DOT:
            qa = qa.to(tl.float32)
            qb = qb.to(tl.float32)
        k_head = k + k_start.to(tl.int64) * stride_kt + head * stride_kh
        v_head = v + k_start.to(tl.int64) * stride_vt + head * stride_vh

        acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        for start in range(0, n_full, BLOCK_N):
            acc, l_i, m_i = _attend(acc, l_i, m_i, qa, qb, k_head, v_head, stride_kt, stride_vt, start, kv_hi, offs_m,
                                    diag, qk_scale, DA, DB, DV, BLOCK_N, False, F32_DOT)
        for start in range(n_full, kv_hi, BLOCK_N):
            acc, l_i, m_i = _attend(acc, l_i, m_i, qa, qb, k_head, v_head, stride_kt, stride_vt, start, kv_hi, offs_m,
                                    diag, qk_scale, DA, DB, DV, BLOCK_N, True, F32_DOT)

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        offs_v = tl.arange(0, DV)
        o_rows = (q_start + offs_m).to(tl.int64)
        tl.store(out + o_rows[:, None] * stride_ot + head * stride_oh + offs_v[None, :],
                 o.to(out.dtype.element_ty), mask=row_ok[:, None])
        tl.store(lse + o_rows * stride_lt + head * stride_lh, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453,
                 mask=row_ok)


def _interpreting():
    return os.environ.get("TRITON_INTERPRET") == "1"


def launch(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, out, lse,
           block_m=None, block_n=None, num_warps=NUM_WARPS, num_stages=NUM_STAGES):
    total_q, heads, head_dim_qk = q.shape
    head_dim_v = v.shape[-1]
    assert k.shape[1] == heads, "h_kv == h"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and out.stride(-1) == 1
    num_seqs = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or num_seqs <= 0:
        return
    interp = _interpreting()
    # The interpreter runs the same code on small tiles, so tiny workloads cover both key loops.
    block_m = block_m or (16 if interp else BLOCK_M)
    block_n = block_n or (16 if interp else BLOCK_N)
    da = triton.next_power_of_2(head_dim_qk) // 2 if head_dim_qk & (head_dim_qk - 1) else head_dim_qk
    db = head_dim_qk - da
    assert db == 0 or db & (db - 1) == 0, "the key dimension must be a power of two or a sum of two"
    # Upper bound on query tiles without reading cu_seqlens_q: each sequence adds at most one partial tile.
    programs = min((total_q + num_seqs * (block_m - 1)) // block_m, total_q)
    block_b = max(16, triton.next_power_of_2(num_seqs))
    sched = torch.empty(programs * TILE_INFO, dtype=torch.int32, device=q.device)
    _schedule_kernel[(programs,)](cu_seqlens_q, sched, num_seqs, BLOCK_M=block_m, BLOCK_B=block_b,
                                  num_warps=4 if block_b > 512 else 1)
    _prefill_kernel[(heads, programs)](
        q, k, v, cu_seqlens_q, cu_seqlens_k, sched, out, lse, float(softmax_scale) * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        DA=da, DB=db, DV=head_dim_v, BLOCK_M=block_m, BLOCK_N=block_n, F32_DOT=interp,
        num_warps=num_warps, num_stages=num_stages,
    )


def run(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, out, lse):
    launch(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, out, lse)
