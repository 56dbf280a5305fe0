#pragma once
// Helpers shared by the CPU op and gradient tests (tests/unit/test_ops_*.cpp and
// test_grad_*.cpp): the per-process random seed, seeded random tensors, the parity measure,
// finite-difference gradient checks, golden fixtures and packed-document offsets.
//
// Header-only on purpose: every tests/unit/test_*.cpp is built as a binary of its own, linking
// only glmtune_core and gtest, so there is no shared test library to put a .cpp in.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "glmtune/io/safetensors.h"
#include "glmtune/tensor/rng.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::test {

// ---- Seed -------------------------------------------------------------------------------------

// One seed per test process: GLMTUNE_TEST_SEED where set (to replay a failure), else drawn fresh
// so that repeated runs cover new inputs. Tests that draw from it open with
// SCOPED_TRACE(seed_note()), so a failure prints the value to set.
inline uint64_t test_seed() {
  static const uint64_t seed = [] {
    const char* env = std::getenv("GLMTUNE_TEST_SEED");
    return env ? uint64_t(std::strtoull(env, nullptr, 10)) : uint64_t(std::random_device{}());
  }();
  return seed;
}

inline std::string seed_note() { return "GLMTUNE_TEST_SEED=" + std::to_string(test_seed()); }

// ---- Random tensors ---------------------------------------------------------------------------
// Counter-based draws (tensor/rng.h) at stream `offset` of the test seed: every call site names
// its own offset, so adding or reordering draws never changes the values of the others.

// N(mean, std²) of dtype `dt`.
inline Tensor random_normal(const Shape& shape, uint64_t offset, DType dt, double mean = 0,
                            double std = 1) {
  Tensor t = Tensor::empty(shape, dt);
  fill_normal(t, test_seed(), offset, mean, std);
  return t;
}

// Zero-mean shorthand, float64 unless told otherwise: N(0, std²).
inline Tensor random_normal(const Shape& shape, uint64_t offset, double std = 1,
                            DType dt = DType::f64) {
  return random_normal(shape, offset, dt, 0.0, std);
}

// Uniform in [lo, hi) of dtype `dt`.
inline Tensor random_uniform(const Shape& shape, uint64_t offset, DType dt, double lo, double hi) {
  Tensor t = Tensor::empty(shape, dt);
  fill_uniform(t, test_seed(), offset, lo, hi);
  return t;
}

// A direction that is zero except on one token row (dim 0) of `shape`, where it is N(0, 1): a
// finite-difference probe of a single token.
inline Tensor row_direction(const Shape& shape, int64_t row, uint64_t offset) {
  Tensor dir = Tensor::zeros(shape, DType::f64);
  const Shape row_shape(shape.begin() + 1, shape.end());
  dir.select(0, row).copy_(random_normal(row_shape, offset, DType::f64));
  return dir;
}

// ---- Reference formulas -----------------------------------------------------------------------

inline double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }
inline double silu(double v) { return v / (1.0 + std::exp(-v)); }

// ---- Comparisons ------------------------------------------------------------------------------

// ⟨a, b⟩ over the elements in order, in double: dot(dy, f(x)) is the scalar loss whose gradient
// in f's output is dy.
inline double dot(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_doubles(), y = b.to_doubles();
  EXPECT_EQ(x.size(), y.size());
  double s = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) s += x[i] * y[i];
  return s;
}

// Largest |v| over the elements.
inline double max_abs(const Tensor& t) {
  double m = 0;
  for (double v : t.to_doubles()) m = std::max(m, std::abs(v));
  return m;
}

// max |a_i − b_i| and max |b_i| over the paired elements.
struct MaxAbs {
  double diff = 0, ref = 0;
};

inline MaxAbs max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  MaxAbs m;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    m.diff = std::max(m.diff, std::abs(a[i] - b[i]));
    m.ref = std::max(m.ref, std::abs(b[i]));
  }
  return m;
}

// max |a − b| / max |b|, the parity measure of docs/testing.md (the plain max |a − b| where b is
// all zero); a and b must have one shape. Whether an all-zero reference is acceptable depends on
// what a test file compares, so each file declares its measure once:
//   constexpr RelErr rel_err{};                              // a zero reference is legitimate
//   constexpr RelErr rel_err{.zero_reference_fails = true};  // it would prove nothing: fail
struct RelErr {
  bool zero_reference_fails = false;

  double operator()(const Tensor& a, const Tensor& b) const {
    EXPECT_EQ(a.shape(), b.shape()) << a.str() << " vs " << b.str();
    const MaxAbs m = max_abs_diff(a.to_doubles(), b.to_doubles());
    if (zero_reference_fails)
      EXPECT_GT(m.ref, 0) << "reference is all zero: the comparison would prove nothing";
    return m.ref > 0 ? m.diff / m.ref : m.diff;
  }
};

// ---- Finite differences -----------------------------------------------------------------------

using Loss = std::function<double()>;

// Central differences (L(x + h) − L(x − h)) / 2h of `loss` at every entry of `t` (contiguous f64,
// perturbed in place and restored). `valid` (optional) is asked after each of the two
// evaluations of an entry; an entry it rejects is NaN (e.g. a perturbation that changed a
// discrete choice the analytic gradient holds fixed).
inline Tensor finite_differences(Tensor& t, const Loss& loss,
                                 const std::function<bool()>& valid = nullptr, double h = 1e-6) {
  double* p = t.data<double>();
  Tensor fd = Tensor::empty(t.shape(), DType::f64);
  double* f = fd.data<double>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double v = p[i];
    bool ok = true;
    p[i] = v + h;
    const double up = loss();
    if (valid) ok &= valid();
    p[i] = v - h;
    const double down = loss();
    if (valid) ok &= valid();
    p[i] = v;
    f[i] = ok ? (up - down) / (2 * h) : NAN;
  }
  return fd;
}

// Every entry of `t` by central differences against the analytic `grad` (shaped like t),
// relative to the gradient: max |fd − grad| / max |grad|. An all-zero gradient fails the test.
inline double fd_check(Tensor& t, const Tensor& grad, const Loss& loss, double h = 1e-6) {
  EXPECT_EQ(t.shape(), grad.shape());
  const MaxAbs m =
      max_abs_diff(finite_differences(t, loss, nullptr, h).to_doubles(), grad.to_doubles());
  EXPECT_GT(m.ref, 0) << "gradient is all zero: the check would prove nothing";
  return m.ref > 0 ? m.diff / m.ref : m.diff;
}

// Every entry of `t` by central differences against the analytic `grad`, relative to the
// differences: RelErr(grad, fd). `grad` must be defined (a skipped gradient fails here rather
// than comparing nothing) and every difference quotient finite.
inline double fd_rel_err(Tensor& t, const Tensor& grad, const Loss& loss, double h = 1e-6) {
  EXPECT_TRUE(grad.defined());
  if (!grad.defined()) return INFINITY;
  const Tensor fd = finite_differences(t, loss, nullptr, h);
  const std::vector<double> f = fd.to_doubles();
  for (size_t i = 0; i < f.size(); ++i) EXPECT_TRUE(std::isfinite(f[i])) << "entry " << i;
  return RelErr{}(grad, fd);
}

// Fourth-order central difference along `dir` (shaped like t),
// (−L(2h) + 8L(h) − 8L(−h) + L(−2h)) / 12h, against ⟨grad, dir⟩, relative to Σ |grad ⊙ dir| (the
// size of the terms the derivative sums, so cancellation cannot hide an error), or to `floor`
// where that is larger (for directions along which the gradient is exactly zero). One directional
// check covers a whole tensor at the cost of four losses; the wider stencil allows a step where
// rounding of the loss is negligible even for a single token row.
inline double fd_direction(Tensor& t, const Tensor& grad, const Tensor& dir, const Loss& loss,
                           double h = 1e-4, double floor = 0) {
  EXPECT_EQ(t.shape(), grad.shape());
  double* p = t.data<double>();
  const std::vector<double> x0(p, p + t.numel()), d = dir.to_doubles(), g = grad.to_doubles();
  auto at = [&](double step) {
    for (size_t i = 0; i < x0.size(); ++i) p[i] = x0[i] + step * d[i];
    return loss();
  };
  const double fd = (-at(2 * h) + 8 * at(h) - 8 * at(-h) + at(-2 * h)) / (12 * h);
  std::copy(x0.begin(), x0.end(), p);
  double an = 0, scale = 0;
  for (size_t i = 0; i < x0.size(); ++i) {
    an += g[i] * d[i];
    scale += std::abs(g[i] * d[i]);
  }
  scale = std::max(scale, floor);
  EXPECT_GT(scale, 0) << "gradient is zero along the direction: the check would prove nothing";
  return std::abs(fd - an) / (scale > 0 ? scale : 1);
}

// ---- Golden fixtures --------------------------------------------------------------------------

// tests/golden/ops/<name>.safetensors, written by the script of tools/golden/ that the test file
// names.
inline io::SafetensorsFile open_golden(const std::string& name) {
  return io::SafetensorsFile::open(std::string(GLMTUNE_SOURCE_DIR) + "/tests/golden/ops/" + name +
                                   ".safetensors");
}

// The script's description of a fixture (its configurations, the parameters the reference gave
// gradients to), stored as JSON under the metadata key "fixture".
inline nlohmann::json golden_metadata(const io::SafetensorsFile& f) {
  return nlohmann::json::parse(f.metadata().at("fixture"));
}

// ---- Packs ------------------------------------------------------------------------------------

// The int32 document offsets [0, n0, n0 + n1, ..., T] of a pack of documents of these lengths.
template <typename Int>
Tensor cu_seqlens(const std::vector<Int>& lengths) {
  std::vector<int32_t> cu{0};
  for (Int n : lengths) cu.push_back(cu.back() + int32_t(n));
  return Tensor::from_vector(cu, {int64_t(cu.size())});
}

inline Tensor cu_seqlens(std::initializer_list<int64_t> lengths) {
  return cu_seqlens(std::vector<int64_t>(lengths));
}

// Tokens in a pack of documents of these lengths.
template <typename Int>
int64_t total_tokens(const std::vector<Int>& lengths) {
  int64_t t = 0;
  for (Int n : lengths) t += n;
  return t;
}

}  // namespace glmtune::test
