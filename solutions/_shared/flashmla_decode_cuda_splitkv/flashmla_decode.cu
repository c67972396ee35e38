// FlashMLA-form dense MLA decode: bf16 paged cache of 64-token blocks, one latent KV head,
// [512 latent | 64 rope] keys, causal over seq_len_q draft tokens, fp32 accumulation.
//
// Work partition. Row r = (request b, query token i, group g of 16 heads), r = (b * s_q + i) *
// (h_q / 16) + g, so the rows of one request are adjacent in the grid and read the same keys from
// L2 at about the same time. One CTA per (KV split, row): grid (num_splits, rows), in launches of at
// most 65535 rows (the limit of grid y) when there are more. num_splits is
// chosen on the host from shapes only (no device read, no sync); the chunk of a split follows on
// device from the request's length, chunk = max(kMinChunk, ceil(L / num_splits) rounded up to a
// tile), so every request is cut into equal pieces whatever its length. A CTA covers keys
// [split * chunk, min((split + 1) * chunk, visible)), visible = L - s_q + i + 1 (FlashMLA's causal
// rule); an empty range only marks its partial with lse -inf.
//
// Per CTA (as in the MLA paged decode cuda_splitkv): 4 warps, the 16 heads are the 16 rows of every
// mma. Tiles of 16 keys start at multiples of 16, so each lies inside one 64-token cache block:
// one block_table entry per tile, and the tile's 16 x 576 values are contiguous in memory. They are
// gathered with 16-byte cp.async into a kStages-deep shared-memory ring (zero-filled past the range,
// whose cache slots may hold anything) and read once for both products:
//   q.k^T: warp w owns the key columns [144w, 144w + 144) (q fragments in registers); the four
//          partial logit tiles are summed through shared memory.
//   p.v:   warp w owns output columns [128w, 128w + 128); p (bf16) is shared through memory.
// Both use mma.sync m16n8k16 (bf16 in, fp32 accumulate). Softmax is online in base 2: logits are
// scaled by softmax_scale * log2(e) and exponentiated with ex2.
//
// Output. With one split the CTA writes out (bf16) and lse (natural log) itself. Otherwise it
// writes a normalised fp32 partial and its base-2 lse to workspace slot r * num_splits + split,
// and the merge kernel (a programmatic dependent of the decode kernel) combines the partials of
// each (row, head) with weights exp2(lse_j - max), skipping the -inf ones, whose outputs were
// never written.

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#ifndef FLASHMLA_DECODE_PDL
#define FLASHMLA_DECODE_PDL 1  // launch the merge kernel with programmatic dependent launch
#endif

namespace flashmla_decode {

constexpr int kMaxGridY = 65535;                             // rows per launch (grid y limit)
constexpr int kHeads = 16;                                   // heads per CTA (mma rows)
constexpr int kDimV = 512;
constexpr int kDimK = 576;                                   // key columns: 512 latent + 64 rope
constexpr int kPageSize = 64;                                // tokens per cache block
constexpr int kBlockN = 16;                                  // keys per tile
constexpr int kStages = 4;                                   // shared-memory ring depth
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowBytes = kDimK * 2 + 16;                    // 1168: one key, padded by 16 bytes
constexpr int kStageBytes = kBlockN * kRowBytes;             // 18688
constexpr int kPiecesPerRow = kDimK * 2 / 16;                // 72 16-byte pieces per key
constexpr int kPiecesPerThread = kBlockN * kPiecesPerRow / kThreads;  // 9
constexpr int kKSteps = kDimK / 16 / kWarps;                 // 9 k-steps of q.k^T per warp
constexpr int kKPerWarp = kKSteps * 16;                      // 144
constexpr int kDimsPerWarp = kDimV / kWarps;                 // 128 output columns per warp
constexpr int kNTiles = kDimsPerWarp / 8;                    // 16 n8 tiles of p.v per warp
constexpr int kSRow = kBlockN + 8;                           // padded rows of the logit tiles
constexpr int kPRow = kBlockN + 8;                           // padded rows of p

// Split choice: about kCtasPerSm CTAs per SM in all (the kernel is built for two resident CTAs per
// SM), at least kMinChunk keys per split, at most kMaxSplits splits.
constexpr int kCtasPerSm = 2;
constexpr int kMinChunk = 256;
constexpr int kMaxSplits = 128;

constexpr int kMergeThreads = kDimV / 4;                     // one float4 of one head per thread

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

static_assert(kBlockN == 16, "the fragment code assumes 16-key tiles");
static_assert(kPageSize % kBlockN == 0, "a tile must not straddle cache blocks");
static_assert(kMinChunk % kBlockN == 0, "splits must start on tile boundaries");
static_assert(kBlockN * kPiecesPerRow == kPiecesPerThread * kThreads, "gather: whole pieces per thread");
static_assert(kDimK % (16 * kWarps) == 0, "q.k^T k-slices must be whole k-steps");
static_assert(kRowBytes % 128 == 16, "row padding keeps ldmatrix conflict-free");

struct SharedStorage {
  alignas(128) unsigned char kv[kStages][kStageBytes];       // [key][576 values | pad]
  alignas(16) float s[kWarps][kHeads][kSRow];                // per-warp partial logits
  alignas(16) __nv_bfloat16 p[kHeads][kPRow];                // probabilities of the tile
  float alpha[kHeads];                                       // rescale factor of the tile
  float rowsum[kHeads];                                      // running sum after the last tile
};

struct DecodeParams {
  const __nv_bfloat16* q;        // [batch, s_q, h_q, 576]
  const __nv_bfloat16* k_cache;  // [num_blocks, 64, 1, 576]
  const int* block_table;        // [batch, max_blocks]
  const int* cache_seqlens;      // [batch]
  __nv_bfloat16* out;            // [batch, s_q, h_q, 512]
  float* lse;                    // [batch, h_q, s_q], natural log
  float* part_o;                 // [rows * num_splits, 16, 512], used when num_splits > 1
  float* part_lse;               // [rows * num_splits, 16], base 2
  int s_q;
  int h_q;
  int max_blocks;
  int num_splits;
  int row_base;                  // first row of this launch (grid y holds at most 65535 rows)
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
// Primitives
// ------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16-byte global -> shared copy; with valid == false the 16 bytes are zero-filled (nothing read).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n"
               :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

// d += a * b, m16n8k16, a row-major (16 x 16), b column-major (16 x 8), bf16 in, fp32 out.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
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

__device__ __forceinline__ float shfl_xor(float v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}

// Waits until the preceding kernel in the stream has completed and its writes are visible;
// a no-op when this kernel was not launched as a programmatic dependent.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// ------------------------------------------------------------------------------------------
// Decode kernel
// ------------------------------------------------------------------------------------------

// Gather of the tile of keys [t0, t0 + 16) from cache block `block`: its 16 rows are contiguous,
// 1152 pieces of 16 bytes; thread tid copies pieces tid + 128 j (j < 9), so a warp moves 512
// contiguous bytes per instruction. Keys at or past n_valid are zero-filled.
__device__ __forceinline__ void issue_tile(const DecodeParams& p, int block, int t0, int n_valid,
                                           uint32_t stage_addr, int tid) {
  const __nv_bfloat16* src =
      p.k_cache + (static_cast<size_t>(block) * kPageSize + (t0 % kPageSize)) * kDimK;
#pragma unroll
  for (int j = 0; j < kPiecesPerThread; ++j) {
    const int piece = tid + j * kThreads;
    const int key = piece / kPiecesPerRow;
    const int col = piece - key * kPiecesPerRow;
    cp_async_16(stage_addr + key * kRowBytes + col * 16, src + piece * 8, key < n_valid);
  }
}

// q fragments (mma A operand) of the CTA's 16 heads for this warp's k-slice, straight from memory;
// q_rows points at head 0 of the group, rows kDimK apart.
__device__ __forceinline__ void load_q(uint32_t (&q)[kKSteps][4], const __nv_bfloat16* q_rows, int warp,
                                       int lane) {
  const int h = lane >> 2;
  const int c = (lane & 3) * 2;
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    const __nv_bfloat16* base = q_rows + warp * kKPerWarp + ks * 16 + c;
    q[ks][0] = __ldg(reinterpret_cast<const unsigned int*>(base + h * kDimK));
    q[ks][1] = __ldg(reinterpret_cast<const unsigned int*>(base + (h + 8) * kDimK));
    q[ks][2] = __ldg(reinterpret_cast<const unsigned int*>(base + h * kDimK + 8));
    q[ks][3] = __ldg(reinterpret_cast<const unsigned int*>(base + (h + 8) * kDimK + 8));
  }
}

__global__ void __launch_bounds__(kThreads, 2) flashmla_decode_kernel(const DecodeParams p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  SharedStorage& sm = *reinterpret_cast<SharedStorage*>(smem_raw);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int split = blockIdx.x;
  const int row = p.row_base + static_cast<int>(blockIdx.y);
  const int groups = p.h_q / kHeads;
  const int bi = row / groups;  // b * s_q + i
  const int b = bi / p.s_q;
  const int i = bi - b * p.s_q;
  const int head0 = (row - bi * groups) * kHeads;
  const size_t slot = static_cast<size_t>(row) * p.num_splits + split;

  const int len = __ldg(p.cache_seqlens + b);
  const int visible = len - p.s_q + i + 1;
  const int per_split = (len + p.num_splits - 1) / p.num_splits;
  const int chunk = max(kMinChunk, (per_split + kBlockN - 1) / kBlockN * kBlockN);
  const int start = split * chunk;
  const int end = min(start + chunk, visible);
  if (start >= end) {
    // Split 0 always holds key 0 (the constraints give visible >= 1), so this is a later split.
    if (p.num_splits > 1 && tid < kHeads) p.part_lse[slot * kHeads + tid] = -INFINITY;
    return;
  }
  const int n_tiles = (end - start + kBlockN - 1) / kBlockN;
  const int* table = p.block_table + static_cast<size_t>(b) * p.max_blocks;

  uint32_t q[kKSteps][4];
  load_q(q, p.q + (static_cast<size_t>(bi) * p.h_q + head0) * kDimK, warp, lane);

  const uint32_t kv_addr = smem_addr(&sm.kv[0][0]);

  // Prologue: the first kStages - 1 tiles (their block ids first, then the copies).
  {
    int blocks[kStages - 1];
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      blocks[s] = s < n_tiles ? __ldg(table + (start + s * kBlockN) / kPageSize) : 0;
    }
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < n_tiles) {
        const int t0 = start + s * kBlockN;
        issue_tile(p, blocks[s], t0, end - t0, kv_addr + s * kStageBytes, tid);
      }
      cp_async_commit();
    }
  }
  // The block id of the next tile to issue is always loaded one iteration ahead.
  int next_block = kStages - 1 < n_tiles ? __ldg(table + (start + (kStages - 1) * kBlockN) / kPageSize) : 0;

  float acc[kNTiles][4];
#pragma unroll
  for (int j = 0; j < kNTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float m_run = -INFINITY;  // softmax state of row tid / 8, replicated over its 8 threads
  float l_run = 0.f;
  const float scale = p.scale_log2;

  // Per-lane fragment addressing (bytes within a stage / within p).
  const int frag_row = lane >> 2;               // C fragment rows frag_row, frag_row + 8
  const int frag_col = (lane & 3) * 2;          // C fragment columns
  const uint32_t k_off = ((lane & 7) + (lane >> 4) * 8) * kRowBytes + (warp * kKPerWarp + ((lane >> 3) & 1) * 8) * 2;
  const uint32_t v_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * kRowBytes + (warp * kDimsPerWarp + (lane >> 4) * 8) * 2;
  const uint32_t p_addr = smem_addr(&sm.p[(lane & 7) + ((lane >> 3) & 1) * 8][(lane >> 4) * 8]);
  const int sm_row = tid >> 3;                  // softmax: row and first of two columns
  const int sm_col = (tid & 7) * 2;

  for (int it = 0; it < n_tiles; ++it) {
    const uint32_t stage_addr = kv_addr + (it % kStages) * kStageBytes;
    cp_async_wait<kStages - 2>();
    __syncthreads();  // tile `it` is in shared memory; everyone is done with tile it - 1

    // Refill the slot of tile it - 1 with tile it + kStages - 1.
    const int nt = it + kStages - 1;
    if (nt < n_tiles) {
      const int t0 = start + nt * kBlockN;
      issue_tile(p, next_block, t0, end - t0, kv_addr + (nt % kStages) * kStageBytes, tid);
      if (nt + 1 < n_tiles) next_block = __ldg(table + (t0 + kBlockN) / kPageSize);
    }
    cp_async_commit();

    const int n_valid = min(kBlockN, end - (start + it * kBlockN));
    const bool last = it == n_tiles - 1;

    // q.k^T over this warp's 144 key columns, two accumulators per n-tile (even/odd k-steps).
    {
      float sacc[2][2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) sacc[n][e][0] = sacc[n][e][1] = sacc[n][e][2] = sacc[n][e][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        uint32_t kb[4];
        ldmatrix_x4(kb, stage_addr + k_off + ks * 32);
        mma_bf16(sacc[0][ks & 1], q[ks], kb[0], kb[1]);
        mma_bf16(sacc[1][ks & 1], q[ks], kb[2], kb[3]);
      }
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        float2 lo = make_float2(sacc[n][0][0] + sacc[n][1][0], sacc[n][0][1] + sacc[n][1][1]);
        float2 hi = make_float2(sacc[n][0][2] + sacc[n][1][2], sacc[n][0][3] + sacc[n][1][3]);
        *reinterpret_cast<float2*>(&sm.s[warp][frag_row][n * 8 + frag_col]) = lo;
        *reinterpret_cast<float2*>(&sm.s[warp][frag_row + 8][n * 8 + frag_col]) = hi;
      }
    }
    __syncthreads();

    // Online softmax, 8 threads per head row, two keys each.
    {
      float x0 = 0.f, x1 = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float2 v = *reinterpret_cast<const float2*>(&sm.s[w][sm_row][sm_col]);
        x0 += v.x;
        x1 += v.y;
      }
      x0 = sm_col < n_valid ? x0 * scale : -INFINITY;
      x1 = sm_col + 1 < n_valid ? x1 * scale : -INFINITY;
      float mx = fmaxf(x0, x1);
      mx = fmaxf(mx, shfl_xor(mx, 1));
      mx = fmaxf(mx, shfl_xor(mx, 2));
      mx = fmaxf(mx, shfl_xor(mx, 4));
      const float m_new = fmaxf(m_run, mx);  // finite: every tile has at least one key
      const float alpha = fast_exp2(m_run - m_new);
      const float p0 = fast_exp2(x0 - m_new);
      const float p1 = fast_exp2(x1 - m_new);
      float rs = p0 + p1;
      rs += shfl_xor(rs, 1);
      rs += shfl_xor(rs, 2);
      rs += shfl_xor(rs, 4);
      l_run = l_run * alpha + rs;
      m_run = m_new;
      *reinterpret_cast<__nv_bfloat162*>(&sm.p[sm_row][sm_col]) = __floats2bfloat162_rn(p0, p1);
      if ((tid & 7) == 0) {
        sm.alpha[sm_row] = alpha;
        if (last) {
          sm.rowsum[sm_row] = l_run;
          const float lse2 = m_run + fast_log2(l_run);
          if (p.num_splits > 1) {
            p.part_lse[slot * kHeads + sm_row] = lse2;
          } else {
            p.lse[(static_cast<size_t>(b) * p.h_q + head0 + sm_row) * p.s_q + i] = lse2 * kLn2;
          }
        }
      }
    }
    __syncthreads();

    // p.v over this warp's 128 output columns.
    {
      const float a_lo = sm.alpha[frag_row];
      const float a_hi = sm.alpha[frag_row + 8];
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
        acc[j][0] *= a_lo;
        acc[j][1] *= a_lo;
        acc[j][2] *= a_hi;
        acc[j][3] *= a_hi;
      }
      uint32_t pa[4];
      ldmatrix_x4(pa, p_addr);
#pragma unroll
      for (int jj = 0; jj < kNTiles / 2; ++jj) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, stage_addr + v_off + jj * 32);
        mma_bf16(acc[2 * jj], pa, vb[0], vb[1]);
        mma_bf16(acc[2 * jj + 1], pa, vb[2], vb[3]);
      }
    }
  }
  cp_async_wait<0>();

  // sm.rowsum was written before the last tile's second barrier.
  const float inv_lo = 1.f / sm.rowsum[frag_row];
  const float inv_hi = 1.f / sm.rowsum[frag_row + 8];
  const int col0 = warp * kDimsPerWarp + frag_col;
  if (p.num_splits > 1) {
    float* o = p.part_o + slot * kHeads * kDimV;
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
      const int col = col0 + j * 8;
      *reinterpret_cast<float2*>(o + frag_row * kDimV + col) = make_float2(acc[j][0] * inv_lo, acc[j][1] * inv_lo);
      *reinterpret_cast<float2*>(o + (frag_row + 8) * kDimV + col) =
          make_float2(acc[j][2] * inv_hi, acc[j][3] * inv_hi);
    }
  } else {
    // out[b, i, head0 .. head0 + 15, :] is one contiguous 16 x 512 block.
    __nv_bfloat16* o = p.out + (static_cast<size_t>(bi) * p.h_q + head0) * kDimV;
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
      const int col = col0 + j * 8;
      *reinterpret_cast<__nv_bfloat162*>(o + frag_row * kDimV + col) =
          __floats2bfloat162_rn(acc[j][0] * inv_lo, acc[j][1] * inv_lo);
      *reinterpret_cast<__nv_bfloat162*>(o + (frag_row + 8) * kDimV + col) =
          __floats2bfloat162_rn(acc[j][2] * inv_hi, acc[j][3] * inv_hi);
    }
  }
}

// ------------------------------------------------------------------------------------------
// Merge kernel: one block per (row, head), one float4 of the 512 outputs per thread. The max of
// the partial lses comes first, so each partial is weighted once, with no running rescale, and the
// loads of different partials are independent.
// ------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kMergeThreads) flashmla_merge_kernel(const MergeParams p) {
  const int tid = threadIdx.x;
  const int row = blockIdx.x / kHeads;
  const int h = blockIdx.x - row * kHeads;
  const size_t slot0 = static_cast<size_t>(row) * p.num_splits;
  const float* part_lse = p.part_lse + slot0 * kHeads + h;
  const float* part_o = p.part_o + (slot0 * kHeads + h) * kDimV + tid * 4;

  grid_dependency_wait();  // before any partial is read

  float mx = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) mx = fmaxf(mx, __ldcg(part_lse + s * kHeads));
  // mx is finite: split 0 holds key 0 of every row.
  float total = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int s = 0; s < p.num_splits; ++s) {
    const float l = __ldcg(part_lse + s * kHeads);
    if (l != -INFINITY) {  // an empty split wrote no output
      const float4 v = __ldcg(reinterpret_cast<const float4*>(part_o + static_cast<size_t>(s) * kHeads * kDimV));
      const float w = fast_exp2(l - mx);
      total += w;
      acc.x += w * v.x;
      acc.y += w * v.y;
      acc.z += w * v.z;
      acc.w += w * v.w;
    }
  }
  const float inv = 1.f / total;
  // Rows are (b * s_q + i) * groups + g and h_q = 16 * groups, so row * 16 + h indexes out's
  // [batch * s_q * h_q] heads directly.
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(p.out + static_cast<size_t>(blockIdx.x) * kDimV + tid * 4);
  o[0] = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
  o[1] = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
  if (tid == 0) {
    const int groups = p.h_q / kHeads;
    const int bi = row / groups;
    const int b = bi / p.s_q;
    const int i = bi - b * p.s_q;
    const int head = (row - bi * groups) * kHeads + h;
    p.lse[(static_cast<size_t>(b) * p.h_q + head) * p.s_q + i] = (mx + fast_log2(total)) * kLn2;
  }
}

// ------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------

// Splits per row from shapes only: one when the rows alone give kCtasPerSm CTAs per SM, else
// enough for that, but no more than max_len (the table's capacity, an upper bound on every
// length) cut in kMinChunk pieces.
int choose_splits(int rows, int max_len, int num_sms) {
  const int target = kCtasPerSm * (num_sms > 0 ? num_sms : 132);
  if (rows >= target) return 1;
  int splits = (target + rows - 1) / rows;
  const int by_len = (max_len + kMinChunk - 1) / kMinChunk;
  if (splits > by_len) splits = by_len;
  if (splits > kMaxSplits) splits = kMaxSplits;
  return splits > 1 ? splits : 1;
}

// Runs the decode on `stream`. All pointers are device pointers to contiguous tensors: q [batch,
// s_q, h_q, 576] bf16, k_cache [num_blocks, 64, 1, 576] bf16, block_table [batch, max_blocks]
// int32, cache_seqlens [batch] int32, out [batch, s_q, h_q, 512] bf16, lse [batch, h_q, s_q] fp32;
// with num_splits > 1, part_o [batch * s_q * h_q * num_splits * 512] and part_lse [batch * s_q *
// h_q * num_splits] fp32. h_q is a multiple of 16.
cudaError_t launch(const void* q, const void* k_cache, const int* block_table, const int* cache_seqlens,
                   int batch, int s_q, int h_q, int max_blocks, float softmax_scale, void* out, float* lse,
                   float* part_o, float* part_lse, int num_splits, cudaStream_t stream) {
  const int rows = batch * s_q * (h_q / kHeads);
  if (rows <= 0) return cudaSuccess;
  const size_t smem = sizeof(SharedStorage);

  static bool configured[64] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= 64 || !configured[device]) {
    err = cudaFuncSetAttribute(flashmla_decode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    err = cudaFuncSetAttribute(flashmla_decode_kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
    if (err != cudaSuccess) return err;
    if (device >= 0 && device < 64) configured[device] = true;
  }

  DecodeParams dp;
  dp.q = static_cast<const __nv_bfloat16*>(q);
  dp.k_cache = static_cast<const __nv_bfloat16*>(k_cache);
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
  for (int base = 0; base < rows; base += kMaxGridY) {
    dp.row_base = base;
    const int n = rows - base < kMaxGridY ? rows - base : kMaxGridY;
    flashmla_decode_kernel<<<dim3(num_splits, n), kThreads, smem, stream>>>(dp);
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
  cfg.gridDim = dim3(rows * kHeads, 1, 1);
  cfg.blockDim = dim3(kMergeThreads, 1, 1);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = FLASHMLA_DECODE_PDL ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, flashmla_merge_kernel, mp);
}

}  // namespace flashmla_decode
