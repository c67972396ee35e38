"""Ground truth for causal varlen MHA prefill (flash_attn_varlen_func semantics, h_kv = h).

Sequence b owns queries cu_seqlens_q[b]:cu_seqlens_q[b+1] and keys/values
cu_seqlens_k[b]:cu_seqlens_k[b+1]. With q_len queries and k_len keys, head by head:
    logits = (q . k^T) * softmax_scale                       [heads, q_len, k_len]
    query i sees keys j <= k_len - q_len + i (bottom-right aligned, FlashAttention-2 >= 2.1)
    out    = softmax(logits) . v                             [q_len, heads, d_v]
    lse    = logsumexp(logits), natural log                  [q_len, heads]
The constraints guarantee k_len >= q_len, so every query sees at least one key. All math runs in
float32; queries are taken in chunks so the logits of a long sequence never need more than about
2**27 floats at once, and a chunk only reads the keys its last query can see.
"""

import torch

MAX_LOGITS = 1 << 27


def run(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale):
    total_q, num_heads, _ = q.shape
    head_dim_v = v.shape[-1]
    device = q.device
    out = torch.empty(total_q, num_heads, head_dim_v, dtype=torch.bfloat16, device=device)
    lse = torch.empty(total_q, num_heads, dtype=torch.float32, device=device)

    q_bounds = cu_seqlens_q.tolist()
    k_bounds = cu_seqlens_k.tolist()
    for b in range(len(q_bounds) - 1):
        q_start, q_len = q_bounds[b], q_bounds[b + 1] - q_bounds[b]
        k_start, k_len = k_bounds[b], k_bounds[b + 1] - k_bounds[b]
        if q_len == 0:
            continue
        keys_all = k[k_start:k_start + k_len].float().transpose(0, 1)  # [heads, k_len, d_qk]
        values_all = v[k_start:k_start + k_len].float().transpose(0, 1)  # [heads, k_len, d_v]
        chunk = max(1, MAX_LOGITS // (num_heads * k_len))
        for c0 in range(0, q_len, chunk):
            c1 = min(c0 + chunk, q_len)
            keys_seen = k_len - q_len + c1  # the chunk's last query sees keys [0, keys_seen)
            queries = q[q_start + c0:q_start + c1].float().transpose(0, 1)  # [heads, c, d_qk]
            keys = keys_all[:, :keys_seen]  # [heads, n, d_qk]
            values = values_all[:, :keys_seen]  # [heads, n, d_v]
            logits = (queries @ keys.transpose(1, 2)) * softmax_scale  # [heads, c, n]

            query_pos = torch.arange(c0, c1, device=device)[:, None]
            key_pos = torch.arange(keys_seen, device=device)[None, :]
            visible = key_pos <= k_len - q_len + query_pos  # [c, n]
            logits = logits.masked_fill(~visible[None], float("-inf"))

            lse_chunk = torch.logsumexp(logits, dim=-1)  # [heads, c]
            probs = torch.exp(logits - lse_chunk[..., None])
            out[q_start + c0:q_start + c1] = (probs @ values).transpose(0, 1).to(torch.bfloat16)
            lse[q_start + c0:q_start + c1] = lse_chunk.T
    return out, lse
