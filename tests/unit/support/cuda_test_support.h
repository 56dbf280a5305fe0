#pragma once
// Helpers shared by the CUDA parity tests (tests/unit/test_cuda_ops_*.cpp): the per-process seed
// (printed, and taken from GLMTUNE_TEST_SEED where set), the GPU skip, random CPU inputs rounded
// to their dtype, the relative L2 measure with its "[ measure ]" log line, bit-exact reruns and
// the GPU device.
//
// Header-only for the reason test_support.h gives. It does not build on test_support.h: that
// seed is neither printed nor reproducible from the environment, which these tests promise.
// Everything but kGpu compiles without CUDA, so the tests build (and skip) in a CPU-only build.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "glmtune/tensor/device.h"
#include "glmtune/tensor/rng.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::test {

// ---- Seed -------------------------------------------------------------------------------------

// One seed per test process: GLMTUNE_TEST_SEED where set, else drawn fresh, so repeated runs
// cover new inputs. Printed on first use, so that any run can be reproduced.
inline uint64_t test_seed() {
  static const uint64_t seed = [] {
    const char* env = std::getenv("GLMTUNE_TEST_SEED");
    const uint64_t s = env ? std::strtoull(env, nullptr, 10) : std::random_device{}();
    std::printf("[ seed     ] GLMTUNE_TEST_SEED=%llu\n", static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

// A failure message that names the seed.
inline std::string ctx(const std::string& what) {
  return what + " (seed " + std::to_string(test_seed()) + ")";
}

// A generator for discrete draws (ids, labels) at `stream` of the test seed.
inline std::mt19937_64 seeded_engine(uint64_t stream) {
  return std::mt19937_64(test_seed() ^ (stream * 0x9E3779B97F4A7C15ull));
}

// ---- Skip -------------------------------------------------------------------------------------

// Skips (does not fail) the test where no GPU is visible, which includes every CPU-only build.
#define REQUIRE_GPU()                                                           \
  do {                                                                          \
    if (!::glmtune::cuda_available()) GTEST_SKIP() << "no CUDA device visible"; \
  } while (0)

// ---- Random inputs ----------------------------------------------------------------------------
// f32 normal draws at `stream` of the test seed, rounded to `dtype`: the GPU and the CPU
// reference then see the same (e.g. bf16) values. `stream` separates the draws of one test.

// N(mean, std²).
inline Tensor random_cpu(const Shape& shape, DType dtype, uint64_t stream, double mean,
                         double std) {
  Tensor f = Tensor::empty(shape, DType::f32);
  fill_normal(f, test_seed(), stream << 32, mean, std);
  return f.to(dtype);
}

// N(0, std²).
inline Tensor random_cpu(const Shape& shape, DType dtype, uint64_t stream, double std = 1.0) {
  return random_cpu(shape, dtype, stream, 0.0, std);
}

// ---- Comparisons ------------------------------------------------------------------------------

// A contiguous CPU f32 copy (or `t` itself where it already is one).
inline Tensor f32(const Tensor& t) { return t.to(Device::cpu()).to(DType::f32).contiguous(); }

// a − b elementwise (CPU f32).
inline Tensor minus(const Tensor& a, const Tensor& b) {
  Tensor out = f32(a).clone();
  const Tensor bc = f32(b);
  for (int64_t i = 0; i < out.numel(); ++i) out.data<float>()[i] -= bc.data<float>()[i];
  return out;
}

// ‖got − want‖ / ‖want‖ (‖got − want‖ where want is all zero); infinity when `got` holds a
// non-finite value (e.g. an unwritten NaN).
inline double rel_l2(const std::vector<double>& got, const std::vector<double>& want) {
  EXPECT_EQ(got.size(), want.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline double rel_l2(const Tensor& got, const Tensor& want) {
  return rel_l2(got.to(Device::cpu()).to_doubles(), want.to(Device::cpu()).to_doubles());
}

// Same dtype, same shape, same bytes.
inline bool bit_identical(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(Device::cpu()).contiguous(), y = b.to(Device::cpu()).contiguous();
  return x.dtype() == y.dtype() && x.shape() == y.shape() &&
         std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

// The relative L2 error of `got` against `want` (tensors or double vectors), printed with its bar
// (so the logs keep the margins, not just pass/fail) and checked against it.
#define EXPECT_CLOSE(got, want, bar, what)                                                      \
  do {                                                                                          \
    const double err_ = ::glmtune::test::rel_l2(got, want);                                     \
    const std::string what_ = (what);                                                           \
    std::printf("[ measure  ] %s: rel L2 %.2e (bar %.0e)\n", what_.c_str(), err_, double(bar)); \
    EXPECT_LE(err_, bar) << ::glmtune::test::ctx(what_);                                        \
  } while (0)

// ---- Device -----------------------------------------------------------------------------------

#ifdef GLMTUNE_WITH_CUDA
inline const Device kGpu = Device::cuda(0);
#endif

}  // namespace glmtune::test
