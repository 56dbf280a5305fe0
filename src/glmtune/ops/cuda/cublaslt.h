#pragma once
// What the dense GEMMs (gemm_cuda.cpp) and the block-scaled FP8 GEMMs (fp8_cuda.cpp) share of
// cuBLASLt: a call's descriptors, one handle per device, one workspace per (device, stream), the
// alignment a matrix lets an algorithm assume, and the heuristic preference built from those
// alignments. Host code only.

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

namespace glmtune::cuda::lt {

// The descriptors of one call, destroyed with it.
struct Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;  // cuBLASLt's A, B and D (= C)
  cublasLtMatmulPreference_t pref = nullptr;
  Descriptors() = default;
  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;
  ~Descriptors() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// NVIDIA's recommendation for Hopper; larger workspaces only help split-K shapes we do not have.
inline constexpr size_t kWorkspaceBytes = size_t(32) << 20;

// The handle of `device`, created on first use. Handles and workspaces are never destroyed: they
// must outlive every static object that might still run a GEMM during shutdown, and the driver
// reclaims them at exit. Thread-safe.
cublasLtHandle_t handle(int device);

// kWorkspaceBytes of `device` memory for the GEMMs queued on `stream` (stream order keeps the
// GEMMs that share it apart), allocated on first use. Thread-safe.
void* workspace(int device, cudaStream_t stream);

// Largest power of two (at most 256, cuBLASLt's default assumption) dividing the start of every
// row: the base address and the row pitch in bytes.
uint32_t alignment_of(const void* p, int64_t ld, size_t element);

// A new heuristic preference (the caller destroys it): at most kWorkspaceBytes of workspace, and
// the byte alignments of A, B, C and D.
cublasLtMatmulPreference_t preference(uint32_t align_a, uint32_t align_b, uint32_t align_c,
                                      uint32_t align_d);

// The algorithm each GEMM shape (Key: whatever decides cuBLASLt's choice) was given, chosen once
// by the heuristic and kept for the process. Thread-safe.
template <typename Key>
class AlgoCache {
 public:
  // The algorithm kept for `key`, or the one `choose()` returns (a heuristic query), kept.
  template <typename Choose>
  cublasLtMatmulAlgo_t get(const Key& key, Choose&& choose) {
    std::lock_guard lock(mu_);
    const auto it = algos_.find(key);
    if (it != algos_.end()) return it->second;
    const cublasLtMatmulAlgo_t algo = choose();
    ++queries_;
    algos_.emplace(key, algo);
    return algo;
  }
  // How many heuristic queries were made.
  int64_t queries() {
    std::lock_guard lock(mu_);
    return queries_;
  }

 private:
  std::mutex mu_;
  std::map<Key, cublasLtMatmulAlgo_t> algos_;
  int64_t queries_ = 0;
};

}  // namespace glmtune::cuda::lt
