"""Causal varlen MHA prefill in plain vectorised PyTorch: pad every sequence to the batch's longest
query and key lengths, batched float32 matmuls for the logits of all heads (queries taken in chunks to bound memory), the
bottom-right causal and padding masks, a softmax via logsumexp, and a second batched matmul for the
output. No per-sequence Python loop, no fusion."""

import torch

MAX_LOGITS = 1 << 28


def run(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale):
    total_q, heads, head_dim_qk = q.shape
    head_dim_v = v.shape[-1]
    device = q.device
    batch = cu_seqlens_q.shape[0] - 1
    if total_q == 0:  # no queries, maybe no keys either: nothing to pad to or to chunk by
        return (torch.empty(0, heads, head_dim_v, dtype=torch.bfloat16, device=device),
                torch.empty(0, heads, dtype=torch.float32, device=device))

    q_starts, k_starts = cu_seqlens_q[:-1].long(), cu_seqlens_k[:-1].long()
    q_lens = cu_seqlens_q[1:].long() - q_starts
    k_lens = cu_seqlens_k[1:].long() - k_starts
    max_q, max_k = int(q_lens.max()), int(k_lens.max())  # reads the lengths back to size the padding

    q_pos = torch.arange(max_q, device=device)
    k_pos = torch.arange(max_k, device=device)
    q_valid = q_pos[None, :] < q_lens[:, None]  # [B, Mq]
    k_valid = k_pos[None, :] < k_lens[:, None]  # [B, Mk]
    q_rows = torch.where(q_valid, q_starts[:, None] + q_pos[None, :], 0)
    k_rows = torch.where(k_valid, k_starts[:, None] + k_pos[None, :], 0)

    qp = q[q_rows].float().permute(0, 2, 1, 3)  # [B, H, Mq, Dqk]
    kp = k[k_rows].float().permute(0, 2, 3, 1)  # [B, H, Dqk, Mk]
    vp = v[k_rows].float().permute(0, 2, 1, 3)  # [B, H, Mk, Dv]
    diag = (k_lens - q_lens)[:, None, None]
    out_padded = torch.empty(batch, heads, max_q, head_dim_v, dtype=torch.float32, device=device)
    lse = torch.empty(batch, heads, max_q, dtype=torch.float32, device=device)
    # Queries in chunks so the padded float32 logits stay near MAX_LOGITS elements.
    chunk = max(1, MAX_LOGITS // (batch * heads * max_k))
    for c0 in range(0, max_q, chunk):
        c1 = min(c0 + chunk, max_q)
        logits = torch.matmul(qp[:, :, c0:c1], kp) * softmax_scale  # [B, H, c, Mk]
        # bottom-right causal: query i sees keys j <= k_len - q_len + i
        visible = (k_pos[None, None, :] <= diag + q_pos[None, c0:c1, None]) & k_valid[:, None, :]  # [B, c, Mk]
        logits = logits.masked_fill(~visible[:, None], float("-inf"))
        lse_c = torch.logsumexp(logits, dim=-1)  # [B, H, c]; -inf only on padded query rows
        probs = torch.exp(logits - torch.where(torch.isinf(lse_c), 0.0, lse_c)[..., None])
        out_padded[:, :, c0:c1] = torch.matmul(probs, vp)
        lse[:, :, c0:c1] = lse_c

    out = torch.empty(total_q, heads, head_dim_v, dtype=torch.bfloat16, device=device)
    lse_out = torch.empty(total_q, heads, dtype=torch.float32, device=device)
    out[q_rows[q_valid]] = out_padded.permute(0, 2, 1, 3)[q_valid].to(torch.bfloat16)
    lse_out[q_rows[q_valid]] = lse.permute(0, 2, 1)[q_valid]
    return out, lse_out
