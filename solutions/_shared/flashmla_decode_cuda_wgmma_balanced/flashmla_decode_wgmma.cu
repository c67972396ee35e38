// FlashMLA-form dense MLA decode for Hopper with wgmma and TMA: bf16 paged cache of 64-token
// blocks, one latent KV head, [512 latent | 64 rope] keys, causal over seq_len_q draft tokens,
// fp32 accumulation. Any number of heads; the 64 rows of every wgmma are (query token, head) pairs.
//
// Rows. A request's rows are its s_q * h_q (query token, head) pairs in q's order, cut into R =
// ceil(s_q * h_q / 64) row blocks of 64; row r of block g sees the keys [0, len - s_q + token + 1),
// token = (64 g + r) / h_q, so causal limits are per row. Rows past a request's last (the last block
// may be short) compute as its last valid row and are never written.
//
// Work partition. A plan kernel counts each request's 64-key tiles (one cache block each: one
// block_table entry and 72 KB of contiguous memory, brought in by TMA, nine 64 x 64 boxes with the
// 128-byte swizzle) and their prefix sums. The batch's tiles, in (request, tile) order, are cut into P
// equal shares, whatever the lengths; CTA (g, part) runs row block g of every request in share `part`,
// one segment per request, so the R CTAs of a share read the same keys at about the same time (from L2
// for all but the first). P * R is about one CTA per SM. A segment that holds a whole request writes
// out and lse; only a share's first and last segments can hold part of one, and they write partials to
// the CTA's two workspace slots, which the merge kernel combines.
//
// Per segment: q (64 x 576) in shared memory; two tile buffers, even tiles in one, odd in the other.
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
// softmax_scale * log2(e)); a row that has seen no key yet has maximum -inf and is rescaled by 1.
//
// The last tile of a segment may end inside its cache block: its logits past each row's end are
// masked, and its rows past the segment's end are zeroed in shared memory before any product reads
// them as values (the cache there may hold anything, and 0 * NaN is NaN).
//
// Output. A whole request: out (bf16) and lse (natural log) directly. A part: a normalised fp32
// partial and its base-2 lse (-inf for a row that saw no key in it) in slot 2c (the CTA's first
// segment) or 2c + 1 (its last), c = part * R + g; an empty share writes an lse of -inf to slot 2c.
// The plan kernel lists the requests cut between shares (at most P - 1), and the merge kernel (a
// programmatic dependent of the decode kernel) walks that list, combining each cut request's parts
// with weights exp2(lse_j - max).

#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#include "mla_wgmma_tile.cuh"

#ifndef FLASHMLA_WGMMA_PDL
#define FLASHMLA_WGMMA_PDL 1  // launch the merge kernel with programmatic dependent launch
#endif

namespace flashmla_wgmma {

using namespace mla_tile;

constexpr int kBytesHalfA = (kHalfCols + 1) * kColBlockBytes;  // latent [0, 256) and rope
constexpr int kBytesHalfB = kHalfCols * kColBlockBytes;        // latent [256, 512)
constexpr int kPlanThreads = 1024;
constexpr int kMergeThreads = kDimV / 4;
constexpr int kMergeBlocksPerRow = 32;            // at most; cut requests are dealt to them in turn
constexpr int kMaxGridY = 65535;

// The batch's work, shared by the three kernels.
struct Plan {
  const int* cache_seqlens;      // [batch]
  int* prefix;                   // [batch + 1]: tiles before each request (written by the plan kernel)
  int4* cuts;                    // [P]: (request, first share, last share, its slot in the first share)
  int* num_cuts;                 // [1]: entries of `cuts` written
  int batch;
  int s_q;
  int h_q;
  int blocks_per_request;        // R
  int num_parts;                 // P
};

struct DecodeParams {
  CUtensorMap q_map;             // q as [batch * s_q * h_q, 576], 64 x 64 boxes
  CUtensorMap kv_map;            // k_cache as [num_blocks * 64, 576], 64 x 64 boxes
  Plan plan;
  const int* block_table;        // [batch, max_blocks]
  __nv_bfloat16* out;            // [batch, s_q, h_q, 512]
  float* lse;                    // [batch, h_q, s_q], natural log
  float* part_o;                 // [2 * P * R, 64, 512]: a CTA's first and last segments, when partial
  float* part_lse;               // [2 * P * R, 64], base 2
  int max_blocks;
  float scale_log2;              // softmax_scale * log2(e)
};

struct MergeParams {
  Plan plan;
  const float* part_o;
  const float* part_lse;
  __nv_bfloat16* out;
  float* lse;
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


// ------------------------------------------------------------------------------------------
// The plan: equal shares of the batch's tiles
// ------------------------------------------------------------------------------------------

// The first tile of share `part` when `total` tiles are cut into `parts` equal shares.
__device__ __forceinline__ int share_start(int part, int total, int parts) {
  return static_cast<int>(static_cast<int64_t>(part) * total / parts);
}

// The share that holds tile t < total: the last part whose share starts at or before t (empty shares
// start where the next one does, so this one is not empty).
__device__ __forceinline__ int share_of(int t, int total, int parts) {
  return static_cast<int>((static_cast<int64_t>(t + 1) * parts - 1) / total);
}

// The request that holds tile t: the last b with prefix[b] <= t (every request has a tile, so prefix
// increases strictly).
__device__ __forceinline__ int request_of(const int* prefix, int batch, int t) {
  int lo = 0, hi = batch;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (__ldcg(prefix + mid) <= t) lo = mid; else hi = mid;
  }
  return lo;
}

// A request's tiles: its last query token sees all len keys, len >= s_q >= 1 (a constraint).
__device__ __forceinline__ int tiles_of(const int* cache_seqlens, int b) {
  return max(1, (__ldg(cache_seqlens + b) + kTile - 1) / kTile);
}

// prefix[b] = tiles of the requests before b, prefix[batch] = all tiles, and the list of requests cut
// between shares. One block; each thread takes a contiguous run of requests, and the runs' sums are
// scanned in shared memory.
__global__ void __launch_bounds__(kPlanThreads, 1) flashmla_wgmma_plan_kernel(const Plan p) {
  __shared__ int sums[kPlanThreads];
  __shared__ int cut_count;
  const int tid = threadIdx.x;
  if (tid == 0) cut_count = 0;
  const int per = (p.batch + kPlanThreads - 1) / kPlanThreads;
  const int first = min(p.batch, tid * per);
  const int last = min(p.batch, first + per);
  int own = 0;
  for (int b = first; b < last; ++b) own += tiles_of(p.cache_seqlens, b);
  sums[tid] = own;
  __syncthreads();
  for (int offset = 1; offset < kPlanThreads; offset *= 2) {
    const int add = tid >= offset ? sums[tid - offset] : 0;
    __syncthreads();
    sums[tid] += add;
    __syncthreads();
  }
  const int total = sums[kPlanThreads - 1];
  int run = sums[tid] - own;
  for (int b = first; b < last; ++b) {
    p.prefix[b] = run;
    const int next = run + tiles_of(p.cache_seqlens, b);
    const int first_share = share_of(run, total, p.num_parts);
    const int last_share = share_of(next - 1, total, p.num_parts);
    if (first_share != last_share) {
      // Cut: its part in the first share is that share's last segment, slot 2c + 1 unless it is also
      // the first; in every later share it is the first segment, slot 2c.
      const int slot_bit = share_start(first_share, total, p.num_parts) < run;
      p.cuts[atomicAdd(&cut_count, 1)] = make_int4(b, first_share, last_share, slot_bit);
    }
    run = next;
  }
  __syncthreads();
  if (tid == kPlanThreads - 1) {
    p.prefix[p.batch] = total;
    *p.num_cuts = cut_count;
  }
}

// ------------------------------------------------------------------------------------------
// Decode kernel: grid (R, P); CTA (g, part) runs row block g of the requests in share `part`.
// ------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads, 1) flashmla_wgmma_kernel(const __grid_constant__ DecodeParams p) {
  extern __shared__ unsigned char smem_raw[];
  SharedStorage& sm = *reinterpret_cast<SharedStorage*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));

  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);  // known warp-uniform: no serialised wgmma
  const int lt = tid % 128;
  const int lane = tid & 31;
  const int row_lo = (lt / 32) * 16 + (lane >> 2);  // this thread's rows of the 64: row_lo, row_lo + 8
  const Plan& plan = p.plan;
  const int g = blockIdx.x;
  const int part = blockIdx.y;
  const size_t cta = static_cast<size_t>(part) * plan.blocks_per_request + g;

  // This CTA's share of the batch's tiles, in (request, tile) order: [pos, stop).
  const int total = __ldcg(plan.prefix + plan.batch);
  int pos = share_start(part, total, plan.num_parts);
  const int stop = share_start(part + 1, total, plan.num_parts);
  if (pos >= stop) {
    // Empty (fewer tiles than shares): a cut request's merge may walk over this share's slot.
    if (tid < kRows) p.part_lse[2 * cta * kRows + tid] = -INFINITY;
    return;
  }
  int b = request_of(plan.prefix, plan.batch, pos);

  // The rows of block g, the same in every request: the query token of the last valid row and of this
  // thread's two rows (a padding row as the last valid one).
  const int rows_per_request = plan.s_q * plan.h_q;
  const int row0 = g * kRows;
  const int valid_rows = min(kRows, rows_per_request - row0);
  const int token_last = (row0 + valid_rows - 1) / plan.h_q;
  const int token_lo = (row0 + min(row_lo, valid_rows - 1)) / plan.h_q;
  const int token_hi = (row0 + min(row_lo + 8, valid_rows - 1)) / plan.h_q;

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

  const float scale = p.scale_log2;
  int uses[2] = {0, 0};  // loads of each buffer so far: the parity of the next one to wait for
  int q_loads = 0;
  for (int segment = 0; pos < stop; ++segment, ++b) {
    // One segment: request b's tiles [lo, hi) that fall in this share.
    const int first_tile = __ldcg(plan.prefix + b);
    const int n_b = __ldcg(plan.prefix + b + 1) - first_tile;
    const int lo = pos - first_tile;
    const int hi = min(stop - first_tile, n_b);
    pos = first_tile + hi;
    const bool whole = lo == 0 && hi == n_b;  // else a part, merged with the other shares' parts
    const size_t slot = 2 * cta + (segment > 0);
    const int len = __ldg(plan.cache_seqlens + b);
    const int visible = len - plan.s_q + token_last + 1;  // >= 1 (a constraint)
    const int visible_lo = len - plan.s_q + token_lo + 1;
    const int visible_hi = len - plan.s_q + token_hi + 1;
    const int key_start = lo * kTile;
    const int key_end = min(hi * kTile, visible);
    if (key_end <= key_start) {
      // A part past the keys these rows see (only where draft tokens end before the request's last
      // tile): no output, and an lse of -inf the merge skips. Not whole: a whole request starts at key 0.
      if (tid < kRows) p.part_lse[slot * kRows + tid] = -INFINITY;
      continue;
    }
    const int n_tiles = (key_end - key_start + kTile - 1) / kTile;
    const int* table = p.block_table + static_cast<size_t>(b) * p.max_blocks + lo;

    if (tid == 0) {
      mbar_expect_tx(bar_q, kTileBytes);
#pragma unroll
      for (int cb = 0; cb < kColBlocks; ++cb) {
        tma_load(q_addr + cb * kColBlockBytes, &p.q_map, cb * kBox, b * rows_per_request + row0, bar_q);
      }
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
    const int n_pairs = (n_tiles + 1) / 2;
    mbar_wait(bar_q, q_loads & 1);
    ++q_loads;

    for (int j = 0; j < n_pairs; ++j) {
      const int k_even = 2 * j;
      const int k_odd = k_even + 1;
      const bool has_odd = k_odd < n_tiles;
      const int parity = (uses[0] + j) & 1;  // the even buffer's; the odd one's: odd_parity
      const int odd_parity = (uses[1] + j) & 1;
      if (wg == 0) {
        float s[32];
        logits<false>(s, q_addr, kv_addr[0], bar_kv[0][0], bar_kv[0][1], parity);
        const int key0 = key_start + k_even * kTile;
        const int n_valid = min(kTile, key_end - key0);
        const float2 mx = scale_and_max(s, scale, make_int2(visible_lo - key0, visible_hi - key0), lane);
        const float2 m0 = make_float2(fmaxf(m.x, mx.x), fmaxf(m.y, mx.y));
        const float2 alpha = factor(m, m0);
        uint4 pe[4];
        float2 sum = make_float2(0.f, 0.f);
        probabilities(pe, s, m0, sum);
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
        const float2 beta = factor(m0, m1);
        rescale(o, beta);
        l = make_float2(l.x * beta.x, l.y * beta.y);
        if (has_odd) {
          uint4 po[4];
#pragma unroll
          for (int t = 0; t < 4; ++t) po[t] = sm.p[t][lt];
          mbar_wait(bar_kv[1][0], odd_parity);
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
          logits<false>(s, q_addr, kv_addr[1], bar_kv[1][0], bar_kv[1][1], odd_parity);
          const int key0 = key_start + k_odd * kTile;
          const int n_valid = min(kTile, key_end - key0);
          mx = scale_and_max(s, scale, make_int2(visible_lo - key0, visible_hi - key0), lane);
          if (n_valid < kTile) zero_tail(sm.kv[1], n_valid, lt);
        }
        named_sync(kBarEvenReady, kThreads);  // m0 and p_e are in shared memory (and the zeros of both groups)
        const float2 m0 = make_float2(sm.m_even[row_lo], sm.m_even[row_lo + 8]);
        const float2 m1 = make_float2(fmaxf(m0.x, mx.x), fmaxf(m0.y, mx.y));
        const float2 alpha = factor(m, m1);
        const float2 beta = factor(m0, m1);
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
      for (int h = 0; h < 2; ++h) {
        const int row = row_lo + 8 * h;
        const float lse2 = (h ? m.y : m.x) + fast_log2(h ? l.y : l.x);  // -inf for a row that saw no key
        if (!whole) {
          p.part_lse[slot * kRows + row] = lse2;
        } else if (row < valid_rows) {
          const int token = (row0 + row) / plan.h_q;
          const int head = row0 + row - token * plan.h_q;
          p.lse[(static_cast<size_t>(b) * plan.h_q + head) * plan.s_q + token] = lse2 * kLn2;
        }
      }
    }
    // A row that saw no key in this part has l = 0 and o = 0: its partial is 0, and its lse -inf.
    const float2 inv = make_float2(l.x > 0.f ? 1.f / l.x : 0.f, l.y > 0.f ? 1.f / l.y : 0.f);
    const int col0 = wg * (kDimV / 2) + 2 * (lane & 3);
    if (!whole) {
      float* dst = p.part_o + slot * kRows * kDimV;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int col = col0 + 8 * j;
        if (row_lo < valid_rows) {  // padding rows' partials are never read
          *reinterpret_cast<float2*>(dst + row_lo * kDimV + col) = make_float2(o[4 * j] * inv.x, o[4 * j + 1] * inv.x);
        }
        if (row_lo + 8 < valid_rows) {
          *reinterpret_cast<float2*>(dst + (row_lo + 8) * kDimV + col) =
              make_float2(o[4 * j + 2] * inv.y, o[4 * j + 3] * inv.y);
        }
      }
    } else {
      // The block's valid rows are contiguous in out [batch, s_q, h_q, 512], as in q.
      __nv_bfloat16* dst = p.out + (static_cast<size_t>(b) * rows_per_request + row0) * kDimV;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int col = col0 + 8 * j;
        if (row_lo < valid_rows) {
          *reinterpret_cast<__nv_bfloat162*>(dst + row_lo * kDimV + col) =
              __floats2bfloat162_rn(o[4 * j] * inv.x, o[4 * j + 1] * inv.x);
        }
        if (row_lo + 8 < valid_rows) {
          *reinterpret_cast<__nv_bfloat162*>(dst + (row_lo + 8) * kDimV + col) =
              __floats2bfloat162_rn(o[4 * j + 2] * inv.y, o[4 * j + 3] * inv.y);
        }
      }
    }

    uses[0] += n_pairs;
    uses[1] += n_tiles / 2;
    __syncthreads();  // row sums read, every product done: the buffers and q are free for the next segment
  }
}

// ------------------------------------------------------------------------------------------
// Merge kernel: grid (R * 64, Y), one float4 of the 512 outputs per thread. Block (row, y) merges
// row `row` of the cut requests y, y + Y, ... of the plan's list: the partials of each share from its
// first to its last (an empty share's slot holds an lse of -inf, as does a part past the row's keys),
// the max of their lses first, so each is weighted once.
// ------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kMergeThreads) flashmla_wgmma_merge_kernel(const MergeParams p) {
  const int tid = threadIdx.x;
  const Plan& plan = p.plan;
  const int g = blockIdx.x / kRows;
  const int r = blockIdx.x - g * kRows;
  const int row = g * kRows + r;  // within a request
  const int rows_per_request = plan.s_q * plan.h_q;
  if (row >= rows_per_request) return;  // a padding row of the last block

  grid_dependency_wait();  // before the plan or any partial is read

  const int n = __ldcg(plan.num_cuts);
  for (int i = blockIdx.y; i < n; i += gridDim.y) {
    const int4 cut = __ldcg(plan.cuts + i);
    const int b = cut.x;
    // Share c's slot for this row block: 2 (c R + g), + 1 in the first share where the request is not
    // its first segment.
    const size_t first_slot = 2 * (static_cast<size_t>(cut.y) * plan.blocks_per_request + g) + cut.w;
    const size_t stride = 2 * static_cast<size_t>(plan.blocks_per_request);
    const size_t base = 2 * (static_cast<size_t>(cut.y) * plan.blocks_per_request + g);
    const int n_parts = cut.z - cut.y + 1;

    // Two passes of independent loads: the lses' max, then the weighted sum (an lse of -inf weighs 0;
    // its partial may be stale and is never multiplied in).
    float mx = __ldcg(p.part_lse + first_slot * kRows + r);
    for (int j = 1; j < n_parts; ++j) mx = fmaxf(mx, __ldcg(p.part_lse + (base + j * stride) * kRows + r));
    float weights = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int j = 0; j < n_parts; ++j) {
      const size_t slot = j == 0 ? first_slot : base + j * stride;
      const float lse2 = __ldcg(p.part_lse + slot * kRows + r);
      const float4 v = __ldcg(reinterpret_cast<const float4*>(p.part_o + (slot * kRows + r) * kDimV + tid * 4));
      const bool seen = lse2 != -INFINITY;
      const float w = seen ? fast_exp2(lse2 - mx) : 0.f;
      weights += w;
      acc.x += seen ? w * v.x : 0.f;
      acc.y += seen ? w * v.y : 0.f;
      acc.z += seen ? w * v.z : 0.f;
      acc.w += seen ? w * v.w : 0.f;
    }
    const float inv = 1.f / weights;
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(
        p.out + (static_cast<size_t>(b) * rows_per_request + row) * kDimV + tid * 4);
    o[0] = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
    o[1] = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
    if (tid == 0) {
      const int token = row / plan.h_q;
      const int head = row - token * plan.h_q;
      p.lse[(static_cast<size_t>(b) * plan.h_q + head) * plan.s_q + token] = (mx + fast_log2(weights)) * kLn2;
    }
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

// Shares: about one CTA per SM with R CTAs each (at least one, at most kMaxGridY); of the counts within
// 10% below that, the largest that divides the batch, so that equal lengths cut no request.
int choose_parts(int blocks_per_request, int batch, int num_sms) {
  const int target = num_sms > 0 ? num_sms : 132;
  int most = target / blocks_per_request;
  most = most < 1 ? 1 : (most > kMaxGridY ? kMaxGridY : most);
  for (int parts = most; parts * 10 >= most * 9; --parts) {
    if (batch % parts == 0) return parts;
  }
  return most;
}

// Runs the decode on `stream`: the plan (one block), the decode (grid (R, P)) and, with P > 1, the merge
// of the requests cut between shares. All pointers are device pointers to contiguous tensors: q [batch,
// s_q, h_q, 576] bf16, k_cache [num_blocks, 64, 1, 576] bf16, block_table [batch, max_blocks] int32,
// cache_seqlens [batch] int32, out [batch, s_q, h_q, 512] bf16, lse [batch, h_q, s_q] fp32; workspace:
// prefix [batch + 1], cuts [P] int4 (16-byte aligned) and num_cuts [1] int32, part_o [2 * P * R * 64 *
// 512] and part_lse [2 * P * R * 64] fp32. q and
// k_cache are 16-byte aligned; every request has len >= s_q.
cudaError_t launch(const void* q, const void* k_cache, int64_t num_blocks, const int* block_table,
                   const int* cache_seqlens, int batch, int s_q, int h_q, int max_blocks, float softmax_scale,
                   void* out, float* lse, int* prefix, int4* cuts, int* num_cuts, float* part_o,
                   float* part_lse, int num_parts, cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
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

  Plan plan;
  plan.cache_seqlens = cache_seqlens;
  plan.prefix = prefix;
  plan.cuts = cuts;
  plan.num_cuts = num_cuts;
  plan.batch = batch;
  plan.s_q = s_q;
  plan.h_q = h_q;
  plan.blocks_per_request = (s_q * h_q + kRows - 1) / kRows;
  plan.num_parts = num_parts;
  flashmla_wgmma_plan_kernel<<<1, kPlanThreads, 0, stream>>>(plan);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;

  DecodeParams dp;
  err = make_map(&dp.q_map, q, static_cast<uint64_t>(batch) * s_q * h_q);
  if (err != cudaSuccess) return err;
  err = make_map(&dp.kv_map, k_cache, static_cast<uint64_t>(num_blocks) * kTile);
  if (err != cudaSuccess) return err;
  dp.plan = plan;
  dp.block_table = block_table;
  dp.out = static_cast<__nv_bfloat16*>(out);
  dp.lse = lse;
  dp.part_o = part_o;
  dp.part_lse = part_lse;
  dp.max_blocks = max_blocks;
  dp.scale_log2 = softmax_scale * kLog2e;
  flashmla_wgmma_kernel<<<dim3(plan.blocks_per_request, num_parts), kThreads, smem, stream>>>(dp);
  err = cudaGetLastError();
  if (err != cudaSuccess || num_parts == 1) return err;

  MergeParams mp;
  mp.plan = plan;
  mp.part_o = part_o;
  mp.part_lse = part_lse;
  mp.out = static_cast<__nv_bfloat16*>(out);
  mp.lse = lse;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(plan.blocks_per_request * kRows, num_parts - 1 < kMergeBlocksPerRow ? num_parts - 1
                                                                                      : kMergeBlocksPerRow, 1);
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
