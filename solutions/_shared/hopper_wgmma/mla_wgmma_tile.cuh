// The tile step our MLA wgmma kernels share: 64 (query token, head) rows against a tile of 64 keys of
// [512 latent | 64 rope] bf16 columns, both in shared memory as nine 64 x 64 column blocks with the
// 128-byte swizzle; two warpgroups that each own half of the 64 x 512 fp32 output; base-2 online softmax
// with bf16 probabilities as the register operands of the p.v products. The kernels differ in how tiles
// arrive (TMA from a paged cache, cp.async gathers) and how work is partitioned.

#pragma once

#include <math.h>

#include "hopper_wgmma.cuh"

namespace mla_tile {

using namespace hopper;

constexpr int kRows = 64;                          // rows per CTA: the M of every wgmma
constexpr int kDimV = 512;                         // latent (value) columns
constexpr int kDimPe = 64;                         // rope columns
constexpr int kDimK = kDimV + kDimPe;              // 576
constexpr int kTile = 64;                          // keys per tile
constexpr int kBox = 64;                           // columns per swizzle atom / TMA box (128 bytes)
constexpr int kColBlocks = kDimK / kBox;           // 9
constexpr int kColBlockBytes = kTile * kBox * 2;   // 8192: 64 rows of 128 bytes
constexpr int kTileBytes = kColBlocks * kColBlockBytes;  // 73728
constexpr int kHalfCols = kDimV / 2 / kBox;        // 4 column blocks of output per warpgroup
constexpr int kRopeBlock = 2 * kHalfCols;          // column block 8
constexpr int kThreads = 256;                      // two warpgroups

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Named barriers (0 is __syncthreads).
constexpr int kBarEvenReady = 1;  // WG0 -> WG1: m0 and p_e are in shared memory
constexpr int kBarOddReady = 2;   // WG1 -> WG0: m1 and p_o are in shared memory
constexpr int kBarGroup0 = 3;     // within WG0
constexpr int kBarGroup1 = 4;     // within WG1

struct SharedStorage {
  alignas(1024) unsigned char q[kTileBytes];     // 9 column blocks of 64 rows x 128 bytes, swizzled
  alignas(1024) unsigned char kv[2][kTileBytes]; // even and odd tiles, same layout
  uint4 p[4][128];                               // probabilities in register order: [k-step][thread]
  float m_even[kRows];                           // m0 of the current pair, per row
  float m_odd[kRows];                            // m1 of the current pair, per row
  float row_sum[2][kRows];                       // final sums of exp2 over each group's tiles
  alignas(8) uint64_t bar_q;                     // q has landed
  uint64_t bar_kv[2][2];                         // [buffer][half]: the half has landed
};

constexpr int kMaxDynamicSmem = 232448;  // per block on sm_90
static_assert(sizeof(SharedStorage) + 1024 <= kMaxDynamicSmem, "shared storage (+ alignment room) must fit");

// s = q k^T over the 576 columns, for the warpgroup's 64 rows and the tile's 64 keys. Half 0 of the
// tile (columns [0, 256) and the rope) is multiplied while half 1 may still be landing.
// GATHERED: the tile was filled by cp.async (generic proxy), so each wait is followed by a proxy fence;
// TMA writes through the async proxy and needs none.
template <bool GATHERED>
__device__ __forceinline__ void logits(float (&s)[32], uint32_t q, uint32_t tile, uint32_t bar_a, uint32_t bar_b,
                                       int parity) {
  if (GATHERED) wait_landed(bar_a, parity); else mbar_wait(bar_a, parity);
  wgmma_fence();
#pragma unroll
  for (int n = 0; n <= kHalfCols; ++n) {
    const int cb = n < kHalfCols ? n : kRopeBlock;
#pragma unroll
    for (int kk = 0; kk < kBox / 16; ++kk) {
      const uint32_t off = cb * kColBlockBytes + kk * 32;
      wgmma_64x64_ss(s, smem_desc(q + off, 16, 1024), smem_desc(tile + off, 16, 1024), n + kk);
    }
  }
  if (GATHERED) wait_landed(bar_b, parity); else mbar_wait(bar_b, parity);
#pragma unroll
  for (int cb = kHalfCols; cb < 2 * kHalfCols; ++cb) {
#pragma unroll
    for (int kk = 0; kk < kBox / 16; ++kk) {
      const uint32_t off = cb * kColBlockBytes + kk * 32;
      wgmma_64x64_ss(s, smem_desc(q + off, 16, 1024), smem_desc(tile + off, 16, 1024), 1);
    }
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_registers(s);
}

// Scales the logits to base 2 and masks the keys at or past n_valid; returns the row maxima of this
// thread's two rows over the quad that shares them.
__device__ __forceinline__ float2 scale_and_max(float (&s)[32], float scale, int2 n_valid, int lane) {
  float mx_lo = -INFINITY, mx_hi = -INFINITY;
  const int c0 = 2 * (lane & 3);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = 8 * j + c0 + (e & 1);
      const float x = col < (e < 2 ? n_valid.x : n_valid.y) ? s[4 * j + e] * scale : -INFINITY;
      s[4 * j + e] = x;
      if (e < 2) mx_lo = fmaxf(mx_lo, x); else mx_hi = fmaxf(mx_hi, x);
    }
  }
  mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
  mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
  mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
  mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
  return make_float2(mx_lo, mx_hi);
}

// A row may see no key yet (packed rows of several query tokens: a split can end before a row's first
// key, and a prefill row can see no key at all): its maximum is -inf, and exp2(-inf - -inf) would be NaN.
// Such a row's exponents are taken against 0, so every p and its rescale factor are 0 (its output and sum
// are 0 already).
__device__ __forceinline__ float safe_max(float m) { return m == -INFINITY ? 0.f : m; }
__device__ __forceinline__ float2 factor(float2 m_old, float2 m_new) {
  return make_float2(fast_exp2(m_old.x - safe_max(m_new.x)), fast_exp2(m_old.y - safe_max(m_new.y)));
}

// p = exp2(s - m) as the four register A operands of the p.v products (k-steps of 16 keys); adds the
// row sums of the fp32 values to sum. FINITE_MAX: the caller knows every row of m is finite (each has
// seen a key), so the safe_max compare is left out.
template <bool FINITE_MAX = false>
__device__ __forceinline__ void probabilities(uint4 (&p)[4], const float (&s)[32], float2 m, float2& sum) {
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float m_row = (e & 2) ? m.y : m.x;
      v[e] = fast_exp2(s[8 * t + e] - (FINITE_MAX ? m_row : safe_max(m_row)));
    }
    sum.x += v[0] + v[1] + v[4] + v[5];
    sum.y += v[2] + v[3] + v[6] + v[7];
    p[t] = make_uint4(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]), pack_bf16(v[4], v[5]), pack_bf16(v[6], v[7]));
  }
}

// Rescales this thread's output rows: o[4j], o[4j + 1] are in row lo, o[4j + 2], o[4j + 3] in row hi.
__device__ __forceinline__ void rescale(float (&o)[128], float2 f) {
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    o[4 * j] *= f.x;
    o[4 * j + 1] *= f.x;
    o[4 * j + 2] *= f.y;
    o[4 * j + 3] *= f.y;
  }
  fence_registers(o);  // done before the next product is issued on them
}

// o += p v over the tile's 64 keys, for the 256 output columns starting at column block cb0.
__device__ __forceinline__ void issue_pv(float (&o)[128], const uint4 (&p)[4], uint32_t tile, int cb0) {
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    wgmma_64x256_rs(o, p[t], smem_desc(tile + cb0 * kColBlockBytes + t * 16 * 128, kColBlockBytes, 1024));
  }
}

}  // namespace mla_tile
