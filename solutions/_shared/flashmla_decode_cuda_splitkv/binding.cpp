// Torch binding of the FlashMLA-form decode in flashmla_decode.cu: checks the tensors, picks the
// number of KV splits from shapes only (no device read, no sync), allocates the fp32 workspace for
// split rows from torch's caching allocator on the current stream, and launches on that stream.

#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <mutex>
#include <unordered_map>

namespace flashmla_decode {
int choose_splits(int rows, int max_len, int num_sms);
cudaError_t launch(const void* q, const void* k_cache, const int* block_table, const int* cache_seqlens,
                   int batch, int s_q, int h_q, int max_blocks, float softmax_scale, void* out, float* lse,
                   float* part_o, float* part_lse, int num_splits, cudaStream_t stream);
}  // namespace flashmla_decode

namespace {

constexpr int64_t kHeadsPerCta = 16;
constexpr int64_t kDimK = 576;
constexpr int64_t kDimV = 512;
constexpr int64_t kPageSize = 64;

int sm_count(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, int> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  int n = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
  TORCH_CHECK(err == cudaSuccess, "cudaDeviceGetAttribute failed: ", cudaGetErrorString(err));
  cache[device] = n;
  return n;
}

void check_tensor(const torch::Tensor& t, const char* name, torch::ScalarType dtype,
                  const torch::Device& device) {
  TORCH_CHECK(t.device() == device, name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_aligned(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
}

}  // namespace

void run(torch::Tensor q, torch::Tensor k_cache, torch::Tensor block_table, torch::Tensor cache_seqlens,
         double softmax_scale, torch::Tensor out, torch::Tensor lse) {
  TORCH_CHECK(q.is_cuda(), "q must be a CUDA tensor");
  const torch::Device device = q.device();
  check_tensor(q, "q", torch::kBFloat16, device);
  check_tensor(k_cache, "k_cache", torch::kBFloat16, device);
  check_tensor(block_table, "block_table", torch::kInt32, device);
  check_tensor(cache_seqlens, "cache_seqlens", torch::kInt32, device);
  check_tensor(out, "out", torch::kBFloat16, device);
  check_tensor(lse, "lse", torch::kFloat32, device);

  TORCH_CHECK(q.dim() == 4 && q.size(3) == kDimK, "q must be [batch, s_q, h_q, 576], got ", q.sizes());
  const int64_t batch = q.size(0);
  const int64_t s_q = q.size(1);
  const int64_t h_q = q.size(2);
  TORCH_CHECK(h_q > 0 && h_q % kHeadsPerCta == 0, "h_q must be a positive multiple of 16, got ", h_q);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(1) == kPageSize && k_cache.size(2) == 1 && k_cache.size(3) == kDimK,
              "k_cache must be [num_blocks, 64, 1, 576], got ", k_cache.sizes());
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == batch,
              "block_table must be [batch, max_blocks_per_seq], got ", block_table.sizes());
  TORCH_CHECK(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == batch,
              "cache_seqlens must be [batch], got ", cache_seqlens.sizes());
  TORCH_CHECK(out.dim() == 4 && out.size(0) == batch && out.size(1) == s_q && out.size(2) == h_q &&
                  out.size(3) == kDimV,
              "out must be [batch, s_q, h_q, 512], got ", out.sizes());
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == batch && lse.size(1) == h_q && lse.size(2) == s_q,
              "lse must be [batch, h_q, s_q], got ", lse.sizes());
  const int64_t rows = batch * s_q * (h_q / kHeadsPerCta);
  const int64_t max_blocks = block_table.size(1);
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  TORCH_CHECK(rows <= kIntMax, "batch * s_q * h_q / 16 must fit an int, got ", rows);
  TORCH_CHECK(max_blocks <= kIntMax / kPageSize, "block_table too wide");
  check_aligned(q, "q");
  check_aligned(k_cache, "k_cache");
  check_aligned(out, "out");
  if (rows == 0) return;

  const c10::cuda::CUDAGuard guard(device);
  const int num_splits = flashmla_decode::choose_splits(static_cast<int>(rows), static_cast<int>(max_blocks * kPageSize),
                                                        sm_count(device.index()));
  // One allocation for both parts of the workspace; the caching allocator keeps it stream-ordered.
  torch::Tensor workspace;
  float* part_o = nullptr;
  float* part_lse = nullptr;
  if (num_splits > 1) {
    const int64_t slots = rows * num_splits * kHeadsPerCta;
    workspace = torch::empty({slots * (kDimV + 1)}, torch::TensorOptions().dtype(torch::kFloat32).device(device));
    part_o = workspace.data_ptr<float>();
    part_lse = part_o + slots * kDimV;
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();

  const cudaError_t err = flashmla_decode::launch(
      q.data_ptr(), k_cache.data_ptr(), block_table.data_ptr<int>(), cache_seqlens.data_ptr<int>(),
      static_cast<int>(batch), static_cast<int>(s_q), static_cast<int>(h_q), static_cast<int>(max_blocks),
      static_cast<float>(softmax_scale), out.data_ptr(), lse.data_ptr<float>(), part_o, part_lse, num_splits, stream);
  TORCH_CHECK(err == cudaSuccess, "flashmla decode launch failed: ", cudaGetErrorString(err));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run", &run, "FlashMLA-form dense MLA decode (bf16 cache, 64-token blocks, causal) into out and lse");
}
