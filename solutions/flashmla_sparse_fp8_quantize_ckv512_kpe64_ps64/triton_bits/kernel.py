"""FlashMLA's FP8 sparse KV cache format (V3.2 layout, 656 bytes per token) written by Triton.

Per token: bytes 0..511 the 512 latent values as e4m3, bytes 512..527 the four float32 tile scales,
bytes 528..655 the 64 rope values as bf16, written through three views of the output bytes.

  * A program owns TOKENS consecutive tokens: it loads their [TOKENS, 512] latent values, takes the
    max |x| of every 128-value tile, and forms the scale 2^ceil(log2(max(amax / 448, 1e-4))) exactly
    from the bits of amax (448 = 1.75 * 2^8: the exponent of amax minus 8, plus one when amax's
    mantissa exceeds 1.75; at least 2^-13), so no division or log2 can round it the wrong way.
  * x / scale is x * 2^-k, exact; it is rounded to e4m3 to nearest, ties to even, by the hardware
    conversion on the GPU. Triton's interpreter rounds that conversion differently, so there (CPU
    checks) the same rounding is done in integer arithmetic on the fp32 bits.
  * The rope values are copied as they are.
"""

import os

import torch
import triton
import triton.language as tl

HEAD_DIM = 576
D_NOPE = 512
D_ROPE = 64
TILE = 128
BYTES_PER_TOKEN = 656
SCALES_AT = D_NOPE // 4  # in float32 words
ROPE_AT = (D_NOPE + 16) // 2  # in bf16 words

TOKENS = 16  # tokens per program
NUM_WARPS = 4


@triton.jit
def _e4m3_bits(f):
    """Round-to-nearest-even e4m3 encoding of fp32 values with |f| <= 448, as int32 bytes."""
    bits = f.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    magnitude = bits & 0x7FFFFFFF
    # normal range: keep 3 mantissa bits, ties to even (a carry moves into the exponent)
    rounded = (magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) & -1048576
    normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)
    # below 2^-6: multiples of 2^-9, rounded by adding and subtracting 2^23 in fp32
    a = magnitude.to(tl.float32, bitcast=True)
    subnormal = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    return tl.where(a < 0.015625, subnormal, normal) | (sign << 7)


@triton.jit
def _quantize_kernel(x, out_bytes, out_scales, out_rope, num_tokens,
                     TOKENS: tl.constexpr, D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, TILE: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BYTES: tl.constexpr, SCALES_AT: tl.constexpr, ROPE_AT: tl.constexpr,
                     SOFT_FP8: tl.constexpr):
    tokens = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    ok = tokens < num_tokens
    offs = tl.arange(0, D_NOPE)
    latent = tl.load(x + tokens[:, None] * HEAD_DIM + offs[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    tiles = tl.reshape(latent, (TOKENS, D_NOPE // TILE, TILE))
    amax = tl.max(tl.abs(tiles), axis=2)  # [TOKENS, 4]
    amax_bits = amax.to(tl.int32, bitcast=True)
    exponent = ((amax_bits >> 23) & 0xFF) - 127 - 8 + ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    exponent = tl.maximum(exponent, -13)  # 1e-4 floor: 2^ceil(log2(1e-4)) = 2^-13
    scale = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    scaled = tl.reshape(tiles * inverse[:, :, None], (TOKENS, D_NOPE))
    if SOFT_FP8:
        quantized = _e4m3_bits(scaled).to(tl.int8)
    else:
        quantized = scaled.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.int8, bitcast=True)
    tl.store(out_bytes + tokens[:, None] * BYTES + offs[None, :], quantized, mask=ok[:, None])
    offs_t = tl.arange(0, D_NOPE // TILE)
    tl.store(out_scales + tokens[:, None] * (BYTES // 4) + SCALES_AT + offs_t[None, :], scale, mask=ok[:, None])
    offs_r = tl.arange(0, D_ROPE)
    rope = tl.load(x + tokens[:, None] * HEAD_DIM + D_NOPE + offs_r[None, :], mask=ok[:, None])
    tl.store(out_rope + tokens[:, None] * (BYTES // 2) + ROPE_AT + offs_r[None, :], rope, mask=ok[:, None])


def run(kv_cache, kv_cache_fp8):
    assert kv_cache.shape[-1] == HEAD_DIM and kv_cache_fp8.shape[-1] == BYTES_PER_TOKEN
    assert kv_cache.is_contiguous() and kv_cache_fp8.is_contiguous()
    num_tokens = kv_cache.numel() // HEAD_DIM
    if num_tokens == 0:
        return
    flat = kv_cache_fp8.view(num_tokens, BYTES_PER_TOKEN)
    _quantize_kernel[(triton.cdiv(num_tokens, TOKENS),)](
        kv_cache, flat, flat.view(torch.float32), flat.view(torch.bfloat16), num_tokens,
        TOKENS=TOKENS, D_NOPE=D_NOPE, D_ROPE=D_ROPE, TILE=TILE, HEAD_DIM=HEAD_DIM, BYTES=BYTES_PER_TOKEN,
        SCALES_AT=SCALES_AT, ROPE_AT=ROPE_AT, SOFT_FP8=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=NUM_WARPS,
    )
