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
// segment) or 2c + 1 (its last), c = part * R + g; the merge kernel (a programmatic dependent of the
// decode kernel) combines the parts of each request cut between shares with weights exp2(lse_j - max).

#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#ifndef FLASHMLA_WGMMA_PDL
#define FLASHMLA_WGMMA_PDL 1  // launch the merge kernel with programmatic dependent launch
#endif

namespace flashmla_wgmma {

constexpr int kRows = 64;                         // rows per CTA: the M of every wgmma
constexpr int kDimK = 576;
constexpr int kDimV = 512;
constexpr int kTile = 64;                         // keys per tile = tokens per cache block
constexpr int kBox = 64;                          // columns per TMA box / swizzle atom width (128 bytes)
constexpr int kColBlocks = kDimK / kBox;          // 9
constexpr int kColBlockBytes = kTile * kBox * 2;  // 8192: 64 rows of 128 bytes
constexpr int kTileBytes = kColBlocks * kColBlockBytes;  // 73728
constexpr int kHalfCols = kDimV / 2 / kBox;       // 4 column blocks of output per warpgroup
constexpr int kBytesHalfA = (kHalfCols + 1) * kColBlockBytes;  // latent [0, 256) and rope
constexpr int kBytesHalfB = kHalfCols * kColBlockBytes;        // latent [256, 512)
constexpr int kThreads = 256;                     // two warpgroups
constexpr int kPlanThreads = 1024;
constexpr int kMergeThreads = kDimV / 4;
constexpr int kMaxGridY = 65535;

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
  alignas(8) uint64_t bar_q;
  uint64_t bar_kv[2][2];                         // [buffer][half]: the half has landed
};

constexpr int kMaxDynamicSmem = 232448;  // per block on sm_90
static_assert(sizeof(SharedStorage) + 1024 <= kMaxDynamicSmem, "shared storage (+ alignment room) must fit");

// The batch's work, shared by the three kernels.
struct Plan {
  const int* cache_seqlens;      // [batch]
  int* prefix;                   // [batch + 1]: tiles before each request (written by the plan kernel)
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
// Primitives
// ------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  }
}

// One 64 x 64 box of a 2D tensor map (column x, row y) into shared memory, counted on `bar`.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, int x, int y, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      :: "r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar) : "memory");
}

__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

// Makes this thread's ordinary shared-memory writes visible to the tensor cores' reads (async proxy).
__device__ __forceinline__ void fence_to_async_proxy() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Shared-memory matrix descriptor with 128-byte swizzle: start address, leading byte offset (between
// 64-column blocks of an MN-major operand; unused for K-major) and stride byte offset (between groups
// of eight 128-byte rows), all in units of 16 bytes.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lead_bytes, uint32_t stride_bytes) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lead_bytes >> 4) << 16) |
         (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (1ull << 62);
}

// __syncwarp first: the fence is .aligned, and it follows a spin on an mbarrier or a one-thread branch.
__device__ __forceinline__ void wgmma_fence() {
  __syncwarp();
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }

// Keeps the compiler from moving reads or writes of accumulator registers across a wgmma's issue or wait.
template <int N>
__device__ __forceinline__ void fence_registers(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

// d (64 x 64, fp32) = A * B^T, or += with accumulate != 0; A: 64 x 16 and B: 64 x 16, both K-major in
// shared memory (128-byte swizzle).
__device__ __forceinline__ void wgmma_64x64_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// d (64 x 256, fp32) += A * B; A: 64 x 16 in registers (the accumulator layout of a 64 x 16 slice, as
// bf16 pairs), B: 16 x 256 MN-major in shared memory (128-byte swizzle).
__device__ __forceinline__ void wgmma_64x256_rs(float (&d)[128], const uint4& a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,"
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "l"(desc_b), "n"(1));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ float2 unpack_bf16(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

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

// s = q k^T over the 576 columns, for the warpgroup's 64 rows and the tile's 64 keys. Half 0 of the
// tile (columns [0, 256) and the rope) is multiplied while half 1 may still be landing.
__device__ __forceinline__ void logits(float (&s)[32], uint32_t q, uint32_t tile, uint32_t bar_a, uint32_t bar_b,
                                       int parity) {
  mbar_wait(bar_a, parity);
  wgmma_fence();
#pragma unroll
  for (int n = 0; n <= kHalfCols; ++n) {
    const int cb = n < kHalfCols ? n : 2 * kHalfCols;
#pragma unroll
    for (int kk = 0; kk < kBox / 16; ++kk) {
      const uint32_t off = cb * kColBlockBytes + kk * 32;
      wgmma_64x64_ss(s, smem_desc(q + off, 16, 1024), smem_desc(tile + off, 16, 1024), n + kk);
    }
  }
  mbar_wait(bar_b, parity);
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

// A row may see no key yet (packed rows of several query tokens: a split can end before a row's first key):
// its maximum is -inf, and exp2(-inf - -inf) would be NaN. Such a row's exponents are taken against 0 (every
// p is 0), and its rescale factor is 1 (its output and sum are still 0).
__device__ __forceinline__ float safe_max(float m) { return m == -INFINITY ? 0.f : m; }
__device__ __forceinline__ float2 factor(float2 m_old, float2 m_new) {
  return make_float2(fast_exp2(m_old.x - safe_max(m_new.x)), fast_exp2(m_old.y - safe_max(m_new.y)));
}

// p = exp2(s - m) as the four register A operands of the p.v products (k-steps of 16 keys); adds the
// row sums of the fp32 values to sum.
__device__ __forceinline__ void probabilities(uint4 (&p)[4], const float (&s)[32], float2 m, float2& sum) {
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = fast_exp2(s[8 * t + e] - safe_max((e & 2) ? m.y : m.x));
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

// prefix[b] = tiles of the requests before b, prefix[batch] = all tiles. One block; each thread takes a
// contiguous run of requests, and the runs' sums are scanned in shared memory.
__global__ void __launch_bounds__(kPlanThreads) flashmla_wgmma_plan_kernel(const Plan p) {
  __shared__ int sums[kPlanThreads];
  const int tid = threadIdx.x;
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
  int run = sums[tid] - own;
  for (int b = first; b < last; ++b) {
    p.prefix[b] = run;
    run += tiles_of(p.cache_seqlens, b);
  }
  if (tid == kPlanThreads - 1) p.prefix[p.batch] = sums[tid];
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
  if (pos >= stop) return;
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
        logits(s, q_addr, kv_addr[0], bar_kv[0][0], bar_kv[0][1], parity);
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
          logits(s, q_addr, kv_addr[1], bar_kv[1][0], bar_kv[1][1], odd_parity);
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
// Merge kernel: grid (R * 64, P), one block per (row, share), one float4 of the 512 outputs per thread.
// A request cut between shares is merged by the share it starts in (where it is the last request): the
// partials of that share's last segment (its first, if the request starts the share) and of the first
// segment of each later share that holds a part of it; the max of their lses first, so each is weighted
// once.
// ------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kMergeThreads) flashmla_wgmma_merge_kernel(const MergeParams p) {
  const int tid = threadIdx.x;
  const Plan& plan = p.plan;
  const int g = blockIdx.x / kRows;
  const int r = blockIdx.x - g * kRows;
  const int row = g * kRows + r;  // within a request
  const int part = blockIdx.y;
  if (row >= plan.s_q * plan.h_q) return;  // a padding row of the last block

  grid_dependency_wait();  // before the plan or any partial is read

  const int total = __ldcg(plan.prefix + plan.batch);
  const int parts = plan.num_parts;
  const int start = share_start(part, total, parts);
  const int stop = share_start(part + 1, total, parts);
  if (start >= stop) return;
  const int b = request_of(plan.prefix, plan.batch, stop - 1);  // this share's last request
  const int b_first = __ldcg(plan.prefix + b);
  const int b_last = __ldcg(plan.prefix + b + 1) - 1;
  if (b_last < stop || share_of(b_first, total, parts) != part) return;  // not cut, or merged by an earlier share
  const int last_part = share_of(b_last, total, parts);

  float mx = -INFINITY;
  for (int c = part; c <= last_part; ++c) {
    if (share_start(c + 1, total, parts) == share_start(c, total, parts)) continue;  // empty: wrote nothing
    const size_t slot = 2 * (static_cast<size_t>(c) * plan.blocks_per_request + g) + (c == part && start < b_first);
    mx = fmaxf(mx, __ldcg(p.part_lse + slot * kRows + r));
  }
  float weights = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int c = part; c <= last_part; ++c) {
    if (share_start(c + 1, total, parts) == share_start(c, total, parts)) continue;
    const size_t slot = 2 * (static_cast<size_t>(c) * plan.blocks_per_request + g) + (c == part && start < b_first);
    const float lse2 = __ldcg(p.part_lse + slot * kRows + r);
    if (lse2 == -INFINITY) continue;  // a part before the row's first key, or past its last: no output
    const float4 v = __ldcg(reinterpret_cast<const float4*>(p.part_o + (slot * kRows + r) * kDimV + tid * 4));
    const float w = fast_exp2(lse2 - mx);
    weights += w;
    acc = make_float4(acc.x + w * v.x, acc.y + w * v.y, acc.z + w * v.z, acc.w + w * v.w);
  }
  const float inv = 1.f / weights;
  const int rows_per_request = plan.s_q * plan.h_q;
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

// ------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled, through the runtime (no link against libcuda).
static cudaError_t encode_function(EncodeTiled* fn) {
  static EncodeTiled cached = nullptr;
  if (cached == nullptr) {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult result;
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &result);
    if (err != cudaSuccess) return err;
    if (result != cudaDriverEntryPointSuccess || ptr == nullptr) return cudaErrorNotSupported;
    cached = reinterpret_cast<EncodeTiled>(ptr);
  }
  *fn = cached;
  return cudaSuccess;
}

// A [rows, 576] bf16 row-major tensor as 64 x 64 boxes with the 128-byte swizzle the wgmma
// descriptors expect.
static cudaError_t make_map(CUtensorMap* map, const void* base, uint64_t rows) {
  EncodeTiled encode = nullptr;
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

// Shares: as many as give about one CTA per SM with R CTAs each, at least one, at most kMaxGridY.
int choose_parts(int blocks_per_request, int num_sms) {
  const int target = num_sms > 0 ? num_sms : 132;
  const int parts = target / blocks_per_request;
  return parts < 1 ? 1 : (parts > kMaxGridY ? kMaxGridY : parts);
}

// Runs the decode on `stream`: the plan (one block), the decode (grid (R, P)) and, with P > 1, the merge
// of the requests cut between shares. All pointers are device pointers to contiguous tensors: q [batch,
// s_q, h_q, 576] bf16, k_cache [num_blocks, 64, 1, 576] bf16, block_table [batch, max_blocks] int32,
// cache_seqlens [batch] int32, out [batch, s_q, h_q, 512] bf16, lse [batch, h_q, s_q] fp32; workspace:
// prefix [batch + 1] int32, part_o [2 * P * R * 64 * 512] and part_lse [2 * P * R * 64] fp32. q and
// k_cache are 16-byte aligned; every request has len >= s_q.
cudaError_t launch(const void* q, const void* k_cache, int64_t num_blocks, const int* block_table,
                   const int* cache_seqlens, int batch, int s_q, int h_q, int max_blocks, float softmax_scale,
                   void* out, float* lse, int* prefix, float* part_o, float* part_lse, int num_parts,
                   cudaStream_t stream) {
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
  cfg.gridDim = dim3(plan.blocks_per_request * kRows, num_parts, 1);
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
