"""FlashMLA-form dense MLA decode in plain vectorised PyTorch: pad every request to the longest
cache length, gather its blocks through the block table, one batched float32 matmul for the
logits, the causal and padding masks, a softmax via logsumexp, and a second batched matmul for the
output. No per-request Python loop, no fusion."""

import torch


def run(q, k_cache, block_table, cache_seqlens, softmax_scale):
    batch, s_q, heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    head_dim_v = 512
    device = q.device

    lengths = cache_seqlens.long()
    max_len = int(lengths.max())  # reads the lengths back to size the padding
    num_blocks = (max_len + block_size - 1) // block_size
    table = block_table[:, :num_blocks].long().clamp_min(0)  # -1 slots read block 0, masked below
    keys = k_cache[table].reshape(batch, num_blocks * block_size, head_dim)[:, :max_len].float()  # [B, L, 576]
    pos = torch.arange(max_len, device=device)
    in_cache = pos[None, :] < lengths[:, None]  # [B, L]
    keys = keys.masked_fill(~in_cache[..., None], 0.0)  # padding and block tails may hold anything

    logits = torch.bmm(q.reshape(batch, s_q * heads, head_dim).float(), keys.transpose(1, 2))
    logits = logits.view(batch, s_q, heads, max_len) * softmax_scale
    # FlashMLA's causal rule: draft token i sees keys j <= L - s_q + i
    limit = lengths[:, None] - s_q + torch.arange(s_q, device=device)[None, :]  # [B, s_q]
    visible = pos[None, None, :] <= limit[..., None]  # [B, s_q, L]
    logits = logits.masked_fill(~visible[:, :, None, :], float("-inf"))

    lse = torch.logsumexp(logits, dim=-1)  # [B, s_q, H], natural log
    probs = torch.exp(logits - lse[..., None]).view(batch, s_q * heads, max_len)
    out = torch.bmm(probs, keys[..., :head_dim_v]).view(batch, s_q, heads, head_dim_v)
    return out.to(torch.bfloat16), lse.permute(0, 2, 1).contiguous()
