// Torch binding of the wgmma sparse prefill in sparse_prefill_wgmma.cu, destination-passing style: validates
// the call and launches on the current stream. `run` serves the definitions without a sink,
// `run_sink_topklen` those with attn_sink and topk_length.

#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

namespace sparse_prefill_wgmma {
cudaError_t launch(const void* q, const void* kv, const int* indices, const int* topk_length, const float* attn_sink,
                   void* out, float* max_logits, float* lse, int s_q, int h_q, int s_kv, int topk, float sm_scale,
                   cudaStream_t stream);
}  // namespace sparse_prefill_wgmma

namespace {

constexpr int64_t kRows = 64;  // heads per CTA
constexpr int64_t kDimK = 576;
constexpr int64_t kDimV = 512;
constexpr int64_t kTile = 64;
constexpr int64_t kMaxTopk = 2048;

void expect(const torch::Tensor& t, const char* name, torch::ScalarType dtype, const torch::Device& device,
            bool aligned) {
  TORCH_CHECK(t.device() == device && t.scalar_type() == dtype && t.is_contiguous(), name, " must be a contiguous ",
              dtype, " tensor on ", device, ", got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(!aligned || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
}

void prefill(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& indices, double sm_scale,
             const torch::Tensor* attn_sink, const torch::Tensor* topk_length, torch::Tensor& out,
             torch::Tensor& max_logits, torch::Tensor& lse) {
  TORCH_CHECK(q.is_cuda(), "q must be a CUDA tensor");
  const torch::Device device = q.device();
  expect(q, "q", torch::kBFloat16, device, true);
  expect(kv, "kv", torch::kBFloat16, device, true);
  expect(indices, "indices", torch::kInt32, device, true);
  expect(out, "out", torch::kBFloat16, device, true);
  expect(max_logits, "max_logits", torch::kFloat32, device, false);
  expect(lse, "lse", torch::kFloat32, device, false);
  if (attn_sink != nullptr) expect(*attn_sink, "attn_sink", torch::kFloat32, device, false);
  if (topk_length != nullptr) expect(*topk_length, "topk_length", torch::kInt32, device, false);

  TORCH_CHECK(q.dim() == 3 && q.size(2) == kDimK, "q must be [s_q, h_q, 576], got ", q.sizes());
  const int64_t s_q = q.size(0), h_q = q.size(1);
  TORCH_CHECK(h_q > 0 && h_q % kRows == 0, "h_q must be a positive multiple of 64, got ", h_q);
  TORCH_CHECK(kv.dim() == 3 && kv.size(1) == 1 && kv.size(2) == kDimK, "kv must be [s_kv, 1, 576], got ", kv.sizes());
  const int64_t s_kv = kv.size(0);
  TORCH_CHECK(indices.dim() == 3 && indices.size(0) == s_q && indices.size(1) == 1,
              "indices must be [s_q, 1, topk], got ", indices.sizes());
  const int64_t topk = indices.size(2);
  TORCH_CHECK(topk > 0 && topk <= kMaxTopk && topk % kTile == 0, "topk must be a multiple of 64 in [64, 2048], got ",
              topk);
  TORCH_CHECK(out.sizes() == torch::IntArrayRef({s_q, h_q, kDimV}), "out must be [s_q, h_q, 512], got ", out.sizes());
  TORCH_CHECK(max_logits.sizes() == torch::IntArrayRef({s_q, h_q}), "max_logits must be [s_q, h_q], got ",
              max_logits.sizes());
  TORCH_CHECK(lse.sizes() == torch::IntArrayRef({s_q, h_q}), "lse must be [s_q, h_q], got ", lse.sizes());
  if (attn_sink != nullptr) {
    TORCH_CHECK(attn_sink->dim() == 1 && attn_sink->size(0) == h_q, "attn_sink must be [h_q], got ",
                attn_sink->sizes());
  }
  if (topk_length != nullptr) {
    TORCH_CHECK(topk_length->dim() == 1 && topk_length->size(0) == s_q, "topk_length must be [s_q], got ",
                topk_length->sizes());
  }
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  TORCH_CHECK(s_q * (h_q / kRows) <= kIntMax, "s_q * h_q / 64 must fit an int");
  TORCH_CHECK(s_kv <= kIntMax, "kv has too many rows for int32 indices");
  if (s_q == 0) return;

  const c10::cuda::CUDAGuard guard(device);
  if (s_kv == 0) {
    // Every entry is invalid: the empty sums (no kernel reads an empty kv).
    out.zero_();
    max_logits.fill_(-std::numeric_limits<float>::infinity());
    lse.fill_(-std::numeric_limits<float>::infinity());
    return;
  }
  const cudaError_t err = sparse_prefill_wgmma::launch(
      q.data_ptr(), kv.data_ptr(), indices.data_ptr<int>(),
      topk_length != nullptr ? topk_length->data_ptr<int>() : nullptr,
      attn_sink != nullptr ? attn_sink->data_ptr<float>() : nullptr, out.data_ptr(), max_logits.data_ptr<float>(),
      lse.data_ptr<float>(), static_cast<int>(s_q), static_cast<int>(h_q), static_cast<int>(s_kv),
      static_cast<int>(topk), static_cast<float>(sm_scale), c10::cuda::getCurrentCUDAStream(device.index()).stream());
  TORCH_CHECK(err == cudaSuccess, "sparse prefill wgmma launch failed: ", cudaGetErrorString(err));
}

}  // namespace

void run(torch::Tensor q, torch::Tensor kv, torch::Tensor indices, double sm_scale, torch::Tensor out,
         torch::Tensor max_logits, torch::Tensor lse) {
  prefill(q, kv, indices, sm_scale, nullptr, nullptr, out, max_logits, lse);
}

void run_sink_topklen(torch::Tensor q, torch::Tensor kv, torch::Tensor indices, double sm_scale,
                      torch::Tensor attn_sink, torch::Tensor topk_length, torch::Tensor out, torch::Tensor max_logits,
                      torch::Tensor lse) {
  prefill(q, kv, indices, sm_scale, &attn_sink, &topk_length, out, max_logits, lse);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run", &run, "FlashMLA-form sparse MLA prefill with wgmma and cp.async gathers (bf16, topk <= 2048)");
  m.def("run_sink_topklen", &run_sink_topklen,
        "FlashMLA-form sparse MLA prefill with an attention sink and per-token topk lengths");
}
