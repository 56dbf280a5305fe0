// The vision tower on the GPU (ops/cuda/vision.h, model/vision/tower.h):
//   - the flash-attention kernel against a float64 attention computed on the host from the same
//     bf16 inputs, on packed images of 1, 7 and 4096 patches (16 heads of 64) and on one segment of
//     16384 patches, forward (output, log-sum-exp) and backward (dq, dk, dv), on sampled rows;
//   - a query range of the pack (vision sequence parallelism) giving the whole pack's rows bit for
//     bit, and reruns bit-identical;
//   - the whole tower and projector, forward and backward, in bf16 on the GPU against the f32 CPU
//     tower on the same (bf16-rounded) weights and pixels, at the tiny preset's width (head dim
//     16) and at the released head dim of 64;
//   - the composed vision-language step (the splice of the features into the token embeddings and
//     its backward into the tower) on the GPU against the CPU, on a pack of the bundled
//     examples/tiny-vl conversations (real images, and a video where the build decodes videos).
// Skipped (not failed) where no GPU is visible or CUDA is not built.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "glmtune/data/media/vl_processor.h"
#include "glmtune/data/packing.h"
#include "glmtune/model/compose.h"
#include "glmtune/model/vision/tower.h"
#include "glmtune/ops/vision.h"
#include "glmtune/tensor/tensor.h"
#include "glmtune/train/vl_batch.h"
#include "support/cuda_test_support.h"
#include "support/gpu_tiny_model.h"
#include "support/random_model.h"
#include "support/temp_dir.h"
#include "support/tiny_vl_data.h"

using namespace glmtune;
using namespace glmtune::test;

namespace {

#ifdef GLMTUNE_WITH_CUDA

// Runs fn(i) for i in [0, n) on every hardware thread.
void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  const int64_t threads = std::max<int64_t>(1, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (int64_t i = t; i < n; i += threads) fn(i);
    });
  for (std::thread& th : pool) th.join();
}

// The rows checked in a segment [start, end): all of a short one, else 48 spread over it with
// its first and last.
std::vector<int64_t> sampled_rows(int64_t start, int64_t end) {
  std::vector<int64_t> rows;
  const int64_t len = end - start, count = std::min<int64_t>(len, 48);
  for (int64_t i = 0; i < count; ++i)
    rows.push_back(start + (count == 1 ? 0 : i * (len - 1) / (count - 1)));
  return rows;
}

// Float64 attention within segments on the host, from the GPU operands' values.
struct Reference {
  int64_t heads, hd, d;
  double scale;
  std::vector<double> q, k, v, dout;

  double dot(const std::vector<double>& a, int64_t i, const std::vector<double>& b, int64_t j,
             int64_t h) const {
    double s = 0;
    for (int64_t c = 0; c < hd; ++c)
      s += a[size_t(i * d + h * hd + c)] * b[size_t(j * d + h * hd + c)];
    return s;
  }
  // Row i's log-sum-exp and output over keys [start, end), head h.
  double row(int64_t i, int64_t start, int64_t end, int64_t h, std::vector<double>* out) const {
    std::vector<double> s(size_t(end - start));
    double mx = -INFINITY;
    for (int64_t j = start; j < end; ++j) {
      s[size_t(j - start)] = scale * dot(q, i, k, j, h);
      mx = std::max(mx, s[size_t(j - start)]);
    }
    double sum = 0;
    for (double& x : s) sum += (x = std::exp(x - mx));
    if (out) {
      out->assign(size_t(hd), 0.0);
      for (int64_t j = start; j < end; ++j)
        for (int64_t c = 0; c < hd; ++c)
          (*out)[size_t(c)] += s[size_t(j - start)] / sum * v[size_t(j * d + h * hd + c)];
    }
    return mx + std::log(sum);
  }
};

struct Checked {
  std::vector<double> got, want;
  double max_abs_lse = 0;
  void add(double g, double w) {
    got.push_back(g);
    want.push_back(w);
  }
};

// Compares the GPU's forward and backward with the float64 reference on sampled rows of every
// segment and head.
void check_against_float64(const std::vector<int64_t>& cu, int64_t heads, int64_t hd,
                           uint64_t stream, double q_std) {
  const int64_t n = cu.back(), d = heads * hd;
  const double scale = 1.0 / std::sqrt(double(hd));
  const Tensor q = random_cpu({n, d}, DType::bf16, stream, q_std).to(kGpu);
  const Tensor k = random_cpu({n, d}, DType::bf16, stream + 1).to(kGpu);
  const Tensor v = random_cpu({n, d}, DType::bf16, stream + 2).to(kGpu);
  const Tensor dout = random_cpu({n, d}, DType::bf16, stream + 3).to(kGpu);
  Tensor lse;
  const Tensor out = ops::varlen_attention(q, k, v, cu, heads, scale, 0, &lse);
  const ops::VarlenAttentionGrads g =
      ops::varlen_attention_backward(q, k, v, out, dout, cu, heads, scale, 0, lse);

  Reference ref{heads,
                hd,
                d,
                scale,
                q.to(Device::cpu()).to_doubles(),
                k.to(Device::cpu()).to_doubles(),
                v.to(Device::cpu()).to_doubles(),
                dout.to(Device::cpu()).to_doubles()};
  const std::vector<double> got_out = out.to(Device::cpu()).to_doubles(),
                            got_lse = lse.to(Device::cpu()).to_doubles(),
                            got_dq = g.dq.to(Device::cpu()).to_doubles(),
                            got_dk = g.dk.to(Device::cpu()).to_doubles(),
                            got_dv = g.dv.to(Device::cpu()).to_doubles();
  Checked c_out, c_dq, c_dk, c_dv;
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    const int64_t start = cu[s], end = cu[s + 1], len = end - start;
    const std::vector<int64_t> rows = sampled_rows(start, end);
    for (int64_t h = 0; h < heads; ++h) {
      // Every row's log-sum-exp, output and delta = dO·O (what the key gradients need).
      std::vector<double> lse_all(static_cast<size_t>(len)), delta(static_cast<size_t>(len));
      std::vector<std::vector<double>> o_all(static_cast<size_t>(len));
      parallel_for(len, [&](int64_t r) {
        lse_all[size_t(r)] = ref.row(start + r, start, end, h, &o_all[size_t(r)]);
        double dl = 0;
        for (int64_t c = 0; c < hd; ++c)
          dl += ref.dout[size_t((start + r) * d + h * hd + c)] * o_all[size_t(r)][size_t(c)];
        delta[size_t(r)] = dl;
      });
      auto prob = [&](int64_t i, int64_t j) {
        return std::exp(scale * ref.dot(ref.q, i, ref.k, j, h) - lse_all[size_t(i - start)]);
      };
      auto dscore = [&](int64_t i, int64_t j) {
        return prob(i, j) * (ref.dot(ref.dout, i, ref.v, j, h) - delta[size_t(i - start)]);
      };
      std::vector<std::vector<double>> dq(rows.size()), dk(rows.size()), dv(rows.size());
      parallel_for(int64_t(rows.size()), [&](int64_t x) {
        const int64_t r = rows[size_t(x)];
        dq[size_t(x)].assign(size_t(hd), 0.0);
        dk[size_t(x)].assign(size_t(hd), 0.0);
        dv[size_t(x)].assign(size_t(hd), 0.0);
        for (int64_t j = start; j < end; ++j) {  // r as the query: dq
          const double ds = dscore(r, j);
          for (int64_t c = 0; c < hd; ++c)
            dq[size_t(x)][size_t(c)] += scale * ds * ref.k[size_t(j * d + h * hd + c)];
        }
        for (int64_t i = start; i < end; ++i) {  // r as the key: dk, dv
          const double p = prob(i, r), ds = dscore(i, r);
          for (int64_t c = 0; c < hd; ++c) {
            dk[size_t(x)][size_t(c)] += scale * ds * ref.q[size_t(i * d + h * hd + c)];
            dv[size_t(x)][size_t(c)] += p * ref.dout[size_t(i * d + h * hd + c)];
          }
        }
      });
      for (size_t x = 0; x < rows.size(); ++x) {
        const int64_t r = rows[x];
        c_out.max_abs_lse = std::max(c_out.max_abs_lse, std::abs(got_lse[size_t(r * heads + h)] -
                                                                 lse_all[size_t(r - start)]));
        for (int64_t c = 0; c < hd; ++c) {
          const size_t at = size_t(r * d + h * hd + c);
          c_out.add(got_out[at], o_all[size_t(r - start)][size_t(c)]);
          c_dq.add(got_dq[at], dq[x][size_t(c)]);
          c_dk.add(got_dk[at], dk[x][size_t(c)]);
          c_dv.add(got_dv[at], dv[x][size_t(c)]);
        }
      }
    }
  }
  // bf16 operands are exact on both sides; the GPU rounds P and dS to bf16 for their products and
  // its results to bf16 (2^-9 relative each): 1e-2 leaves room for the two roundings in a chain.
  EXPECT_CLOSE(c_out.got, c_out.want, 1e-2, "attention output");
  std::printf("[ measure  ] log-sum-exp: max abs error %.2e (bar 1e-4)\n", c_out.max_abs_lse);
  EXPECT_LE(c_out.max_abs_lse, 1e-4) << ctx("log-sum-exp");
  EXPECT_CLOSE(c_dq.got, c_dq.want, 2e-2, "dq");
  EXPECT_CLOSE(c_dk.got, c_dk.want, 2e-2, "dk");
  EXPECT_CLOSE(c_dv.got, c_dv.want, 2e-2, "dv");
}

#endif

TEST(CudaVisionAttention, PackedImagesMatchFloat64) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  check_against_float64({0, 1, 8, 4104}, 16, 64, 10, 1.5);
#endif
}

TEST(CudaVisionAttention, OneLongSegmentMatchesFloat64) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  check_against_float64({0, 16384}, 2, 64, 20, 1.5);
#endif
}

TEST(CudaVisionAttention, EveryHeadDimMatchesFloat64) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  for (int64_t hd : {16, 32, 128}) {
    SCOPED_TRACE("head dim " + std::to_string(hd));
    check_against_float64({0, 3, 70, 200}, 3, hd, 30 + uint64_t(hd), 1.0);
  }
#endif
}

// Vision sequence parallelism hands each rank a range of query rows; every row is computed as in
// the whole pack (the same key blocks in the same order), so the range's rows are bit-identical.
TEST(CudaVisionAttention, QueryRangeGivesTheWholePacksRows) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const std::vector<int64_t> cu = {0, 100, 300, 333};
  const int64_t heads = 4, hd = 64, d = heads * hd, n = cu.back();
  const double scale = 0.125;
  // v as the last third of a fused qkv block, as the tower passes it.
  const Tensor qkv = random_cpu({n, 3 * d}, DType::bf16, 40).to(kGpu);
  const Tensor q = qkv.slice(1, 0, d).contiguous(), k = qkv.slice(1, d, 2 * d).contiguous();
  const Tensor v = qkv.slice(1, 2 * d, 3 * d);
  const Tensor dout = random_cpu({n, d}, DType::bf16, 41).to(kGpu);
  Tensor lse;
  const Tensor out = ops::varlen_attention(q, k, v, cu, heads, scale, 0, &lse);
  const auto g = ops::varlen_attention_backward(q, k, v, out, dout, cu, heads, scale, 0, lse);

  Tensor lse_again;
  const Tensor out_again = ops::varlen_attention(q, k, v, cu, heads, scale, 0, &lse_again);
  const auto g_again =
      ops::varlen_attention_backward(q, k, v, out_again, dout, cu, heads, scale, 0, lse_again);
  EXPECT_TRUE(bit_identical(out, out_again));
  EXPECT_TRUE(bit_identical(g.dq, g_again.dq));
  EXPECT_TRUE(bit_identical(g.dk, g_again.dk));
  EXPECT_TRUE(bit_identical(g.dv, g_again.dv));

  const int64_t first = 70, rows = 190;  // spans the first two segments' boundary
  Tensor lse_part;
  const Tensor q_part = q.slice(0, first, first + rows).contiguous();
  const Tensor out_part = ops::varlen_attention(q_part, k, v, cu, heads, scale, first, &lse_part);
  EXPECT_TRUE(bit_identical(out_part, out.slice(0, first, first + rows)));
  EXPECT_TRUE(bit_identical(lse_part, lse.slice(0, first, first + rows)));
  const auto g_part = ops::varlen_attention_backward(
      q_part, k, v, out_part, dout.slice(0, first, first + rows).contiguous(), cu, heads, scale,
      first, lse_part);
  EXPECT_TRUE(bit_identical(g_part.dq, g.dq.slice(0, first, first + rows)));
  // Keys of the third segment hold no query row of the range: zero gradients.
  const std::vector<double> dk_tail = g_part.dk.slice(0, 300, 333).to(Device::cpu()).to_doubles();
  EXPECT_TRUE(std::all_of(dk_tail.begin(), dk_tail.end(), [](double x) { return x == 0.0; }));
  // The backward without the saved log-sum-exp reruns the forward for it.
  const auto g_no_lse = ops::varlen_attention_backward(q, k, v, out, dout, cu, heads, scale);
  EXPECT_TRUE(bit_identical(g_no_lse.dq, g.dq));
  EXPECT_TRUE(bit_identical(g_no_lse.dk, g.dk));
#endif
}

TEST(CudaVisionAttention, UnsupportedHeadDimIsAnError) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const Tensor x = random_cpu({8, 2 * 24}, DType::bf16, 50).to(kGpu);
  try {
    ops::varlen_attention(x, x, x, {0, 8}, 2, 0.2);
    ADD_FAILURE() << "head dim 24 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head dim 24"), std::string::npos) << e.what();
  }
#endif
}

#ifdef GLMTUNE_WITH_CUDA

// The tower forward and backward of one pack: the GPU (bf16) against the CPU (f32) on the same
// bf16-rounded weights, pixels and output gradient.
void check_tower(const std::vector<std::string>& sets, const char* what) {
  using namespace model::vision;
  RandomModel m(std::string("cuda-vision-") + what, test_seed(), sets);
  std::mt19937_64 rng(test_seed() + 7);
  m.redraw_constants(rng);
  const model::VisionConfig config = *m.config.vision();
  auto rounded = [&](const std::string& name) {
    return m.store->contains(name) ? m.store->get(name).to(DType::bf16) : Tensor();
  };
  const VisionParams cpu = VisionParams::load(config, rounded, DType::f32);
  const VisionParams gpu = VisionParams::load(config, rounded, DType::bf16, kGpu);
  EXPECT_EQ(gpu.device, kGpu);

  // Two images (one of several 64-row tiles) and a two-tubelet video.
  const std::vector<GridThw> grid = {{1, 4, 6}, {1, 20, 16}, {2, 4, 4}};
  int64_t n = 0;
  for (const auto& [t, h, w] : grid) n += t * h * w;
  const int64_t row =
      config.in_channels * config.temporal_patch_size * config.patch_size * config.patch_size;
  const Tensor pixels = random_cpu({n, row}, DType::bf16, 60).to(DType::f32);
  const int64_t merged = n / (config.spatial_merge_size * config.spatial_merge_size);
  const Tensor d_pooler =
      random_cpu({merged, config.out_hidden_size}, DType::bf16, 61).to(DType::f32);

  VisionContext cpu_ctx, gpu_ctx;
  const VisionOutput cpu_out = vision_forward(config, cpu, pixels, grid, &cpu_ctx);
  const VisionOutput gpu_out = vision_forward(config, gpu, pixels, grid, &gpu_ctx);
  EXPECT_EQ(gpu_out.pooler_output.device(), kGpu);
  VisionBackwardOptions options;
  options.pixel_grad = true;
  VisionGrads cpu_grads = VisionGrads::zeros_like(cpu), gpu_grads = VisionGrads::zeros_like(gpu);
  const Tensor cpu_dpix = vision_backward(config, cpu, cpu_ctx, d_pooler, cpu_grads, options);
  const Tensor gpu_dpix = vision_backward(config, gpu, gpu_ctx, d_pooler, gpu_grads, options);

  const std::string tag = std::string(what) + ": ";
  // bf16 activations through two blocks and the projector: a few roundings of 2^-9 compound.
  EXPECT_CLOSE(gpu_out.last_hidden_state, cpu_out.last_hidden_state, 3e-2, tag + "last hidden");
  EXPECT_CLOSE(gpu_out.pooler_output, cpu_out.pooler_output, 3e-2, tag + "pooler output");
  EXPECT_CLOSE(gpu_dpix, cpu_dpix, 6e-2, tag + "pixel gradient");
  const auto want = cpu_grads.released(config), got = gpu_grads.released(config);
  ASSERT_EQ(got.size(), want.size());
  std::vector<double> all_got, all_want;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i].first, want[i].first);
    EXPECT_EQ(got[i].second.dtype(), DType::f32) << got[i].first;
    const std::vector<double> g = got[i].second.to(Device::cpu()).to_doubles(),
                              w = want[i].second.to_doubles();
    all_got.insert(all_got.end(), g.begin(), g.end());
    all_want.insert(all_want.end(), w.begin(), w.end());
    EXPECT_CLOSE(g, w, 1e-1, tag + "gradient of " + got[i].first);
  }
  EXPECT_CLOSE(all_got, all_want, 6e-2, tag + "every gradient together");

  // Recomputed blocks (train.recompute_vision): the backward reruns the blocks with the same
  // kernels, so every GPU gradient is bit for bit the one of the run that kept the activations.
  VisionContext recomputed;
  recomputed.recompute_blocks = true;
  vision_forward(config, gpu, pixels, grid, &recomputed);
  VisionGrads re_grads = VisionGrads::zeros_like(gpu);
  const Tensor re_dpix = vision_backward(config, gpu, recomputed, d_pooler, re_grads, options);
  EXPECT_TRUE(bit_identical(re_dpix.to(Device::cpu()), gpu_dpix.to(Device::cpu())))
      << tag << "pixel gradient with recomputed blocks";
  const auto re = re_grads.released(config);
  for (size_t i = 0; i < re.size(); ++i)
    EXPECT_TRUE(bit_identical(re[i].second.to(Device::cpu()), got[i].second.to(Device::cpu())))
        << tag << re[i].first << " with recomputed blocks";
}

#endif

TEST(CudaVisionTower, TinyPresetMatchesTheCpuTower) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  check_tower({}, "tiny");
#endif
}

TEST(CudaVisionTower, ReleasedHeadDimMatchesTheCpuTower) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  check_tower({"vision_config.hidden_size=128", "vision_config.num_heads=2",
               "vision_config.intermediate_size=256"},
              "head-dim-64");
#endif
}

// One training pack of examples/tiny-vl through the composed model on the CPU (f32) and on the
// GPU (bf16): the losses, the pooler features' gradients reaching every vision parameter, and the
// text gradients, with the tower and with the tower frozen.
TEST(CudaVisionLanguage, ComposedStepMatchesTheCpu) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  namespace fs = std::filesystem;
  const char* env = std::getenv("GLMTUNE_SOURCE_DIR");
  const fs::path source = env ? fs::path(env) : fs::path(GLMTUNE_SOURCE_DIR);
  const data::media::VlProcessor processor =
      data::media::VlProcessor::from_dir(source / "examples/tiny/tokenizer");
  TempDir dir("cuda-vl-step");
  train::VlDataConfig dc;
  dc.files = {tiny_vl_chat(source, dir.path()).string()};
  dc.media_root = source / "examples/tiny-vl";
  dc.max_length = 1 << 20;
  const train::VlDataset dataset = train::VlDataset::scan(dc, processor);
  ASSERT_GE(dataset.size(), 3);
  // The first three conversations in one pack.
  const std::vector<int64_t> idx = {0, 1, 2};
  int64_t length = 0;
  for (int64_t i : idx) length += dataset.length(i);
  const data::Pack pack = data::build_pack(dataset.load(idx), idx, length,
                                           processor.tokenizer().require_id("<|endoftext|>"));
  const model::PackMedia media = train::pack_media(dataset, pack);
  ASSERT_FALSE(media.empty());
  model::text::PackInput in;
  in.input_ids = Tensor::from_vector(pack.input_ids, {int64_t(pack.input_ids.size())});
  in.cu_seqlens = Tensor::from_vector(pack.cu_seqlens, {int64_t(pack.cu_seqlens.size())});
  in.labels = Tensor::from_vector(pack.labels, {int64_t(pack.labels.size())});

  model::ParamStore store = random_gpu_tiny_store(dir.path() / "ck", test_seed());
  const model::VisionLanguageModel cpu(store);
  const model::VisionLanguageModel gpu(store, model::text::TextModelOptions{DType::bf16, kGpu});
  EXPECT_EQ(gpu.vision().device, kGpu);
  model::text::TrainOptions train;
  double labels = 0;
  for (int32_t l : pack.labels) labels += l >= 0;
  train.lm_denominator = labels;

  for (const bool freeze_vision : {false, true}) {
    SCOPED_TRACE(freeze_vision ? "tower frozen" : "tower trained");
    model::ComposeOptions options;
    options.freeze_vision = freeze_vision;
    auto tg_cpu = model::text::TextGrads::zeros_like(cpu.text().weights());
    auto tg_gpu = model::text::TextGrads::zeros_like(gpu.text().weights());
    auto vg_cpu = model::vision::VisionGrads::zeros_like(cpu.vision());
    auto vg_gpu = model::vision::VisionGrads::zeros_like(gpu.vision());
    const auto rc = model::compose_forward_backward(cpu, in, media, train, options, tg_cpu, vg_cpu);
    const auto rg = model::compose_forward_backward(gpu, in, media, train, options, tg_gpu, vg_gpu);
    std::printf("[ measure  ] VL step loss cpu %.6f gpu %.6f\n", rc.backward.lm_loss,
                rg.backward.lm_loss);
    EXPECT_NEAR(rg.backward.lm_loss, rc.backward.lm_loss, 2e-3 * rc.backward.lm_loss)
        << ctx("loss");
    const auto want = vg_cpu.released(cpu.vision_config()),
               got = vg_gpu.released(gpu.vision_config());
    ASSERT_EQ(got.size(), want.size());
    std::vector<double> vision_got, vision_want;
    for (size_t i = 0; i < got.size(); ++i) {
      const std::vector<double> g = got[i].second.to(Device::cpu()).to_doubles(),
                                w = want[i].second.to_doubles();
      vision_got.insert(vision_got.end(), g.begin(), g.end());
      vision_want.insert(vision_want.end(), w.begin(), w.end());
      if (freeze_vision && !model::vision::is_projector_param(got[i].first))
        EXPECT_TRUE(std::all_of(g.begin(), g.end(), [](double x) { return x == 0.0; }))
            << got[i].first << " is frozen";
    }
    // The tower sits behind the whole text backward (five bf16 layers: docs/testing.md's bars
    // for the text step, 1e-1 for all gradients together).
    EXPECT_CLOSE(vision_got, vision_want, 1e-1, "every vision gradient together");
    std::vector<double> text_got, text_want;
    for (size_t i = 0; i < tg_cpu.named.size(); ++i) {
      if (!tg_cpu.named[i].second.defined()) continue;
      const std::vector<double> g = tg_gpu.named[i].second.to(Device::cpu()).to_doubles(),
                                w = tg_cpu.named[i].second.to_doubles();
      text_got.insert(text_got.end(), g.begin(), g.end());
      text_want.insert(text_want.end(), w.begin(), w.end());
    }
    EXPECT_CLOSE(text_got, text_want, 1e-1, "every text gradient together");
  }
#endif
}

}  // namespace
