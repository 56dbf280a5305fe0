// Grouped expert GEMMs with the offsets on the device (ops/cuda/grouped_gemm.h): checks and the
// launch of the Hopper kernels of ops/cuda/grouped_gemm_sm90.cuh.

#include "glmtune/ops/cuda/common.cuh"
#include "glmtune/ops/cuda/grouped_gemm.h"
#include "glmtune/ops/cuda/grouped_gemm_sm90.cuh"
#include "glmtune/ops/cuda/sm90a.h"

namespace glmtune::cuda {
namespace {

using sm90::GroupedMode;

// A bf16 row operand TMA can read: contiguous on the GPU, 16-byte rows and start.
bool tma_rows(const Tensor& t) {
  return t.defined() && t.device().is_cuda() && t.is_contiguous() && t.dtype() == DType::bf16 &&
         t.dim() >= 1 && t.size(-1) > 0 && t.size(-1) % 8 == 0 && detail::aligned16(t.data_ptr()) &&
         t.numel() / t.size(-1) < int64_t(INT32_MAX);
}

void check_offsets(const Tensor& offsets, int64_t groups, const Tensor& like, const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(
      offsets.defined() && offsets.dtype() == DType::i32 && offsets.is_contiguous() &&
          offsets.device() == like.device() && offsets.dim() == 1 && offsets.size(0) == groups + 1,
      std::string(op) + ": offsets must be int32 [" + std::to_string(groups + 1) + "] on " +
          like.device().str() + ", got " + detail::describe(offsets));
}

template <GroupedMode kMode>
void launch(const char* op, const Tensor& first, const Tensor& second, Tensor& out,
            const Tensor& offsets, int64_t groups, int64_t n, int64_t k, bool accumulate,
            cudaStream_t stream) {
  GLMTUNE_CUDA_OP_REQUIRE(grouped_gemm_device_offsets_fit(first, second, out, groups),
                          std::string(op) +
                              ": these operands need the host-offset form "
                              "(grouped_gemm_device_offsets_fit is false): first " +
                              detail::describe(first) + ", second " + detail::describe(second) +
                              ", out " + detail::describe(out));
  check_offsets(offsets, groups, first, op);
  const int64_t rows = first.numel() / first.size(-1);
  if (rows == 0 || groups == 0) return;
  detail::DeviceGuard guard(first.device().index);
  sm90::grouped::Args a{};
  a.offsets = offsets.data<int32_t>();
  a.groups = int(groups);
  a.rows = rows;
  a.n = n;
  a.k = k;
  a.out = out.data_ptr();
  a.out_f32 = out.dtype() == DType::f32;
  a.accumulate = accumulate;
  int sms = 0;  // one persistent block per SM
  GLMTUNE_CUDA_CHECK(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, first.device().index));
  const bool launched =
      sm90::launch_grouped_gemm<kMode>(first.data_ptr(), second.data_ptr(), a, sms, stream);
  GLMTUNE_CUDA_OP_REQUIRE(launched, std::string(op) + ": TMA cannot describe the operands");
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool grouped_gemm_device_offsets_fit(const Tensor& first, const Tensor& second, const Tensor& out,
                                     int64_t groups) {
  if (!tma_rows(first) || !tma_rows(second) || second.device() != first.device()) return false;
  if (!out.defined() || !out.is_contiguous() || out.device() != first.device() ||
      out.size(-1) % 8 != 0 || !detail::aligned16(out.data_ptr()))
    return false;
  if (out.dtype() != DType::bf16 && !(out.dtype() == DType::f32 && out.dim() == 3)) return false;
  if (groups < 1 || groups > sm90::grouped::kMaxGroups) return false;
  return detail::sm90a_kernels_available(first.device().index);
}

void grouped_linear(Tensor& y, const Tensor& x, const Tensor& w, const Tensor& offsets,
                    cudaStream_t stream, bool accumulate) {
  const char* op = "cuda::grouped_linear (device offsets)";
  GLMTUNE_CUDA_OP_REQUIRE(
      w.defined() && w.dim() == 3 && x.defined() && x.size(-1) == w.size(2) && y.defined() &&
          y.numel() == x.numel() / x.size(-1) * w.size(1) && y.size(-1) == w.size(1),
      std::string(op) + ": x " + detail::describe(x) + ", w " + detail::describe(w) + ", y " +
          detail::describe(y) + " are not x [rows, K], w [G, N, K], y [rows, N]");
  launch<GroupedMode::kForward>(op, x, w, y, offsets, w.size(0), w.size(1), w.size(2), accumulate,
                                stream);
}

void grouped_linear_backward_input(Tensor& dx, const Tensor& dy, const Tensor& w,
                                   const Tensor& offsets, cudaStream_t stream, bool accumulate) {
  const char* op = "cuda::grouped_linear_backward_input (device offsets)";
  GLMTUNE_CUDA_OP_REQUIRE(
      w.defined() && w.dim() == 3 && dy.defined() && dy.size(-1) == w.size(1) && dx.defined() &&
          dx.numel() == dy.numel() / dy.size(-1) * w.size(2) && dx.size(-1) == w.size(2),
      std::string(op) + ": dy " + detail::describe(dy) + ", w " + detail::describe(w) + ", dx " +
          detail::describe(dx) + " are not dy [rows, N], w [G, N, K], dx [rows, K]");
  launch<GroupedMode::kBackwardInput>(op, dy, w, dx, offsets, w.size(0), w.size(1), w.size(2),
                                      accumulate, stream);
}

void grouped_linear_backward_weight(Tensor& dw, const Tensor& dy, const Tensor& x,
                                    const Tensor& offsets, cudaStream_t stream) {
  const char* op = "cuda::grouped_linear_backward_weight (device offsets)";
  GLMTUNE_CUDA_OP_REQUIRE(
      dw.defined() && dw.dim() == 3 && dy.defined() && x.defined() && dy.size(-1) == dw.size(1) &&
          x.size(-1) == dw.size(2) && dy.numel() / dy.size(-1) == x.numel() / x.size(-1),
      std::string(op) + ": dy " + detail::describe(dy) + ", x " + detail::describe(x) + ", dw " +
          detail::describe(dw) + " are not dy [rows, N], x [rows, K], dw [G, N, K]");
  launch<GroupedMode::kBackwardWeight>(op, dy, x, dw, offsets, dw.size(0), dw.size(1), dw.size(2),
                                       /*accumulate=*/true, stream);
}

}  // namespace glmtune::cuda
