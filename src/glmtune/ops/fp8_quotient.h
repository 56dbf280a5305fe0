#pragma once
// x / scale as the FP8 quantisers need it, with one reciprocal per tile instead of a division per
// value. The quantisation rule divides every value of a tile by the tile's scale with correct
// rounding; a correctly rounded division costs a GPU about a dozen instructions and a branch per
// value, which made the quantisers instruction-bound at a quarter of the copy bandwidth.
//
// With inv = RN(1 / scale), q0 = RN(x · inv) is within a few ulps of x / scale, the residual
// r = x − q0 · scale is exact in one fma (Markstein), and RN(q0 + r · inv) is the correctly rounded
// quotient wherever r does not underflow. Where it does (|x| below about 2^-100), the quotient is
// below 2^-50 and its e4m3 code is ±0 whichever f32 it is; the sign is taken from x, as the
// quotient's is. Fp8Quant.QuotientByReciprocalGivesTheDivisionsCodes (test_fp8_quant) checks
// every bf16 x against a sweep of scales and random f32 ones: the codes equal, and the quotients
// above 2^-40 bit for bit.
//
// Valid for scales the rule makes from a finite amax: positive, at least 1e-12 / 448, finite, so
// that inv is a normal number. An infinite or NaN scale takes the division.

#include <cmath>

#include "glmtune/tensor/dtype.h"

namespace glmtune::ops {

GLMTUNE_HD float fp8_quotient(float x, float scale, float inv) {
#if defined(__CUDA_ARCH__)
  const float q0 = __fmul_rn(x, inv);
  return copysignf(__fmaf_rn(__fmaf_rn(-q0, scale, x), inv, q0), x);
#else
  const float q0 = x * inv;
  return std::copysign(std::fma(std::fma(-q0, scale, x), inv, q0), x);
#endif
}

// The rule's scale, f32(max(amax, 1e-12) / 448) with the quotient taken in double, computed in
// f32: for every finite amax of at least 1e-12 the correctly rounded f32 quotient is the double one
// rounded (448 is 7 · 2^6, and a multiple of 1/7 never has the run of 29 equal bits that double
// rounding needs), and the reciprocal form above gives it (both checked for every such f32 when
// this was written; the test above checks every 61st). An infinite or NaN amax is its own scale,
// as amax / 448 is.
GLMTUNE_HD float fp8_scale(float amax) {
  constexpr float kInv448 = 1.0f / 448.0f;
  constexpr float kSmallest = float(1e-12 / 448.0);
  if (!(amax - amax == 0.0f)) return amax;  // inf or NaN
  if (double(amax) < 1e-12) return kSmallest;
  return fp8_quotient(amax, 448.0f, kInv448);
}

}  // namespace glmtune::ops
