"""Ground truth for FlashMLA's FP8 sparse KV cache format (DeepSeek-V3.2, "V32_FP8Sparse"): quantize.

Each token of a bfloat16 cache [num_blocks, 64, 1, 576] ([512 latent | 64 rope]) becomes 656 bytes:
    bytes   0..511  the 512 latent values as float8_e4m3fn, in four tiles of 128 values
    bytes 512..527  the four tile scales as float32 (little-endian), tile t covering values 128t..128t+127
    bytes 528..655  the 64 rope values as bfloat16, unchanged
Tile t's scale is the power of two FlashMLA's quantize_k_cache uses,
    scale = 2^ceil(log2(max(amax / 448, 1e-4))),   amax = max |x| over the tile (448: e4m3's largest),
and each latent value is stored as float8_e4m3fn(x / scale), rounded to nearest, ties to even.
Dividing by a power of two is exact, so every byte is determined; |x / scale| <= 448, so nothing
saturates. The bytes are returned as int8 (the byte type definitions have); read them as uint8 or
float8_e4m3fn/float32/bfloat16 views as the layout says.
"""

import torch

D_NOPE = 512
D_ROPE = 64
TILE = 128
NUM_TILES = D_NOPE // TILE
BYTES_PER_TOKEN = D_NOPE + 4 * NUM_TILES + 2 * D_ROPE  # 656
FP8_MAX = 448.0
MIN_SCALE = 1e-4


def power_of_two_scale(amax):
    """2^ceil(log2(max(amax / 448, 1e-4))) in float32, computed exactly (frexp instead of log2)."""
    bound = torch.clamp_min(amax.float() / FP8_MAX, MIN_SCALE)
    mantissa, exponent = torch.frexp(bound)  # bound = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power of two stays itself
    return torch.ldexp(torch.ones_like(bound), exponent)


def run(kv_cache):
    num_blocks, block_size, num_heads_kv, head_dim = kv_cache.shape
    tokens = kv_cache.reshape(-1, head_dim)
    count = tokens.shape[0]
    nope = tokens[:, :D_NOPE].float().reshape(count, NUM_TILES, TILE)
    scale = power_of_two_scale(nope.abs().amax(dim=-1))  # [tokens, 4]
    quantized = (nope / scale[..., None]).to(torch.float8_e4m3fn)

    packed = torch.empty(count, BYTES_PER_TOKEN, dtype=torch.int8, device=kv_cache.device)
    packed[:, :D_NOPE] = quantized.reshape(count, D_NOPE).view(torch.int8)
    packed[:, D_NOPE:D_NOPE + 4 * NUM_TILES] = scale.contiguous().view(torch.int8)
    packed[:, D_NOPE + 4 * NUM_TILES:] = tokens[:, D_NOPE:].contiguous().view(torch.int8)
    return packed.reshape(num_blocks, block_size, num_heads_kv, BYTES_PER_TOKEN)
