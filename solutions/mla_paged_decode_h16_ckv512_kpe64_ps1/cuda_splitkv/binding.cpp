// Torch binding of the MLA paged decode in mla_decode.cu: checks the tensors, keeps the fp32
// workspace for split requests across calls, and launches on the current stream.

#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <mutex>
#include <unordered_map>

namespace mla_decode {
int workspace_slots(int batch, int total, int num_sms);
cudaError_t launch(const void* q_nope, const void* q_pe, const void* ckv, const void* kpe,
                   const int* kv_indptr, const int* kv_indices, int batch, int total, float sm_scale,
                   void* out, float* lse, float* part_o, float* part_lse, int num_sms,
                   cudaStream_t stream);
}  // namespace mla_decode

namespace {

constexpr int64_t kHeads = 16;
constexpr int64_t kDimCkv = 512;
constexpr int64_t kDimKpe = 64;

struct Workspace {
  torch::Tensor part_o;    // [slots, 16, 512] fp32
  torch::Tensor part_lse;  // [slots, 16] fp32
  int64_t slots = 0;
};

std::mutex cache_mutex;

int sm_count(int device) {
  static std::unordered_map<int, int> cache;
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  int n = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
  TORCH_CHECK(err == cudaSuccess, "cudaDeviceGetAttribute failed: ", cudaGetErrorString(err));
  cache[device] = n;
  return n;
}

// One workspace per device, grown when a call needs more rows and reused otherwise. Kernels
// using it are ordered on the caller's stream.
Workspace& workspace(const torch::Device& device, int64_t slots) {
  static std::unordered_map<int, Workspace> cache;
  std::lock_guard<std::mutex> lock(cache_mutex);
  Workspace& ws = cache[device.index()];
  if (ws.slots < slots) {
    const auto options = torch::TensorOptions().dtype(torch::kFloat32).device(device);
    ws.part_o = torch::empty({slots, kHeads, kDimCkv}, options);
    ws.part_lse = torch::empty({slots, kHeads}, options);
    ws.slots = slots;
  }
  return ws;
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

void run(torch::Tensor q_nope, torch::Tensor q_pe, torch::Tensor ckv_cache, torch::Tensor kpe_cache,
         torch::Tensor kv_indptr, torch::Tensor kv_indices, double sm_scale, torch::Tensor output,
         torch::Tensor lse) {
  TORCH_CHECK(q_nope.is_cuda(), "q_nope must be a CUDA tensor");
  const torch::Device device = q_nope.device();
  check_tensor(q_nope, "q_nope", torch::kBFloat16, device);
  check_tensor(q_pe, "q_pe", torch::kBFloat16, device);
  check_tensor(ckv_cache, "ckv_cache", torch::kBFloat16, device);
  check_tensor(kpe_cache, "kpe_cache", torch::kBFloat16, device);
  check_tensor(kv_indptr, "kv_indptr", torch::kInt32, device);
  check_tensor(kv_indices, "kv_indices", torch::kInt32, device);
  check_tensor(output, "output", torch::kBFloat16, device);
  check_tensor(lse, "lse", torch::kFloat32, device);

  TORCH_CHECK(q_nope.dim() == 3 && q_nope.size(1) == kHeads && q_nope.size(2) == kDimCkv,
              "q_nope must be [batch, 16, 512], got ", q_nope.sizes());
  const int64_t batch = q_nope.size(0);
  TORCH_CHECK(q_pe.dim() == 3 && q_pe.size(0) == batch && q_pe.size(1) == kHeads && q_pe.size(2) == kDimKpe,
              "q_pe must be [batch, 16, 64], got ", q_pe.sizes());
  TORCH_CHECK(ckv_cache.dim() == 3 && ckv_cache.size(1) == 1 && ckv_cache.size(2) == kDimCkv,
              "ckv_cache must be [num_pages, 1, 512], got ", ckv_cache.sizes());
  TORCH_CHECK(kpe_cache.dim() == 3 && kpe_cache.size(0) == ckv_cache.size(0) && kpe_cache.size(1) == 1 &&
                  kpe_cache.size(2) == kDimKpe,
              "kpe_cache must be [num_pages, 1, 64], got ", kpe_cache.sizes());
  TORCH_CHECK(kv_indptr.dim() == 1 && kv_indptr.size(0) == batch + 1,
              "kv_indptr must be [batch + 1], got ", kv_indptr.sizes());
  TORCH_CHECK(kv_indices.dim() == 1, "kv_indices must be 1-D, got ", kv_indices.sizes());
  TORCH_CHECK(output.sizes() == q_nope.sizes(), "output must be [batch, 16, 512], got ", output.sizes());
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == batch && lse.size(1) == kHeads,
              "lse must be [batch, 16], got ", lse.sizes());
  // kv_indices holds exactly kv_indptr[-1] entries (the definition's constraint), which lets the
  // work partition be sized without reading device memory.
  const int64_t total = kv_indices.size(0);
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  TORCH_CHECK(batch < kIntMax / 2 && total < kIntMax / 2, "batch or number of KV tokens too large");
  check_aligned(q_nope, "q_nope");
  check_aligned(q_pe, "q_pe");
  check_aligned(ckv_cache, "ckv_cache");
  check_aligned(kpe_cache, "kpe_cache");
  check_aligned(output, "output");
  if (batch == 0) return;

  const c10::cuda::CUDAGuard guard(device);
  const int num_sms = sm_count(device.index());
  const int64_t slots = mla_decode::workspace_slots(static_cast<int>(batch), static_cast<int>(total), num_sms);
  Workspace& ws = workspace(device, slots);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();

  const cudaError_t err = mla_decode::launch(
      q_nope.data_ptr(), q_pe.data_ptr(), ckv_cache.data_ptr(), kpe_cache.data_ptr(),
      kv_indptr.data_ptr<int>(), kv_indices.data_ptr<int>(), static_cast<int>(batch), static_cast<int>(total),
      static_cast<float>(sm_scale), output.data_ptr(), lse.data_ptr<float>(), ws.part_o.data_ptr<float>(),
      ws.part_lse.data_ptr<float>(), num_sms, stream);
  TORCH_CHECK(err == cudaSuccess, "mla decode launch failed: ", cudaGetErrorString(err));
  const cudaError_t last = cudaGetLastError();
  TORCH_CHECK(last == cudaSuccess, "mla decode kernel error: ", cudaGetErrorString(last));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run", &run, "MLA paged decode (16 heads, ckv 512, kpe 64, page size 1) into output and lse");
}
