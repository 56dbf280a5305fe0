// Clamped SwiGLU forward and backward kernels (ops/cuda/swiglu.h).

#include <initializer_list>
#include <utility>

#include "glmtune/ops/cuda/common.cuh"
#include "glmtune/ops/cuda/swiglu.cuh"
#include "glmtune/ops/cuda/swiglu.h"

namespace glmtune::cuda {
namespace {

using detail::bf16;

constexpr int kThreads = 256;

template <typename T>
struct RowPtrs {
  const T* gate;
  int64_t ld_gate;
  const T* up;
  int64_t ld_up;
};

// One block per row; the threads stride over the row VEC elements at a time.
template <int VEC, typename T>
__global__ void __launch_bounds__(kThreads)
    swiglu_fwd_kernel(RowPtrs<T> in, T* __restrict__ out, int64_t ld_out, int cols, float lim) {
  const int64_t row = blockIdx.x;
  const T* g = in.gate + row * in.ld_gate;
  const T* u = in.up + row * in.ld_up;
  T* o = out + row * ld_out;
  for (int j = threadIdx.x * VEC; j < cols; j += blockDim.x * VEC) {
    float gv[VEC], uv[VEC], ov[VEC];
    detail::load_vec<VEC>(g + j, gv);
    detail::load_vec<VEC>(u + j, uv);
#pragma unroll
    for (int k = 0; k < VEC; ++k) ov[k] = swiglu_math::value(gv[k], uv[k], lim);
    detail::store_vec<VEC>(o + j, ov);
  }
}

template <int VEC, typename T>
__global__ void __launch_bounds__(kThreads)
    swiglu_bwd_kernel(RowPtrs<T> in, const T* __restrict__ dout, int64_t ld_dout,
                      T* __restrict__ dgate, int64_t ld_dgate, T* __restrict__ dup, int64_t ld_dup,
                      int cols, float lim) {
  const int64_t row = blockIdx.x;
  const T* g = in.gate + row * in.ld_gate;
  const T* u = in.up + row * in.ld_up;
  const T* d = dout + row * ld_dout;
  T* dg = dgate + row * ld_dgate;
  T* du = dup + row * ld_dup;
  for (int j = threadIdx.x * VEC; j < cols; j += blockDim.x * VEC) {
    float gv[VEC], uv[VEC], dv[VEC], dgv[VEC], duv[VEC];
    detail::load_vec<VEC>(g + j, gv);
    detail::load_vec<VEC>(u + j, uv);
    detail::load_vec<VEC>(d + j, dv);
#pragma unroll
    for (int k = 0; k < VEC; ++k) swiglu_math::grads(gv[k], uv[k], dv[k], lim, dgv[k], duv[k]);
    detail::store_vec<VEC>(dg + j, dgv);
    detail::store_vec<VEC>(du + j, duv);
  }
}

// Every operand shares gate's dtype (bf16, or f32 in the fp32 mode) and shape.
void check_operand(const Tensor& t, const Tensor& like, const char* what, const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(t.defined() && t.device().is_cuda() &&
                              (t.dtype() == DType::bf16 || t.dtype() == DType::f32) &&
                              t.dtype() == like.dtype() && t.shape() == like.shape() &&
                              t.device() == like.device() && detail::has_row_layout(t),
                          std::string(op) + ": " + what + " " + detail::describe(t) +
                              " must be a bf16 or f32 CUDA tensor of the dtype and shape of " +
                              like.str() + ", contiguous or rows with unit inner stride");
}

// The checks every launch makes: gate sets the dtype and shape of all `others` (name, tensor), and
// the limit is positive.
void check_launch(const char* op, const Tensor& gate, double limit,
                  std::initializer_list<std::pair<const char*, const Tensor*>> others) {
  GLMTUNE_CUDA_OP_REQUIRE(gate.defined() && gate.dim() >= 1,
                          std::string(op) + ": gate must have at least one dimension");
  check_operand(gate, gate, "gate", op);
  for (const auto& [what, t] : others) check_operand(*t, gate, what, op);
  GLMTUNE_CUDA_OP_REQUIRE(limit > 0, std::string(op) + ": limit must be positive");
}

// False for an empty launch (nothing to do); else checks that the rows and columns fit the
// kernels' 32-bit indices.
bool has_work(const detail::RowsView& g, const char* op) {
  if (g.rows == 0 || g.cols == 0) return false;
  GLMTUNE_CUDA_OP_REQUIRE(g.cols <= INT32_MAX && g.rows <= INT32_MAX,
                          std::string(op) + ": tensor too large");
  return true;
}

// 16-byte accesses need bf16 rows of whole 8-element groups on 16-byte boundaries.
bool vector_ok(DType dtype, int64_t cols, std::initializer_list<detail::RowsView> views) {
  if (dtype != DType::bf16 || cols % 8 != 0) return false;
  for (const auto& v : views)
    if (!detail::aligned16(v.data) || v.ld % 8 != 0) return false;
  return true;
}

}  // namespace

void swiglu_clamped_out(Tensor& out, const Tensor& gate, const Tensor& up, double limit,
                        cudaStream_t stream) {
  const char* op = "cuda::swiglu_clamped";
  check_launch(op, gate, limit, {{"up", &up}, {"out", &out}});
  const detail::RowsView g = detail::rows_view(gate), u = detail::rows_view(up),
                         o = detail::rows_view(out);
  if (!has_work(g, op)) return;
  detail::DeviceGuard guard(gate.device().index);
  auto launch = [&]<typename T>(auto kernel, T*) {
    const RowPtrs<T> in{static_cast<const T*>(g.data), g.ld, static_cast<const T*>(u.data), u.ld};
    kernel<<<unsigned(g.rows), kThreads, 0, stream>>>(in, static_cast<T*>(o.data), o.ld,
                                                      int(g.cols), float(limit));
  };
  if (gate.dtype() == DType::f32)
    launch(swiglu_fwd_kernel<1, float>, static_cast<float*>(nullptr));
  else if (vector_ok(gate.dtype(), g.cols, {g, u, o}))
    launch(swiglu_fwd_kernel<8, bf16>, static_cast<bf16*>(nullptr));
  else
    launch(swiglu_fwd_kernel<1, bf16>, static_cast<bf16*>(nullptr));
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

Tensor swiglu_clamped(const Tensor& gate, const Tensor& up, double limit, cudaStream_t stream) {
  GLMTUNE_CUDA_OP_REQUIRE(gate.defined(), "cuda::swiglu_clamped: gate is undefined");
  Tensor out = Tensor::empty(gate.shape(), gate.dtype(), gate.device());
  swiglu_clamped_out(out, gate, up, limit, stream);
  return out;
}

void swiglu_clamped_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, double limit,
                             Tensor& dgate, Tensor& dup, cudaStream_t stream) {
  const char* op = "cuda::swiglu_clamped_backward";
  check_launch(op, gate, limit, {{"up", &up}, {"dout", &dout}, {"dgate", &dgate}, {"dup", &dup}});
  const detail::RowsView g = detail::rows_view(gate), u = detail::rows_view(up),
                         d = detail::rows_view(dout), dg = detail::rows_view(dgate),
                         du = detail::rows_view(dup);
  if (!has_work(g, op)) return;
  detail::DeviceGuard guard(gate.device().index);
  auto launch = [&]<typename T>(auto kernel, T*) {
    const RowPtrs<T> in{static_cast<const T*>(g.data), g.ld, static_cast<const T*>(u.data), u.ld};
    kernel<<<unsigned(g.rows), kThreads, 0, stream>>>(
        in, static_cast<const T*>(d.data), d.ld, static_cast<T*>(dg.data), dg.ld,
        static_cast<T*>(du.data), du.ld, int(g.cols), float(limit));
  };
  if (gate.dtype() == DType::f32)
    launch(swiglu_bwd_kernel<1, float>, static_cast<float*>(nullptr));
  else if (vector_ok(gate.dtype(), g.cols, {g, u, d, dg, du}))
    launch(swiglu_bwd_kernel<8, bf16>, static_cast<bf16*>(nullptr));
  else
    launch(swiglu_bwd_kernel<1, bf16>, static_cast<bf16*>(nullptr));
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

}  // namespace glmtune::cuda
