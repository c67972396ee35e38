"""Ground truth for causal MLA paged prefill (absorbed MLA, page size 1).

Request b owns queries qo_indptr[b]:qo_indptr[b+1] and keys (pages)
kv_indices[kv_indptr[b]:kv_indptr[b+1]]. The causal mask is aligned to the end of
the request's KV: query i of q_len sees keys j <= kv_len - q_len + i.
    logits = (q_nope . ckv + q_pe . kpe) * sm_scale, masked      [q_len, heads, kv_len]
    output = softmax(logits) . ckv ;  lse = log2(sum(exp(logits)))
A query that sees no key gives output 0 and lse -inf. All math runs in float32.
"""

import math

import torch


def run(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, sm_scale):
    total_q, num_heads, head_dim_ckv = q_nope.shape
    head_dim_kpe = q_pe.shape[-1]
    device = q_nope.device
    output = torch.zeros(total_q, num_heads, head_dim_ckv, dtype=torch.bfloat16, device=device)
    lse = torch.full((total_q, num_heads), -math.inf, dtype=torch.float32, device=device)

    ckv_rows = ckv_cache.reshape(-1, head_dim_ckv)  # page_size 1: one row per page
    kpe_rows = kpe_cache.reshape(-1, head_dim_kpe)
    q_bounds = qo_indptr.tolist()
    kv_bounds = kv_indptr.tolist()
    for b in range(len(q_bounds) - 1):
        q_start, q_end = q_bounds[b], q_bounds[b + 1]
        kv_start, kv_end = kv_bounds[b], kv_bounds[b + 1]
        q_len, kv_len = q_end - q_start, kv_end - kv_start
        if q_len == 0 or kv_len == 0:
            continue
        pages = kv_indices[kv_start:kv_end].long()
        ckv = ckv_rows[pages].float()  # [kv_len, 512]
        kpe = kpe_rows[pages].float()  # [kv_len, 64]
        qn = q_nope[q_start:q_end].float()  # [q_len, heads, 512]
        qp = q_pe[q_start:q_end].float()
        logits = (qn @ ckv.T + qp @ kpe.T) * sm_scale  # [q_len, heads, kv_len]

        query_pos = torch.arange(q_len, device=device)[:, None]
        key_pos = torch.arange(kv_len, device=device)[None, :]
        visible = key_pos <= kv_len - q_len + query_pos  # [q_len, kv_len]
        logits = logits.masked_fill(~visible[:, None, :], -math.inf)

        lse_natural = torch.logsumexp(logits, dim=-1)  # -inf where a query sees nothing
        sees_any = visible.any(dim=-1)[:, None, None]
        probs = torch.where(sees_any, torch.exp(logits - lse_natural[..., None]), 0.0)
        output[q_start:q_end] = (probs @ ckv).to(torch.bfloat16)
        lse[q_start:q_end] = lse_natural / math.log(2.0)
    return output, lse
