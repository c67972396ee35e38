"""Sparse MLA decode over FlashMLA's FP8 KV cache (flash_mla_with_kvcache with is_fp8_kvcache and
indices: 656-byte tokens of 512 e4m3 latent values, four float32 tile scales and 64 bf16 rope
values; optional attention sink) in Triton.

One kernel, two forms (FORMS below), each with an entry point for the definitions without a sink and
one for those with attn_sink:
  * triton_fp8_splitk (run, run_sink): a tile of -1 entries is branched around (it costs one index
    load), and the branch keeps Triton from pipelining the loop (compiled for sm_90a the kernel has
    the same shared memory at 1, 2 or 3 stages: no gathers in flight across steps; it spills).
  * triton_fp8_pipelined (run_pipelined, run_sink_pipelined): no branch, so Triton pipelines the
    gathers (two stages; 255 registers, no spills, 185 KB of shared memory for sm_90a); a tile of -1
    entries costs its arithmetic but, its loads being masked, no memory traffic.

Work decomposition
  * A program owns one query token (of one request), BLOCK_H of its heads and one split of its
    topk index list, so every cache token it gathers serves all those heads.
  * The inner loop walks BLOCK_N index entries at a time: one load of BLOCK_N ids, then a gather of
    BLOCK_N packed tokens through three views of the same bytes (e4m3 latent values, float32 scales,
    bf16 rope values). The latent values are dequantized in registers (e4m3 -> fp32, times the
    power-of-two scale of their 128-value tile, exact in bf16) and the tile is used both as the key
    part of q.k^T and as the value of p.v, both on tensor cores (tl.dot, bf16 in, fp32 accumulate);
    the rope part joins q.k^T as a second dot. Entries of -1 are masked on load (their token is never
    read) and get logit -inf.
  * Base-2 online softmax with softmax_scale * log2(e) folded into one multiply; lse is written in
    natural log, [batch, heads, s_q] as FlashMLA lays it out. A row with no valid entry writes out 0
    and lse +inf (FlashMLA's convention). The sink scales out by 1 / (1 + e^(attn_sink - lse)).
  * Split-K over the index list only when the query tokens x head tiles leave SMs idle (chosen on
    the host from shapes, so there is no host sync): each split writes an fp32 partial and its base-2
    lse, and a combine kernel merges them; with one split the kernel writes out and lse directly.
  * Under Triton's interpreter (CPU checks) the dot operands are upcast to fp32, as its bf16 dot is
    wrong there, and the tiles are larger (all heads at once, at most two splits; the pipelined form,
    which computes every tile, also takes more entries per step), as its cost is per operation; the
    bf16 path and the launch configuration below run on the GPU. They are chosen, not tuned on an H200.
"""

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

HEAD_DIM = 576
HEAD_DIM_V = 512
HEAD_DIM_ROPE = HEAD_DIM - HEAD_DIM_V
TILE = 128
BYTES_PER_TOKEN = 656
SCALES_AT = HEAD_DIM_V // 4  # in float32 words: bytes 512..527
ROPE_AT = (HEAD_DIM_V + 16) // 2  # in bf16 words: bytes 528..655
LOG2E = 1.4426950408889634

# Launch configuration, both forms: 64 heads x 64 entries per step, 8 warps, two stages of KV tiles.
BLOCK_H = 64
BLOCK_N = 64
NUM_WARPS = 8
NUM_STAGES = 2
TARGET_PROGRAMS = 264  # two waves of the H200's 132 SMs
MAX_SPLITS = 16
COMBINE_HEADS = 4  # heads per combine program
INTERPRETER_MAX_SPLITS = 2


class Form(NamedTuple):
    skip_empty: bool  # branch around a tile of -1 entries
    interpreter_block_n: int  # entries per step under the interpreter


FORMS = {
    "triton_fp8_splitk": Form(skip_empty=True, interpreter_block_n=64),
    "triton_fp8_pipelined": Form(skip_empty=False, interpreter_block_n=256),  # every tile computed: few large steps
}


@triton.jit
def _attend_tile(qn, qr, k_fp8, k_scale, k_rope, idx, valid, m_i, l_i, acc, qk_scale, offs_v, offs_r,
                 DV: tl.constexpr, TILE: tl.constexpr, BYTES: tl.constexpr, SCALES_AT: tl.constexpr,
                 ROPE_AT: tl.constexpr, BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr):
    """One step of the online softmax over a gathered, dequantized tile of BLOCK_N index entries."""
    token = tl.where(valid, idx, 0).to(tl.int64)
    raw = tl.load(k_fp8 + token[:, None] * BYTES + offs_v[None, :], mask=valid[:, None], other=0.0)
    scale = tl.load(k_scale + token[:, None] * (BYTES // 4) + SCALES_AT + tl.arange(0, DV // TILE)[None, :],
                    mask=valid[:, None], other=0.0)  # [BLOCK_N, 4]
    kn = tl.reshape(raw.to(tl.float32), (BLOCK_N, DV // TILE, TILE)) * scale[:, :, None]
    kn = tl.reshape(kn, (BLOCK_N, DV))
    kr = tl.load(k_rope + token[:, None] * (BYTES // 2) + ROPE_AT + offs_r[None, :], mask=valid[:, None], other=0.0)
    if F32_DOT:
        kr = kr.to(tl.float32)
    else:
        kn = kn.to(tl.bfloat16)  # exact: power-of-two scales
    s = tl.dot(qn, tl.trans(kn))
    s = tl.dot(qr, tl.trans(kr), s)
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing valid yet
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(kn.dtype), kn, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _sparse_decode_kernel(q, k_fp8, k_scale, k_rope, indices, attn_sink, out, lse, o_part, lse_part,
                          qk_scale, num_tokens,
                          stride_qr, stride_qh, stride_ir, stride_or, stride_oh,
                          S_Q: tl.constexpr, H: tl.constexpr, TOPK: tl.constexpr, CHUNK: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr, TILE: tl.constexpr,
                          BYTES: tl.constexpr, SCALES_AT: tl.constexpr, ROPE_AT: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SKIP_EMPTY: tl.constexpr,
                          HAS_SINK: tl.constexpr, F32_DOT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # query token: request row // S_Q, draft token row % S_Q
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    offs_v = tl.arange(0, DV)
    offs_r = tl.arange(0, DR)

    q_rows = q + row * stride_qr + heads[:, None] * stride_qh
    qn = tl.load(q_rows + offs_v[None, :])  # [BLOCK_H, 512]
    qr = tl.load(q_rows + DV + offs_r[None, :])  # [BLOCK_H, 64]
    if F32_DOT:
        qn = qn.to(tl.float32)
        qr = qr.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV], tl.float32)
    for start in range(split * CHUNK, split * CHUNK + CHUNK, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        idx = tl.load(indices + row * stride_ir + offs_n, mask=offs_n < TOPK, other=-1)
        valid = (idx >= 0) & (idx < num_tokens)  # -1 is the invalid entry; the bound only guards memory
        if SKIP_EMPTY:
            if tl.max(valid.to(tl.int32), axis=0) > 0:  # a tile of -1 entries costs one index load
                m_i, l_i, acc = _attend_tile(qn, qr, k_fp8, k_scale, k_rope, idx, valid, m_i, l_i, acc, qk_scale,
                                             offs_v, offs_r, DV, TILE, BYTES, SCALES_AT, ROPE_AT, BLOCK_N, F32_DOT)
        else:  # no branch: Triton pipelines the gathers; a tile of -1 entries reads no memory
            m_i, l_i, acc = _attend_tile(qn, qr, k_fp8, k_scale, k_rope, idx, valid, m_i, l_i, acc, qk_scale,
                                         offs_v, offs_r, DV, TILE, BYTES, SCALES_AT, ROPE_AT, BLOCK_N, F32_DOT)

    seen = l_i > 0.0
    safe_l = tl.where(seen, l_i, 1.0)
    o = acc / safe_l[:, None]
    lse2 = tl.where(seen, m_i + tl.math.log2(safe_l), float("-inf"))
    if NUM_SPLITS == 1:
        if HAS_SINK:
            sink = tl.load(attn_sink + heads)
            kept = 1.0 / (1.0 + tl.math.exp2(sink * 1.4426950408889634 - tl.where(seen, lse2, 0.0)))
            o = o * tl.where(seen, kept, 1.0)[:, None]
        o = tl.where(seen[:, None], o, 0.0)
        tl.store(out + row * stride_or + heads[:, None] * stride_oh + offs_v[None, :], o.to(out.dtype.element_ty))
        b = row // S_Q
        s_q = row % S_Q
        tl.store(lse + b * H * S_Q + heads * S_Q + s_q, tl.where(seen, lse2 * 0.6931471805599453, float("inf")))
    else:
        part = (row * H + heads) * NUM_SPLITS + split  # [BLOCK_H]
        tl.store(o_part + part[:, None] * DV + offs_v[None, :], o)
        tl.store(lse_part + part, lse2)


@triton.jit
def _combine_kernel(o_part, lse_part, attn_sink, out, lse, stride_or, stride_oh,
                    S_Q: tl.constexpr, H: tl.constexpr, NUM_SPLITS: tl.constexpr, DV: tl.constexpr,
                    BLOCK_HC: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_HC + tl.arange(0, BLOCK_HC)
    offs_s = tl.arange(0, BLOCK_S)
    offs_v = tl.arange(0, DV)
    part = (row * H + heads[:, None]) * NUM_SPLITS + offs_s[None, :]  # [BLOCK_HC, BLOCK_S]
    in_range = (offs_s < NUM_SPLITS)[None, :]
    lse2 = tl.load(lse_part + part, mask=in_range, other=float("-inf"))
    top = tl.max(lse2, axis=1)
    seen = top > float("-inf")
    weight = tl.math.exp2(lse2 - tl.where(seen, top, 0.0)[:, None])  # 0 for empty splits
    total = tl.where(seen, tl.sum(weight, axis=1), 1.0)
    o = tl.load(o_part + part[:, :, None] * DV + offs_v[None, None, :], mask=in_range[:, :, None], other=0.0)
    o = tl.sum(o * weight[:, :, None], axis=1) / total[:, None]  # [BLOCK_HC, 512]
    row_lse = tl.where(seen, top + tl.math.log2(total), 0.0)
    if HAS_SINK:
        sink = tl.load(attn_sink + heads)
        o = o * (1.0 / (1.0 + tl.math.exp2(sink * 1.4426950408889634 - row_lse)))[:, None]
    o = tl.where(seen[:, None], o, 0.0)
    tl.store(out + row * stride_or + heads[:, None] * stride_oh + offs_v[None, :], o.to(out.dtype.element_ty))
    b = row // S_Q
    s_q = row % S_Q
    tl.store(lse + b * H * S_Q + heads * S_Q + s_q, tl.where(seen, row_lse * 0.6931471805599453, float("inf")))


def launch(form, q, k_cache, indices, softmax_scale, attn_sink, out, lse):
    batch_size, seq_len_q, num_heads, head_dim = q.shape
    topk = indices.shape[-1]
    assert head_dim == HEAD_DIM and k_cache.shape[-1] == BYTES_PER_TOKEN and k_cache.shape[2] == 1
    assert k_cache.is_contiguous() and q.stride(-1) == 1 and indices.stride(-1) == 1
    assert out.is_contiguous() and lse.is_contiguous()
    rows = batch_size * seq_len_q
    if rows == 0:
        return
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    block_h, block_n = (num_heads, form.interpreter_block_n) if interpret else (BLOCK_H, BLOCK_N)
    assert num_heads % block_h == 0 and topk % block_n == 0
    tiles = rows * (num_heads // block_h)
    splits = max(1, min(INTERPRETER_MAX_SPLITS if interpret else MAX_SPLITS, TARGET_PROGRAMS // tiles, topk // block_n))
    chunk = triton.cdiv(triton.cdiv(topk, splits), block_n) * block_n
    splits = triton.cdiv(topk, chunk)

    flat = k_cache.view(-1, BYTES_PER_TOKEN)
    q_rows = q.view(rows, num_heads, head_dim) if q.is_contiguous() else q.reshape(rows, num_heads, head_dim)
    idx_rows = indices.reshape(rows, topk)
    out_rows = out.view(rows, num_heads, HEAD_DIM_V)
    if splits > 1:
        o_part = torch.empty(rows * num_heads * splits, HEAD_DIM_V, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(rows * num_heads * splits, dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = lse
    sink = attn_sink if attn_sink is not None else lse
    _sparse_decode_kernel[(rows, num_heads // block_h, splits)](
        q_rows, flat.view(torch.float8_e4m3fn), flat.view(torch.float32), flat.view(torch.bfloat16), idx_rows,
        sink, out_rows, lse, o_part, lse_part,
        float(softmax_scale) * LOG2E, flat.shape[0],
        q_rows.stride(0), q_rows.stride(1), idx_rows.stride(0), out_rows.stride(0), out_rows.stride(1),
        S_Q=seq_len_q, H=num_heads, TOPK=topk, CHUNK=chunk, NUM_SPLITS=splits,
        DV=HEAD_DIM_V, DR=HEAD_DIM_ROPE, TILE=TILE, BYTES=BYTES_PER_TOKEN, SCALES_AT=SCALES_AT, ROPE_AT=ROPE_AT,
        BLOCK_H=block_h, BLOCK_N=block_n, SKIP_EMPTY=form.skip_empty, HAS_SINK=attn_sink is not None,
        F32_DOT=interpret,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    if splits > 1:
        block_hc = num_heads if interpret else COMBINE_HEADS
        _combine_kernel[(rows, num_heads // block_hc)](
            o_part, lse_part, sink, out_rows, lse, out_rows.stride(0), out_rows.stride(1),
            S_Q=seq_len_q, H=num_heads, NUM_SPLITS=splits, DV=HEAD_DIM_V, BLOCK_HC=block_hc,
            BLOCK_S=triton.next_power_of_2(splits), HAS_SINK=attn_sink is not None, num_warps=4,
        )


def run(q, k_cache, indices, softmax_scale, out, lse):
    launch(FORMS["triton_fp8_splitk"], q, k_cache, indices, softmax_scale, None, out, lse)


def run_sink(q, k_cache, indices, softmax_scale, attn_sink, out, lse):
    """The definitions with an attention sink (flashmla_sparse_decode_fp8_sink_*)."""
    launch(FORMS["triton_fp8_splitk"], q, k_cache, indices, softmax_scale, attn_sink, out, lse)


def run_pipelined(q, k_cache, indices, softmax_scale, out, lse):
    launch(FORMS["triton_fp8_pipelined"], q, k_cache, indices, softmax_scale, None, out, lse)


def run_sink_pipelined(q, k_cache, indices, softmax_scale, attn_sink, out, lse):
    launch(FORMS["triton_fp8_pipelined"], q, k_cache, indices, softmax_scale, attn_sink, out, lse)
