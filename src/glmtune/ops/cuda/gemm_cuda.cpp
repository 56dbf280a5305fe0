// cuBLASLt GEMMs (ops/cuda/gemm.h). Plain C++: the library is called from the host only.

#include <cublasLt.h>

#include <algorithm>
#include <climits>
#include <compare>
#include <map>
#include <mutex>
#include <numeric>
#include <tuple>
#include <utility>

#include "glmtune/ops/cuda/cublas_check.h"
#include "glmtune/ops/cuda/cublaslt.h"
#include "glmtune/ops/cuda/gemm.h"
#include "glmtune/tensor/allocator.h"
#include "glmtune/tensor/cuda_check.h"

namespace glmtune {

void throw_cublas_error(cublasStatus_t status, const char* expr, const char* file, int line) {
  const bool no_gpu =
      status == CUBLAS_STATUS_NOT_INITIALIZED || status == CUBLAS_STATUS_ARCH_MISMATCH;
  throw_call_error("cuBLAS", expr, cublasLtGetStatusString(status), cublasLtGetStatusName(status),
                   file, line,
                   no_gpu ? "check that a GPU is visible (nvidia-smi) and that the CUDA 13 cuBLAS "
                            "libraries are on LD_LIBRARY_PATH"
                          : "");
}

namespace cuda {
namespace {

// What the algorithm depends on: the problem without its operands' addresses and scalars, and
// the operands' alignments (cuBLASLt's order: our B, our A, then C).
auto algo_key(const GemmArgs& g, uint32_t align_b, uint32_t align_a, uint32_t align_c) {
  return std::tuple(g.device, g.trans_a, g.trans_b, g.m, g.n, g.k, g.lda, g.ldb, g.ldc, g.c_dtype,
                    g.ab_dtype, g.bias != nullptr, g.batch, g.stride_a, g.stride_b, g.stride_c,
                    align_b, align_a, align_c);
}
using AlgoKey = decltype(algo_key(GemmArgs{}, 0, 0, 0));

// Never destroyed (as lt::handle's handles).
lt::AlgoCache<AlgoKey>& algo_cache() {
  static auto* cache = new lt::AlgoCache<AlgoKey>();
  return *cache;
}

// Called with the state's mutex held and the device current.
cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::bf16:
      return CUDA_R_16BF;
    default:
      break;
  }
  throw_internal(__FILE__, __LINE__,
                 fmt::format("GEMM operand dtype {} is not f32 or bf16", dtype_name(t)));
}

std::string describe(const Tensor& t) { return t.defined() ? t.str() : std::string("undefined"); }

// A CUDA matrix as rows of its last dimension: contiguous (leading dims flattened) or a 2-D view
// with unit inner stride and a row stride of at least the row length.
struct Mat {
  void* data = nullptr;
  int64_t rows = 0, cols = 0, ld = 0;
};

Mat matrix_of(const Tensor& t, const char* what, const char* op) {
  GLMTUNE_ASSERT(t.defined() && t.device().is_cuda() && t.dim() >= 1,
                 "{}: {} must be a CUDA tensor, got {}", op, what, describe(t));
  const bool strided_2d = t.dim() == 2 && t.stride(1) == 1 && t.stride(0) >= t.size(1);
  GLMTUNE_ASSERT(t.is_contiguous() || strided_2d,
                 "{}: {} {} must be contiguous or a 2-D view with unit inner stride", op, what,
                 t.str());
  Mat m;
  m.data = t.data_ptr();
  m.cols = t.size(-1);
  m.rows = m.cols > 0 ? t.numel() / m.cols : 0;
  m.ld = t.is_contiguous() ? std::max<int64_t>(m.cols, 1) : t.stride(0);
  return m;
}

// The dtypes every GEMM operand and result may have.
bool is_gemm_dtype(DType t) { return t == DType::f32 || t == DType::bf16; }

void check_same_device(const Tensor& a, const Tensor& b, const char* op) {
  GLMTUNE_ASSERT(a.device() == b.device(), "{}: {} and {} are on different devices", op, a.str(),
                 b.str());
}

// The two operands of a product: one dtype, bf16 or f32.
void check_operand_dtypes(const Tensor& a, const char* a_name, const Tensor& b, const char* b_name,
                          const char* op) {
  GLMTUNE_ASSERT(is_gemm_dtype(a.dtype()) && b.dtype() == a.dtype(),
                 "{}: {} {} and {} {} must share bf16 or f32", op, a_name, a.str(), b_name,
                 b.str());
}

// c = op(a)·op(b) (+ bias), plus beta·c: m and n are c's rows and columns, k op(a)'s columns.
// Runs on x's device with x's dtype for both operands, as the callers checked a and b to share.
void gemm_mats(const Tensor& x, const Mat& a, bool trans_a, const Mat& b, bool trans_b,
               const Mat& c, DType c_dtype, float beta, const void* bias, cudaStream_t stream) {
  gemm({.device = x.device().index,
        .trans_a = trans_a,
        .trans_b = trans_b,
        .m = c.rows,
        .n = c.cols,
        .k = trans_a ? a.rows : a.cols,
        .a = a.data,
        .lda = a.ld,
        .b = b.data,
        .ldb = b.ld,
        .c = c.data,
        .ldc = c.ld,
        .c_dtype = c_dtype,
        .beta = beta,
        .bias = bias,
        .ab_dtype = x.dtype()},
       stream);
}

}  // namespace

void gemm(const GemmArgs& g, cudaStream_t stream) {
  GLMTUNE_ASSERT(g.m >= 0 && g.n >= 0 && g.k > 0, "gemm: bad problem size m={} n={} k={}", g.m, g.n,
                 g.k);
  if (g.m == 0 || g.n == 0) return;
  GLMTUNE_ASSERT(g.a && g.b && g.c, "gemm: null operand");
  GLMTUNE_ASSERT(
      g.lda >= (g.trans_a ? g.m : g.k) && g.ldb >= (g.trans_b ? g.k : g.n) && g.ldc >= g.n,
      "gemm: leading dimensions lda={} ldb={} ldc={} too small for m={} n={} k={} "
      "(trans_a={}, trans_b={})",
      g.lda, g.ldb, g.ldc, g.m, g.n, g.k, g.trans_a, g.trans_b);
  GLMTUNE_ASSERT(
      g.batch >= 1 && g.batch <= INT32_MAX && g.stride_a >= 0 && g.stride_b >= 0 && g.stride_c >= 0,
      "gemm: bad batch {} (strides {}/{}/{})", g.batch, g.stride_a, g.stride_b, g.stride_c);
  GLMTUNE_ASSERT(g.batch == 1 || g.bias == nullptr, "gemm: a batched product takes no bias");
  const cudaDataType_t ct = cuda_type(g.c_dtype), abt = cuda_type(g.ab_dtype);
  const size_t c_size = dtype_size(g.c_dtype), ab_size = dtype_size(g.ab_dtype);

  // cuBLASLt is column-major. Row-major C = op(A)·op(B) is column-major C^T = op(B)^T · op(A)^T,
  // and a row-major matrix with row stride ld is the column-major transpose with the same ld. So
  // cuBLASLt's first operand is our B and its second is our A, each with its own transpose flag;
  // its problem is (n, m, k).
  // CUBLAS_COMPUTE_32F keeps f32 operands in full fp32 (SIMT FFMA): cuBLASLt rounds them to TF32
  // only under CUBLAS_COMPUTE_32F_FAST_TF32, which the fp32 mode must never take.
  lt::Descriptors desc;
  GLMTUNE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_first = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  GLMTUNE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSA,
                                                      &op_first, sizeof(op_first)));
  GLMTUNE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSB,
                                                      &op_second, sizeof(op_second)));
  if (g.bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const int32_t bias_type = int32_t(ct);
    GLMTUNE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                        &epilogue, sizeof(epilogue)));
    GLMTUNE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                        &g.bias, sizeof(g.bias)));
    GLMTUNE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        desc.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
  }
  GLMTUNE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&desc.a, abt, g.trans_b ? g.k : g.n,
                                                  g.trans_b ? g.n : g.k, g.ldb));
  GLMTUNE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&desc.b, abt, g.trans_a ? g.m : g.k,
                                                  g.trans_a ? g.k : g.m, g.lda));
  GLMTUNE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&desc.d, ct, g.n, g.m, g.ldc));
  if (g.batch > 1) {
    const int32_t count = int32_t(g.batch);
    const std::pair<cublasLtMatrixLayout_t, int64_t> layouts[] = {
        {desc.a, g.stride_b}, {desc.b, g.stride_a}, {desc.d, g.stride_c}};
    for (const auto& [layout, stride] : layouts) {
      GLMTUNE_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
          layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
      GLMTUNE_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
          layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
    }
  }

  // Every product of a batch starts a stride further on: its rows are aligned as both allow.
  const uint32_t align_b = lt::alignment_of(g.b, std::gcd(g.ldb, g.stride_b), ab_size);
  const uint32_t align_a = lt::alignment_of(g.a, std::gcd(g.lda, g.stride_a), ab_size);
  const uint32_t align_c = lt::alignment_of(g.c, std::gcd(g.ldc, g.stride_c), c_size);
  const AlgoKey key = algo_key(g, align_b, align_a, align_c);

  detail::DeviceGuard guard(g.device);
  const cublasLtHandle_t handle = lt::handle(g.device);
  void* const workspace = lt::workspace(g.device, stream);
  const cublasLtMatmulAlgo_t algo = algo_cache().get(key, [&] {
    desc.pref = lt::preference(align_b, align_a, align_c, align_c);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    GLMTUNE_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, desc.op, desc.a, desc.b, desc.d,
                                                        desc.d, desc.pref, 1, &result, &found));
    if (found == 0 || result.state != CUBLAS_STATUS_SUCCESS)
      throw Error(fmt::format("cuBLASLt has no algorithm for a {} GEMM m={} n={} k={} "
                              "(trans_a={}, trans_b={}, lda={} ldb={} ldc={}, output {}, "
                              "alignments {}/{}/{} bytes{})",
                              dtype_name(g.ab_dtype), g.m, g.n, g.k, g.trans_a, g.trans_b, g.lda,
                              g.ldb, g.ldc, dtype_name(g.c_dtype), align_a, align_b, align_c,
                              g.bias ? ", bias" : ""),
                  "cuda gemm",
                  "keep rows of every operand 16-byte aligned (row lengths a multiple of 16 "
                  "bytes: 8 bf16 or 4 f32 elements)");
    return result.algo;
  });
  GLMTUNE_CUBLAS_CHECK(cublasLtMatmul(handle, desc.op, &g.alpha, g.b, desc.a, g.a, desc.b, &g.beta,
                                      g.c, desc.d, g.c, desc.d, &algo, workspace,
                                      lt::kWorkspaceBytes, stream));
}

int64_t gemm_heuristic_queries() { return algo_cache().queries(); }

void linear_out(Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias, bool accumulate,
                cudaStream_t stream) {
  const char* op = "cuda::linear";
  const Mat xm = matrix_of(x, "input", op), wm = matrix_of(w, "weight", op);
  const Mat ym = matrix_of(y, "output", op);
  check_operand_dtypes(x, "input", w, "weight", op);
  GLMTUNE_ASSERT(w.dim() == 2 && wm.cols == xm.cols, "{}: weight {} must be [out, {}] for input {}",
                 op, w.str(), xm.cols, x.str());
  GLMTUNE_ASSERT(is_gemm_dtype(y.dtype()) && ym.rows == xm.rows && ym.cols == wm.rows,
                 "{}: output {} must be f32 or bf16 with {} rows of {}", op, y.str(), xm.rows,
                 wm.rows);
  check_same_device(x, w, op);
  check_same_device(x, y, op);
  Tensor b;
  if (bias.defined()) {
    GLMTUNE_ASSERT(bias.dim() == 1 && bias.size(0) == wm.rows && bias.device() == x.device() &&
                       is_gemm_dtype(bias.dtype()),
                   "{}: bias {} must be a CUDA f32/bf16 vector of {}", op, bias.str(), wm.rows);
    // cuBLASLt's bias epilogue reads the bias in the output type.
    b = bias.dtype() == y.dtype() ? bias.contiguous() : bias.to(y.dtype());
  }
  if (xm.rows == 0 || wm.rows == 0) return;
  gemm_mats(x, xm, false, wm, true, ym, y.dtype(), accumulate ? 1.0f : 0.0f,
            b.defined() ? b.data_ptr() : nullptr, stream);
}

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& bias, std::optional<DType> out_dtype,
              cudaStream_t stream) {
  GLMTUNE_ASSERT(x.defined() && x.dim() >= 1 && w.defined() && w.dim() == 2,
                 "cuda::linear needs x [..., in] and weight [out, in], got {} and {}", describe(x),
                 describe(w));
  Shape shape = x.shape();
  shape.back() = w.size(0);
  Tensor y = Tensor::empty(shape, out_dtype.value_or(x.dtype()), x.device());
  linear_out(y, x, w, bias, false, stream);
  return y;
}

void linear_backward_input_out(Tensor& dx, const Tensor& dy, const Tensor& w, bool accumulate,
                               cudaStream_t stream) {
  const char* op = "cuda::linear_backward_input";
  const Mat dym = matrix_of(dy, "dy", op), wm = matrix_of(w, "weight", op);
  const Mat dxm = matrix_of(dx, "dx", op);
  check_operand_dtypes(dy, "dy", w, "weight", op);
  GLMTUNE_ASSERT(w.dim() == 2 && dym.cols == wm.rows, "{}: dy {} does not match weight {}", op,
                 dy.str(), w.str());
  GLMTUNE_ASSERT(is_gemm_dtype(dx.dtype()) && dxm.rows == dym.rows && dxm.cols == wm.cols,
                 "{}: dx {} must be f32 or bf16 with {} rows of {}", op, dx.str(), dym.rows,
                 wm.cols);
  check_same_device(dy, w, op);
  check_same_device(dy, dx, op);
  if (dym.rows == 0 || wm.cols == 0) return;
  gemm_mats(dy, dym, false, wm, false, dxm, dx.dtype(), accumulate ? 1.0f : 0.0f, nullptr, stream);
}

Tensor linear_backward_input(const Tensor& dy, const Tensor& w, std::optional<DType> out_dtype,
                             cudaStream_t stream) {
  GLMTUNE_ASSERT(dy.defined() && dy.dim() >= 1 && w.defined() && w.dim() == 2,
                 "cuda::linear_backward_input needs dy [..., out] and weight [out, in], got {} "
                 "and {}",
                 describe(dy), describe(w));
  Shape shape = dy.shape();
  shape.back() = w.size(1);
  Tensor dx = Tensor::empty(shape, out_dtype.value_or(dy.dtype()), dy.device());
  linear_backward_input_out(dx, dy, w, false, stream);
  return dx;
}

void linear_backward_weight(Tensor& dw, const Tensor& dy, const Tensor& x, cudaStream_t stream) {
  const char* op = "cuda::linear_backward_weight";
  const Mat dym = matrix_of(dy, "dy", op), xm = matrix_of(x, "input", op);
  check_operand_dtypes(dy, "dy", x, "input", op);
  GLMTUNE_ASSERT(dym.rows == xm.rows, "{}: dy {} and input {} differ in rows", op, dy.str(),
                 x.str());
  GLMTUNE_ASSERT(dw.defined() && dw.dim() == 2 && dw.is_contiguous() && is_gemm_dtype(dw.dtype()) &&
                     dw.size(0) == dym.cols && dw.size(1) == xm.cols,
                 "{}: weight gradient {} must be a contiguous f32/bf16 [{}, {}]", op, describe(dw),
                 dym.cols, xm.cols);
  check_same_device(dy, x, op);
  check_same_device(dy, dw, op);
  if (dym.rows == 0 || dym.cols == 0 || xm.cols == 0) return;
  const Mat dwm{dw.data_ptr(), dym.cols, xm.cols, xm.cols};  // contiguous [dy cols, x cols]
  gemm_mats(dy, dym, true, xm, false, dwm, dw.dtype(), 1.0f, nullptr, stream);
}

}  // namespace cuda
}  // namespace glmtune
