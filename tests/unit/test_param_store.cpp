#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/io/fp8.h"
#include "glmtune/model/init.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/weights.h"
#include "glmtune/tensor/allocator.h"
#include "support/error_message.h"
#include "support/temp_dir.h"

using namespace glmtune;
using namespace glmtune::model;
namespace fs = std::filesystem;

namespace {

using glmtune::test::TempDir;

uint64_t test_seed() {
  static const uint64_t seed = std::random_device{}();
  return seed;
}

using glmtune::test::message_of;

// Rewrites checkpoint `src` into `dst`, letting `edit` drop or replace tensors.
void rewrite(
    const fs::path& src, const fs::path& dst,
    const std::function<void(const std::string&, const Tensor&, io::CheckpointWriter&)>& edit) {
  auto reader = io::CheckpointReader::open(src);
  io::CheckpointWriter writer(dst);
  for (const auto& name : reader.names()) edit(name, reader.tensor(name).clone(), writer);
  writer.copy_file(src / "config.json", "config.json");
  writer.finish();
}

}  // namespace

TEST(Init, DeterministicAndIndependentOfSharding) {
  TempDir dir;
  const ModelConfig config = ModelConfig::preset("tiny");
  InitOptions a;
  a.seed = test_seed();
  write_random_checkpoint(config, dir / "a", a);
  InitOptions b = a;
  b.max_shard_bytes = 200'000;  // many shards
  write_random_checkpoint(config, dir / "b", b);
  InitOptions c = a;
  c.seed = a.seed + 1;
  write_random_checkpoint(config, dir / "c", c);
  auto ra = io::CheckpointReader::open(dir / "a");
  auto rb = io::CheckpointReader::open(dir / "b");
  auto rc = io::CheckpointReader::open(dir / "c");
  EXPECT_GT(rb.shard_files().size(), 3u);
  EXPECT_EQ(ra.names(), rb.names());
  int differ = 0;
  for (const auto& name : ra.names()) {
    auto x = ra.bytes(name), y = rb.bytes(name), z = rc.bytes(name);
    ASSERT_TRUE(std::equal(x.begin(), x.end(), y.begin(), y.end()))
        << name << " seed " << test_seed();
    differ += !std::equal(x.begin(), x.end(), z.begin(), z.end());
  }
  EXPECT_GT(differ, 100);
}

TEST(Init, FollowsTheReferenceRules) {
  TempDir dir;
  const ModelConfig config = ModelConfig::preset("tiny");
  InitOptions options;
  options.seed = test_seed();
  write_random_checkpoint(config, dir / "ck", options);
  auto r = io::CheckpointReader::open(dir / "ck");
  const std::string l1 = "model.language_model.layers.1.";
  const std::string l3 = "model.language_model.layers.3.";
  auto values = [&](const std::string& name) { return r.tensor(name).to_doubles(); };
  for (double v : values(l1 + "self_attn.A_log")) EXPECT_EQ(v, 0.0);
  for (double v : values(l1 + "self_attn.dt_bias")) {
    const double dt = std::log1p(std::exp(v));  // softplus
    EXPECT_GE(dt, 1e-3 * 0.999);
    EXPECT_LE(dt, 1e-1 * 1.001);
  }
  for (double v : values(l3 + "self_attn.indexer.index_kpool_compress_gate")) EXPECT_EQ(v, 1.0);
  for (double v : values(l3 + "self_attn.indexer.index_kpool_compress_ape")) EXPECT_EQ(v, 0.0);
  for (double v : values(l1 + "hc_attn_scale")) EXPECT_EQ(v, 1.0);
  for (double v : values(l1 + "hc_attn_base")) EXPECT_EQ(v, 0.0);
  for (double v : values(l1 + "mlp.gate.e_score_correction_bias")) EXPECT_EQ(v, 0.0);
  for (double v : values(l1 + "input_layernorm.weight")) EXPECT_EQ(v, 1.0);
  auto emb = r.tensor("model.language_model.embed_tokens.weight");
  const int64_t pad = config.text().pad_token_id;
  for (int64_t d = 0; d < emb.size(1); ++d) EXPECT_EQ(emb.item({pad, d}), 0.0);
  auto stddev = [](const std::vector<double>& v) {
    double s = 0, q = 0;
    for (double x : v) s += x, q += x * x;
    return std::sqrt(q / v.size() - (s / v.size()) * (s / v.size()));
  };
  EXPECT_NEAR(stddev(values(l1 + "hc_attn_fn")), 0.02, 0.002);
  EXPECT_NEAR(stddev(values("lm_head.weight")), 0.02, 0.001);
  EXPECT_EQ(r.info(l1 + "self_attn.q_conv1d.weight").dtype, DType::f32);
  EXPECT_EQ(r.info(l1 + "hc_ffn_base").dtype, DType::f32);
  EXPECT_EQ(r.info(l1 + "hc_ffn_fn").dtype, DType::bf16);
}

// The released layout (model/layout.cpp: the zip_*_params visitors walked over the fields' shapes)
// and the model the loader fills through the same visitors agree: every text tensor a checkpoint
// holds is a weight of the model, loaded once, and nothing else is (the fused tensors split and
// joined back, the outside-the-layers tensors named by hand). Over the layouts that change the
// list: biases, a tied head, no MTP layer, a shared indexer, DSA layers with dense MLPs and KDA
// layers with MoE.
TEST(ParamStore, EveryReleasedTextTensorIsOneWeightOfTheModel) {
  const std::vector<std::vector<std::pair<std::string, std::string>>> variants = {
      {},
      {{"text_config.attention_bias", "true"}},
      {{"text_config.tie_word_embeddings", "true"}},
      {{"text_config.num_nextn_predict_layers", "0"}},
      {{"text_config.layer_types", R"(["deepseek_sparse_attention","linear_attention",)"
                                   R"("linear_attention","deepseek_sparse_attention",)"
                                   R"("deepseek_sparse_attention"])"},
       {"text_config.indexer_types", R"(["full","full","full","full","shared"])"}},
  };
  for (size_t v = 0; v < variants.size(); ++v) {
    SCOPED_TRACE("variant " + std::to_string(v));
    TempDir dir("layout-lists");
    model::ModelConfig config = model::ModelConfig::preset("tiny");
    for (const auto& [key, value] : variants[v]) config.set(key, value);
    model::write_random_checkpoint(config, dir.path() / "ck", model::InitOptions{});
    const model::ParamStore store =
        model::ParamStore::load(io::CheckpointReader::open(dir.path() / "ck"), config);
    const model::text::TextWeights w =
        model::text::load_text_weights(store, DType::f32, Device::cpu());
    std::set<std::string> weights;
    for (const auto& [name, t] : w.named) {
      EXPECT_TRUE(weights.insert(name).second) << name << " is two weights";
      EXPECT_TRUE(store.contains(name)) << name << " is a weight the layout does not hold";
    }
    int64_t text = 0;
    for (const model::InternalParam& p : store.params()) {
      if (p.name.starts_with("model.visual.")) continue;
      ++text;
      EXPECT_TRUE(weights.contains(p.name)) << p.name << " is in the layout but no weight";
    }
    EXPECT_EQ(int64_t(weights.size()), text);
  }
}

TEST(ParamStore, FusesOnLoadAndSplitsOnSave) {
  TempDir dir;
  const ModelConfig config = ModelConfig::preset("tiny");
  InitOptions options;
  options.seed = test_seed();
  write_random_checkpoint(config, dir / "ck", options);
  auto reader = io::CheckpointReader::open(dir / "ck");
  ParamStore store = ParamStore::load(reader, config);
  const TextConfig& t = config.text();
  const std::string l1 = "model.language_model.layers.1.";
  const Tensor& gate_up = store.get(l1 + "mlp.experts.gate_up_proj");
  EXPECT_EQ(gate_up.shape(),
            (Shape{t.n_routed_experts, 2 * t.moe_intermediate_size, t.hidden_size}));
  const Tensor& down = store.get(l1 + "mlp.experts.down_proj");
  EXPECT_EQ(down.shape(), (Shape{t.n_routed_experts, t.hidden_size, t.moe_intermediate_size}));
  const Tensor& conv = store.get(l1 + "self_attn.conv1d.weight");
  EXPECT_EQ(conv.shape(), (Shape{3 * t.linear_width(), 1, t.linear_conv_kernel_dim}));
  const int64_t e = 5, Im = t.moe_intermediate_size, QL = t.linear_width();
  EXPECT_EQ(gate_up.select(0, e).slice(0, 0, Im).to_doubles(),
            reader.tensor(l1 + "mlp.experts.5.gate_proj.weight").to_doubles());
  EXPECT_EQ(gate_up.select(0, e).slice(0, Im, 2 * Im).to_doubles(),
            reader.tensor(l1 + "mlp.experts.5.up_proj.weight").to_doubles());
  EXPECT_EQ(down.select(0, e).to_doubles(),
            reader.tensor(l1 + "mlp.experts.5.down_proj.weight").to_doubles());
  EXPECT_EQ(conv.slice(0, 2 * QL, 3 * QL).to_doubles(),
            reader.tensor(l1 + "self_attn.v_conv1d.weight").to_doubles());
  // Unfused parameters view the mapped file instead of copying it.
  EXPECT_FALSE(store.get("lm_head.weight").storage()->owns_memory());

  store.save(dir / "saved", 300'000);
  auto again = io::CheckpointReader::open(dir / "saved");
  ASSERT_EQ(again.names(), reader.names());
  for (const auto& name : reader.names()) {
    auto x = reader.bytes(name), y = again.bytes(name);
    ASSERT_TRUE(std::equal(x.begin(), x.end(), y.begin(), y.end())) << name;
    EXPECT_EQ(reader.info(name).dtype, again.info(name).dtype) << name;
  }
}

// A checkpoint exported in float32 is used as stored: its fused experts keep the f32 values (not
// rounded to bf16, the released dtype), like every unfused tensor; the report names the f32
// tensors the release stores in bf16, which a save writes back in bf16.
TEST(ParamStore, KeepsTheValuesOfAFloat32Checkpoint) {
  TempDir dir;
  const ModelConfig config = ModelConfig::preset("tiny");
  InitOptions options;
  options.seed = test_seed();
  write_random_checkpoint(config, dir / "ck", options);
  // Every tensor widened to f32, plus a nudge of 2^-12 relative that bf16 cannot hold.
  rewrite(dir / "ck", dir / "f32",
          [&](const std::string& name, const Tensor& t, io::CheckpointWriter& w) {
            Tensor v = t.to(DType::f32);
            float* p = v.data<float>();
            for (int64_t i = 0; i < v.numel(); ++i) p[i] *= 1.0f + std::ldexp(1.0f, -12);
            w.add(name, v);
          });
  auto reader = io::CheckpointReader::open(dir / "f32");
  const CheckpointReport report = check_checkpoint(reader, config);
  int64_t bf16_released = 0;
  for (const ParamSpec& spec : released_layout(config)) bf16_released += spec.dtype == DType::bf16;
  EXPECT_EQ(int64_t(report.f32_not_bf16.size()), bf16_released);
  EXPECT_TRUE(
      check_checkpoint(io::CheckpointReader::open(dir / "ck"), config).f32_not_bf16.empty());

  const ParamStore store = ParamStore::load(reader, config);
  const std::string l1 = "model.language_model.layers.1.";
  const Tensor& gate_up = store.get(l1 + "mlp.experts.gate_up_proj");
  const Tensor& down = store.get(l1 + "mlp.experts.down_proj");
  EXPECT_EQ(gate_up.dtype(), DType::f32);
  EXPECT_EQ(down.dtype(), DType::f32);
  const int64_t e = 3, Im = config.text().moe_intermediate_size;
  EXPECT_EQ(gate_up.select(0, e).slice(0, 0, Im).to_doubles(),
            reader.tensor(l1 + "mlp.experts.3.gate_proj.weight").to_doubles());
  EXPECT_EQ(gate_up.select(0, e).slice(0, Im, 2 * Im).to_doubles(),
            reader.tensor(l1 + "mlp.experts.3.up_proj.weight").to_doubles());
  EXPECT_EQ(down.select(0, e).to_doubles(),
            reader.tensor(l1 + "mlp.experts.3.down_proj.weight").to_doubles());
  for (const InternalParam& p : store.params()) EXPECT_EQ(p.value.dtype(), DType::f32) << p.name;
  // Deferred (fully sharded) loads read the same f32 values.
  const ParamStore deferred =
      ParamStore::load(reader, config, std::nullopt, [](const std::string&) { return true; });
  const int64_t count = down.numel() / 2;
  EXPECT_EQ(deferred.read_elements(reader, l1 + "mlp.experts.down_proj", 5, count).to_doubles(),
            down.reshape({-1}).narrow(0, 5, count).to_doubles());

  // Saving writes the released dtypes: what was f32 but released as bf16 is rounded there.
  store.save(dir / "saved");
  auto saved = io::CheckpointReader::open(dir / "saved");
  for (const std::string& name : report.f32_not_bf16)
    EXPECT_EQ(saved.info(name).dtype, DType::bf16) << name;
}

// A load of experts [4, 6) of 8 equals the full load narrowed to them, bit for bit, and allocates
// only their bytes; every other parameter, and every released name, is that of the full load. Such
// a store refuses to save (its expert tensors would name the wrong experts).
TEST(ParamStore, LoadsARangeOfTheRoutedExperts) {
  TempDir dir;
  const ModelConfig config = ModelConfig::preset("tiny");
  InitOptions options;
  options.seed = test_seed();
  write_random_checkpoint(config, dir / "ck", options);
  auto reader = io::CheckpointReader::open(dir / "ck");
  const ParamStore full = ParamStore::load(reader, config);
  const int64_t n = config.text().n_routed_experts;
  ASSERT_EQ(n, 8);
  const ExpertRange range{4, 2};
  const ParamStore part = ParamStore::load(reader, config, range);
  EXPECT_EQ(part.expert_range(), range);
  EXPECT_EQ(full.expert_range(), std::nullopt);
  ASSERT_EQ(part.params().size(), full.params().size());
  int64_t fused = 0, part_bytes = 0, full_bytes = 0;
  for (size_t i = 0; i < part.params().size(); ++i) {
    const InternalParam& got = part.params()[i];
    const InternalParam& whole = full.params()[i];
    ASSERT_EQ(got.name, whole.name);
    EXPECT_EQ(got.sources, whole.sources) << got.name;
    EXPECT_EQ(got.trainable, whole.trainable) << got.name;
    if (!is_fused_expert_tensor(got.name)) {
      EXPECT_EQ(got.value.shape(), whole.value.shape()) << got.name;
      EXPECT_EQ(got.value.to_doubles(), whole.value.to_doubles()) << got.name;
      continue;
    }
    ++fused;
    const Tensor want = whole.value.narrow(0, range.first, range.count);
    EXPECT_EQ(got.value.shape(), want.shape()) << got.name;
    EXPECT_EQ(got.value.to_doubles(), want.to_doubles()) << got.name;
    part_bytes += int64_t(got.value.storage()->bytes());
    full_bytes += int64_t(whole.value.storage()->bytes());
  }
  EXPECT_GT(fused, 0);
  EXPECT_EQ(part_bytes * (n / range.count), full_bytes);
  EXPECT_THROW(part.save(dir / "saved"), InternalError);
  EXPECT_FALSE(fs::exists(dir / "saved"));
}

// A range that is not one of the equal slices of the experts is refused by name; the tensors of
// the experts outside the range are still checked.
TEST(ParamStore, RefusesExpertRangesThatAreNotASlice) {
  TempDir dir;
  const ModelConfig config = ModelConfig::preset("tiny");
  InitOptions options;
  options.seed = test_seed();
  write_random_checkpoint(config, dir / "ck", options);
  auto reader = io::CheckpointReader::open(dir / "ck");
  for (const ExpertRange bad : {ExpertRange{8, 2}, ExpertRange{-2, 2}, ExpertRange{0, 0},
                                ExpertRange{0, 3}, ExpertRange{1, 2}, ExpertRange{0, 16}}) {
    SCOPED_TRACE(std::to_string(bad.first) + " +" + std::to_string(bad.count));
    const std::string msg = message_of([&] { ParamStore::load(reader, config, bad); });
    EXPECT_NE(msg.find("are not one of the equal slices of the 8 routed experts"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("expert range"), std::string::npos) << msg;
  }

  const std::string reshaped = "model.language_model.layers.1.mlp.experts.7.down_proj.weight";
  rewrite(dir / "ck", dir / "bad",
          [&](const std::string& name, const Tensor& t, io::CheckpointWriter& w) {
            w.add(name, name == reshaped ? Tensor::full({3, 5}, 0.5, DType::bf16) : t);
          });
  auto bad_reader = io::CheckpointReader::open(dir / "bad");
  const std::string msg = message_of([&] {
    ParamStore::load(bad_reader, config, ExpertRange{0, 4});
  });
  EXPECT_NE(msg.find(reshaped), std::string::npos) << msg;
}

TEST(ParamStore, ReportsMissingUnexpectedAndMisshapedKeys) {
  TempDir dir;
  const ModelConfig config = ModelConfig::preset("tiny");
  InitOptions options;
  options.seed = test_seed();
  write_random_checkpoint(config, dir / "ck", options);
  const std::string dropped = "model.language_model.layers.2.self_attn.g_b_proj.weight";
  const std::string reshaped = "model.language_model.layers.0.mlp.up_proj.weight";
  rewrite(dir / "ck", dir / "bad",
          [&](const std::string& name, const Tensor& t, io::CheckpointWriter& w) {
            if (name == dropped) return;
            if (name == reshaped) {
              w.add(name, Tensor::full({3, 5}, 0.5, DType::bf16));
              return;
            }
            w.add(name, t);
          });
  {
    io::CheckpointWriter w(dir / "extra");
    auto reader = io::CheckpointReader::open(dir / "bad");
    for (const auto& name : reader.names()) w.add(name, reader.tensor(name).clone());
    w.add("model.language_model.layers.0.self_attn.rotary_emb.inv_freq",
          Tensor::full({4}, 1.0, DType::f32));
    w.copy_file(dir / "ck" / "config.json", "config.json");
    w.finish();
  }
  auto reader = io::CheckpointReader::open(dir / "extra");
  CheckpointReport report = check_checkpoint(reader, config);
  EXPECT_EQ(report.missing, std::vector<std::string>{dropped});
  EXPECT_EQ(report.unexpected, std::vector<std::string>{
                                   "model.language_model.layers.0.self_attn.rotary_emb.inv_freq"});
  ASSERT_EQ(report.misshaped.size(), 1u);
  EXPECT_EQ(report.misshaped[0].name, reshaped);
  std::string msg = message_of([&] { ParamStore::load(reader, config); });
  for (const std::string& part : {dropped, reshaped, std::string("rotary_emb.inv_freq"),
                                  std::string("expected [96, 64], found [3, 5]")})
    EXPECT_NE(msg.find(part), std::string::npos) << msg;
}

TEST(ParamStore, RefusesCheckpointsOfOtherModels) {
  TempDir dir;
  io::CheckpointWriter w(dir / "other");
  w.add("model.layers.0.self_attn.q_proj.weight", Tensor::full({4, 4}, 0.25, DType::bf16));
  w.add("model.embed_tokens.weight", Tensor::full({8, 4}, 0.25, DType::bf16));
  w.finish();
  auto reader = io::CheckpointReader::open(dir / "other");
  std::string msg = message_of([&] { ParamStore::load(reader, ModelConfig::preset("tiny")); });
  EXPECT_NE(msg.find("no GLM-5.3-Flash tensor found"), std::string::npos) << msg;
}

// The random checkpoint of `config` under dir/ck, and a copy under dir/fp8 with `target` stored as
// FP8: random e4m3 bytes (no NaN encodings) and a random scale per 128×128 block.
struct Fp8Weight {
  Tensor fp8, scales;
};
Fp8Weight write_with_fp8_weight(const TempDir& dir, const ModelConfig& config,
                                const std::string& target) {
  InitOptions options;
  options.seed = test_seed();
  write_random_checkpoint(config, dir / "ck", options);
  std::mt19937_64 gen(test_seed());
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(0.001f, 0.05f);
  Fp8Weight out;
  rewrite(dir / "ck", dir / "fp8",
          [&](const std::string& name, const Tensor& t, io::CheckpointWriter& w) {
            if (name != target) {
              w.add(name, t);
              return;
            }
            out.fp8 = Tensor::empty(t.shape(), DType::fp8e4m3);
            auto* p = static_cast<uint8_t*>(out.fp8.data_ptr());
            for (int64_t i = 0; i < out.fp8.numel(); ++i) {
              const int b = byte(gen);
              p[i] = uint8_t((b & 0x7f) == 0x7f ? b - 1 : b);
            }
            out.scales = Tensor::empty(io::fp8_scale_shape(t.shape()), DType::f32);
            for (int64_t r = 0; r < out.scales.size(0); ++r)
              for (int64_t c = 0; c < out.scales.size(1); ++c)
                out.scales.set_item({r, c}, scale(gen));
            w.add(name, out.fp8);
            w.add(name.substr(0, name.size() - 7) + ".weight_scale_inv", out.scales);
          });
  return out;
}

TEST(ParamStore, DequantisesFp8BlockWeights) {
  TempDir dir;
  const ModelConfig config = ModelConfig::preset("tiny");
  const std::string target =
      "model.language_model.layers.0.mlp.gate_proj.weight";  // [96, 64]: a partial edge block
  const auto [fp8, scales] = write_with_fp8_weight(dir, config, target);
  auto reader = io::CheckpointReader::open(dir / "fp8");
  CheckpointReport report = check_checkpoint(reader, config);
  EXPECT_TRUE(report.ok()) << report.describe();
  EXPECT_EQ(report.fp8_weights, std::vector<std::string>{target});
  ParamStore store = ParamStore::load(reader, config);
  const Tensor& w = store.get(target);
  ASSERT_EQ(w.dtype(), DType::bf16);
  for (int64_t r = 0; r < w.size(0); ++r)
    for (int64_t c = 0; c < w.size(1); ++c) {
      const double want =
          double(fp8e4m3_to_f32(static_cast<uint8_t*>(fp8.data_ptr())[r * w.size(1) + c])) *
          scales.item({0, 0});
      // The float64 product is exact; it is rounded to bf16 once.
      const double rounded = Tensor::from_doubles({want}, {1}, DType::bf16).item({0});
      ASSERT_EQ(w.item({r, c}), rounded) << r << "," << c << " seed " << test_seed();
    }
}

// A range of an FP8 weight is read by dequantising only the 128-row blocks that hold it (an fsdp
// rank reads its slice of every decoder-layer tensor so): the elements are the whole load's, bit
// for bit, and a few elements cost one block of rows, not the tensor.
TEST(ParamStore, ReadsRangesOfFp8WeightsBlockByBlock) {
  TempDir dir;
  const ModelConfig config = ModelConfig::preset("tiny");
  const std::string target = "model.language_model.embed_tokens.weight";  // [V, D]: 16 row blocks
  const int64_t cols = write_with_fp8_weight(dir, config, target).fp8.size(1);
  auto reader = io::CheckpointReader::open(dir / "fp8");
  const ParamStore store = ParamStore::load(reader, config);
  const Tensor whole = store.get(target).reshape({-1});
  const int64_t n = whole.numel();
  ASSERT_GT(n, 4 * 128 * cols) << "the test needs a weight of several row blocks";
  const std::vector<std::pair<int64_t, int64_t>> ranges = {
      {0, n},                         // everything
      {5, 10},                        // inside the first row
      {127 * cols + 3, 2 * cols},     // across the first block boundary
      {128 * cols - 1, 2},            // the last element of a block and the first of the next
      {300 * cols + 11, 200 * cols},  // from inside a block over whole blocks
      {n - 7, 7}};                    // the tensor's end
  for (const auto& [begin, count] : ranges) {
    const Tensor got = store.read_elements(reader, target, begin, count);
    ASSERT_EQ(got.dtype(), DType::bf16);
    const Tensor want = whole.narrow(0, begin, count).contiguous();
    ASSERT_EQ(got.numel(), count);
    EXPECT_EQ(std::memcmp(got.data_ptr(), want.data_ptr(), size_t(count) * 2), 0)
        << "elements [" << begin << ", " << begin + count << ") seed " << test_seed();
  }
  // A few elements in the middle allocate one block of rows (and the result), not the tensor.
  Allocator& host = host_allocator();
  host.reset_peak();
  const size_t before = host.stats().allocated;
  store.read_elements(reader, target, 1000 * cols + 5, 10);
  const size_t extra = host.stats().peak_allocated - before;
  EXPECT_LE(extra, size_t(128 * cols * 2 + 4096))
      << "the whole weight in bf16 is " << n * 2 << " bytes";
}
