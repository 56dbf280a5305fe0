#include "glmtune/ops/fp8.h"

#include <algorithm>
#include <cmath>

#include "glmtune/base/error.h"
#include "glmtune/io/fp8.h"
#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/grad.h"
#include "glmtune/ops/linear.h"
#include "glmtune/tensor/dtype.h"

namespace glmtune::ops {
namespace {

int64_t blocks_of(int64_t n, int64_t block) { return (n + block - 1) / block; }

void check_blocks(int64_t block_rows, int64_t block_cols, const char* op) {
  GLMTUNE_ASSERT(block_rows >= 1 && block_cols >= 1, "{}: blocks of {} x {} must be positive", op,
                 block_rows, block_cols);
}

}  // namespace

Fp8Blocks quantize_fp8_blocks(const Tensor& x_in, int64_t block_rows, int64_t block_cols) {
  const char* op = "quantize_fp8_blocks";
  check_blocks(block_rows, block_cols, op);
  GLMTUNE_ASSERT(
      x_in.defined() && x_in.dim() == 2 &&
          (x_in.dtype() == DType::f32 || x_in.dtype() == DType::bf16 || x_in.dtype() == DType::f64),
      "{}: x must be a [rows, cols] tensor in f32, bf16 or f64, got {}", op,
      x_in.defined() ? x_in.str() : "undefined");
  GLMTUNE_DISPATCH_CUDA(x_in, cuda_path::quantize_fp8_blocks(x_in, block_rows, block_cols));
  const Tensor x = x_in.to(DType::f32).contiguous();
  const int64_t rows = x.size(0), cols = x.size(1);
  const int64_t brs = blocks_of(rows, block_rows), bcs = blocks_of(cols, block_cols);
  Fp8Blocks q;
  q.block_rows = block_rows;
  q.block_cols = block_cols;
  q.values = Tensor::empty({rows, cols}, DType::fp8e4m3);
  q.scales = Tensor::empty({brs, bcs}, DType::f32);
  const float* xp = x.data<float>();
  auto* vp = static_cast<uint8_t*>(q.values.data_ptr());
  float* sp = q.scales.data<float>();
#pragma omp parallel for schedule(static) collapse(2) if (rows * cols > (1 << 16))
  for (int64_t br = 0; br < brs; ++br)
    for (int64_t bc = 0; bc < bcs; ++bc) {
      const int64_t r0 = br * block_rows, r1 = std::min(rows, r0 + block_rows);
      const int64_t c0 = bc * block_cols, c1 = std::min(cols, c0 + block_cols);
      // fmax would skip a NaN; the block's amax must carry it.
      double amax = 0.0;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) {
          const double a = std::fabs(double(xp[r * cols + c]));
          amax = std::isnan(a) || a > amax ? a : amax;
        }
      // std::max keeps a NaN amax (NaN < 1e-12 is false), so a NaN block gets a NaN scale.
      const float scale = float(std::max(amax, 1e-12) / kFp8E4m3Max);
      sp[br * bcs + bc] = scale;
      const float limit = float(kFp8E4m3Max);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) {
          const float v = xp[r * cols + c] / scale;
          vp[r * cols + c] = f32_to_fp8e4m3(std::isnan(v) ? v : std::clamp(v, -limit, limit));
        }
    }
  return q;
}

Tensor dequantize_fp8_blocks(const Fp8Blocks& q, DType out) {
  const char* op = "dequantize_fp8_blocks";
  GLMTUNE_CPU_ONLY(op, q.values);
  check_blocks(q.block_rows, q.block_cols, op);
  GLMTUNE_ASSERT(out == DType::f32 || out == DType::bf16, "{}: output in f32 or bf16, not {}", op,
                 dtype_name(out));
  if (out == DType::bf16)
    return io::dequantize_fp8_block(q.values, q.scales, q.block_rows, q.block_cols, op);
  GLMTUNE_ASSERT(q.values.defined() && q.values.dtype() == DType::fp8e4m3 && q.values.dim() == 2,
                 "{}: values must be fp8e4m3 [rows, cols], got {}", op,
                 q.values.defined() ? q.values.str() : "undefined");
  const int64_t rows = q.values.size(0), cols = q.values.size(1);
  const int64_t bcs = blocks_of(cols, q.block_cols);
  const Shape scale_shape{blocks_of(rows, q.block_rows), bcs};
  GLMTUNE_ASSERT(
      q.scales.defined() && q.scales.dtype() == DType::f32 && q.scales.shape() == scale_shape,
      "{}: scales {} do not fit {} in blocks of {} x {}", op,
      q.scales.defined() ? q.scales.str() : "undefined", q.values.str(), q.block_rows,
      q.block_cols);
  const Tensor v = q.values.contiguous(), s = q.scales.contiguous();
  const auto* vp = static_cast<const uint8_t*>(v.data_ptr());
  const float* sp = s.data<float>();
  Tensor x = Tensor::empty({rows, cols}, DType::f32);
  float* xp = x.data<float>();
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 16))
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      xp[r * cols + c] = float(double(fp8e4m3_to_f32(vp[r * cols + c])) *
                               double(sp[(r / q.block_rows) * bcs + c / q.block_cols]));
  return x;
}

Tensor dequantize_fp8_pieces(const Tensor& codes, const Tensor& scales, int64_t piece_rows,
                             const Shape& shape, DType out) {
  const char* op = "dequantize_fp8_pieces";
  GLMTUNE_ASSERT(codes.defined() && codes.dtype() == DType::fp8e4m3 && codes.dim() == 2 &&
                     piece_rows > 0 && codes.size(0) % piece_rows == 0 &&
                     shape_numel(shape) == codes.numel(),
                 "{}: codes {} must be fp8e4m3 pieces of {} rows, {} elements", op,
                 codes.defined() ? codes.str() : "undefined", piece_rows, shape_numel(shape));
  GLMTUNE_ASSERT(out == DType::bf16 || out == DType::f32 || out == DType::f64,
                 "{}: output in bf16, f32 or f64, not {}", op, std::string(dtype_name(out)));
  GLMTUNE_DISPATCH_CUDA(codes,
                        cuda_path::dequantize_fp8_pieces(codes, scales, piece_rows, shape, out));
  const int64_t pieces = codes.size(0) / piece_rows;
  GLMTUNE_ASSERT(scales.defined() && scales.dim() == 3 && scales.size(0) == pieces,
                 "{}: scales {} must hold one block grid per piece ({})", op,
                 scales.defined() ? scales.str() : "undefined", pieces);
  Tensor values = Tensor::empty({codes.size(0), codes.size(1)}, DType::bf16);
  for (int64_t p = 0; p < pieces; ++p)
    values.narrow(0, p * piece_rows, piece_rows)
        .copy_(io::dequantize_fp8_block(codes.narrow(0, p * piece_rows, piece_rows),
                                        scales.select(0, p), io::kFp8BlockSize, io::kFp8BlockSize,
                                        op));
  return values.to(out).view(shape);
}

Fp8Blocks fp8_weight_from_codes(const Tensor& codes, const Tensor& scales) {
  const char* op = "fp8_weight_from_codes";
  GLMTUNE_ASSERT(codes.defined() && codes.dtype() == DType::fp8e4m3 && codes.dim() == 2 &&
                     codes.stride(1) == 1 &&
                     (codes.size(0) <= 1 || codes.stride(0) == codes.size(1)),
                 "{}: codes {} must be contiguous fp8e4m3 [rows, cols]", op,
                 codes.defined() ? codes.str() : "undefined");
  GLMTUNE_ASSERT(
      scales.defined() && scales.dtype() == DType::f32 && scales.device() == codes.device() &&
          scales.shape() == Shape({blocks_of(codes.size(0), 128), blocks_of(codes.size(1), 128)}),
      "{}: scales {} do not fit codes {} in 128 x 128 blocks", op,
      scales.defined() ? scales.str() : "undefined", codes.str());
  GLMTUNE_DISPATCH_CUDA(codes, cuda_path::fp8_weight_from_codes(codes, scales));
  return Fp8Blocks{codes, scales.contiguous(), 128, 128};
}

namespace {

// Q(a; br × bc) of a [..., n] tensor viewed as [rows, n], in a's dtype and shape (an input an
// Fp8InputShare names is quantised once).
Tensor quantized(const Tensor& a, int64_t block_rows, int64_t block_cols) {
  return dequantize_fp8_blocks(fp8_input_tiles(a, block_rows, block_cols))
      .to(a.dtype())
      .view(a.shape());
}

// Q(W; 128 × 128) in W's dtype: the blocks fp8_weight_blocks gives.
Tensor quantized_weight(const Tensor& w) {
  return dequantize_fp8_blocks(fp8_weight_blocks(w)).to(w.dtype());
}

void check_fp8_linear(const Tensor& x, const Tensor& weight, const char* op) {
  GLMTUNE_ASSERT(x.defined() && x.dim() >= 1 && weight.defined() && weight.dim() == 2 &&
                     x.size(-1) == weight.size(1) && x.dtype() == weight.dtype(),
                 "{}: input {} does not fit weight {} (x [..., in], W [out, in], one dtype)", op,
                 x.defined() ? x.str() : "undefined",
                 weight.defined() ? weight.str() : "undefined");
}

void check_fp8_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const char* op) {
  check_fp8_linear(x, weight, op);
  GLMTUNE_ASSERT(dy.defined() && dy.dim() == x.dim() && dy.size(-1) == weight.size(0) &&
                     dy.numel() / dy.size(-1) == x.numel() / x.size(-1),
                 "{}: dy {} does not fit input {} and weight {}", op, dy.str(), x.str(),
                 weight.str());
}

}  // namespace

Tensor linear_fp8(const Tensor& x, const Tensor& weight) {
  check_fp8_linear(x, weight, "linear_fp8");
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::linear_fp8(x, weight));
  return linear(quantized(x, 1, 128), quantized_weight(weight));
}

void linear_fp8_backward_add(Tensor* dx_sum, const Tensor& dy, const Tensor& x,
                             const Tensor& weight, Tensor* grad_weight) {
  check_fp8_backward(dy, x, weight, "linear_fp8_backward_add");
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::linear_fp8_backward_add(dx_sum, dy, x, weight, grad_weight));
  if (grad_if_trained(grad_weight, weight))
    linear_backward(quantized(dy, 128, 1), quantized(x, 128, 1), weight, grad_weight, nullptr,
                    /*need_input_grad=*/false);
  if (dx_sum)
    linear_backward_add(*dx_sum, quantized(dy, 1, 128), x, quantized_weight(weight), nullptr);
}

Tensor linear_fp8_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                           Tensor* grad_weight) {
  check_fp8_backward(dy, x, weight, "linear_fp8_backward");
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::linear_fp8_backward(dy, x, weight, grad_weight));
  Tensor dx;
  linear_fp8_backward_add(&dx, dy, x, weight, grad_weight);
  return dx.to(x.dtype());
}

}  // namespace glmtune::ops
