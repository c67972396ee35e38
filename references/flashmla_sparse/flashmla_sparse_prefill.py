"""Ground truth for sparse MLA prefill (FlashMLA's flash_mla_sparse_fwd, DeepSeek-V3.2 DSA).

There is no batch dimension: query token i attends only to the KV tokens kv[indices[i, 0, :], 0]
(576 values [512 latent | 64 rope]; the value is the first 512). An entry of indices is invalid,
and ignored, when it is -1 or >= seq_len_kv. In base 2, as FlashMLA's pseudo-code writes it:
    P[i, h, j]       = (q[i, h] . kv[indices[i, 0, j], 0]) * sm_scale * log2(e)   valid j only
    max_logits[i, h] = max_j P[i, h, j]
    lse[i, h]        = log2(sum_j 2^P[i, h, j])
    out[i, h]        = sum_j 2^(P[i, h, j] - lse[i, h]) * kv[indices[i, 0, j], 0, :512]
A query token with no valid entry gets out 0, max_logits -inf and lse -inf (the sums are empty).
All math runs in float32, a chunk of query tokens at a time so the gathered keys fit in memory.
"""

import math

import torch

HEAD_DIM_V = 512
QUERIES_PER_CHUNK = 16  # gathered keys: 16 x 2048 x 576 float32 = 75 MB


def run(q, kv, indices, sm_scale):
    seq_len_q, num_heads, _ = q.shape
    seq_len_kv = kv.shape[0]
    device = q.device
    out = torch.zeros(seq_len_q, num_heads, HEAD_DIM_V, dtype=torch.bfloat16, device=device)
    max_logits = torch.full((seq_len_q, num_heads), -math.inf, dtype=torch.float32, device=device)
    lse = torch.full((seq_len_q, num_heads), -math.inf, dtype=torch.float32, device=device)
    if seq_len_kv == 0:
        return out, max_logits, lse

    rows = kv[:, 0]  # [seq_len_kv, 576]
    scale = sm_scale * math.log2(math.e)
    for start in range(0, seq_len_q, QUERIES_PER_CHUNK):
        end = min(start + QUERIES_PER_CHUNK, seq_len_q)
        idx = indices[start:end, 0].long()  # [n, topk]
        valid = (idx >= 0) & (idx < seq_len_kv)
        keys = rows[idx.clamp(0, seq_len_kv - 1)].float()  # [n, topk, 576]
        keys = torch.where(valid[..., None], keys, 0.0)
        logits = (q[start:end].float() @ keys.transpose(1, 2)) * scale  # [n, heads, topk]
        logits = logits.masked_fill(~valid[:, None, :], -math.inf)

        row_max = logits.amax(dim=-1)  # -inf where nothing is valid
        seen = valid.any(dim=-1)[:, None]  # [n, 1]
        shift = torch.where(seen, row_max, 0.0)
        weights = torch.exp2(logits - shift[..., None])  # 0 at invalid entries
        total = weights.sum(dim=-1)
        values = (weights @ keys[..., :HEAD_DIM_V]) / total.clamp_min(1e-30)[..., None]
        out[start:end] = torch.where(seen[..., None], values, 0.0).to(torch.bfloat16)
        max_logits[start:end] = row_max
        lse[start:end] = torch.where(seen, shift + torch.log2(total), -math.inf)
    return out, max_logits, lse
