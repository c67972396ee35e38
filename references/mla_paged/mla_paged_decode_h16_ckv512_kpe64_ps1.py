"""Ground truth for MLA paged decode (absorbed MLA, page size 1).

For each request b, its keys are the pages kv_indices[kv_indptr[b]:kv_indptr[b+1]]:
    logits = (q_nope[b] . ckv + q_pe[b] . kpe) * sm_scale        [heads, kv_len]
    output = softmax(logits) . ckv                                [heads, 512]
    lse    = log2(sum(exp(logits)))                               [heads]
A request with no keys gives output 0 and lse -inf. All math runs in float32.
"""

import math

import torch


def run(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale):
    batch_size, num_heads, head_dim_ckv = q_nope.shape
    head_dim_kpe = q_pe.shape[-1]
    device = q_nope.device
    output = torch.zeros(batch_size, num_heads, head_dim_ckv, dtype=torch.bfloat16, device=device)
    lse = torch.full((batch_size, num_heads), -math.inf, dtype=torch.float32, device=device)

    ckv_rows = ckv_cache.reshape(-1, head_dim_ckv)  # page_size 1: one row per page
    kpe_rows = kpe_cache.reshape(-1, head_dim_kpe)
    bounds = kv_indptr.tolist()
    for b in range(batch_size):
        start, end = bounds[b], bounds[b + 1]
        if start == end:
            continue
        pages = kv_indices[start:end].long()
        ckv = ckv_rows[pages].float()  # [kv_len, 512]
        kpe = kpe_rows[pages].float()  # [kv_len, 64]
        logits = (q_nope[b].float() @ ckv.T + q_pe[b].float() @ kpe.T) * sm_scale  # [heads, kv_len]
        lse_natural = torch.logsumexp(logits, dim=-1)
        probs = torch.exp(logits - lse_natural[:, None])
        output[b] = (probs @ ckv).to(torch.bfloat16)
        lse[b] = lse_natural / math.log(2.0)
    return output, lse
