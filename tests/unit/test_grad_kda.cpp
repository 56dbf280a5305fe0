// Backward of the KDA mixer: float64 central finite differences on fresh random packed inputs
// whose documents (1, 63, 64, 65, 130 tokens) cross chunk and document boundaries — the conv +
// SiLU, the forget gate in both forms, the chunked delta rule and the whole mixer — plus saved
// against recomputed intermediates (bit-identical), chunk-size independence, accumulation, and
// parity with the reference's autograd (fixtures from tools/golden/grads_kda_mhc.py).

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "glmtune/io/safetensors.h"
#include "glmtune/ops/kda.h"
#include "glmtune/ops/norm.h"
#include "glmtune/tensor/rng.h"

using namespace glmtune;

namespace {

const std::string kGolden =
    std::string(GLMTUNE_SOURCE_DIR) + "/tests/golden/ops/grads_kda_mhc.safetensors";

uint64_t test_seed() {
  static const uint64_t seed = std::random_device{}();
  return seed;
}

std::string seed_note() { return "seed " + std::to_string(test_seed()); }

Tensor random_normal(const Shape& shape, uint64_t offset, DType dt, double mean = 0,
                     double std = 1) {
  Tensor t = Tensor::empty(shape, dt);
  fill_normal(t, test_seed(), offset, mean, std);
  return t;
}

Tensor random_uniform(const Shape& shape, uint64_t offset, DType dt, double lo, double hi) {
  Tensor t = Tensor::empty(shape, dt);
  fill_uniform(t, test_seed(), offset, lo, hi);
  return t;
}

double dot(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_doubles(), y = b.to_doubles();
  EXPECT_EQ(x.size(), y.size());
  double s = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) s += x[i] * y[i];
  return s;
}

// max |a − b| / max |b|: the parity measure of SPEC.md §7.
double rel_err(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.numel(), b.numel()) << a.str() << " vs " << b.str();
  const std::vector<double> x = a.to_doubles(), y = b.to_doubles();
  double diff = 0, ref = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
    diff = std::max(diff, std::abs(x[i] - y[i]));
    ref = std::max(ref, std::abs(y[i]));
  }
  EXPECT_GT(ref, 0) << "reference is all zero: the comparison would prove nothing";
  return ref > 0 ? diff / ref : diff;
}

using Loss = std::function<double()>;

// Every element of `t` (contiguous f64, perturbed in place and restored): central differences of
// `loss` against the analytic `grad`; max |fd − grad| / max |grad|.
double fd_check(Tensor& t, const Tensor& grad, const Loss& loss, double h = 1e-6) {
  EXPECT_EQ(t.numel(), grad.numel());
  double* p = t.data<double>();
  const std::vector<double> g = grad.to_doubles();
  double diff = 0, ref = 0;
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double x0 = p[i];
    p[i] = x0 + h;
    const double up = loss();
    p[i] = x0 - h;
    const double down = loss();
    p[i] = x0;
    diff = std::max(diff, std::abs((up - down) / (2 * h) - g[size_t(i)]));
    ref = std::max(ref, std::abs(g[size_t(i)]));
  }
  EXPECT_GT(ref, 0) << "gradient is all zero: the check would prove nothing";
  return ref > 0 ? diff / ref : diff;
}

// Fourth-order central difference along `dir` (shaped like t),
// (−L(2h) + 8L(h) − 8L(−h) + L(−2h)) / 12h, against ⟨grad, dir⟩, relative to Σ |grad ⊙ dir| (the
// size of the terms the derivative sums, so cancellation cannot hide an error), or to `floor`
// where that is larger (for directions along which the gradient is exactly zero). The wider
// stencil allows a step where rounding of the loss is negligible even for a single token row.
double fd_direction(Tensor& t, const Tensor& grad, const Tensor& dir, const Loss& loss,
                    double h = 1e-4, double floor = 0) {
  EXPECT_EQ(t.numel(), grad.numel());
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

double max_abs(const Tensor& t) {
  double m = 0;
  for (double v : t.to_doubles()) m = std::max(m, std::abs(v));
  return m;
}

// A direction that is zero except on one token row (dim 0) of `shape`.
Tensor row_direction(const Shape& shape, int64_t row, uint64_t offset) {
  Tensor dir = Tensor::zeros(shape, DType::f64);
  Shape row_shape(shape.begin() + 1, shape.end());
  dir.select(0, row).copy_(random_normal(row_shape, offset, DType::f64));
  return dir;
}

constexpr double kFdTol = 1e-6;

// Odd lengths around the chunk size: a single token, one short of a chunk, exactly one, one
// over, and two chunks plus two.
const std::vector<int64_t> kDocs{1, 63, 64, 65, 130};
// Rows next to every document and chunk boundary of kDocs (documents start at 0, 1, 64, 128,
// 193; chunks inside the last document start at 193 and 257).
const std::vector<int64_t> kBoundaryRows{0,   1,   2,   63,  64,  65,  127, 128,
                                         129, 192, 193, 194, 256, 257, 322};

bool is_doc_start(int64_t row) {
  int64_t start = 0;
  for (int64_t n : kDocs) {
    if (row == start) return true;
    start += n;
  }
  return false;
}

Tensor cu_from_lengths(const std::vector<int64_t>& lengths) {
  std::vector<int32_t> cu{0};
  for (int64_t n : lengths) cu.push_back(cu.back() + int32_t(n));
  return Tensor::from_vector(cu, {int64_t(cu.size())});
}

int64_t total(const std::vector<int64_t>& lengths) {
  int64_t t = 0;
  for (int64_t n : lengths) t += n;
  return t;
}

// Seeded parameters of the released shapes, scaled for unit-size activations; decay mostly slow
// (dt_bias around −2.5) so that state crosses chunk boundaries with weight.
ops::KdaParams random_params(int64_t d, int64_t nl, int64_t hl, int64_t kc, DType dt,
                             uint64_t off) {
  const int64_t ql = nl * hl;
  const double sd = 1.0 / std::sqrt(double(d)), sh = 1.0 / std::sqrt(double(hl)),
               sq = 1.0 / std::sqrt(double(ql));
  ops::KdaParams p;
  p.q_proj = random_normal({ql, d}, off + 1'000'000, dt, 0, sd);
  p.k_proj = random_normal({ql, d}, off + 2'000'000, dt, 0, sd);
  p.v_proj = random_normal({ql, d}, off + 3'000'000, dt, 0, sd);
  p.conv1d = random_normal({3 * ql, 1, kc}, off + 4'000'000, dt, 0, 0.6);
  p.f_a_proj = random_normal({hl, d}, off + 5'000'000, dt, 0, sd);
  p.f_b_proj = random_normal({ql, hl}, off + 6'000'000, dt, 0, sh);
  p.dt_bias = random_normal({ql}, off + 7'000'000, dt, -2.5, 1.0);
  p.A_log = random_uniform({nl}, off + 8'000'000, dt, -1.5, 1.0);
  p.b_proj = random_normal({nl, d}, off + 9'000'000, dt, 0, sd);
  p.g_a_proj = random_normal({hl, d}, off + 10'000'000, dt, 0, sd);
  p.g_b_proj = random_normal({ql, hl}, off + 11'000'000, dt, 0, sh);
  p.o_norm = random_normal({hl}, off + 12'000'000, dt, 1.0, 0.4);
  p.o_proj = random_normal({d, ql}, off + 13'000'000, dt, 0, sq);
  return p;
}

// The parameters with their names, for loops over all of them.
std::vector<std::pair<const char*, Tensor*>> named(ops::KdaParams& p) {
  return {{"q_proj", &p.q_proj},     {"k_proj", &p.k_proj},     {"v_proj", &p.v_proj},
          {"conv1d", &p.conv1d},     {"f_a_proj", &p.f_a_proj}, {"f_b_proj", &p.f_b_proj},
          {"dt_bias", &p.dt_bias},   {"A_log", &p.A_log},       {"b_proj", &p.b_proj},
          {"g_a_proj", &p.g_a_proj}, {"g_b_proj", &p.g_b_proj}, {"o_norm", &p.o_norm},
          {"o_proj", &p.o_proj}};
}

struct CoreInputs {
  Tensor q, k, v, g, beta;
};

// Delta-rule inputs as the mixer produces them: unit q/k, log decay from the LB gate.
CoreInputs random_core(int64_t t, int64_t nh, int64_t kd, int64_t vd, uint64_t off) {
  CoreInputs c;
  c.q = ops::l2_norm(random_normal({t, nh, kd}, off + 1'000'000, DType::f64), 1e-6);
  c.k = ops::l2_norm(random_normal({t, nh, kd}, off + 2'000'000, DType::f64), 1e-6);
  c.v = random_normal({t, nh, vd}, off + 3'000'000, DType::f64);
  const Tensor graw = random_normal({t, nh * kd}, off + 4'000'000, DType::f64, 0, 1.5);
  const Tensor dt_bias = random_normal({nh * kd}, off + 5'000'000, DType::f64, -2.5, 1.0);
  const Tensor a_log = random_uniform({nh}, off + 6'000'000, DType::f64, -1.5, 1.0);
  c.g = ops::kda_gate(graw, dt_bias, a_log, -5.0);
  c.beta = random_uniform({t, nh}, off + 7'000'000, DType::f64, 0.05, 0.95);
  return c;
}

}  // namespace

TEST(GradKda, ConvFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  // Documents shorter than, equal to and longer than the kernel: every tap meets the boundary.
  const std::vector<int64_t> docs{1, 2, 5, 3, 4};
  const Tensor cu = cu_from_lengths(docs);
  const int64_t t = total(docs), c = 5, kc = 4;
  Tensor x = random_normal({t, c}, 1, DType::f64);
  Tensor w = random_normal({c, 1, kc}, 2, DType::f64, 0, 0.6);
  const Tensor dy = random_normal({t, c}, 3, DType::f64);
  for (bool silu : {true, false}) {
    SCOPED_TRACE(silu ? "silu" : "linear");
    auto loss = [&] { return dot(dy, ops::causal_conv1d(x, w, cu, silu)); };
    Tensor gw;
    const Tensor dx = ops::causal_conv1d_backward(x, w, cu, silu, dy, &gw);
    ASSERT_EQ(gw.shape(), w.shape());
    EXPECT_LE(fd_check(x, dx, loss), kFdTol);
    EXPECT_LE(fd_check(w, gw, loss), kFdTol);
  }
  // The forward's saved pre-activation gives the same gradients as recomputing it.
  Tensor pre, gw1, gw2;
  ops::causal_conv1d(x, w, cu, true, &pre);
  EXPECT_EQ(ops::causal_conv1d_backward(x, w, cu, true, dy, &gw1, pre).to_doubles(),
            ops::causal_conv1d_backward(x, w, cu, true, dy, &gw2).to_doubles());
  EXPECT_EQ(gw1.to_doubles(), gw2.to_doubles());
}

TEST(GradKda, GateFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  const int64_t t = 6, nl = 3, hl = 4, ql = nl * hl;
  Tensor graw = random_normal({t, ql}, 1, DType::f64, 0, 1.5);
  Tensor a_log = random_uniform({nl}, 2, DType::f64, -1.5, 1.0);
  const Tensor dg = random_normal({t, nl, hl}, 3, DType::f64);
  for (std::optional<double> lb : {std::optional<double>(-5.0), std::optional<double>()}) {
    SCOPED_TRACE(lb ? "lower bound" : "softplus");
    Tensor dt_bias = random_normal({ql}, 4, DType::f64, lb ? -2.5 : -1.0, 1.0);
    if (!lb) {
      // Channels far past softplus' threshold (z > 20 takes the identity branch).
      for (int64_t ch = 0; ch < ql; ch += 5) dt_bias.set_item({ch}, 24.0);
    }
    auto loss = [&] { return dot(dg, ops::kda_gate(graw, dt_bias, a_log, lb)); };
    Tensor gdt, ga;
    const Tensor dz = ops::kda_gate_backward(graw, dt_bias, a_log, lb, dg, &gdt, &ga);
    EXPECT_LE(fd_check(graw, dz, loss), kFdTol);
    EXPECT_LE(fd_check(dt_bias, gdt, loss), kFdTol);
    EXPECT_LE(fd_check(a_log, ga, loss), kFdTol);
  }
}

TEST(GradKda, CoreFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  const Tensor cu = cu_from_lengths(kDocs);
  const int64_t t = total(kDocs), nh = 2, kd = 8, vd = 6;  // K ≠ V
  CoreInputs c = random_core(t, nh, kd, vd, 0);
  const double scale = 1.0 / std::sqrt(double(kd));
  const Tensor dout = random_normal({t, nh, vd}, 50'000'000, DType::f64);
  auto loss = [&] { return dot(dout, ops::kda_chunked(c.q, c.k, c.v, c.g, c.beta, cu, scale)); };
  const ops::KdaCoreGrads g =
      ops::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, cu, scale, dout);
  uint64_t off = 60'000'000;
  const std::vector<std::tuple<const char*, Tensor*, const Tensor*>> inputs = {
      {"q", &c.q, &g.dq},
      {"k", &c.k, &g.dk},
      {"v", &c.v, &g.dv},
      {"g", &c.g, &g.dg},
      {"beta", &c.beta, &g.dbeta}};
  for (const auto& [name, in, grad] : inputs) {
    SCOPED_TRACE(name);
    EXPECT_LE(
        fd_direction(*in, *grad, random_normal(in->shape(), off += 1'000'000, DType::f64), loss),
        kFdTol);
    for (int64_t row : kBoundaryRows) {
      SCOPED_TRACE("row " + std::to_string(row));
      const Tensor dir = row_direction(in->shape(), row, off += 1'000);
      if (std::string(name) == "g" && is_doc_start(row)) {
        // The decay of a document's first step multiplies the zero initial state and cancels in
        // every in-chunk difference Γ_i − Γ_j: its gradient is exactly zero. The analytic value
        // must be rounding noise and the difference quotient agree on the tensor's scale.
        EXPECT_LE(max_abs(grad->select(0, row).contiguous()), 1e-12 * max_abs(*grad));
        EXPECT_LE(fd_direction(*in, *grad, dir, loss, 1e-4, max_abs(*grad)), kFdTol);
      } else {
        EXPECT_LE(fd_direction(*in, *grad, dir, loss), kFdTol);
      }
    }
  }
}

TEST(GradKda, CoreBackwardDoesNotDependOnTheChunkSize) {
  SCOPED_TRACE(seed_note());
  // Chunked forms of every size compute one function, so their gradients agree to rounding; this
  // pins the cross-chunk state gradient with many more chunk boundaries than 64 gives.
  const Tensor cu = cu_from_lengths(kDocs);
  const int64_t t = total(kDocs), nh = 2, kd = 6, vd = 7;
  const CoreInputs c = random_core(t, nh, kd, vd, 0);
  const double scale = 1.0 / std::sqrt(double(kd));
  const Tensor dout = random_normal({t, nh, vd}, 50'000'000, DType::f64);
  const ops::KdaCoreGrads ref =
      ops::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, cu, scale, dout, 64);
  for (int64_t chunk : {1, 7, 16, 200}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    const ops::KdaCoreGrads g =
        ops::kda_chunked_backward(c.q, c.k, c.v, c.g, c.beta, cu, scale, dout, chunk);
    EXPECT_LE(rel_err(g.dq, ref.dq), 1e-11);
    EXPECT_LE(rel_err(g.dk, ref.dk), 1e-11);
    EXPECT_LE(rel_err(g.dv, ref.dv), 1e-11);
    EXPECT_LE(rel_err(g.dg, ref.dg), 1e-11);
    EXPECT_LE(rel_err(g.dbeta, ref.dbeta), 1e-11);
  }
}

TEST(GradKda, MixerFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  const Tensor cu = cu_from_lengths(kDocs);
  const int64_t t = total(kDocs), d = 12, nl = 2, hl = 8;
  for (bool softplus : {false, true}) {
    SCOPED_TRACE(softplus ? "softplus gate" : "lower-bound gate");
    ops::KdaParams p = random_params(d, nl, hl, 4, DType::f64, softplus ? 100'000'000 : 0);
    ops::KdaOptions opt;
    opt.num_heads = nl;
    opt.head_dim = hl;
    if (softplus) {
      opt.lower_bound = std::nullopt;
      // Rates around 1 and a few channels on softplus' identity branch (z > 20).
      p.A_log = random_uniform({nl}, 200'000'000, DType::f64, -2.0, 0.5);
      for (int64_t ch = 0; ch < nl * hl; ch += 7) p.dt_bias.set_item({ch}, 24.0);
    }
    Tensor x = random_normal({t, d}, 300'000'000, DType::f64);
    const Tensor dy = random_normal({t, d}, 400'000'000, DType::f64);
    auto loss = [&] { return dot(dy, ops::kda_forward(p, x, cu, opt)); };
    ops::KdaGrads g;
    const Tensor dx = ops::kda_backward(p, x, cu, opt, nullptr, dy, g);
    uint64_t off = 500'000'000;
    auto params = named(p);
    auto grads = named(g);
    for (size_t i = 0; i < params.size(); ++i) {
      SCOPED_TRACE(params[i].first);
      Tensor& param = *params[i].second;
      const Tensor& grad = *grads[i].second;
      ASSERT_EQ(grad.shape(), param.shape());
      EXPECT_LE(fd_direction(param, grad,
                             random_normal(param.shape(), off += 1'000'000, DType::f64), loss),
                kFdTol);
    }
    // The per-head and per-channel parameters element by element.
    EXPECT_LE(fd_check(p.A_log, g.A_log, loss), kFdTol);
    EXPECT_LE(fd_check(p.o_norm, g.o_norm, loss), kFdTol);
    EXPECT_LE(fd_direction(x, dx, random_normal(x.shape(), off += 1'000'000, DType::f64), loss),
              kFdTol);
    for (int64_t row : kBoundaryRows) {
      SCOPED_TRACE("x row " + std::to_string(row));
      EXPECT_LE(fd_direction(x, dx, row_direction(x.shape(), row, off += 1'000), loss), kFdTol);
    }
  }
}

TEST(GradKda, RecomputedIntermediatesGiveBitIdenticalGradients) {
  SCOPED_TRACE(seed_note());
  const Tensor cu = cu_from_lengths(kDocs);
  const int64_t t = total(kDocs), d = 16, nl = 2, hl = 8;
  for (DType dt : {DType::f32, DType::f64}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    ops::KdaParams p = random_params(d, nl, hl, 4, dt, 0);
    ops::KdaOptions opt;
    opt.num_heads = nl;
    opt.head_dim = hl;
    const Tensor x = random_normal({t, d}, 300'000'000, dt);
    const Tensor dy = random_normal({t, d}, 400'000'000, dt);
    ops::KdaSaved s;
    ops::kda_forward(p, x, cu, opt, &s);
    ops::KdaGrads saved_g, fresh_g;
    const Tensor dx_saved = ops::kda_backward(p, x, cu, opt, &s, dy, saved_g);
    const Tensor dx_fresh = ops::kda_backward(p, x, cu, opt, nullptr, dy, fresh_g);
    EXPECT_EQ(dx_saved.to_doubles(), dx_fresh.to_doubles());
    auto a = named(saved_g);
    auto b = named(fresh_g);
    for (size_t i = 0; i < a.size(); ++i) {
      SCOPED_TRACE(a[i].first);
      EXPECT_EQ(a[i].second->to_doubles(), b[i].second->to_doubles());
    }
  }
}

TEST(GradKda, ParameterGradientsAccumulateAcrossCalls) {
  SCOPED_TRACE(seed_note());
  // Two micro-batches into one gradient struct give the sum of their separate gradients.
  const std::vector<int64_t> docs_a{5, 70}, docs_b{64, 3};
  const int64_t d = 8, nl = 2, hl = 4;
  ops::KdaParams p = random_params(d, nl, hl, 4, DType::f64, 0);
  ops::KdaOptions opt;
  opt.num_heads = nl;
  opt.head_dim = hl;
  const Tensor xa = random_normal({total(docs_a), d}, 1, DType::f64);
  const Tensor xb = random_normal({total(docs_b), d}, 2, DType::f64);
  const Tensor dya = random_normal({total(docs_a), d}, 3, DType::f64);
  const Tensor dyb = random_normal({total(docs_b), d}, 4, DType::f64);
  ops::KdaGrads both, only_a, only_b;
  ops::kda_backward(p, xa, cu_from_lengths(docs_a), opt, nullptr, dya, both);
  ops::kda_backward(p, xb, cu_from_lengths(docs_b), opt, nullptr, dyb, both);
  ops::kda_backward(p, xa, cu_from_lengths(docs_a), opt, nullptr, dya, only_a);
  ops::kda_backward(p, xb, cu_from_lengths(docs_b), opt, nullptr, dyb, only_b);
  auto s = named(both);
  auto a = named(only_a);
  auto b = named(only_b);
  for (size_t i = 0; i < s.size(); ++i) {
    SCOPED_TRACE(s[i].first);
    const std::vector<double> va = a[i].second->to_doubles(), vb = b[i].second->to_doubles();
    std::vector<double> sum(va.size());
    for (size_t j = 0; j < va.size(); ++j) sum[j] = va[j] + vb[j];
    EXPECT_LE(rel_err(*s[i].second, Tensor::from_vector(sum, s[i].second->shape())), 1e-13);
  }
}

TEST(GradKda, MixerMatchesReferenceAutograd) {
  const io::SafetensorsFile f = io::SafetensorsFile::open(kGolden);
  for (bool softplus : {false, true}) {
    for (DType dt : {DType::f32, DType::f64}) {
      SCOPED_TRACE(fmt::format("{} {}", softplus ? "softplus" : "lower bound", dtype_name(dt)));
      const std::string pre = softplus ? "kda_softplus." : "kda.";
      ops::KdaParams p;
      for (auto& [name, t] : named(p)) {
        const std::string own = pre + "param." + name;
        // The softplus variant stores only the gate parameters it changes.
        *t = f.tensor(f.contains(own) ? own : std::string("kda.param.") + name).to(dt);
      }
      ops::KdaOptions opt;
      opt.num_heads = p.A_log.size(0);
      opt.head_dim = p.o_norm.size(0);
      if (softplus) opt.lower_bound = std::nullopt;
      const Tensor x = f.tensor("kda.x").to(dt);
      ops::KdaGrads g;
      const Tensor dx = ops::kda_backward(p, x, f.tensor("kda.cu_seqlens"), opt, nullptr,
                                          f.tensor(pre + "dy").to(dt), g);
      EXPECT_LE(rel_err(dx, f.tensor(pre + "dx")), 1e-4);
      for (auto& [name, t] : named(g)) {
        SCOPED_TRACE(name);
        EXPECT_LE(rel_err(*t, f.tensor(pre + "grad." + name)), 1e-4);
      }
    }
  }
}
