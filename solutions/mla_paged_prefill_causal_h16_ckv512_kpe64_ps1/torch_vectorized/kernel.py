"""Causal MLA paged prefill in plain PyTorch: pad the batch, gather, two batched matmuls.

Every request is padded to the longest query length and the longest KV length of the batch; the
keys [ckv | kpe] and queries [q_nope | q_pe] are gathered into dense tensors, the scores of all heads
for a chunk of query positions come from one batched matmul (fp32), the causal and padding
masks are applied in fp32, and the output is a second batched matmul with ckv as the value.
"""

import math

import torch

LOGITS_PER_CHUNK = 1 << 28


def run(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, sm_scale):
    total_q, num_heads, head_dim_ckv = q_nope.shape
    device = q_nope.device
    output = torch.zeros(total_q, num_heads, head_dim_ckv, dtype=torch.bfloat16, device=device)
    lse = torch.full((total_q, num_heads), -math.inf, dtype=torch.float32, device=device)
    num_req = qo_indptr.shape[0] - 1
    if total_q == 0 or num_req == 0:
        return output, lse

    qo_indptr = qo_indptr.long()
    kv_indptr = kv_indptr.long()
    q_lens = qo_indptr[1:] - qo_indptr[:-1]  # [B]
    kv_lens = kv_indptr[1:] - kv_indptr[:-1]
    max_q = int(q_lens.max())
    max_kv = int(kv_lens.max())
    if max_q == 0 or max_kv == 0:
        return output, lse

    # Padded gather positions: [B, max_q] query rows and [B, max_kv] pages.
    q_pos = torch.arange(max_q, device=device)
    kv_pos = torch.arange(max_kv, device=device)
    q_valid = q_pos[None, :] < q_lens[:, None]
    kv_valid = kv_pos[None, :] < kv_lens[:, None]
    q_rows = torch.where(q_valid, qo_indptr[:-1, None] + q_pos[None, :], 0)
    kv_slot = torch.where(kv_valid, kv_indptr[:-1, None] + kv_pos[None, :], 0)
    pages = torch.where(kv_valid, kv_indices.long()[kv_slot], 0)

    q = torch.cat([q_nope, q_pe], dim=-1)[q_rows]  # [B, max_q, H, 576]
    ckv = ckv_cache.reshape(ckv_cache.shape[0], -1)[pages]  # [B, max_kv, 512]
    kpe = kpe_cache.reshape(kpe_cache.shape[0], -1)[pages]  # [B, max_kv, 64]
    keys = torch.cat([ckv, kpe], dim=-1)  # [B, max_kv, 576]

    # Scores for every (query, head) row of a request, for a chunk of query positions at a time, so that the
    # padded fp32 scores stay near 2^28 elements (a skewed batch of 33 requests padded to 2624 queries and
    # 3202 keys would need 18 GB at once): [B, chunk * H, max_kv].
    chunk = max(1, min(max_q, LOGITS_PER_CHUNK // max(1, num_req * num_heads * max_kv)))
    keys_t = keys.transpose(1, 2).float()
    out = torch.empty(num_req, max_q, num_heads, head_dim_ckv, dtype=torch.bfloat16, device=device)
    lse_nat = torch.empty(num_req, max_q, num_heads, dtype=torch.float32, device=device)
    for first in range(0, max_q, chunk):
        last = min(first + chunk, max_q)
        rows = last - first
        scores = torch.matmul(q[:, first:last].reshape(num_req, rows * num_heads, -1).float(), keys_t)
        scores = scores.reshape(num_req, rows, num_heads, max_kv) * sm_scale

        # Query i sees keys j <= kv_len - q_len + i (and only real keys).
        limit = (kv_lens - q_lens)[:, None] + q_pos[None, first:last]  # [B, rows]
        visible = (kv_pos[None, None, :] <= limit[:, :, None]) & kv_valid[:, None, :]
        scores = scores.masked_fill(~visible[:, :, None, :], -math.inf)

        chunk_lse = torch.logsumexp(scores, dim=-1)  # [B, rows, H]; -inf where nothing is visible
        sees_any = visible.any(dim=-1)[:, :, None]  # [B, rows, 1]
        probs = torch.exp(scores - torch.where(sees_any, chunk_lse, 0.0)[..., None])
        probs = probs.to(torch.bfloat16).reshape(num_req, rows * num_heads, max_kv)
        out[:, first:last] = torch.matmul(probs, ckv).reshape(num_req, rows, num_heads, head_dim_ckv)
        lse_nat[:, first:last] = chunk_lse

    # Requests are stored one after another, so the valid padded rows in order are the token rows.
    output[:] = out[q_valid]
    lse[:] = (lse_nat / math.log(2.0))[q_valid]
    return output, lse
