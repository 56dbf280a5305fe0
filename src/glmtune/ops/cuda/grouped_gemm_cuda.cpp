// Grouped expert GEMMs (ops/cuda/grouped_gemm.h): cublasGemmGroupedBatchedEx or one cuBLASLt GEMM
// per group. Plain C++: the libraries are called from the host only.

#include <cublas_v2.h>

#include <map>
#include <mutex>

#include "glmtune/ops/cuda/cublas_check.h"
#include "glmtune/ops/cuda/gemm.h"
#include "glmtune/ops/cuda/grouped_gemm.h"
#include "glmtune/tensor/cuda_check.h"

namespace glmtune::cuda {
namespace {

// One cuBLAS handle per device for the process (never destroyed, like the cuBLASLt handles of
// gemm_cuda.cpp). The mutex also serialises the stream switch and the call on the shared handle.
struct CublasState {
  std::mutex mu;
  std::map<int, cublasHandle_t> handles;
};

CublasState& cublas_state() {
  static CublasState* state = new CublasState();
  return *state;
}

// The device's handle, created on first use; called with the state's mutex held.
cublasHandle_t handle_locked(CublasState& s, int device) {
  auto it = s.handles.find(device);
  if (it == s.handles.end()) {
    cublasHandle_t h = nullptr;
    GLMTUNE_CUBLAS_CHECK(cublasCreate(&h));
    it = s.handles.emplace(device, h).first;
  }
  return it->second;
}

std::string describe(const Tensor& t) { return t.defined() ? t.str() : std::string("undefined"); }

// Rows of a row operand: a contiguous CUDA bf16 (or, in the fp32 mode, f32) tensor viewed as
// [rows, cols].
struct Rows {
  const void* data = nullptr;
  int64_t rows = 0, cols = 0;
};

Rows rows_of(const Tensor& t, const char* what, const char* op) {
  GLMTUNE_ASSERT(t.defined() && t.device().is_cuda() && t.is_contiguous() && t.dim() >= 1 &&
                     (t.dtype() == DType::bf16 || t.dtype() == DType::f32),
                 "{}: {} must be a contiguous bf16 or f32 CUDA tensor, got {}", op, what,
                 describe(t));
  Rows r;
  r.data = t.data_ptr();
  r.cols = t.size(-1);
  r.rows = r.cols > 0 ? t.numel() / r.cols : 0;
  return r;
}

void check_offsets(const std::vector<int64_t>& offsets, int64_t groups, int64_t rows,
                   const char* op) {
  GLMTUNE_ASSERT(
      int64_t(offsets.size()) == groups + 1 && offsets.front() == 0 && offsets.back() == rows,
      "{}: offsets must hold {} entries from 0 to {} rows", op, groups + 1, rows);
  for (size_t g = 0; g + 1 < offsets.size(); ++g)
    GLMTUNE_ASSERT(offsets[g] <= offsets[g + 1], "{}: offsets decrease at group {}", op, g);
}

// One grouped problem in cuBLAS's column-major terms (see gemm_cuda.cpp for the row/column-major
// swap): C'[m', n'] = op(A')[m', k'] · op(B')[k', n'] per group.
struct ColumnMajorProblem {
  cublasOperation_t op_a = CUBLAS_OP_N, op_b = CUBLAS_OP_N;
  int m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0;
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;
};

void run_cublas_grouped(int device, const std::vector<ColumnMajorProblem>& problems, float beta,
                        cudaStream_t stream) {
  if (problems.empty()) return;
  const size_t g = problems.size();
  std::vector<cublasOperation_t> op_a(g), op_b(g);
  std::vector<int> m(g), n(g), k(g), lda(g), ldb(g), ldc(g), group_size(g, 1);
  std::vector<float> alpha(g, 1.0f), betas(g, beta);
  // A, B and C pointer arrays live on the device; one upload for all three.
  std::vector<const void*> ptrs(3 * g);
  for (size_t i = 0; i < g; ++i) {
    const ColumnMajorProblem& p = problems[i];
    op_a[i] = p.op_a;
    op_b[i] = p.op_b;
    m[i] = p.m;
    n[i] = p.n;
    k[i] = p.k;
    lda[i] = p.lda;
    ldb[i] = p.ldb;
    ldc[i] = p.ldc;
    ptrs[i] = p.a;
    ptrs[g + i] = p.b;
    ptrs[2 * g + i] = p.c;
  }
  Tensor dev_ptrs = Tensor::empty({int64_t(3 * g)}, DType::i64, Device::cuda(device));
  // From pageable memory the copy is staged before the call returns, so `ptrs` may go.
  GLMTUNE_CUDA_CHECK(cudaMemcpyAsync(dev_ptrs.data_ptr(), ptrs.data(), ptrs.size() * sizeof(void*),
                                     cudaMemcpyHostToDevice, stream));
  auto* dp = static_cast<const void**>(dev_ptrs.data_ptr());
  CublasState& s = cublas_state();
  std::lock_guard lock(s.mu);
  cublasHandle_t handle = handle_locked(s, device);
  GLMTUNE_CUBLAS_CHECK(cublasSetStream(handle, stream));
  GLMTUNE_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(
      handle, op_a.data(), op_b.data(), m.data(), n.data(), k.data(), alpha.data(), dp, CUDA_R_16BF,
      lda.data(), dp + g, CUDA_R_16BF, ldb.data(), betas.data(), const_cast<void**>(dp + 2 * g),
      CUDA_R_16BF, ldc.data(), int(g), group_size.data(), CUBLAS_COMPUTE_32F));
}

bool fits_int(int64_t v) { return v >= 0 && v <= int64_t(INT32_MAX); }

enum class Kind { kForward, kBackwardInput, kBackwardWeight };

// `rows_op` is the segmented row operand that defines the groups' row counts (x, dy or dy), `w`
// the per-group matrices, `out` the result. Shapes are checked by the callers.
void run(Kind kind, Tensor& out, const Tensor& first, const Tensor& second,
         const std::vector<int64_t>& offsets, GroupedGemmBackend backend, cudaStream_t stream,
         bool accumulate = false) {
  // The weight gradient always accumulates.
  const float beta = kind == Kind::kBackwardWeight || accumulate ? 1.0f : 0.0f;
  const int device = out.device().index;
  const DType operands = first.dtype();
  const int64_t elem = int64_t(dtype_size(operands));
  // The grouped cuBLAS call is set up for bf16 operands and results only; the device-offset
  // kernels have their own entry points.
  if (operands == DType::f32 || (kind == Kind::kBackwardWeight && out.dtype() == DType::f32) ||
      backend == GroupedGemmBackend::kWgmmaDeviceOffsets)
    backend = GroupedGemmBackend::kLtPerGroup;
  std::vector<ColumnMajorProblem> problems;
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    const int64_t r0 = offsets[g], rows = offsets[g + 1] - r0;
    if (rows == 0) continue;
    GemmArgs a;
    a.device = device;
    a.ab_dtype = operands;
    a.c_dtype = out.dtype();
    ColumnMajorProblem p;
    if (kind == Kind::kForward) {
      // y_g = x_g · w[g]^T: first = x [rows, K], second = w [G, N, K].
      const int64_t kdim = first.size(-1), ndim = second.size(1);
      const char* xg = static_cast<const char*>(first.data_ptr()) + r0 * kdim * elem;
      const char* wg =
          static_cast<const char*>(second.data_ptr()) + int64_t(g) * ndim * kdim * elem;
      char* yg = static_cast<char*>(out.data_ptr()) + r0 * ndim * elem;
      a.trans_b = true;
      a.m = rows, a.n = ndim, a.k = kdim;
      a.a = xg, a.lda = kdim, a.b = wg, a.ldb = kdim, a.c = yg, a.ldc = ndim;
      a.beta = beta;
      p.op_a = CUBLAS_OP_T, p.op_b = CUBLAS_OP_N;
      p.m = int(ndim), p.n = int(rows), p.k = int(kdim);
      p.a = wg, p.lda = int(kdim), p.b = xg, p.ldb = int(kdim), p.c = yg, p.ldc = int(ndim);
    } else if (kind == Kind::kBackwardInput) {
      // dx_g = dy_g · w[g]: first = dy [rows, N], second = w [G, N, K].
      const int64_t ndim = first.size(-1), kdim = second.size(2);
      const char* dyg = static_cast<const char*>(first.data_ptr()) + r0 * ndim * elem;
      const char* wg =
          static_cast<const char*>(second.data_ptr()) + int64_t(g) * ndim * kdim * elem;
      char* dxg = static_cast<char*>(out.data_ptr()) + r0 * kdim * elem;
      a.m = rows, a.n = kdim, a.k = ndim;
      a.a = dyg, a.lda = ndim, a.b = wg, a.ldb = kdim, a.c = dxg, a.ldc = kdim;
      a.beta = beta;
      p.op_a = CUBLAS_OP_N, p.op_b = CUBLAS_OP_N;
      p.m = int(kdim), p.n = int(rows), p.k = int(ndim);
      p.a = wg, p.lda = int(kdim), p.b = dyg, p.ldb = int(ndim), p.c = dxg, p.ldc = int(kdim);
    } else {
      // dw[g] += dy_g^T · x_g: first = dy [rows, N], second = x [rows, K], out [G, N, K].
      const int64_t ndim = first.size(-1), kdim = second.size(-1);
      const char* dyg = static_cast<const char*>(first.data_ptr()) + r0 * ndim * elem;
      const char* xg = static_cast<const char*>(second.data_ptr()) + r0 * kdim * elem;
      char* dwg = static_cast<char*>(out.data_ptr()) +
                  int64_t(g) * ndim * kdim * int64_t(dtype_size(out.dtype()));
      a.trans_a = true;
      a.m = ndim, a.n = kdim, a.k = rows;
      a.a = dyg, a.lda = ndim, a.b = xg, a.ldb = kdim, a.c = dwg, a.ldc = kdim;
      a.beta = beta;
      p.op_a = CUBLAS_OP_N, p.op_b = CUBLAS_OP_T;
      p.m = int(kdim), p.n = int(ndim), p.k = int(rows);
      p.a = xg, p.lda = int(kdim), p.b = dyg, p.ldb = int(ndim), p.c = dwg, p.ldc = int(kdim);
    }
    if (backend == GroupedGemmBackend::kLtPerGroup) {
      gemm(a, stream);
    } else {
      GLMTUNE_ASSERT(fits_int(a.m) && fits_int(a.n) && fits_int(a.k),
                     "grouped GEMM problem {}x{}x{} exceeds 32-bit sizes", a.m, a.n, a.k);
      problems.push_back(p);
    }
  }
  if (backend == GroupedGemmBackend::kCublasGrouped)
    run_cublas_grouped(device, problems, beta, stream);
}

void check_out(const Tensor& out, const Shape& shape, const Tensor& like, const char* op) {
  GLMTUNE_ASSERT(out.defined() && out.device() == like.device() && out.is_contiguous() &&
                     out.shape() == shape && out.dtype() == like.dtype(),
                 "{}: output {} must be a contiguous {} tensor {} on {}", op, describe(out),
                 dtype_name(like.dtype()), shape_str(shape), like.device().str());
}

}  // namespace

const char* grouped_gemm_backend_name(GroupedGemmBackend backend) {
  switch (backend) {
    case GroupedGemmBackend::kCublasGrouped:
      return "cublasGemmGroupedBatchedEx";
    case GroupedGemmBackend::kLtPerGroup:
      return "cuBLASLt per group";
    case GroupedGemmBackend::kWgmmaDeviceOffsets:
      return "wgmma, device offsets";
  }
  return "unknown";
}

void grouped_linear(Tensor& y, const Tensor& x, const Tensor& w,
                    const std::vector<int64_t>& offsets, GroupedGemmBackend backend,
                    cudaStream_t stream, bool accumulate) {
  const char* op = "cuda::grouped_linear";
  const Rows xr = rows_of(x, "x", op);
  GLMTUNE_ASSERT(w.defined() && w.dim() == 3 && w.is_contiguous() && w.dtype() == x.dtype() &&
                     w.device() == x.device() && w.size(2) == xr.cols,
                 "{}: w {} must be contiguous {} [G, N, {}] on {}", op, describe(w),
                 dtype_name(x.dtype()), xr.cols, x.device().str());
  check_offsets(offsets, w.size(0), xr.rows, op);
  check_out(y, {xr.rows, w.size(1)}, x, op);
  run(Kind::kForward, y, x, w, offsets, backend, stream, accumulate);
}

void grouped_linear_backward_input(Tensor& dx, const Tensor& dy, const Tensor& w,
                                   const std::vector<int64_t>& offsets, GroupedGemmBackend backend,
                                   cudaStream_t stream, bool accumulate) {
  const char* op = "cuda::grouped_linear_backward_input";
  const Rows dr = rows_of(dy, "dy", op);
  GLMTUNE_ASSERT(w.defined() && w.dim() == 3 && w.is_contiguous() && w.dtype() == dy.dtype() &&
                     w.device() == dy.device() && w.size(1) == dr.cols,
                 "{}: w {} must be contiguous {} [G, {}, K] on {}", op, describe(w),
                 dtype_name(dy.dtype()), dr.cols, dy.device().str());
  check_offsets(offsets, w.size(0), dr.rows, op);
  check_out(dx, {dr.rows, w.size(2)}, dy, op);
  run(Kind::kBackwardInput, dx, dy, w, offsets, backend, stream, accumulate);
}

void grouped_linear_backward_weight(Tensor& dw, const Tensor& dy, const Tensor& x,
                                    const std::vector<int64_t>& offsets, GroupedGemmBackend backend,
                                    cudaStream_t stream) {
  const char* op = "cuda::grouped_linear_backward_weight";
  const Rows dr = rows_of(dy, "dy", op);
  const Rows xr = rows_of(x, "x", op);
  GLMTUNE_ASSERT(dr.rows == xr.rows && x.device() == dy.device() && x.dtype() == dy.dtype(),
                 "{}: dy {} and x {} must have the same rows and dtype on one device", op, dy.str(),
                 x.str());
  GLMTUNE_ASSERT(dw.defined() && dw.dim() == 3 && dw.is_contiguous() &&
                     dw.device() == dy.device() && dw.size(1) == dr.cols && dw.size(2) == xr.cols &&
                     (dw.dtype() == DType::f32 || dw.dtype() == DType::bf16),
                 "{}: dw {} must be a contiguous f32/bf16 [G, {}, {}] on {}", op, describe(dw),
                 dr.cols, xr.cols, dy.device().str());
  check_offsets(offsets, dw.size(0), dr.rows, op);
  run(Kind::kBackwardWeight, dw, dy, x, offsets, backend, stream);
}

void gemm_f32_nt(int device, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                 int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
                 cudaStream_t stream, bool tf32_operands) {
  if (m == 0 || n == 0) return;
  GLMTUNE_ASSERT(fits_int(m) && fits_int(n) && fits_int(k) && fits_int(lda) && fits_int(ldb) &&
                     fits_int(ldc) && k > 0,
                 "gemm_f32_nt: problem {}x{}x{} outside 32-bit sizes", m, n, k);
  const float beta = 0.0f;
  CublasState& s = cublas_state();
  std::lock_guard lock(s.mu);
  cublasHandle_t handle = handle_locked(s, device);
  GLMTUNE_CUBLAS_CHECK(cublasSetStream(handle, stream));
  // Column-major C^T[n, m] = B[n, k] · A^T[k, m]: B as stored is column-major [k, n], hence op T.
  GLMTUNE_CUBLAS_CHECK(cublasGemmEx(
      handle, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(m), int(k), &alpha, b, CUDA_R_32F, int(ldb), a,
      CUDA_R_32F, int(lda), &beta, c, CUDA_R_32F, int(ldc),
      tf32_operands ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace glmtune::cuda
