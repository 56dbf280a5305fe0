#pragma once
// Element conversion between dtypes, shared by the CPU copy path and the CUDA kernels.
// Narrow float targets are rounded correctly from any source: a double source is first rounded to
// float with round-to-odd, which makes the second rounding (to bf16/f16/fp8, nearest even) exact.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "glmtune/tensor/dtype.h"

namespace glmtune::convert {

GLMTUNE_HD float double_to_float_round_odd(double d) {
  float f = float(d);
  double back = double(f);
  if (back == d || d != d) return f;
  if ((back > d) == (d > 0)) {
    // Rounded away from zero: step back towards zero to get the truncated value.
    uint32_t bits = float_bits(f);
    bits -= 1;
    f = bits_float(bits);
  }
  return bits_float(float_bits(f) | 1u);
}

GLMTUNE_HD double load(const void* p, DType t) {
  switch (t) {
    case DType::f32:
      return *static_cast<const float*>(p);
    case DType::f64:
      return *static_cast<const double*>(p);
    case DType::bf16:
      return bf16_to_f32(*static_cast<const uint16_t*>(p));
    case DType::f16:
      return f16_to_f32(*static_cast<const uint16_t*>(p));
    case DType::fp8e4m3:
      return fp8e4m3_to_f32(*static_cast<const uint8_t*>(p));
    case DType::i32:
      return *static_cast<const int32_t*>(p);
    case DType::i64:
      return double(*static_cast<const int64_t*>(p));
    case DType::boolean:
      return *static_cast<const uint8_t*>(p) ? 1.0 : 0.0;
  }
  return 0.0;
}

// Writes a float to a narrow float target (bf16, f16, fp8), rounding to nearest even; returns
// false for any other dtype. Both store paths below round through here.
GLMTUNE_HD bool store_narrow(void* p, DType t, float v) {
  switch (t) {
    case DType::bf16:
      *static_cast<uint16_t*>(p) = f32_to_bf16(v);
      return true;
    case DType::f16:
      *static_cast<uint16_t*>(p) = f32_to_f16(v);
      return true;
    case DType::fp8e4m3:
      *static_cast<uint8_t*>(p) = f32_to_fp8e4m3(v);
      return true;
    default:
      return false;
  }
}

// Integer targets truncate toward zero (as a C cast does); bool is value != 0.
GLMTUNE_HD void store(void* p, DType t, double v) {
  switch (t) {
    case DType::f32:
      *static_cast<float*>(p) = float(v);
      return;
    case DType::f64:
      *static_cast<double*>(p) = v;
      return;
    case DType::bf16:
    case DType::f16:
    case DType::fp8e4m3:
      store_narrow(p, t, double_to_float_round_odd(v));
      return;
    case DType::i32:
      *static_cast<int32_t*>(p) = int32_t(v);
      return;
    case DType::i64:
      *static_cast<int64_t*>(p) = int64_t(v);
      return;
    case DType::boolean:
      *static_cast<uint8_t*>(p) = v != 0.0;
      return;
  }
}

// Fast path for the common float32 <-> narrow conversions (no double round trip needed: float
// holds every bf16/f16/fp8 value exactly).
GLMTUNE_HD void convert_element(const void* src, DType st, void* dst, DType dt) {
  if (st == DType::f32 || st == DType::bf16 || st == DType::f16 || st == DType::fp8e4m3) {
    const float v = float(load(src, st));
    if (dt == DType::f32) {
      *static_cast<float*>(dst) = v;
      return;
    }
    if (store_narrow(dst, dt, v)) return;
  }
  if (st == DType::i64 && dt == DType::i64) {
    *static_cast<int64_t*>(dst) = *static_cast<const int64_t*>(src);
    return;
  }
  store(dst, dt, load(src, st));
}

}  // namespace glmtune::convert
