// Checkpoints written and read in pieces: the streaming writer (CheckpointWriter::plan_in_order /
// put) makes the files the buffered one (add) makes; a parameter store that defers tensors reads
// any range of them as the whole load holds it; ParamStore::save with whole values given one at a
// time writes the files of the previous, buffered save; the optimizer state streamed tensor by
// tensor is AdamW::save's; a saved optimizer state read by ranges gives the same values and
// informative errors.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/model/init.h"
#include "glmtune/model/layout.h"
#include "glmtune/model/param_store.h"
#include "glmtune/train/optimizer.h"
#include "glmtune/train/state.h"
#include "support/error_message.h"
#include "support/same_files.h"
#include "support/temp_dir.h"

using namespace glmtune;
namespace fs = std::filesystem;

namespace {

using glmtune::test::message_of;
using glmtune::test::read_text;
using glmtune::test::TempDir;

Tensor random_tensor(const Shape& shape, DType dtype, std::mt19937_64& rng, bool positive = false) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(size_t(shape_numel(shape)));
  for (float& x : v) x = positive ? std::abs(normal(rng)) : normal(rng);
  return Tensor::from_vector(v, shape).to(dtype);
}

const fs::path& tiny_checkpoint() {
  static TempDir dir("streamed-tiny");
  static const fs::path path = [] {
    model::InitOptions options;
    options.seed = 21;
    model::write_random_checkpoint(model::ModelConfig::preset("tiny"), dir / "tiny", options);
    return dir / "tiny";
  }();
  return path;
}

model::ModelConfig tiny_config() {
  return model::ModelConfig::from_file((tiny_checkpoint() / "config.json").string());
}

TEST(CheckpointWriter, StreamedShardsAreTheBufferedOnes) {
  TempDir dir;
  std::mt19937_64 rng(3);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (int i = 0; i < 23; ++i)
    tensors.emplace_back(fmt::format("t.{:02d}.weight", (i * 7) % 23),
                         random_tensor({int64_t(3 + i % 5), int64_t(20 + 3 * i)},
                                       i % 3 == 0 ? DType::f32 : DType::bf16, rng));
  io::CheckpointWriterOptions options;
  options.max_shard_bytes = 2'000;  // many shards, some tensors alone in theirs
  {
    io::CheckpointWriter buffered(dir / "buffered", options);
    for (const auto& [name, t] : tensors) buffered.add(name, t);
    buffered.finish();
  }
  {
    io::CheckpointWriter streamed(dir / "streamed", options);
    std::vector<io::TensorSpec> specs;
    for (const auto& [name, t] : tensors) specs.push_back({name, t.dtype(), t.shape()});
    streamed.plan_in_order(specs);
    for (const auto& [name, t] : tensors) streamed.put(name, t.clone());
    streamed.finish();
    EXPECT_GT(streamed.num_shards(), 5u);
  }
  test::expect_same_files(dir / "streamed", dir / "buffered");
}

TEST(CheckpointWriter, StreamedTensorsOutOfOrderOrMissingAreNamed) {
  TempDir dir;
  std::mt19937_64 rng(4);
  io::CheckpointWriterOptions options;
  options.max_shard_bytes = 100;
  const Tensor t = random_tensor({4, 8}, DType::f32, rng);  // 128 bytes: a shard each
  {
    io::CheckpointWriter w(dir / "late", options);
    w.plan_in_order({{"a", DType::f32, {4, 8}}, {"b", DType::f32, {4, 8}}});
    w.put("a", t);
    w.put("b", t);
    std::string msg = message_of([&] { w.put("a", t); });
    EXPECT_NE(msg.find("\"a\" arrives after its shard was closed"), std::string::npos) << msg;
  }
  {
    io::CheckpointWriter w(dir / "skipped", options);
    w.plan_in_order({{"a", DType::f32, {4, 8}}, {"b", DType::f32, {4, 8}}});
    const std::string msg = message_of([&] { w.put("b", t); });
    EXPECT_NE(msg.find("\"a\" was planned but never written"), std::string::npos) << msg;
  }
  {
    io::CheckpointWriter w(dir / "missing", options);
    w.plan_in_order({{"a", DType::f32, {4, 8}}, {"b", DType::f32, {4, 8}}});
    w.put("a", t);
    const std::string msg = message_of([&] { w.finish(); });
    EXPECT_NE(msg.find("never written: \"b\""), std::string::npos) << msg;
    EXPECT_FALSE(fs::exists(dir / "missing"));
  }
}

// Every tensor deferred: placeholders of one element, the whole shapes kept, and any range read
// from the checkpoint equal to the same elements of a whole load (ranges crossing a fused expert
// tensor's gate / up and expert boundaries and the q / k / v parts of a convolution included).
TEST(ParamStore, DeferredTensorsReadAnyRangeAsTheWholeLoadHoldsIt) {
  const io::CheckpointReader reader = io::CheckpointReader::open(tiny_checkpoint());
  const model::ModelConfig config = tiny_config();
  const model::ParamStore whole = model::ParamStore::load(reader, config);
  const model::ParamStore deferred = model::ParamStore::load(
      reader, config, std::nullopt, [](const std::string&) { return true; });
  ASSERT_EQ(deferred.params().size(), whole.params().size());
  std::mt19937_64 rng(5);
  int fused = 0;
  for (const model::InternalParam& p : whole.params()) {
    const model::InternalParam& d = deferred.param(p.name);
    EXPECT_TRUE(d.deferred) << p.name;
    EXPECT_FALSE(p.deferred) << p.name;
    EXPECT_EQ(d.value.numel(), 1) << p.name;
    EXPECT_EQ(d.value.dtype(), p.value.dtype()) << p.name;
    EXPECT_EQ(d.shape, p.value.shape()) << p.name;
    EXPECT_EQ(d.sources, p.sources) << p.name;
    const int64_t n = p.value.numel();
    const Tensor flat = p.value.reshape({-1});
    std::vector<std::pair<int64_t, int64_t>> ranges = {{0, n}, {0, 1}, {n - 1, 1}, {n / 3, 0}};
    for (int k = 0; k < 4; ++k) {
      const int64_t a = int64_t(rng() % uint64_t(n)), b = int64_t(rng() % uint64_t(n));
      ranges.emplace_back(std::min(a, b), std::max(a, b) - std::min(a, b) + 1);
    }
    for (const auto& [begin, count] : ranges) {
      const Tensor got = deferred.read_elements(reader, p.name, begin, count);
      ASSERT_EQ(got.numel(), count);
      ASSERT_EQ(got.dtype(), p.value.dtype());
      if (count > 0) {
        const Tensor want = flat.narrow(0, begin, count).contiguous();
        EXPECT_EQ(0, std::memcmp(got.data_ptr(), want.data_ptr(), want.nbytes()))
            << p.name << " [" << begin << ", " << begin + count << ")";
      }
    }
    fused += p.sources.size() > 1;
  }
  EXPECT_GT(fused, 4) << "the tiny model has fused expert and convolution tensors";
  const std::string& name = whole.params().front().name;
  const std::string msg = message_of(
      [&] { deferred.read_elements(reader, name, 0, whole.params().front().value.numel() + 1); });
  EXPECT_NE(msg.find(name), std::string::npos) << msg;
}

// A deferred tensor is still checked at load: a wrong shape names the tensor and both shapes.
TEST(ParamStore, DeferredLoadStillRefusesAMisshapedTensor) {
  TempDir dir;
  const io::CheckpointReader src = io::CheckpointReader::open(tiny_checkpoint());
  const std::string victim = "model.language_model.layers.1.input_layernorm.weight";
  ASSERT_TRUE(src.contains(victim));
  {
    io::CheckpointWriter w(dir / "bad");
    for (const auto& name : src.names()) {
      const Tensor t = src.tensor(name).clone();
      w.add(name, name == victim ? t.narrow(0, 0, t.size(0) - 1).contiguous() : t);
    }
    w.copy_file(tiny_checkpoint() / "config.json", "config.json");
    w.finish();
  }
  const io::CheckpointReader bad = io::CheckpointReader::open(dir / "bad");
  const std::string msg = message_of([&] {
    model::ParamStore::load(bad, tiny_config(), std::nullopt,
                            [](const std::string& n) { return n.find(".layers.") != n.npos; });
  });
  EXPECT_NE(msg.find(victim), std::string::npos) << msg;
  EXPECT_NE(msg.find("wrong shape"), std::string::npos) << msg;
}

// ParamStore::save takes each whole value from the caller, one at a time, and writes the files the
// buffered save wrote before (every released tensor added in store order), shard for shard.
TEST(ParamStore, StreamedSaveWritesTheBufferedSavesFiles) {
  TempDir dir;
  const io::CheckpointReader reader = io::CheckpointReader::open(tiny_checkpoint());
  const model::ModelConfig config = tiny_config();
  const model::ParamStore store = model::ParamStore::load(reader, config);
  constexpr uint64_t kShard = 300'000;
  // The previous save, buffered: every released tensor added in store order.
  {
    std::map<std::string, DType> stored;
    for (const auto& spec : model::released_layout(config)) stored[spec.name] = spec.dtype;
    io::CheckpointWriterOptions options;
    options.max_shard_bytes = kShard;
    io::CheckpointWriter writer(dir / "buffered", options);
    const auto emit = [&](const std::string& name, const Tensor& t) {
      writer.add(name, t.to(stored.at(name)).contiguous());
    };
    for (const auto& p : store.params()) {
      if (p.sources.size() == 1 && p.sources[0] == p.name) {
        emit(p.name, p.value);
      } else if (p.name.ends_with("gate_up_proj")) {
        const int64_t E = p.value.size(0), Im = p.value.size(1) / 2;
        for (int64_t e = 0; e < E; ++e) {
          emit(p.sources[size_t(e)], p.value.select(0, e).slice(0, 0, Im));
          emit(p.sources[size_t(E + e)], p.value.select(0, e).slice(0, Im, 2 * Im));
        }
      } else if (p.name.ends_with("down_proj")) {
        for (int64_t e = 0; e < p.value.size(0); ++e)
          emit(p.sources[size_t(e)], p.value.select(0, e));
      } else {
        const int64_t QL = p.value.size(0) / 3;
        for (int64_t i = 0; i < 3; ++i)
          emit(p.sources[size_t(i)], p.value.slice(0, i * QL, (i + 1) * QL));
      }
    }
    writer.add_file("config.json", config.document().dump(2) + "\n");
    writer.finish();
  }
  std::vector<std::string> asked;
  store.save(
      dir / "streamed",
      [&](const model::InternalParam& p) {
        asked.push_back(p.name);
        return p.value.clone();
      },
      kShard);
  EXPECT_EQ(asked.size(), store.params().size());
  EXPECT_GT(io::CheckpointReader::open(dir / "streamed").shard_files().size(), 3u);
  test::expect_same_files(dir / "streamed", dir / "buffered");
  // A value that is not the whole tensor is refused by name.
  const std::string expert = [&] {
    for (const auto& p : store.params())
      if (model::is_fused_expert_tensor(p.name)) return p.name;
    return std::string();
  }();
  ASSERT_FALSE(expert.empty());
  EXPECT_THROW(store.save(dir / "partial",
                          [&](const model::InternalParam& p) {
                            return p.name == expert ? p.value.narrow(0, 0, 1) : p.value;
                          }),
               InternalError);
}

// An optimizer over a few parameters (bf16 and f32, one frozen) with a non-trivial state.
struct SmallOptimizer {
  std::vector<train::NamedParam> params;
  std::unique_ptr<train::AdamW> adamw;
  SmallOptimizer() {
    std::mt19937_64 rng(8);
    params = {{"a.weight", random_tensor({6, 10}, DType::bf16, rng), true},
              {"b.bias", random_tensor({10}, DType::f32, rng), true},
              {"c.frozen", random_tensor({4}, DType::f32, rng), false},
              {"d.weight", random_tensor({3, 5, 7}, DType::bf16, rng), true}};
    adamw = std::make_unique<train::AdamW>(params);
    for (size_t i = 0; i < params.size(); ++i) {
      if (!params[i].trainable) continue;
      const Shape& s = params[i].value.shape();
      adamw->set_state(i, random_tensor(s, DType::f32, rng), random_tensor(s, DType::f32, rng),
                       random_tensor(s, DType::f32, rng, true));
    }
    adamw->set_step_count(7);
  }
  std::vector<std::pair<std::string, Shape>> trained() const {
    std::vector<std::pair<std::string, Shape>> out;
    for (const auto& p : params)
      if (p.trainable) out.emplace_back(p.name, p.value.shape());
    return out;
  }
};

TEST(OptimizerState, StreamedSaveWritesAdamWsFilesAndRangesReadThemBack) {
  TempDir dir;
  const SmallOptimizer opt;
  opt.adamw->save(dir / "whole");
  std::vector<std::string> asked;
  train::save_optimizer_state(dir / "streamed", opt.trained(), opt.adamw->step_count(),
                              [&](const std::string& name) -> std::array<Tensor, 3> {
                                asked.push_back(name);
                                for (size_t i = 0; i < opt.params.size(); ++i)
                                  if (opt.params[i].name == name)
                                    return {opt.adamw->master(i).clone(),
                                            opt.adamw->exp_avg(i).clone(),
                                            opt.adamw->exp_avg_sq(i).clone()};
                                return {};
                              });
  EXPECT_EQ(asked, (std::vector<std::string>{"a.weight", "b.bias", "d.weight"}));
  test::expect_same_files(dir / "streamed", dir / "whole");

  const train::SavedAdamWState saved = train::SavedAdamWState::open(dir / "streamed");
  EXPECT_EQ(saved.step_count(), 7);
  saved.check(opt.trained());
  for (size_t i = 0; i < opt.params.size(); ++i) {
    if (!opt.params[i].trainable) continue;
    const int64_t n = opt.params[i].value.numel();
    for (int kind = 0; kind < 3; ++kind) {
      const Tensor& want = kind == 0   ? opt.adamw->master(i)
                           : kind == 1 ? opt.adamw->exp_avg(i)
                                       : opt.adamw->exp_avg_sq(i);
      const Tensor got = saved.range(kind, opt.params[i].name, n / 3, n - n / 3);
      EXPECT_EQ(0,
                std::memcmp(got.contiguous().data_ptr(),
                            want.reshape({-1}).narrow(0, n / 3, n - n / 3).contiguous().data_ptr(),
                            size_t(n - n / 3) * 4))
          << opt.params[i].name << " kind " << kind;
    }
  }
}

TEST(OptimizerState, RangedReadsNameWhatIsMissingOrMisshaped) {
  TempDir dir;
  const SmallOptimizer opt;
  opt.adamw->save(dir / "state");
  const train::SavedAdamWState saved = train::SavedAdamWState::open(dir / "state");
  auto trained = opt.trained();
  trained.emplace_back("e.missing", Shape{2});
  std::string msg = message_of([&] { saved.check(trained); });
  EXPECT_NE(msg.find("missing"), std::string::npos) << msg;
  EXPECT_NE(msg.find("optimizer/master/e.missing"), std::string::npos) << msg;
  EXPECT_NE(msg.find((dir / "state").string()), std::string::npos) << msg;
  trained = opt.trained();
  trained[2].second = Shape{5, 3, 7};
  msg = message_of([&] { saved.check(trained); });
  EXPECT_NE(msg.find("'optimizer/master/d.weight' is f32 [3, 5, 7], expected f32 [5, 3, 7]"),
            std::string::npos)
      << msg;
  msg = message_of([&] { saved.range(1, "b.bias", 5, 6); });
  EXPECT_NE(msg.find("optimizer/exp_avg/b.bias"), std::string::npos) << msg;
  msg = message_of([&] { saved.range(0, "z.unknown", 0, 1); });
  EXPECT_NE(msg.find("optimizer/master/z.unknown"), std::string::npos) << msg;
  msg = message_of([&] { train::SavedAdamWState::open(tiny_checkpoint()); });
  EXPECT_NE(msg.find("not an optimizer state"), std::string::npos) << msg;
}

}  // namespace
