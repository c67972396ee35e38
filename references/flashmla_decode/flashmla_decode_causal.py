"""Ground truth for FlashMLA-style dense MLA decode (bf16 paged cache, 64-token blocks, causal).

Request b has s_q query tokens and L = cache_seqlens[b] keys; key t is
k_cache[block_table[b, t // 64], t % 64, 0] (576 values), its value the first 512 of them:
    logits = (q[b] . keys^T) * softmax_scale                     [s_q, heads, L]
    query token i sees keys j <= L - s_q + i (FlashMLA's causal rule)
    out    = softmax(logits) . values                            [s_q, heads, 512]
    lse    = logsumexp(logits), natural log, stored [heads, s_q]
The constraints guarantee L >= s_q, so every query token sees at least one key.
All math runs in float32.
"""

import torch

HEAD_DIM_V = 512


def run(q, k_cache, block_table, cache_seqlens, softmax_scale):
    batch_size, seq_len_q, num_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    device = q.device
    out = torch.empty(batch_size, seq_len_q, num_heads, HEAD_DIM_V, dtype=torch.bfloat16, device=device)
    lse = torch.empty(batch_size, num_heads, seq_len_q, dtype=torch.float32, device=device)

    lengths = cache_seqlens.tolist()
    for b in range(batch_size):
        length = lengths[b]
        num_used = (length + block_size - 1) // block_size
        blocks = block_table[b, :num_used].long()  # slots past the last block are never read
        keys = k_cache[blocks].reshape(num_used * block_size, head_dim)[:length].float()  # [L, 576]
        values = keys[:, :HEAD_DIM_V]  # [L, 512]
        logits = (q[b].float() @ keys.T) * softmax_scale  # [s_q, heads, L]

        query_pos = torch.arange(seq_len_q, device=device)[:, None]
        key_pos = torch.arange(length, device=device)[None, :]
        visible = key_pos <= length - seq_len_q + query_pos  # [s_q, L]
        logits = logits.masked_fill(~visible[:, None, :], float("-inf"))

        lse_b = torch.logsumexp(logits, dim=-1)  # [s_q, heads]
        probs = torch.exp(logits - lse_b[..., None])
        out[b] = (probs @ values).to(torch.bfloat16)
        lse[b] = lse_b.T
    return out, lse
