"""Ground truth for sparse MLA prefill with an attention sink and per-query top-k lengths
(FlashMLA's flash_mla_sparse_fwd with attn_sink and topk_length).

There is no batch dimension: query token i attends only to the KV tokens
kv[indices[i, 0, j], 0] for j < topk_length[i] (576 values [512 latent | 64 rope]; the value is
the first 512). Entries at j >= topk_length[i] are ignored whatever they hold; an entry before it
is invalid, and ignored, when it is -1 or >= seq_len_kv. In base 2, as FlashMLA's pseudo-code:
    P[i, h, j]       = (q[i, h] . kv[indices[i, 0, j], 0]) * sm_scale * log2(e)   valid j only
    max_logits[i, h] = max_j P[i, h, j]
    lse[i, h]        = log2(sum_j 2^P[i, h, j])
    out[i, h]        = sum_j 2^(P[i, h, j] - lse[i, h]) * kv[indices[i, 0, j], 0, :512]
                       * e^L / (e^L + e^attn_sink[h]),   L = lse[i, h] * ln(2)
The sink is a logit in natural-log units (like q.k * sm_scale) that joins the softmax's denominator
without a value; it changes out only, never max_logits or lse. attn_sink = -inf is neutral (no
sink); 0 is not (it adds e^0 = 1 to the denominator); +inf makes out 0.
A query token with no valid entry gets out 0, max_logits -inf and lse -inf, whatever the sink.
All math runs in float32, a chunk of query tokens at a time so the gathered keys fit in memory.
"""

import math

import torch

HEAD_DIM_V = 512
QUERIES_PER_CHUNK = 16  # gathered keys: 16 x 2048 x 576 float32 = 75 MB


def run(q, kv, indices, sm_scale, attn_sink, topk_length):
    seq_len_q, num_heads, _ = q.shape
    seq_len_kv = kv.shape[0]
    topk = indices.shape[-1]
    device = q.device
    out = torch.zeros(seq_len_q, num_heads, HEAD_DIM_V, dtype=torch.bfloat16, device=device)
    max_logits = torch.full((seq_len_q, num_heads), -math.inf, dtype=torch.float32, device=device)
    lse = torch.full((seq_len_q, num_heads), -math.inf, dtype=torch.float32, device=device)
    if seq_len_kv == 0:
        return out, max_logits, lse

    rows = kv[:, 0]  # [seq_len_kv, 576]
    scale = sm_scale * math.log2(math.e)
    sink = attn_sink.float()[None, :]  # [1, heads]
    position = torch.arange(topk, device=device)[None, :]
    for start in range(0, seq_len_q, QUERIES_PER_CHUNK):
        end = min(start + QUERIES_PER_CHUNK, seq_len_q)
        idx = indices[start:end, 0].long()  # [n, topk]
        valid = (idx >= 0) & (idx < seq_len_kv) & (position < topk_length[start:end, None].long())
        keys = rows[idx.clamp(0, seq_len_kv - 1)].float()  # [n, topk, 576]
        keys = torch.where(valid[..., None], keys, 0.0)
        logits = (q[start:end].float() @ keys.transpose(1, 2)) * scale  # [n, heads, topk]
        logits = logits.masked_fill(~valid[:, None, :], -math.inf)

        row_max = logits.amax(dim=-1)  # -inf where nothing is valid
        seen = valid.any(dim=-1)[:, None]  # [n, 1]
        shift = torch.where(seen, row_max, 0.0)
        weights = torch.exp2(logits - shift[..., None])  # 0 at invalid entries
        total = weights.sum(dim=-1)
        row_lse = torch.where(seen, shift + torch.log2(total), -math.inf)
        values = (weights @ keys[..., :HEAD_DIM_V]) / total.clamp_min(1e-30)[..., None]
        # e^L / (e^L + e^sink) = 1 / (1 + e^(sink - L)): 1 for sink -inf, 0 for sink +inf
        kept = 1.0 / (1.0 + torch.exp(sink - row_lse * math.log(2.0)))
        values = values * torch.where(seen, kept, 1.0)[..., None]
        out[start:end] = torch.where(seen[..., None], values, 0.0).to(torch.bfloat16)
        max_logits[start:end] = row_max
        lse[start:end] = row_lse
    return out, max_logits, lse
