// Low-rank adapters: the projection op with an adapter (ops/linear.h) against its formula and
// float64 finite differences, the text model's adapter gradients against finite differences of
// the whole loss, target resolution, the PEFT adapter directory and merging (model/lora.h).

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <string>
#include <tuple>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/io/safetensors.h"
#include "glmtune/model/init.h"
#include "glmtune/model/lora.h"
#include "glmtune/model/loss.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/model.h"
#include "glmtune/ops/cross_entropy.h"
#include "glmtune/ops/elementwise.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/moe.h"
#include "support/random_model.h"
#include "support/temp_dir.h"
#include "support/test_support.h"

using namespace glmtune;
using namespace glmtune::test;
using namespace glmtune::model;
using namespace glmtune::model::text;

namespace {

namespace fs = std::filesystem;
constexpr RelErr rel_err{};

ops::Linear random_linear(int64_t out, int64_t in, int64_t r, uint64_t off, bool bias) {
  ops::Linear l(random_normal({out, in}, off, DType::f64, 0, 1.0 / std::sqrt(double(in))));
  if (bias) l.bias = random_normal({out}, off + 1'000, DType::f64);
  l.lora.A = random_normal({r, in}, off + 2'000, DType::f64);
  l.lora.B = random_normal({out, r}, off + 3'000, DType::f64);
  l.lora.scale = 1.7;
  return l;
}

TEST(LoraOps, AdapterAddsTheScaledLowRankTerm) {
  SCOPED_TRACE(seed_note());
  const int64_t t = 5, in = 7, out = 6, r = 3;
  const ops::Linear l = random_linear(out, in, r, 10'000, true);
  const Tensor x = random_normal({t, in}, 1, DType::f64);
  const Tensor y = ops::linear(x, l);
  const std::vector<double> xs = x.to_doubles(), w = l.weight.to_doubles(), b = l.bias.to_doubles(),
                            a = l.lora.A.to_doubles(), bb = l.lora.B.to_doubles(),
                            ys = y.to_doubles();
  double worst = 0;
  for (int64_t i = 0; i < t; ++i)
    for (int64_t o = 0; o < out; ++o) {
      double want = b[size_t(o)];
      for (int64_t k = 0; k < in; ++k) want += w[size_t(o * in + k)] * xs[size_t(i * in + k)];
      for (int64_t j = 0; j < r; ++j) {
        double ax = 0;
        for (int64_t k = 0; k < in; ++k) ax += a[size_t(j * in + k)] * xs[size_t(i * in + k)];
        want += l.lora.scale * bb[size_t(o * r + j)] * ax;
      }
      worst = std::max(worst, std::abs(ys[size_t(i * out + o)] - want));
    }
  EXPECT_LE(worst, 1e-12);

  // Without an adapter the Linear calls are the tensor calls, bit for bit.
  ops::Linear plain(l.weight, l.bias);
  EXPECT_EQ(ops::linear(x, plain).to_doubles(), ops::linear(x, l.weight, l.bias).to_doubles());
}

// Also with dropout active: the backward is then the gradient of the masked function (the mask
// fixed by its key), the input's gradient going back through the same mask.
TEST(LoraOps, BackwardMatchesFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  const int64_t t = 6, in = 8, out = 5, r = 2;
  ops::Linear l = random_linear(out, in, r, 20'000, true);
  Tensor x = random_normal({t, in}, 2, DType::f64);
  const Tensor dy = random_normal({t, out}, 3, DType::f64);
  auto loss = [&] { return dot(dy, ops::linear(x, l)); };
  for (const uint64_t dropout_key : {uint64_t(0), uint64_t(987654321)})
    for (bool add : {false, true}) {
      SCOPED_TRACE(add ? "linear_backward_add" : "linear_backward");
      SCOPED_TRACE(dropout_key ? "dropout 0.4" : "no dropout");
      l.lora.dropout = 0.4;
      l.lora.dropout_key = dropout_key;
      ops::Linear g;
      Tensor dx;
      if (add) {
        dx = random_normal({t, in}, 4, DType::f64);
        const Tensor before = dx.clone();
        ops::linear_backward_add(dx, dy, x, l, &g);
        // What was added to the running sum is the input gradient.
        std::vector<double> d = dx.to_doubles(), b0 = before.to_doubles();
        for (size_t i = 0; i < d.size(); ++i) d[i] -= b0[i];
        dx = Tensor::from_doubles(d, dx.shape(), DType::f64);
      } else {
        dx = ops::linear_backward(dy, x, l, &g);
      }
      uint64_t off = 30'000;
      for (auto [name, param, grad] :
           std::vector<std::tuple<const char*, Tensor*, Tensor*>>{{"weight", &l.weight, &g.weight},
                                                                  {"bias", &l.bias, &g.bias},
                                                                  {"lora_A", &l.lora.A, &g.lora.A},
                                                                  {"lora_B", &l.lora.B, &g.lora.B},
                                                                  {"x", &x, &dx}}) {
        SCOPED_TRACE(name);
        ASSERT_TRUE(grad->defined());
        EXPECT_LE(fd_direction(*param, *grad, random_normal(param->shape(), off += 100, DType::f64),
                               loss),
                  1e-9);
      }
    }
}

// lora_dropout: the mask keeps each element with probability 1 − p and scales it by 1 / (1 − p),
// the same key redraws the same mask (the backward and a recompute see the forward's), another key
// another one, and key 0 is no dropout at all.
TEST(LoraOps, DropoutMasksAndScalesAsItsKeySays) {
  const double p = 0.25;
  const Tensor ones = Tensor::full({400, 250}, 1.0, DType::f64);
  Tensor a = ones.clone(), b = ones.clone(), c = ones.clone();
  ops::dropout_into(a, p, 77);
  ops::dropout_into(b, p, 77);
  ops::dropout_into(c, p, 78);
  const std::vector<double> va = a.to_doubles(), vb = b.to_doubles(), vc = c.to_doubles();
  EXPECT_EQ(va, vb);
  EXPECT_NE(va, vc);
  int64_t dropped = 0;
  for (double v : va) {
    EXPECT_TRUE(v == 0 || v == 1 / (1 - p)) << v;
    dropped += v == 0;
  }
  // 100,000 Bernoulli(0.25) draws: the count is within 6 standard deviations (137) of 25,000.
  EXPECT_NEAR(double(dropped), p * double(va.size()), 6 * std::sqrt(p * (1 - p) * va.size()));
  // f32 takes the same mask, the product rounded once.
  Tensor f = Tensor::full({400, 250}, 1.0, DType::f32);
  ops::dropout_into(f, p, 77);
  const std::vector<double> vf = f.to_doubles();
  for (size_t i = 0; i < va.size(); ++i)
    ASSERT_EQ(vf[i], va[i] == 0 ? 0.0 : double(float(1 / (1 - p)))) << i;

  // Through a projection: key 0 (evaluation) is the adapter without dropout, bit for bit; an
  // active key changes the output.
  ops::Linear l = random_linear(6, 8, 3, 50'000, false);
  const Tensor x = random_normal({5, 8}, 5, DType::f64);
  const std::vector<double> plain = ops::linear(x, l).to_doubles();
  l.lora.dropout = 0.3;
  EXPECT_EQ(ops::linear(x, l).to_doubles(), plain);
  l.lora.dropout_key = 12345;
  EXPECT_NE(ops::linear(x, l).to_doubles(), plain);
}

// A block of a larger input (sequence parallelism: a shard of rows, a slice of heads' columns)
// takes the whole input's mask at its place: the blocks of a [40, 30] tensor, masked apart,
// assemble the mask of the whole; the block's own positions would give another.
TEST(LoraOps, DropoutOfABlockIsTheWholeMaskAtItsPlace) {
  const double p = 0.3;
  const Tensor x = random_normal({40, 30}, 9, DType::f64);
  Tensor whole = x.clone();
  ops::dropout_into(whole, p, 4242);
  const std::vector<double> want = whole.to_doubles();
  for (const auto& [r0, r1, c0, c1] : std::vector<std::array<int64_t, 4>>{
           {0, 40, 0, 30}, {0, 17, 0, 30}, {17, 40, 0, 30}, {0, 40, 10, 20}, {5, 9, 22, 30}}) {
    Tensor block = x.narrow(0, r0, r1 - r0).narrow(1, c0, c1 - c0).contiguous().clone();
    ops::dropout_into(block, p, 4242, {r0, c0, 30});
    const std::vector<double> got = block.to_doubles();
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = c0; c < c1; ++c)
        ASSERT_EQ(got[size_t((r - r0) * (c1 - c0) + (c - c0))], want[size_t(r * 30 + c)])
            << "block [" << r0 << ", " << r1 << ") x [" << c0 << ", " << c1 << "): " << r << ", "
            << c;
  }
  Tensor shard = x.narrow(0, 17, 23).contiguous().clone();
  ops::dropout_into(shard, p, 4242);
  EXPECT_NE(shard.to_doubles(),
            std::vector<double>(want.begin() + 17 * 30, want.end()));  // drawn at its own rows
  Tensor bad = x.narrow(1, 0, 20).contiguous().clone();
  EXPECT_THROW(ops::dropout_into(bad, p, 4242, {0, 15, 30}), InternalError);  // past the row
}

TEST(LoraOps, AFrozenBaseGetsNoGradientAndTheAdapterDoes) {
  SCOPED_TRACE(seed_note());
  ops::Linear l = random_linear(4, 6, 2, 40'000, false);
  l.weight.set_frozen(true);
  const Tensor x = random_normal({3, 6}, 5, DType::f64), dy = random_normal({3, 4}, 6, DType::f64);
  ops::Linear g;
  ops::linear_backward(dy, x, l, &g);
  EXPECT_FALSE(g.weight.defined());
  EXPECT_FALSE(g.bias.defined());
  EXPECT_TRUE(g.lora.A.defined());
  EXPECT_TRUE(g.lora.B.defined());
}

// Labels in [0, V) with every third row ignored.
Tensor head_labels(int64_t rows, int64_t vocab, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<int64_t> v(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i)
    v[size_t(i)] = i % 3 == 1 ? ops::kIgnoreIndex : int64_t(gen() % uint64_t(vocab));
  return Tensor::from_vector(v, {rows});
}

// The fused head's weight gradient of the columns from c0 on (what the head's adapter asks for,
// [V, D − c0]) is those columns of the whole weight's gradient, added to what the buffer holds;
// the loss and the input gradient do not change.
TEST(LoraOps, HeadCrossEntropyGivesTheTrailingColumnsOfTheWeightGradient) {
  SCOPED_TRACE(seed_note());
  const int64_t t = 11, d = 7, v = 9;
  const Tensor h = random_normal({t, d}, 70, DType::f64);
  const Tensor w = random_normal({v, d}, 71, DType::f64);
  const Tensor labels = head_labels(t, v, test_seed());
  for (const int64_t chunk : {int64_t(3), int64_t(256)}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    ops::CrossEntropyOptions opts;
    opts.chunk_rows = chunk;
    opts.grad_scale = 0.7;
    Tensor dh, dw;
    const ops::CrossEntropyResult whole = ops::lm_head_cross_entropy(h, w, labels, opts, &dh, &dw);
    const std::vector<double> dws = dw.to_doubles();
    for (const int64_t c0 : {int64_t(1), d - 3, d - 1}) {
      SCOPED_TRACE("from column " + std::to_string(c0));
      opts.weight_grad_col0 = c0;
      const Tensor before = random_normal({v, d - c0}, 72, DType::f64);
      Tensor dh2, dw2 = before.clone();
      const ops::CrossEntropyResult r = ops::lm_head_cross_entropy(h, w, labels, opts, &dh2, &dw2);
      EXPECT_EQ(r.loss, whole.loss);
      EXPECT_EQ(dh2.to_doubles(), dh.to_doubles());
      ASSERT_EQ(dw2.shape(), (Shape{v, d - c0}));
      const std::vector<double> got = dw2.to_doubles(), b0 = before.to_doubles();
      double worst = 0, largest = 0;
      for (int64_t i = 0; i < v; ++i)
        for (int64_t j = c0; j < d; ++j) {
          const size_t k = size_t(i * (d - c0) + (j - c0));
          worst = std::max(worst, std::abs(got[k] - b0[k] - dws[size_t(i * d + j)]));
          largest = std::max(largest, std::abs(dws[size_t(i * d + j)]));
        }
      EXPECT_GT(largest, 0);
      EXPECT_LE(worst, 1e-14 * largest);
      // A buffer of the whole weight's shape is an error, not a silent partial update.
      Tensor wrong = Tensor::zeros({v, d}, DType::f64);
      EXPECT_THROW(ops::lm_head_cross_entropy(h, w, labels, opts, nullptr, &wrong), InternalError);
    }
    opts.weight_grad_col0 = d;
    EXPECT_THROW(ops::lm_head_cross_entropy(h, w, labels, opts, nullptr, &dw), InternalError);
  }
}

// The head with an adapter: the loss is the cross-entropy of h Wᵀ + scale · (drop(h) Aᵀ) Bᵀ, and
// its gradients (A, B, the weight when trained, the hidden rows) match float64 finite
// differences, with and without a dropout mask; a frozen weight changes none of the others.
TEST(LoraOps, HeadAdapterLossAndGradientsMatchFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  const int64_t t = 10, d = 8, v = 13, r = 3;
  ops::Linear head = random_linear(v, d, r, 80'000, false);
  Tensor h = random_normal({t, d}, 81, DType::f64);
  const Tensor labels = head_labels(t, v, test_seed() + 1);
  ops::CrossEntropyOptions opts;
  opts.chunk_rows = 4;
  opts.grad_scale = 0.6;
  auto loss = [&] {
    return opts.grad_scale * ops::lm_head_cross_entropy(h, head, labels, opts).loss;
  };
  // Without an adapter: exactly the call on the weight.
  {
    const ops::Linear plain(head.weight);
    Tensor dh1, dh2;
    ops::Linear g;
    Tensor dw;
    const double l1 = ops::lm_head_cross_entropy(h, plain, labels, opts, &dh1, &g).loss;
    const double l2 = ops::lm_head_cross_entropy(h, head.weight, labels, opts, &dh2, &dw).loss;
    EXPECT_EQ(l1, l2);
    EXPECT_EQ(dh1.to_doubles(), dh2.to_doubles());
    EXPECT_EQ(g.weight.to_doubles(), dw.to_doubles());
    EXPECT_FALSE(g.lora.A.defined());
  }
  for (const uint64_t key : {uint64_t(0), uint64_t(55555)}) {
    SCOPED_TRACE(key ? "dropout 0.3" : "no dropout");
    head.lora.dropout = 0.3;
    head.lora.dropout_key = key;
    // The loss is that of the adapted logits.
    EXPECT_NEAR(ops::lm_head_cross_entropy(h, head, labels, opts).loss,
                ops::cross_entropy_forward(ops::linear(h, head), labels).loss, 1e-12);
    ops::Linear g;
    Tensor dh;
    ops::lm_head_cross_entropy(h, head, labels, opts, &dh, &g);
    uint64_t off = 82'000;
    for (auto [name, param, grad] :
         std::vector<std::tuple<const char*, Tensor*, Tensor*>>{{"weight", &head.weight, &g.weight},
                                                                {"lora_A", &head.lora.A, &g.lora.A},
                                                                {"lora_B", &head.lora.B, &g.lora.B},
                                                                {"hidden", &h, &dh}}) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(grad->defined());
      EXPECT_LE(
          fd_direction(*param, *grad, random_normal(param->shape(), off += 100, DType::f64), loss),
          1e-9);
    }
    // A frozen weight: no gradient for it, the same ones for the adapter and the rows (the
    // adapter's B then comes from the trailing columns alone).
    head.weight.set_frozen(true);
    ops::Linear gf;
    gf.lora.B = Tensor::full(head.lora.B.shape(), 0.25, DType::f64);
    Tensor dhf;
    ops::lm_head_cross_entropy(h, head, labels, opts, &dhf, &gf);
    head.weight.set_frozen(false);
    EXPECT_FALSE(gf.weight.defined());
    EXPECT_LE(rel_err(gf.lora.A, g.lora.A), 1e-14);
    std::vector<double> db = gf.lora.B.to_doubles();
    for (double& x : db) x -= 0.25;  // accumulated into what the buffer held
    EXPECT_LE(rel_err(Tensor::from_doubles(db, g.lora.B.shape(), DType::f64), g.lora.B), 1e-14);
    EXPECT_LE(rel_err(dhf, dh), 1e-14);
  }
}

// A tiny MoE in f64 with adapters on both fused expert parameters (A [E, r, in], B [E, out, r]).
struct TinyMoe {
  ops::MoeConfig cfg;
  ops::MoeParams p;
  static constexpr int64_t E = 3, D = 6, I = 4, S = 5, r = 2;

  TinyMoe() {
    cfg.n_experts = E;
    cfg.top_k = 2;
    cfg.routed_scaling_factor = 1.3;
    uint64_t off = 90'000;
    auto rnd = [&](const Shape& s, double sd) {
      return random_normal(s, off += 100, DType::f64, 0, sd);
    };
    p.router_weight = rnd({E, D}, 1.0);
    p.e_score_correction_bias = Tensor::zeros({E}, DType::f64);
    p.gate_up_proj = ops::Linear(rnd({E, 2 * I, D}, 0.4));
    p.down_proj = ops::Linear(rnd({E, D, I}, 0.5));
    for (ops::Linear* l : {&p.gate_up_proj, &p.down_proj}) {
      l->lora.A = rnd({E, r, l->weight.size(2)}, 0.5);
      l->lora.B = rnd({E, l->weight.size(1), r}, 0.5);
      l->lora.scale = 1.7;
    }
    p.shared.gate_proj = ops::Linear(rnd({S, D}, 0.4));
    p.shared.up_proj = ops::Linear(rnd({S, D}, 0.4));
    p.shared.down_proj = ops::Linear(rnd({D, S}, 0.4));
  }
};

// W_e + scale · B_e A_e for every expert, in f64.
Tensor merged_experts(const ops::Linear& l) {
  std::vector<double> w = l.weight.to_doubles();
  const std::vector<double> a = l.lora.A.to_doubles(), b = l.lora.B.to_doubles();
  const int64_t e_n = l.weight.size(0), out = l.weight.size(1), in = l.weight.size(2),
                r = l.lora.A.size(1);
  for (int64_t e = 0; e < e_n; ++e)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i)
        for (int64_t k = 0; k < r; ++k)
          w[size_t((e * out + o) * in + i)] +=
              l.lora.scale * b[size_t((e * out + o) * r + k)] * a[size_t((e * r + k) * in + i)];
  return Tensor::from_doubles(w, l.weight.shape(), DType::f64);
}

TEST(LoraOps, ExpertAdaptersComputeTheMergedExperts) {
  SCOPED_TRACE(seed_note());
  const TinyMoe m;
  const Tensor x = random_normal({7, TinyMoe::D}, 11, DType::f64);
  ops::MoeParams merged = m.p;
  merged.gate_up_proj = ops::Linear(merged_experts(m.p.gate_up_proj));
  merged.down_proj = ops::Linear(merged_experts(m.p.down_proj));
  const Tensor y = ops::moe_forward(m.cfg, m.p, x).y;
  EXPECT_LE(rel_err(y, ops::moe_forward(m.cfg, merged, x).y), 1e-12);
  // The adapters change the output (a test of the adapter term, not of the base alone).
  ops::MoeParams plain = m.p;
  plain.gate_up_proj.lora = {};
  plain.down_proj.lora = {};
  EXPECT_GT(rel_err(y, ops::moe_forward(m.cfg, plain, x).y), 1e-3);
  // A mis-shaped adapter is refused naming the parameter and the layout.
  ops::MoeParams bad = m.p;
  bad.down_proj.lora.B = random_normal({TinyMoe::E, TinyMoe::r, TinyMoe::D}, 12, DType::f64);
  try {
    ops::moe_forward(m.cfg, bad, x);
    ADD_FAILURE() << "accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("experts.down_proj adapter"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("[E, out, r]"), std::string::npos) << e.what();
  }
}

TEST(LoraOps, ExpertAdapterGradientsMatchFiniteDifferences) {
  SCOPED_TRACE(seed_note());
  for (bool frozen : {false, true}) {
    SCOPED_TRACE(frozen ? "frozen experts" : "trained experts");
    TinyMoe m;
    m.p.gate_up_proj.weight.set_frozen(frozen);
    m.p.down_proj.weight.set_frozen(frozen);
    Tensor x = random_normal({7, TinyMoe::D}, 13, DType::f64);
    const Tensor dy = random_normal({7, TinyMoe::D}, 14, DType::f64);
    ops::MoeContext ctx;
    ops::moe_forward(m.cfg, m.p, x, -1, ctx);
    ops::MoeParams g;
    const Tensor dx = ops::moe_backward(m.cfg, m.p, ctx, dy, g);
    auto loss = [&] { return dot(dy, ops::moe_forward(m.cfg, m.p, x).y); };
    EXPECT_EQ(g.gate_up_proj.weight.defined(), !frozen);
    EXPECT_EQ(g.down_proj.weight.defined(), !frozen);
    std::vector<std::tuple<const char*, Tensor*, Tensor*>> checks{
        {"gate_up_proj.lora_A", &m.p.gate_up_proj.lora.A, &g.gate_up_proj.lora.A},
        {"gate_up_proj.lora_B", &m.p.gate_up_proj.lora.B, &g.gate_up_proj.lora.B},
        {"down_proj.lora_A", &m.p.down_proj.lora.A, &g.down_proj.lora.A},
        {"down_proj.lora_B", &m.p.down_proj.lora.B, &g.down_proj.lora.B},
        {"x", &x, const_cast<Tensor*>(&dx)}};
    if (!frozen) {
      checks.emplace_back("gate_up_proj", &m.p.gate_up_proj.weight, &g.gate_up_proj.weight);
      checks.emplace_back("down_proj", &m.p.down_proj.weight, &g.down_proj.weight);
    }
    uint64_t off = 95'000;
    for (auto [name, param, grad] : checks) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(grad->defined());
      // The smallest error over three steps: a long step can cross a SwiGLU clamp or change
      // the top-2 choice, a short one drowns in roundoff; a wrong gradient fails at all three.
      const Tensor dir = random_normal(param->shape(), off += 100, DType::f64);
      double err = INFINITY;
      for (double step : {1e-4, 1e-5, 1e-6})
        err = std::min(err, fd_direction(*param, *grad, dir, loss, step));
      EXPECT_LE(err, 1e-7);
    }
  }
}

// ---- The text model with adapters ------------------------------------------------------------

using glmtune::test::RandomModel;

LoraConfig all_linear(int64_t rank = 2, double alpha = 3) {
  LoraConfig c;
  c.rank = rank;
  c.alpha = alpha;
  c.target_modules = {"all-linear"};
  return c;
}

const std::vector<std::string> kExpertParams = {"mlp.experts.gate_up_proj",
                                                "mlp.experts.down_proj"};

// all-linear and both fused expert parameters: every adapter glmtune can train.
LoraConfig everything(int64_t rank = 2, double alpha = 3) {
  LoraConfig c = all_linear(rank, alpha);
  c.target_parameters = kExpertParams;
  return c;
}

// B is zero at initialisation, which leaves A without gradient: draw it, so that every adapter
// tensor is checked.
void randomise_b(ParamStore& store, uint64_t off) {
  for (const InternalParam& p : store.params())
    if (p.adapter && p.name.ends_with("lora_B.weight"))
      store.get(p.name) = random_normal(p.shape, off += 1'000, DType::f32, 0, 0.3);
}

void freeze_base(ParamStore& store) {
  for (const InternalParam& p : store.params())
    if (!p.adapter) store.set_trainable(p.name, false);
}

PackInput tiny_pack(const TextConfig& c, std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> tok(0, int32_t(c.vocab_size) - 1);
  std::vector<int32_t> ids;
  for (int i = 0; i < 20; ++i) {
    int32_t t = tok(rng);
    while (t == c.pad_token_id) t = tok(rng);
    ids.push_back(t);
  }
  PackInput in;
  in.input_ids = Tensor::from_vector(ids, {int64_t(ids.size())});
  in.cu_seqlens = Tensor::from_vector(std::vector<int32_t>{0, 8, 20}, {3});
  in.labels = next_token_labels(in.input_ids, in.cu_seqlens,
                                Tensor::from_vector(std::vector<int32_t>(20, 1), {20}));
  return in;
}

TEST(LoraModel, TargetsResolveAsPeftMatchesThem) {
  RandomModel m("lora", 11);
  std::vector<std::string> all = adaptable_modules(*m.store);
  ASSERT_FALSE(all.empty());
  // The LM head last; all-linear leaves it out (PEFT's rule for the output layer), naming it
  // adapts it alone.
  ASSERT_EQ(all.back(), "lm_head");
  all.pop_back();
  for (const std::string& name : all) {
    EXPECT_TRUE(name.starts_with("model.language_model.layers.")) << name;
    EXPECT_EQ(name.find(".indexer."), std::string::npos) << name;
    EXPECT_EQ(name.find("experts.gate_up_proj"), std::string::npos) << name;
  }
  LoraConfig c = all_linear();
  EXPECT_EQ(resolve_lora_targets(*m.store, c, "lora"), all);
  c.target_modules = {"lm_head"};
  EXPECT_EQ(resolve_lora_targets(*m.store, c, "lora"), std::vector<std::string>{"lm_head"});
  c.target_modules = {"all-linear", "lm_head"};
  std::vector<std::string> with_head = all;
  with_head.push_back("lm_head");
  EXPECT_EQ(resolve_lora_targets(*m.store, c, "lora"), with_head);
  c.target_modules.clear();
  c.target_regex = "lm_head";
  EXPECT_EQ(resolve_lora_targets(*m.store, c, "lora"), std::vector<std::string>{"lm_head"});
  c = all_linear();
  // A suffix matches whole name components: q_proj is KDA's, not MLA's q_a_proj / q_b_proj.
  c.target_modules = {"q_proj"};
  for (const std::string& name : resolve_lora_targets(*m.store, c, "lora"))
    EXPECT_TRUE(name.ends_with(".self_attn.q_proj")) << name;
  c.target_modules = {"shared_experts.down_proj"};
  for (const std::string& name : resolve_lora_targets(*m.store, c, "lora"))
    EXPECT_TRUE(name.ends_with(".mlp.shared_experts.down_proj")) << name;
  // A regular expression over whole names.
  c.target_modules.clear();
  c.target_regex = R"(model\.language_model\.layers\.0\.self_attn\.(q|k)_proj)";
  EXPECT_EQ(resolve_lora_targets(*m.store, c, "lora").size(), 2u);

  // The routed experts only through target_parameters (PEFT's all-linear leaves them out), after
  // the modules, layer by layer, gate_up_proj first.
  LoraConfig e;
  e.target_parameters = {"experts.down_proj"};
  const std::vector<std::string> downs = resolve_lora_targets(*m.store, e, "lora");
  ASSERT_FALSE(downs.empty());
  for (const std::string& name : downs) EXPECT_TRUE(name.ends_with(".mlp.experts.down_proj"));
  const std::vector<std::string> both = resolve_lora_targets(*m.store, everything(), "lora");
  ASSERT_EQ(both.size(), all.size() + 2 * downs.size());
  EXPECT_TRUE(both[all.size()].ends_with(".mlp.experts.gate_up_proj")) << both[all.size()];
  e.target_parameters = {"mlp.experts.up_proj"};
  try {
    resolve_lora_targets(*m.store, e, "recipe.toml: lora");
    ADD_FAILURE() << "accepted";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("matches none of the routed experts"), std::string::npos)
        << err.what();
    EXPECT_NE(err.where().find("lora.target_parameters"), std::string::npos) << err.where();
  }

  auto refused = [&](const LoraConfig& bad, const std::string& says) {
    try {
      resolve_lora_targets(*m.store, bad, "recipe.toml: lora");
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
      EXPECT_NE(e.where().find("lora.target_modules"), std::string::npos) << e.where();
    }
  };
  LoraConfig bad = all_linear();
  bad.target_modules = {"wq_b"};
  refused(bad, "never train");
  bad.target_modules = {"qkv_proj"};
  refused(bad, "matches no projection");
  // Dropout: a probability, and none on the routed experts' adapters (PEFT refuses it there).
  LoraConfig dropout = all_linear();
  dropout.dropout = 0.1;
  EXPECT_NO_THROW(dropout.validate("lora"));
  dropout.dropout = 1.0;
  EXPECT_THROW(dropout.validate("lora"), Error);
  dropout.dropout = 0.1;
  dropout.target_parameters = {"mlp.experts.gate_up_proj"};
  try {
    dropout.validate("lora");
    ADD_FAILURE() << "dropout on expert adapters accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.where(), "lora.dropout") << e.what();
  }
  bad = all_linear();
  bad.rank = 0;
  EXPECT_THROW(bad.validate("lora"), Error);
}

TEST(LoraModel, AdapterGradientsMatchFiniteDifferencesOfTheLoss) {
  SCOPED_TRACE(seed_note());
  // Every expert routed and every key pool kept: the loss is smooth in the adapters (the top-k
  // selections are covered by the model's own finite-difference test).
  RandomModel m(
      "lora", test_seed(),
      {"text_config.n_group=1", "text_config.topk_group=1", "text_config.n_routed_experts=2",
       "text_config.num_experts_per_tok=2", "text_config.index_topk=16"});
  LoraConfig c = everything();
  c.target_modules.push_back("lm_head");
  add_lora_adapters(*m.store, c, resolve_lora_targets(*m.store, c, "lora"), test_seed());
  ASSERT_TRUE(m.store->contains("lm_head.lora_A.weight"));
  randomise_b(*m.store, 50'000);
  freeze_base(*m.store);
  const TextModel model(*m.store, TextModelOptions{DType::f64});
  std::mt19937_64 rng(test_seed());
  const PackInput in = tiny_pack(model.text(), rng);
  TrainOptions opt;
  opt.mtp = false;
  opt.balancing_alpha = 0;
  TextGrads grads = TextGrads::zeros_like(model.weights());
  forward_backward(model, in, opt, grads);
  ForwardOptions fo;
  fo.logits = false;
  auto loss = [&] { return model.forward(in, fo).loss(); };

  int adapters = 0;
  uint64_t off = 60'000'000;
  for (auto& [name, w] : model.weights().named) {
    const Tensor* g = grads.find(name);
    if (name.find(".lora_") == std::string::npos) {
      EXPECT_TRUE(g == nullptr || !g->defined()) << name << ": a frozen base tensor got a gradient";
      continue;
    }
    ASSERT_TRUE(g != nullptr && g->defined()) << name;
    SCOPED_TRACE(name);
    Tensor& param = const_cast<Tensor&>(w);
    // The smallest error over three steps. The random adapters make the loss strongly curved
    // along some directions (truncation error 4e-5 at a step of 2.5e-5, falling 16x per
    // halving); a tensor with a weak gradient (the last layer's forget gate) has roundoff of
    // 2e-6 relative to it at 3e-6 but 1e-9 at 2.5e-5; and a long step can cross a clamp of the
    // SwiGLU or the gate. Each measured draw passes at one of the steps with 100x to spare, while
    // a wrong gradient fails at every step.
    const Tensor dir = random_normal(param.shape(), off += 1'000'000, DType::f64);
    double err = INFINITY;
    for (double step : {2.5e-5, 6e-6, 1.5e-6})
      err = std::min(err, fd_direction(param, *g, dir, loss, step));
    EXPECT_LE(err, 1e-6);
    ++adapters;
  }
  EXPECT_EQ(adapters, 2 * int(resolve_lora_targets(*m.store, c, "lora").size()));
}

// With the base trainable too, each adapter's gradients are the base weight's gradient dW seen
// through the other factor: dA = s·Bᵀ·dW and dB = s·dW·Aᵀ (per expert for the fused experts),
// to f64 rounding. The GPU step's bf16 bound on the adapter gradients (test_cuda_model_step)
// rests on this.
TEST(LoraModel, AdapterGradientsAreTheWeightGradientThroughTheOtherFactor) {
  SCOPED_TRACE(seed_note());
  RandomModel m("lora-factor", test_seed(),
                {"text_config.n_group=1", "text_config.topk_group=1",
                 "text_config.n_routed_experts=2", "text_config.num_experts_per_tok=2"});
  LoraConfig c = everything();
  c.target_modules.push_back("lm_head");
  const std::vector<std::string> modules = resolve_lora_targets(*m.store, c, "lora");
  ASSERT_NE(std::find(modules.begin(), modules.end(), "lm_head"), modules.end());
  add_lora_adapters(*m.store, c, modules, test_seed());
  randomise_b(*m.store, 70'000);
  const TextModel model(*m.store, TextModelOptions{DType::f64});
  std::mt19937_64 rng(test_seed());
  const PackInput in = tiny_pack(model.text(), rng);
  TrainOptions opt;
  opt.mtp = false;
  TextGrads grads = TextGrads::zeros_like(model.weights());
  forward_backward(model, in, opt, grads);
  const double s = c.scale();
  // out[e] = s · a[e] · b[e] for stacks of [rows, inner] · [inner, cols] matrices; `ta` / `tb`
  // read a[e] / b[e] transposed.
  const auto product = [s](const Tensor& a, bool ta, const Tensor& b, bool tb) {
    const bool stacked = a.dim() == 3;
    const int64_t e = stacked ? a.size(0) : 1, d = a.dim();
    const int64_t rows = ta ? a.size(d - 1) : a.size(d - 2),
                  inner = ta ? a.size(d - 2) : a.size(d - 1);
    const int64_t cols = tb ? b.size(d - 2) : b.size(d - 1);
    const std::vector<double> av = a.to_doubles(), bv = b.to_doubles();
    const int64_t a_cols = a.size(d - 1), b_cols = b.size(d - 1);
    std::vector<double> out(size_t(e * rows * cols), 0.0);
    for (int64_t x = 0; x < e; ++x)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) {
          double acc = 0;
          for (int64_t k = 0; k < inner; ++k)
            acc += av[size_t(x * a.size(d - 2) * a_cols + (ta ? k * a_cols + i : i * a_cols + k))] *
                   bv[size_t(x * b.size(d - 2) * b_cols + (tb ? j * b_cols + k : k * b_cols + j))];
          out[size_t((x * rows + i) * cols + j)] = s * acc;
        }
    return out;
  };
  int64_t checked = 0;
  for (const std::string& module : modules) {
    SCOPED_TRACE(module);
    const std::string base = m.store->contains(module + ".weight") ? module + ".weight" : module;
    const Tensor* dw = grads.find(base);
    if (dw == nullptr || !dw->defined()) continue;  // a base that is never trained (the indexer)
    const Tensor* da = grads.find(module + ".lora_A.weight");
    const Tensor* db = grads.find(module + ".lora_B.weight");
    ASSERT_TRUE(da && db && da->defined() && db->defined());
    const Tensor& a = m.store->get(module + ".lora_A.weight");
    const Tensor& b = m.store->get(module + ".lora_B.weight");
    EXPECT_LE(
        rel_err(*da, Tensor::from_doubles(product(b, true, *dw, false), da->shape(), DType::f64)),
        1e-10)
        << "dA";
    EXPECT_LE(
        rel_err(*db, Tensor::from_doubles(product(*dw, false, a, true), db->shape(), DType::f64)),
        1e-10)
        << "dB";
    ++checked;
  }
  EXPECT_GE(checked, int64_t(modules.size()) / 2);  // the indexer's few projections aside
}

TEST(LoraModel, AdapterDirectoryRoundTripsAndMergesIntoTheWeights) {
  SCOPED_TRACE(seed_note());
  RandomModel m("lora", test_seed());
  LoraConfig c = everything(3, 5);
  c.use_rslora = true;
  c.target_modules.push_back("lm_head");
  const std::vector<std::string> targets = resolve_lora_targets(*m.store, c, "lora");
  add_lora_adapters(*m.store, c, targets, 7);
  randomise_b(*m.store, 70'000);
  const fs::path dir = m.dir.path() / "adapter";
  save_lora_adapter(*m.store, c, dir);

  // PEFT's layout: keys under base_model.model., a regular expression of exactly the adapted
  // modules.
  const nlohmann::json j = nlohmann::json::parse(std::ifstream(dir / "adapter_config.json"));
  EXPECT_EQ(j["peft_type"], "LORA");
  EXPECT_EQ(j["r"], 3);
  EXPECT_EQ(j["lora_alpha"], 5.0);
  EXPECT_EQ(j["use_rslora"], true);
  const io::SafetensorsFile f = io::SafetensorsFile::open(dir / "adapter_model.safetensors");
  EXPECT_TRUE(
      f.contains("base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight"));
  // The head's under PEFT's name of the module, lm_head (A [r, D], B [V, r]), and named in
  // target_modules, so that PEFT adapts it too (its all-linear would not).
  {
    const Shape w = m.store->param("lm_head.weight").shape;
    ASSERT_TRUE(f.contains("base_model.model.lm_head.lora_A.weight"));
    EXPECT_EQ(f.tensor("base_model.model.lm_head.lora_A.weight").shape(), (Shape{3, w[1]}));
    EXPECT_EQ(f.tensor("base_model.model.lm_head.lora_B.weight").shape(), (Shape{w[0], 3}));
    const std::regex peft_targets(j["target_modules"].get<std::string>());
    EXPECT_TRUE(std::regex_match("lm_head", peft_targets)) << j["target_modules"];
    EXPECT_FALSE(std::regex_match("model.language_model.embed_tokens", peft_targets));
  }
  // The experts as PEFT's nested ParamWrappers save them: gate_up_proj (wrapped first) under
  // "experts.base_layer.", down_proj under "experts."; A [r·E, in] with expert e's rows
  // e·r .. e·r+r, B [out, r·E] with expert e's column k at k·E + e; target_parameters by name.
  std::string gate_up;
  for (const std::string& t : targets)
    if (t.ends_with(".mlp.experts.gate_up_proj") && gate_up.empty()) gate_up = t;
  ASSERT_FALSE(gate_up.empty());
  const std::string experts =
      gate_up.substr(0, gate_up.size() - std::string("gate_up_proj").size());
  const std::string down = experts + "down_proj";
  EXPECT_NE(std::find(j["target_parameters"].begin(), j["target_parameters"].end(), gate_up),
            j["target_parameters"].end());
  for (const auto& [param, key] : std::vector<std::pair<std::string, std::string>>{
           {gate_up, experts + "base_layer."}, {down, experts}}) {
    SCOPED_TRACE(param);
    const Tensor a = m.store->get(param + ".lora_A.weight");  // [E, r, in]
    const Tensor b = m.store->get(param + ".lora_B.weight");  // [E, out, r]
    const int64_t n_e = a.size(0), r = a.size(1), in = a.size(2), out = b.size(1);
    const Tensor pa = f.tensor("base_model.model." + key + "lora_A.weight");
    const Tensor pb = f.tensor("base_model.model." + key + "lora_B.weight");
    ASSERT_EQ(pa.shape(), (Shape{r * n_e, in}));
    ASSERT_EQ(pb.shape(), (Shape{out, r * n_e}));
    const std::vector<double> av = a.to_doubles(), bv = b.to_doubles(), pav = pa.to_doubles(),
                              pbv = pb.to_doubles();
    for (int64_t e = 0; e < n_e; ++e)
      for (int64_t k = 0; k < r; ++k) {
        for (int64_t i = 0; i < in; ++i)
          ASSERT_EQ(pav[size_t((e * r + k) * in + i)], av[size_t((e * r + k) * in + i)]);
        for (int64_t o = 0; o < out; ++o)
          ASSERT_EQ(pbv[size_t(o * r * n_e + k * n_e + e)], bv[size_t((e * out + o) * r + k)]);
      }
  }

  ParamStore fresh = ParamStore::load(io::CheckpointReader::open(m.dir.path() / "ck"), m.config);
  const LoraConfig read = load_lora_adapter(fresh, dir);
  EXPECT_EQ(read.rank, 3);
  EXPECT_DOUBLE_EQ(fresh.adapter_scale(), 5.0 / std::sqrt(3.0));
  for (const InternalParam& p : m.store->params())
    if (p.adapter) EXPECT_EQ(fresh.get(p.name).to_doubles(), p.value.to_doubles()) << p.name;

  // Merged: W + scale · B A, rounded once to the base weight's dtype.
  const std::string module = "model.language_model.layers.0.self_attn.q_proj";
  const Tensor w0 = fresh.get(module + ".weight").to(DType::f64);
  const Tensor a = fresh.get(module + ".lora_A.weight").to(DType::f64);
  const Tensor b = fresh.get(module + ".lora_B.weight").to(DType::f64);
  const DType stored = fresh.get(module + ".weight").dtype();
  EXPECT_GT(merge_lora_adapters(fresh), 0);
  EXPECT_FALSE(fresh.has_adapters());
  EXPECT_FALSE(fresh.contains(module + ".lora_A.weight"));
  const Tensor ba = ops::linear(b, ops::Linear(a.transpose(0, 1).contiguous()));
  std::vector<double> want = w0.to_doubles();
  const std::vector<double> d = ba.to_doubles();
  for (size_t i = 0; i < want.size(); ++i) want[i] += (5.0 / std::sqrt(3.0)) * d[i];
  EXPECT_LE(rel_err(fresh.get(module + ".weight"),
                    Tensor::from_doubles(want, w0.shape(), stored).to(DType::f64)),
            stored == DType::bf16 ? 8e-3 : 1e-6);
  // Each expert: W_e + scale · B_e A_e.
  {
    ParamStore again = ParamStore::load(io::CheckpointReader::open(m.dir.path() / "ck"), m.config);
    load_lora_adapter(again, dir);
    ops::Linear l(again.get(gate_up).to(DType::f64));
    l.lora.A = again.get(gate_up + ".lora_A.weight").to(DType::f64);
    l.lora.B = again.get(gate_up + ".lora_B.weight").to(DType::f64);
    l.lora.scale = 5.0 / std::sqrt(3.0);
    const DType dt = again.get(gate_up).dtype();
    const Tensor want_e = merged_experts(l);
    merge_lora_adapters(again);
    EXPECT_LE(rel_err(again.get(gate_up).to(DType::f64), want_e.to(dt).to(DType::f64)),
              dt == DType::bf16 ? 8e-3 : 1e-6);
    EXPECT_GT(rel_err(again.get(gate_up).to(DType::f64), l.weight), 1e-3);
  }
  // The head too: lm_head.weight + scale · B A.
  {
    ParamStore again = ParamStore::load(io::CheckpointReader::open(m.dir.path() / "ck"), m.config);
    load_lora_adapter(again, dir);
    ops::Linear l(again.get("lm_head.weight").to(DType::f64));
    const Tensor a3 = again.get("lm_head.lora_A.weight").to(DType::f64);
    const Tensor b3 = again.get("lm_head.lora_B.weight").to(DType::f64);
    // [V, D] + s · B A, computed by merged_experts as a single expert.
    l.weight = l.weight.unsqueeze(0);
    l.lora.A = a3.unsqueeze(0);
    l.lora.B = b3.unsqueeze(0);
    l.lora.scale = 5.0 / std::sqrt(3.0);
    const DType dt = again.get("lm_head.weight").dtype();
    const Tensor want_h = merged_experts(l).squeeze(0);
    merge_lora_adapters(again);
    EXPECT_LE(rel_err(again.get("lm_head.weight").to(DType::f64), want_h.to(dt).to(DType::f64)),
              dt == DType::bf16 ? 8e-3 : 1e-6);
    EXPECT_GT(rel_err(again.get("lm_head.weight").to(DType::f64), l.weight.squeeze(0)), 1e-3);
  }
  // The merged model saves in the released layout, without adapter tensors.
  fresh.save(m.dir.path() / "merged");
  const io::CheckpointReader merged = io::CheckpointReader::open(m.dir.path() / "merged");
  for (const std::string& name : merged.names())
    EXPECT_EQ(name.find("lora_"), std::string::npos) << name;
}

// With tie_word_embeddings the head is the embedding matrix: as PEFT's adapted lm_head module,
// the adapter changes the head's product only (the embedding lookup reads the table as it is),
// trains like any adapter, saves under lm_head's name, and a merge, which would have to change the
// shared table, is refused before anything changes.
TEST(LoraModel, AHeadTiedToTheEmbeddingAdaptsTheHeadOnly) {
  SCOPED_TRACE(seed_note());
  RandomModel m(
      "lora-tied", test_seed(),
      {"tie_word_embeddings=true", "text_config.tie_word_embeddings=true", "text_config.n_group=1",
       "text_config.topk_group=1", "text_config.n_routed_experts=2",
       "text_config.num_experts_per_tok=2", "text_config.index_topk=16"});
  ASSERT_TRUE(m.config.text().tie_word_embeddings);
  ASSERT_FALSE(m.store->contains("lm_head.weight"));
  const TextModel base(*m.store, TextModelOptions{DType::f64});
  LoraConfig c = all_linear(3, 4);
  c.target_modules = {"lm_head"};
  ASSERT_EQ(resolve_lora_targets(*m.store, c, "lora"), std::vector<std::string>{"lm_head"});
  add_lora_adapters(*m.store, c, {"lm_head"}, test_seed());
  const Shape e = m.store->param("model.language_model.embed_tokens.weight").shape;
  EXPECT_EQ(m.store->param("lm_head.lora_A.weight").shape, (Shape{3, e[1]}));
  EXPECT_EQ(m.store->param("lm_head.lora_B.weight").shape, (Shape{e[0], 3}));
  randomise_b(*m.store, 90'000);
  freeze_base(*m.store);
  const TextModel model(*m.store, TextModelOptions{DType::f64});
  const TextWeights& w = model.weights();
  EXPECT_EQ(w.lm_head.weight.data_ptr(), w.embed_tokens.data_ptr());
  ASSERT_TRUE(w.lm_head.lora.defined());

  std::mt19937_64 rng(test_seed());
  const PackInput in = tiny_pack(model.text(), rng);
  EXPECT_EQ(model.embed(in.input_ids).to_doubles(), base.embed(in.input_ids).to_doubles());
  ForwardOptions fo;
  fo.mtp = false;
  EXPECT_GT(rel_err(model.forward(in, fo).logits, base.forward(in, fo).logits), 1e-3);

  // The MTP depth's loss reads the same head (and adapter): its share of the gradients is in too.
  ASSERT_TRUE(model.has_mtp());
  TrainOptions opt;
  opt.balancing_alpha = 0;
  opt.mtp_loss_scale = 0.5;
  TextGrads grads = TextGrads::zeros_like(w);
  forward_backward(model, in, opt, grads);
  EXPECT_EQ(grads.find("model.language_model.embed_tokens.weight"), nullptr);
  fo.logits = false;
  fo.mtp = true;
  fo.mtp_loss_scale = 0.5;
  auto loss = [&] {
    const ForwardOutput out = model.forward(in, fo);
    return out.loss() + (out.mtp ? out.mtp->loss : 0.0);
  };
  uint64_t off = 91'000'000;
  for (const char* name : {"lm_head.lora_A.weight", "lm_head.lora_B.weight"}) {
    SCOPED_TRACE(name);
    const Tensor* g = grads.find(name);
    ASSERT_TRUE(g != nullptr && g->defined());
    Tensor* param = nullptr;
    for (auto& [n, t] : w.named)
      if (n == name) param = const_cast<Tensor*>(&t);
    ASSERT_NE(param, nullptr);
    double err = INFINITY;
    for (double step : {2.5e-5, 6e-6})
      err = std::min(
          err, fd_direction(*param, *g, random_normal(param->shape(), off += 1'000, DType::f64),
                            loss, step));
    EXPECT_LE(err, 1e-6);
  }

  const fs::path dir = m.dir.path() / "adapter";
  save_lora_adapter(*m.store, c, dir);
  ParamStore fresh = ParamStore::load(io::CheckpointReader::open(m.dir.path() / "ck"), m.config);
  load_lora_adapter(fresh, dir);
  EXPECT_EQ(fresh.get("lm_head.lora_B.weight").to_doubles(),
            m.store->get("lm_head.lora_B.weight").to_doubles());
  const std::vector<double> table =
      fresh.get("model.language_model.embed_tokens.weight").to(DType::f64).to_doubles();
  try {
    merge_lora_adapters(fresh);
    ADD_FAILURE() << "a tied head's adapter merged";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("tie_word_embeddings"), std::string::npos) << err.what();
  }
  EXPECT_TRUE(fresh.has_adapters());
  EXPECT_EQ(fresh.get("model.language_model.embed_tokens.weight").to(DType::f64).to_doubles(),
            table);
}

// lora.dropout reaches the head's adapter: a pack's key masks its input (the logits change, the
// same key gives the same ones, key 0 none), drawn at a sequence-parallel shard's rows.
TEST(LoraModel, DropoutKeysTheHeadsAdapterPerPack) {
  SCOPED_TRACE(seed_note());
  RandomModel m("lora-head-dropout", test_seed());
  LoraConfig c = all_linear();
  c.target_modules = {"lm_head"};
  add_lora_adapters(*m.store, c, {"lm_head"}, test_seed());
  randomise_b(*m.store, 95'000);
  TextModel model(*m.store, TextModelOptions{DType::f64});
  std::mt19937_64 rng(test_seed());
  const PackInput in = tiny_pack(model.text(), rng);
  ForwardOptions fo;
  fo.mtp = false;
  const std::vector<double> plain = model.forward(in, fo).logits.to_doubles();
  set_adapter_dropout(model.weights(), 0.3, 4321, 7);
  const ops::LoraAdapter& head = model.weights().lm_head.lora;
  EXPECT_EQ(head.dropout, 0.3);
  EXPECT_NE(head.dropout_key, 0u);
  EXPECT_EQ(head.dropout_block.row0, 7);
  const std::vector<double> masked = model.forward(in, fo).logits.to_doubles();
  EXPECT_NE(masked, plain);
  EXPECT_EQ(model.forward(in, fo).logits.to_doubles(), masked);
  set_adapter_dropout(model.weights(), 0.3, 0);
  EXPECT_EQ(model.forward(in, fo).logits.to_doubles(), plain);
}

// A store loaded with an expert range (one expert-parallel rank's, dist/expert_shards.h) holds its
// range of the routed experts' adapters: fresh ones are the single process's values of those
// experts (A drawn at its place in the whole draw, every later module's draw unchanged), a saved
// adapter loads that range, and each expert adapter's parameter shape is the whole adapter's.
TEST(LoraModel, AStoreOfAnExpertRangeHoldsThatRangeOfTheExpertAdapters) {
  RandomModel m("lora", 9);
  const LoraConfig c = everything(3, 5);
  const std::vector<std::string> targets = resolve_lora_targets(*m.store, c, "lora");
  add_lora_adapters(*m.store, c, targets, 7);
  randomise_b(*m.store, 90'000);
  const fs::path dir = m.dir.path() / "adapter";
  save_lora_adapter(*m.store, c, dir);
  const int64_t n = m.config.text().n_routed_experts;
  ASSERT_EQ(n % 2, 0);
  const ExpertRange range{n / 2, n / 2};
  ParamStore fresh =
      ParamStore::load(io::CheckpointReader::open(m.dir.path() / "ck"), m.config, range);
  add_lora_adapters(fresh, c, targets, 7);
  ParamStore loaded =
      ParamStore::load(io::CheckpointReader::open(m.dir.path() / "ck"), m.config, range);
  load_lora_adapter(loaded, dir);
  int64_t experts_seen = 0;
  for (const InternalParam& whole : m.store->params()) {
    if (!whole.adapter) continue;
    SCOPED_TRACE(whole.name);
    const bool sliced = is_expert_adapter(whole.name);
    experts_seen += sliced ? 1 : 0;
    const Tensor want = sliced ? whole.value.narrow(0, range.first, range.count) : whole.value;
    EXPECT_EQ(fresh.param(whole.name).shape, whole.shape);
    EXPECT_EQ(loaded.param(whole.name).shape, whole.shape);
    EXPECT_EQ(loaded.get(whole.name).to_doubles(), want.to_doubles());
    // Fresh: A as one process draws it, B zero.
    if (whole.name.ends_with(".lora_A.weight"))
      EXPECT_EQ(fresh.get(whole.name).to_doubles(), want.to_doubles());
    else
      EXPECT_EQ(fresh.get(whole.name).shape(), want.shape());
  }
  EXPECT_GT(experts_seen, 0);
}

TEST(LoraModel, BadAdapterDirectoriesAreErrorsNamingTheFile) {
  RandomModel m("lora", 5);
  const fs::path dir = m.dir.path() / "bad";
  auto expect_error = [&](const std::string& says) {
    ParamStore s = ParamStore::load(io::CheckpointReader::open(m.dir.path() / "ck"), m.config);
    try {
      load_lora_adapter(s, dir);
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
      EXPECT_NE(e.where().find(dir.string()), std::string::npos) << e.where();
    }
  };
  fs::create_directories(dir);
  expect_error("no adapter_config.json");

  const LoraConfig c = all_linear();
  add_lora_adapters(*m.store, c, resolve_lora_targets(*m.store, c, "lora"), 1);
  save_lora_adapter(*m.store, c, dir);
  auto write_config = [&](const nlohmann::json& j) {
    std::ofstream(dir / "adapter_config.json") << j.dump();
  };
  nlohmann::json j = peft_adapter_config(c, {"x"});
  j["peft_type"] = "IA3";
  write_config(j);
  expect_error("LoRA adapters only");
  j = peft_adapter_config(c, {"x"});
  j["r"] = 5;
  write_config(j);
  expect_error("expected [5,");
  j = peft_adapter_config(c, {"x"});
  j["use_dora"] = true;
  write_config(j);
  expect_error("DoRA");
  // A tensor of a projection this model cannot adapt.
  write_config(peft_adapter_config(c, {"x"}));
  io::save_safetensors(
      dir / "adapter_model.safetensors",
      {{"base_model.model.model.language_model.layers.0.self_attn.indexer.wk.lora_A.weight",
        Tensor::zeros({2, 4}, DType::f32)}});
  expect_error("not the A or B of a projection this model can adapt");
  // A routed-expert tensor where target_parameters names none, and a mis-shaped one.
  LoraConfig ce = c;
  ce.target_parameters = {"mlp.experts.down_proj"};
  const std::vector<std::string> downs = resolve_lora_targets(*m.store, ce, "lora");
  const std::string down = downs.back();
  ASSERT_TRUE(down.ends_with(".mlp.experts.down_proj")) << down;
  const std::string key = "base_model.model." + down.substr(0, down.size() - 9) + "lora_A.weight";
  io::save_safetensors(dir / "adapter_model.safetensors",
                       {{key, Tensor::zeros({3, 5}, DType::f32)}});
  write_config(peft_adapter_config(c, {"x"}));
  expect_error("target_parameters [] names none at this place");
  write_config(peft_adapter_config(ce, {"x", down}));
  expect_error("expected [");
}

// PEFT's save_pretrained with lm_head among the targets also writes the head's base weight
// (base_model.model.lm_head.base_layer.weight, save_embedding_layers): a copy of the base's head,
// in f32 or rounded to bf16, loads (nothing to apply); another head is an error naming the key.
TEST(LoraModel, PeftsCopyOfTheBaseHeadLoadsOnlyWhenItIsTheBases) {
  RandomModel m("lora-head-copy", 6);
  LoraConfig c = all_linear();
  c.target_modules = {"q_proj", "lm_head"};
  add_lora_adapters(*m.store, c, resolve_lora_targets(*m.store, c, "lora"), 1);
  const fs::path dir = m.dir.path() / "adapter";
  save_lora_adapter(*m.store, c, dir);
  io::NamedTensors tensors;
  {
    const io::SafetensorsFile f = io::SafetensorsFile::open(dir / "adapter_model.safetensors");
    for (const std::string& name : f.names()) tensors.emplace_back(name, f.tensor(name).clone());
  }
  const Tensor head = m.store->get("lm_head.weight").to(DType::f32).contiguous().clone();
  const std::string key = "base_model.model.lm_head.base_layer.weight";
  auto load_with = [&](const Tensor& copy) {
    io::NamedTensors with = tensors;
    with.emplace_back(key, copy);
    io::save_safetensors(dir / "adapter_model.safetensors", with);
    ParamStore s = ParamStore::load(io::CheckpointReader::open(m.dir.path() / "ck"), m.config);
    load_lora_adapter(s, dir);
    return s.contains("lm_head.lora_A.weight");
  };
  EXPECT_TRUE(load_with(head));
  EXPECT_TRUE(load_with(head.to(DType::bf16)));
  Tensor other = head.clone();
  other.data<float>()[7] += 1.0f;
  try {
    load_with(other);
    ADD_FAILURE() << "another head accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("differs from the base"), std::string::npos) << e.what();
  }
}

}  // namespace
