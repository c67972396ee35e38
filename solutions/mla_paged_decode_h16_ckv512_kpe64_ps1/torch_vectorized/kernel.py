"""MLA paged decode in plain vectorised PyTorch: pad every request to the longest one,
gather its pages, two batched matmuls and a masked softmax. No per-request Python loop."""

import math

import torch


def run(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale):
    batch, heads, dim = q_nope.shape
    dim_pe = q_pe.shape[-1]
    device = q_nope.device
    output = torch.zeros(batch, heads, dim, dtype=q_nope.dtype, device=device)
    lse = torch.full((batch, heads), -math.inf, dtype=torch.float32, device=device)
    if batch == 0 or kv_indices.numel() == 0:
        return output, lse

    indptr = kv_indptr.long()
    lens = indptr[1:] - indptr[:-1]  # [B]
    max_len = int(lens.max())
    pos = torch.arange(max_len, device=device)
    valid = pos[None, :] < lens[:, None]  # [B, L]
    flat = torch.where(valid, indptr[:-1, None] + pos[None, :], 0)
    pages = kv_indices.long()[flat]  # [B, L]; padded slots read page kv_indices[0]

    ckv = ckv_cache.reshape(-1, dim)[pages].float()  # [B, L, 512]
    kpe = kpe_cache.reshape(-1, dim_pe)[pages].float()  # [B, L, 64]
    logits = torch.bmm(q_nope.float(), ckv.transpose(1, 2)) + torch.bmm(q_pe.float(), kpe.transpose(1, 2))
    logits = (logits * sm_scale).masked_fill(~valid[:, None, :], -math.inf)  # [B, H, L]

    lse_e = torch.logsumexp(logits, dim=-1)  # [B, H]; -inf for empty requests
    probs = torch.exp(logits - torch.where(torch.isinf(lse_e), 0.0, lse_e)[..., None])
    output.copy_(torch.bmm(probs, ckv))
    lse.copy_(lse_e / math.log(2.0))
    return output, lse
