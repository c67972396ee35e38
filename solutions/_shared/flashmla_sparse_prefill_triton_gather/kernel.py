"""Sparse MLA prefill (FlashMLA's flash_mla_sparse_fwd: 576-value latent keys, 512-value values,
topk indices per query token, optional attention sink and per-query top-k length) in Triton.

One kernel, two forms (FORMS below), each with an entry point for the definitions without a sink and
one for those with attn_sink and topk_length:
  * triton_gather (run, run_sink_topklen): 32 heads per program; a tile with no valid entry is
    branched around (it costs one index load), and the branch keeps Triton from pipelining the loop
    (compiled for sm_90a it has the same shared memory at 1, 2 or 3 stages: no gathers in flight
    across steps).
  * triton_gather_pipelined (run_pipelined, run_sink_topklen_pipelined): 64 heads per program (each
    gathered row serves twice as many heads) and no branch, so Triton pipelines the gathers (two
    stages); a tile with no valid entry costs its arithmetic but no memory traffic. Compiled for
    sm_90a, 255 registers, no spills, 216 KB of shared memory. On an H200 it ran 2.0-2.6x as fast
    as triton_gather on the 128-head definition (traces/nvidia_h200/); the other three definitions
    are not yet measured.

Work decomposition
  * A program owns one query token and BLOCK_H of its heads, so every KV tile it gathers through the
    token's indices serves all those heads (all heads of a token share its indices).
  * The inner loop walks the token's index list BLOCK_N entries at a time: one load of BLOCK_N ids,
    then a gather of BLOCK_N rows of 576 values. Invalid entries (-1, >= seq_len_kv, or at or past
    topk_length) are masked on load and get logit -inf, so nothing they point to is ever read; with
    topk_length the loop stops at the token's length (in both forms: a loop bound, not a branch).
  * The latent part of the tile (first 512 values) is loaded once and used both as the key part of
    q.k^T and as the value of p.v, both on tensor cores (tl.dot, bf16 in, fp32 accumulate); the rope
    part (last 64) joins q.k^T as a second dot into the same accumulator.
  * Base-2 online softmax with sm_scale * log2(e) folded into one multiply, which is also the unit of
    max_logits and lse. A row with no valid entry writes out 0 and max_logits = lse = -inf. The sink
    scales out by 1 / (1 + 2^(attn_sink * log2(e) - lse)) at the end and never touches lse.
  * Under Triton's interpreter (CPU checks) the dot operands are upcast to fp32, as its bf16 dot is
    wrong there, and the tiles are larger (all heads at once; the pipelined form, which computes
    every tile, also takes more entries per step), as its cost is per operation; the bf16 path and
    the launch configurations below run on the GPU. triton_gather's are chosen, not tuned on an H200.
"""

import os
from typing import NamedTuple

import triton
import triton.language as tl

HEAD_DIM = 576
HEAD_DIM_V = 512
HEAD_DIM_ROPE = HEAD_DIM - HEAD_DIM_V
LOG2E = 1.4426950408889634


class Form(NamedTuple):
    block_h: int  # heads per program
    block_n: int  # index entries per step
    skip_empty: bool  # branch around a tile with no valid entry
    num_warps: int
    num_stages: int
    interpreter_block_n: int  # entries per step under the interpreter


FORMS = {
    "triton_gather": Form(block_h=32, block_n=64, skip_empty=True, num_warps=8, num_stages=2,
                          interpreter_block_n=64),
    "triton_gather_pipelined": Form(block_h=64, block_n=64, skip_empty=False, num_warps=8, num_stages=2,
                                    interpreter_block_n=256),
}


@triton.jit
def _attend_tile(qn, qr, kv, idx, valid, m_i, l_i, acc, qk_scale, stride_kv, offs_v, offs_r,
                 DV: tl.constexpr, F32_DOT: tl.constexpr):
    """One step of the online softmax over a gathered tile of BLOCK_N index entries."""
    rows = kv + tl.where(valid, idx, 0).to(tl.int64)[:, None] * stride_kv
    kn = tl.load(rows + offs_v[None, :], mask=valid[:, None], other=0.0)  # [BLOCK_N, 512]
    kr = tl.load(rows + DV + offs_r[None, :], mask=valid[:, None], other=0.0)  # [BLOCK_N, 64]
    if F32_DOT:
        kn = kn.to(tl.float32)
        kr = kr.to(tl.float32)
    s = tl.dot(qn, tl.trans(kn))
    s = tl.dot(qr, tl.trans(kr), s)
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing valid yet
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if F32_DOT:
        acc = tl.dot(p, kn, acc * alpha[:, None])
    else:
        acc = tl.dot(p.to(kn.dtype), kn, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _sparse_prefill_kernel(q, kv, indices, attn_sink, topk_length, out, max_logits, lse,
                           seq_len_kv, qk_scale,
                           stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh, stride_lt,
                           TOPK: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SKIP_EMPTY: tl.constexpr,
                           HAS_SINK: tl.constexpr, HAS_LENGTH: tl.constexpr, F32_DOT: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, DV)
    offs_r = tl.arange(0, DR)

    q_rows = q + token * stride_qt + heads[:, None] * stride_qh
    qn = tl.load(q_rows + offs_v[None, :])  # [BLOCK_H, 512]
    qr = tl.load(q_rows + DV + offs_r[None, :])  # [BLOCK_H, 64]
    if F32_DOT:
        qn = qn.to(tl.float32)
        qr = qr.to(tl.float32)

    if HAS_LENGTH:
        count = tl.minimum(tl.maximum(tl.load(topk_length + token), 0), TOPK)
    else:
        count = TOPK
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV], tl.float32)
    for start in range(0, count, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        idx = tl.load(indices + token * stride_it + offs_n, mask=offs_n < count, other=-1)
        valid = (idx >= 0) & (idx < seq_len_kv)
        if SKIP_EMPTY:
            if tl.max(valid.to(tl.int32), axis=0) > 0:  # a tile of invalid entries costs one index load
                m_i, l_i, acc = _attend_tile(qn, qr, kv, idx, valid, m_i, l_i, acc, qk_scale, stride_kv,
                                             offs_v, offs_r, DV, F32_DOT)
        else:  # no branch: Triton pipelines the gathers; an all-invalid tile reads no memory
            m_i, l_i, acc = _attend_tile(qn, qr, kv, idx, valid, m_i, l_i, acc, qk_scale, stride_kv,
                                         offs_v, offs_r, DV, F32_DOT)

    seen = l_i > 0.0
    safe_l = tl.where(seen, l_i, 1.0)
    row_lse = tl.where(seen, m_i + tl.math.log2(safe_l), float("-inf"))
    o = acc / safe_l[:, None]
    if HAS_SINK:
        sink = tl.load(attn_sink + heads)
        kept = 1.0 / (1.0 + tl.math.exp2(sink * 1.4426950408889634 - tl.where(seen, row_lse, 0.0)))
        o = o * tl.where(seen, kept, 1.0)[:, None]
    o = tl.where(seen[:, None], o, 0.0)
    tl.store(out + token * stride_ot + heads[:, None] * stride_oh + offs_v[None, :], o.to(out.dtype.element_ty))
    tl.store(max_logits + token * stride_lt + heads, m_i)
    tl.store(lse + token * stride_lt + heads, row_lse)


def launch(form, q, kv, indices, sm_scale, attn_sink, topk_length, out, max_logits, lse):
    seq_len_q, num_heads, head_dim = q.shape
    seq_len_kv = kv.shape[0]
    topk = indices.shape[-1]
    assert head_dim == HEAD_DIM and kv.shape[-1] == HEAD_DIM and kv.shape[1] == 1
    assert q.stride(-1) == 1 and kv.stride(-1) == 1 and indices.stride(-1) == 1
    assert out.is_contiguous() and max_logits.is_contiguous() and lse.is_contiguous()
    if seq_len_q == 0:
        return
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    block_h, block_n = (num_heads, form.interpreter_block_n) if interpret else (form.block_h, form.block_n)
    assert num_heads % block_h == 0 and topk % block_n == 0
    grid = (seq_len_q, num_heads // block_h)
    _sparse_prefill_kernel[grid](
        q, kv, indices, attn_sink if attn_sink is not None else lse, topk_length if topk_length is not None else indices,
        out, max_logits, lse,
        seq_len_kv, float(sm_scale) * LOG2E,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), out.stride(0), out.stride(1), lse.stride(0),
        TOPK=topk, DV=HEAD_DIM_V, DR=HEAD_DIM_ROPE, BLOCK_H=block_h, BLOCK_N=block_n, SKIP_EMPTY=form.skip_empty,
        HAS_SINK=attn_sink is not None, HAS_LENGTH=topk_length is not None, F32_DOT=interpret,
        num_warps=form.num_warps, num_stages=form.num_stages,
    )


def run(q, kv, indices, sm_scale, out, max_logits, lse):
    launch(FORMS["triton_gather"], q, kv, indices, sm_scale, None, None, out, max_logits, lse)


def run_sink_topklen(q, kv, indices, sm_scale, attn_sink, topk_length, out, max_logits, lse):
    """The definitions with an attention sink and per-row topk lengths (flashmla_sparse_prefill_sink_topklen_*)."""
    launch(FORMS["triton_gather"], q, kv, indices, sm_scale, attn_sink, topk_length, out, max_logits, lse)


def run_pipelined(q, kv, indices, sm_scale, out, max_logits, lse):
    launch(FORMS["triton_gather_pipelined"], q, kv, indices, sm_scale, None, None, out, max_logits, lse)


def run_sink_topklen_pipelined(q, kv, indices, sm_scale, attn_sink, topk_length, out, max_logits, lse):
    launch(FORMS["triton_gather_pipelined"], q, kv, indices, sm_scale, attn_sink, topk_length, out, max_logits, lse)
