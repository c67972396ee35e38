// Torch binding of the wgmma causal MLA prefill in paged_prefill_wgmma.cu: validates the call (shapes,
// dtypes, layout; nothing read from the device, no sync) and launches on the current stream, writing
// into the given output and lse (destination-passing style, arguments in the definition's order).

#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

namespace mla_prefill_wgmma {
cudaError_t launch(const void* q_nope, const void* q_pe, const void* ckv, const void* kpe, const int* qo_indptr,
                   const int* kv_indptr, const int* kv_indices, int batch, int64_t total_q, float sm_scale, void* out,
                   float* lse, cudaStream_t stream);
}  // namespace mla_prefill_wgmma

namespace {

constexpr int64_t kHeads = 16;
constexpr int64_t kDimCkv = 512;
constexpr int64_t kDimKpe = 64;

void expect(const torch::Tensor& t, const char* name, torch::ScalarType dtype, const torch::Device& device,
            bool aligned) {
  TORCH_CHECK(t.device() == device && t.scalar_type() == dtype && t.is_contiguous(), name, " must be a contiguous ",
              dtype, " tensor on ", device, ", got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(!aligned || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
}

}  // namespace

void run(torch::Tensor q_nope, torch::Tensor q_pe, torch::Tensor ckv_cache, torch::Tensor kpe_cache,
         torch::Tensor qo_indptr, torch::Tensor kv_indptr, torch::Tensor kv_indices, double sm_scale,
         torch::Tensor output, torch::Tensor lse) {
  TORCH_CHECK(q_nope.is_cuda(), "q_nope must be a CUDA tensor");
  const torch::Device device = q_nope.device();
  expect(q_nope, "q_nope", torch::kBFloat16, device, true);
  expect(q_pe, "q_pe", torch::kBFloat16, device, true);
  expect(ckv_cache, "ckv_cache", torch::kBFloat16, device, true);
  expect(kpe_cache, "kpe_cache", torch::kBFloat16, device, true);
  expect(qo_indptr, "qo_indptr", torch::kInt32, device, false);
  expect(kv_indptr, "kv_indptr", torch::kInt32, device, false);
  expect(kv_indices, "kv_indices", torch::kInt32, device, false);
  expect(output, "output", torch::kBFloat16, device, true);
  expect(lse, "lse", torch::kFloat32, device, false);

  TORCH_CHECK(q_nope.dim() == 3 && q_nope.size(1) == kHeads && q_nope.size(2) == kDimCkv,
              "q_nope must be [total_q, 16, 512], got ", q_nope.sizes());
  const int64_t total_q = q_nope.size(0);
  TORCH_CHECK(q_pe.sizes() == torch::IntArrayRef({total_q, kHeads, kDimKpe}), "q_pe must be [total_q, 16, 64], got ",
              q_pe.sizes());
  TORCH_CHECK(ckv_cache.dim() == 3 && ckv_cache.size(1) == 1 && ckv_cache.size(2) == kDimCkv,
              "ckv_cache must be [num_pages, 1, 512], got ", ckv_cache.sizes());
  const int64_t num_pages = ckv_cache.size(0);
  TORCH_CHECK(kpe_cache.sizes() == torch::IntArrayRef({num_pages, 1, kDimKpe}),
              "kpe_cache must be [num_pages, 1, 64], got ", kpe_cache.sizes());
  TORCH_CHECK(qo_indptr.dim() == 1 && qo_indptr.size(0) >= 1, "qo_indptr must be [batch + 1], got ", qo_indptr.sizes());
  TORCH_CHECK(kv_indptr.sizes() == qo_indptr.sizes(), "kv_indptr must be [batch + 1] like qo_indptr, got ",
              kv_indptr.sizes());
  TORCH_CHECK(kv_indices.dim() == 1, "kv_indices must be one-dimensional, got ", kv_indices.sizes());
  TORCH_CHECK(output.sizes() == q_nope.sizes(), "output must be [total_q, 16, 512], got ", output.sizes());
  TORCH_CHECK(lse.sizes() == torch::IntArrayRef({total_q, kHeads}), "lse must be [total_q, 16], got ", lse.sizes());
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  const int64_t batch = qo_indptr.size(0) - 1;
  // Block slots, (total_q + 3 batch) / 4, must fit the grid (and an int).
  TORCH_CHECK(batch <= kIntMax / 4 && total_q <= kIntMax, "too many requests or query tokens: ", batch, ", ", total_q);
  if (batch == 0 || total_q == 0) return;

  const c10::cuda::CUDAGuard guard(device);
  const cudaError_t err = mla_prefill_wgmma::launch(
      q_nope.data_ptr(), q_pe.data_ptr(), ckv_cache.data_ptr(), kpe_cache.data_ptr(), qo_indptr.data_ptr<int>(),
      kv_indptr.data_ptr<int>(), kv_indices.data_ptr<int>(), static_cast<int>(batch), total_q,
      static_cast<float>(sm_scale), output.data_ptr(), lse.data_ptr<float>(),
      c10::cuda::getCurrentCUDAStream(device.index()).stream());
  TORCH_CHECK(err == cudaSuccess, "mla paged prefill wgmma launch failed: ", cudaGetErrorString(err));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run", &run, "Causal MLA paged prefill (page size 1, 16 heads) with wgmma and cp.async gathers");
}
