#include "glmtune/train/trainer.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <span>
#include <thread>

#include "glmtune/base/error.h"
#include "glmtune/base/fs.h"
#include "glmtune/data/dataset.h"
#include "glmtune/data/packing.h"
#include "glmtune/data/tokenizer.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/model/loss.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/model.h"
#include "glmtune/train/optimizer.h"
#include "glmtune/train/router_bias.h"
#include "glmtune/train/schedule.h"
#include "glmtune/train/state.h"

namespace glmtune::train {
namespace {

namespace fs = std::filesystem;
using model::text::TextModel;

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

Tensor i32(const std::vector<int32_t>& v) { return Tensor::from_vector(v, {int64_t(v.size())}); }

model::ParamStore load_store(const fs::path& dir) {
  const fs::path config_file = dir / "config.json";
  if (!fs::exists(config_file))
    throw Error("no config.json in the model directory", dir.string(),
                "point [model] path at a checkpoint (glmtune init writes one)");
  const model::ModelConfig config = model::ModelConfig::from_file(config_file.string());
  const io::CheckpointReader reader = io::CheckpointReader::open(dir);
  model::ParamStore store = model::ParamStore::load(reader, config);
  // The checkpoint mapping is read-only; the optimizer and the bias update write in place.
  make_params_writable(store);
  return store;
}

// Copies the store's (updated) parameters into the model's compute-dtype tensors. The forward
// therefore always sees the stored values (bf16 weights rounded from the f32 masters), exactly
// what a run resumed from a saved checkpoint sees.
void refresh_model(TextModel& model, const model::ParamStore& store) {
  for (auto& [name, t] : model.weights().named) t.copy_(store.get(name).to(t.dtype()));
}

// The optimizer trains the text model's trainable tensors; the vision tower (kept in the store so
// that checkpoints stay complete) has no gradient in text SFT and is left untouched.
std::vector<NamedParam> trainable_params(const model::ParamStore& store) {
  std::vector<NamedParam> params = named_params(store);
  for (NamedParam& p : params)
    if (!model::text::is_trainable_param(p.name)) p.trainable = false;
  return params;
}

// Files `glmtune eval` and the data pipeline expect next to the weights.
void copy_tokenizer_files(const fs::path& from, const fs::path& to) {
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}) {
    const fs::path src = from / name;
    if (fs::exists(src)) fs::copy_file(src, to / name, fs::copy_options::overwrite_existing);
  }
}

int64_t save_delay_ms() {
  const char* v = std::getenv(kSaveDelayEnv);
  return v ? std::atoll(v) : 0;
}

struct PackBatch {
  std::vector<data::Pack> packs;
  std::vector<model::text::PackInput> inputs;
  int64_t lm_targets = 0;
  std::vector<int64_t> mtp_targets;  // per depth
  int64_t text_tokens = 0;
  int64_t slots = 0;
};

PackBatch next_batch(data::PackSampler& sampler, int64_t micro_packs, int64_t mtp_depths) {
  PackBatch b;
  b.mtp_targets.assign(size_t(mtp_depths), 0);
  for (int64_t i = 0; i < micro_packs; ++i) {
    data::Pack pack = sampler.next();
    model::text::PackInput in;
    in.input_ids = i32(pack.input_ids);
    in.cu_seqlens = i32(pack.cu_seqlens);
    in.labels = i32(pack.labels);
    in.padding_tokens = pack.num_padding;
    b.lm_targets += pack.num_targets;
    for (int64_t k = 1; k <= mtp_depths; ++k) {
      const Tensor shifted = model::shift_labels(in.labels, in.cu_seqlens, k);
      const int32_t* l = shifted.data<int32_t>();
      for (int64_t r = 0; r < shifted.numel(); ++r)
        b.mtp_targets[size_t(k - 1)] += l[r] != model::kIgnoreLabel ? 1 : 0;
    }
    b.slots += int64_t(pack.input_ids.size());
    b.text_tokens += int64_t(pack.input_ids.size()) - pack.num_padding;
    b.packs.push_back(std::move(pack));
    b.inputs.push_back(std::move(in));
  }
  return b;
}

}  // namespace

TrainSummary run_training(const Recipe& recipe, const TrainerOptions& options) {
  if (!recipe.device.is_cpu())
    throw Error(fmt::format("glmtune train runs on the CPU reference path; device {} is not "
                            "supported by the trainer",
                            recipe.device.str()),
                recipe.source() + ": train.device", "set device = \"cpu\"");
  const fs::path out_dir = recipe.output_dir;
  const fs::path model_dir = recipe.model_path;
  const fs::path tok_dir =
      recipe.tokenizer_path.empty() ? model_dir : fs::path(recipe.tokenizer_path);
  TrainSummary summary;
  summary.metrics = out_dir / "metrics.jsonl";

  // Resume point, decided before anything heavy is loaded.
  std::optional<ResumePoint> resume;
  if (options.resume) {
    resume = load_latest_checkpoint(out_dir);
    if (!resume)
      spdlog::info("no complete checkpoint under {}: starting from step 0",
                   (out_dir / kCheckpointsDir).string());
  } else if (!complete_checkpoint_steps(out_dir).empty()) {
    throw Error("the output directory already holds checkpoints of a run",
                (out_dir / kCheckpointsDir).string(),
                "pass --resume to continue that run, or choose another [output] dir");
  }

  // Tokenizer and data.
  const fs::path tokenizer_file = tok_dir / "tokenizer.json";
  if (!fs::exists(tokenizer_file))
    throw Error("no tokenizer.json", tokenizer_file.string(),
                "set [model] tokenizer to the directory holding tokenizer.json");
  const data::Tokenizer tokenizer = data::Tokenizer::from_file(tokenizer_file.string());
  const int32_t pad_id = tokenizer.require_id("<|endoftext|>");
  const auto data_start = Clock::now();
  const data::JsonlDataset dataset = data::JsonlDataset::scan(recipe.dataset_config(), tokenizer);
  if (dataset.size() == 0)
    throw Error("no usable sample in the data", recipe.source() + ": data.files",
                "check the files' format (docs/data.md)");
  data::PackSampler sampler(dataset, recipe.packing_config(pad_id));
  spdlog::info("data: {} samples, {} tokens ({} trained) in {:.1f}s; {} packs of {} per epoch",
               dataset.size(), dataset.stats().tokens, dataset.stats().trained_tokens,
               seconds_since(data_start), sampler.packs_in_epoch(), recipe.pack_max_length);

  // Model and optimizer: from the checkpoint when resuming (its weights are the rounded masters
  // and its router biases the updated ones), else from [model] path.
  const fs::path weights_dir = resume ? resume->checkpoint.model_dir() : model_dir;
  model::ParamStore store = load_store(weights_dir);
  if (tokenizer.vocab_size() > store.config().text().vocab_size)
    throw Error(fmt::format("the tokenizer has {} tokens but the model only {}",
                            tokenizer.vocab_size(), store.config().text().vocab_size),
                tokenizer_file.string(), "use the tokenizer that came with the checkpoint");
  AdamW optimizer(trainable_params(store), recipe.adamw_config());
  TrainerState st;
  st.seed = recipe.seed;
  st.recipe_fingerprint = recipe.fingerprint();
  if (resume) {
    optimizer.load(resume->checkpoint.optimizer_dir());
    sampler.restore_state(resume->state.sampler);
    st = resume->state;
    if (st.recipe_fingerprint != recipe.fingerprint())
      spdlog::warn(
          "the recipe differs from the one that saved {} (fingerprint {} vs {}): the "
          "resumed run will not reproduce an uninterrupted one",
          resume->checkpoint.dir.string(), st.recipe_fingerprint, recipe.fingerprint());
    st.recipe_fingerprint = recipe.fingerprint();
    summary.resumed = true;
    spdlog::info("resuming from {} (step {})", resume->checkpoint.dir.string(), st.step);
  }
  TextModel model(store);
  const model::TextConfig& tc = model.text();

  const int64_t total = recipe.resolve_total_steps(sampler.packs_in_epoch());
  const Schedule schedule = recipe.schedule(total);
  st.total_steps = total;
  summary.start_step = st.step;
  summary.total_steps = total;

  model::text::TrainOptions topt;
  topt.recompute = model::text::recompute_policy(tc.num_hidden_layers, recipe.recompute);
  // The seed system checkpoints the MTP layer whenever it recomputes at all.
  topt.recompute_mtp = recipe.recompute > 0;
  topt.mtp = model.has_mtp() && recipe.mtp_scale > 0;
  topt.mtp_depths = topt.mtp ? tc.num_nextn_predict_layers : 0;
  topt.mtp_loss_scale = recipe.mtp_scale;
  topt.balancing_alpha = recipe.balancing_alpha;
  topt.num_micro_packs = recipe.micro_packs;
  model::text::TextGrads grads = model::text::TextGrads::zeros_like(model.weights());

  // Gradients in the optimizer's parameter order (frozen ones stay undefined).
  std::vector<Tensor> grad_list(optimizer.params().size());
  for (size_t i = 0; i < optimizer.params().size(); ++i) {
    const NamedParam& p = optimizer.params()[i];
    if (!p.trainable) continue;
    const Tensor* g = grads.find(p.name);
    GLMTUNE_ASSERT(g != nullptr, "trainable parameter '{}' has no gradient buffer", p.name);
    grad_list[i] = *g;
  }

  fs::create_directories(out_dir);
  write_file_atomic((out_dir / "recipe.toml").string(), recipe.to_toml());
  ThroughputMeter meter(st.totals);
  MetricsLog log(out_dir, st.step, options.print_steps ? recipe.log_every : (int64_t(1) << 62));
  spdlog::info(
      "training {} steps from step {} ({} packs of {} tokens per step, lr {} -> {}, "
      "{} of {} layers recomputed)",
      total, st.step, recipe.micro_packs, recipe.pack_max_length, recipe.lr, recipe.lr_min,
      std::count(topt.recompute.begin(), topt.recompute.end(), true), tc.num_hidden_layers);

  auto save = [&] {
    st.epoch = sampler.epoch();
    st.sampler = sampler.save_state();
    st.totals = meter.totals();
    const int64_t delay = save_delay_ms();
    const ModelWriter writer = [&](const fs::path& dir) {
      store.save(dir);
      copy_tokenizer_files(tok_dir, dir);
      if (delay > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay));
    };
    const auto t0 = Clock::now();
    const CheckpointDir ck = save_checkpoint(out_dir, st, writer, optimizer, recipe.keep_last);
    summary.checkpoint = ck.dir;
    spdlog::info("saved {} in {:.1f}s", ck.dir.string(), seconds_since(t0));
  };

  const auto run_start = Clock::now();
  while (st.step < total) {
    const auto step_start = Clock::now();
    PackBatch batch = next_batch(sampler, recipe.micro_packs, topt.mtp_depths);
    // Denominators of the whole step (SPEC.md §4); a step without any target gets 1 so that
    // every term is 0 rather than NaN.
    topt.lm_denominator = double(std::max<int64_t>(batch.lm_targets, 1));
    topt.mtp_denominators.clear();
    for (int64_t n : batch.mtp_targets)
      topt.mtp_denominators.push_back(double(std::max<int64_t>(n, 1)));

    grads.zero();
    ExpertLoads loads;
    double lm_sum = 0, balancing = 0;
    std::vector<double> mtp_sum(size_t(topt.mtp_depths), 0.0);
    for (const model::text::PackInput& in : batch.inputs) {
      const model::text::StepPackResult r = model::text::forward_backward(model, in, topt, grads);
      lm_sum += r.backward.lm_loss_sum;
      for (size_t k = 0; k < r.backward.mtp_loss_sum.size(); ++k)
        mtp_sum[k] += r.backward.mtp_loss_sum[k];
      balancing += r.backward.balancing_loss;
      for (const auto& l : r.loads) {
        const int64_t* c = l.counts.data<int64_t>();
        loads.add(l.bias_name, std::span<const int64_t>(c, size_t(l.counts.numel())));
      }
    }
    const double lr = schedule.lr(st.step);
    const StepReport rep = optimizer.step(grad_list, lr);
    // The bias moves from the step's loads even when the update was skipped (docs/training.md).
    const double maxvio =
        update_router_biases(loads, recipe.router_bias_update_rate,
                             [&](const std::string& name) -> Tensor& { return store.get(name); });
    refresh_model(model, store);
    ++st.step;
    if (rep.skipped) ++st.skipped_steps;

    StepMetrics m;
    m.step = st.step;
    m.total_steps = total;
    m.epoch = sampler.epoch();
    m.loss = lm_sum / topt.lm_denominator;
    double mtp_mean = 0;
    for (size_t k = 0; k < mtp_sum.size(); ++k) mtp_mean += mtp_sum[k] / topt.mtp_denominators[k];
    m.mtp_loss = mtp_sum.empty() ? 0.0 : recipe.mtp_scale * mtp_mean / double(mtp_sum.size());
    m.balancing_loss = balancing;
    m.grad_norm = rep.grad_norm;
    m.lr = lr;
    m.maxvio = maxvio;
    m.skipped = rep.skipped;
    const MemoryPeaks peaks = take_memory_peaks(recipe.device);
    m.max_memory = peaks.max_memory;
    m.reserved_memory = peaks.reserved_memory;
    meter.record(m, batch.text_tokens, batch.slots, seconds_since(step_start));
    log.write(m);
    summary.steps.push_back(m);
    summary.text_tokens += batch.text_tokens;
    if (options.on_step) options.on_step(m);

    const bool stop = options.stop && options.stop->load();
    const bool periodic = recipe.save_every > 0 && st.step % recipe.save_every == 0;
    if (periodic || st.step == total || stop) save();
    if (stop && st.step < total) {
      summary.interrupted = true;
      spdlog::warn("stopped at step {} of {} on request", st.step, total);
      break;
    }
  }
  if (summary.checkpoint.empty()) {
    // Nothing left to run (resumed at the end): the latest checkpoint is the result.
    if (const auto last = load_latest_checkpoint(out_dir))
      summary.checkpoint = last->checkpoint.dir;
  }
  summary.end_step = st.step;
  summary.skipped_steps = st.skipped_steps;
  summary.seconds = seconds_since(run_start);
  return summary;
}

}  // namespace glmtune::train
