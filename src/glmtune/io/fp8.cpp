#include "glmtune/io/fp8.h"

#include <algorithm>
#include <array>

#include "glmtune/base/error.h"
#include "glmtune/tensor/convert.h"

namespace glmtune::io {
namespace {

// Every e4m3 code as a double (exact), decoded once with the shared conversion.
const std::array<double, 256>& fp8_table() {
  static const std::array<double, 256> table = [] {
    std::array<double, 256> t{};
    for (int i = 0; i < 256; ++i) t[size_t(i)] = double(fp8e4m3_to_f32(uint8_t(i)));
    return t;
  }();
  return table;
}

// The exact product rounded once to bf16: round-to-odd to float32 keeps enough information for
// the final nearest-even rounding to bf16 to equal a direct rounding of the exact value.
inline uint16_t round_product(double exact) {
  return f32_to_bf16(convert::double_to_float_round_odd(exact));
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

std::string fp8_scale_name(const std::string& weight) {
  return weight.substr(0, weight.size() - std::string(".weight").size()) + ".weight_scale_inv";
}

Shape fp8_scale_shape(const Shape& weight_shape, int64_t block_rows, int64_t block_cols) {
  GLMTUNE_ASSERT(weight_shape.size() == 2, "FP8 block scales need a 2-D weight, got {}",
                 shape_str(weight_shape));
  return {ceil_div(weight_shape[0], block_rows), ceil_div(weight_shape[1], block_cols)};
}

uint16_t dequantize_fp8_value_bf16(uint8_t weight, float scale) {
  return round_product(fp8_table()[weight] * double(scale));
}

void dequantize_fp8_block_bf16(const uint8_t* weight, const float* scale, int64_t rows,
                               int64_t cols, int64_t block_rows, int64_t block_cols,
                               uint16_t* out) {
  GLMTUNE_ASSERT(block_rows > 0 && block_cols > 0, "block {}x{}", block_rows, block_cols);
  const auto& table = fp8_table();
  const int64_t scale_cols = ceil_div(cols, block_cols);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* scale_row = scale + (r / block_rows) * scale_cols;
    const uint8_t* w = weight + r * cols;
    uint16_t* o = out + r * cols;
    for (int64_t c0 = 0; c0 < cols; c0 += block_cols) {
      const double s = double(scale_row[c0 / block_cols]);
      const int64_t c1 = std::min(cols, c0 + block_cols);  // the last block may be partial
      for (int64_t c = c0; c < c1; ++c) o[c] = round_product(table[w[c]] * s);
    }
  }
}

Tensor dequantize_fp8_block(const Tensor& weight, const Tensor& scale_inv, int64_t block_rows,
                            int64_t block_cols, const std::string& name) {
  if (weight.dtype() != DType::fp8e4m3)
    throw Error("has a weight_scale_inv companion but is " +
                    std::string(dtype_name(weight.dtype())) + ", not fp8e4m3",
                name, "only FP8 e4m3 weights are block-dequantised");
  if (weight.dim() != 2)
    throw Error("FP8 weight has shape " + shape_str(weight.shape()) +
                    "; block dequantisation needs [out, in]",
                name);
  if (scale_inv.dtype() != DType::f32 && scale_inv.dtype() != DType::bf16)
    throw Error("scale_inv is " + std::string(dtype_name(scale_inv.dtype())) + ", expected f32",
                name);
  const Shape expected = fp8_scale_shape(weight.shape(), block_rows, block_cols);
  if (scale_inv.shape() != expected)
    throw Error("scale_inv has shape " + shape_str(scale_inv.shape()) + " but a " +
                    shape_str(weight.shape()) + " weight in " + std::to_string(block_rows) + "x" +
                    std::to_string(block_cols) + " blocks needs " + shape_str(expected),
                name, "the weight and its scale do not belong together");
  Tensor w = weight.to(Device::cpu()).contiguous();
  Tensor s = scale_inv.to(Device::cpu()).to(DType::f32).contiguous();
  Tensor out = Tensor::empty(weight.shape(), DType::bf16);
  dequantize_fp8_block_bf16(static_cast<const uint8_t*>(w.data_ptr()),
                            static_cast<const float*>(s.data_ptr()), weight.size(0), weight.size(1),
                            block_rows, block_cols, static_cast<uint16_t*>(out.data_ptr()));
  return out;
}

}  // namespace glmtune::io
