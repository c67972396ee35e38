"""Causal MLA paged prefill (absorbed MLA, 16 heads, ckv 512 + kpe 64, page size 1) in Triton.

Work decomposition
  * A tile is TOK = BLOCK_M // 16 consecutive query tokens of one request times all 16 heads
    (BLOCK_M = 64 rows: 4 tokens x 16 heads), so every KV block gathered from the page table serves
    all heads of those tokens. Tiles are aligned to the END of each request: tile j of a request
    covers tokens [q_len - (j+1)*TOK, q_len - j*TOK), so it needs keys [0, kv_len - j*TOK) and the
    first tile of a request may be partial.
  * Tiles run longest first across the whole batch: tile (b, j) sits on level
    (E - kv_len_b) // TOK + j, where E is the longest kv_len. A one-warp schedule kernel maps each
    program id to its tile by a binary search over levels and writes (q_start, q_len, kv_start,
    kv_len, tile) per program, so nothing is read back to the host; the grid is an upper bound on
    the tile count (total_q / TOK + requests) and spare programs exit at once.
  * Inner loop over KV blocks of BLOCK_N pages, double-buffered (cp.async): the ckv block is loaded
    once into shared memory and serves as the key part of q.k^T and as the value of p.v, both on
    tensor cores (wgmma); keys past the tile's last visible key are never visited. The 64 x 512 fp32
    accumulator is spread over 8 warps (two warp groups, 256 value columns each).
  * Base-2 online softmax: scores are scaled by sm_scale * log2(e) before the mask (any scale, zero
    and negative included) and the running max is kept in those units.
  * Rows that see no key write output 0 and lse -inf.

Measured on an H200 (triton 3.6): 1 x 8192 causal ~4.06 ms (~288 TFLOP/s). Triton lays out the score
tile of a chained dot over warps along rows only (warpsPerCTA [8, 1]); with 64 rows both warp groups
then compute the whole 64 x BLOCK_N score tile (q.k^T is done twice, as 64x32 wgmma tiles that read
the query tile from shared memory twice as often), and that, not memory, bounds this kernel."""

import os

import torch
import triton
import triton.language as tl

import fast_launch  # solutions/_shared/triton_fast_launch

NUM_HEADS = 16
HEAD_DIM_CKV = 512
HEAD_DIM_KPE = 64
LOG2E = 1.4426950408889634

# Default launch configuration (tuned on an H200).
BLOCK_M = 64
BLOCK_N = 64
NUM_WARPS = 8
NUM_STAGES = 2
SINGLE_LOOP = True


@triton.jit
def _tile_of(pid, qo_indptr, kv_indptr, num_req, TOK: tl.constexpr, BLOCK_B: tl.constexpr):
    """Maps a program id to (request, tile-from-end) in longest-first order; request -1 if none."""
    offs = tl.arange(0, BLOCK_B)
    valid = offs < num_req
    q0 = tl.load(qo_indptr + offs, mask=valid, other=0)
    q1 = tl.load(qo_indptr + offs + 1, mask=valid, other=0)
    k0 = tl.load(kv_indptr + offs, mask=valid, other=0)
    k1 = tl.load(kv_indptr + offs + 1, mask=valid, other=0)
    n_tiles = tl.where(valid, (q1 - q0 + TOK - 1) // TOK, 0)
    kv_len = k1 - k0
    longest = tl.max(tl.where(n_tiles > 0, kv_len, 0), axis=0)
    level0 = tl.where(n_tiles > 0, (longest - kv_len) // TOK, 0)
    total = tl.sum(n_tiles, axis=0)
    lo = pid * 0
    hi = tl.max(tl.where(n_tiles > 0, level0 + n_tiles - 1, 0), axis=0)
    # smallest level L with (number of tiles on levels <= L) > pid
    while lo < hi:
        mid = (lo + hi) // 2
        cnt = tl.sum(tl.minimum(tl.maximum(mid - level0 + 1, 0), n_tiles), axis=0)
        if cnt > pid:
            hi = mid
        else:
            lo = mid + 1
    before = tl.sum(tl.minimum(tl.maximum(lo - level0, 0), n_tiles), axis=0)
    on_level = (level0 <= lo) & (lo < level0 + n_tiles)
    rank = tl.cumsum(on_level.to(tl.int32), axis=0)
    pick = on_level & (rank == pid - before + 1)
    req = tl.max(tl.where(pick, offs, -1), axis=0)
    tile = tl.sum(tl.where(pick, lo - level0, 0), axis=0)
    req = tl.where(pid < total, req, -1)
    return req, tile


TILE_INFO = 8  # int32 slots per program in the schedule: q_start, q_len, kv_start, kv_len, tile


@triton.jit(do_not_specialize=["num_req"])
def _schedule_kernel(qo_indptr, kv_indptr, sched, num_req, TOK: tl.constexpr, BLOCK_B: tl.constexpr):
    pid = tl.program_id(0)
    req, tile = _tile_of(pid, qo_indptr, kv_indptr, num_req, TOK, BLOCK_B)
    has = req >= 0
    r = tl.maximum(req, 0)
    q_start = tl.load(qo_indptr + r)
    q_len = tl.load(qo_indptr + r + 1) - q_start
    kv_start = tl.load(kv_indptr + r)
    kv_len = tl.load(kv_indptr + r + 1) - kv_start
    base = sched + pid * 8
    tl.store(base + 0, q_start)
    tl.store(base + 1, tl.where(has, q_len, 0))
    tl.store(base + 2, kv_start)
    tl.store(base + 3, kv_len)
    tl.store(base + 4, tile)


@triton.jit
def _attend_block(acc, l_i, m_i, qn, qp, start, kv_hi, row_limit,
                  ckv_cache, kpe_cache, kv_indices, kv_start, stride_ckv, stride_kpe, qk_scale,
                  D: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASKED: tl.constexpr, F32_DOT: tl.constexpr):
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_dp = tl.arange(0, DP)
    if MASKED:
        page = tl.load(kv_indices + kv_start + offs_n, mask=offs_n < kv_hi, other=0)
    else:
        page = tl.load(kv_indices + kv_start + offs_n)
    page = page.to(tl.int64)
    ckv = tl.load(ckv_cache + page[:, None] * stride_ckv + offs_d[None, :])  # [BLOCK_N, D]
    kpe = tl.load(kpe_cache + page[:, None] * stride_kpe + offs_dp[None, :])  # [BLOCK_N, DP]
    if F32_DOT:
        ckv = ckv.to(tl.float32)
        kpe = kpe.to(tl.float32)
    s = tl.dot(qn, tl.trans(ckv))
    s = tl.dot(qp, tl.trans(kpe), s)
    # Scale before masking: a masked -inf times qk_scale <= 0 would be NaN or +inf, and for
    # qk_scale < 0 max(s) * qk_scale is not the maximum of the scaled scores.
    s = s * qk_scale
    if MASKED:
        s = tl.where(offs_n[None, :] < row_limit[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    acc = acc * alpha[:, None]
    l_i = l_i * alpha
    m_i = m_new
    p = tl.math.exp2(s - m_i[:, None])
    l_i = l_i + tl.sum(p, axis=1)
    if not F32_DOT:
        p = p.to(ckv.dtype)
    acc = tl.dot(p, ckv, acc)  # ckv, already in shared memory, is also the value
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(q_nope, q_pe, ckv_cache, kpe_cache, kv_indices, sched,
                    output, lse, qk_scale,
                    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_ckv, stride_kpe,
                    stride_o_t, stride_o_h, stride_l_t, stride_l_h,
                    H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    SINGLE_LOOP: tl.constexpr, F32_DOT: tl.constexpr):
    TOK: tl.constexpr = BLOCK_M // H
    pid = tl.program_id(0)
    info = sched + pid * 8
    q_start = tl.load(info + 0)
    q_len = tl.load(info + 1)
    kv_start = tl.load(info + 2)
    kv_len = tl.load(info + 3)
    tile = tl.load(info + 4)
    if q_len > 0:
        diag = kv_len - q_len  # token t sees keys n <= diag + t
        tok_hi = q_len - tile * TOK
        tok_lo = tok_hi - TOK
        kv_hi = tl.minimum(tl.maximum(diag + tok_hi, 0), kv_len)  # keys the tile needs: [0, kv_hi)
        full_hi = tl.minimum(tl.maximum(diag + tl.maximum(tok_lo, 0) + 1, 0), kv_hi)
        n_full = (full_hi // BLOCK_N) * BLOCK_N  # [0, n_full) visible to every row

        offs_m = tl.arange(0, BLOCK_M)
        tok = tok_lo + offs_m // H
        head = offs_m % H
        row_ok = tok >= 0
        row_limit = diag + tok + 1
        q_row = (q_start + tok).to(tl.int64)
        offs_d = tl.arange(0, D)
        offs_dp = tl.arange(0, DP)
        qn = tl.load(q_nope + q_row[:, None] * stride_qn_t + head[:, None] * stride_qn_h + offs_d[None, :],
                     mask=row_ok[:, None], other=0.0)
        qp = tl.load(q_pe + q_row[:, None] * stride_qp_t + head[:, None] * stride_qp_h + offs_dp[None, :],
                     mask=row_ok[:, None], other=0.0)
        if F32_DOT:
            qn = qn.to(tl.float32)
            qp = qp.to(tl.float32)

        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        if SINGLE_LOOP:
            # one pipelined loop, causal mask on every block: one pipeline fill per tile
            for start in range(0, kv_hi, BLOCK_N):
                acc, l_i, m_i = _attend_block(acc, l_i, m_i, qn, qp, start, kv_hi, row_limit,
                                              ckv_cache, kpe_cache, kv_indices, kv_start, stride_ckv,
                                              stride_kpe, qk_scale, D, DP, BLOCK_N,
                                              True, F32_DOT)
        else:
            # unmasked blocks, then the one or two blocks that cross the diagonal
            for start in range(0, n_full, BLOCK_N):
                acc, l_i, m_i = _attend_block(acc, l_i, m_i, qn, qp, start, kv_hi, row_limit,
                                              ckv_cache, kpe_cache, kv_indices, kv_start, stride_ckv,
                                              stride_kpe, qk_scale, D, DP, BLOCK_N,
                                              False, F32_DOT)
            for start in range(n_full, kv_hi, BLOCK_N):
                acc, l_i, m_i = _attend_block(acc, l_i, m_i, qn, qp, start, kv_hi, row_limit,
                                              ckv_cache, kpe_cache, kv_indices, kv_start, stride_ckv,
                                              stride_kpe, qk_scale, D, DP, BLOCK_N,
                                              True, F32_DOT)

        seen = l_i > 0.0
        inv_l = tl.where(seen, 1.0 / tl.where(seen, l_i, 1.0), 0.0)
        out = acc * inv_l[:, None]
        o_row = (q_start + tok).to(tl.int64)
        tl.store(output + o_row[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :],
                 out.to(output.dtype.element_ty), mask=row_ok[:, None])
        lse_val = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(lse + o_row * stride_l_t + head * stride_l_h, lse_val, mask=row_ok)


def _interpreting():
    return os.environ.get("TRITON_INTERPRET") == "1"


def launch(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, sm_scale, output, lse,
           block_n=None, num_warps=None, num_stages=None, single_loop=None):
    """Writes attention output and base-2 lse into output / lse. Keyword arguments override the defaults."""
    block_n = BLOCK_N if block_n is None else block_n
    num_warps = NUM_WARPS if num_warps is None else num_warps
    num_stages = NUM_STAGES if num_stages is None else num_stages
    single_loop = SINGLE_LOOP if single_loop is None else single_loop

    total_q, num_heads, head_dim = q_nope.shape
    head_dim_pe = q_pe.shape[-1]
    assert num_heads == NUM_HEADS and head_dim == HEAD_DIM_CKV and head_dim_pe == HEAD_DIM_KPE
    assert ckv_cache.shape[1] == 1 and kpe_cache.shape[1] == 1, "page size 1"
    assert q_nope.stride(-1) == 1 and q_pe.stride(-1) == 1 and output.stride(-1) == 1
    assert ckv_cache.stride(-1) == 1 and kpe_cache.stride(-1) == 1
    num_req = qo_indptr.shape[0] - 1
    if total_q == 0 or num_req <= 0:
        return
    tok = BLOCK_M // NUM_HEADS
    # Upper bound on tiles without reading the indptr arrays: each request adds at most one partial tile.
    num_programs = min(-(-total_q // tok) + num_req, total_q)
    block_b = max(16, 1 << (num_req - 1).bit_length())
    interp = _interpreting()
    qo_indptr = qo_indptr.to(torch.int32)
    kv_indptr = kv_indptr.to(torch.int32)
    kv_indices = kv_indices.to(torch.int32)

    sched = torch.empty(num_programs * TILE_INFO, dtype=torch.int32, device=q_nope.device)
    device = q_nope.device
    fast_launch.launch(_schedule_kernel, (num_programs, 1, 1), (qo_indptr, kv_indptr, sched, num_req),
            dict(TOK=tok, BLOCK_B=block_b), 4 if block_b > 512 else 1, 3, device)
    fast_launch.launch(
        _prefill_kernel, (num_programs, 1, 1),
        (q_nope, q_pe, ckv_cache, kpe_cache, kv_indices, sched,
         output, lse, float(sm_scale) * LOG2E,
         q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
         ckv_cache.stride(0), kpe_cache.stride(0),
         output.stride(0), output.stride(1), lse.stride(0), lse.stride(1)),
        dict(H=NUM_HEADS, D=HEAD_DIM_CKV, DP=HEAD_DIM_KPE, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
             SINGLE_LOOP=single_loop, F32_DOT=interp),
        num_warps, num_stages, device,
    )


def run(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, sm_scale, output, lse):
    launch(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, sm_scale, output, lse)
