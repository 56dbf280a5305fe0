// The cuBLASLt pieces every GEMM path shares (ops/cuda/cublaslt.h).

#include <map>
#include <mutex>
#include <utility>

#include "glmtune/ops/cuda/cublas_check.h"
#include "glmtune/ops/cuda/cublaslt.h"
#include "glmtune/tensor/allocator.h"

namespace glmtune::cuda::lt {
namespace {

struct Shared {
  std::mutex mu;
  std::map<int, cublasLtHandle_t> handles;
  std::map<std::pair<int, cudaStream_t>, void*> workspaces;
};

Shared& shared() {
  static Shared* state = new Shared();  // never destroyed (cublaslt.h says why)
  return *state;
}

}  // namespace

cublasLtHandle_t handle(int device) {
  Shared& s = shared();
  std::lock_guard lock(s.mu);
  auto it = s.handles.find(device);
  if (it != s.handles.end()) return it->second;
  cublasLtHandle_t h = nullptr;
  GLMTUNE_CUBLAS_CHECK(cublasLtCreate(&h));
  s.handles.emplace(device, h);
  return h;
}

void* workspace(int device, cudaStream_t stream) {
  Shared& s = shared();
  std::lock_guard lock(s.mu);
  const auto key = std::make_pair(device, stream);
  auto it = s.workspaces.find(key);
  if (it != s.workspaces.end()) return it->second;
  void* ws = cuda_allocator(device).allocate(kWorkspaceBytes);
  s.workspaces.emplace(key, ws);
  return ws;
}

uint32_t alignment_of(const void* p, int64_t ld, size_t element) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(p) | uintptr_t(ld) * element;
  uint32_t a = 256;
  while (a > 1 && (v & (a - 1)) != 0) a >>= 1;
  return a;
}

cublasLtMatmulPreference_t preference(uint32_t align_a, uint32_t align_b, uint32_t align_c,
                                      uint32_t align_d) {
  cublasLtMatmulPreference_t pref = nullptr;
  GLMTUNE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws_bytes = kWorkspaceBytes;
  GLMTUNE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> alignments[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d}};
  for (const auto& [attribute, bytes] : alignments)
    GLMTUNE_CUBLAS_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, attribute, &bytes, sizeof(bytes)));
  return pref;
}

}  // namespace glmtune::cuda::lt
