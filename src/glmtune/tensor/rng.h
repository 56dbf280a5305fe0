#pragma once
// Counter-based random numbers (Philox-4x32-10). Value i of a draw made at stream offset `o` with
// seed `s` depends only on (s, o + i): the CPU and every GPU produce the same numbers, and a draw
// can be split across threads, ranks or shards without changing it. Normal samples use
// Box-Muller with our own log/cos in float64 built only from correctly-rounded IEEE operations,
// so host and device results agree bit for bit.

#include <cstdint>

#include "glmtune/tensor/dtype.h"

namespace glmtune {

class Tensor;

struct Philox4 {
  uint32_t x[4];
};

GLMTUNE_HD Philox4 philox4x32_10(uint64_t counter, uint64_t key) {
  uint32_t c0 = uint32_t(counter), c1 = uint32_t(counter >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = uint32_t(key), k1 = uint32_t(key >> 32);
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = uint64_t(0xD2511F53u) * c0;
    uint64_t p1 = uint64_t(0xCD9E8D57u) * c2;
    uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0;
    uint32_t n1 = uint32_t(p1);
    uint32_t n2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
    uint32_t n3 = uint32_t(p0);
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return {{c0, c1, c2, c3}};
}

namespace rng_detail {
// Explicit round-to-nearest operations: device code must not contract them into FMAs.
#if defined(__CUDA_ARCH__)
GLMTUNE_HD double mul(double a, double b) { return __dmul_rn(a, b); }
GLMTUNE_HD double add(double a, double b) { return __dadd_rn(a, b); }
GLMTUNE_HD double div(double a, double b) { return __ddiv_rn(a, b); }
GLMTUNE_HD double sqrt_rn(double a) { return __dsqrt_rn(a); }
#else
GLMTUNE_HD double mul(double a, double b) {
  volatile double r = a * b;
  return r;
}
GLMTUNE_HD double add(double a, double b) {
  volatile double r = a + b;
  return r;
}
GLMTUNE_HD double div(double a, double b) { return a / b; }
double sqrt_rn(double a);
#endif

// Natural log for x in (0, 1]: x = m·2^e with m in [sqrt(1/2), sqrt(2)); log m by the atanh series.
GLMTUNE_HD double log_unit(double x) {
  uint64_t bits;
  memcpy(&bits, &x, 8);
  int e = int((bits >> 52) & 0x7ff) - 1023;
  bits = (bits & 0x000fffffffffffffull) | 0x3ff0000000000000ull;
  double m;
  memcpy(&m, &bits, 8);
  if (m > 1.4142135623730951) {
    m = mul(m, 0.5);
    e += 1;
  }
  double s = div(add(m, -1.0), add(m, 1.0));
  double s2 = mul(s, s);
  double term = s, sum = 0.0;
  for (int k = 1; k <= 27; k += 2) {
    sum = add(sum, div(term, double(k)));
    term = mul(term, s2);
  }
  return add(mul(2.0, sum), mul(double(e), 0.6931471805599453));
}

// cos(2·pi·t) for t in [0, 1), by quadrant and Taylor series on [0, pi/2).
GLMTUNE_HD double cos_2pi(double t) {
  double r = mul(t, 4.0);
  int q = int(r);
  double a = mul(add(r, -double(q)), 1.5707963267948966);
  double a2 = mul(a, a);
  // sin and cos by Taylor series; 12 terms are far below double rounding on [0, pi/2).
  double c = 1.0, s = a, tc = 1.0, ts = a;
  for (int k = 1; k <= 12; ++k) {
    tc = div(mul(tc, -a2), double((2 * k - 1) * (2 * k)));
    ts = div(mul(ts, -a2), double((2 * k) * (2 * k + 1)));
    c = add(c, tc);
    s = add(s, ts);
  }
  switch (q & 3) {
    case 0:
      return c;
    case 1:
      return -s;
    case 2:
      return -c;
    default:
      return s;
  }
}
}  // namespace rng_detail

// Uniform in [0, 1) with 53 random bits, for element `index` of a draw.
GLMTUNE_HD double rng_uniform_at(uint64_t seed, uint64_t index) {
  Philox4 r = philox4x32_10(index, seed);
  uint64_t bits = (uint64_t(r.x[0]) << 21) ^ uint64_t(r.x[1] >> 11);
  return double(bits & ((1ull << 53) - 1)) * 1.1102230246251565e-16;  // 2^-53
}

// Standard normal for element `index` of a draw (Box-Muller on two lanes of one Philox block).
GLMTUNE_HD double rng_normal_at(uint64_t seed, uint64_t index) {
  Philox4 r = philox4x32_10(index, seed);
  uint64_t b1 = (uint64_t(r.x[0]) << 21) ^ uint64_t(r.x[1] >> 11);
  uint64_t b2 = (uint64_t(r.x[2]) << 21) ^ uint64_t(r.x[3] >> 11);
  double u1 = double((b1 & ((1ull << 53) - 1)) + 1) * 1.1102230246251565e-16;  // (0, 1]
  double u2 = double(b2 & ((1ull << 53) - 1)) * 1.1102230246251565e-16;        // [0, 1)
  double radius = rng_detail::sqrt_rn(rng_detail::mul(-2.0, rng_detail::log_unit(u1)));
  return rng_detail::mul(radius, rng_detail::cos_2pi(u2));
}

// base + scale·x without contraction, so CPU and GPU round the same way.
GLMTUNE_HD double rng_affine(double base, double scale, double x) {
  return rng_detail::add(base, rng_detail::mul(scale, x));
}

// Fill `t` (contiguous, CPU or CUDA, any floating dtype) with draws at stream offset `offset`.
// Uniform values are drawn in [low, high) in float64 and then rounded to the element type, so a
// narrow type can hold `high` itself.
void fill_uniform(Tensor& t, uint64_t seed, uint64_t offset, double low = 0.0, double high = 1.0);
void fill_normal(Tensor& t, uint64_t seed, uint64_t offset, double mean = 0.0, double std = 1.0);

}  // namespace glmtune
