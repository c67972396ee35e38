// FlashMLA-form sparse MLA prefill for Hopper (flash_mla_sparse_fwd): bf16 q [s_q, h_q, 576], bf16 kv
// [s_kv, 1, 576] ([512 latent | 64 rope]), int32 indices [s_q, 1, topk] (-1 or >= s_kv invalid),
// optional per-token topk_length and per-head attention sink; out bf16 [s_q, h_q, 512], base-2
// max_logits and lse [s_q, h_q]. The tile step is the dense wgmma decode's (mla_wgmma_tile.cuh): same
// swizzled layout, descriptors and pair schedule; what differs is how a tile gets into shared memory.
//
// Partition. One CTA per row block rb = token * (h_q / 64) + group: the token's 64 heads of that group
// are the 64 rows (M) of every wgmma, and they share the token's index list. The row blocks of one
// token are adjacent in the grid, so the second reads the gathered rows from L2.
//
// Prologue. The CTA reads its token's index list once and keeps a validity bit per entry (-1, >= s_kv,
// or at/past topk_length are invalid) in shared memory; 64-entry tiles with no valid entry are dropped
// and the rest listed in order, so every tile the loop sees has a valid key (the running maxima are
// finite after the first tile, as in the decode) and a token with none writes out 0, max_logits and lse
// -inf without computing. q is gathered like the keys.
//
// Loads. A tile is 64 gathered kv rows. Each is copied with cp.async (16 bytes, L2 only) into the
// TMA SWIZZLE_128B layout: column block cb (64 columns) at cb * 8192, row r at r * 128, 16-byte chunk
// c at (c ^ (r % 8)) * 16. Eight threads copy one 128-byte segment of a row; an invalid entry copies
// zero bytes (zero fill), so its row is 0 (never NaN) and its logit is masked to -inf. Each buffer half
// is filled by the 128 threads of the warpgroup that reads it last (latent [0, 256) and rope by WG0,
// latent [256, 512) by WG1), each thread signalling the half's mbarrier (count 128) with
// cp.async.mbarrier.arrive.noinc; a reader waits on it, then fences the generic-proxy writes before its
// wgmma (async proxy) reads them.

#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#include "mla_wgmma_tile.cuh"

namespace sparse_prefill_wgmma {

using namespace mla_tile;

constexpr int kRowBytes = kDimK * 2;              // 1152 bytes per kv / q row
constexpr int kMaxTopk = 2048;                    // entries per token (the validity bits are sized for it)
constexpr int kMaxTiles = kMaxTopk / kTile;       // 32: one lane per tile when listing them

struct SharedStorage {
  alignas(1024) unsigned char q[kTileBytes];     // 9 column blocks of 64 rows x 128 bytes, swizzled
  alignas(1024) unsigned char kv[2][kTileBytes]; // even and odd tiles, same layout
  uint4 p[4][128];                               // probabilities in register order: [k-step][thread]
  float m_even[kRows];                           // m0 of the current pair, per row
  float m_odd[kRows];                            // m1 of the current pair, per row
  float row_sum[2][kRows];                       // final sums of exp2 over each group's tiles
  alignas(8) unsigned char valid[kMaxTopk / 8];  // bit e of byte b: entry 8b + e is valid
  int tiles[kMaxTiles];                          // the non-empty tiles, in order
  int n_tiles;
  alignas(8) uint64_t bar_q;                     // count 256: every thread's q copies
  uint64_t bar_kv[2][2];                         // [buffer][half], count 128: the half has landed
};

static_assert(sizeof(SharedStorage) + 1024 <= kMaxDynamicSmem, "shared storage (+ alignment room) must fit");

struct Params {
  const __nv_bfloat16* q;       // [s_q * h_q, 576]
  const __nv_bfloat16* kv;      // [s_kv, 576]
  const int* indices;           // [s_q, topk]
  const int* topk_length;       // [s_q] or null
  const float* attn_sink;       // [h_q] or null, natural-log units
  __nv_bfloat16* out;           // [s_q * h_q, 512]
  float* max_logits;            // [s_q * h_q], base 2
  float* lse;                   // [s_q * h_q], base 2
  int s_kv;
  int topk;                     // a multiple of 64, at most kMaxTopk
  int groups;                   // h_q / 64
  float scale_log2;             // sm_scale * log2(e)
};

// ------------------------------------------------------------------------------------------
// Sparse prefill kernel
// ------------------------------------------------------------------------------------------

// Gathers one half of the tile of entries [base, base + 64) into the buffer at `tile`, by the 128
// threads of one warpgroup: half 0 is latent columns [0, 256) and the rope columns, half 1 latent
// columns [256, 512). Thread lt copies 16-byte chunk c = lt % 8 of rows lt / 8 + 16 i (i < 4); row
// r % 8 = (lt / 8) % 8 for all four, so the swizzled chunk position is fixed per thread.
__device__ __forceinline__ void gather_half(const Params& p, const int* idx_row, int count, uint32_t tile, uint32_t bar,
                                            int base, int half, int lt) {
  const int r0 = lt >> 3;
  const int c = lt & 7;
  const uint32_t dst = tile + r0 * 128 + ((c ^ (r0 & 7)) << 4);
  const unsigned char* kv = reinterpret_cast<const unsigned char*>(p.kv) + c * 16;
  int id[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int pos = base + r0 + 16 * i;
    id[i] = pos < count ? __ldg(idx_row + pos) : -1;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const bool ok = static_cast<unsigned>(id[i]) < static_cast<unsigned>(p.s_kv);  // -1 and >= s_kv fail
    const unsigned char* src = kv + static_cast<size_t>(ok ? id[i] : 0) * kRowBytes;
    const uint32_t bytes = ok ? 16u : 0u;
    const uint32_t d = dst + i * 16 * 128;
    if (half == 0) {
#pragma unroll
      for (int cb = 0; cb < kHalfCols; ++cb) cp_async_16(d + cb * kColBlockBytes, src + cb * 128, bytes);
      cp_async_16(d + 2 * kHalfCols * kColBlockBytes, src + 2 * kHalfCols * 128, bytes);
    } else {
#pragma unroll
      for (int cb = kHalfCols; cb < 2 * kHalfCols; ++cb) cp_async_16(d + cb * kColBlockBytes, src + cb * 128, bytes);
    }
  }
  cp_async_arrive(bar);
}

// The validity bits of the k-th listed tile: bit i of .x (i < 32) / .y (i - 32) is key i of the tile.
__device__ __forceinline__ uint2 tile_mask(const SharedStorage& sm, int k) {
  return *reinterpret_cast<const uint2*>(sm.valid + 8 * sm.tiles[k]);
}

// Scales the logits to base 2 and masks the invalid keys; returns the row maxima of this thread's two
// rows over the quad that shares them. Thread columns: 8 j + 2 (lane % 4) + (e & 1).
__device__ __forceinline__ float2 scale_and_max(float (&s)[32], float scale, uint2 mask, int lane) {
  float mx_lo = -INFINITY, mx_hi = -INFINITY;
  const int c0 = 2 * (lane & 3);
  const uint32_t w_lo = mask.x >> c0;
  const uint32_t w_hi = mask.y >> c0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint32_t w = j < 4 ? w_lo : w_hi;
      const bool valid = (w >> (8 * (j & 3) + (e & 1))) & 1u;
      const float x = valid ? s[4 * j + e] * scale : -INFINITY;
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

__global__ void __launch_bounds__(kThreads, 1) sparse_prefill_kernel(const __grid_constant__ Params p) {
  extern __shared__ unsigned char smem_raw[];
  SharedStorage& sm = *reinterpret_cast<SharedStorage*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));

  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);  // known warp-uniform: no serialised wgmma
  const int lt = tid % 128;
  const int lane = tid & 31;
  const int row_lo = (lt / 32) * 16 + (lane >> 2);  // this thread's rows of the 64: row_lo, row_lo + 8
  const int rb = blockIdx.x;
  const int token = rb / p.groups;
  const int* idx_row = p.indices + static_cast<size_t>(token) * p.topk;
  const int count = p.topk_length != nullptr ? min(max(__ldg(p.topk_length + token), 0), p.topk) : p.topk;

  const uint32_t q_addr = smem_addr(sm.q);
  const uint32_t kv_addr[2] = {smem_addr(sm.kv[0]), smem_addr(sm.kv[1])};
  const uint32_t bar_q = smem_addr(&sm.bar_q);
  const uint32_t bar_kv[2][2] = {{smem_addr(&sm.bar_kv[0][0]), smem_addr(&sm.bar_kv[0][1])},
                                 {smem_addr(&sm.bar_kv[1][0]), smem_addr(&sm.bar_kv[1][1])}};
  if (tid == 0) {
    mbar_init(bar_q, kThreads);
    for (int k = 0; k < 2; ++k) {
      mbar_init(bar_kv[k][0], 128);
      mbar_init(bar_kv[k][1], 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // Validity of entries [8 tid, 8 tid + 8) (256 threads x 8 = kMaxTopk); entries at or past count are
  // invalid and never read (count <= topk, a multiple of 64, so the loads stay in the row).
  {
    const int pos0 = 8 * tid;
    uint32_t bits = 0;
    if (pos0 < count) {
      const int4 a = __ldg(reinterpret_cast<const int4*>(idx_row + pos0));
      const int4 b = __ldg(reinterpret_cast<const int4*>(idx_row + pos0 + 4));
      const int v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        if (pos0 + e < count && static_cast<unsigned>(v[e]) < static_cast<unsigned>(p.s_kv)) bits |= 1u << e;
      }
    }
    sm.valid[tid] = static_cast<unsigned char>(bits);
  }
  __syncthreads();
  // Warp 0 lists the tiles with a valid entry (lane k: tile k).
  if (tid < 32) {
    const uint2 w = *reinterpret_cast<const uint2*>(sm.valid + 8 * tid);
    const bool nonempty = (w.x | w.y) != 0u;
    const uint32_t ballot = __ballot_sync(0xffffffffu, nonempty);
    if (nonempty) sm.tiles[__popc(ballot & ((1u << tid) - 1u))] = tid;
    if (tid == 0) sm.n_tiles = __popc(ballot);
  }
  __syncthreads();
  // Through a shuffle so ptxas knows it warp-uniform: a shared-memory load is not, and a loop bound it
  // cannot prove uniform serialises every wgmma in the loop (C7520).
  const int n_tiles = __shfl_sync(0xffffffffu, sm.n_tiles, 0);

  if (n_tiles == 0) {
    // No valid entry: the empty sums (out 0, max_logits and lse -inf); nothing was copied.
    uint4* dst = reinterpret_cast<uint4*>(p.out + static_cast<size_t>(rb) * kRows * kDimV);
#pragma unroll
    for (int k = 0; k < kRows * kDimV * 2 / 16 / kThreads; ++k) dst[k * kThreads + tid] = make_uint4(0, 0, 0, 0);
    if (tid < kRows) {
      p.max_logits[static_cast<size_t>(rb) * kRows + tid] = -INFINITY;
      p.lse[static_cast<size_t>(rb) * kRows + tid] = -INFINITY;
    }
    return;
  }

  // q: rows tid / 8 and tid / 8 + 32 of the block, chunk tid % 8 of each of the nine column blocks.
  {
    const int r0 = tid >> 3;
    const int c = tid & 7;
    const uint32_t dst = q_addr + r0 * 128 + ((c ^ (r0 & 7)) << 4);
    const unsigned char* src =
        reinterpret_cast<const unsigned char*>(p.q) + (static_cast<size_t>(rb) * kRows + r0) * kRowBytes + c * 16;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int cb = 0; cb < kColBlocks; ++cb) {
        cp_async_16(dst + i * 32 * 128 + cb * kColBlockBytes, src + i * 32 * kRowBytes + cb * 128, 16u);
      }
    }
    cp_async_arrive(bar_q);
  }
  // Tiles 0 and 1, each group its halves (addresses from wg directly: no runtime-indexed arrays).
  gather_half(p, idx_row, count, kv_addr[0], smem_addr(&sm.bar_kv[0][wg]), sm.tiles[0] * kTile, wg, lt);
  if (n_tiles > 1) {
    gather_half(p, idx_row, count, kv_addr[1], smem_addr(&sm.bar_kv[1][wg]), sm.tiles[1] * kTile, wg, lt);
  }

  float o[128];
#pragma unroll
  for (int k = 0; k < 128; ++k) o[k] = 0.f;
  float2 m = make_float2(-INFINITY, -INFINITY);  // running maxima of rows row_lo, row_lo + 8
  float2 l = make_float2(0.f, 0.f);              // this thread's part of the running sums of its group's tiles
  const float scale = p.scale_log2;
  const int n_pairs = (n_tiles + 1) / 2;
  wait_landed(bar_q, 0);

  for (int j = 0; j < n_pairs; ++j) {
    const int k_even = 2 * j;
    const int k_odd = k_even + 1;
    const bool has_odd = k_odd < n_tiles;
    const int parity = j & 1;
    if (wg == 0) {
      float s[32];
      logits<true>(s, q_addr, kv_addr[0], bar_kv[0][0], bar_kv[0][1], parity);
      const float2 mx = scale_and_max(s, scale, tile_mask(sm, k_even), lane);
      const float2 m0 = make_float2(fmaxf(m.x, mx.x), fmaxf(m.y, mx.y));  // finite: the tile has a valid key
      const float2 alpha = make_float2(fast_exp2(m.x - m0.x), fast_exp2(m.y - m0.y));
      uint4 pe[4];
      float2 sum = make_float2(0.f, 0.f);
      probabilities(pe, s, m0, sum);
      l = make_float2(l.x * alpha.x + sum.x, l.y * alpha.y + sum.y);  // even tiles' sums, in fp32
#pragma unroll
      for (int t = 0; t < 4; ++t) sm.p[t][lt] = pe[t];
      if ((lane & 3) == 0) {
        sm.m_even[row_lo] = m0.x;
        sm.m_even[row_lo + 8] = m0.y;
      }
      named_arrive(kBarEvenReady, kThreads);
      rescale(o, alpha);
      wgmma_fence();
      issue_pv(o, pe, kv_addr[0], 0);
      wgmma_commit();
      named_sync(kBarOddReady, kThreads);  // m1 and p_o are in shared memory
      wgmma_wait<0>();
      fence_registers(o);
      named_sync(kBarGroup0, 128);  // the whole group is done with half 0 of the even buffer
      if (k_even + 2 < n_tiles) {
        gather_half(p, idx_row, count, kv_addr[0], bar_kv[0][0], sm.tiles[k_even + 2] * kTile, 0, lt);
      }
      const float2 m1 = make_float2(sm.m_odd[row_lo], sm.m_odd[row_lo + 8]);
      const float2 beta = make_float2(fast_exp2(m0.x - m1.x), fast_exp2(m0.y - m1.y));
      rescale(o, beta);
      l = make_float2(l.x * beta.x, l.y * beta.y);
      if (has_odd) {
        uint4 po[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) po[t] = sm.p[t][lt];
        wait_landed(bar_kv[1][0], parity);
        wgmma_fence();
        issue_pv(o, po, kv_addr[1], 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_registers(o);
        named_sync(kBarGroup0, 128);  // the whole group is done with half 0 of the odd buffer
        if (k_odd + 2 < n_tiles) {
          gather_half(p, idx_row, count, kv_addr[1], bar_kv[1][0], sm.tiles[k_odd + 2] * kTile, 0, lt);
        }
      }
      m = m1;
    } else {
      float s[32];
      float2 mx = make_float2(-INFINITY, -INFINITY);
      if (has_odd) {
        logits<true>(s, q_addr, kv_addr[1], bar_kv[1][0], bar_kv[1][1], parity);
        mx = scale_and_max(s, scale, tile_mask(sm, k_odd), lane);
      }
      named_sync(kBarEvenReady, kThreads);  // m0 and p_e are in shared memory
      const float2 m0 = make_float2(sm.m_even[row_lo], sm.m_even[row_lo + 8]);
      const float2 m1 = make_float2(fmaxf(m0.x, mx.x), fmaxf(m0.y, mx.y));
      const float2 alpha = make_float2(fast_exp2(m.x - m1.x), fast_exp2(m.y - m1.y));
      const float2 beta = make_float2(fast_exp2(m0.x - m1.x), fast_exp2(m0.y - m1.y));
      float2 sum = make_float2(0.f, 0.f);
      uint4 pe[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const uint4 raw = sm.p[t][lt];
        const float2 a = unpack_bf16(raw.x), c = unpack_bf16(raw.y), d = unpack_bf16(raw.z), e = unpack_bf16(raw.w);
        const float2 lo0 = make_float2(a.x * beta.x, a.y * beta.x), hi0 = make_float2(c.x * beta.y, c.y * beta.y);
        const float2 lo1 = make_float2(d.x * beta.x, d.y * beta.x), hi1 = make_float2(e.x * beta.y, e.y * beta.y);
        pe[t] = make_uint4(pack_bf16(lo0.x, lo0.y), pack_bf16(hi0.x, hi0.y), pack_bf16(lo1.x, lo1.y),
                           pack_bf16(hi1.x, hi1.y));
      }
      uint4 po[4];
      if (has_odd) {
        probabilities(po, s, m1, sum);
#pragma unroll
        for (int t = 0; t < 4; ++t) sm.p[t][lt] = po[t];
      }
      if ((lane & 3) == 0) {
        sm.m_odd[row_lo] = m1.x;
        sm.m_odd[row_lo + 8] = m1.y;
      }
      named_arrive(kBarOddReady, kThreads);
      l = make_float2(l.x * alpha.x + sum.x, l.y * alpha.y + sum.y);
      rescale(o, alpha);
      wait_landed(bar_kv[0][1], parity);
      wgmma_fence();
      issue_pv(o, pe, kv_addr[0], kHalfCols);
      wgmma_commit();
      if (has_odd) issue_pv(o, po, kv_addr[1], kHalfCols);
      wgmma_commit();
      // The even buffer's half 1 is refilled as soon as its product is done, while the odd one's runs:
      // WG0's next logits wait for it.
      wgmma_wait<1>();
      named_sync(kBarGroup1, 128);
      if (k_even + 2 < n_tiles) {
        gather_half(p, idx_row, count, kv_addr[0], bar_kv[0][1], sm.tiles[k_even + 2] * kTile, 1, lt);
      }
      wgmma_wait<0>();
      fence_registers(o);
      named_sync(kBarGroup1, 128);  // the whole group is done with half 1 of the odd buffer
      if (k_odd + 2 < n_tiles) {
        gather_half(p, idx_row, count, kv_addr[1], bar_kv[1][1], sm.tiles[k_odd + 2] * kTile, 1, lt);
      }
      m = m1;
    }
  }

  // Row sums: each group holds its threads' parts of the sums over its own tiles (in fp32, as the
  // probabilities were before rounding), both in the frame of the final maxima; the quad that shares a
  // row adds them up, then the two groups swap theirs.
  l.x += __shfl_xor_sync(0xffffffffu, l.x, 1);
  l.x += __shfl_xor_sync(0xffffffffu, l.x, 2);
  l.y += __shfl_xor_sync(0xffffffffu, l.y, 1);
  l.y += __shfl_xor_sync(0xffffffffu, l.y, 2);
  if ((lane & 3) == 0) {
    sm.row_sum[wg][row_lo] = l.x;
    sm.row_sum[wg][row_lo + 8] = l.y;
  }
  __syncthreads();
  // l >= 1: the row's maximum contributes exp2(0).
  l = make_float2(sm.row_sum[0][row_lo] + sm.row_sum[1][row_lo], sm.row_sum[0][row_lo + 8] + sm.row_sum[1][row_lo + 8]);
  const float2 lse2 = make_float2(m.x + fast_log2(l.x), m.y + fast_log2(l.y));
  const size_t row0 = static_cast<size_t>(rb) * kRows;
  if (wg == 1 && (lane & 3) == 0) {
    p.max_logits[row0 + row_lo] = m.x;
    p.max_logits[row0 + row_lo + 8] = m.y;
    p.lse[row0 + row_lo] = lse2.x;
    p.lse[row0 + row_lo + 8] = lse2.y;
  }
  // The sink joins the denominator only: out *= e^L / (e^L + e^sink) = 1 / (1 + 2^(sink log2(e) - lse2)).
  float2 keep = make_float2(1.f, 1.f);
  if (p.attn_sink != nullptr) {
    const int head0 = (rb - token * p.groups) * kRows;
    const float s_lo = __ldg(p.attn_sink + head0 + row_lo), s_hi = __ldg(p.attn_sink + head0 + row_lo + 8);
    keep = make_float2(1.f / (1.f + fast_exp2(s_lo * kLog2e - lse2.x)),
                       1.f / (1.f + fast_exp2(s_hi * kLog2e - lse2.y)));
  }
  const float2 inv = make_float2(keep.x / l.x, keep.y / l.y);
  const int col0 = wg * (kDimV / 2) + 2 * (lane & 3);
  // out[token, the group's 64 heads, :] is one contiguous 64 x 512 block.
  __nv_bfloat16* dst = p.out + row0 * kDimV;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int col = col0 + 8 * j;
    *reinterpret_cast<__nv_bfloat162*>(dst + row_lo * kDimV + col) =
        __floats2bfloat162_rn(o[4 * j] * inv.x, o[4 * j + 1] * inv.x);
    *reinterpret_cast<__nv_bfloat162*>(dst + (row_lo + 8) * kDimV + col) =
        __floats2bfloat162_rn(o[4 * j + 2] * inv.y, o[4 * j + 3] * inv.y);
  }
}

// ------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------

// Runs the prefill on `stream`. All pointers are device pointers to contiguous tensors: q [s_q, h_q,
// 576] bf16, kv [s_kv, 1, 576] bf16, indices [s_q, 1, topk] int32, topk_length [s_q] int32 or null,
// attn_sink [h_q] fp32 or null, out [s_q, h_q, 512] bf16, max_logits and lse [s_q, h_q] fp32. h_q is a
// multiple of 64, topk a multiple of 64 and at most 2048, s_kv >= 1; q, kv, indices 16-byte aligned.
cudaError_t launch(const void* q, const void* kv, const int* indices, const int* topk_length, const float* attn_sink,
                   void* out, float* max_logits, float* lse, int s_q, int h_q, int s_kv, int topk, float sm_scale,
                   cudaStream_t stream) {
  const long long row_blocks = static_cast<long long>(s_q) * (h_q / kRows);
  if (row_blocks <= 0) return cudaSuccess;
  if (row_blocks > 0x7fffffffLL || topk <= 0 || topk > kMaxTopk || topk % kTile != 0 || s_kv <= 0) {
    return cudaErrorInvalidValue;
  }
  const size_t smem = sizeof(SharedStorage) + 1024;  // + room to align the storage to 1024 bytes

  static bool configured[64] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= 64 || !configured[device]) {
    err = cudaFuncSetAttribute(sparse_prefill_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    if (device >= 0 && device < 64) configured[device] = true;
  }

  Params prm;
  prm.q = static_cast<const __nv_bfloat16*>(q);
  prm.kv = static_cast<const __nv_bfloat16*>(kv);
  prm.indices = indices;
  prm.topk_length = topk_length;
  prm.attn_sink = attn_sink;
  prm.out = static_cast<__nv_bfloat16*>(out);
  prm.max_logits = max_logits;
  prm.lse = lse;
  prm.s_kv = s_kv;
  prm.topk = topk;
  prm.groups = h_q / kRows;
  prm.scale_log2 = sm_scale * kLog2e;
  sparse_prefill_kernel<<<dim3(static_cast<unsigned>(row_blocks)), kThreads, smem, stream>>>(prm);
  return cudaGetLastError();
}

}  // namespace sparse_prefill_wgmma
