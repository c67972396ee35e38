"""FlashMLA's FP8 sparse KV cache format (V3.2 layout, 656 bytes per token) read back by Triton.

Per token: bytes 0..511 the 512 latent values as e4m3, bytes 512..527 the four float32 tile scales,
bytes 528..655 the 64 rope values as bf16, read through three views of the same bytes.

  * A program owns TOKENS consecutive tokens: latent value k becomes bf16(e4m3 byte k * scale[k // 128]),
    the product taken in float32 and rounded once.
  * On the GPU the e4m3 bytes are converted by the hardware. Triton's interpreter has no e4m3 type of
    its own, so there (CPU checks) the byte is decoded in integer arithmetic: sign, 4 exponent bits
    (bias 7), 3 mantissa bits, subnormals as multiples of 2^-9.
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
def _e4m3_value(byte):
    """float32 value of e4m3fn bytes given as int32 0..255 (no NaN: the quantizer never writes one)."""
    exponent = (byte >> 3) & 0xF
    mantissa = byte & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # 2^-9
    magnitude = tl.where(exponent == 0, subnormal, normal)
    return tl.where((byte & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def _dequantize_kernel(in_bytes, in_scales, in_rope, out, num_tokens,
                       TOKENS: tl.constexpr, D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, TILE: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BYTES: tl.constexpr, SCALES_AT: tl.constexpr, ROPE_AT: tl.constexpr,
                       SOFT_FP8: tl.constexpr):
    tokens = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    ok = tokens < num_tokens
    offs = tl.arange(0, D_NOPE)
    raw = tl.load(in_bytes + tokens[:, None] * BYTES + offs[None, :], mask=ok[:, None], other=0)
    if SOFT_FP8:
        latent = _e4m3_value(raw.to(tl.int32) & 0xFF)
    else:
        latent = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    offs_t = tl.arange(0, D_NOPE // TILE)
    scale = tl.load(in_scales + tokens[:, None] * (BYTES // 4) + SCALES_AT + offs_t[None, :], mask=ok[:, None], other=0.0)
    tiles = tl.reshape(latent, (TOKENS, D_NOPE // TILE, TILE)) * scale[:, :, None]
    values = tl.reshape(tiles, (TOKENS, D_NOPE)).to(tl.bfloat16)
    tl.store(out + tokens[:, None] * HEAD_DIM + offs[None, :], values, mask=ok[:, None])
    offs_r = tl.arange(0, D_ROPE)
    rope = tl.load(in_rope + tokens[:, None] * (BYTES // 2) + ROPE_AT + offs_r[None, :], mask=ok[:, None])
    tl.store(out + tokens[:, None] * HEAD_DIM + D_NOPE + offs_r[None, :], rope, mask=ok[:, None])


def run(kv_cache_fp8, kv_cache):
    assert kv_cache.shape[-1] == HEAD_DIM and kv_cache_fp8.shape[-1] == BYTES_PER_TOKEN
    assert kv_cache.is_contiguous() and kv_cache_fp8.is_contiguous()
    num_tokens = kv_cache.numel() // HEAD_DIM
    if num_tokens == 0:
        return
    flat = kv_cache_fp8.view(num_tokens, BYTES_PER_TOKEN)
    _dequantize_kernel[(triton.cdiv(num_tokens, TOKENS),)](
        flat, flat.view(torch.float32), flat.view(torch.bfloat16), kv_cache, num_tokens,
        TOKENS=TOKENS, D_NOPE=D_NOPE, D_ROPE=D_ROPE, TILE=TILE, HEAD_DIM=HEAD_DIM, BYTES=BYTES_PER_TOKEN,
        SCALES_AT=SCALES_AT, ROPE_AT=ROPE_AT, SOFT_FP8=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=NUM_WARPS,
    )
