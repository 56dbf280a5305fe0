// Block-scaled FP8 on the GPU (ops/cuda/fp8.h): the tensor-level quantisers over the kernels of
// ops/cuda/fp8.cu, and the e4m3 GEMMs through cuBLASLt. Plain C++: the library is called from the
// host only.

#include <cublasLt.h>

#include <algorithm>
#include <compare>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "glmtune/base/error.h"
#include "glmtune/ops/cuda/cublas_check.h"
#include "glmtune/ops/cuda/cublaslt.h"
#include "glmtune/ops/cuda/fp8.h"
#include "glmtune/ops/cuda/fp8_kernels.h"
#include "glmtune/tensor/allocator.h"
#include "glmtune/tensor/cuda_check.h"

namespace glmtune::cuda {
namespace {

using ops::Fp8Blocks;

int64_t blocks_of(int64_t n, int64_t b) { return (n + b - 1) / b; }
int64_t pad_to(int64_t n, int64_t m) { return blocks_of(n, m) * m; }

std::string describe(const Tensor& t) { return t.defined() ? t.str() : std::string("undefined"); }

enum class Tiling { rows_1x128, blocks_128x128, cols_128x1 };

Tiling tiling_of(int64_t br, int64_t bc, const char* op) {
  if (br == 1 && bc == 128) return Tiling::rows_1x128;
  if (br == 128 && bc == 128) return Tiling::blocks_128x128;
  if (br == 128 && bc == 1) return Tiling::cols_128x1;
  throw Error(fmt::format("{}: blocks of {} x {} have no GPU layout", op, br, bc), op,
              "quantise on the GPU in 1 x 128, 128 x 128 or 128 x 1 blocks, or on the CPU");
}

// The physical layout of one Fp8Blocks (see ops/cuda/fp8.h): the buffers' shapes and the strides
// of the logical views over them.
struct Layout {
  Shape values_buffer, values_strides, scales_buffer, scales_strides;
};

Layout layout_of(Tiling t, int64_t rows, int64_t cols) {
  Layout l;
  switch (t) {
    case Tiling::rows_1x128: {
      // cuBLASLt (13.1, sm_90) has no VEC128 algorithm unless the scaled operand's outer
      // dimension is a multiple of 4, and it takes the scales' leading dimension from that
      // dimension: the GEMM runs on pad4(rows) rows, so the codes are stored with zero rows up to
      // there as well as the scales.
      const int64_t ld = pad_to(rows, 4);
      l.values_buffer = {ld, cols};
      l.values_strides = {cols, 1};
      l.scales_buffer = {blocks_of(cols, 128), ld};
      l.scales_strides = {1, ld};
      break;
    }
    case Tiling::blocks_128x128: {
      const int64_t ld = pad_to(blocks_of(cols, 128), 4);
      l.values_buffer = {rows, cols};
      l.values_strides = {cols, 1};
      l.scales_buffer = {blocks_of(rows, 128), ld};
      l.scales_strides = {ld, 1};
      break;
    }
    case Tiling::cols_128x1: {
      const int64_t ld_q = pad_to(rows, 16), ld_s = pad_to(cols, 4);
      l.values_buffer = {cols, ld_q};
      l.values_strides = {1, ld_q};
      l.scales_buffer = {blocks_of(rows, 128), ld_s};
      l.scales_strides = {ld_s, 1};
      break;
    }
  }
  return l;
}

Shape scale_shape(Tiling t, int64_t rows, int64_t cols) {
  switch (t) {
    case Tiling::rows_1x128:
      return {rows, blocks_of(cols, 128)};
    case Tiling::blocks_128x128:
      return {blocks_of(rows, 128), blocks_of(cols, 128)};
    case Tiling::cols_128x1:
      return {blocks_of(rows, 128), cols};
  }
  return {};
}

Tensor view_over(const Tensor& buffer, const Shape& shape, const Shape& strides) {
  return Tensor::from_storage(buffer.storage(), buffer.storage_offset(), shape, strides,
                              buffer.dtype());
}

// Strides agree where they matter: a dimension of size 0 or 1 has no meaningful stride.
bool strides_match(const Tensor& t, const Shape& strides) {
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) > 1 && t.stride(d) != strides[size_t(d)]) return false;
  return true;
}

// The storage behind view `t` holds the whole physical buffer from the view's first element: the
// GEMMs read the padding too.
bool holds_buffer(const Tensor& t, const Shape& buffer) {
  const size_t need = size_t(t.storage_offset() + shape_numel(buffer)) * dtype_size(t.dtype());
  return t.storage() != nullptr && t.storage()->bytes() >= need;
}

void check_blocks(const Fp8Blocks& q, const char* op, const char* what) {
  GLMTUNE_ASSERT(q.values.defined() && q.values.dim() == 2 && q.values.dtype() == DType::fp8e4m3,
                 "{}: {} values must be fp8e4m3 [rows, cols], got {}", op, what,
                 describe(q.values));
  const Tiling t = tiling_of(q.block_rows, q.block_cols, op);
  const Shape want = scale_shape(t, q.values.size(0), q.values.size(1));
  GLMTUNE_ASSERT(q.scales.defined() && q.scales.dtype() == DType::f32 && q.scales.shape() == want,
                 "{}: {} scales {} do not fit values {} in blocks of {} x {}", op, what,
                 describe(q.scales), q.values.str(), q.block_rows, q.block_cols);
}

// The quantised x in `t` tiles, written by the kernels into fresh buffers on x's device.
Fp8Blocks quantize_2d(const Tensor& x, Tiling t, int64_t br, int64_t bc, cudaStream_t stream) {
  const int64_t rows = x.size(0), cols = x.size(1), ld_x = rows > 1 ? x.stride(0) : cols;
  const Device dev = x.device();
  const Layout l = layout_of(t, rows, cols);
  Tensor vbuf = Tensor::empty(l.values_buffer, DType::fp8e4m3, dev);
  Tensor sbuf = Tensor::empty(l.scales_buffer, DType::f32, dev);
  detail::DeviceGuard guard(dev.index);
  const Shape sshape = scale_shape(t, rows, cols);
  if (sbuf.numel() != shape_numel(sshape))  // padding scales are read by nobody; zero, not garbage
    GLMTUNE_CUDA_CHECK(cudaMemsetAsync(sbuf.data_ptr(), 0, sbuf.nbytes(), stream));
  const bool bf16 = x.dtype() == DType::bf16;
  auto* q = static_cast<uint8_t*>(vbuf.data_ptr());
  auto* s = sbuf.data<float>();
  if (t == Tiling::rows_1x128 && l.values_buffer[0] > rows)  // the GEMM reads the padding rows
    GLMTUNE_CUDA_CHECK(
        cudaMemsetAsync(q + rows * cols, 0, size_t((l.values_buffer[0] - rows) * cols), stream));
  switch (t) {
    case Tiling::rows_1x128:
      fp8_kernels::quantize_tiles(x.data_ptr(), bf16, rows, cols, ld_x, q, cols, s,
                                  l.scales_buffer[1], stream);
      break;
    case Tiling::blocks_128x128:
      fp8_kernels::quantize_blocks(x.data_ptr(), bf16, rows, cols, ld_x, q, cols, s,
                                   l.scales_buffer[1], stream);
      break;
    case Tiling::cols_128x1:
      fp8_kernels::quantize_columns(x.data_ptr(), bf16, rows, cols, ld_x, q, l.values_buffer[1], s,
                                    l.scales_buffer[1], stream);
      break;
  }
  Fp8Blocks out;
  out.block_rows = br;
  out.block_cols = bc;
  out.values = view_over(vbuf, {rows, cols}, l.values_strides);
  out.scales = view_over(sbuf, sshape, l.scales_strides);
  return out;
}

// A logical CPU tensor placed into a zeroed physical buffer on `device`, returned as the view.
Tensor place(const Tensor& logical, const Shape& buffer, const Shape& strides, Device device) {
  Tensor host = Tensor::zeros(buffer, logical.dtype());
  Tensor view = view_over(host, logical.shape(), strides);
  view.copy_(logical.to(Device::cpu()));
  return view_over(host.to(device), logical.shape(), strides);
}

// ---- cuBLASLt --------------------------------------------------------------------------------

struct AlgoKey {
  int device = 0;
  int64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldd = 0;
  int32_t mode_a = 0, mode_b = 0;
  DType d_dtype = DType::bf16;
  bool accumulate = false;
  uint32_t align_a = 0, align_b = 0, align_d = 0;
  auto operator<=>(const AlgoKey&) const = default;
};

// Never destroyed (as lt::handle's handles).
lt::AlgoCache<AlgoKey>& algo_cache() {
  static auto* cache = new lt::AlgoCache<AlgoKey>();
  return *cache;
}

const char* mode_name(int32_t mode) {
  return mode == CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F       ? "VEC128_32F"
         : mode == CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F ? "BLK128x128_32F"
                                                               : "other";
}

// One FP8 operand in cuBLASLt's terms: column-major [k, outer] (contiguous along k) with leading
// dimension ld, and its block scales.
struct LtOperand {
  const void* data = nullptr;
  int64_t ld = 0;
  const void* scales = nullptr;
  int32_t mode = 0;
};

// Column-major D[m, n] (ld ldd) = Aᵀ · B (+ D), A stored [k, m], B stored [k, n]: the "TN" form,
// the only one cuBLASLt runs FP8 in on Hopper.
void lt_fp8_tn(int device, int64_t m, int64_t n, int64_t k, const LtOperand& a, const LtOperand& b,
               void* d, DType d_dtype, int64_t ldd, bool accumulate, cudaStream_t stream,
               const char* op) {
  if (cublasLtGetVersion() < 120900)
    throw Error(
        fmt::format("{}: cuBLASLt {} has no block-scaled FP8 GEMM", op, cublasLtGetVersion()), op,
        "run with the CUDA 12.9 (or later) cuBLAS libraries on LD_LIBRARY_PATH");
  const cudaDataType_t dt = d_dtype == DType::f32 ? CUDA_R_32F : CUDA_R_16BF;
  lt::Descriptors desc;
  GLMTUNE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans = CUBLAS_OP_T, no_trans = CUBLAS_OP_N;
  GLMTUNE_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof(trans)));
  GLMTUNE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSB,
                                                      &no_trans, sizeof(no_trans)));
  GLMTUNE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                                      &a.mode, sizeof(a.mode)));
  GLMTUNE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                                                      &b.mode, sizeof(b.mode)));
  GLMTUNE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                      &a.scales, sizeof(a.scales)));
  GLMTUNE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                      &b.scales, sizeof(b.scales)));
  GLMTUNE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&desc.a, CUDA_R_8F_E4M3, k, m, a.ld));
  GLMTUNE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&desc.b, CUDA_R_8F_E4M3, k, n, b.ld));
  GLMTUNE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&desc.d, dt, m, n, ldd));

  AlgoKey key;
  key.device = device;
  key.m = m, key.n = n, key.k = k, key.lda = a.ld, key.ldb = b.ld, key.ldd = ldd;
  key.mode_a = a.mode, key.mode_b = b.mode;
  key.d_dtype = d_dtype;
  key.accumulate = accumulate;
  key.align_a = lt::alignment_of(a.data, a.ld, 1);
  key.align_b = lt::alignment_of(b.data, b.ld, 1);
  key.align_d = lt::alignment_of(d, ldd, dtype_size(d_dtype));

  detail::DeviceGuard guard(device);
  const cublasLtHandle_t handle = lt::handle(device);
  void* const workspace = lt::workspace(device, stream);
  const cublasLtMatmulAlgo_t algo = algo_cache().get(key, [&] {
    desc.pref = lt::preference(key.align_a, key.align_b, key.align_d, key.align_d);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
        handle, desc.op, desc.a, desc.b, desc.d, desc.d, desc.pref, 1, &result, &found);
    const cublasStatus_t why = status != CUBLAS_STATUS_SUCCESS ? status
                               : found == 0                    ? CUBLAS_STATUS_NOT_SUPPORTED
                                                               : result.state;
    if (why != CUBLAS_STATUS_SUCCESS) {
      int major = 0, minor = 0;
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
      throw Error(
          fmt::format("cuBLASLt {} has no algorithm for a block-scaled FP8 GEMM on sm_{}{}: {} "
                      "({}); TN m={} n={} k={} lda={} ldb={} ldd={}, A scales {}, B scales {}, "
                      "output {}{}, alignments {}/{}/{} bytes",
                      cublasLtGetVersion(), major, minor, cublasLtGetStatusName(why),
                      cublasLtGetStatusString(why), m, n, k, a.ld, b.ld, ldd, mode_name(a.mode),
                      mode_name(b.mode), dtype_name(d_dtype), accumulate ? " (accumulated)" : "",
                      key.align_a, key.align_b, key.align_d),
          op,
          "FP8 block scaling (VEC128 / BLK128x128) runs on Hopper (sm_90) with cuBLAS 12.9 or "
          "later; keep N and K multiples of 16");
    }
    return result.algo;
  });
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  GLMTUNE_CUBLAS_CHECK(cublasLtMatmul(handle, desc.op, &alpha, a.data, desc.a, b.data, desc.b,
                                      &beta, d, desc.d, d, desc.d, &algo, workspace,
                                      lt::kWorkspaceBytes, stream));
}

void check_gemm_operand(const Fp8Blocks& q, int64_t br, int64_t bc, const char* op,
                        const char* what) {
  if (q.block_rows != br || q.block_cols != bc || !is_fp8_gemm_layout(q))
    throw Error(
        fmt::format("{}: {} must be quantised in {} x {} blocks in the GPU GEMM layout, got "
                    "{} x {} blocks, values {}, scales {}",
                    op, what, br, bc, q.block_rows, q.block_cols, describe(q.values),
                    describe(q.scales)),
        op,
        "quantise it with cuda::quantize_fp8_blocks (or move it with "
        "cuda::fp8_blocks_to_device)");
}

void check_multiple_of_16(int64_t n, const char* dim, const char* op) {
  if (n % 16 != 0)
    throw Error(fmt::format("{}: {} = {} is not a multiple of 16", op, dim, n), op,
                "cuBLASLt's FP8 GEMMs need 16-byte rows: pad the dimension to a multiple of 16 or "
                "run this product in bf16");
}

void check_out(const Tensor& out, int64_t rows, int64_t cols, const Tensor& like, const char* op,
               const char* what) {
  GLMTUNE_ASSERT(out.defined() && out.device() == like.device() && out.is_contiguous() &&
                     out.dim() == 2 && out.size(0) == rows && out.size(1) == cols &&
                     (out.dtype() == DType::bf16 || out.dtype() == DType::f32),
                 "{}: {} {} must be a contiguous bf16 or f32 [{}, {}] on {}", op, what,
                 describe(out), rows, cols, like.device().str());
}

void linear_impl(Tensor& y, const Fp8Blocks& x, const Fp8Blocks& w, bool accumulate,
                 cudaStream_t stream, const char* op, const char* x_name, const char* w_name) {
  check_gemm_operand(x, 1, 128, op, x_name);
  check_gemm_operand(w, 128, 128, op, w_name);
  const int64_t m = x.values.size(0), k = x.values.size(1), n = w.values.size(0);
  GLMTUNE_ASSERT(w.values.size(1) == k && w.values.device() == x.values.device(),
                 "{}: {} {} and {} {} differ in the reduced dimension or device", op, x_name,
                 x.values.str(), w_name, w.values.str());
  check_out(y, m, n, x.values, op, "output");
  check_multiple_of_16(n, "N (output columns)", op);
  check_multiple_of_16(k, "K (reduced dimension)", op);
  if (m == 0 || n == 0) return;
  // Row-major y = x wᵀ is column-major yᵀ[n, m] = w[k, n]ᵀ · xᵀ[k, m]: cuBLASLt's A is w.
  const LtOperand a{w.values.data_ptr(), k, w.scales.data_ptr(),
                    CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F};
  const LtOperand b{x.values.data_ptr(), k, x.scales.data_ptr(),
                    CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F};
  const int device = x.values.device().index;
  // The GEMM runs on pad4(m) rows (cuBLASLt's VEC128 needs the outer dimension a multiple of 4;
  // x's layout holds zero codes and zero scales there). The padding rows of the product must not
  // land outside y, so an m that is not a multiple of 4 goes through a staging output: y's rows
  // copied in when accumulating, the real rows copied back.
  const int64_t m_pad = pad_to(m, 4);
  if (m_pad == m) {
    lt_fp8_tn(device, n, m, k, a, b, y.data_ptr(), y.dtype(), n, accumulate, stream, op);
    return;
  }
  detail::DeviceGuard guard(device);
  Tensor staged = Tensor::empty({m_pad, n}, y.dtype(), y.device());
  const size_t real_bytes = y.nbytes();
  auto* staged_bytes = static_cast<char*>(staged.data_ptr());
  if (accumulate) {
    GLMTUNE_CUDA_CHECK(
        cudaMemcpyAsync(staged_bytes, y.data_ptr(), real_bytes, cudaMemcpyDeviceToDevice, stream));
    // beta = 1 reads the padding rows too: zeros, not whatever the allocator left there.
    GLMTUNE_CUDA_CHECK(
        cudaMemsetAsync(staged_bytes + real_bytes, 0, staged.nbytes() - real_bytes, stream));
  }
  lt_fp8_tn(device, n, m_pad, k, a, b, staged.data_ptr(), y.dtype(), n, accumulate, stream, op);
  GLMTUNE_CUDA_CHECK(
      cudaMemcpyAsync(y.data_ptr(), staged_bytes, real_bytes, cudaMemcpyDeviceToDevice, stream));
}

void check_offsets(const std::vector<int64_t>& offsets, size_t groups, int64_t rows,
                   const char* op) {
  GLMTUNE_ASSERT(offsets.size() == groups + 1 && offsets.front() == 0 && offsets.back() == rows,
                 "{}: offsets must hold {} entries from 0 to {} rows", op, groups + 1, rows);
  for (size_t g = 0; g + 1 < offsets.size(); ++g)
    GLMTUNE_ASSERT(offsets[g] <= offsets[g + 1], "{}: offsets decrease at group {}", op, g);
}

}  // namespace

// ---- quantisers ------------------------------------------------------------------------------

Fp8Blocks quantize_fp8_blocks(const Tensor& x_in, int64_t block_rows, int64_t block_cols,
                              cudaStream_t stream) {
  const char* op = "cuda::quantize_fp8_blocks";
  const Tiling t = tiling_of(block_rows, block_cols, op);
  GLMTUNE_ASSERT(x_in.defined() && x_in.device().is_cuda() && x_in.dim() == 2 &&
                     (x_in.dtype() == DType::bf16 || x_in.dtype() == DType::f32),
                 "{}: x must be a CUDA [rows, cols] tensor in bf16 or f32, got {}", op,
                 describe(x_in));
  const bool rows_view = x_in.stride(1) == 1 && x_in.stride(0) >= x_in.size(1);
  const Tensor x = rows_view ? x_in : x_in.contiguous();
  return quantize_2d(x, t, block_rows, block_cols, stream);
}

Fp8Blocks transpose_fp8_weight(const Fp8Blocks& w, cudaStream_t stream) {
  const char* op = "cuda::transpose_fp8_weight";
  check_gemm_operand(w, 128, 128, op, "weight");
  const int64_t n = w.values.size(0), k = w.values.size(1);
  const Layout l = layout_of(Tiling::blocks_128x128, k, n);
  const Device dev = w.values.device();
  Tensor vbuf = Tensor::empty(l.values_buffer, DType::fp8e4m3, dev);
  Tensor sbuf = Tensor::empty(l.scales_buffer, DType::f32, dev);
  detail::DeviceGuard guard(dev.index);
  GLMTUNE_CUDA_CHECK(cudaMemsetAsync(sbuf.data_ptr(), 0, sbuf.nbytes(), stream));
  fp8_kernels::transpose_u8(static_cast<const uint8_t*>(w.values.data_ptr()), n, k, k,
                            static_cast<uint8_t*>(vbuf.data_ptr()), n, stream);
  const int64_t nb = w.scales.size(0), kb = w.scales.size(1);
  fp8_kernels::transpose_f32(w.scales.data<float>(), nb, kb, pad_to(kb, 4), sbuf.data<float>(),
                             l.scales_buffer[1], stream);
  Fp8Blocks out;
  out.block_rows = out.block_cols = 128;
  out.values = view_over(vbuf, {k, n}, l.values_strides);
  out.scales = view_over(sbuf, {kb, nb}, l.scales_strides);
  return out;
}

Fp8Blocks transpose_fp8_weight_stack(const Fp8Blocks& w, int64_t n, int64_t first, int64_t count,
                                     cudaStream_t stream) {
  const char* op = "cuda::transpose_fp8_weight_stack";
  check_gemm_operand(w, 128, 128, op, "weight stack");
  const int64_t k = w.values.size(1);
  GLMTUNE_ASSERT(n > 0 && n % 128 == 0 && k % 128 == 0 && w.values.size(0) % n == 0 && first >= 0 &&
                     count > 0 && (first + count) * n <= w.values.size(0),
                 "{}: groups {} .. {} of [{}, {}] blocks from a stack {}", op, first,
                 first + count - 1, n, k, describe(w.values));
  const int64_t nb = n / 128, kb = k / 128;
  const Layout l = layout_of(Tiling::blocks_128x128, count * k, n);
  const Device dev = w.values.device();
  Tensor vbuf = Tensor::empty(l.values_buffer, DType::fp8e4m3, dev);
  Tensor sbuf = Tensor::empty(l.scales_buffer, DType::f32, dev);
  detail::DeviceGuard guard(dev.index);
  GLMTUNE_CUDA_CHECK(cudaMemsetAsync(sbuf.data_ptr(), 0, sbuf.nbytes(), stream));
  fp8_kernels::transpose_u8(static_cast<const uint8_t*>(w.values.data_ptr()) + first * n * k, n, k,
                            k, static_cast<uint8_t*>(vbuf.data_ptr()), n, stream, count, n * k,
                            k * n);
  const int64_t ld_in = w.scales.stride(0), ld_out = l.scales_buffer[1];
  fp8_kernels::transpose_f32(w.scales.data<float>() + first * nb * ld_in, nb, kb, ld_in,
                             sbuf.data<float>(), ld_out, stream, count, nb * ld_in, kb * ld_out);
  Fp8Blocks out;
  out.block_rows = out.block_cols = 128;
  out.values = view_over(vbuf, {count * k, n}, l.values_strides);
  out.scales = view_over(sbuf, {count * kb, nb}, l.scales_strides);
  return out;
}

bool is_fp8_gemm_layout(const Fp8Blocks& q) {
  if (!q.values.defined() || !q.scales.defined() || !q.values.device().is_cuda() ||
      q.scales.device() != q.values.device() || q.values.dtype() != DType::fp8e4m3 ||
      q.scales.dtype() != DType::f32 || q.values.dim() != 2)
    return false;
  Tiling t;
  if (q.block_rows == 1 && q.block_cols == 128)
    t = Tiling::rows_1x128;
  else if (q.block_rows == 128 && q.block_cols == 128)
    t = Tiling::blocks_128x128;
  else if (q.block_rows == 128 && q.block_cols == 1)
    t = Tiling::cols_128x1;
  else
    return false;
  const int64_t rows = q.values.size(0), cols = q.values.size(1);
  const Layout l = layout_of(t, rows, cols);
  return q.scales.shape() == scale_shape(t, rows, cols) &&
         strides_match(q.values, l.values_strides) && strides_match(q.scales, l.scales_strides) &&
         holds_buffer(q.values, l.values_buffer) && holds_buffer(q.scales, l.scales_buffer);
}

Fp8Blocks fp8_blocks_to_device(const Fp8Blocks& q, Device device) {
  const char* op = "cuda::fp8_blocks_to_device";
  GLMTUNE_ASSERT(device.is_cuda(), "{}: {} is not a CUDA device", op, device.str());
  check_blocks(q, op, "tensor");
  const Tiling t = tiling_of(q.block_rows, q.block_cols, op);
  const Layout l = layout_of(t, q.values.size(0), q.values.size(1));
  Fp8Blocks out;
  out.block_rows = q.block_rows;
  out.block_cols = q.block_cols;
  out.values = place(q.values, l.values_buffer, l.values_strides, device);
  out.scales = place(q.scales, l.scales_buffer, l.scales_strides, device);
  return out;
}

Fp8Blocks fp8_weight_from_codes(const Tensor& codes, const Tensor& scales) {
  const char* op = "cuda::fp8_weight_from_codes";
  GLMTUNE_ASSERT(codes.defined() && codes.device().is_cuda() && codes.dtype() == DType::fp8e4m3 &&
                     codes.dim() == 2 && strides_match(codes, {codes.size(1), 1}),
                 "{}: codes {} must be contiguous fp8e4m3 [rows, cols] on a CUDA device", op,
                 describe(codes));
  const Layout l = layout_of(Tiling::blocks_128x128, codes.size(0), codes.size(1));
  Fp8Blocks out;
  out.block_rows = out.block_cols = 128;
  out.values = codes;
  // Made once per weight (at load), so the scales' trip through the host costs nothing per step.
  out.scales = place(scales, l.scales_buffer, l.scales_strides, codes.device());
  check_blocks(out, op, "weight");
  return out;
}

void dequantize_fp8_pieces(Tensor& out, const Tensor& codes, const Tensor& scales,
                           int64_t piece_rows, cudaStream_t stream) {
  const char* op = "cuda::dequantize_fp8_pieces";
  GLMTUNE_ASSERT(codes.defined() && codes.device().is_cuda() && codes.is_contiguous() &&
                     codes.dtype() == DType::fp8e4m3 && codes.dim() >= 2,
                 "{}: codes {} must be a contiguous fp8e4m3 CUDA tensor of rows", op,
                 describe(codes));
  const int64_t cols = codes.size(-1), rows = codes.numel() / std::max<int64_t>(cols, 1);
  GLMTUNE_ASSERT(piece_rows > 0 && rows % piece_rows == 0, "{}: {} rows are not pieces of {}", op,
                 rows, piece_rows);
  const Shape grid{rows / piece_rows, (piece_rows + 127) / 128, (cols + 127) / 128};
  GLMTUNE_ASSERT(scales.defined() && scales.device() == codes.device() && scales.is_contiguous() &&
                     scales.dtype() == DType::f32 && scales.numel() == shape_numel(grid),
                 "{}: scales {} must be a contiguous f32 {} on {}", op, describe(scales),
                 shape_str(grid), codes.device().str());
  GLMTUNE_ASSERT(out.defined() && out.device() == codes.device() && out.is_contiguous() &&
                     out.numel() == codes.numel() &&
                     (out.dtype() == DType::bf16 || out.dtype() == DType::f32),
                 "{}: out {} must be a contiguous bf16 or f32 tensor of {} elements on {}", op,
                 describe(out), codes.numel(), codes.device().str());
  detail::DeviceGuard guard(codes.device().index);
  fp8_kernels::dequantize_pieces(static_cast<const uint8_t*>(codes.data_ptr()),
                                 scales.data<float>(), rows, cols, piece_rows,
                                 out.dtype() == DType::f32, out.data_ptr(), stream);
}

// ---- dense GEMMs -----------------------------------------------------------------------------

void fp8_linear_out(Tensor& y, const Fp8Blocks& x, const Fp8Blocks& w, bool accumulate,
                    cudaStream_t stream) {
  linear_impl(y, x, w, accumulate, stream, "cuda::fp8_linear", "x", "weight");
}

Tensor fp8_linear(const Fp8Blocks& x, const Fp8Blocks& w, DType out, cudaStream_t stream) {
  GLMTUNE_ASSERT(
      x.values.defined() && w.values.defined() && x.values.dim() == 2 && w.values.dim() == 2,
      "cuda::fp8_linear needs x [M, K] and weight [N, K], got {} and {}", describe(x.values),
      describe(w.values));
  Tensor y = Tensor::empty({x.values.size(0), w.values.size(0)}, out, x.values.device());
  fp8_linear_out(y, x, w, false, stream);
  return y;
}

void fp8_linear_backward_input_out(Tensor& dx, const Fp8Blocks& dy, const Fp8Blocks& w_t,
                                   bool accumulate, cudaStream_t stream) {
  linear_impl(dx, dy, w_t, accumulate, stream, "cuda::fp8_linear_backward_input", "dy",
              "transposed weight");
}

void fp8_linear_backward_weight(Tensor& dw, const Fp8Blocks& dy, const Fp8Blocks& x,
                                bool accumulate, cudaStream_t stream) {
  const char* op = "cuda::fp8_linear_backward_weight";
  check_gemm_operand(dy, 128, 1, op, "dy");
  check_gemm_operand(x, 128, 1, op, "x");
  const int64_t t = dy.values.size(0), n = dy.values.size(1), k = x.values.size(1);
  GLMTUNE_ASSERT(x.values.size(0) == t && x.values.device() == dy.values.device(),
                 "{}: dy {} and x {} differ in tokens or device", op, dy.values.str(),
                 x.values.str());
  check_out(dw, n, k, dy.values, op, "weight gradient");
  check_multiple_of_16(n, "N (dy columns)", op);
  check_multiple_of_16(k, "K (x columns)", op);
  if (n == 0 || k == 0) return;
  if (t == 0) {
    if (!accumulate) dw.zero_();
    return;
  }
  // Row-major dw = dyᵀ x is column-major dwᵀ[k, n] = x[t, k]ᵀ · dy[t, n]; both operands are stored
  // transposed ([cols, pad16(t)]), contiguous along the tokens, and the zero padding rows join the
  // reduction (they are in the last 128-token tile, whose scale the real tokens set).
  const int64_t kt = pad_to(t, 16);
  const LtOperand a{x.values.data_ptr(), kt, x.scales.data_ptr(),
                    CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F};
  const LtOperand b{dy.values.data_ptr(), kt, dy.scales.data_ptr(),
                    CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F};
  lt_fp8_tn(dy.values.device().index, k, n, kt, a, b, dw.data_ptr(), dw.dtype(), k, accumulate,
            stream, op);
}

// ---- grouped ---------------------------------------------------------------------------------

std::vector<Fp8Blocks> quantize_fp8_grouped(const Tensor& x, const std::vector<int64_t>& offsets,
                                            int64_t block_rows, int64_t block_cols,
                                            cudaStream_t stream) {
  const char* op = "cuda::quantize_fp8_grouped";
  GLMTUNE_ASSERT(x.defined() && x.dim() == 2 && !offsets.empty(),
                 "{}: x must be [rows, cols] with offsets, got {}", op, describe(x));
  check_offsets(offsets, offsets.size() - 1, x.size(0), op);
  GLMTUNE_ASSERT(block_cols != 128 || block_rows == 1,
                 "{}: groups take 1 x 128 or 128 x 1 tiles, not {} x {}", op, block_rows,
                 block_cols);
  const Tiling t = tiling_of(block_rows, block_cols, op);
  const size_t groups = offsets.size() - 1;
  const bool rows_view = x.stride(1) == 1 && x.stride(0) >= x.size(1);
  if (groups > size_t(fp8_kernels::kMaxGroupsPerLaunch) || !x.device().is_cuda() || !rows_view ||
      x.size(0) + 16 * int64_t(groups) > std::numeric_limits<int32_t>::max() ||
      (x.dtype() != DType::bf16 && x.dtype() != DType::f32)) {
    std::vector<Fp8Blocks> out;
    out.reserve(groups);
    for (size_t g = 0; g < groups; ++g)
      out.push_back(quantize_fp8_blocks(x.slice(0, offsets[g], offsets[g + 1]), block_rows,
                                        block_cols, stream));
    return out;
  }
  // Every group in one launch, into one buffer of values and one of scales, each group's part laid
  // out as quantize_fp8_blocks lays out its rows alone: the same codes and scales, and per group a
  // view, without a launch, two buffers and the padding's memsets per expert.
  const int64_t cols = x.size(1), pad = t == Tiling::rows_1x128 ? 4 : 16;
  fp8_kernels::GroupTable table;
  table.groups = int32_t(groups);
  table.rows[0] = table.padded[0] = table.tiles[0] = 0;
  for (size_t g = 0; g < groups; ++g) {
    const int64_t rows_g = offsets[g + 1] - offsets[g];
    table.rows[g + 1] = int32_t(offsets[g + 1]);
    table.padded[g + 1] = table.padded[g] + int32_t(pad_to(rows_g, pad));
    table.tiles[g + 1] = table.tiles[g] + int32_t(blocks_of(rows_g, 128));
  }
  const Device dev = x.device();
  const int64_t values = int64_t(table.padded[groups]) * cols;
  const int64_t scales = t == Tiling::rows_1x128
                             ? int64_t(table.padded[groups]) * blocks_of(cols, 128)
                             : int64_t(table.tiles[groups]) * pad_to(cols, 4);
  Tensor vbuf = Tensor::empty({std::max<int64_t>(values, 1)}, DType::fp8e4m3, dev);
  Tensor sbuf = Tensor::empty({std::max<int64_t>(scales, 1)}, DType::f32, dev);
  detail::DeviceGuard guard(dev.index);
  const bool bf16 = x.dtype() == DType::bf16;
  const int64_t ld_x = x.size(0) > 1 ? x.stride(0) : cols;
  auto* q = static_cast<uint8_t*>(vbuf.data_ptr());
  if (t == Tiling::rows_1x128) {
    fp8_kernels::quantize_group_tiles(x.data_ptr(), bf16, cols, ld_x, table, q, sbuf.data<float>(),
                                      stream);
  } else {
    // The padding columns' scales are read by nobody; zero, not garbage.
    GLMTUNE_CUDA_CHECK(cudaMemsetAsync(sbuf.data_ptr(), 0, sbuf.nbytes(), stream));
    fp8_kernels::quantize_group_columns(x.data_ptr(), bf16, cols, ld_x, table, q,
                                        sbuf.data<float>(), stream);
  }
  std::vector<Fp8Blocks> out(groups);
  for (size_t g = 0; g < groups; ++g) {
    const int64_t rows_g = offsets[g + 1] - offsets[g];
    if (rows_g == 0) continue;
    const Layout l = layout_of(t, rows_g, cols);
    const int64_t value_start = int64_t(table.padded[g]) * cols;
    const int64_t scale_start = t == Tiling::rows_1x128
                                    ? int64_t(table.padded[g]) * blocks_of(cols, 128)
                                    : int64_t(table.tiles[g]) * pad_to(cols, 4);
    out[g].block_rows = block_rows;
    out[g].block_cols = block_cols;
    out[g].values = view_over(vbuf.narrow(0, value_start, shape_numel(l.values_buffer)),
                              {rows_g, cols}, l.values_strides);
    out[g].scales = view_over(sbuf.narrow(0, scale_start, shape_numel(l.scales_buffer)),
                              scale_shape(t, rows_g, cols), l.scales_strides);
  }
  return out;
}

Fp8TokenTiles quantize_fp8_token_tiles(const Tensor& x_in, const Tensor& offsets,
                                       cudaStream_t stream) {
  const char* op = "cuda::quantize_fp8_token_tiles";
  GLMTUNE_ASSERT(x_in.defined() && x_in.device().is_cuda() && x_in.dim() == 2 &&
                     (x_in.dtype() == DType::bf16 || x_in.dtype() == DType::f32),
                 "{}: x must be a CUDA [rows, cols] tensor in bf16 or f32, got {}", op,
                 describe(x_in));
  GLMTUNE_ASSERT(offsets.defined() && offsets.dtype() == DType::i32 && offsets.is_contiguous() &&
                     offsets.device() == x_in.device() && offsets.dim() == 1 &&
                     offsets.size(0) >= 2,
                 "{}: offsets must be int32 [groups + 1] on {}, got {}", op, x_in.device().str(),
                 describe(offsets));
  const bool rows_view = x_in.stride(1) == 1 && x_in.stride(0) >= x_in.size(1);
  const Tensor x = rows_view ? x_in : x_in.contiguous();
  const int64_t rows = x.size(0), cols = x.size(1), groups = offsets.size(0) - 1;
  const Device dev = x.device();
  Fp8TokenTiles out;
  out.padded = 128 * (blocks_of(rows, 128) + groups);
  out.codes = Tensor::empty({cols, out.padded}, DType::fp8e4m3, dev);
  out.scales = Tensor::empty({out.padded / 128, pad_to(cols, 4)}, DType::f32, dev);
  out.tiles = Tensor::empty({groups + 1}, DType::i32, dev);
  detail::DeviceGuard guard(dev.index);
  GLMTUNE_CUDA_CHECK(cudaMemsetAsync(out.scales.data_ptr(), 0, out.scales.nbytes(), stream));
  fp8_kernels::quantize_device_group_columns(
      x.data_ptr(), x.dtype() == DType::bf16, rows, cols, rows > 1 ? x.stride(0) : cols,
      offsets.data<int32_t>(), int(groups), out.tiles.data<int32_t>(),
      static_cast<uint8_t*>(out.codes.data_ptr()), out.padded, out.scales.data<float>(),
      out.scales.size(1), stream);
  return out;
}

std::vector<Fp8Blocks> quantize_fp8_weight_grouped(const Tensor& w, cudaStream_t stream) {
  GLMTUNE_ASSERT(w.defined() && w.dim() == 3,
                 "cuda::quantize_fp8_weight_grouped: w must be [G, N, K], got {}", describe(w));
  std::vector<Fp8Blocks> out;
  out.reserve(size_t(w.size(0)));
  for (int64_t g = 0; g < w.size(0); ++g)
    out.push_back(quantize_fp8_blocks(w.select(0, g), 128, 128, stream));
  return out;
}

void fp8_grouped_linear(Tensor& y, const std::vector<Fp8Blocks>& x, const std::vector<Fp8Blocks>& w,
                        const std::vector<int64_t>& offsets, cudaStream_t stream) {
  const char* op = "cuda::fp8_grouped_linear";
  GLMTUNE_ASSERT(x.size() == w.size() && y.defined() && y.dim() == 2 && y.is_contiguous(),
                 "{}: {} activation groups, {} weights, output {}", op, x.size(), w.size(),
                 describe(y));
  check_offsets(offsets, x.size(), y.size(0), op);
  for (size_t g = 0; g < x.size(); ++g) {
    if (offsets[g + 1] == offsets[g]) continue;
    Tensor yg = y.slice(0, offsets[g], offsets[g + 1]);
    linear_impl(yg, x[g], w[g], false, stream, op, "x", "weight");
  }
}

void fp8_grouped_linear_backward_input(Tensor& dx, const std::vector<Fp8Blocks>& dy,
                                       const std::vector<Fp8Blocks>& w,
                                       const std::vector<int64_t>& offsets, cudaStream_t stream) {
  const char* op = "cuda::fp8_grouped_linear_backward_input";
  GLMTUNE_ASSERT(dy.size() == w.size() && dx.defined() && dx.dim() == 2 && dx.is_contiguous(),
                 "{}: {} gradient groups, {} weights, dx {}", op, dy.size(), w.size(),
                 describe(dx));
  check_offsets(offsets, dy.size(), dx.size(0), op);
  for (size_t g = 0; g < dy.size(); ++g) {
    if (offsets[g + 1] == offsets[g]) continue;
    Tensor dxg = dx.slice(0, offsets[g], offsets[g + 1]);
    // Freed when the next group's is made; the allocator hands the same block back on this stream.
    const Fp8Blocks w_t = transpose_fp8_weight(w[g], stream);
    linear_impl(dxg, dy[g], w_t, false, stream, op, "dy", "transposed weight");
  }
}

void fp8_grouped_linear_backward_weight(Tensor& dw, const std::vector<Fp8Blocks>& dy,
                                        const std::vector<Fp8Blocks>& x,
                                        const std::vector<int64_t>& offsets, cudaStream_t stream) {
  const char* op = "cuda::fp8_grouped_linear_backward_weight";
  GLMTUNE_ASSERT(dy.size() == x.size() && dw.defined() && dw.dim() == 3 && dw.is_contiguous() &&
                     dw.size(0) == int64_t(dy.size()),
                 "{}: {} gradient groups, {} input groups, dw {}", op, dy.size(), x.size(),
                 describe(dw));
  GLMTUNE_ASSERT(!offsets.empty(), "{}: no offsets", op);
  check_offsets(offsets, dy.size(), offsets.back(), op);
  for (size_t g = 0; g < dy.size(); ++g) {
    if (offsets[g + 1] == offsets[g]) continue;
    Tensor dwg = dw.select(0, int64_t(g));
    fp8_linear_backward_weight(dwg, dy[g], x[g], true, stream);
  }
}

}  // namespace glmtune::cuda
