// Causal MLA paged prefill for Hopper with wgmma: 16 heads, keys [512 latent | 64 rope] gathered from a
// page-size-1 cache (ckv_cache, kpe_cache) through kv_indices, values the latent part, fp32 accumulation,
// base-2 lse. The tile loop is flashmla_decode_cuda_wgmma_balanced's pair schedule, with the keys brought
// in by cp.async (a page per key: TMA boxes cannot gather) instead of TMA.
//
// Rows. A request's rows are its (query token, head) pairs in q's order, cut into blocks of 64 (4 tokens
// x 16 heads, the M of every wgmma); row r of block g is token 4g + r / 16, head r % 16, and sees keys
// [0, kv_len - q_len + token + 1). A thread's two accumulator rows (row_lo, row_lo + 8) lie in one
// warp's 16 rows, so they share one token and one causal limit. Rows past the request's last token
// (a short last block) read q = 0 and are never written.
//
// Grid. No plan kernel: request b owns the block slots [S_b / 4, S_{b+1} / 4) with S_b = qo_indptr[b]
// + 3 b, which are at least ceil(q_len_b / 4) (one spare at most per request; a spare exits at once).
// The host knows the slot count from total_q and the batch size alone; a CTA finds its request with a
// 32-way warp search over qo_indptr. Slots run in reverse (blockIdx 0 takes the last slot), so the last
// row blocks of a request, which see the most keys, start first.
//
// Per CTA: q (64 x 576) and two tile buffers (64 keys x 576) in shared memory, each as nine 64-column
// blocks of 64 rows x 128 bytes with the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)),
// where TMA SWIZZLE_128B would put it, so the wgmma descriptors are the decode's. Even tiles in buffer
// 0, odd in buffer 1. Two warpgroups each own half of the 64 x 512 output (columns [0, 256), [256, 512))
// and take turns at the logits (see the decode's notes): WG0 does the even tile's q k^T and softmax
// while WG1 does the odd one's, the probabilities cross in shared memory as bf16 in register order.
//
// Loads. Half A of a buffer (latent [0, 256) and rope) is refilled by WG0's 128 threads, half B (latent
// [256, 512)) by WG1's: each is the last reader of its half. Eight threads take one 128-byte row
// segment of a column block; a thread copies rows r0, r0 + 16, r0 + 32, r0 + 48 (r0 = lt / 8). Keys at or
// past the block's last visible key are zero-filled (src-size 0): their logits are masked, and as
// values they meet p = 0 (stale shared memory could hold NaN). Each thread signals its copies with
// cp.async.mbarrier.arrive.noinc on the half's mbarrier (count 128); readers wait on it and then fence
// the generic-proxy writes for the tensor cores' async-proxy reads. Page ids are read one refill
// ahead, one per lane, and shuffled to the lanes that copy those keys, so no refill waits on a load.

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#include "mla_wgmma_tile.cuh"

namespace mla_prefill_wgmma {

using namespace mla_tile;

constexpr int kHeads = 16;
constexpr int kTokensPerBlock = kRows / kHeads;    // 4

struct Params {
  const __nv_bfloat16* q_nope;   // [total_q * 16, 512]
  const __nv_bfloat16* q_pe;     // [total_q * 16, 64]
  const __nv_bfloat16* ckv;      // [num_pages, 512]
  const __nv_bfloat16* kpe;      // [num_pages, 64]
  const int* qo_indptr;          // [batch + 1]
  const int* kv_indptr;          // [batch + 1]
  const int* kv_indices;         // [kv_indptr[batch]]
  __nv_bfloat16* out;            // [total_q * 16, 512]
  float* lse;                    // [total_q * 16], base 2
  int batch;
  int num_slots;                 // (total_q + 3 * batch) / 4
  float scale_log2;              // sm_scale * log2(e)
};

// ------------------------------------------------------------------------------------------
// Tile pieces
// ------------------------------------------------------------------------------------------

// Copies this thread's share of one buffer half of a tile: rows r0 + 16 i (i < 4), 16-byte chunk c of
// every column block of the half (HALF 0: latent blocks 0-3 and the rope block; HALF 1: latent blocks
// 4-7), then arrives on the half's barrier. `page` is this lane's page id of the tile (row
// load_row(lane)); a negative id zero-fills the key. Called by all 128 threads of one warpgroup.
template <int HALF>
__device__ __forceinline__ void refill(const Params& p, uint32_t tile, uint32_t bar, int page, int lt) {
  const int lane = lt & 31;
  const int c = lt & 7;
  const int r0 = lt >> 3;
  const uint32_t dst = tile + r0 * 128 + ((c ^ (r0 & 7)) << 4);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // Row r0 + 16 i is held by lane (r0 % 4) + 4 i of this warp (load_row).
    const int pg = __shfl_sync(0xffffffffu, page, (lane >> 3) + 4 * i);
    const int bytes = pg >= 0 ? 16 : 0;
    const size_t row = static_cast<size_t>(pg >= 0 ? pg : 0);
    const __nv_bfloat16* src = p.ckv + row * kDimV + HALF * (kDimV / 2) + c * 8;
#pragma unroll
    for (int cb = 0; cb < kHalfCols; ++cb) {
      cp_async_16(dst + (HALF * kHalfCols + cb) * kColBlockBytes + i * 16 * 128, src + cb * kBox, bytes);
    }
    if (HALF == 0) {
      cp_async_16(dst + kRopeBlock * kColBlockBytes + i * 16 * 128, p.kpe + row * kDimPe + c * 8, bytes);
    }
  }
  cp_async_arrive(bar);
}

// The key row of a tile whose page id lane `lane` of warp `warp` (of its warpgroup) holds: the rows
// its warp copies are 4 warp + {0..3} + 16 {0..3}; lanes 16-31 repeat lanes 0-15.
__device__ __forceinline__ int load_row(int warp, int lane) { return 4 * warp + (lane & 3) + 16 * ((lane >> 2) & 3); }

// The page id of key `key` of the request, or -1 at or past key_end.
__device__ __forceinline__ int page_of(const int* indices, int key, int key_end) {
  return key < key_end ? __ldg(indices + key) : -1;
}

// The request whose slot range holds `slot`: the last b < batch with (qo_indptr[b] + 3 b) / 4 <= slot,
// by a 32-way search of the warp (slot starts never decrease). Every lane returns it.
__device__ __forceinline__ int request_of(const int* qo_indptr, int batch, int slot, int lane) {
  int lo = 0, hi = batch;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const int step = (hi - lo + 31) / 32;
    const int idx = lo + lane * step;
    bool ok = false;
    if (idx < hi) ok = (static_cast<int64_t>(__ldg(qo_indptr + idx)) + 3ll * idx) / 4 <= slot;
    const unsigned mask = __ballot_sync(0xffffffffu, ok);  // lane 0 (idx = lo) always holds
    lo += (31 - __clz(mask)) * step;
    hi = min(hi, lo + step);
  }
  return lo;
}

// ------------------------------------------------------------------------------------------
// Kernel: one CTA per row block (4 query tokens x 16 heads of one request).
// ------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads, 1) mla_prefill_wgmma_kernel(const __grid_constant__ Params p) {
  extern __shared__ unsigned char smem_raw[];
  SharedStorage& sm = *reinterpret_cast<SharedStorage*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));

  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);  // known warp-uniform: no serialised wgmma
  const int lt = tid % 128;
  const int lane = tid & 31;
  const int warp = lt >> 5;                          // warp within the warpgroup
  const int row_lo = warp * 16 + (lane >> 2);        // this thread's rows of the 64: row_lo, row_lo + 8

  // Longest first: blockIdx 0 takes the last slot.
  const int slot = p.num_slots - 1 - static_cast<int>(blockIdx.x);
  const int b = request_of(p.qo_indptr, p.batch, slot, lane);
  const int q_start = __ldg(p.qo_indptr + b);
  const int q_len = __ldg(p.qo_indptr + b + 1) - q_start;
  const int g = slot - static_cast<int>((static_cast<int64_t>(q_start) + 3ll * b) / 4);
  const int t0 = g * kTokensPerBlock;  // first token of the block, within the request
  if (t0 >= q_len) return;             // a spare slot
  const int kv_start = __ldg(p.kv_indptr + b);
  const int kv_len = __ldg(p.kv_indptr + b + 1) - kv_start;
  const int valid_tokens = min(kTokensPerBlock, q_len - t0);
  const int valid_rows = valid_tokens * kHeads;
  const size_t row0 = (static_cast<size_t>(q_start) + t0) * kHeads;  // global (token, head) row of row 0
  const int diag = kv_len - q_len;       // token t sees keys [0, diag + t + 1)
  const int key_end = max(0, min(kv_len, diag + t0 + valid_tokens));  // keys the block needs: [0, key_end)
  const int n_tiles = (key_end + kTile - 1) / kTile;
  const int limit = diag + t0 + warp + 1;  // this thread's rows' keys: [0, limit)

  if (n_tiles == 0) {
    // No row sees a key: output 0, lse -inf.
    uint4* dst = reinterpret_cast<uint4*>(p.out + row0 * kDimV);
    for (int k = tid; k < valid_rows * (kDimV / 8); k += kThreads) dst[k] = make_uint4(0, 0, 0, 0);
    if (tid < valid_rows) p.lse[row0 + tid] = -INFINITY;
    return;
  }

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
  __syncthreads();

  // q: rows r0, r0 + 32 (r0 = tid / 8), chunk c of all nine column blocks; rows past the block's valid
  // rows read as 0.
  {
    const int c = tid & 7;
    const int r0 = tid >> 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + 32 * h;
      const int bytes = r < valid_rows ? 16 : 0;
      const size_t row = row0 + (r < valid_rows ? r : 0);
      const uint32_t dst = q_addr + r * 128 + ((c ^ (r & 7)) << 4);
      const __nv_bfloat16* src = p.q_nope + row * kDimV + c * 8;
#pragma unroll
      for (int cb = 0; cb < kRopeBlock; ++cb) cp_async_16(dst + cb * kColBlockBytes, src + cb * kBox, bytes);
      cp_async_16(dst + kRopeBlock * kColBlockBytes, p.q_pe + row * kDimPe + c * 8, bytes);
    }
    cp_async_arrive(bar_q);
  }

  // The first two tiles, each warpgroup its half; then this lane's page of tile 2.
  const int* indices = p.kv_indices + kv_start;
  const int my_row = load_row(warp, lane);
  {
    const int page0 = page_of(indices, my_row, key_end);
    const int page1 = page_of(indices, kTile + my_row, key_end);
    if (wg == 0) {
      refill<0>(p, kv_addr[0], bar_kv[0][0], page0, lt);
      if (n_tiles > 1) refill<0>(p, kv_addr[1], bar_kv[1][0], page1, lt);
    } else {
      refill<1>(p, kv_addr[0], bar_kv[0][1], page0, lt);
      if (n_tiles > 1) refill<1>(p, kv_addr[1], bar_kv[1][1], page1, lt);
    }
  }
  int next_page = page_of(indices, 2 * kTile + my_row, key_end);  // the next tile this group refills

  const float scale = p.scale_log2;
  float o[128];
#pragma unroll
  for (int k = 0; k < 128; ++k) o[k] = 0.f;
  float2 m = make_float2(-INFINITY, -INFINITY);  // running maxima of rows row_lo, row_lo + 8
  float2 l = make_float2(0.f, 0.f);              // this thread's part of the running sums of its group's tiles
  const int n_pairs = (n_tiles + 1) / 2;
  wait_landed(bar_q, 0);

  for (int j = 0; j < n_pairs; ++j) {
    const int k_even = 2 * j;
    const int k_odd = k_even + 1;
    const bool has_odd = k_odd < n_tiles;
    const int parity = j & 1;  // load j of each buffer
    if (wg == 0) {
      float s[32];
      logits<true>(s, q_addr, kv_addr[0], bar_kv[0][0], bar_kv[0][1], parity);
      const float2 mx = scale_and_max(s, scale, make_int2(limit - k_even * kTile, limit - k_even * kTile), lane);
      const float2 m0 = make_float2(fmaxf(m.x, mx.x), fmaxf(m.y, mx.y));
      const float2 alpha = factor(m, m0);
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
      named_sync(kBarGroup0, 128);  // the whole group is done with half A of the even buffer
      if (k_even + 2 < n_tiles) {
        refill<0>(p, kv_addr[0], bar_kv[0][0], next_page, lt);
        next_page = page_of(indices, (k_even + 3) * kTile + my_row, key_end);
      }
      const float2 m1 = make_float2(sm.m_odd[row_lo], sm.m_odd[row_lo + 8]);
      const float2 beta = factor(m0, m1);
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
        named_sync(kBarGroup0, 128);  // the whole group is done with half A of the odd buffer
        if (k_odd + 2 < n_tiles) {
          refill<0>(p, kv_addr[1], bar_kv[1][0], next_page, lt);
          next_page = page_of(indices, (k_odd + 3) * kTile + my_row, key_end);
        }
      }
      m = m1;
    } else {
      float s[32];
      float2 mx = make_float2(-INFINITY, -INFINITY);
      if (has_odd) {
        logits<true>(s, q_addr, kv_addr[1], bar_kv[1][0], bar_kv[1][1], parity);
        mx = scale_and_max(s, scale, make_int2(limit - k_odd * kTile, limit - k_odd * kTile), lane);
      }
      named_sync(kBarEvenReady, kThreads);  // m0 and p_e are in shared memory
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
        pe[t] = make_uint4(pack_bf16(a.x * beta.x, a.y * beta.x), pack_bf16(c.x * beta.y, c.y * beta.y),
                           pack_bf16(d.x * beta.x, d.y * beta.x), pack_bf16(e.x * beta.y, e.y * beta.y));
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
      // The even buffer's half B is refilled as soon as its product is done, while the odd one's runs:
      // WG0's next logits wait for it.
      wgmma_wait<1>();
      named_sync(kBarGroup1, 128);
      if (k_even + 2 < n_tiles) {
        refill<1>(p, kv_addr[0], bar_kv[0][1], next_page, lt);
        next_page = page_of(indices, (k_even + 3) * kTile + my_row, key_end);
      }
      wgmma_wait<0>();
      fence_registers(o);
      named_sync(kBarGroup1, 128);  // the whole group is done with half B of the odd buffer
      if (k_odd + 2 < n_tiles) {
        refill<1>(p, kv_addr[1], bar_kv[1][1], next_page, lt);
        next_page = page_of(indices, (k_odd + 3) * kTile + my_row, key_end);
      }
      m = m1;
    }
  }

  // Row sums: each group holds its threads' parts of the sums over its own tiles (in fp32), both in the
  // frame of the final maxima; the quad that shares a row adds them up, then the two groups swap theirs.
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
    // Base 2, as the definition's lse; -inf for a row that saw no key (m = -inf, l = 0).
    if (row_lo < valid_rows) p.lse[row0 + row_lo] = m.x + fast_log2(l.x);
    if (row_lo + 8 < valid_rows) p.lse[row0 + row_lo + 8] = m.y + fast_log2(l.y);
  }
  // A row that saw no key has l = 0 and o = 0: output 0.
  const float2 inv = make_float2(l.x > 0.f ? 1.f / l.x : 0.f, l.y > 0.f ? 1.f / l.y : 0.f);
  const int col0 = wg * (kDimV / 2) + 2 * (lane & 3);
  __nv_bfloat16* dst = p.out + row0 * kDimV;
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

// ------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------

// Block slots for a batch of `batch` requests and `total_q` query tokens: (total_q + 3 batch) / 4.
int64_t num_slots(int64_t total_q, int64_t batch) { return (total_q + 3 * batch) / 4; }

// Runs the prefill on `stream`. Device pointers to contiguous tensors: q_nope [total_q, 16, 512], q_pe
// [total_q, 16, 64], ckv [num_pages, 1, 512], kpe [num_pages, 1, 64] (bf16, 16-byte aligned), qo_indptr
// and kv_indptr [batch + 1], kv_indices (int32), out [total_q, 16, 512] bf16 (16-byte aligned), lse
// [total_q, 16] fp32. Every row of out and lse is written.
cudaError_t launch(const void* q_nope, const void* q_pe, const void* ckv, const void* kpe, const int* qo_indptr,
                   const int* kv_indptr, const int* kv_indices, int batch, int64_t total_q, float sm_scale, void* out,
                   float* lse, cudaStream_t stream) {
  if (batch <= 0 || total_q <= 0) return cudaSuccess;
  const int64_t slots = num_slots(total_q, batch);
  if (slots > 0x7fffffff) return cudaErrorInvalidValue;
  const size_t smem = sizeof(SharedStorage) + 1024;  // + room to align the storage to 1024 bytes

  static bool configured[64] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= 64 || !configured[device]) {
    err = cudaFuncSetAttribute(mla_prefill_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    if (device >= 0 && device < 64) configured[device] = true;
  }

  Params prm;
  prm.q_nope = static_cast<const __nv_bfloat16*>(q_nope);
  prm.q_pe = static_cast<const __nv_bfloat16*>(q_pe);
  prm.ckv = static_cast<const __nv_bfloat16*>(ckv);
  prm.kpe = static_cast<const __nv_bfloat16*>(kpe);
  prm.qo_indptr = qo_indptr;
  prm.kv_indptr = kv_indptr;
  prm.kv_indices = kv_indices;
  prm.out = static_cast<__nv_bfloat16*>(out);
  prm.lse = lse;
  prm.batch = batch;
  prm.num_slots = static_cast<int>(slots);
  prm.scale_log2 = sm_scale * kLog2e;
  mla_prefill_wgmma_kernel<<<static_cast<unsigned>(slots), kThreads, smem, stream>>>(prm);
  return cudaGetLastError();
}

}  // namespace mla_prefill_wgmma
