// MLA paged decode (absorbed form): 16 query heads, ckv 512, kpe 64, page size 1, bf16 in,
// fp32 accumulation, base-2 lse. Split-KV with a balanced partition of the flattened KV tokens.
//
// Work partition. The KV tokens of the whole batch, request after request (kv_indices), are cut
// into `units` chunks of `chunk` tokens; one CTA per chunk. chunk follows from len(kv_indices)
// (== kv_indptr[-1] by the definition), so the host never reads device data. A CTA finds the
// request holding its first token by counting kv_indptr entries <= start (all threads at once),
// then walks the requests its chunk overlaps, one segment per request, in tiles of kBlockN
// tokens. The tile stream runs across segment boundaries without draining the pipeline.
//
// Per CTA: 4 warps, all 16 heads (the 16 rows of every mma). Each KV tile ([ckv | kpe] rows,
// gathered through kv_indices with 16-byte cp.async into a kStages-deep shared-memory ring) is
// read once from memory and serves both products, ckv being both key and value:
//   q.k^T: warp w owns the k-slice [144w, 144w + 144) of the 576 key columns for all tokens of
//          the tile (its q fragments live in registers); the four partial logit tiles are
//          summed through shared memory.
//   p.v:   warp w owns output columns [128w, 128w + 128); p (bf16) is shared through memory.
// Both products use mma.sync m16n8k16 (bf16 in, fp32 accumulate). Softmax is online in base 2:
// logits are scaled by sm_scale * log2(e) and exponentiated with ex2.
//
// Output. A request that lies inside one chunk is finished in place (bf16 output, lse). A
// request cut by chunk boundaries leaves, per chunk, a normalised fp32 partial output and its
// lse in workspace slot (request + unit), which is unique since requests and chunks are both
// ordered along the token axis. The merge kernel, launched as a programmatic dependent of the
// decode kernel, combines a request's partials (slots request + first_unit .. request +
// last_unit) with weights exp2(lse_j - max) and writes output 0 and lse -inf for requests
// without KV; it derives its own work list from kv_indptr.
//
// Build: nvcc -c -O3 -gencode=arch=compute_90a,code=sm_90a --use_fast_math mla_decode.cu
// (nothing here needs more than sm_90). Defining MLA_DECODE_EXTERNAL_PRIMITIVES compiles the
// kernels against primitives (cp.async, ldmatrix, mma, ...) supplied by the includer, such as a
// host emulation of those instructions, and leaves out the launcher.

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#ifndef MLA_DECODE_PDL
#define MLA_DECODE_PDL 1  // launch the merge kernel with programmatic dependent launch
#endif

namespace mla_decode {

constexpr int kHeads = 16;
constexpr int kDimCkv = 512;
constexpr int kDimKpe = 64;
constexpr int kDimK = kDimCkv + kDimKpe;                     // 576 key columns
constexpr int kBlockN = 16;                                  // KV tokens per tile
#ifndef MLA_DECODE_STAGES
#define MLA_DECODE_STAGES 4
#endif
constexpr int kStages = MLA_DECODE_STAGES;                   // shared-memory ring depth
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowBytes = kDimK * 2 + 16;                    // 1168: one token, padded by 16 bytes
constexpr int kStageBytes = kBlockN * kRowBytes;             // 18688
constexpr int kCkvChunks = kDimCkv * 2 / 16;                 // 64 16-byte pieces of ckv per token
constexpr int kKpeChunks = kDimKpe * 2 / 16;                 // 8 of kpe
constexpr int kCkvRowsPerPass = kThreads / kCkvChunks;       // 2 token rows of ckv per pass
constexpr int kCkvPasses = kBlockN / kCkvRowsPerPass;        // 8
constexpr int kChunksPerThread = kCkvPasses + 1;             // 8 ckv pieces + 1 kpe piece
constexpr int kKSteps = kDimK / 16 / kWarps;                 // 9 k-steps of q.k^T per warp
constexpr int kKPerWarp = kKSteps * 16;                      // 144
constexpr int kDimsPerWarp = kDimCkv / kWarps;               // 128 output columns per warp
constexpr int kNTiles = kDimsPerWarp / 8;                    // 16 n8 tiles of p.v per warp
constexpr int kSRow = kBlockN + 8;                           // padded rows of the logit tiles
constexpr int kPRow = kBlockN + 8;                           // padded rows of p

// Default partition: two CTAs per SM (the kernel is built for two resident CTAs per SM) and at
// least kMinChunk tokens per CTA.
constexpr int kUnitsPerSm = 2;
constexpr int kMinChunk = 64;

constexpr int kMergeThreads = 256;
constexpr int kF4PerRequest = kHeads * kDimCkv / 4;          // 2048 float4 of output per request
constexpr int kMergeSlicesPerGroup = kF4PerRequest / kMergeThreads;  // 8
constexpr int kMergeMaxGroups = 32;                          // partial groups per merge item, at most
constexpr int kMergeUnroll = 6;                              // partials in flight per thread
constexpr int kMergeBlocksPerSm = 4;                         // resident merge blocks per SM (<= 64 regs)

static_assert(kBlockN == 16, "the fragment code assumes 16-token tiles");
static_assert(kBlockN * kCkvChunks == kCkvPasses * kThreads, "ckv gather: whole passes");
static_assert(kBlockN * kKpeChunks == kThreads, "kpe gather: one piece per thread");
static_assert(kDimK % (16 * kWarps) == 0, "q.k^T k-slices must be whole k-steps");
static_assert(kRowBytes % 128 == 16, "row padding keeps ldmatrix conflict-free");
static_assert(kMergeThreads % kMergeMaxGroups == 0, "merge groups must divide the block");

struct SharedStorage {
  alignas(128) unsigned char kv[kStages][kStageBytes];       // [token][ckv 512 | kpe 64 | pad]
  alignas(16) float s[kWarps][kHeads][kSRow];                // per-warp partial logits
  alignas(16) __nv_bfloat16 p[kHeads][kPRow];                // probabilities of the tile
  float alpha[kHeads];                                       // rescale factor of the tile
  float rowsum[kHeads];                                      // running sum at a segment's end
  int red[kWarps];
};

struct DecodeParams {
  const __nv_bfloat16* q_nope;   // [batch, 16, 512]
  const __nv_bfloat16* q_pe;     // [batch, 16, 64]
  const __nv_bfloat16* ckv;      // [pages, 512]
  const __nv_bfloat16* kpe;      // [pages, 64]
  const int* kv_indptr;          // [batch + 1]
  const int* kv_indices;         // [total]
  __nv_bfloat16* out;            // [batch, 16, 512]
  float* lse;                    // [batch, 16]
  float* part_o;                 // [slots, 16, 512]
  float* part_lse;               // [slots, 16]
  int batch;
  int total;
  int chunk;
  float scale_log2;              // sm_scale * log2(e)
};

struct MergeParams {
  const int* kv_indptr;
  const float* part_o;
  const float* part_lse;
  __nv_bfloat16* out;
  float* lse;
  int batch;
  int chunk;
};

// ------------------------------------------------------------------------------------------
// Primitives
// ------------------------------------------------------------------------------------------
#ifndef MLA_DECODE_EXTERNAL_PRIMITIVES

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16-byte global -> shared copy; with valid == false the 16 bytes are zero-filled.
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

__device__ __forceinline__ int shfl_xor(int v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}

__device__ __forceinline__ int ld_i32(const int* p) { return __ldg(p); }

__device__ __forceinline__ uint32_t ld_u32(const __nv_bfloat16* p) {
  return __ldg(reinterpret_cast<const unsigned int*>(p));
}

// Partials written by the preceding kernel: cached in L2 only.
__device__ __forceinline__ float ld_f32(const float* p) { return __ldcg(p); }

__device__ __forceinline__ float4 ld_f32x4(const float* p) {
  return __ldcg(reinterpret_cast<const float4*>(p));
}

// Waits until the preceding kernel in the stream has completed and its writes are visible;
// a no-op when this kernel was not launched as a programmatic dependent.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

#endif  // MLA_DECODE_EXTERNAL_PRIMITIVES

// ------------------------------------------------------------------------------------------
// Decode kernel
// ------------------------------------------------------------------------------------------

// Position in the CTA's token range [start, end): the current segment is
// [pos, min(end, req_end)) of request b, whose KV is [req_start, req_end).
struct Cursor {
  int pos;
  int b;
  int req_start;
  int req_end;

  // Moves past a tile ending at t1; at a segment's end steps to the next non-empty request.
  __device__ __forceinline__ void advance(int t1, int end, const int* kv_indptr) {
    pos = t1;
    if (pos < end && pos >= req_end) {
      do {
        ++b;
        req_start = req_end;
        req_end = ld_i32(kv_indptr + b + 1);
      } while (req_end <= pos);
    }
  }
};

// Gather of a tile: thread tid copies 16-byte column (tid % 64) of ckv for the tokens
// 2i + tid / 64 (i < 8), so a warp moves 512 contiguous bytes of one ckv row per pass, and
// 16-byte column (tid % 8) of kpe for token tid / 8. pages[] holds the page id behind each of
// these nine pieces, -1 for tokens past the tile's end (zero-filled).
__device__ __forceinline__ int ckv_token(int i, int tid) { return i * kCkvRowsPerPass + tid / kCkvChunks; }
__device__ __forceinline__ int kpe_token(int tid) { return tid / kKpeChunks; }

__device__ __forceinline__ void load_pages(int (&pages)[kChunksPerThread], const int* kv_indices,
                                           int t0, int t1, int tid) {
#pragma unroll
  for (int i = 0; i < kCkvPasses; ++i) {
    const int tok = ckv_token(i, tid);
    pages[i] = (t0 + tok < t1) ? ld_i32(kv_indices + t0 + tok) : -1;
  }
  const int tok = kpe_token(tid);
  pages[kCkvPasses] = (t0 + tok < t1) ? ld_i32(kv_indices + t0 + tok) : -1;
}

__device__ __forceinline__ void issue_tile(const int (&pages)[kChunksPerThread], const DecodeParams& p,
                                           uint32_t stage_addr, int tid) {
  const int ccol = tid % kCkvChunks;
  const uint32_t cdst = stage_addr + ckv_token(0, tid) * kRowBytes + ccol * 16;
  const __nv_bfloat16* csrc = p.ckv + ccol * 8;
#pragma unroll
  for (int i = 0; i < kCkvPasses; ++i) {
    const int page = pages[i];
    cp_async_16(cdst + i * kCkvRowsPerPass * kRowBytes, csrc + static_cast<size_t>(max(page, 0)) * kDimCkv,
                page >= 0);
  }
  const int kcol = tid % kKpeChunks;
  const int page = pages[kCkvPasses];
  cp_async_16(stage_addr + kpe_token(tid) * kRowBytes + kDimCkv * 2 + kcol * 16,
              p.kpe + static_cast<size_t>(max(page, 0)) * kDimKpe + kcol * 8, page >= 0);
}

// q fragments (mma A operand) of request b for this warp's k-slice, straight from memory.
__device__ __forceinline__ void load_q(uint32_t (&q)[kKSteps][4], const DecodeParams& p, int b,
                                       int warp, int lane) {
  const int h = lane >> 2;
  const int c = (lane & 3) * 2;
  const __nv_bfloat16* qn = p.q_nope + static_cast<size_t>(b) * kHeads * kDimCkv;
  const __nv_bfloat16* qp = p.q_pe + static_cast<size_t>(b) * kHeads * kDimKpe;
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    const int k0 = warp * kKPerWarp + ks * 16;
    const __nv_bfloat16* base;
    int ld;
    if (k0 < kDimCkv) {
      base = qn + k0;
      ld = kDimCkv;
    } else {
      base = qp + (k0 - kDimCkv);
      ld = kDimKpe;
    }
    q[ks][0] = ld_u32(base + h * ld + c);
    q[ks][1] = ld_u32(base + (h + 8) * ld + c);
    q[ks][2] = ld_u32(base + h * ld + c + 8);
    q[ks][3] = ld_u32(base + (h + 8) * ld + c + 8);
  }
}

__global__ void __launch_bounds__(kThreads, 2) mla_decode_split_kernel(const DecodeParams p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  SharedStorage& sm = *reinterpret_cast<SharedStorage*>(smem_raw);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int unit = blockIdx.x;
  const int start = unit * p.chunk;
  const int end = min(start + p.chunk, p.total);
  if (start >= end) return;

  // Request holding token `start`: the number of requests that end at or before it.
  int count = 0;
  for (int j = tid + 1; j <= p.batch; j += kThreads) count += ld_i32(p.kv_indptr + j) <= start ? 1 : 0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) count += shfl_xor(count, o);
  if (lane == 0) sm.red[warp] = count;
  __syncthreads();
  int b0 = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) b0 += sm.red[w];

  Cursor prod;
  prod.pos = start;
  prod.b = b0;
  prod.req_start = ld_i32(p.kv_indptr + b0);
  prod.req_end = ld_i32(p.kv_indptr + b0 + 1);
  Cursor cons = prod;

  uint32_t q_next[kKSteps][4];
  load_q(q_next, p, b0, warp, lane);

  const uint32_t kv_addr = smem_addr(&sm.kv[0][0]);

  // Prologue: the first kStages - 1 tiles (page ids of all of them first, then the copies).
  {
    int pro_pages[kStages - 1][kChunksPerThread];
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (prod.pos < end) {
        const int t1 = min(prod.pos + kBlockN, min(end, prod.req_end));
        load_pages(pro_pages[s], p.kv_indices, prod.pos, t1, tid);
        prod.advance(t1, end, p.kv_indptr);
      } else {
#pragma unroll
        for (int i = 0; i < kChunksPerThread; ++i) pro_pages[s][i] = -2;
      }
    }
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (pro_pages[s][0] != -2) issue_tile(pro_pages[s], p, kv_addr + s * kStageBytes, tid);
      cp_async_commit();
    }
  }
  // Page ids of the next tile to issue are always loaded one iteration ahead.
  int pages[kChunksPerThread];
  if (prod.pos < end) {
    load_pages(pages, p.kv_indices, prod.pos, min(prod.pos + kBlockN, min(end, prod.req_end)), tid);
  }

  uint32_t q[kKSteps][4];
  float acc[kNTiles][4];
#pragma unroll
  for (int j = 0; j < kNTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float m_run = -INFINITY;  // softmax state of row tid / 8, replicated over its 8 threads
  float l_run = 0.f;
  bool split = false;       // the current request is cut by chunk boundaries
  const float scale = p.scale_log2;

  // Per-lane fragment addressing (bytes within a stage / within p).
  const int frag_row = lane >> 2;               // C fragment rows frag_row, frag_row + 8
  const int frag_col = (lane & 3) * 2;          // C fragment columns
  const uint32_t k_off = ((lane & 7) + (lane >> 4) * 8) * kRowBytes + (warp * kKPerWarp + ((lane >> 3) & 1) * 8) * 2;
  const uint32_t v_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * kRowBytes + (warp * kDimsPerWarp + (lane >> 4) * 8) * 2;
  const uint32_t p_addr = smem_addr(&sm.p[(lane & 7) + ((lane >> 3) & 1) * 8][(lane >> 4) * 8]);
  const int sm_row = tid >> 3;                  // softmax: row and first of two columns
  const int sm_col = (tid & 7) * 2;

  for (int it = 0; cons.pos < end; ++it) {
    const uint32_t stage_addr = kv_addr + (it % kStages) * kStageBytes;
    cp_async_wait<kStages - 2>();
    __syncthreads();  // tile `it` is in shared memory; everyone is done with tile it - 1

    // Refill the slot of tile it - 1 with tile it + kStages - 1.
    if (prod.pos < end) {
      issue_tile(pages, p, kv_addr + ((it + kStages - 1) % kStages) * kStageBytes, tid);
      const int t1 = min(prod.pos + kBlockN, min(end, prod.req_end));
      prod.advance(t1, end, p.kv_indptr);
      if (prod.pos < end) {
        load_pages(pages, p.kv_indices, prod.pos, min(prod.pos + kBlockN, min(end, prod.req_end)), tid);
      }
    }
    cp_async_commit();

    const int b = cons.b;
    const int t0 = cons.pos;
    const int seg_end = min(end, cons.req_end);
    const int t1 = min(t0 + kBlockN, seg_end);
    const bool first = t0 == start || t0 == cons.req_start;
    const bool last = t1 == seg_end;

    if (first) {
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
#pragma unroll
        for (int r = 0; r < 4; ++r) q[ks][r] = q_next[ks][r];
      }
      if (seg_end < end) {  // prefetch q of the next request with KV in this chunk
        int nb = b + 1;
        while (ld_i32(p.kv_indptr + nb + 1) <= seg_end) ++nb;
        load_q(q_next, p, nb, warp, lane);
      }
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
      m_run = -INFINITY;
      l_run = 0.f;
      split = cons.req_start / p.chunk != (cons.req_end - 1) / p.chunk;
    }

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

    // Online softmax, 8 threads per head row, two tokens each.
    {
      float x0 = 0.f, x1 = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float2 v = *reinterpret_cast<const float2*>(&sm.s[w][sm_row][sm_col]);
        x0 += v.x;
        x1 += v.y;
      }
      const int n_valid = t1 - t0;
      x0 = sm_col < n_valid ? x0 * scale : -INFINITY;
      x1 = sm_col + 1 < n_valid ? x1 * scale : -INFINITY;
      float mx = fmaxf(x0, x1);
      mx = fmaxf(mx, shfl_xor(mx, 1));
      mx = fmaxf(mx, shfl_xor(mx, 2));
      mx = fmaxf(mx, shfl_xor(mx, 4));
      const float m_new = fmaxf(m_run, mx);  // finite: every tile has at least one token
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
          const float lse_v = m_run + fast_log2(l_run);
          if (split) {
            p.part_lse[static_cast<size_t>(b + unit) * kHeads + sm_row] = lse_v;
          } else {
            p.lse[static_cast<size_t>(b) * kHeads + sm_row] = lse_v;
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

    if (last) {
      const float inv_lo = 1.f / sm.rowsum[frag_row];
      const float inv_hi = 1.f / sm.rowsum[frag_row + 8];
      const int col0 = warp * kDimsPerWarp + frag_col;
      if (split) {
        float* o = p.part_o + static_cast<size_t>(b + unit) * kHeads * kDimCkv;
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) {
          const int col = col0 + j * 8;
          *reinterpret_cast<float2*>(o + frag_row * kDimCkv + col) =
              make_float2(acc[j][0] * inv_lo, acc[j][1] * inv_lo);
          *reinterpret_cast<float2*>(o + (frag_row + 8) * kDimCkv + col) =
              make_float2(acc[j][2] * inv_hi, acc[j][3] * inv_hi);
        }
      } else {
        __nv_bfloat16* o = p.out + static_cast<size_t>(b) * kHeads * kDimCkv;
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) {
          const int col = col0 + j * 8;
          *reinterpret_cast<__nv_bfloat162*>(o + frag_row * kDimCkv + col) =
              __floats2bfloat162_rn(acc[j][0] * inv_lo, acc[j][1] * inv_lo);
          *reinterpret_cast<__nv_bfloat162*>(o + (frag_row + 8) * kDimCkv + col) =
              __floats2bfloat162_rn(acc[j][2] * inv_hi, acc[j][3] * inv_hi);
        }
      }
    }

    cons.advance(t1, end, p.kv_indptr);
  }
  cp_async_wait<0>();
}

// ------------------------------------------------------------------------------------------
// Merge kernel: a fixed grid of blocks walks a list of items that every block derives from
// kv_indptr on its own (no host planning, no trivial blocks per request):
//   - a request without KV gives 8 items, each zeroing 2 heads of output (lse -inf);
//   - a request finished in place gives none;
//   - a request with n >= 2 partials gives 8 * G items, G = merge_groups(n) partial groups:
//     item k covers 256 / G float4 of the request's 16 x 512 outputs, and group g of its
//     threads folds partials g, g + G, ... into a running (max, sum, output); the G states are
//     combined through shared memory. Heavily split requests thus get up to 256 blocks.
// Requests are taken 256 at a time; items are dealt round-robin to the blocks.
// ------------------------------------------------------------------------------------------
__device__ __forceinline__ int merge_groups(int n) {
  int g = 1;
  while (g * 2 <= n / 2 && g < kMergeMaxGroups) g *= 2;
  return g;
}

__device__ __forceinline__ int num_partials(int req_start, int req_end, int chunk) {
  return (req_end - 1) / chunk - req_start / chunk + 1;
}

__device__ __forceinline__ void merge_item(const MergeParams& p, int r, int slice, int slices,
                                           float* s_m, float* s_s, float4* s_acc) {
  const int tid = threadIdx.x;
  const int req_start = ld_i32(p.kv_indptr + r);
  const int req_end = ld_i32(p.kv_indptr + r + 1);
  if (req_end <= req_start) {  // no KV: output 0, lse -inf
    const int f = slice * kMergeThreads + tid;
    const int h = f / (kDimCkv / 4);
    const int c4 = f % (kDimCkv / 4);
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(p.out + (static_cast<size_t>(r) * kHeads + h) * kDimCkv + c4 * 4);
    const __nv_bfloat162 z = __floats2bfloat162_rn(0.f, 0.f);
    o[0] = z;
    o[1] = z;
    if (c4 == 0) p.lse[static_cast<size_t>(r) * kHeads + h] = -INFINITY;
    return;
  }
  const int groups = slices / kMergeSlicesPerGroup;
  const int per_group = kMergeThreads / groups;
  const int g = tid / per_group;
  const int f = slice * per_group + tid % per_group;
  const int h = f / (kDimCkv / 4);
  const int c4 = f % (kDimCkv / 4);
  const int n = num_partials(req_start, req_end, p.chunk);
  const size_t base = static_cast<size_t>(r) + req_start / p.chunk;

  float m = -INFINITY;
  float s = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int u0 = g; u0 < n; u0 += groups * kMergeUnroll) {
    float l[kMergeUnroll];
    float4 v[kMergeUnroll];
#pragma unroll
    for (int k = 0; k < kMergeUnroll; ++k) {
      const int u = u0 + k * groups;
      if (u < n) {
        l[k] = ld_f32(p.part_lse + (base + u) * kHeads + h);
        v[k] = ld_f32x4(p.part_o + ((base + u) * kHeads + h) * kDimCkv + c4 * 4);
      } else {
        l[k] = -INFINITY;
        v[k] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
#pragma unroll
    for (int k = 0; k < kMergeUnroll; ++k) {
      if (l[k] != -INFINITY) {
        const float m_new = fmaxf(m, l[k]);
        const float sc = fast_exp2(m - m_new);
        const float w = fast_exp2(l[k] - m_new);
        acc.x = acc.x * sc + w * v[k].x;
        acc.y = acc.y * sc + w * v[k].y;
        acc.z = acc.z * sc + w * v[k].z;
        acc.w = acc.w * sc + w * v[k].w;
        s = s * sc + w;
        m = m_new;
      }
    }
  }
  s_m[tid] = m;
  s_s[tid] = s;
  s_acc[tid] = acc;
  __syncthreads();
  if (g == 0) {
    float mx = -INFINITY;
    for (int gg = 0; gg < groups; ++gg) mx = fmaxf(mx, s_m[gg * per_group + tid]);
    float total = 0.f;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int gg = 0; gg < groups; ++gg) {
      const int k = gg * per_group + tid;
      const float w = s_m[k] == -INFINITY ? 0.f : fast_exp2(s_m[k] - mx);
      const float4 ag = s_acc[k];
      total += w * s_s[k];
      a.x += w * ag.x;
      a.y += w * ag.y;
      a.z += w * ag.z;
      a.w += w * ag.w;
    }
    const float inv = 1.f / total;
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(p.out + (static_cast<size_t>(r) * kHeads + h) * kDimCkv + c4 * 4);
    o[0] = __floats2bfloat162_rn(a.x * inv, a.y * inv);
    o[1] = __floats2bfloat162_rn(a.z * inv, a.w * inv);
    if (c4 == 0) p.lse[static_cast<size_t>(r) * kHeads + h] = mx + fast_log2(total);
  }
  __syncthreads();  // shared state is reused by the next item
}

__global__ void __launch_bounds__(kMergeThreads, kMergeBlocksPerSm) mla_decode_merge_kernel(const MergeParams p) {
  __shared__ int s_scan[kMergeThreads];
  __shared__ float s_m[kMergeThreads];
  __shared__ float s_s[kMergeThreads];
  __shared__ float4 s_acc[kMergeThreads];

  const int tid = threadIdx.x;
  const int nblocks = gridDim.x;
  const int bid = blockIdx.x;
  // Every block waits, so this grid never completes before the decode kernel has.
  grid_dependency_wait();
  int item_base = 0;
  for (int r0 = 0; r0 < p.batch; r0 += kMergeThreads) {
    // Items of requests r0 .. r0 + 255 (inclusive scan over the block).
    const int r = r0 + tid;
    int items = 0;
    if (r < p.batch) {
      const int req_start = ld_i32(p.kv_indptr + r);
      const int req_end = ld_i32(p.kv_indptr + r + 1);
      if (req_end <= req_start) {
        items = kMergeSlicesPerGroup;
      } else {
        const int n = num_partials(req_start, req_end, p.chunk);
        items = n > 1 ? kMergeSlicesPerGroup * merge_groups(n) : 0;
      }
    }
    s_scan[tid] = items;
    __syncthreads();
    for (int off = 1; off < kMergeThreads; off <<= 1) {
      const int v = tid >= off ? s_scan[tid - off] : 0;
      __syncthreads();
      s_scan[tid] += v;
      __syncthreads();
    }
    const int chunk_items = s_scan[kMergeThreads - 1];

    int i = item_base + ((bid - item_base % nblocks) % nblocks + nblocks) % nblocks;
    for (; i < item_base + chunk_items; i += nblocks) {
      const int local = i - item_base;
      int lo = 0, hi = kMergeThreads - 1;  // first request whose inclusive count exceeds `local`
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (s_scan[mid] > local) hi = mid; else lo = mid + 1;
      }
      const int before = lo > 0 ? s_scan[lo - 1] : 0;
      merge_item(p, r0 + lo, local - before, s_scan[lo] - before, s_m, s_s, s_acc);
    }
    item_base += chunk_items;
    __syncthreads();  // s_scan is rewritten by the next round
  }
}

// ------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------
struct Plan {
  int chunk;  // tokens per CTA
  int units;  // CTAs of the decode kernel
};

inline Plan make_plan(int total, int num_sms) {
  Plan plan;
  const int target = num_sms > 0 ? kUnitsPerSm * num_sms : 2 * 132;
  int chunk = (total + target - 1) / target;
  if (chunk < kMinChunk) chunk = kMinChunk;
  plan.chunk = chunk;
  plan.units = total > 0 ? (total + chunk - 1) / chunk : 0;
  return plan;
}

// Rows of the partial workspace that launch() may use: part_o needs slots * 16 * 512 floats,
// part_lse slots * 16 floats.
int workspace_slots(int batch, int total, int num_sms) {
  const Plan plan = make_plan(total, num_sms);
  return batch + (plan.units > 0 ? plan.units : 1);
}

size_t decode_smem_bytes() { return sizeof(SharedStorage); }

// Blocks of the merge kernel: one wave, or fewer when the batch cannot produce that many items
// (at most 8 per request without KV, at most 4 per partial otherwise).
inline int merge_blocks(int batch, const Plan& plan, int num_sms) {
  const long long wave = static_cast<long long>(kMergeBlocksPerSm) * (num_sms > 0 ? num_sms : 132);
  const long long most = static_cast<long long>(kMergeSlicesPerGroup) * batch + 4LL * (batch + plan.units);
  return static_cast<int>(most < wave ? most : wave);
}

#ifndef MLA_DECODE_EXTERNAL_PRIMITIVES

// Runs the decode on `stream`. All pointers are device pointers to contiguous tensors:
// q_nope [batch, 16, 512] bf16, q_pe [batch, 16, 64] bf16, ckv [pages, 512] bf16,
// kpe [pages, 64] bf16, kv_indptr [batch + 1] int32, kv_indices [total] int32 (total ==
// kv_indptr[batch]), out [batch, 16, 512] bf16, lse [batch, 16] fp32, and the workspace
// part_o / part_lse of workspace_slots(batch, total, num_sms) rows.
cudaError_t launch(const void* q_nope, const void* q_pe, const void* ckv, const void* kpe,
                   const int* kv_indptr, const int* kv_indices, int batch, int total, float sm_scale,
                   void* out, float* lse, float* part_o, float* part_lse, int num_sms,
                   cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  const Plan plan = make_plan(total, num_sms);
  const size_t smem = sizeof(SharedStorage);

  if (plan.units > 0) {
    static bool configured[64] = {};
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    if (device < 0 || device >= 64 || !configured[device]) {
      err = cudaFuncSetAttribute(mla_decode_split_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(smem));
      if (err != cudaSuccess) return err;
      err = cudaFuncSetAttribute(mla_decode_split_kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                 cudaSharedmemCarveoutMaxShared);
      if (err != cudaSuccess) return err;
      if (device >= 0 && device < 64) configured[device] = true;
    }
    DecodeParams dp;
    dp.q_nope = static_cast<const __nv_bfloat16*>(q_nope);
    dp.q_pe = static_cast<const __nv_bfloat16*>(q_pe);
    dp.ckv = static_cast<const __nv_bfloat16*>(ckv);
    dp.kpe = static_cast<const __nv_bfloat16*>(kpe);
    dp.kv_indptr = kv_indptr;
    dp.kv_indices = kv_indices;
    dp.out = static_cast<__nv_bfloat16*>(out);
    dp.lse = lse;
    dp.part_o = part_o;
    dp.part_lse = part_lse;
    dp.batch = batch;
    dp.total = total;
    dp.chunk = plan.chunk;
    dp.scale_log2 = sm_scale * 1.4426950408889634f;
    mla_decode_split_kernel<<<plan.units, kThreads, smem, stream>>>(dp);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }

  MergeParams mp;
  mp.kv_indptr = kv_indptr;
  mp.part_o = part_o;
  mp.part_lse = part_lse;
  mp.out = static_cast<__nv_bfloat16*>(out);
  mp.lse = lse;
  mp.batch = batch;
  mp.chunk = plan.chunk;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(merge_blocks(batch, plan, num_sms), 1, 1);
  cfg.blockDim = dim3(kMergeThreads, 1, 1);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  // Only overlap with our own decode kernel, never with whatever ran before it.
  cfg.numAttrs = (MLA_DECODE_PDL && plan.units > 0) ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, mla_decode_merge_kernel, mp);
}

#endif  // MLA_DECODE_EXTERNAL_PRIMITIVES

}  // namespace mla_decode
