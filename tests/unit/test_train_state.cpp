// Training checkpoints: save → load gives identical optimizer tensors and trainer state, keep_last
// pruning, recovery from a save killed midway, the ParamStore round trip; and the metrics log.

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "glmtune/base/error.h"
#include "glmtune/base/fs.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/io/safetensors.h"
#include "glmtune/model/config.h"
#include "glmtune/model/init.h"
#include "glmtune/model/param_store.h"
#include "glmtune/tensor/rng.h"
#include "glmtune/train/flops.h"
#include "glmtune/train/optimizer.h"
#include "glmtune/train/state.h"

using namespace glmtune;
using namespace glmtune::train;
namespace fs = std::filesystem;

namespace {

uint64_t fresh_seed() { return std::random_device{}(); }

fs::path temp_dir(const std::string& name) {
  fs::path p =
      fs::temp_directory_path() / ("glmtune_test_state_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

Tensor random_tensor(const Shape& shape, DType dtype, uint64_t seed, uint64_t offset) {
  Tensor t = Tensor::empty(shape, dtype);
  fill_normal(t, seed, offset, 0.0, 1.0);
  return t;
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  Tensor c = t.contiguous();
  const auto* p = static_cast<const uint8_t*>(c.data_ptr());
  return std::vector<uint8_t>(p, p + c.nbytes());
}

std::vector<NamedParam> small_params(uint64_t seed) {
  return {{"w1", random_tensor({6, 4}, DType::bf16, seed, 0), true},
          {"w2", random_tensor({5}, DType::f32, seed, 100), true},
          {"buffer", random_tensor({3}, DType::f32, seed, 200), false}};
}

std::vector<Tensor> grads_for(const std::vector<NamedParam>& params, uint64_t seed, uint64_t step) {
  std::vector<Tensor> g;
  for (size_t i = 0; i < params.size(); ++i)
    g.push_back(params[i].trainable ? random_tensor(params[i].value.shape(), DType::f32, seed + 1,
                                                    step * 1000 + i * 100)
                                    : Tensor());
  return g;
}

// A model writer for tests: the parameters as one safetensors file.
ModelWriter writer_for(const std::vector<NamedParam>& params) {
  return [&params](const fs::path& dir) {
    fs::create_directories(dir);
    io::NamedTensors t;
    for (const auto& p : params) t.emplace_back(p.name, p.value);
    io::save_safetensors(dir / "model.safetensors", t, {{"format", "pt"}});
  };
}

// The same through the checkpoint writer, which records every tensor's checksum.
ModelWriter checksummed_writer_for(const std::vector<NamedParam>& params) {
  return [&params](const fs::path& dir) {
    io::CheckpointWriter w(dir);
    for (const auto& p : params) w.add(p.name, p.value);
    w.finish();
  };
}

void flip_bit(const fs::path& file, uint64_t at) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(std::streamoff(at));
  char c = 0;
  f.read(&c, 1);
  c = char(c ^ 0x01);  // the lowest mantissa bit: the value stays finite
  f.seekp(std::streamoff(at));
  f.write(&c, 1);
}

// Flips a bit of the first byte of tensor `name` in the checkpoint directory `dir`.
fs::path flip_tensor_bit(const fs::path& dir, const std::string& name) {
  const auto reader = io::CheckpointReader::open(dir);
  const std::string file = reader.shard_of(name);
  const uint64_t at = reader.shard(file).data_offset() + reader.info(name).begin;
  flip_bit(dir / file, at);
  return dir / file;
}

TrainerState sample_state(uint64_t seed, int64_t step) {
  TrainerState s;
  s.step = step;
  s.total_steps = 100;
  s.epoch = 2;
  s.sampler = {{"epoch", 2}, {"index_in_epoch", 7}, {"seed", seed}, {"fingerprint", "abc"}};
  s.seed = seed;
  s.rng_offset = seed % 1000 + 1;
  s.skipped_steps = 1;
  s.totals = {step, 12345, 16384, 12.5};
  s.recipe_fingerprint = "0123456789abcdef";
  s.extra = {{"note", "kept verbatim"}};
  return s;
}

}  // namespace

TEST(TrainerState, JsonRoundTrip) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const TrainerState s = sample_state(seed, 42);
  const TrainerState back = TrainerState::from_json(s.to_json(), "t.json");
  EXPECT_EQ(back.to_json(), s.to_json());
  EXPECT_EQ(back.seed, seed);
  EXPECT_EQ(back.totals.seconds, 12.5);
  nlohmann::json broken = s.to_json();
  broken.erase("sampler");
  try {
    TrainerState::from_json(broken, "t.json");
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.where(), "t.json");
    EXPECT_NE(e.problem().find("sampler"), std::string::npos);
  }
  broken = s.to_json();
  broken["step"] = -3;
  EXPECT_THROW(TrainerState::from_json(broken, "t.json"), Error);
  broken = s.to_json();
  broken["format_version"] = 99;
  EXPECT_THROW(TrainerState::from_json(broken, "t.json"), Error);
}

TEST(Checkpoint, SaveThenLoadGivesIdenticalState) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const fs::path out = temp_dir("roundtrip");
  EXPECT_FALSE(load_latest_checkpoint(out).has_value());  // a fresh run
  auto params = small_params(seed);
  AdamW opt(params, {});
  for (uint64_t s = 0; s < 3; ++s) opt.step(grads_for(params, seed, s), 1e-2);
  const TrainerState state = sample_state(seed, 3);
  const CheckpointDir saved = save_checkpoint(out, state, writer_for(params), opt, 3);
  EXPECT_EQ(saved.dir, out / "checkpoints" / "step-3");
  EXPECT_TRUE(is_complete_checkpoint(saved.dir));
  EXPECT_EQ(read_text_file((out / "checkpoints" / "latest").string(), "latest"), "step-3\n");

  const auto resume = load_latest_checkpoint(out);
  ASSERT_TRUE(resume.has_value());
  EXPECT_EQ(resume->checkpoint.dir, saved.dir);
  EXPECT_EQ(resume->state.to_json(), state.to_json());
  // A new optimizer over other values restores every tensor bit for bit.
  auto other = small_params(seed + 7);
  AdamW restored(other, {});
  restored.load(resume->checkpoint.optimizer_dir());
  EXPECT_EQ(restored.step_count(), 3);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(bytes_of(restored.master(i)), bytes_of(opt.master(i)));
    EXPECT_EQ(bytes_of(restored.exp_avg(i)), bytes_of(opt.exp_avg(i)));
    EXPECT_EQ(bytes_of(restored.exp_avg_sq(i)), bytes_of(opt.exp_avg_sq(i)));
    EXPECT_EQ(bytes_of(other[i].value), bytes_of(params[i].value));
  }
  // The model part is what the writer produced.
  io::CheckpointReader model = io::CheckpointReader::open(resume->checkpoint.model_dir());
  EXPECT_EQ(bytes_of(model.tensor("w1")), bytes_of(params[0].value));
  // Saving the same step again replaces it.
  opt.step(grads_for(params, seed, 3), 1e-2);
  save_checkpoint(out, state, writer_for(params), opt, 3);
  AdamW again(small_params(seed + 9), {});
  again.load(load_latest_checkpoint(out)->checkpoint.optimizer_dir());
  EXPECT_EQ(again.step_count(), 4);
  fs::remove_all(out);
}

TEST(Checkpoint, KeepLastPrunesTheOldest) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const fs::path out = temp_dir("prune");
  auto params = small_params(seed);
  AdamW opt(params, {});
  for (int64_t step = 1; step <= 5; ++step) {
    opt.step(grads_for(params, seed, uint64_t(step)), 1e-3);
    save_checkpoint(out, sample_state(seed, step * 10), writer_for(params), opt, 2);
  }
  EXPECT_EQ(complete_checkpoint_steps(out), (std::vector<int64_t>{40, 50}));
  EXPECT_FALSE(fs::exists(out / "checkpoints" / "step-30"));
  EXPECT_EQ(load_latest_checkpoint(out)->state.step, 50);
  // keep_last 0 keeps everything.
  save_checkpoint(out, sample_state(seed, 60), writer_for(params), opt, 0);
  save_checkpoint(out, sample_state(seed, 70), writer_for(params), opt, 0);
  EXPECT_EQ(complete_checkpoint_steps(out), (std::vector<int64_t>{40, 50, 60, 70}));
  fs::remove_all(out);
}

TEST(Checkpoint, ResumeIgnoresASaveKilledMidway) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const fs::path out = temp_dir("killed");
  const fs::path root = out / "checkpoints";
  auto params = small_params(seed);
  AdamW opt(params, {});
  opt.step(grads_for(params, seed, 0), 1e-2);
  save_checkpoint(out, sample_state(seed, 2), writer_for(params), opt, 3);

  // What a kill leaves behind: a temporary directory of the next save, half written ...
  fs::create_directories(root / ".step-3.tmp-424242" / "model");
  std::ofstream(root / ".step-3.tmp-424242" / "model" / "model.safetensors") << "partial";
  // ... a step directory without its manifest (as if copied in part) ...
  fs::create_directories(root / "step-3" / "optimizer");
  fs::copy_file(root / "step-2" / kTrainerStateFile, root / "step-3" / kTrainerStateFile);
  // ... and one whose manifest no longer matches a truncated file.
  fs::copy(root / "step-2", root / "step-4", fs::copy_options::recursive);
  fs::resize_file(root / "step-4" / "model" / "model.safetensors", 10);
  // The pointer may even name a broken one.
  write_file_atomic((root / "latest").string(), "step-4\n");

  std::string why;
  EXPECT_FALSE(is_complete_checkpoint(root / "step-3", &why));
  EXPECT_NE(why.find("COMPLETE"), std::string::npos) << why;
  EXPECT_FALSE(is_complete_checkpoint(root / "step-4", &why));
  EXPECT_NE(why.find("bytes"), std::string::npos) << why;
  auto resume = load_latest_checkpoint(out);
  ASSERT_TRUE(resume.has_value());
  EXPECT_EQ(resume->state.step, 2);
  EXPECT_EQ(resume->checkpoint.dir, root / "step-2");
  EXPECT_EQ(complete_checkpoint_steps(out), std::vector<int64_t>{2});

  // The next save of step 3 replaces the partial directory and clears the leftover.
  opt.step(grads_for(params, seed, 1), 1e-2);
  save_checkpoint(out, sample_state(seed, 3), writer_for(params), opt, 3);
  EXPECT_FALSE(fs::exists(root / ".step-3.tmp-424242"));
  EXPECT_EQ(complete_checkpoint_steps(out), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(load_latest_checkpoint(out)->state.step, 3);
  fs::remove_all(out);
}

TEST(Checkpoint, AFailedSaveLeavesThePreviousOne) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const fs::path out = temp_dir("failed");
  auto params = small_params(seed);
  AdamW opt(params, {});
  save_checkpoint(out, sample_state(seed, 5), writer_for(params), opt, 3);
  const ModelWriter failing = [](const fs::path& dir) {
    fs::create_directories(dir);
    std::ofstream(dir / "half.bin") << "x";
    throw Error("disk full", dir.string(), "free some space");
  };
  EXPECT_THROW(save_checkpoint(out, sample_state(seed, 6), failing, opt, 3), Error);
  EXPECT_FALSE(fs::exists(out / "checkpoints" / "step-6"));
  size_t entries = 0;
  for (const auto& e : fs::directory_iterator(out / "checkpoints")) {
    ++entries;
    EXPECT_EQ(e.path().filename().string().find(".step-"), std::string::npos) << e.path();
  }
  EXPECT_EQ(entries, 2u);  // step-5 and latest
  EXPECT_EQ(load_latest_checkpoint(out)->state.step, 5);
  EXPECT_EQ(read_text_file((out / "checkpoints" / "latest").string(), "latest"), "step-5\n");
  fs::remove_all(out);
}

TEST(Checkpoint, ResumeFallsBackFromACorruptNewestCheckpointAndKeepsIt) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const fs::path out = temp_dir("corrupt");
  const fs::path root = out / "checkpoints";
  auto params = small_params(seed);
  AdamW opt(params, {});
  save_checkpoint(out, sample_state(seed, 10), checksummed_writer_for(params), opt, 0);
  opt.step(grads_for(params, seed, 1), 1e-2);
  save_checkpoint(out, sample_state(seed, 20), checksummed_writer_for(params), opt, 0);
  const io::VerifyReport good = verify_training_checkpoint(root / "step-20");
  EXPECT_TRUE(good.ok()) << good.describe();
  EXPECT_TRUE(good.has_checksums);
  EXPECT_EQ(good.tensors_verified, 3 + 1 + 3 * 2);  // model; optimizer step + 3 per trained one

  // One bit of one weight, the file size unchanged: the manifest's sizes still match.
  const auto size = fs::file_size(root / "step-20" / "model" / "model-00001-of-00001.safetensors");
  flip_tensor_bit(root / "step-20" / "model", "w2");
  EXPECT_EQ(fs::file_size(root / "step-20" / "model" / "model-00001-of-00001.safetensors"), size);
  EXPECT_TRUE(is_complete_checkpoint(root / "step-20"));
  const io::VerifyReport bad = verify_training_checkpoint(root / "step-20");
  ASSERT_EQ(bad.problems.size(), 1u) << bad.describe();
  EXPECT_EQ(bad.problems[0].file, "model/model-00001-of-00001.safetensors");
  EXPECT_EQ(bad.problems[0].tensor, "w2");

  LoadCheckpointOptions options;
  options.set_aside_failed = true;
  const auto resume = load_latest_checkpoint(out, options);
  ASSERT_TRUE(resume.has_value());
  EXPECT_EQ(resume->state.step, 10);
  // Not deleted: set aside under a name no save, prune or resume touches.
  EXPECT_FALSE(fs::exists(root / "step-20"));
  ASSERT_TRUE(fs::exists(root / "step-20.corrupt"));
  EXPECT_EQ(verify_training_checkpoint(root / "step-20.corrupt").problems.size(), 1u);
  save_checkpoint(out, sample_state(seed, 20), checksummed_writer_for(params), opt, 1);
  EXPECT_TRUE(fs::exists(root / "step-20.corrupt"));
  EXPECT_EQ(complete_checkpoint_steps(out), std::vector<int64_t>{20});
  fs::remove_all(out);
}

TEST(Checkpoint, ResumeFallsBackFromACorruptOrTruncatedOrMissingOptimizerShard) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const std::string damage : {"flip", "truncate", "remove"}) {
    SCOPED_TRACE(damage);
    const fs::path out = temp_dir("optimizer_" + damage);
    const fs::path root = out / "checkpoints";
    auto params = small_params(seed);
    AdamW opt(params, {});
    save_checkpoint(out, sample_state(seed, 1), checksummed_writer_for(params), opt, 0);
    save_checkpoint(out, sample_state(seed, 2), checksummed_writer_for(params), opt, 0);
    const fs::path odir = root / "step-2" / "optimizer";
    const fs::path shard = odir / io::CheckpointReader::open(odir).shard_files().front();
    if (damage == "flip")
      flip_tensor_bit(odir, optimizer_state_name(1, "w1"));
    else if (damage == "truncate")
      fs::resize_file(shard, fs::file_size(shard) - 8);
    else
      fs::remove(shard);
    const io::VerifyReport bad = verify_training_checkpoint(root / "step-2");
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.problems[0].file, "optimizer/" + shard.filename().string()) << bad.describe();
    if (damage == "flip") EXPECT_EQ(bad.problems[0].tensor, optimizer_state_name(1, "w1"));
    const auto resume = load_latest_checkpoint(out);
    ASSERT_TRUE(resume.has_value());
    EXPECT_EQ(resume->state.step, 1);
    EXPECT_TRUE(fs::exists(root / "step-2"));  // without set_aside_failed it stays as it is
    fs::remove_all(out);
  }
}

TEST(Checkpoint, NoCheckpointVerifyingIsAnErrorThatKeepsThem) {
  const uint64_t seed = fresh_seed();
  const fs::path out = temp_dir("allbad");
  const fs::path root = out / "checkpoints";
  auto params = small_params(seed);
  AdamW opt(params, {});
  save_checkpoint(out, sample_state(seed, 1), checksummed_writer_for(params), opt, 0);
  flip_tensor_bit(root / "step-1" / "model", "w1");
  LoadCheckpointOptions options;
  options.set_aside_failed = true;
  try {
    load_latest_checkpoint(out, options);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("step-1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("\"w1\""), std::string::npos) << msg;
    EXPECT_NE(msg.find("inspect --verify"), std::string::npos) << msg;
    // A training checkpoint cannot be downloaded again: the advice must not suggest it.
    EXPECT_EQ(msg.find("download"), std::string::npos) << msg;
  }
  EXPECT_TRUE(fs::exists(root / "step-1.corrupt"));
  fs::remove_all(out);
}

TEST(Checkpoint, ACheckpointWithoutChecksumsStillResumesUnverified) {
  const uint64_t seed = fresh_seed();
  const fs::path out = temp_dir("unverified");
  auto params = small_params(seed);
  AdamW opt(params, {});
  // writer_for writes a lone model.safetensors, as older glmtune versions and other tools do.
  save_checkpoint(out, sample_state(seed, 4), writer_for(params), opt, 0);
  const io::VerifyReport r = verify_training_checkpoint(out / "checkpoints" / "step-4");
  EXPECT_TRUE(r.ok()) << r.describe();
  EXPECT_FALSE(r.has_checksums);
  ASSERT_TRUE(load_latest_checkpoint(out).has_value());
  EXPECT_EQ(load_latest_checkpoint(out)->state.step, 4);
  fs::remove_all(out);
}

TEST(Checkpoint, ParamStoreRoundTripInTheReleasedLayout) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const fs::path out = temp_dir("store");
  const model::ModelConfig config = model::ModelConfig::preset("tiny");
  model::InitOptions init;
  init.seed = seed;
  model::write_random_checkpoint(config, out / "init", init);
  model::ParamStore store =
      model::ParamStore::load(io::CheckpointReader::open(out / "init"), config);
  make_params_writable(store);
  for (const auto& p : store.params()) {
    if (p.trainable || p.name.ends_with("e_score_correction_bias"))
      EXPECT_TRUE(p.value.storage()->owns_memory()) << p.name;
  }
  AdamW opt(named_params(store), {});
  std::vector<Tensor> grads;
  uint64_t offset = 0;
  for (const auto& p : opt.params()) {
    grads.push_back(p.trainable ? random_tensor(p.value.shape(), DType::f32, seed, offset)
                                : Tensor());
    offset += uint64_t(p.value.numel());
  }
  const StepReport r = opt.step(grads, 1e-3);
  EXPECT_FALSE(r.skipped);
  // The router bias is a buffer: move it as the load-balancing rule would.
  std::string bias_name;
  for (const auto& p : store.params())
    if (p.name.ends_with("e_score_correction_bias")) bias_name = p.name;
  ASSERT_FALSE(bias_name.empty());
  Tensor& bias = store.get(bias_name);
  bias.set_item({0}, bias.item({0}) + 0.25);

  save_checkpoint(
      out, sample_state(seed, 1), [&](const std::filesystem::path& dir) { store.save(dir); }, opt,
      1);
  const auto resume = load_latest_checkpoint(out);
  ASSERT_TRUE(resume.has_value());
  model::ParamStore loaded =
      model::ParamStore::load(io::CheckpointReader::open(resume->checkpoint.model_dir()), config);
  ASSERT_EQ(loaded.params().size(), store.params().size());
  for (size_t i = 0; i < store.params().size(); ++i) {
    const auto& a = store.params()[i];
    EXPECT_EQ(bytes_of(loaded.get(a.name)), bytes_of(a.value)) << a.name;
  }
  // Resuming on the loaded store restores the optimizer exactly.
  make_params_writable(loaded);
  AdamW resumed(named_params(loaded), {});
  resumed.load(resume->checkpoint.optimizer_dir());
  for (size_t i = 0; i < opt.params().size(); ++i) {
    if (!opt.params()[i].trainable) continue;
    ASSERT_EQ(bytes_of(resumed.exp_avg_sq(i)), bytes_of(opt.exp_avg_sq(i))) << i;
    ASSERT_EQ(bytes_of(resumed.master(i)), bytes_of(opt.master(i))) << i;
  }
  fs::remove_all(out);
}

TEST(Metrics, RecordsUseTheSeedSystemsNames) {
  StepMetrics m;
  m.step = 3;
  m.total_steps = 10;
  m.loss = 2.5;
  m.grad_norm = std::nan("");
  m.skipped = true;
  const nlohmann::json j = m.to_json();
  for (const char* key :
       {"loss", "mtp_loss", "balancing_loss", "grad_norm", "lr", "tgs", "seqlen_tgs", "exp_tgs",
        "max_memory", "reserved_memory", "maxvio", "eta"})
    EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_TRUE(j["grad_norm"].is_null());  // non-finite values are null, never invalid JSON
  EXPECT_EQ(j["loss"], 2.5);
  EXPECT_TRUE(j["mfu"].is_null()) << "a CPU run has no MFU";
  EXPECT_TRUE(j["comm_time"].is_null()) << "nor GPU communication";
  const std::string line = m.log_line();
  EXPECT_NE(line.find("step 3/10"), std::string::npos) << line;
  EXPECT_NE(line.find("skipped"), std::string::npos) << line;
  EXPECT_EQ(line.find("mfu"), std::string::npos) << line;
  m.model_tflops = 250.0;
  m.mfu = 250.0 / 989.4;
  EXPECT_NE(m.log_line().find("model_tflops 250.0 mfu 25.3%"), std::string::npos) << m.log_line();
  EXPECT_DOUBLE_EQ(m.to_json()["mfu"].get<double>(), 250.0 / 989.4);
  m.comm_time = 0.125;
  EXPECT_NE(m.log_line().find("comm_time 0.125s"), std::string::npos) << m.log_line();
  EXPECT_DOUBLE_EQ(m.to_json()["comm_time"].get<double>(), 0.125);
  EXPECT_EQ(format_eta(3723.4), "1:02:03");
}

TEST(Metrics, ThroughputContinuesAcrossResume) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 gen(seed);
  ThroughputMeter meter;
  StepMetrics m;
  m.total_steps = 10;
  int64_t tokens = 0;
  double seconds = 0;
  for (int64_t s = 1; s <= 4; ++s) {
    const int64_t t = std::uniform_int_distribution<int64_t>(100, 1000)(gen);
    const double dt = std::uniform_real_distribution<double>(0.5, 2.0)(gen);
    tokens += t;
    seconds += dt;
    m.step = s;
    meter.record(m, t, 1024, dt);
    EXPECT_DOUBLE_EQ(m.tgs, double(t) / dt);
    EXPECT_DOUBLE_EQ(m.seqlen_tgs, 1024.0 / dt);
    EXPECT_DOUBLE_EQ(m.exp_tgs, double(tokens) / seconds);
    EXPECT_DOUBLE_EQ(m.eta, double(10 - s) * seconds / double(s));
    EXPECT_EQ(m.consumed_tokens, tokens);
  }
  // The totals travel in the trainer state; a resumed meter continues the averages.
  const ThroughputTotals saved = ThroughputTotals::from_json(meter.totals().to_json(), "t");
  ThroughputMeter resumed(saved);
  m.step = 5;
  resumed.record(m, 500, 1024, 1.0);
  EXPECT_DOUBLE_EQ(m.exp_tgs, double(tokens + 500) / (seconds + 1.0));
  EXPECT_EQ(m.consumed_tokens, tokens + 500);
}

TEST(Metrics, LogAppendsAndDropsRedoneSteps) {
  const fs::path out = temp_dir("metrics");
  {
    MetricsLog log(out, 0, 100);
    for (int64_t s = 1; s <= 5; ++s) {
      StepMetrics m;
      m.step = s;
      m.total_steps = 5;
      m.loss = 1.0 / double(s);
      log.write(m);
    }
  }
  // A kill mid-write tears the last line.
  std::ofstream(out / "metrics.jsonl", std::ios::app) << "{\"step\": 6, \"lo";
  auto steps_in_file = [&] {
    std::vector<int64_t> steps;
    std::ifstream in(out / "metrics.jsonl");
    std::string line;
    while (std::getline(in, line)) steps.push_back(nlohmann::json::parse(line)["step"]);
    return steps;
  };
  {
    // Resuming from the checkpoint of step 3: steps 4 and 5 will be redone.
    MetricsLog log(out, 3, 1);
    EXPECT_EQ(steps_in_file(), (std::vector<int64_t>{1, 2, 3}));
    StepMetrics m;
    m.step = 4;
    m.total_steps = 5;
    log.write(m);
    // Flushed at once: readable before the log is closed.
    EXPECT_EQ(steps_in_file(), (std::vector<int64_t>{1, 2, 3, 4}));
  }
  fs::remove_all(out);
}
// The FLOP count behind model_tflops / mfu (train/flops.h): per-token terms add up over documents,
// attention counts only the keys a query sees in its own document (at most index_topk of them),
// the indexer is counted once (no backward), and MTP adds its layer.
TEST(FlopCount, FollowsTheDocumentsAndTheSelection) {
  const model::TextConfig c = model::ModelConfig::preset("tiny").text();
  ASSERT_GT(c.index_topk, 4);
  const int64_t topk = c.index_topk;
  // Two documents of 3 tokens cost twice one, whole step included.
  const FlopCount one = count_flops(c, {3}, true), two = count_flops(c, {3, 3}, true);
  EXPECT_NEAR(two.step(6), 2 * one.step(3), 1e-9 * two.step(6));
  // A document of 2·topk tokens: its second half attends topk keys per query, more than the
  // first; the per-token work grows with it and never shrinks.
  const FlopCount short_doc = count_flops(c, {topk}, false);
  const FlopCount long_doc = count_flops(c, {2 * topk}, false);
  EXPECT_GT(long_doc.trained, short_doc.trained);
  EXPECT_GT(long_doc.step(2 * topk), 2 * short_doc.step(topk));
  // Keys per query are capped at topk: doubling the document again adds half as much attention
  // per token as the first doubling did ((topk − 1)/8 keys against (topk − 1)/4).
  const FlopCount longer = count_flops(c, {4 * topk}, false);
  EXPECT_GT(longer.trained, long_doc.trained);
  EXPECT_LT(longer.trained - long_doc.trained, long_doc.trained - short_doc.trained + 1e-9);
  // The indexer runs forward only: it is not part of the × 3.
  EXPECT_GT(one.forward_only, 0);
  EXPECT_DOUBLE_EQ(one.step(3), 3 * (3 * one.trained) + one.forward_only);
  // MTP adds work; no document, no work.
  EXPECT_GT(count_flops(c, {3}, true).trained, count_flops(c, {3}, false).trained);
  EXPECT_EQ(count_flops(c, {}, true).step(0), 0.0);
}
