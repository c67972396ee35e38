// Torch binding of the wgmma decode in flashmla_decode_wgmma.cu: validates the call, picks the number
// of shares from shapes only (no device read, no sync), takes the workspace (the plan's prefix sums and
// the partials of requests cut between shares) from torch's caching allocator on the current stream,
// and launches on that stream.

#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <limits>

namespace flashmla_wgmma {
int choose_parts(int blocks_per_request, int batch, int num_sms);
cudaError_t launch(const void* q, const void* k_cache, int64_t num_blocks, const int* block_table,
                   const int* cache_seqlens, int batch, int s_q, int h_q, int max_blocks, float softmax_scale,
                   void* out, float* lse, int* prefix, int4* cuts, int* num_cuts, float* part_o,
                   float* part_lse, int num_parts, cudaStream_t stream);
}  // namespace flashmla_wgmma

namespace {

constexpr int64_t kRows = 64;  // (query token, head) rows per CTA
constexpr int64_t kDimK = 576;
constexpr int64_t kDimV = 512;
constexpr int64_t kPage = 64;

// SM count per device, asked once (at most 64 devices).
int multiprocessors(int device) {
  static std::array<int, 64> known{};
  TORCH_CHECK(device >= 0 && device < 64, "device index out of range: ", device);
  if (known[device] == 0) {
    int n = 0;
    const cudaError_t err = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    TORCH_CHECK(err == cudaSuccess, "cudaDeviceGetAttribute: ", cudaGetErrorString(err));
    known[device] = n;
  }
  return known[device];
}

void expect(const torch::Tensor& t, const char* name, torch::ScalarType dtype, const torch::Device& device,
            bool aligned) {
  TORCH_CHECK(t.device() == device && t.scalar_type() == dtype && t.is_contiguous(), name, " must be a contiguous ",
              dtype, " tensor on ", device, ", got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(!aligned || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
}

}  // namespace

void run(torch::Tensor q, torch::Tensor k_cache, torch::Tensor block_table, torch::Tensor cache_seqlens,
         double softmax_scale, torch::Tensor out, torch::Tensor lse) {
  TORCH_CHECK(q.is_cuda(), "q must be a CUDA tensor");
  const torch::Device device = q.device();
  expect(q, "q", torch::kBFloat16, device, true);
  expect(k_cache, "k_cache", torch::kBFloat16, device, true);
  expect(block_table, "block_table", torch::kInt32, device, false);
  expect(cache_seqlens, "cache_seqlens", torch::kInt32, device, false);
  expect(out, "out", torch::kBFloat16, device, true);
  expect(lse, "lse", torch::kFloat32, device, false);

  TORCH_CHECK(q.dim() == 4 && q.size(3) == kDimK, "q must be [batch, s_q, h_q, 576], got ", q.sizes());
  const int64_t batch = q.size(0), s_q = q.size(1), h_q = q.size(2);
  TORCH_CHECK(h_q > 0, "h_q must be positive, got ", h_q);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(1) == kPage && k_cache.size(2) == 1 && k_cache.size(3) == kDimK,
              "k_cache must be [num_blocks, 64, 1, 576], got ", k_cache.sizes());
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == batch,
              "block_table must be [batch, max_blocks_per_seq], got ", block_table.sizes());
  TORCH_CHECK(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == batch,
              "cache_seqlens must be [batch], got ", cache_seqlens.sizes());
  TORCH_CHECK(out.sizes() == torch::IntArrayRef({batch, s_q, h_q, kDimV}),
              "out must be [batch, s_q, h_q, 512], got ", out.sizes());
  TORCH_CHECK(lse.sizes() == torch::IntArrayRef({batch, h_q, s_q}), "lse must be [batch, h_q, s_q], got ", lse.sizes());
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  const int64_t max_blocks = block_table.size(1);
  TORCH_CHECK(s_q > 0 && s_q <= kIntMax / h_q && batch <= kIntMax / (s_q * h_q),
              "batch * s_q * h_q must fit an int, got ", batch, " * ", s_q, " * ", h_q);
  TORCH_CHECK(max_blocks <= kIntMax / kPage, "block_table too wide");
  TORCH_CHECK(k_cache.size(0) <= kIntMax / kPage, "k_cache has too many blocks");
  TORCH_CHECK(max_blocks == 0 || batch <= kIntMax / max_blocks, "batch * max_blocks_per_seq (an upper bound on the "
              "batch's tiles) must fit an int");
  if (batch == 0 || k_cache.size(0) == 0) return;

  const c10::cuda::CUDAGuard guard(device);
  const int64_t blocks_per_request = (s_q * h_q + kRows - 1) / kRows;
  const int num_parts = flashmla_wgmma::choose_parts(static_cast<int>(blocks_per_request), static_cast<int>(batch),
                                                     multiprocessors(device.index()));
  // One allocation for the partials and the plan; the caching allocator keeps it stream-ordered. slots is
  // a multiple of 128, so the cut list after the partials is 16-byte aligned.
  const int64_t slots = 2 * static_cast<int64_t>(num_parts) * blocks_per_request * kRows;
  torch::Tensor workspace = torch::empty({slots * (kDimV + 1) + 4 * static_cast<int64_t>(num_parts) + 1 + batch + 1},
                                         torch::TensorOptions().dtype(torch::kFloat32).device(device));
  float* part_o = workspace.data_ptr<float>();
  float* part_lse = part_o + slots * kDimV;
  int4* cuts = reinterpret_cast<int4*>(part_lse + slots);
  int* num_cuts = reinterpret_cast<int*>(cuts + num_parts);
  int* prefix = num_cuts + 1;
  const cudaError_t err = flashmla_wgmma::launch(
      q.data_ptr(), k_cache.data_ptr(), k_cache.size(0), block_table.data_ptr<int>(), cache_seqlens.data_ptr<int>(),
      static_cast<int>(batch), static_cast<int>(s_q), static_cast<int>(h_q), static_cast<int>(max_blocks),
      static_cast<float>(softmax_scale), out.data_ptr(), lse.data_ptr<float>(), prefix, cuts, num_cuts, part_o, part_lse,
      num_parts,
      c10::cuda::getCurrentCUDAStream(device.index()).stream());
  TORCH_CHECK(err == cudaSuccess, "flashmla wgmma decode launch failed: ", cudaGetErrorString(err));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run", &run, "FlashMLA-form dense MLA decode with wgmma and TMA (bf16 cache, 64-token blocks, causal)");
}
