"""FlashMLA-form dense MLA decode in Triton, with the keys of the whole batch split evenly.

Same tiles and math as triton_splitkv (a program owns BLOCK_M (draft token x head) rows of one
request, walks one 64-token cache block per step, latent part loaded once for q.k^T and p.v,
FlashMLA's causal rule, base-2 online softmax), but a different partition of the keys:

  * Work units: the batch's keys are cut into chunks of one size, chosen so that about
    TARGET units cover all of them (5/4 of an even share, rounded up to whole cache blocks, at
    least MIN_CHUNK keys). Request b gets n_b = ceil(L_b / chunk) units, so a 64k request among
    1k ones is cut into many units while the short ones stay whole, and every unit does about
    the same work. The slack of 5/4 keeps a uniform batch that nearly fills the GPU unsplit.
  * No host sync: every program loads all cache_seqlens (one vector load), computes the chunk,
    the n_b and their running sum, and finds which (request, split) its unit index is. The grid
    is sized on the host from shapes alone (TARGET + batch units bound the total), and programs
    past the last unit return at once.
  * A request in one unit is finished in place (bf16 out, natural-log lse); a split one leaves an
    fp32 partial and base-2 lse per unit in slot `unit` (unique), combined by a merge kernel that
    recomputes the same schedule.
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
MIN_CHUNK = 256  # keys: shorter units would spend more on their partial than on their keys
MERGE_ROWS = 16  # rows per merge program


@triton.jit
def _schedule(cache_seqlens, batch, target_units, BATCH_P2: tl.constexpr, BLOCK_N: tl.constexpr,
              MIN_KEYS: tl.constexpr):
    """(chunk, units of each request, exclusive running sum of those units) as vectors over the batch."""
    offs_b = tl.arange(0, BATCH_P2)
    in_batch = offs_b < batch
    lengths = tl.load(cache_seqlens + offs_b, mask=in_batch, other=0)
    total = tl.sum(lengths, axis=0)
    chunk = tl.cdiv(tl.cdiv(total * 5, target_units * 4), BLOCK_N) * BLOCK_N
    chunk = tl.maximum(chunk, MIN_KEYS)
    units = tl.where(in_batch, tl.maximum(tl.cdiv(lengths, chunk), 1), 0)
    ends = tl.cumsum(units, axis=0)
    return chunk, units, ends - units, offs_b


@triton.jit
def _decode_kernel(q, k_cache, block_table, cache_seqlens, out, lse, o_part, lse_part,
                   qk_scale, batch, target_units, rows,
                   stride_qb, stride_qs, stride_qh, stride_kb, stride_kt, stride_tb,
                   stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                   H: tl.constexpr, S_Q: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BATCH_P2: tl.constexpr, MIN_KEYS: tl.constexpr,
                   F32_DOT: tl.constexpr):
    tile = tl.program_id(0)
    unit = tl.program_id(1)
    chunk, units, starts, offs_b = _schedule(cache_seqlens, batch, target_units, BATCH_P2, BLOCK_N, MIN_KEYS)
    b = tl.sum((starts + units <= unit) & (offs_b < batch), axis=0)  # requests wholly before this unit
    if b < batch:
        split = unit - tl.sum(tl.where(offs_b == b, starts, 0), axis=0)
        n_b = tl.sum(tl.where(offs_b == b, units, 0), axis=0)
        length = tl.load(cache_seqlens + b)

        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < rows
        tok = offs_m // H
        head = offs_m % H
        limit = tl.where(row_ok, length - S_Q + tok + 1, 0)  # keys [0, limit) are visible to the row
        k_lo = split * chunk
        k_hi = tl.minimum(k_lo + chunk, tl.max(limit, axis=0))

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
        if n_b > 1:
            part = unit.to(tl.int64) * rows + offs_m
            tl.store(o_part + part[:, None] * DV + offs_v[None, :], o, mask=row_ok[:, None])
            tl.store(lse_part + part, lse2, mask=row_ok)
        else:
            o_row = out + b.to(tl.int64) * stride_ob + tok * stride_os + head * stride_oh
            tl.store(o_row[:, None] + offs_v[None, :], o.to(out.dtype.element_ty), mask=row_ok[:, None])
            tl.store(lse + b.to(tl.int64) * stride_lb + head * stride_lh + tok * stride_ls,
                     lse2 * 0.6931471805599453, mask=row_ok)


@triton.jit
def _merge_kernel(cache_seqlens, o_part, lse_part, out, lse, batch, target_units, rows,
                  stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                  H: tl.constexpr, DV: tl.constexpr, BLOCK_R: tl.constexpr, BATCH_P2: tl.constexpr,
                  BLOCK_N: tl.constexpr, MIN_KEYS: tl.constexpr):
    """Combines the units of BLOCK_R rows of one split request, weighting each partial by
    exp2(its lse - the running max). Requests in one unit were finished by the decode kernel."""
    b = tl.program_id(1)
    chunk, units, starts, offs_b = _schedule(cache_seqlens, batch, target_units, BATCH_P2, BLOCK_N, MIN_KEYS)
    n_b = tl.sum(tl.where(offs_b == b, units, 0), axis=0)
    if n_b > 1:
        first = tl.sum(tl.where(offs_b == b, starts, 0), axis=0)
        offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = offs_r < rows
        offs_v = tl.arange(0, DV)
        m = tl.full([BLOCK_R], -1.0e30, dtype=tl.float32)
        total = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, DV], dtype=tl.float32)
        for split in range(0, n_b):
            part = (first + split).to(tl.int64) * rows + offs_r
            lse_s = tl.load(lse_part + part, mask=row_ok, other=float("-inf"))  # -inf: the unit saw no key
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
    return 4  # the interpreter: few units, so tiny batches still split


def launch(q, k_cache, block_table, cache_seqlens, softmax_scale, out, lse, target_units=None, min_chunk=MIN_CHUNK):
    batch, s_q, heads, head_dim = q.shape
    assert head_dim == HEAD_DIM and k_cache.shape[1] == BLOCK_SIZE and k_cache.shape[2] == 1
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and out.stride(-1) == 1
    if batch == 0 or s_q == 0:  # no query rows: nothing to write, and no row tiles to size the grid by
        return
    rows = s_q * heads
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    row_tiles = triton.cdiv(rows, block_m)
    if target_units is None:  # about two programs per SM, counting the row tiles of each unit
        target_units = max(1, triton.cdiv(2 * _num_sms(q.device), row_tiles))
    max_units = target_units + batch  # sum of ceil(L_b / chunk) with chunk >= total / target_units
    o_part = torch.empty(max_units * rows * HEAD_DIM_V, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(max_units * rows, dtype=torch.float32, device=q.device)
    interp = _interpreting()
    common = dict(BATCH_P2=triton.next_power_of_2(batch), BLOCK_N=BLOCK_SIZE, MIN_KEYS=min_chunk)
    _decode_kernel[(row_tiles, max_units)](
        q, k_cache, block_table, cache_seqlens, out, lse, o_part, lse_part,
        float(softmax_scale) * LOG2E, batch, target_units, rows,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        H=heads, S_Q=s_q, DV=HEAD_DIM_V, DR=HEAD_DIM_ROPE, BLOCK_M=block_m, F32_DOT=interp,
        num_warps=8 if block_m >= 64 else 4, num_stages=2, **common,
    )
    _merge_kernel[(triton.cdiv(rows, MERGE_ROWS), batch)](
        cache_seqlens, o_part, lse_part, out, lse, batch, target_units, rows,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        H=heads, DV=HEAD_DIM_V, BLOCK_R=MERGE_ROWS, num_warps=4, **common,
    )


def run(q, k_cache, block_table, cache_seqlens, softmax_scale, out, lse):
    launch(q, k_cache, block_table, cache_seqlens, softmax_scale, out, lse)
