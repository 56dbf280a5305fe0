// CUDA parity for the optimizer step (ops/cuda/adamw.h) against a float64 reference written here
// from the formulas of docs/training.md, "Optimizer" (torch.optim.AdamW with decoupled weight
// decay, clip coefficient min(1, max_norm / (norm + 1e-6))): the global gradient norm over f32 and
// bf16 gradients, the clipped multi-tensor update of master weights and moments (relative L2 ≤
// 1e-6, the update itself too), the bf16 storage refresh (bit-exact rounding of the new master),
// unaligned tensors on the scalar path, the skipped step on a non-finite norm, and bit-identical
// reruns. Fresh random inputs (seed printed; GLMTUNE_TEST_SEED reproduces a run). Skipped (not
// failed) where no GPU is visible or CUDA is not built.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "glmtune/tensor/tensor.h"
#include "support/cuda_test_support.h"
#ifdef GLMTUNE_WITH_CUDA
#include "glmtune/ops/cuda/adamw.h"
#endif

using namespace glmtune;
using namespace glmtune::test;

namespace {

// n normal draws as f32 values, held exactly as doubles.
std::vector<double> normal(int64_t n, uint64_t stream, double mean, double std) {
  return random_cpu({n}, DType::f32, stream, mean, std).to_doubles();
}

#ifdef GLMTUNE_WITH_CUDA
Tensor on_gpu(const std::vector<double>& v, DType dtype) {
  return Tensor::from_doubles(v, {int64_t(v.size())}, dtype).to(kGpu);
}

// One parameter's host state (f32 values held as doubles) and its device tensors.
struct Param {
  int64_t n = 0;
  bool grad_bf16 = false, with_storage = false;
  std::vector<double> master, m, v, grad;
  Tensor buf;  // device buffer the master lives in (offset by one element when unaligned)
  cuda::AdamWParam dev;
};

Param make_param(int64_t n, bool grad_bf16, bool with_storage, bool unaligned, uint64_t stream) {
  Param p;
  p.n = n;
  p.grad_bf16 = grad_bf16;
  p.with_storage = with_storage;
  p.master = normal(n, stream, 0.0, 0.02);
  p.m = normal(n, stream + 1, 0.0, 1e-3);
  p.v = normal(n, stream + 2, 0.0, 1e-3);
  for (double& x : p.v) x = double(float(x * x));  // second moments are positive
  p.grad = normal(n, stream + 3, 0.0, 1e-2);
  if (grad_bf16) p.grad = Tensor::from_doubles(p.grad, {n}, DType::bf16).to_doubles();
  auto place = [&](const std::vector<double>& v, DType dtype) {
    if (!unaligned) return on_gpu(v, dtype);
    // A view starting one element into a larger buffer: 4- or 2-byte aligned only, so the
    // kernels take their scalar path.
    std::vector<double> padded(v.size() + 1, 0.0);
    std::copy(v.begin(), v.end(), padded.begin() + 1);
    return on_gpu(padded, dtype).slice(0, 1, int64_t(padded.size()));
  };
  p.dev.master = place(p.master, DType::f32);
  p.dev.exp_avg = place(p.m, DType::f32);
  p.dev.exp_avg_sq = place(p.v, DType::f32);
  p.dev.grad = place(p.grad, grad_bf16 ? DType::bf16 : DType::f32);
  if (with_storage) {
    p.dev.param = place(std::vector<double>(size_t(n), 0.0), DType::bf16);
    p.dev.param.fill_(NAN);  // poisoned: the step must write every element
  }
  return p;
}

// A deep copy of the device state (to rerun from the same start).
cuda::AdamWParam clone(const cuda::AdamWParam& a) {
  cuda::AdamWParam c;
  c.master = a.master.clone();
  c.exp_avg = a.exp_avg.clone();
  c.exp_avg_sq = a.exp_avg_sq.clone();
  c.grad = a.grad;
  if (a.param.defined()) c.param = a.param.clone();
  return c;
}

std::vector<Param> make_params() {
  std::vector<Param> ps;
  uint64_t s = 1;
  ps.push_back(make_param(1, false, true, false, s += 10));
  ps.push_back(make_param(7, true, false, false, s += 10));
  ps.push_back(make_param(4096, false, true, false, s += 10));
  ps.push_back(make_param(65536 + 5, true, true, false, s += 10));  // crosses a chunk boundary
  ps.push_back(make_param(200003, false, true, false, s += 10));
  ps.push_back(make_param(1000, true, true, true, s += 10));  // unaligned: scalar path
  ps.push_back(make_param(70001, false, false, true, s += 10));
  return ps;
}
#endif

}  // namespace

TEST(CudaOpsAdamW, GradNormAndClippedStepMatchFloat64) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  std::vector<Param> ps = make_params();
  std::vector<Tensor> grads;
  double sq = 0;
  for (const Param& p : ps) {
    grads.push_back(p.dev.grad);
    for (double g : p.grad) sq += g * g;
  }
  const double norm_ref = std::sqrt(sq);
  const double max_norm = 1.0;
  ASSERT_GT(norm_ref, 2.0) << "the test gradients should need clipping";

  const cuda::GradNorm gn = cuda::grad_norm(grads, max_norm);
  const double norm = gn.norm.to_doubles()[0];
  const double clip = gn.clip.to_doubles()[0];
  std::printf("[ measure  ] grad norm %.9g, float64 reference %.9g\n", norm, norm_ref);
  EXPECT_LE(std::abs(norm - norm_ref) / norm_ref, 1e-6) << ctx("grad norm");
  const double clip_ref = std::min(1.0, max_norm / (norm_ref + 1e-6));
  EXPECT_LE(std::abs(clip - clip_ref) / clip_ref, 1e-6) << ctx("clip coefficient");
  const cuda::GradNorm gn2 = cuda::grad_norm(grads, max_norm);
  EXPECT_TRUE(bit_identical(gn.norm, gn2.norm)) << ctx("grad norm rerun");

  cuda::AdamWConfig cfg;
  cfg.lr = 1e-2;  // large enough that the update is a visible part of the weight
  cfg.beta1 = 0.9;
  cfg.beta2 = 0.95;
  cfg.eps = 1e-8;
  cfg.weight_decay = 0.01;
  cfg.step = 5;
  std::vector<cuda::AdamWParam> before;
  std::vector<cuda::AdamWParam> dev;
  for (const Param& p : ps) {
    before.push_back(clone(p.dev));
    dev.push_back(p.dev);
  }
  cuda::adamw_step(dev, cfg, gn.clip);

  const double bc1 = 1.0 - std::pow(cfg.beta1, double(cfg.step));
  const double bc2 = 1.0 - std::pow(cfg.beta2, double(cfg.step));
  for (size_t i = 0; i < ps.size(); ++i) {
    const Param& p = ps[i];
    std::vector<double> master(p.master), m(p.m), v(p.v), delta(static_cast<size_t>(p.n));
    for (size_t j = 0; j < size_t(p.n); ++j) {
      const double g = p.grad[j] * clip;  // the device's clip value, as the kernel uses it
      master[j] *= 1.0 - cfg.lr * cfg.weight_decay;
      m[j] = cfg.beta1 * m[j] + (1.0 - cfg.beta1) * g;
      v[j] = cfg.beta2 * v[j] + (1.0 - cfg.beta2) * g * g;
      master[j] -= cfg.lr / bc1 * m[j] / (std::sqrt(v[j]) / std::sqrt(bc2) + cfg.eps);
      delta[j] = master[j] - p.master[j];
    }
    const std::string what = "param " + std::to_string(i) + " (n=" + std::to_string(p.n) + ")";
    const std::vector<double> got_master = dev[i].master.to_doubles();
    std::vector<double> got_delta(static_cast<size_t>(p.n));
    for (size_t j = 0; j < size_t(p.n); ++j) got_delta[j] = got_master[j] - p.master[j];
    EXPECT_CLOSE(got_master, master, 1e-6, "master " + what);
    EXPECT_CLOSE(got_delta, delta, 1e-6, "update " + what);
    EXPECT_CLOSE(dev[i].exp_avg.to_doubles(), m, 1e-6, "exp_avg " + what);
    EXPECT_CLOSE(dev[i].exp_avg_sq.to_doubles(), v, 1e-6, "exp_avg_sq " + what);
    if (p.with_storage) {
      // The bf16 storage is the round-to-nearest-even of the new fp32 master, bit for bit.
      const Tensor want = Tensor::from_doubles(got_master, {p.n}, DType::bf16);
      EXPECT_TRUE(bit_identical(dev[i].param, want)) << ctx("bf16 storage " + what);
    }
  }

  // Rerun from the saved start: bit-identical.
  std::vector<cuda::AdamWParam> again;
  for (const auto& b : before) again.push_back(clone(b));
  cuda::adamw_step(again, cfg, gn.clip);
  for (size_t i = 0; i < ps.size(); ++i) {
    EXPECT_TRUE(bit_identical(again[i].master, dev[i].master)) << ctx("rerun master");
    EXPECT_TRUE(bit_identical(again[i].exp_avg_sq, dev[i].exp_avg_sq)) << ctx("rerun v");
  }
#endif
}

TEST(CudaOpsAdamW, NoClipEqualsUnitClip) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  std::vector<Param> ps = make_params();
  std::vector<Tensor> grads;
  for (const Param& p : ps) grads.push_back(p.dev.grad);
  // max_norm <= 0: no clipping, the coefficient is exactly 1.
  const cuda::GradNorm gn = cuda::grad_norm(grads, 0.0);
  EXPECT_EQ(gn.clip.to_doubles()[0], 1.0);
  std::vector<cuda::AdamWParam> a, b;
  for (const Param& p : ps) {
    a.push_back(clone(p.dev));
    b.push_back(clone(p.dev));
  }
  cuda::AdamWConfig cfg;
  cfg.lr = 3e-3;
  cfg.step = 1;
  cuda::adamw_step(a, cfg, gn.clip);
  cuda::adamw_step(b, cfg);
  for (size_t i = 0; i < ps.size(); ++i) {
    EXPECT_TRUE(bit_identical(a[i].master, b[i].master)) << ctx("param " + std::to_string(i));
    EXPECT_FALSE(bit_identical(a[i].master, ps[i].dev.master)) << "the step changed nothing";
  }
#endif
}

TEST(CudaOpsAdamW, NonFiniteNormSkipsTheStep) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  std::vector<Param> ps = make_params();
  // One infinite gradient element anywhere makes the norm infinite.
  Tensor g = ps[3].dev.grad.to(Device::cpu());
  g.set_item({12345}, INFINITY);
  ps[3].dev.grad = g.to(kGpu);
  std::vector<Tensor> grads;
  std::vector<cuda::AdamWParam> dev, before;
  for (const Param& p : ps) {
    grads.push_back(p.dev.grad);
    dev.push_back(p.dev);
    before.push_back(clone(p.dev));
  }
  const cuda::GradNorm gn = cuda::grad_norm(grads, 1.0);
  EXPECT_FALSE(std::isfinite(gn.norm.to_doubles()[0]));
  EXPECT_TRUE(std::isnan(gn.clip.to_doubles()[0]));
  cuda::AdamWConfig cfg;
  cfg.lr = 1e-2;
  cuda::adamw_step(dev, cfg, gn.clip);
  for (size_t i = 0; i < ps.size(); ++i) {
    EXPECT_TRUE(bit_identical(dev[i].master, before[i].master)) << "skipped step wrote master";
    EXPECT_TRUE(bit_identical(dev[i].exp_avg, before[i].exp_avg)) << "skipped step wrote m";
    EXPECT_TRUE(bit_identical(dev[i].exp_avg_sq, before[i].exp_avg_sq)) << "skipped step wrote v";
  }
#endif
}
