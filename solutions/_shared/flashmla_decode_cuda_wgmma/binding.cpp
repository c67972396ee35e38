// Torch binding of the wgmma decode in flashmla_decode_wgmma.cu: validates the call, picks the number
// of KV splits from shapes only (no device read, no sync), takes the fp32 workspace of split rows
// from torch's caching allocator on the current stream, and launches on that stream.

#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <limits>

namespace flashmla_wgmma {
int choose_splits(int row_blocks, int max_len, int num_sms);
cudaError_t launch(const void* q, const void* k_cache, int64_t num_blocks, const int* block_table,
                   const int* cache_seqlens, int batch, int s_q, int h_q, int max_blocks, float softmax_scale,
                   void* out, float* lse, float* part_o, float* part_lse, int num_splits, cudaStream_t stream);
}  // namespace flashmla_wgmma

namespace {

constexpr int64_t kRows = 64;  // heads per CTA
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
  TORCH_CHECK(h_q > 0 && h_q % kRows == 0, "h_q must be a positive multiple of 64, got ", h_q);
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
  const int64_t row_blocks = batch * s_q * (h_q / kRows);
  const int64_t max_blocks = block_table.size(1);
  TORCH_CHECK(row_blocks <= kIntMax / kRows, "batch * s_q * h_q must fit an int, got ", row_blocks * kRows);
  TORCH_CHECK(max_blocks <= kIntMax / kPage, "block_table too wide");
  TORCH_CHECK(k_cache.size(0) <= kIntMax / kPage, "k_cache has too many blocks");
  if (row_blocks == 0 || k_cache.size(0) == 0) return;

  const c10::cuda::CUDAGuard guard(device);
  const int num_splits = flashmla_wgmma::choose_splits(static_cast<int>(row_blocks),
                                                       static_cast<int>(max_blocks * kPage),
                                                       multiprocessors(device.index()));
  // One allocation for both parts of the workspace; the caching allocator keeps it stream-ordered.
  torch::Tensor workspace;
  float* part_o = nullptr;
  float* part_lse = nullptr;
  if (num_splits > 1) {
    const int64_t rows = row_blocks * num_splits * kRows;
    workspace = torch::empty({rows * (kDimV + 1)}, torch::TensorOptions().dtype(torch::kFloat32).device(device));
    part_o = workspace.data_ptr<float>();
    part_lse = part_o + rows * kDimV;
  }
  const cudaError_t err = flashmla_wgmma::launch(
      q.data_ptr(), k_cache.data_ptr(), k_cache.size(0), block_table.data_ptr<int>(), cache_seqlens.data_ptr<int>(),
      static_cast<int>(batch), static_cast<int>(s_q), static_cast<int>(h_q), static_cast<int>(max_blocks),
      static_cast<float>(softmax_scale), out.data_ptr(), lse.data_ptr<float>(), part_o, part_lse, num_splits,
      c10::cuda::getCurrentCUDAStream(device.index()).stream());
  TORCH_CHECK(err == cudaSuccess, "flashmla wgmma decode launch failed: ", cudaGetErrorString(err));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run", &run, "FlashMLA-form dense MLA decode with wgmma and TMA (bf16 cache, 64-token blocks, causal)");
}
