"""Ground truth for FlashMLA's FP8 sparse KV cache format (DeepSeek-V3.2, "V32_FP8Sparse"): dequantize.

Each token of a packed cache [num_blocks, 64, 1, 656] (int8 bytes) holds
    bytes   0..511  512 latent values as float8_e4m3fn, in four tiles of 128 values
    bytes 512..527  four float32 tile scales (little-endian), tile t covering values 128t..128t+127
    bytes 528..655  64 rope values as bfloat16
and becomes 576 bfloat16 values [512 latent | 64 rope]:
    latent value k = bfloat16(float32(fp8 byte k) * scale[k // 128]),   rope copied bit for bit.
With the power-of-two scales quantize writes, the product is exact in bfloat16.
"""

import torch

D_NOPE = 512
D_ROPE = 64
TILE = 128
NUM_TILES = D_NOPE // TILE
SCALES_AT = D_NOPE
ROPE_AT = D_NOPE + 4 * NUM_TILES  # 528


def run(kv_cache_fp8):
    num_blocks, block_size, num_heads_kv, _ = kv_cache_fp8.shape
    tokens = kv_cache_fp8.reshape(-1, kv_cache_fp8.shape[-1])
    count = tokens.shape[0]
    nope = tokens[:, :D_NOPE].contiguous().view(torch.float8_e4m3fn).float().reshape(count, NUM_TILES, TILE)
    scale = tokens[:, SCALES_AT:ROPE_AT].contiguous().view(torch.float32)  # [tokens, 4]
    rope = tokens[:, ROPE_AT:].contiguous().view(torch.bfloat16)  # [tokens, 64]

    out = torch.empty(count, D_NOPE + D_ROPE, dtype=torch.bfloat16, device=kv_cache_fp8.device)
    out[:, :D_NOPE] = (nope * scale[..., None]).reshape(count, D_NOPE).to(torch.bfloat16)
    out[:, D_NOPE:] = rope
    return out.reshape(num_blocks, block_size, num_heads_kv, D_NOPE + D_ROPE)
