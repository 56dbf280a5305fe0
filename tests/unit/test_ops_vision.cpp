// The vision tower's leaf ops (ops/vision.h): attention within segments against a float64 dense
// reference on packs of images of very different sizes (one above the query block of 256 rows),
// query-row subsets as sequence parallelism uses them, strided values, and float64 finite
// differences of its backward; the 2-D rotary embedding against its formula, its backward as the
// transpose; exact GELU's backward by finite differences.

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/ops/vision.h"
#include "support/test_support.h"

using namespace glmtune;
using namespace glmtune::test;

namespace {

constexpr RelErr rel_err{};

std::vector<int64_t> bounds(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> cu{0};
  for (int64_t n : lengths) cu.push_back(cu.back() + n);
  return cu;
}

// Softmax attention of every segment with itself, per head, in double, from the definition; with
// `lse`, each row's log-sum-exp of its scaled scores ([N, H]).
std::vector<double> reference_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                        const std::vector<int64_t>& cu, int64_t heads, double scale,
                                        std::vector<double>* lse = nullptr) {
  const int64_t n = q.size(0), d = q.size(1), hd = d / heads;
  const std::vector<double> qs = q.to_doubles(), ks = k.to_doubles(), vs = v.to_doubles();
  std::vector<double> out(size_t(n * d), 0.0), w;
  if (lse) lse->assign(size_t(n * heads), 0.0);
  for (size_t s = 0; s + 1 < cu.size(); ++s)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = cu[s]; i < cu[s + 1]; ++i) {
        w.assign(size_t(cu[s + 1] - cu[s]), 0.0);
        double mx = -INFINITY, sum = 0;
        for (int64_t j = cu[s]; j < cu[s + 1]; ++j) {
          double dot = 0;
          for (int64_t e = 0; e < hd; ++e)
            dot += qs[size_t(i * d + h * hd + e)] * ks[size_t(j * d + h * hd + e)];
          w[size_t(j - cu[s])] = dot * scale;
          mx = std::max(mx, dot * scale);
        }
        for (double& x : w) sum += (x = std::exp(x - mx));
        if (lse) (*lse)[size_t(i * heads + h)] = mx + std::log(sum);
        for (int64_t j = cu[s]; j < cu[s + 1]; ++j)
          for (int64_t e = 0; e < hd; ++e)
            out[size_t(i * d + h * hd + e)] +=
                w[size_t(j - cu[s])] / sum * vs[size_t(j * d + h * hd + e)];
      }
  return out;
}

TEST(OpsVision, AttentionMatchesFloat64OnPackedImagesOfEverySize) {
  SCOPED_TRACE(seed_note());
  // One patch, a few, more than one query block of 256 rows, and a large image, packed.
  const std::vector<int64_t> cu = bounds({1, 7, 300, 1100});
  const int64_t n = cu.back(), heads = 2, hd = 16, d = heads * hd;
  const double scale = 1.0 / std::sqrt(double(hd));
  const Tensor q = random_normal({n, d}, 1, DType::f32), k = random_normal({n, d}, 2, DType::f32),
               v = random_normal({n, d}, 3, DType::f32);
  std::vector<double> lse_ref;
  const Tensor want = Tensor::from_doubles(reference_attention(q, k, v, cu, heads, scale, &lse_ref),
                                           {n, d}, DType::f64);
  const Tensor want_lse = Tensor::from_doubles(lse_ref, {n, heads}, DType::f64);
  Tensor lse, lse64;
  EXPECT_LE(rel_err(ops::varlen_attention(q, k, v, cu, heads, scale, 0, &lse), want), 1e-5);
  EXPECT_LE(rel_err(ops::varlen_attention(q.to(DType::f64), k.to(DType::f64), v.to(DType::f64), cu,
                                          heads, scale, 0, &lse64),
                    want),
            1e-12);
  // The log-sum-exp the GPU backward reads: f32 whatever the compute dtype.
  ASSERT_EQ(lse.dtype(), DType::f32);
  EXPECT_LE(rel_err(lse, want_lse), 1e-6);
  EXPECT_LE(rel_err(lse64, want_lse), 1e-7);

  // Values read through a strided view of a fused [N, 3d] tensor, and a block of query rows (one
  // rank's share under sequence parallelism, crossing a segment border), give the whole's rows.
  // The GEMMs see other leading dimensions and row counts, for which BLAS may pick other kernels
  // (another summation order), so the bar is a few f32 roundings, not equality.
  const Tensor whole = ops::varlen_attention(q, k, v, cu, heads, scale);
  Tensor qkv = Tensor::empty({n, 3 * d}, DType::f32);
  qkv.slice(1, 2 * d, 3 * d).copy_(v);
  EXPECT_LE(
      rel_err(ops::varlen_attention(q, k, qkv.slice(1, 2 * d, 3 * d), cu, heads, scale), whole),
      1e-6);
  const int64_t begin = 150, rows = 400;
  const Tensor part =
      ops::varlen_attention(q.narrow(0, begin, rows).contiguous(), k, v, cu, heads, scale, begin);
  EXPECT_LE(rel_err(part, whole.narrow(0, begin, rows)), 1e-6);
}

TEST(OpsVision, AttentionBackwardMatchesFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  const std::vector<int64_t> cu = bounds({1, 5, 9});
  const int64_t n = cu.back(), heads = 2, hd = 4, d = heads * hd;
  const double scale = 0.7;
  Tensor q = random_normal({n, d}, 11, DType::f64), k = random_normal({n, d}, 12, DType::f64),
         v = random_normal({n, d}, 13, DType::f64);
  const Tensor dy = random_normal({n, d}, 14, DType::f64);
  auto loss = [&] { return dot(dy, ops::varlen_attention(q, k, v, cu, heads, scale)); };
  const Tensor out = ops::varlen_attention(q, k, v, cu, heads, scale);
  const ops::VarlenAttentionGrads g =
      ops::varlen_attention_backward(q, k, v, out, dy, cu, heads, scale);
  EXPECT_LE(fd_rel_err(q, g.dq, loss), 1e-6);
  EXPECT_LE(fd_rel_err(k, g.dk, loss), 1e-6);
  EXPECT_LE(fd_rel_err(v, g.dv, loss), 1e-6);

  // Query rows [3, 11): their dq, and dk / dv summed over the rows the part holds.
  const int64_t begin = 3, rows = 8;
  const Tensor qp = q.narrow(0, begin, rows).contiguous();
  const Tensor dyp = dy.narrow(0, begin, rows).contiguous();
  auto part_loss = [&] {
    return dot(dyp, ops::varlen_attention(qp, k, v, cu, heads, scale, begin));
  };
  const ops::VarlenAttentionGrads gp = ops::varlen_attention_backward(
      qp, k, v, ops::varlen_attention(qp, k, v, cu, heads, scale, begin), dyp, cu, heads, scale,
      begin);
  Tensor qpv = qp;
  EXPECT_LE(fd_rel_err(qpv, gp.dq, part_loss), 1e-6);
  EXPECT_LE(fd_rel_err(k, gp.dk, part_loss), 1e-6);
  EXPECT_LE(fd_rel_err(v, gp.dv, part_loss), 1e-6);
}

TEST(OpsVision, BadAttentionArgumentsAreRejected) {
  const Tensor x = random_normal({6, 8}, 1, DType::f32);
  EXPECT_THROW(ops::varlen_attention(x, x, x, {0, 5}, 2, 1.0), InternalError);     // bounds short
  EXPECT_THROW(ops::varlen_attention(x, x, x, {0, 6}, 3, 1.0), InternalError);     // 8 % 3
  EXPECT_THROW(ops::varlen_attention(x, x, x, {0, 6}, 2, 1.0, 1), InternalError);  // rows past
}

TEST(OpsVision, RopeRotatesPairsByTheAxialAnglesAndItsBackwardIsTheTranspose) {
  SCOPED_TRACE(seed_note());
  const int64_t n = 5, heads = 3, hd = 8;
  std::vector<int64_t> pos;
  for (int64_t r = 0; r < n; ++r) pos.insert(pos.end(), {r / 2, 3 * r % 4});
  const Tensor positions = Tensor::from_vector(pos, {n, 2});
  const double theta = 10000.0;
  const ops::RopeTables t = ops::rope_2d_tables(positions, hd, theta, DType::f64);
  // Row r, entry m < hd/2: angle = position[axis] / θ^(2k / (hd/2)), axis = m / (hd/4).
  const std::vector<double> c = t.cos.to_doubles(), s = t.sin.to_doubles();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t m = 0; m < hd; ++m) {
      const int64_t mm = m % (hd / 2), axis = mm / (hd / 4), k = mm % (hd / 4);
      const double angle =
          double(pos[size_t(r * 2 + axis)]) / std::pow(theta, double(2 * k) / double(hd / 2));
      EXPECT_NEAR(c[size_t(r * hd + m)], std::cos(angle), 1e-15);
      EXPECT_NEAR(s[size_t(r * hd + m)], std::sin(angle), 1e-15);
    }
  const Tensor x = random_normal({n * heads, hd}, 21, DType::f64);
  const Tensor y = random_normal({n * heads, hd}, 22, DType::f64);
  Tensor rx = x.clone(), rty = y.clone();
  ops::rope_2d_(rx, t);
  ops::rope_2d_backward_(rty, t);
  EXPECT_NEAR(dot(rx, y), dot(x, rty), 1e-12 * std::abs(dot(x, rty)));  // <R x, y> = <x, Rᵀ y>
  EXPECT_NEAR(dot(rx, rx), dot(x, x), 1e-12 * dot(x, x));               // a rotation
  Tensor back = rx.clone();
  ops::rope_2d_backward_(back, t);
  EXPECT_LE(rel_err(back, x), 1e-14);
}

TEST(OpsVision, GeluBackwardMatchesFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  Tensor x = random_normal({7, 5}, 31, DType::f64, 0, 2.0);
  const Tensor dy = random_normal({7, 5}, 32, DType::f64);
  auto loss = [&] {
    Tensor y = x.clone();
    ops::gelu_erf_(y);
    return dot(dy, y);
  };
  Tensor g = dy.clone();
  ops::gelu_erf_backward_(x, g);
  EXPECT_LE(fd_rel_err(x, g, loss), 1e-7);
}

}  // namespace
