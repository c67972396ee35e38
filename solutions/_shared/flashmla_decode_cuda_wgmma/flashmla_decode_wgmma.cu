// FlashMLA-form dense MLA decode for Hopper with wgmma and TMA: bf16 paged cache of 64-token
// blocks, one latent KV head, [512 latent | 64 rope] keys, causal over seq_len_q draft tokens,
// fp32 accumulation. Built for many heads (h_q a multiple of 64), where decode is compute-bound.
//
// Work partition. Row block r = (request b, query token i, group g of 64 heads), r = (b * s_q + i) *
// (h_q / 64) + g: the 64 heads are the 64 rows of every wgmma, and the row blocks of one request are
// adjacent in the grid, so they read the same keys from L2 at about the same time. One CTA per (KV
// split, row block), grid (num_splits, row blocks), in launches of at most 65535 row blocks. The
// number of splits comes from shapes only (about one CTA per SM in all); a split's chunk is a whole
// number of cache blocks, so each 64-key tile is one cache block: one block_table entry and 72 KB of
// contiguous memory, brought in by TMA (nine 64 x 64 boxes, 128-byte swizzle) with no gather.
//
// Per CTA: q (64 x 576) stays in shared memory; two tile buffers, even tiles in one, odd in the other.
// Two warpgroups (WG0, WG1) each own half of the 64 x 512 output in registers (columns [0, 256) and
// [256, 512)), and take turns at the logits: per pair of tiles (2j, 2j + 1)
//   WG0: s_e = q k_e^T; m0 = max(m, rowmax s_e); p_e = exp2(s_e - m0)  -> hands m0, p_e to WG1
//        o_L = o_L * exp2(m - m0) + p_e v_e[:, L]
//   WG1: s_o = q k_o^T (while WG0 does its softmax); m1 = max(m0, rowmax s_o); p_o = exp2(s_o - m1)
//        -> hands m1, p_o to WG0;  o_R = o_R * exp2(m - m1) + (p_e exp2(m0 - m1)) v_e[:, R] + p_o v_o[:, R]
//   WG0: o_L = o_L * exp2(m0 - m1) + p_o v_o[:, L];  m = m1
// so one warpgroup's softmax overlaps the other's products. The probabilities cross in shared memory
// in the registers' own order (a thread reads back exactly what the same thread of the other group
// wrote), as bf16, and both products take them as register operands. Each half of a tile buffer is
// refilled by the warpgroup that reads it last, as soon as its products on it are done: the first
// 256 latent columns and the rope columns by WG0, the other 256 latent columns by WG1; one mbarrier
// per buffer half tells both groups when it has landed. Softmax is in base 2 (logits scaled by
// softmax_scale * log2(e)).
//
// The last tile of a split may end inside its cache block: its logits past the end are masked, and
// its rows past the end are zeroed in shared memory before any product reads them as values (the
// cache there may hold anything, and 0 * NaN is NaN).
//
// Output. With one split the CTA writes out (bf16) and lse (natural log) itself. Otherwise it writes
// a normalised fp32 partial and its base-2 lse to workspace slot r * num_splits + split, and the merge
// kernel (a programmatic dependent of the decode kernel) combines the partials of each (row block,
// head) with weights exp2(lse_j - max), skipping the -inf ones of empty splits, which wrote no output.

#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#include "mla_wgmma_tile.cuh"  // the tile step and Hopper wrappers, shared with our other wgmma kernels

#ifndef FLASHMLA_WGMMA_PDL
#define FLASHMLA_WGMMA_PDL 1  // launch the merge kernel with programmatic dependent launch
#endif

namespace flashmla_wgmma {

using namespace mla_tile;

constexpr int kMaxGridY = 65535;
constexpr int kBytesHalfA = (kHalfCols + 1) * kColBlockBytes;  // latent [0, 256) and rope
constexpr int kBytesHalfB = kHalfCols * kColBlockBytes;        // latent [256, 512)
constexpr int kMinChunk = 256;                    // keys per split, at least
constexpr int kMaxSplits = 64;
constexpr int kMergeThreads = kDimV / 4;

struct DecodeParams {
  CUtensorMap q_map;             // q as [batch * s_q * h_q, 576], 64 x 64 boxes
  CUtensorMap kv_map;            // k_cache as [num_blocks * 64, 576], 64 x 64 boxes
  const int* block_table;        // [batch, max_blocks]
  const int* cache_seqlens;      // [batch]
  __nv_bfloat16* out;            // [batch, s_q, h_q, 512]
  float* lse;                    // [batch, h_q, s_q], natural log
  float* part_o;                 // [row blocks * num_splits, 64, 512], when num_splits > 1
  float* part_lse;               // [row blocks * num_splits, 64], base 2
  int s_q;
  int h_q;
  int max_blocks;
  int num_splits;
  int row_base;                  // first row block of this launch
  float scale_log2;              // softmax_scale * log2(e)
};

struct MergeParams {
  const float* part_o;
  const float* part_lse;
  __nv_bfloat16* out;
  float* lse;
  int s_q;
  int h_q;
  int num_splits;
};

// ------------------------------------------------------------------------------------------
// Decode kernel
// ------------------------------------------------------------------------------------------

// Loads one half of cache block `block` into the tile buffer at `tile`: half 0 is latent columns
// [0, 256) and the rope columns, half 1 latent columns [256, 512). Issued by one thread.
__device__ __forceinline__ void load_half(const DecodeParams& p, uint32_t tile, uint32_t bar, int block, int half) {
  const int y = block * kTile;
  if (half == 0) {
    mbar_expect_tx(bar, kBytesHalfA);
#pragma unroll
    for (int cb = 0; cb < kHalfCols; ++cb) tma_load(tile + cb * kColBlockBytes, &p.kv_map, cb * kBox, y, bar);
    tma_load(tile + 2 * kHalfCols * kColBlockBytes, &p.kv_map, 2 * kHalfCols * kBox, y, bar);
  } else {
    mbar_expect_tx(bar, kBytesHalfB);
#pragma unroll
    for (int cb = kHalfCols; cb < 2 * kHalfCols; ++cb) {
      tma_load(tile + cb * kColBlockBytes, &p.kv_map, cb * kBox, y, bar);
    }
  }
}

// Zeroes the rows [n_valid, 64) of a tile's 512 latent columns (whole rows, so the swizzle does not
// matter), by the 128 threads of one warpgroup, and fences the writes for the tensor cores.
__device__ __forceinline__ void zero_tail(unsigned char* tile, int n_valid, int lt) {
  const int pieces = (kTile - n_valid) * 8;  // 16-byte pieces per column block
  for (int k = lt; k < 2 * kHalfCols * pieces; k += 128) {
    const int cb = k / pieces;
    const int r = k - cb * pieces;
    *reinterpret_cast<uint4*>(tile + cb * kColBlockBytes + n_valid * 128 + r * 16) = make_uint4(0, 0, 0, 0);
  }
  fence_to_async_proxy();
}

__global__ void __launch_bounds__(kThreads, 1) flashmla_wgmma_kernel(const __grid_constant__ DecodeParams p) {
  extern __shared__ unsigned char smem_raw[];
  SharedStorage& sm = *reinterpret_cast<SharedStorage*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));

  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);  // known warp-uniform: no serialised wgmma
  const int lt = tid % 128;
  const int lane = tid & 31;
  const int row_lo = (lt / 32) * 16 + (lane >> 2);  // this thread's rows of the 64: row_lo, row_lo + 8
  const int split = blockIdx.x;
  const int rb = p.row_base + static_cast<int>(blockIdx.y);
  const int groups = p.h_q / kRows;
  const int bi = rb / groups;  // b * s_q + i
  const int b = bi / p.s_q;
  const int i = bi - b * p.s_q;
  const size_t slot = static_cast<size_t>(rb) * p.num_splits + split;

  const int len = __ldg(p.cache_seqlens + b);
  const int visible = len - p.s_q + i + 1;
  const int per_split = (len + p.num_splits - 1) / p.num_splits;
  const int chunk = max(kMinChunk, (per_split + kTile - 1) / kTile * kTile);
  const int start = split * chunk;
  const int end = min(start + chunk, visible);
  if (start >= end) {
    // Split 0 always holds key 0 (the constraints give visible >= 1), so this is a later split.
    if (p.num_splits > 1 && tid < kRows) p.part_lse[slot * kRows + tid] = -INFINITY;
    return;
  }
  const int n_tiles = (end - start + kTile - 1) / kTile;
  const int* table = p.block_table + static_cast<size_t>(b) * p.max_blocks + start / kTile;

  const uint32_t q_addr = smem_addr(sm.q);
  const uint32_t kv_addr[2] = {smem_addr(sm.kv[0]), smem_addr(sm.kv[1])};
  const uint32_t bar_q = smem_addr(&sm.bar_q);
  const uint32_t bar_kv[2][2] = {{smem_addr(&sm.bar_kv[0][0]), smem_addr(&sm.bar_kv[0][1])},
                                 {smem_addr(&sm.bar_kv[1][0]), smem_addr(&sm.bar_kv[1][1])}};
  if (tid == 0) {
    mbar_init(bar_q, 1);
    for (int k = 0; k < 2; ++k) {
      mbar_init(bar_kv[k][0], 1);
      mbar_init(bar_kv[k][1], 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (tid == 0) {
    mbar_expect_tx(bar_q, kTileBytes);
#pragma unroll
    for (int cb = 0; cb < kColBlocks; ++cb) tma_load(q_addr + cb * kColBlockBytes, &p.q_map, cb * kBox, rb * kRows, bar_q);
    for (int k = 0; k < 2 && k < n_tiles; ++k) {
      const int block = __ldg(table + k);
      load_half(p, kv_addr[k], bar_kv[k][0], block, 0);
      load_half(p, kv_addr[k], bar_kv[k][1], block, 1);
    }
  }

  float o[128];
#pragma unroll
  for (int k = 0; k < 128; ++k) o[k] = 0.f;
  float2 m = make_float2(-INFINITY, -INFINITY);  // running maxima of rows row_lo, row_lo + 8
  float2 l = make_float2(0.f, 0.f);              // this thread's part of the running sums of its group's tiles
  const float scale = p.scale_log2;
  const int n_pairs = (n_tiles + 1) / 2;
  mbar_wait(bar_q, 0);

  for (int j = 0; j < n_pairs; ++j) {
    const int k_even = 2 * j;
    const int k_odd = k_even + 1;
    const bool has_odd = k_odd < n_tiles;
    const int parity = j & 1;
    if (wg == 0) {
      float s[32];
      logits<false>(s, q_addr, kv_addr[0], bar_kv[0][0], bar_kv[0][1], parity);
      const int n_valid = min(kTile, end - (start + k_even * kTile));
      const float2 mx = scale_and_max(s, scale, make_int2(n_valid, n_valid), lane);
      const float2 m0 = make_float2(fmaxf(m.x, mx.x), fmaxf(m.y, mx.y));  // finite: the tile has a key
      const float2 alpha = make_float2(fast_exp2(m.x - m0.x), fast_exp2(m.y - m0.y));
      uint4 pe[4];
      float2 sum = make_float2(0.f, 0.f);
      probabilities<true>(pe, s, m0, sum);
      l = make_float2(l.x * alpha.x + sum.x, l.y * alpha.y + sum.y);  // even tiles' sums, in fp32
      if (n_valid < kTile) zero_tail(sm.kv[0], n_valid, lt);
#pragma unroll
      for (int t = 0; t < 4; ++t) sm.p[t][lt] = pe[t];
      if ((lane & 3) == 0) {
        sm.m_even[row_lo] = m0.x;
        sm.m_even[row_lo + 8] = m0.y;
      }
      named_arrive(kBarEvenReady, kThreads);
      if (n_valid < kTile) named_sync(kBarGroup0, 128);  // every thread's zeros are in before the product
      rescale(o, alpha);
      wgmma_fence();
      issue_pv(o, pe, kv_addr[0], 0);
      wgmma_commit();
      named_sync(kBarOddReady, kThreads);  // m1 and p_o are in shared memory
      wgmma_wait<0>();
      fence_registers(o);
      named_sync(kBarGroup0, 128);  // the whole group is done with half 0 of the even buffer
      if (lt == 0 && k_even + 2 < n_tiles) load_half(p, kv_addr[0], bar_kv[0][0], __ldg(table + k_even + 2), 0);
      const float2 m1 = make_float2(sm.m_odd[row_lo], sm.m_odd[row_lo + 8]);
      const float2 beta = make_float2(fast_exp2(m0.x - m1.x), fast_exp2(m0.y - m1.y));
      rescale(o, beta);
      l = make_float2(l.x * beta.x, l.y * beta.y);
      if (has_odd) {
        uint4 po[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) po[t] = sm.p[t][lt];
        mbar_wait(bar_kv[1][0], parity);
        wgmma_fence();
        issue_pv(o, po, kv_addr[1], 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_registers(o);
        named_sync(kBarGroup0, 128);
        if (lt == 0 && k_odd + 2 < n_tiles) load_half(p, kv_addr[1], bar_kv[1][0], __ldg(table + k_odd + 2), 0);
      }
      m = m1;
    } else {
      float s[32];
      float2 mx = make_float2(-INFINITY, -INFINITY);
      if (has_odd) {
        logits<false>(s, q_addr, kv_addr[1], bar_kv[1][0], bar_kv[1][1], parity);
        const int n_valid = min(kTile, end - (start + k_odd * kTile));
        mx = scale_and_max(s, scale, make_int2(n_valid, n_valid), lane);
        if (n_valid < kTile) zero_tail(sm.kv[1], n_valid, lt);
      }
      named_sync(kBarEvenReady, kThreads);  // m0 and p_e are in shared memory (and the zeros of both groups)
      const float2 m0 = make_float2(sm.m_even[row_lo], sm.m_even[row_lo + 8]);
      const float2 m1 = make_float2(fmaxf(m0.x, mx.x), fmaxf(m0.y, mx.y));  // finite, as m0 is
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
        probabilities<true>(po, s, m1, sum);
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
      mbar_wait(bar_kv[0][1], parity);
      wgmma_fence();
      issue_pv(o, pe, kv_addr[0], kHalfCols);
      wgmma_commit();
      if (has_odd) issue_pv(o, po, kv_addr[1], kHalfCols);
      wgmma_commit();
      // The even buffer's half 1 is refilled as soon as its product is done, while the odd one's runs:
      // WG0's next logits wait for it.
      wgmma_wait<1>();
      named_sync(kBarGroup1, 128);
      if (lt == 0 && k_even + 2 < n_tiles) load_half(p, kv_addr[0], bar_kv[0][1], __ldg(table + k_even + 2), 1);
      wgmma_wait<0>();
      fence_registers(o);
      named_sync(kBarGroup1, 128);  // the whole group is done with half 1 of the odd buffer
      if (lt == 0 && k_odd + 2 < n_tiles) load_half(p, kv_addr[1], bar_kv[1][1], __ldg(table + k_odd + 2), 1);
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
  l = make_float2(sm.row_sum[0][row_lo] + sm.row_sum[1][row_lo], sm.row_sum[0][row_lo + 8] + sm.row_sum[1][row_lo + 8]);
  if (wg == 1 && (lane & 3) == 0) {
    const int heads0 = (rb - bi * groups) * kRows;
    for (int h = 0; h < 2; ++h) {
      const int row = row_lo + 8 * h;
      const float lse2 = (h ? m.y : m.x) + fast_log2(h ? l.y : l.x);
      if (p.num_splits > 1) {
        p.part_lse[slot * kRows + row] = lse2;
      } else {
        p.lse[(static_cast<size_t>(b) * p.h_q + heads0 + row) * p.s_q + i] = lse2 * kLn2;
      }
    }
  }
  const float2 inv = make_float2(1.f / l.x, 1.f / l.y);
  const int col0 = wg * (kDimV / 2) + 2 * (lane & 3);
  if (p.num_splits > 1) {
    float* dst = p.part_o + slot * kRows * kDimV;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int col = col0 + 8 * j;
      *reinterpret_cast<float2*>(dst + row_lo * kDimV + col) = make_float2(o[4 * j] * inv.x, o[4 * j + 1] * inv.x);
      *reinterpret_cast<float2*>(dst + (row_lo + 8) * kDimV + col) =
          make_float2(o[4 * j + 2] * inv.y, o[4 * j + 3] * inv.y);
    }
  } else {
    // out[b, i, the group's 64 heads, :] is one contiguous 64 x 512 block.
    __nv_bfloat16* dst = p.out + static_cast<size_t>(rb) * kRows * kDimV;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int col = col0 + 8 * j;
      *reinterpret_cast<__nv_bfloat162*>(dst + row_lo * kDimV + col) =
          __floats2bfloat162_rn(o[4 * j] * inv.x, o[4 * j + 1] * inv.x);
      *reinterpret_cast<__nv_bfloat162*>(dst + (row_lo + 8) * kDimV + col) =
          __floats2bfloat162_rn(o[4 * j + 2] * inv.y, o[4 * j + 3] * inv.y);
    }
  }
}

// ------------------------------------------------------------------------------------------
// Merge kernel: one block per (row block, head), one float4 of the 512 outputs per thread; the max of
// the partial lses first, so each partial is weighted once.
// ------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kMergeThreads) flashmla_wgmma_merge_kernel(const MergeParams p) {
  const int tid = threadIdx.x;
  const int rb = blockIdx.x / kRows;
  const int h = blockIdx.x - rb * kRows;
  const size_t slot0 = static_cast<size_t>(rb) * p.num_splits;
  const float* part_lse = p.part_lse + slot0 * kRows + h;
  const float* part_o = p.part_o + (slot0 * kRows + h) * kDimV + tid * 4;

  grid_dependency_wait();  // before any partial is read

  float mx = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) mx = fmaxf(mx, __ldcg(part_lse + s * kRows));
  float total = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int s = 0; s < p.num_splits; ++s) {
    const float lse2 = __ldcg(part_lse + s * kRows);
    if (lse2 == -INFINITY) continue;  // an empty split wrote no output
    const float4 v = __ldcg(reinterpret_cast<const float4*>(part_o + static_cast<size_t>(s) * kRows * kDimV));
    const float w = fast_exp2(lse2 - mx);
    total += w;
    acc = make_float4(acc.x + w * v.x, acc.y + w * v.y, acc.z + w * v.z, acc.w + w * v.w);
  }
  const float inv = 1.f / total;
  // blockIdx.x = rb * 64 + h indexes out's [batch * s_q * h_q] heads directly.
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(p.out + static_cast<size_t>(blockIdx.x) * kDimV + tid * 4);
  o[0] = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
  o[1] = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
  if (tid == 0) {
    const int groups = p.h_q / kRows;
    const int bi = rb / groups;
    const int b = bi / p.s_q;
    const int i = bi - b * p.s_q;
    const int head = (rb - bi * groups) * kRows + h;
    p.lse[(static_cast<size_t>(b) * p.h_q + head) * p.s_q + i] = (mx + fast_log2(total)) * kLn2;
  }
}

// ------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------


// A [rows, 576] bf16 row-major tensor as 64 x 64 boxes with the 128-byte swizzle the wgmma
// descriptors expect.
static cudaError_t make_map(CUtensorMap* map, const void* base, uint64_t rows) {
  hopper::EncodeTiled encode = nullptr;
  const cudaError_t err = encode_function(&encode);
  if (err != cudaSuccess) return err;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(kDimK), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(kDimK) * 2};
  const cuuint32_t box[2] = {kBox, kTile};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult res = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box,
                              element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// Splits per row block from shapes only: as many as keep all CTAs in one wave (one per SM; a second
// wave of a few CTAs would cost as much as the first), but no more than max_len (the table's
// capacity, an upper bound on every length) cut in kMinChunk pieces.
int choose_splits(int row_blocks, int max_len, int num_sms) {
  const int target = num_sms > 0 ? num_sms : 132;
  if (row_blocks >= target) return 1;
  int splits = target / row_blocks;
  const int by_len = (max_len + kMinChunk - 1) / kMinChunk;
  if (splits > by_len) splits = by_len;
  if (splits > kMaxSplits) splits = kMaxSplits;
  return splits > 1 ? splits : 1;
}

// Runs the decode on `stream`. All pointers are device pointers to contiguous tensors: q [batch, s_q,
// h_q, 576] bf16, k_cache [num_blocks, 64, 1, 576] bf16, block_table [batch, max_blocks] int32,
// cache_seqlens [batch] int32, out [batch, s_q, h_q, 512] bf16, lse [batch, h_q, s_q] fp32; with
// num_splits > 1, part_o [row blocks * num_splits * 64 * 512] and part_lse [row blocks * num_splits
// * 64] fp32. h_q is a multiple of 64; q, k_cache are 16-byte aligned.
cudaError_t launch(const void* q, const void* k_cache, int64_t num_blocks, const int* block_table,
                   const int* cache_seqlens, int batch, int s_q, int h_q, int max_blocks, float softmax_scale,
                   void* out, float* lse, float* part_o, float* part_lse, int num_splits, cudaStream_t stream) {
  const int row_blocks = batch * s_q * (h_q / kRows);
  if (row_blocks <= 0) return cudaSuccess;
  const size_t smem = sizeof(SharedStorage) + 1024;  // + room to align the storage to 1024 bytes

  static bool configured[64] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= 64 || !configured[device]) {
    err = cudaFuncSetAttribute(flashmla_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    if (device >= 0 && device < 64) configured[device] = true;
  }

  DecodeParams dp;
  err = make_map(&dp.q_map, q, static_cast<uint64_t>(row_blocks) * kRows);
  if (err != cudaSuccess) return err;
  err = make_map(&dp.kv_map, k_cache, static_cast<uint64_t>(num_blocks) * kTile);
  if (err != cudaSuccess) return err;
  dp.block_table = block_table;
  dp.cache_seqlens = cache_seqlens;
  dp.out = static_cast<__nv_bfloat16*>(out);
  dp.lse = lse;
  dp.part_o = part_o;
  dp.part_lse = part_lse;
  dp.s_q = s_q;
  dp.h_q = h_q;
  dp.max_blocks = max_blocks;
  dp.num_splits = num_splits;
  dp.scale_log2 = softmax_scale * kLog2e;
  for (int base = 0; base < row_blocks; base += kMaxGridY) {
    dp.row_base = base;
    const int n = row_blocks - base < kMaxGridY ? row_blocks - base : kMaxGridY;
    flashmla_wgmma_kernel<<<dim3(num_splits, n), kThreads, smem, stream>>>(dp);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (num_splits == 1) return cudaSuccess;

  MergeParams mp;
  mp.part_o = part_o;
  mp.part_lse = part_lse;
  mp.out = static_cast<__nv_bfloat16*>(out);
  mp.lse = lse;
  mp.s_q = s_q;
  mp.h_q = h_q;
  mp.num_splits = num_splits;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(row_blocks * kRows, 1, 1);
  cfg.blockDim = dim3(kMergeThreads, 1, 1);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = FLASHMLA_WGMMA_PDL ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, flashmla_wgmma_merge_kernel, mp);
}

}  // namespace flashmla_wgmma
