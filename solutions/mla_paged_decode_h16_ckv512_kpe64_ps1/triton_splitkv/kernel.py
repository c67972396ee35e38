"""MLA paged decode (16 heads, ckv 512, kpe 64, page size 1) in Triton.

Work partition: the flattened KV tokens of the whole batch (kv_indices, request after
request) are cut into about NUM_UNITS chunks of equal token count (at least MIN_CHUNK
tokens; a whole fraction of the mean request length, so that a uniform batch cuts every
request into equal parts), one program per chunk, so a batch with one 64k request among
short ones keeps every SM busy just like a uniform batch. A chunk may cross request boundaries: the program walks
the requests it overlaps and processes one segment per request. No host synchronisation:
the chunk size follows from len(kv_indices), which the definition makes equal to
kv_indptr[-1], and each program finds its first request with one vector compare over
kv_indptr.

Each program handles all 16 heads at once, so every KV tile is loaded once and serves
both q.k^T (ckv|kpe as keys) and p.v (ckv as values). Logits are scaled by
sm_scale*log2(e) and exponentiated with exp2 (online softmax, base 2).

A request that lies inside one chunk is finished in place (bf16 output and lse). A
request cut by chunk boundaries leaves one fp32 partial output and partial lse per chunk
in slot (request + chunk) -- unique, since requests and chunks are both ordered along the
flattened token axis -- and a small merge kernel combines them with exp2(lse_j - max)
weights. The merge kernel also writes output 0 and lse -inf for empty requests.
"""

import os

import torch
import triton
import triton.language as tl

import fast_launch  # solutions/_shared/triton_fast_launch

LOG2E = 1.4426950408889634

# Measured best on an H200 (block of 32 tokens, 4 warps, 5 pipeline stages = 2 KV tiles in
# flight, 2 programs per SM); every value is overridable in launch(). aligned: chunks are a whole
# fraction of the mean request length, so that a uniform batch cuts every request into the same
# number of parts and no chunk straddles two requests (on an H200, 7-8 µs less on b64_l4096 and
# b128_l1024 than equal cuts of the flattened tokens). merge=None picks the merge tiling by the
# parts per request (MANY_PARTS).
DEFAULTS = dict(block_n=32, num_warps=4, num_stages=5, units_per_sm=2, min_chunk=64, merge=None, aligned=True)


@triton.jit(do_not_specialize=["batch", "total", "chunk"])
def _mla_decode_split_kernel(
    q_nope, q_pe, ckv, kpe, kv_indptr, kv_indices,
    out, lse, part_o, part_lse,
    batch, total, chunk, scale_log2,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h,
    stride_ckv, stride_kpe, stride_o_b, stride_o_h, stride_l_b,
    H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, UPCAST: tl.constexpr,
):
    # The 512 ckv columns are handled as four quarters: q.k^T becomes five independent
    # products (four ckv quarters and kpe) whose sum is formed afterwards, which gives the
    # tensor cores five short accumulation chains instead of one long one; p.v writes four
    # independent accumulators.
    DQ: tl.constexpr = D // 4
    unit = tl.program_id(0)
    start = unit * chunk
    end = tl.minimum(start + chunk, total)
    if start < end:
        # First request whose KV extends past `start`: count requests that end at or before it.
        b = tl.sum(tl.zeros([BLOCK_B], dtype=tl.int32), axis=0)
        for i0 in range(0, batch, BLOCK_B):
            offs_b = i0 + 1 + tl.arange(0, BLOCK_B)
            ends = tl.load(kv_indptr + offs_b, mask=offs_b <= batch, other=2147483647)
            b += tl.sum((ends <= start).to(tl.int32), axis=0)

        offs_h = tl.arange(0, H)
        offs_q = tl.arange(0, DQ)
        offs_p = tl.arange(0, DP)
        offs_n0 = tl.arange(0, BLOCK_N)

        s = start
        while s < end:
            req_start = tl.load(kv_indptr + b)
            req_end = tl.load(kv_indptr + b + 1)
            seg_end = tl.minimum(end, req_end)
            if seg_end > s:
                qrow = q_nope + b.to(tl.int64) * stride_qn_b + offs_h[:, None] * stride_qn_h + offs_q[None, :]
                q0 = tl.load(qrow)
                q1 = tl.load(qrow + DQ)
                q2 = tl.load(qrow + 2 * DQ)
                q3 = tl.load(qrow + 3 * DQ)
                qp = tl.load(q_pe + b.to(tl.int64) * stride_qp_b + offs_h[:, None] * stride_qp_h + offs_p[None, :])
                if UPCAST:
                    q0 = q0.to(tl.float32)
                    q1 = q1.to(tl.float32)
                    q2 = q2.to(tl.float32)
                    q3 = q3.to(tl.float32)
                    qp = qp.to(tl.float32)
                m_i = tl.full([H], float("-inf"), dtype=tl.float32)
                l_i = tl.zeros([H], dtype=tl.float32)
                acc0 = tl.zeros([H, DQ], dtype=tl.float32)
                acc1 = tl.zeros([H, DQ], dtype=tl.float32)
                acc2 = tl.zeros([H, DQ], dtype=tl.float32)
                acc3 = tl.zeros([H, DQ], dtype=tl.float32)

                for n in range(s, seg_end, BLOCK_N):
                    offs_n = n + offs_n0
                    valid = offs_n < seg_end
                    # Out-of-range lanes read page 0 (always present); their logits are masked.
                    pages = tl.load(kv_indices + offs_n, mask=valid, other=0).to(tl.int64)
                    krow = ckv + pages[:, None] * stride_ckv + offs_q[None, :]
                    k0 = tl.load(krow)
                    k1 = tl.load(krow + DQ)
                    k2 = tl.load(krow + 2 * DQ)
                    k3 = tl.load(krow + 3 * DQ)
                    kp = tl.load(kpe + pages[:, None] * stride_kpe + offs_p[None, :])
                    if UPCAST:
                        k0 = k0.to(tl.float32)
                        k1 = k1.to(tl.float32)
                        k2 = k2.to(tl.float32)
                        k3 = k3.to(tl.float32)
                        kp = kp.to(tl.float32)
                    s0 = tl.dot(q0, tl.trans(k0)) * scale_log2
                    s1 = tl.dot(q1, tl.trans(k1)) * scale_log2
                    s2 = tl.dot(q2, tl.trans(k2)) * scale_log2
                    s3 = tl.dot(q3, tl.trans(k3)) * scale_log2
                    sp = tl.dot(qp, tl.trans(kp)) * scale_log2
                    sc = ((s0 + s1) + (s2 + s3)) + sp  # [H, N], base-2 scaled logits
                    sc = tl.where(valid[None, :], sc, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
                    alpha = tl.exp2(m_i - m_new)
                    p = tl.exp2(sc - m_new[:, None])
                    l_i = l_i * alpha + tl.sum(p, axis=1)
                    pv = p.to(k0.dtype)
                    acc0 = tl.dot(pv, k0, acc0 * alpha[:, None])
                    acc1 = tl.dot(pv, k1, acc1 * alpha[:, None])
                    acc2 = tl.dot(pv, k2, acc2 * alpha[:, None])
                    acc3 = tl.dot(pv, k3, acc3 * alpha[:, None])
                    m_i = m_new

                seg_lse = m_i + tl.log2(l_i)
                inv_l = 1.0 / l_i
                first_unit = req_start // chunk
                last_unit = (req_end - 1) // chunk
                if first_unit == last_unit:
                    optr = out + b.to(tl.int64) * stride_o_b + offs_h[:, None] * stride_o_h + offs_q[None, :]
                    odt = out.dtype.element_ty
                    tl.store(optr, (acc0 * inv_l[:, None]).to(odt))
                    tl.store(optr + DQ, (acc1 * inv_l[:, None]).to(odt))
                    tl.store(optr + 2 * DQ, (acc2 * inv_l[:, None]).to(odt))
                    tl.store(optr + 3 * DQ, (acc3 * inv_l[:, None]).to(odt))
                    tl.store(lse + b.to(tl.int64) * stride_l_b + offs_h, seg_lse)
                else:
                    slot = (b + unit).to(tl.int64)
                    pptr = part_o + slot * (H * D) + offs_h[:, None] * D + offs_q[None, :]
                    tl.store(pptr, acc0 * inv_l[:, None])
                    tl.store(pptr + DQ, acc1 * inv_l[:, None])
                    tl.store(pptr + 2 * DQ, acc2 * inv_l[:, None])
                    tl.store(pptr + 3 * DQ, acc3 * inv_l[:, None])
                    tl.store(part_lse + slot * H + offs_h, seg_lse)
            s = seg_end
            b += 1


@triton.jit(do_not_specialize=["chunk"])
def _mla_decode_merge_kernel(
    kv_indptr, out, lse, part_o, part_lse,
    chunk,
    stride_o_b, stride_o_h, stride_l_b,
    H: tl.constexpr, D: tl.constexpr, HB: tl.constexpr, BD: tl.constexpr, UB: tl.constexpr,
):
    # One program per (request, head block, column block); the partials of a request sit in
    # consecutive slots request + unit for unit in [first_unit, last_unit]. One pass with a running
    # maximum: the loads of each step do not wait on the previous step's.
    b = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_d = tl.program_id(2)
    offs_h = pid_h * HB + tl.arange(0, HB)
    offs_d = pid_d * BD + tl.arange(0, BD)
    offs_u = tl.arange(0, UB)
    req_start = tl.load(kv_indptr + b)
    req_end = tl.load(kv_indptr + b + 1)
    o_ptrs = out + b.to(tl.int64) * stride_o_b + offs_h[:, None] * stride_o_h + offs_d[None, :]
    l_ptrs = lse + b.to(tl.int64) * stride_l_b + offs_h
    lse_mask = (offs_h >= 0) & (pid_d == 0)
    if req_end <= req_start:
        tl.store(o_ptrs, tl.zeros([HB, BD], dtype=out.dtype.element_ty))
        tl.store(l_ptrs, tl.full([HB], float("-inf"), dtype=tl.float32), mask=lse_mask)
    else:
        first_unit = req_start // chunk
        num = (req_end - 1) // chunk - first_unit + 1
        if num > 1:
            base = (b + first_unit).to(tl.int64)
            m = tl.full([HB], float("-inf"), dtype=tl.float32)
            acc = tl.zeros([HB, BD], dtype=tl.float32)
            wsum = tl.zeros([HB], dtype=tl.float32)
            for u0 in range(0, num, UB):
                uu = u0 + offs_u
                um = uu < num
                lp = tl.load(part_lse + (base + uu[:, None]) * H + offs_h[None, :],
                             mask=um[:, None], other=float("-inf"))
                po = tl.load(part_o + (base + uu[:, None, None]) * (H * D) + offs_h[None, :, None] * D
                             + offs_d[None, None, :], mask=um[:, None, None], other=0.0)  # [UB, HB, BD]
                m_new = tl.maximum(m, tl.max(lp, axis=0))  # finite: every step has a part
                keep = tl.exp2(m - m_new)
                w = tl.exp2(lp - m_new[None, :])  # [UB, HB]
                wsum = wsum * keep + tl.sum(w, axis=0)
                acc = acc * keep[:, None] + tl.sum(w[:, :, None] * po, axis=0)
                m = m_new
            tl.store(o_ptrs, (acc / wsum[:, None]).to(out.dtype.element_ty))
            tl.store(l_ptrs, m + tl.log2(wsum), mask=lse_mask)


# Merge kernel tilings (heads per program, columns per program, partials per step, warps).
# One-warp programs measured fastest on every workload: many small programs fit per SM, so
# the few dependent loads of each program overlap across programs.
MERGE_TILINGS = {
    "fine": (2, 64, 32, 4),
    "fine1w": (2, 64, 16, 1),
    "coarse": (4, 128, 4, 4),
    "columns": (1, 32, 32, 1),
}
# From this many parts per request on average, "columns" (narrower programs, more of them, more
# parts per step): one request cut into ~260 parts merges in ~7 µs instead of ~11 µs on an H200;
# with few parts per request "fine1w" is faster (56 against 71 µs on b128_l1024, whole call).
MANY_PARTS = 32

_SM_COUNT = {}
_WORKSPACE = {}


def _num_sms(device):
    if device.type != "cuda":
        return 4
    key = device.index if device.index is not None else torch.cuda.current_device()
    n = _SM_COUNT.get(key)
    if n is None:
        n = torch.cuda.get_device_properties(key).multi_processor_count
        _SM_COUNT[key] = n
    return n


def _workspace(device, slots, heads, dim):
    key = (str(device), heads, dim)
    ws = _WORKSPACE.get(key)
    if ws is None or ws[1].shape[0] < slots:
        part_o = torch.empty(slots, heads, dim, dtype=torch.float32, device=device)
        part_lse = torch.empty(slots, heads, dtype=torch.float32, device=device)
        ws = (part_o, part_lse)
        _WORKSPACE[key] = ws
    return ws


def _chunk(total, batch, num_units, min_chunk, aligned):
    """Tokens per work unit for about num_units units."""
    if aligned and batch > 0:
        mean = -(-total // batch)
        parts = max(round(num_units / batch), 1)
        return max(-(-mean // parts), min_chunk, 1)
    return max(-(-total // num_units), min_chunk, 1)


def launch(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, output, lse,
           block_n=None, num_warps=None, num_stages=None, units_per_sm=None, min_chunk=None,
           num_units=None, merge=None, aligned=None):
    """Run the decode into output/lse; keyword arguments override DEFAULTS."""
    cfg = DEFAULTS
    block_n = cfg["block_n"] if block_n is None else block_n
    num_warps = cfg["num_warps"] if num_warps is None else num_warps
    num_stages = cfg["num_stages"] if num_stages is None else num_stages
    units_per_sm = cfg["units_per_sm"] if units_per_sm is None else units_per_sm
    min_chunk = cfg["min_chunk"] if min_chunk is None else min_chunk
    merge = cfg["merge"] if merge is None else merge
    aligned = cfg["aligned"] if aligned is None else aligned

    batch, heads, dim = q_nope.shape
    dim_pe = q_pe.shape[-1]
    device = q_nope.device
    if isinstance(sm_scale, torch.Tensor):
        sm_scale = float(sm_scale)
    total = kv_indices.shape[0]  # == kv_indptr[-1] by the definition's constraints
    if num_units is None:
        num_units = units_per_sm * _num_sms(device)
    chunk = _chunk(total, batch, num_units, min_chunk, aligned)
    units = -(-total // chunk) if total > 0 else 0
    part_o, part_lse = _workspace(device, batch + max(units, 1), heads, dim)
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"

    if units > 0:
        block_b = min(1 << max(batch - 1, 0).bit_length(), 1024)
        fast_launch.launch(
            _mla_decode_split_kernel, (units, 1, 1),
            (q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices,
             output, lse, part_o, part_lse,
             batch, total, chunk, float(sm_scale) * LOG2E,
             q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
             ckv_cache.stride(0), kpe_cache.stride(0), output.stride(0), output.stride(1), lse.stride(0)),
            dict(H=heads, D=dim, DP=dim_pe, BLOCK_N=block_n, BLOCK_B=block_b, UPCAST=interpret),
            num_warps, num_stages, device,
        )
    if batch > 0:
        if merge is None:
            merge = "columns" if units >= MANY_PARTS * batch else "fine1w"
        hb, bd, ub, warps = MERGE_TILINGS[merge]
        fast_launch.launch(
            _mla_decode_merge_kernel, (batch, heads // hb, dim // bd),
            (kv_indptr, output, lse, part_o, part_lse, chunk,
             output.stride(0), output.stride(1), lse.stride(0)),
            dict(H=heads, D=dim, HB=hb, BD=bd, UB=ub),
            warps, 2, device,
        )


def run(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, output, lse):
    launch(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, output, lse)
