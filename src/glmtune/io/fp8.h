#pragma once
// FP8 block dequantisation of the released checkpoint.
//
// The FP8 release stores most large linear weights as float8 e4m3 `[out, in]` with a float32
// companion `<name>_scale_inv` of shape `[ceil(out/128), ceil(in/128)]`: one scale per 128x128
// block, partial blocks at the right and bottom edges included. Despite its name the scale
// multiplies: w[r, c] = fp8(w)[r, c] * scale_inv[r / 128, c / 128].
//
// glmtune computes that product exactly (an e4m3 value has 4 significant bits and a float32 24,
// so the product is exact in double) and rounds it once to bfloat16, nearest-even. Converting
// through a float32 product first (as `w.float() * s` in PyTorch does) rounds twice and can differ
// in the last bf16 bit in rare ties; the single rounding is what a float64 reference gives.

#include <cstdint>
#include <string>

#include "glmtune/tensor/tensor.h"

namespace glmtune::io {

inline constexpr int64_t kFp8BlockSize = 128;

// The block-scale companion of FP8 weight `weight` ("….weight" → "….weight_scale_inv").
std::string fp8_scale_name(const std::string& weight);

// The scale shape a weight of shape [rows, cols] needs: [ceil(rows/br), ceil(cols/bc)].
Shape fp8_scale_shape(const Shape& weight_shape, int64_t block_rows = kFp8BlockSize,
                      int64_t block_cols = kFp8BlockSize);

// out[r * cols + c] = bf16(fp8(weight[r * cols + c]) * scale[(r / br) * scale_cols + c / bc]),
// with scale_cols = ceil(cols / bc). Rows are spread over all cores (OpenMP).
void dequantize_fp8_block_bf16(const uint8_t* weight, const float* scale, int64_t rows,
                               int64_t cols, int64_t block_rows, int64_t block_cols, uint16_t* out);

// One element, as above (for tests and scalar paths).
uint16_t dequantize_fp8_value_bf16(uint8_t weight, float scale);

// Tensor form: `weight` fp8e4m3 [rows, cols], `scale_inv` f32 or bf16 of fp8_scale_shape(...).
// Returns a new contiguous bf16 CPU tensor. Throws glmtune::Error (naming `name`) on a dtype or
// shape mismatch.
Tensor dequantize_fp8_block(const Tensor& weight, const Tensor& scale_inv,
                            int64_t block_rows = kFp8BlockSize, int64_t block_cols = kFp8BlockSize,
                            const std::string& name = "weight");

}  // namespace glmtune::io
