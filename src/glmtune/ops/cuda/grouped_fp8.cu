// Grouped block-scaled FP8 GEMMs with the offsets on the device (ops/cuda/fp8.h): the checks and
// the launches of the Hopper kernel of ops/cuda/grouped_fp8_sm90.cuh.

#include <algorithm>
#include <string>

#include "glmtune/ops/cuda/common.cuh"
#include "glmtune/ops/cuda/fp8.h"
#include "glmtune/ops/cuda/grouped_fp8_sm90.cuh"
#include "glmtune/ops/cuda/sm90a.h"

namespace glmtune::cuda {
namespace {

void check_offsets(const Tensor& offsets, const Tensor& like, const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(offsets.defined() && offsets.dtype() == DType::i32 &&
                              offsets.is_contiguous() && offsets.device() == like.device() &&
                              offsets.dim() == 1 && offsets.size(0) >= 2,
                          std::string(op) + ": offsets must be int32 [groups + 1] on " +
                              like.device().str() + ", got " + detail::describe(offsets));
}

// One launch over groups first .. first + count − 1 (offsets + first), with `w` the stack of
// exactly those groups' [n, k] blocks.
void launch(const char* op, Tensor& out, const ops::Fp8Blocks& x, const ops::Fp8Blocks& w,
            const Tensor& offsets, int64_t first, int64_t count, bool accumulate,
            cudaStream_t stream) {
  const int64_t rows = x.values.size(0), n = out.size(1), k = x.values.size(1);
  if (rows == 0) return;
  detail::DeviceGuard guard(out.device().index);
  sm90::grouped_fp8::Args a{};
  a.offsets = offsets.data<int32_t>() + first;
  a.groups = int(count);
  a.n = n;
  a.k = k;
  a.b_scales = w.scales.data<float>();
  a.b_scales_ld = w.scales.stride(0);
  a.out = out.data_ptr();
  a.out_f32 = out.dtype() == DType::f32;
  a.accumulate = accumulate;
  int sms = 0;  // one persistent block per SM
  GLMTUNE_CUDA_CHECK(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, out.device().index));
  const bool launched = sm90::launch_grouped_fp8_gemm(x.values.data_ptr(), rows, x.values.stride(0),
                                                      x.scales.data<float>(), x.scales.stride(1),
                                                      w.values.data_ptr(), a, sms, stream);
  GLMTUNE_CUDA_OP_REQUIRE(launched, std::string(op) + ": TMA cannot describe the operands");
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool fp8_grouped_device_offsets_possible(int device, int64_t groups, int64_t n, int64_t k) {
  return groups >= 1 && groups <= sm90::grouped_fp8::kMaxGroups && n > 0 && n % 128 == 0 && k > 0 &&
         k % 16 == 0 && groups * n < int64_t(INT32_MAX) && detail::sm90a_kernels_available(device);
}

bool fp8_grouped_device_offsets_fit(const ops::Fp8Blocks& x, const ops::Fp8Blocks& w_stack,
                                    const Tensor& out, int64_t groups) {
  if (x.block_rows != 1 || x.block_cols != 128 || !is_fp8_gemm_layout(x)) return false;
  if (w_stack.block_rows != 128 || w_stack.block_cols != 128 || !is_fp8_gemm_layout(w_stack))
    return false;
  if (!out.defined() || out.dim() != 2 || !out.is_contiguous() ||
      out.device() != x.values.device() || w_stack.values.device() != x.values.device() ||
      (out.dtype() != DType::bf16 && out.dtype() != DType::f32))
    return false;
  const int64_t rows = x.values.size(0), n = out.size(1), k = x.values.size(1);
  if (out.size(0) != rows || rows >= int64_t(INT32_MAX) || w_stack.values.size(0) != groups * n ||
      w_stack.values.size(1) != k)
    return false;
  if (!detail::aligned16(x.values.data_ptr()) || !detail::aligned16(x.scales.data_ptr()) ||
      !detail::aligned16(w_stack.values.data_ptr()) || !detail::aligned16(out.data_ptr()))
    return false;
  return fp8_grouped_device_offsets_possible(x.values.device().index, groups, n, k);
}

void fp8_grouped_linear(Tensor& y, const ops::Fp8Blocks& x, const ops::Fp8Blocks& w_stack,
                        const Tensor& offsets, cudaStream_t stream, bool accumulate) {
  const char* op = "cuda::fp8_grouped_linear (device offsets)";
  check_offsets(offsets, y, op);
  const int64_t groups = offsets.size(0) - 1;
  GLMTUNE_CUDA_OP_REQUIRE(fp8_grouped_device_offsets_fit(x, w_stack, y, groups),
                          std::string(op) + ": these operands do not fit the grouped FP8 kernel " +
                              "(fp8_grouped_device_offsets_fit): x " + detail::describe(x.values) +
                              ", w " + detail::describe(w_stack.values) + ", y " +
                              detail::describe(y) + ", " + std::to_string(groups) + " groups");
  launch(op, y, x, w_stack, offsets, 0, groups, accumulate, stream);
}

void fp8_grouped_linear_backward_input(Tensor& dx, const ops::Fp8Blocks& dy,
                                       const ops::Fp8Blocks& w_stack, const Tensor& offsets,
                                       cudaStream_t stream, int64_t chunk_bytes) {
  const char* op = "cuda::fp8_grouped_linear_backward_input (device offsets)";
  check_offsets(offsets, dx, op);
  const int64_t groups = offsets.size(0) - 1;
  const int64_t n = dy.values.size(1), k = dx.defined() && dx.dim() == 2 ? dx.size(1) : 0;
  GLMTUNE_CUDA_OP_REQUIRE(
      n % 128 == 0 && k % 128 == 0 && w_stack.values.defined() &&
          w_stack.values.size(0) == groups * n && w_stack.values.size(1) == k,
      std::string(op) + ": dy " + detail::describe(dy.values) + ", w " +
          detail::describe(w_stack.values) + " and dx " + detail::describe(dx) +
          " are not dy [rows, N], w [G · N, K], dx [rows, K] with N and K multiples of 128");
  const int64_t chunk = std::max<int64_t>(1, chunk_bytes / (n * k));
  for (int64_t first = 0; first < groups; first += chunk) {
    const int64_t count = std::min(chunk, groups - first);
    const ops::Fp8Blocks w_t = transpose_fp8_weight_stack(w_stack, n, first, count, stream);
    GLMTUNE_CUDA_OP_REQUIRE(fp8_grouped_device_offsets_fit(dy, w_t, dx, count),
                            std::string(op) + ": these operands do not fit the grouped FP8 " +
                                "kernel (fp8_grouped_device_offsets_fit): dy " +
                                detail::describe(dy.values) + ", dx " + detail::describe(dx));
    // The chunk's transposed codes are freed when the next chunk's are made; the allocator hands
    // the block back on this stream.
    launch(op, dx, dy, w_t, offsets, first, count, /*accumulate=*/false, stream);
  }
}

void fp8_grouped_linear_backward_weight(Tensor& dw, const Fp8TokenTiles& dy, const Fp8TokenTiles& x,
                                        const Tensor& offsets, cudaStream_t stream) {
  const char* op = "cuda::fp8_grouped_linear_backward_weight (device offsets)";
  check_offsets(offsets, dw, op);
  const int64_t groups = offsets.size(0) - 1;
  GLMTUNE_CUDA_OP_REQUIRE(
      dw.defined() && dw.dim() == 3 && dw.is_contiguous() && dw.size(0) == groups &&
          (dw.dtype() == DType::f32 || dw.dtype() == DType::bf16) && dy.codes.defined() &&
          x.codes.defined() && dy.codes.size(0) == dw.size(1) && x.codes.size(0) == dw.size(2) &&
          dy.padded == x.padded && dy.codes.size(1) == dy.padded && x.codes.size(1) == x.padded &&
          dy.tiles.defined() && dy.tiles.numel() == groups + 1,
      std::string(op) + ": dy " + detail::describe(dy.codes) + ", x " + detail::describe(x.codes) +
          " and dw " + detail::describe(dw) +
          " are not the token tiles of one grouping and dw [G, N, K]");
  const int64_t n = dw.size(1), k = dw.size(2);
  GLMTUNE_CUDA_OP_REQUIRE(
      fp8_grouped_device_offsets_possible(dw.device().index, groups, n, k) && k % 128 == 0 &&
          dy.padded % 128 == 0 && dy.padded < int64_t(INT32_MAX),
      std::string(op) + ": N = " + std::to_string(n) + " and K = " + std::to_string(k) +
          " must be multiples of 128 on an sm_90a device, at most " +
          std::to_string(sm90::grouped_fp8::kMaxGroups) + " groups");
  if (dy.padded == 0) return;
  detail::DeviceGuard guard(dw.device().index);
  sm90::grouped_fp8::Args a{};
  a.offsets = offsets.data<int32_t>();
  a.groups = int(groups);
  a.n = n;
  a.k = k;
  // Both quantisations computed the same tiles from the same offsets.
  a.token_tiles = dy.tiles.data<int32_t>();
  a.out = dw.data_ptr();
  a.out_f32 = dw.dtype() == DType::f32;
  a.accumulate = true;
  int sms = 0;
  GLMTUNE_CUDA_CHECK(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dw.device().index));
  const bool launched = sm90::launch_grouped_fp8_weight_grad(
      dy.codes.data_ptr(), dy.scales.data<float>(), dy.scales.size(1), x.codes.data_ptr(),
      x.scales.data<float>(), x.scales.size(1), dy.padded, a, sms, stream);
  GLMTUNE_CUDA_OP_REQUIRE(launched, std::string(op) + ": TMA cannot describe the operands");
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

}  // namespace glmtune::cuda
