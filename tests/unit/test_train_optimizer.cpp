// AdamW against a float64 reference written here (weight decay, bias correction, clipping, bf16
// storage rounding), the non-finite skip, and bit-exact save / load.

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <filesystem>
#include <random>

#include "glmtune/base/error.h"
#include "glmtune/io/safetensors.h"
#include "glmtune/tensor/rng.h"
#include "glmtune/train/optimizer.h"

using namespace glmtune;
using namespace glmtune::train;
namespace fs = std::filesystem;

namespace {

uint64_t fresh_seed() { return std::random_device{}(); }

Tensor random_tensor(const Shape& shape, DType dtype, uint64_t seed, uint64_t offset,
                     double std = 1.0) {
  Tensor t = Tensor::empty(shape, dtype);
  fill_normal(t, seed, offset, 0.0, std);
  return t;
}

fs::path temp_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() /
               ("glmtune_test_optimizer_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

// PyTorch-style AdamW in float64, on one parameter.
struct RefAdamW {
  std::vector<double> p, m, v;
  int64_t t = 0;

  explicit RefAdamW(const std::vector<double>& init)
      : p(init), m(init.size(), 0.0), v(init.size(), 0.0) {}

  void step(const std::vector<double>& g, double lr, double clip, const AdamWConfig& c) {
    ++t;
    const double bc1 = 1 - std::pow(c.beta1, double(t));
    const double bc2 = 1 - std::pow(c.beta2, double(t));
    for (size_t j = 0; j < p.size(); ++j) {
      const double gj = g[j] * clip;
      p[j] *= 1 - lr * c.weight_decay;
      m[j] = c.beta1 * m[j] + (1 - c.beta1) * gj;
      v[j] = c.beta2 * v[j] + (1 - c.beta2) * gj * gj;
      p[j] -= lr / bc1 * m[j] / (std::sqrt(v[j]) / std::sqrt(bc2) + c.eps);
    }
  }
};

double ref_norm(const std::vector<std::vector<double>>& grads) {
  double s = 0;
  for (const auto& g : grads)
    for (double x : g) s += x * x;
  return std::sqrt(s);
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  Tensor c = t.contiguous();
  const auto* p = static_cast<const uint8_t*>(c.data_ptr());
  return std::vector<uint8_t>(p, p + c.nbytes());
}

// Three trainable parameters (f32, bf16, f16 storage) and one frozen one.
struct ParamSet {
  std::vector<NamedParam> params;
  explicit ParamSet(uint64_t seed) {
    params.push_back({"a.weight", random_tensor({7, 5}, DType::f32, seed, 0), true});
    params.push_back({"b.weight", random_tensor({33, 40}, DType::bf16, seed, 1000), true});
    params.push_back({"c.bias", random_tensor({9}, DType::f16, seed, 5000), true});
    params.push_back({"frozen.weight", random_tensor({4, 4}, DType::bf16, seed, 6000), false});
  }
  // A fresh copy (own storage) of every parameter.
  std::vector<NamedParam> clone() const {
    std::vector<NamedParam> out;
    for (const auto& p : params) out.push_back({p.name, p.value.clone(), p.trainable});
    return out;
  }
};

std::vector<Tensor> random_grads(const std::vector<NamedParam>& params, uint64_t seed,
                                 uint64_t step, double scale) {
  std::vector<Tensor> g;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].trainable) {
      g.emplace_back();
      continue;
    }
    // The second gradient comes in bf16, as a bf16 backward would produce it.
    const DType dt = i == 1 ? DType::bf16 : DType::f32;
    g.push_back(random_tensor(params[i].value.shape(), dt, seed ^ 0x9e3779b97f4a7c15ull,
                              step * 100000 + i * 10000, scale));
  }
  return g;
}

}  // namespace

TEST(AdamW, MatchesFloat64ReferenceOverSeveralSteps) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  ParamSet setup(seed);
  AdamWConfig cfg;
  cfg.weight_decay = 0.1;  // large enough that a missing or misplaced decay shows
  cfg.max_grad_norm = 0;   // clipping is tested separately
  const auto frozen_before = bytes_of(setup.params[3].value);
  AdamW opt(setup.clone(), cfg);
  std::vector<RefAdamW> ref;
  for (const auto& p : opt.params()) ref.emplace_back(p.value.to_doubles());
  const double lrs[] = {0.0, 1e-2, 3e-3, 5e-2, 2e-3, 1e-2, 7e-3};
  for (int64_t step = 0; step < 7; ++step) {
    auto grads = random_grads(opt.params(), seed, uint64_t(step), 0.5);
    const StepReport r = opt.step(grads, lrs[step]);
    EXPECT_FALSE(r.skipped);
    EXPECT_EQ(r.step, step + 1);
    EXPECT_EQ(r.clip_coef, 1.0);
    for (size_t i = 0; i < 3; ++i) ref[i].step(grads[i].to_doubles(), lrs[step], 1.0, cfg);
  }
  EXPECT_EQ(opt.step_count(), 7);
  for (size_t i = 0; i < 3; ++i) {
    SCOPED_TRACE(opt.params()[i].name);
    const auto master = opt.master(i).to_doubles();
    const auto m = opt.exp_avg(i).to_doubles();
    const auto v = opt.exp_avg_sq(i).to_doubles();
    const auto stored = opt.params()[i].value.to_doubles();
    for (size_t j = 0; j < master.size(); ++j) {
      ASSERT_NEAR(master[j], ref[i].p[j], 2e-6 * (1 + std::abs(ref[i].p[j]))) << j;
      // Moments are compared at the gradients' scale (0.5): they may cancel to near zero.
      ASSERT_NEAR(m[j], ref[i].m[j], 1e-6 + 1e-5 * std::abs(ref[i].m[j])) << j;
      ASSERT_NEAR(v[j], ref[i].v[j], 1e-7 + 1e-5 * std::abs(ref[i].v[j])) << j;
    }
    // The storage is exactly the master rounded to its dtype; against the f64 reference that is
    // within one unit in the last place of that dtype.
    const DType dt = opt.params()[i].value.dtype();
    const Tensor rounded = opt.master(i).to(dt);
    EXPECT_EQ(bytes_of(rounded), bytes_of(opt.params()[i].value));
    const double ulp = dt == DType::bf16 ? std::ldexp(1.0, -7) : std::ldexp(1.0, -10);
    for (size_t j = 0; j < stored.size(); ++j)
      ASSERT_LE(std::abs(stored[j] - ref[i].p[j]), ulp * std::abs(ref[i].p[j]) + 1e-6) << j;
  }
  // The f32 parameter is its own master; the frozen one was not touched.
  EXPECT_EQ(opt.master(0).data_ptr(), opt.params()[0].value.data_ptr());
  EXPECT_EQ(bytes_of(opt.params()[3].value), frozen_before);
  EXPECT_FALSE(opt.exp_avg(3).defined());
}

TEST(AdamW, ClipsByTheGlobalNorm) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  ParamSet setup(seed);
  AdamWConfig cfg;  // max_grad_norm 1.0 (torch's clip coefficient min(1, 1/(norm + 1e-6)))
  AdamW opt(setup.clone(), cfg);
  std::vector<RefAdamW> ref;
  for (const auto& p : opt.params()) ref.emplace_back(p.value.to_doubles());
  for (int64_t step = 0; step < 3; ++step) {
    auto grads = random_grads(opt.params(), seed, uint64_t(step), 3.0);  // norm well above 1
    std::vector<std::vector<double>> g64;
    for (size_t i = 0; i < 3; ++i) g64.push_back(grads[i].to_doubles());
    const double norm = ref_norm(g64);
    ASSERT_GT(norm, 10.0);
    EXPECT_NEAR(std::sqrt(opt.grad_sq_norm(grads)), norm, 1e-12 * norm);
    const StepReport r = opt.step(grads, 1e-2);
    EXPECT_NEAR(r.grad_norm, norm, 1e-12 * norm);
    EXPECT_NEAR(r.clip_coef, 1.0 / (norm + 1e-6), 1e-15);
    for (size_t i = 0; i < 3; ++i) ref[i].step(g64[i], 1e-2, 1.0 / (norm + 1e-6), cfg);
  }
  for (size_t i = 0; i < 3; ++i) {
    const auto master = opt.master(i).to_doubles();
    for (size_t j = 0; j < master.size(); ++j)
      ASSERT_NEAR(master[j], ref[i].p[j], 2e-6 * (1 + std::abs(ref[i].p[j]))) << i << " " << j;
  }
  // A norm below the threshold leaves the gradients alone; max_norm 0 turns clipping off.
  EXPECT_EQ(clip_coefficient(0.5, 1.0), 1.0);
  EXPECT_EQ(clip_coefficient(1e6, 0.0), 1.0);
  EXPECT_DOUBLE_EQ(clip_coefficient(4.0, 2.0), 2.0 / (4.0 + 1e-6));
}

TEST(AdamW, UsesAGlobalNormGivenByTheCaller) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  ParamSet setup(seed);
  AdamW a(setup.clone(), {});
  auto grads = random_grads(a.params(), seed, 0, 1.0);
  // What other ranks would add: the same update as scaling the local gradients by that factor.
  const double norm = 10.0;
  const StepReport r = a.step(grads, 1e-2, norm);
  EXPECT_EQ(r.grad_norm, norm);
  EXPECT_NEAR(r.clip_coef, 1.0 / (norm + 1e-6), 1e-15);
  std::vector<Tensor> scaled;
  for (const auto& g : grads) {
    if (!g.defined()) {
      scaled.emplace_back();
      continue;
    }
    auto d = g.to_doubles();
    for (auto& x : d) x *= r.clip_coef;
    scaled.push_back(Tensor::from_doubles(d, g.shape(), DType::f64));
  }
  AdamWConfig no_clip;
  no_clip.max_grad_norm = 0;
  AdamW c(setup.clone(), no_clip);
  c.step(scaled, 1e-2);
  for (size_t i = 0; i < 3; ++i) {
    const auto x = a.master(i).to_doubles(), y = c.master(i).to_doubles();
    for (size_t j = 0; j < x.size(); ++j) ASSERT_NEAR(x[j], y[j], 1e-6 * (1 + std::abs(y[j])));
  }
}

TEST(AdamW, NonFiniteNormSkipsTheStep) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  ParamSet setup(seed);
  AdamW opt(setup.clone(), {});
  opt.step(random_grads(opt.params(), seed, 0, 1.0), 1e-2);
  std::vector<std::vector<uint8_t>> before;
  for (size_t i = 0; i < 3; ++i) {
    before.push_back(bytes_of(opt.params()[i].value));
    before.push_back(bytes_of(opt.master(i)));
    before.push_back(bytes_of(opt.exp_avg(i)));
    before.push_back(bytes_of(opt.exp_avg_sq(i)));
  }
  for (double bad : {std::nan(""), double(INFINITY), -double(INFINITY)}) {
    auto grads = random_grads(opt.params(), seed, 1, 1.0);
    grads[2].set_item({4}, bad);
    const StepReport r = opt.step(grads, 1e-2);
    EXPECT_TRUE(r.skipped) << bad;
    EXPECT_FALSE(std::isfinite(r.grad_norm));
    EXPECT_EQ(r.step, 1);
    EXPECT_EQ(opt.step_count(), 1);
    size_t k = 0;
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(bytes_of(opt.params()[i].value), before[k++]);
      EXPECT_EQ(bytes_of(opt.master(i)), before[k++]);
      EXPECT_EQ(bytes_of(opt.exp_avg(i)), before[k++]);
      EXPECT_EQ(bytes_of(opt.exp_avg_sq(i)), before[k++]);
    }
  }
  // A finite gradient that overflows f32 when squared still counts as finite in the f64 norm.
  auto big = random_grads(opt.params(), seed, 2, 1.0);
  big[0].set_item({0, 0}, 1e30);
  const StepReport r = opt.step(big, 1e-2);
  EXPECT_FALSE(r.skipped);
  EXPECT_EQ(opt.step_count(), 2);
}

TEST(AdamW, SaveAndLoadResumeBitExactly) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const fs::path dir = temp_dir("resume");
  ParamSet setup(seed);
  AdamW straight(setup.clone(), {});
  AdamW first(setup.clone(), {});
  const double lrs[] = {1e-3, 2e-2, 1e-2, 5e-3, 3e-3};
  for (int64_t s = 0; s < 5; ++s) straight.step(random_grads(setup.params, seed, s, 2.0), lrs[s]);
  for (int64_t s = 0; s < 3; ++s) first.step(random_grads(setup.params, seed, s, 2.0), lrs[s]);
  first.save(dir / "optimizer");
  // The resumed run starts from different parameter values: load must restore them from the
  // masters, not rely on the model checkpoint.
  ParamSet other(seed + 1);
  AdamW resumed(other.clone(), {});
  resumed.load(dir / "optimizer");
  EXPECT_EQ(resumed.step_count(), 3);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(bytes_of(resumed.master(i)), bytes_of(first.master(i)));
    EXPECT_EQ(bytes_of(resumed.exp_avg(i)), bytes_of(first.exp_avg(i)));
    EXPECT_EQ(bytes_of(resumed.exp_avg_sq(i)), bytes_of(first.exp_avg_sq(i)));
    EXPECT_EQ(bytes_of(resumed.params()[i].value), bytes_of(first.params()[i].value));
  }
  for (int64_t s = 3; s < 5; ++s) resumed.step(random_grads(setup.params, seed, s, 2.0), lrs[s]);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(bytes_of(resumed.params()[i].value), bytes_of(straight.params()[i].value));
    EXPECT_EQ(bytes_of(resumed.exp_avg_sq(i)), bytes_of(straight.exp_avg_sq(i)));
  }
  fs::remove_all(dir);
}

TEST(AdamW, LoadRejectsAStateOfAnotherModel) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const fs::path dir = temp_dir("mismatch");
  ParamSet setup(seed);
  AdamW opt(setup.clone(), {});
  opt.save(dir / "optimizer");
  auto message = [&](std::vector<NamedParam> params) -> std::string {
    AdamW other(std::move(params), {});
    try {
      other.load(dir / "optimizer");
    } catch (const Error& e) {
      return e.what();
    }
    ADD_FAILURE() << "expected an error";
    return "";
  };
  // An extra trainable parameter: its state is missing.
  auto more = setup.clone();
  more.push_back({"d.weight", random_tensor({3}, DType::f32, seed, 9000), true});
  std::string msg = message(more);
  EXPECT_NE(msg.find("missing"), std::string::npos) << msg;
  EXPECT_NE(msg.find("optimizer/master/d.weight"), std::string::npos) << msg;
  // A parameter now frozen: its state is unexpected.
  auto fewer = setup.clone();
  fewer[2].trainable = false;
  msg = message(fewer);
  EXPECT_NE(msg.find("unexpected"), std::string::npos) << msg;
  EXPECT_NE(msg.find("c.bias"), std::string::npos) << msg;
  // A different shape.
  auto reshaped = setup.clone();
  reshaped[0].value = random_tensor({5, 7}, DType::f32, seed, 0);
  msg = message(reshaped);
  EXPECT_NE(msg.find("expected f32 [5, 7]"), std::string::npos) << msg;
  // A directory that is not an optimizer state.
  fs::create_directories(dir / "model");
  io::save_safetensors(dir / "model" / "model.safetensors",
                       {{"x", random_tensor({2}, DType::f32, seed, 1)}}, {{"format", "pt"}});
  AdamW any(setup.clone(), {});
  try {
    any.load(dir / "model");
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not an optimizer state"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(AdamW, RefusesParametersItCannotWrite) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto owner = std::make_shared<std::vector<float>>(6, 1.5f);
  Tensor view = Tensor::from_external(owner->data(), {6}, DType::f32, Device::cpu(), owner);
  EXPECT_THROW(AdamW({{"mapped", view, true}}), InternalError);
  // Frozen parameters may view anything.
  EXPECT_NO_THROW(AdamW({{"mapped", view, false}}));
  EXPECT_THROW(AdamW({{"f64", random_tensor({3}, DType::f64, seed, 0), true}}), InternalError);
  EXPECT_THROW(AdamW({{"same", random_tensor({3}, DType::f32, seed, 0), true},
                      {"same", random_tensor({3}, DType::f32, seed, 9), true}}),
               InternalError);
}

TEST(AdamW, GradientNormDoesNotDependOnTheThreadCount) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  // Several norm blocks per parameter, so threads really split the sum.
  std::vector<NamedParam> params = {
      {"big", random_tensor({300, 701}, DType::bf16, seed, 0), true},
      {"small", random_tensor({17}, DType::f32, seed, 1 << 20), true}};
  AdamW opt(params, {});
  auto grads = random_grads(opt.params(), seed, 0, 1.0);
  const int before = omp_get_max_threads();
  omp_set_num_threads(1);
  const double one = opt.grad_sq_norm(grads);
  omp_set_num_threads(3);
  const double three = opt.grad_sq_norm(grads);
  omp_set_num_threads(before);
  EXPECT_EQ(one, three);
  double ref = 0;
  for (const auto& g : grads)
    for (double x : g.to_doubles()) ref += x * x;
  EXPECT_NEAR(one, ref, 1e-12 * ref);
}
