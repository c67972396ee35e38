"""Ground truth for sparse MLA decode over FlashMLA's FP8 KV cache (flash_mla_with_kvcache with
is_fp8_kvcache=True and indices, DeepSeek-V3.2 DSA).

k_cache is the packed FP8 cache [num_blocks, 64, 1, 656] (int8 bytes; see the fp8 quantize
definition): per token 512 float8_e4m3fn latent values, four float32 tile scales, 64 bfloat16 rope
values. Dequantized, token k_cache[n // 64, n % 64] is the key
    [bfloat16(fp8[0:512] * scale[tile]) | rope]   (576 values; the value is its first 512).
Query token s of request b attends only to the tokens indices[b, s, :] (n = block * 64 + offset);
an entry of -1 is invalid and ignored (the only invalid value FlashMLA's decode kernel accepts):
    logits = (q[b, s] . key_n) * softmax_scale                    [heads, valid entries]
    out[b, s] = softmax(logits) . value_n                         [heads, 512]
    lse[b, :, s] = logsumexp(logits)                              natural log, heads before s
A query token with no valid entry gets out 0 and lse +inf (FlashMLA's convention).
The keys are dequantized exactly as above and all attention math runs in float32.
"""

import math

import torch

HEAD_DIM_V = 512
D_NOPE = 512
TILE = 128
NUM_TILES = D_NOPE // TILE
ROPE_AT = D_NOPE + 4 * NUM_TILES  # 528


def dequantize_tokens(rows):
    """[..., 656] int8 bytes -> [..., 576] float32 keys (latent values dequantized to bfloat16)."""
    nope = rows[..., :D_NOPE].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[..., D_NOPE:ROPE_AT].contiguous().view(torch.float32)  # [..., 4]
    nope = (nope.unflatten(-1, (NUM_TILES, TILE)) * scale[..., None]).flatten(-2).to(torch.bfloat16)
    rope = rows[..., ROPE_AT:].contiguous().view(torch.bfloat16)
    return torch.cat([nope, rope], dim=-1).float()


def run(q, k_cache, indices, softmax_scale):
    batch_size, seq_len_q, num_heads, _ = q.shape
    device = q.device
    tokens = k_cache.reshape(-1, k_cache.shape[-1])  # [num_blocks * 64, 656]
    out = torch.zeros(batch_size, seq_len_q, num_heads, HEAD_DIM_V, dtype=torch.bfloat16, device=device)
    lse = torch.full((batch_size, num_heads, seq_len_q), math.inf, dtype=torch.float32, device=device)
    for b in range(batch_size):
        idx = indices[b].long()  # [s_q, topk]
        valid = idx != -1
        keys = dequantize_tokens(tokens[idx.clamp_min(0)])  # [s_q, topk, 576]
        keys = torch.where(valid[..., None], keys, 0.0)
        logits = (q[b].float() @ keys.transpose(1, 2)) * softmax_scale  # [s_q, heads, topk]
        logits = logits.masked_fill(~valid[:, None, :], -math.inf)

        seen = valid.any(dim=-1)[:, None]  # [s_q, 1]
        row_lse = torch.logsumexp(logits, dim=-1)  # -inf where nothing is valid
        weights = torch.exp(logits - torch.where(seen, row_lse, 0.0)[..., None])
        values = weights @ keys[..., :HEAD_DIM_V]  # [s_q, heads, 512]
        out[b] = torch.where(seen[..., None], values, 0.0).to(torch.bfloat16)
        lse[b] = torch.where(seen, row_lse, math.inf).T
    return out, lse
