#include "glmtune/train/trainer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <thread>
#include <utility>

#include "glmtune/base/error.h"
#include "glmtune/base/fs.h"
#include "glmtune/data/dataset.h"
#include "glmtune/data/packing.h"
#include "glmtune/data/token_cache.h"
#include "glmtune/data/tokenizer.h"
#include "glmtune/dist/expert_parallel.h"
#include "glmtune/dist/expert_shards.h"
#include "glmtune/dist/fsdp.h"
#include "glmtune/dist/parallel.h"
#include "glmtune/dist/sequence_parallel.h"
#include "glmtune/dist/sharded_optimizer.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/model/loss.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/model.h"
#include "glmtune/tensor/allocator.h"
#include "glmtune/train/optimizer.h"
#ifdef GLMTUNE_WITH_CUDA
#include "glmtune/train/device_adamw.h"
#endif
#include "glmtune/train/flops.h"
#include "glmtune/train/freeze.h"
#include "glmtune/train/released.h"
#include "glmtune/train/router_bias.h"
#include "glmtune/train/schedule.h"
#include "glmtune/train/state.h"
#include "glmtune/train/vl_batch.h"

namespace glmtune::train {
namespace {

namespace fs = std::filesystem;
using model::text::TextModel;

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

Tensor i32(const std::vector<int32_t>& v) { return Tensor::from_vector(v, {int64_t(v.size())}); }

model::ModelConfig read_model_config(const fs::path& dir) {
  const fs::path config_file = dir / "config.json";
  if (!fs::exists(config_file))
    throw Error("no config.json in the model directory", dir.string(),
                "point [model] path at a checkpoint (glmtune init writes one)");
  return model::ModelConfig::from_file(config_file.string());
}

// `experts`: the routed experts this rank keeps (expert parallelism); nullopt loads all of them.
// `defer`: tensors held as placeholders, read later from `reader` piece by piece (fsdp).
model::ParamStore load_store(const io::CheckpointReader& reader, const model::ModelConfig& config,
                             std::optional<model::ExpertRange> experts,
                             const std::function<bool(const std::string&)>& defer) {
  model::ParamStore store = model::ParamStore::load(reader, config, experts, defer);
  // The checkpoint mapping is read-only; the optimizer and the bias update write in place.
  make_params_writable(store);
  return store;
}

// Copies the store's (updated) parameters into the model's compute-dtype tensors. The forward
// therefore always sees the stored values (bf16 weights rounded from the f32 masters), exactly
// what a run resumed from a saved checkpoint sees.
void refresh_model(TextModel& model, const model::ParamStore& store) {
  // Sharded decoder layers are undefined between uses: their slices are updated by their own
  // optimizer and, for the router biases the store keeps, from the store after each step.
  for (auto& [name, t] : model.weights().named)
    if (t.defined()) t.copy_(store.get(name).to(t.dtype()));
}

// With the optimizer on the GPU the model's trained tensors are updated in place; of the store's
// values only the router correction biases change on the host (the bias rule) and are copied.
void refresh_router_biases(TextModel& model, const model::ParamStore& store) {
  for (auto& [name, t] : model.weights().named)
    if (t.defined() && name.ends_with("e_score_correction_bias"))
      t.copy_(store.get(name).to(t.dtype()));
}

// The one-GPU optimizer (train/device_adamw.h) as the trainer uses it; empty when the optimizer
// runs on the host. Function members keep the CUDA-only type out of the CPU build.
struct GpuOptimizer {
  std::function<double()> grad_norm;
  std::function<StepReport(double lr, double grad_norm, bool skip)> step;
  std::function<int64_t()> step_count;
  std::function<void(const SavedAdamWState&)> load;
  // {master, exp_avg, exp_avg_sq} of one trained parameter, on the host (a checkpoint).
  WholeOptimizerState state;
  // Writes every master into the store's value, rounded to its storage dtype (a checkpoint).
  std::function<void(model::ParamStore&)> to_store;
  std::function<int64_t()> state_bytes;
  explicit operator bool() const { return bool(step); }
};

GpuOptimizer make_gpu_optimizer(const std::vector<NamedParam>& params, TextModel& model,
                                model::text::TextGrads& grads, const AdamWConfig& config) {
#ifdef GLMTUNE_WITH_CUDA
  auto opt = std::make_shared<DeviceAdamW>(params, model.weights(), grads, config);
  GpuOptimizer g;
  g.grad_norm = [opt] { return opt->grad_norm(); };
  g.step = [opt](double lr, double norm, bool skip) { return opt->step(lr, norm, skip); };
  g.step_count = [opt] { return opt->step_count(); };
  g.load = [opt](const SavedAdamWState& saved) { opt->load(saved); };
  g.state = [opt](const std::string& name) { return opt->state(name); };
  g.to_store = [opt](model::ParamStore& store) {
    for (const auto& [name, master] : opt->masters()) store.get(name).copy_(master);
  };
  g.state_bytes = [opt] { return opt->state_bytes(); };
  return g;
#else
  (void)params, (void)model, (void)grads, (void)config;
  throw_internal(__FILE__, __LINE__, "a GPU optimizer in a build without CUDA");
#endif
}

// Whether `name` is a tensor of one of the first `layers` decoder layers (not the MTP layer).
bool in_decoder_layer(const std::string& name, int64_t layers) {
  for (int64_t l = 0; l < layers; ++l) {
    const std::string prefix = model::text::layer_prefix(l);
    if (name.compare(0, prefix.size(), prefix) == 0) return true;
  }
  return false;
}

// The store's tensor `p` when it holds one (sharded decoder layers are dropped from it).
const Tensor* stored_value(const model::InternalParam& p) {
  return p.value.defined() ? &p.value : nullptr;
}

// The trained tensors of the optimizer state a sharded run saves and resumes (name and whole shape,
// in the order of the unsharded optimizer's parameters): with fsdp or expert slices the store holds
// placeholders or slices, whose whole shapes it keeps.
std::vector<std::pair<std::string, Shape>> whole_trained(const std::vector<NamedParam>& params,
                                                         const model::ParamStore& store) {
  std::vector<std::pair<std::string, Shape>> out;
  for (const NamedParam& p : params)
    if (p.trainable)
      out.emplace_back(p.name,
                       store.contains(p.name) ? store.param(p.name).shape : p.value.shape());
  return out;
}

// The optimizer trains the text model's trainable tensors; the vision tower (kept in the store so
// that checkpoints stay complete) has no gradient in text SFT and is left untouched.
std::vector<NamedParam> trainable_params(const model::ParamStore& store) {
  std::vector<NamedParam> params = named_params(store);
  for (NamedParam& p : params)
    if (!model::text::is_trainable_param(p.name)) p.trainable = false;
  return params;
}

// Applies train.freeze (with the model.freeze_vision / freeze_projector shorthands, which a model
// without a vision tower ignores) to the store, and says what it froze; glmtune::Error when nothing
// is left to train (the vision tower and projector train only in a vision-language run).
FreezePlan freeze_parameters(const Recipe& recipe, model::ParamStore& store, bool vision_language) {
  std::vector<std::string> patterns = recipe.freeze;
  const bool has_vision =
      std::any_of(store.params().begin(), store.params().end(),
                  [](const auto& p) { return p.name.starts_with("model.visual."); });
  if (has_vision && recipe.freeze_vision) patterns.push_back(vision_tower_pattern());
  if (has_vision && recipe.freeze_projector) patterns.push_back(projector_pattern());
  FreezePlan plan = apply_freeze(store, patterns, recipe.source() + ": train.freeze");
  const std::vector<NamedParam> text = trainable_params(store);
  const bool text_trains =
      std::any_of(text.begin(), text.end(), [](const NamedParam& p) { return p.trainable; });
  const bool vision_trains = vision_language && !((recipe.freeze_vision || plan.vision_tower) &&
                                                  (recipe.freeze_projector || plan.projector));
  if (!text_trains && !vision_trains)
    throw Error("the freeze patterns leave no parameter to train",
                recipe.source() + ": train.freeze", "freeze fewer parameters");
  if (!recipe.freeze.empty())
    spdlog::info("train.freeze: {} tensors ({} parameters) frozen", plan.frozen.size(),
                 plan.frozen_elements);
  return plan;
}

// Files `glmtune eval` and the data pipeline expect next to the weights.
void copy_tokenizer_files(const fs::path& from, const fs::path& to) {
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                           "processor_config.json"}) {
    const fs::path src = from / name;
    if (fs::exists(src)) fs::copy_file(src, to / name, fs::copy_options::overwrite_existing);
  }
}

int64_t save_delay_ms() {
  const char* v = std::getenv(kSaveDelayEnv);
  return v ? std::atoll(v) : 0;
}

// How many offending tensors a non-finite step names.
constexpr size_t kNonFiniteNamed = 4;

// Opens the recipe's token cache and checks that it holds the samples the recipe would make from
// its JSONL files: the same tokenizer (by the hash of tokenizer.json), chat template, format,
// max_length and on_overlong.
data::TokenCache open_cache(const Recipe& recipe, const fs::path& tokenizer_file) {
  const data::TokenCache cache =
      data::TokenCache::open(recipe.data_cache, data::tokenizer_file_hash(tokenizer_file));
  const nlohmann::json& c = cache.metadata().value("config", nlohmann::json::object());
  const data::DatasetConfig want = recipe.dataset_config();
  const char* format = want.format == data::SampleFormat::kChat   ? "chat"
                       : want.format == data::SampleFormat::kText ? "text"
                                                                  : "auto";
  const char* overlong = want.on_overlong == data::OverlongPolicy::kDrop ? "drop" : "truncate";
  const std::string prepare = fmt::format(
      "prepare the cache again: glmtune data prepare --tokenizer {} --input FILES --out {} "
      "--format {} --max-length {} --on-overlong {}",
      tokenizer_file.parent_path().string(), recipe.data_cache, format, want.max_length, overlong);
  auto check = [&](const char* key, const nlohmann::json& expected, const char* recipe_key) {
    const nlohmann::json got = c.value(key, nlohmann::json());
    if (got != expected)
      throw Error(fmt::format("the token cache was prepared with {} = {}, the recipe asks for {}",
                              key, got.dump(), expected.dump()),
                  fmt::format("{} (recipe {}: {})", recipe.data_cache, recipe.source(), recipe_key),
                  fmt::format("set {} = {} in the recipe, or {}", recipe_key, got.dump(), prepare));
  };
  check("chat_template", "glm5.3", "data.cache");
  check("format", format, "data.format");
  check("max_length", want.max_length, "data.max_length");
  check("on_overlong", overlong, "data.on_overlong");
  if (const auto stale = cache.stale_sources(); !stale.empty())
    spdlog::warn("{} was changed or removed since {} was prepared; training on the cache as it is",
                 stale.front(), recipe.data_cache);
  return cache;
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

// The GPU this process trains on. Ranks sharing a node take one GPU each, the node-local
// rank's, so a distributed recipe names the kind of device only.
Device training_device(const Recipe& recipe, const dist::ParallelContext* par) {
  const int visible = cuda_device_count();
  if (par == nullptr || !par->distributed() || par->local_size() == 1) {
    if (recipe.device.index >= visible)
      throw Error(
          fmt::format("{} asked for, but {} GPU(s) are visible", recipe.device.str(), visible),
          recipe.source() + ": train.device",
          "pick a device below the number of visible GPUs (CUDA_VISIBLE_DEVICES)");
    return recipe.device;
  }
  if (recipe.device.index != 0)
    throw Error(fmt::format("device {} in a run of {} ranks on this node", recipe.device.str(),
                            par->local_size()),
                recipe.source() + ": train.device",
                "set device = \"cuda\": each rank of a node takes the GPU of its node-local rank");
  if (par->local_size() > visible)
    throw Error(
        fmt::format("{} ranks on this node but {} GPU(s) visible", par->local_size(), visible),
        recipe.source() + ": train.device",
        "launch one rank per GPU (mpirun -np N with N GPUs per node, or srun "
        "--ntasks-per-node=N --gpus-per-node=N)");
  return Device::cuda(par->local_rank());
}

}  // namespace

TrainSummary run_training(const Recipe& recipe, const TrainerOptions& options) {
  const bool on_gpu = recipe.device.is_cuda();
#ifndef GLMTUNE_WITH_CUDA
  if (on_gpu)
    throw Error(fmt::format("device {} asked for, but this glmtune was built without CUDA",
                            recipe.device.str()),
                recipe.source() + ": train.device",
                "set device = \"cpu\", or build with -DGLMTUNE_CUDA=ON on a machine with the CUDA "
                "toolkit");
#endif
  const fs::path out_dir = recipe.output_dir;
  const fs::path model_dir = recipe.model_path;
  const fs::path tok_dir =
      recipe.tokenizer_path.empty() ? model_dir : fs::path(recipe.tokenizer_path);
  TrainSummary summary;
  summary.metrics = out_dir / "metrics.jsonl";
  // Distributed: each step's packs are split over the data-parallel ranks, whose gradients,
  // losses and expert loads are summed; rank 0 logs and saves.
  dist::ParallelContext* par = options.parallel;
  const bool distributed = par != nullptr && par->distributed();
  const Device device = on_gpu ? training_device(recipe, par) : Device::cpu();
  const bool root = par == nullptr || par->is_root();
  if (on_gpu && distributed) {
    // Every layout over NCCL, one rank per GPU.
    par->use_gpu(device.index);
  } else if (on_gpu) {
    use_cuda_device(device.index);
  }
  const int64_t dp = distributed ? par->sizes().dp : 1;
  const int64_t dp_rank = distributed ? par->dp().rank() : 0;
  const bool sequence_parallel = distributed && par->sizes().sp > 1;

  // A path that cannot hold the output fails now, not after loading everything.
  create_output_directory(out_dir, recipe.source() + ": output.dir");
  if (root) {
    remove_stale_temporary_files(out_dir, {"metrics.jsonl", "recipe.toml"});
    remove_stale_temporary_files(out_dir / kCheckpointsDir, {kLatestFile});
  }

  // Resume point, decided before anything heavy is loaded: the newest checkpoint that verifies.
  std::optional<ResumePoint> resume;
  if (options.resume) {
    LoadCheckpointOptions load;
    load.set_aside_failed = root;
    resume = load_latest_checkpoint(out_dir, load);
    if (!resume)
      spdlog::info("no complete checkpoint under {}: starting from step 0",
                   (out_dir / kCheckpointsDir).string());
  } else if (!complete_checkpoint_steps(out_dir).empty()) {
    throw Error("the output directory already holds checkpoints of a run",
                (out_dir / kCheckpointsDir).string(),
                "pass --resume to continue that run, or choose another [output] dir");
  }
  if (distributed) {
    const int64_t step = resume ? resume->state.step : -1;
    if (par->world().all_reduce_max(step) != step || -par->world().all_reduce_max(-step) != step)
      throw Error("the ranks found different checkpoints to resume from",
                  (out_dir / kCheckpointsDir).string(),
                  "put [output] dir on a file system that every rank shares");
  }

  // Tokenizer and data.
  const fs::path tokenizer_file = tok_dir / "tokenizer.json";
  if (!fs::exists(tokenizer_file))
    throw Error("no tokenizer.json", tokenizer_file.string(),
                "set [model] tokenizer to the directory holding tokenizer.json");
  const data::Tokenizer tokenizer = data::Tokenizer::from_file(tokenizer_file.string());
  const int32_t pad_id = tokenizer.require_id("<|endoftext|>");
  const auto data_start = Clock::now();
  std::optional<data::JsonlDataset> dataset;
  std::optional<data::TokenCache> cache;
  int64_t data_tokens = 0, trained_tokens = 0;
  // Vision-language data (data.media_root set): conversations with images and videos.
  std::unique_ptr<VlTraining> vl;
  if (!recipe.media_root.empty()) {
    vl = std::make_unique<VlTraining>(recipe, tok_dir);
    if (vl->dataset().size() == 0)
      throw Error("no usable sample in the data", recipe.source() + ": data.files",
                  "check the conversations and their media (docs/vision.md)");
    data_tokens = vl->dataset().stats().tokens;
    trained_tokens = vl->dataset().stats().trained_tokens;
  } else if (!recipe.data_cache.empty()) {
    cache.emplace(open_cache(recipe, tokenizer_file));
    data_tokens = cache->num_tokens();
    trained_tokens = cache->num_trained_tokens();
  } else {
    dataset.emplace(data::JsonlDataset::scan(recipe.dataset_config(), tokenizer));
    if (dataset->size() == 0)
      throw Error("no usable sample in the data", recipe.source() + ": data.files",
                  "check the files' format (docs/data.md)");
    data_tokens = dataset->stats().tokens;
    trained_tokens = dataset->stats().trained_tokens;
  }
  const data::SampleSource& source = vl      ? static_cast<const data::SampleSource&>(vl->dataset())
                                     : cache ? static_cast<const data::SampleSource&>(*cache)
                                             : *dataset;
  data::PackSampler sampler(source, recipe.packing_config(pad_id));
  spdlog::info("data: {} samples, {} tokens ({} trained) in {:.1f}s; {} packs of {} per epoch",
               source.size(), data_tokens, trained_tokens, seconds_since(data_start),
               sampler.packs_in_epoch(), recipe.pack_max_length);
  // Only the first bad lines were logged one by one while reading; the totals come once.
  if (const data::DatasetStats* read = vl        ? &vl->dataset().stats()
                                       : dataset ? &dataset->stats()
                                                 : nullptr;
      read && read->skipped_total() > 0)
    spdlog::warn("data: {}", read->skipped_report());

  // Model and optimizer: from the checkpoint when resuming (its weights are the rounded masters
  // and its router biases the updated ones), else from [model] path.
  const fs::path weights_dir = resume ? resume->checkpoint.model_dir() : model_dir;
  const model::ModelConfig model_config = read_model_config(weights_dir);
  // Expert parallel: each rank loads and keeps the routed experts of its ep slice only (weights,
  // gradients, optimizer state: dist/expert_shards.h); the other tensors stay replicated as without
  // it.
  const bool expert_sharded = distributed && par->sizes().ep > 1;
  std::optional<dist::ExpertParallel> expert_parallel;
  if (expert_sharded)
    expert_parallel.emplace(par->ep(), model_config.text().n_routed_experts,
                            recipe.source() + ": train.ep_size", on_gpu ? par->ep_gpu() : nullptr);
  // Fully sharded decoder layers (dist/fsdp.h): each rank keeps a slice of every decoder layer's
  // compute weights, gradient, fp32 masters and moments over dp (a group of one without a
  // launcher); the replicated tensors, the vision tower and projector included, go through the
  // sharded AdamW below.
  const bool fsdp = recipe.fsdp;
  const int64_t num_layers = model_config.text().num_hidden_layers;
  // With fsdp the decoder layers' tensors are not read here: the store holds placeholders and each
  // rank reads only the elements of its slices from the mapped checkpoint once the layout is known
  // (below). The router correction biases stay whole: the bias rule updates them in the store. So
  // do the routed-expert slices of expert parallelism: they differ per ep rank, so they stay out of
  // the dp layout and are loaded (this rank's experts) and trained as without fsdp.
  std::optional<io::CheckpointReader> weights_reader = io::CheckpointReader::open(weights_dir);
  const auto sliced_later = [&](const std::string& name) {
    return in_decoder_layer(name, num_layers) && !name.ends_with("e_score_correction_bias") &&
           !(expert_sharded && model::is_fused_expert_tensor(name));
  };
  model::ParamStore store = load_store(
      *weights_reader, model_config,
      expert_parallel ? std::optional(dist::local_range(*expert_parallel)) : std::nullopt,
      fsdp ? std::function<bool(const std::string&)>(sliced_later) : nullptr);
  if (!fsdp) weights_reader.reset();
  const FreezePlan freeze = freeze_parameters(recipe, store, vl != nullptr);
  if (vl) vl->freeze(freeze.vision_tower, freeze.projector);
  if (tokenizer.vocab_size() > store.config().text().vocab_size)
    throw Error(fmt::format("the tokenizer has {} tokens but the model only {}",
                            tokenizer.vocab_size(), store.config().text().vocab_size),
                tokenizer_file.string(), "use the tokenizer that came with the checkpoint");
  std::unique_ptr<dist::Communicator> self_group;
  if (fsdp && !distributed) self_group = dist::make_self_communicator("dp");
  dist::Communicator* const dp_group = distributed ? &par->dp() : self_group.get();
  // On GPUs the sharded optimizers and layers move device tensors through NCCL (a group of one
  // moves them locally).
  dist::Communicator* const device_dp_group = !on_gpu       ? nullptr
                                              : distributed ? par->dp_gpu()
                                                            : self_group.get();
  std::vector<NamedParam> own_params =
      dp_group ? std::vector<NamedParam>{} : trainable_params(store);
  // The vision tower and projector train in VL runs (unless frozen): their gradient buffers,
  // aligned with the optimizer's parameters (the sharded optimizer's when there is a dp group).
  std::vector<Tensor> vision_grads =
      vl && !dp_group ? vl->attach(own_params, store) : std::vector<Tensor>{};
  // On one GPU the optimizer runs on the device beside the model (train/device_adamw.h; built with
  // the model below) and the host optimizer gets no parameters: no gradient or weight crosses the
  // host link in a step.
  const bool gpu_optimizer = on_gpu && !dp_group;
  std::vector<NamedParam> device_params;
  if (gpu_optimizer) device_params = std::exchange(own_params, {});
  AdamW optimizer(std::move(own_params), recipe.adamw_config());
  std::optional<dist::ShardedAdamW> sharded;
  if (dp_group) {
    std::vector<NamedParam> replicated = trainable_params(store);
    if (fsdp)
      std::erase_if(replicated,
                    [&](const NamedParam& p) { return in_decoder_layer(p.name, num_layers); });
    if (expert_sharded)
      std::erase_if(replicated,
                    [](const NamedParam& p) { return model::is_fused_expert_tensor(p.name); });
    if (vl) vision_grads = vl->attach(replicated, store);
    sharded.emplace(std::move(replicated), recipe.adamw_config(), *dp_group, device_dp_group);
  }
  const std::vector<NamedParam>& opt_params = sharded ? sharded->params() : optimizer.params();
  // Every trained tensor, the sharded ones included, with the vision tower and projector marked as
  // the VL step trains them (the text rule alone would leave their state out of a checkpoint).
  const auto all_trained_params = [&] {
    std::vector<NamedParam> params = trainable_params(store);
    if (vl) vl->step().attach(params);
    return params;
  };
  TrainerState st;
  st.seed = recipe.seed;
  st.recipe_fingerprint = recipe.fingerprint(dp);
  // The trained tensors of the saved optimizer state, whole shapes, in the unsharded optimizer's
  // order: what a sharded run checks when it resumes and writes when it saves.
  const std::vector<std::pair<std::string, Shape>> saved_trained =
      sharded
          ? whole_trained(fsdp || expert_sharded ? all_trained_params() : sharded->params(), store)
      : gpu_optimizer ? whole_trained(device_params, store)
                      : std::vector<std::pair<std::string, Shape>>{};
  // A sharded run reads its pieces of the saved state straight from the mapped files (the
  // replicated shards here, the decoder-layer and expert pieces once those optimizers exist below):
  // no rank reads or holds the whole state.
  std::optional<SavedAdamWState> saved_state;
  if (resume) {
    if (sharded || gpu_optimizer) {
      saved_state.emplace(SavedAdamWState::open(resume->checkpoint.optimizer_dir()));
      saved_state->check(saved_trained);
      if (sharded) sharded->load(*saved_state);
    } else {
      optimizer.load(resume->checkpoint.optimizer_dir());
    }
    sampler.restore_state(resume->state.sampler);
    st = resume->state;
    if (st.recipe_fingerprint != recipe.fingerprint(dp))
      spdlog::warn(
          "the recipe differs from the one that saved {} (fingerprint {} vs {}): the "
          "resumed run will not reproduce an uninterrupted one",
          resume->checkpoint.dir.string(), st.recipe_fingerprint, recipe.fingerprint(dp));
    st.recipe_fingerprint = recipe.fingerprint(dp);
    summary.resumed = true;
    spdlog::info("resuming from {} (step {})", resume->checkpoint.dir.string(), st.step);
  }
  // The store holds this rank's expert slices, so the model built from it below holds them as its
  // compute tensors and its gradient buffers are slice-sized too.
  std::optional<dist::LocalExperts> local_experts;
  std::optional<dist::ExpertAdamW> expert_optimizer;
  if (expert_sharded) {
    local_experts.emplace(store, *expert_parallel);
    expert_optimizer.emplace(*local_experts, recipe.adamw_config(), par->edp(),
                             on_gpu ? par->edp_gpu() : nullptr);
    if (saved_state) expert_optimizer->load(*saved_state);
  }
  std::optional<TextModel> text_model;
  if (vl && on_gpu)
    throw Error(
        "vision-language training runs on the CPU only: the vision tower has no GPU path yet",
        recipe.source() + ": train.device", "set device = \"cpu\" for data with media");
  if (vl)
    vl->load_model(store);
  else if (on_gpu)
    // bf16 weights on the device (fp32-kept parameters in f32). On one GPU the optimizer updates
    // them in place; a distributed GPU run's sharded optimizers update their shards on the device
    // and all-gather the weights into it.
    text_model.emplace(store, model::text::TextModelOptions{DType::bf16, device});
  else
    text_model.emplace(store);
  TextModel& model = vl ? vl->model().text() : *text_model;
  const model::TextConfig& tc = model.text();

  const int64_t total = recipe.resolve_total_steps(sampler.packs_in_epoch(), dp);
  const Schedule schedule = recipe.schedule(total);
  st.total_steps = total;
  summary.start_step = st.step;
  summary.total_steps = total;

  model::text::TrainOptions topt;
  topt.activations =
      model::text::activation_policy(tc.num_hidden_layers, recipe.recompute, recipe.offload);
  // The reference trainer checkpoints the MTP layer whenever it recomputes at all.
  topt.recompute_mtp = recipe.recompute > 0;
  topt.mtp = model.has_mtp() && recipe.mtp_scale > 0;
  topt.mtp_depths = topt.mtp ? tc.num_nextn_predict_layers : 0;
  topt.mtp_loss_scale = recipe.mtp_scale;
  topt.balancing_alpha = recipe.balancing_alpha;
  topt.num_micro_packs = recipe.micro_packs * dp;
  // Expert parallel: tokens travel to the ranks holding their experts.
  if (expert_parallel) topt.expert_dispatch = &*expert_parallel;
  // Sequence parallel: the ranks of an sp group share each pack, one contiguous shard of rows
  // each; the mixers exchange what crosses the shards (dist/sequence_parallel.h).
  std::optional<dist::UlyssesParallel> ulysses;
  if (sequence_parallel) {
    ulysses.emplace(par->sp(), tc.linear_num_heads, tc.num_attention_heads,
                    recipe.source() + ": train.sp_size", on_gpu ? par->sp_gpu() : nullptr);
    topt.sequence_parallel = &*ulysses;
  }
  model::text::TextGrads grads = model::text::TextGrads::zeros_like(model.weights());
  // Several GPUs: the sharded optimizers keep their state on the device too and write the
  // gathered weights straight into the model (dist/sharded_optimizer.h), so the store's values
  // are brought up to date only for a checkpoint.
  const auto compute_tensors = [&](const std::vector<NamedParam>& params) {
    std::vector<Tensor> compute;
    for (const NamedParam& p : params) {
      compute.emplace_back();
      if (!p.trainable) continue;
      for (const auto& [name, t] : model.weights().named)
        if (name == p.name) compute.back() = t;
    }
    return compute;
  };
  if (on_gpu && sharded) {
    sharded->keep_on_device(compute_tensors(sharded->params()));
    if (expert_optimizer)
      expert_optimizer->keep_on_device(compute_tensors(expert_optimizer->params()));
    spdlog::info("optimizer on {}: {} bytes of this rank's fp32 masters and moments there",
                 device.str(),
                 sharded->state_bytes() + (expert_optimizer ? expert_optimizer->state_bytes() : 0));
  }
  GpuOptimizer gpu_adamw;
  if (gpu_optimizer) {
    gpu_adamw = make_gpu_optimizer(device_params, model, grads, recipe.adamw_config());
    if (saved_state) gpu_adamw.load(*saved_state);
    spdlog::info("optimizer on {}: {} bytes of fp32 masters and moments there", device.str(),
                 gpu_adamw.state_bytes());
  }
  // Fully sharded decoder layers: weights gathered over dp around each use (the next layer's
  // transfer overlapping the current one), gradients reduce-scattered into slices right after
  // each layer's backward, and AdamW on the slices. The store then drops the layers' tensors but
  // the router correction biases, which the bias rule updates in place every step (the others were
  // placeholders: the slices were read from the checkpoint piece by piece); a checkpoint gathers
  // them back one tensor at a time.
  std::optional<dist::ShardedLayers> sharded_layers;
  std::optional<dist::ShardedLayerAdamW> layer_optimizer;
  std::map<std::string, DType> dropped_from_store;  // name -> storage dtype
  std::vector<std::string> biases_in_store;
  if (fsdp) {
    // The model holds placeholders for the deferred tensors: each rank reads its slices' elements.
    const auto read_piece = [&](const std::string& name, int64_t begin, int64_t count) {
      const model::InternalParam& p = store.param(name);
      return p.deferred ? store.read_elements(*weights_reader, name, begin, count)
                        : p.value.reshape({-1}).narrow(0, begin, count).clone();
    };
    sharded_layers.emplace(
        model.weights(), grads, *dp_group,
        dist::LayerSource{
            [&](const std::string& name) -> std::optional<Shape> {
              const model::InternalParam& p = store.param(name);
              return p.deferred ? std::optional(p.shape) : std::nullopt;
            },
            read_piece,
            [&](const std::string& name) { return local_experts && local_experts->holds(name); }},
        device_dp_group);
    std::vector<NamedParam> layer_params = named_params(store);
    std::erase_if(layer_params,
                  [&](const NamedParam& p) { return !in_decoder_layer(p.name, num_layers); });
    layer_optimizer.emplace(*sharded_layers, read_piece, recipe.adamw_config());
    if (saved_state) layer_optimizer->load(*saved_state);
    if (on_gpu) layer_optimizer->keep_on_device();
    weights_reader.reset();
    for (const NamedParam& p : layer_params) {
      if (local_experts && local_experts->holds(p.name)) continue;
      if (!sharded_layers->holds(p.name))
        throw InternalError(fmt::format("decoder-layer tensor '{}' has no slice", p.name));
      if (p.name.ends_with("e_score_correction_bias")) {
        biases_in_store.push_back(p.name);
      } else {
        dropped_from_store.emplace(p.name, p.value.dtype());
        store.get(p.name) = Tensor();
      }
    }
    topt.layer_params = &*sharded_layers;
    spdlog::info("fsdp: {} bytes of tensor memory allocated on this rank after start-up ({})",
                 allocator_for(device).stats().allocated, on_gpu ? device.str() : "host");
    spdlog::info(
        "fsdp: this rank holds {} of {} bytes of decoder-layer weights{}, {} of {} bytes of their "
        "gradients and {} bytes of their optimizer state ({} for the replicated tensors)",
        sharded_layers->resident_bytes(), sharded_layers->full_bytes(),
        local_experts ? " (the routed experts apart: see ep)" : "",
        sharded_layers->gradient_bytes(), sharded_layers->full_gradient_bytes(),
        layer_optimizer->state_bytes(), sharded->state_bytes());
  }

  // Gradients in the optimizer's parameter order (frozen ones stay undefined).
  std::vector<Tensor> grad_list(opt_params.size());
  for (size_t i = 0; i < opt_params.size(); ++i) {
    const NamedParam& p = opt_params[i];
    if (!p.trainable) continue;
    if (vl && vision_grads[i].defined()) {
      grad_list[i] = vision_grads[i];
      continue;
    }
    const Tensor* g = grads.find(p.name);
    GLMTUNE_ASSERT(g != nullptr, "trainable parameter '{}' has no gradient buffer", p.name);
    // A distributed GPU run reduces them on the device and moves only this rank's shard
    // (sharded_optimizer.h); one GPU's optimizer reads them where they are.
    grad_list[i] = *g;
  }
  // This rank's expert-slice gradients, in the expert optimizer's order.
  std::vector<Tensor> expert_grad_list;
  if (expert_optimizer)
    for (const NamedParam& p : expert_optimizer->params()) {
      if (!p.trainable) {  // frozen experts: no buffer
        expert_grad_list.emplace_back();
        continue;
      }
      const Tensor* g = grads.find(p.name);
      GLMTUNE_ASSERT(g != nullptr && g->shape() == p.value.shape(),
                     "routed-expert tensor '{}' has no slice-sized gradient buffer", p.name);
      expert_grad_list.push_back(*g);
    }
  if (local_experts) {
    const auto expert_bytes = [](const std::vector<std::pair<std::string, Tensor>>& named) {
      int64_t bytes = 0;
      for (const auto& [name, t] : named)
        if (t.defined() && model::is_fused_expert_tensor(name)) bytes += int64_t(t.nbytes());
      return bytes;
    };
    spdlog::info(
        "ep: this rank holds experts {}..{} of {}: {} of {} bytes of routed-expert weights in the "
        "parameter store, {} bytes of them in the model, {} bytes of their gradients and {} bytes "
        "of their optimizer state",
        expert_parallel->first_expert(),
        expert_parallel->first_expert() + expert_parallel->local_experts() - 1,
        expert_parallel->experts(), local_experts->local_bytes(), local_experts->full_bytes(),
        expert_bytes(model.weights().named), expert_bytes(grads.named),
        expert_optimizer->state_bytes());
  }
  // The gradient the optimizer sees for a parameter (the vision tower's live outside `grads`).
  std::map<std::string, Tensor*> optimizer_grad;
  for (size_t i = 0; i < opt_params.size(); ++i)
    if (grad_list[i].defined()) optimizer_grad[opt_params[i].name] = &grad_list[i];

  if (root) write_file_atomic((out_dir / "recipe.toml").string(), recipe.to_toml());
  ThroughputMeter meter(st.totals);
  std::optional<MetricsLog> log;
  if (root)
    log.emplace(out_dir, st.step, options.print_steps ? recipe.log_every : (int64_t(1) << 62));
  if (distributed)
    spdlog::info(
        "distributed: {} ranks, data parallel over {} (rank {}){}{}, optimizer sharded{}{}",
        par->sizes().world, dp, par->rank(),
        on_gpu ? fmt::format(" on {} (gradients over NCCL)", device.str()) : std::string(),
        sequence_parallel ? fmt::format(", sequence parallel over {} (shard {})", par->sizes().sp,
                                        par->sp().rank())
                          : std::string(),
        expert_parallel
            ? fmt::format(", experts {}..{} of {} here (ep_size {})",
                          expert_parallel->first_expert(),
                          expert_parallel->first_expert() + expert_parallel->local_experts() - 1,
                          tc.n_routed_experts, par->sizes().ep)
            : std::string(),
        sharded_layers ? ", decoder-layer weights sharded (fsdp)" : "");
  const auto layers_with = [&](model::text::ActivationPolicy policy) {
    return std::count(topt.activations.begin(), topt.activations.end(), policy);
  };
  const auto offloaded = layers_with(model::text::ActivationPolicy::offload);
  spdlog::info(
      "training {} steps from step {} ({} packs of {} tokens per step, lr {} -> {}, "
      "{} of {} layers recomputed, {} offloaded{})",
      total, st.step, recipe.micro_packs, recipe.pack_max_length, recipe.lr, recipe.lr_min,
      layers_with(model::text::ActivationPolicy::recompute), tc.num_hidden_layers, offloaded,
      offloaded > 0 && !on_gpu ? "; on the CPU offloaded layers are kept" : "");

  // Expert slices are named per expert by LocalExperts::nonfinite, not by released_views (which
  // splits whole tensors).
  const auto replicated_only = [&](const InternalLookup& lookup) -> InternalLookup {
    return [&, lookup](const model::InternalParam& p) -> const Tensor* {
      return local_experts && local_experts->holds(p.name) ? nullptr : lookup(p);
    };
  };
  auto save = [&] {
    // The store's values are the checkpoint's: with the optimizer on the GPU they are brought up
    // to date here, one tensor at a time.
    if (gpu_adamw) gpu_adamw.to_store(store);
    if (on_gpu && sharded) {
      sharded->write_params();
      if (expert_optimizer) expert_optimizer->write_params();
    }
    // Never a checkpoint of weights that are not finite (a run resumed from it could only fail).
    std::vector<std::string> bad =
        first_nonfinite(released_views(store, replicated_only(stored_value)), kNonFiniteNamed);
    if (local_experts) {
      const std::vector<std::string> experts = local_experts->nonfinite(
          [&](const std::string& name) { return &store.get(name); }, par->world(), kNonFiniteNamed);
      bad.insert(bad.end(), experts.begin(), experts.end());
    }
    if (sharded_layers) {
      const std::vector<std::string> layers = sharded_layers->nonfinite(false, kNonFiniteNamed);
      bad.insert(bad.end(), layers.begin(), layers.end());
    }
    if (!bad.empty())
      throw Error(fmt::format("not saving step {}: the weights hold non-finite values (in {})",
                              st.step, fmt::join(bad, ", ")),
                  (out_dir / kCheckpointsDir).string(),
                  "check the model checkpoint the run started from, or resume from an earlier "
                  "checkpoint with a lower optimizer.lr");
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
    if (gpu_adamw) {
      const CheckpointDir ck = save_checkpoint(
          out_dir, st, writer,
          [&](const fs::path& dir) {
            save_optimizer_state(dir, saved_trained, gpu_adamw.step_count(), gpu_adamw.state);
          },
          recipe.keep_last);
      summary.checkpoint = ck.dir;
      spdlog::info("saved {} in {:.1f}s", ck.dir.string(), seconds_since(t0));
      return;
    }
    if (!sharded) {
      const CheckpointDir ck = save_checkpoint(out_dir, st, writer, optimizer, recipe.keep_last);
      summary.checkpoint = ck.dir;
      spdlog::info("saved {} in {:.1f}s", ck.dir.string(), seconds_since(t0));
      return;
    }
    // The released layout whatever the sharding, streamed: every tensor that is sharded (decoder
    // layers with fsdp, expert slices) is gathered whole, with its optimizer state, right before
    // rank 0 writes it, one tensor at a time in the order a single process writes them, so rank 0
    // never holds the whole model or optimizer state beyond what it keeps for training. The other
    // ranks run the same sequence of gathers without writing.
    const bool first_sp = !distributed || par->sp().rank() == 0;
    const model::ParamStore::WholeValue whole_value = [&](const model::InternalParam& p) -> Tensor {
      if (sharded_layers && !p.value.defined() && sharded_layers->holds(p.name)) {
        const Tensor whole = sharded_layers->gather_tensor(p.name, 0);
        if (!root) return Tensor();
        // Exact: the compute slices hold the stored values.
        Tensor stored = Tensor::empty(whole.shape(), dropped_from_store.at(p.name));
        stored.copy_(whole);
        return stored;
      }
      if (local_experts && local_experts->holds(p.name)) {
        // The ranks of one sp index hold every slice; the other sp indices hold copies.
        if (!first_sp || par->edp().rank() != 0) return Tensor();
        return local_experts->gather_one(p.name);
      }
      return p.value;
    };
    const WholeOptimizerState whole_state = [&](const std::string& name) -> std::array<Tensor, 3> {
      if (layer_optimizer && sharded_layers->holds(name))
        return layer_optimizer->gather_state(name, 0);
      if (expert_optimizer && local_experts->holds(name)) {
        if (!first_sp) return {};
        return expert_optimizer->gather_state(name);
      }
      return sharded->gather_state(name, 0);
    };
    if (root) {
      try {
        summary.checkpoint =
            save_checkpoint(
                out_dir, st,
                [&](const fs::path& dir) {
                  store.save(dir, whole_value);
                  copy_tokenizer_files(tok_dir, dir);
                  if (delay > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay));
                },
                [&](const fs::path& dir) {
                  save_optimizer_state(dir, saved_trained, sharded->step_count(), whole_state);
                },
                recipe.keep_last)
                .dir;
      } catch (const std::exception& e) {
        if (!distributed) throw;
        par->abort(fmt::format("saving step {} failed: {}", st.step, e.what()));
      }
      spdlog::info("saved {} in {:.1f}s", summary.checkpoint.string(), seconds_since(t0));
    } else {
      store.visit_for_save(whole_value);
      visit_optimizer_state(saved_trained, whole_state);
    }
    if (!distributed) return;
    par->world().barrier();
    if (!root)
      if (const auto last = load_latest_checkpoint(out_dir, {.verify = false}))
        summary.checkpoint = last->checkpoint.dir;
  };

  const auto run_start = Clock::now();
  // The start-up's collectives are not the first step's.
  if (on_gpu && distributed) par->take_gpu_busy_seconds();
  while (st.step < total) {
    const auto step_start = Clock::now();
    PackBatch batch = next_batch(sampler, recipe.micro_packs * dp, topt.mtp_depths);
    // Denominators of the whole step: the targets of every rank's packs, so that the ranks'
    // gradients sum to the gradient of one batch (docs/distributed.md, "How a data-parallel step
    // works"); a step without any target gets 1 so that every term is 0 rather than NaN.
    topt.lm_denominator = double(std::max<int64_t>(batch.lm_targets, 1));
    topt.mtp_denominators.clear();
    for (int64_t n : batch.mtp_targets)
      topt.mtp_denominators.push_back(double(std::max<int64_t>(n, 1)));

    // Sharded decoder layers have no buffers between steps: their slices are zeroed instead.
    for (auto& [name, g] : grads.named)
      if (g.defined()) g.zero_();
    if (sharded_layers) sharded_layers->zero_gradients();
    if (vl) vl->step().zero();
    ExpertLoads loads;
    double lm_sum = 0, balancing = 0;
    std::vector<double> mtp_sum(size_t(topt.mtp_depths), 0.0);
    const std::span<const model::text::PackInput> my_packs =
        std::span<const model::text::PackInput>(batch.inputs)
            .subspan(size_t(dp_rank * recipe.micro_packs), size_t(recipe.micro_packs));
    for (size_t k = 0; k < my_packs.size(); ++k) {
      const model::text::PackInput& in = my_packs[k];
      const model::text::StepPackResult r =
          vl ? vl->run(batch.packs[size_t(dp_rank * recipe.micro_packs) + k], in, topt, grads)
             : model::text::forward_backward(model, in, topt, grads);
      lm_sum += r.backward.lm_loss_sum;
      for (size_t k = 0; k < r.backward.mtp_loss_sum.size(); ++k)
        mtp_sum[k] += r.backward.mtp_loss_sum[k];
      balancing += r.backward.balancing_loss;
      for (const auto& l : r.loads) {
        const int64_t* c = l.counts.data<int64_t>();
        loads.add(l.bias_name, std::span<const int64_t>(c, size_t(l.counts.numel())));
      }
    }
    if (vl) vl->step().export_grads();
    // Each rank of an sp group holds its shard's (and its heads') part of every gradient, the
    // vision tower's (its patches) included: their sum is the pack's gradient, which the dp
    // reduction below then treats as one rank's. With fsdp the decoder layers' parts were
    // reduce-scattered over dp in the backward already: the sp group's ranks hold the same slices,
    // and adding them gives each the whole step's slice.
    if (sequence_parallel) {
      dist::Communicator& sp_sum = on_gpu ? *par->sp_gpu() : par->sp();
      for (auto& [name, g] : grads.named)
        if (g.defined()) sp_sum.all_reduce(g);
      if (sharded_layers) sharded_layers->all_reduce_gradients(sp_sum);
      for (Tensor& g : vision_grads)
        if (g.defined()) par->sp().all_reduce(g);
    }
    if (distributed) {
      // The step's losses and expert loads are sums over every rank's packs, like the
      // denominators above.
      std::vector<double> sums = {lm_sum, balancing};
      sums.insert(sums.end(), mtp_sum.begin(), mtp_sum.end());
      par->world().all_reduce_sum(sums);
      lm_sum = sums[0];
      balancing = sums[1];
      std::copy(sums.begin() + 2, sums.end(), mtp_sum.begin());
      std::vector<int64_t> flat = loads.flat();
      par->world().all_reduce_sum(flat);
      loads.set_flat(flat);
    }
    if (options.on_gradients)
      options.on_gradients(st.step + 1, [&](const std::string& name) -> Tensor& {
        for (auto& [n, g] : grads.named)
          if (n == name && g.defined()) return g;
        throw_internal(__FILE__, __LINE__, fmt::format("no gradient buffer for '{}'", name));
      });
    const double lr = schedule.lr(st.step);
    const double lm_loss = lm_sum / topt.lm_denominator;
    // The decoder-layer slices' and the expert shards' parts of the global norm join the
    // replicated shards' in one sum over dp, where each of them appears once.
    const double other_sq_norm =
        (layer_optimizer ? layer_optimizer->grad_sq_norm() : 0.0) +
        (expert_optimizer ? expert_optimizer->reduce_gradients(expert_grad_list) : 0.0);
    const double grad_norm = sharded     ? sharded->reduce_gradients(grad_list, other_sq_norm)
                             : gpu_adamw ? gpu_adamw.grad_norm()
                                         : std::sqrt(optimizer.grad_sq_norm(grad_list));
    std::vector<std::string> nonfinite;
    if (!std::isfinite(lm_loss) || !std::isfinite(balancing) ||
        !std::all_of(mtp_sum.begin(), mtp_sum.end(), [](double v) { return std::isfinite(v); }))
      nonfinite.push_back("loss");
    if (!std::isfinite(grad_norm)) {
      // Gradients on a GPU are scanned from host copies, made only here.
      std::map<std::string, Tensor> host_copies;
      const std::vector<std::string> names = first_nonfinite(
          released_views(
              store, replicated_only([&](const model::InternalParam& p) -> const Tensor* {
                const auto it = optimizer_grad.find(p.name);
                const Tensor* g = it != optimizer_grad.end() ? it->second : grads.find(p.name);
                if (!g || !g->defined()) return nullptr;
                if (g->device().is_cpu()) return g;
                return &(host_copies[p.name] = g->to(Device::cpu()));
              })),
          kNonFiniteNamed);
      nonfinite.insert(nonfinite.end(), names.begin(), names.end());
      // Collective: every rank sees the same non-finite global norm.
      if (sharded_layers) {
        const std::vector<std::string> layers = sharded_layers->nonfinite(true, kNonFiniteNamed);
        nonfinite.insert(nonfinite.end(), layers.begin(), layers.end());
      }
      if (local_experts) {
        const std::vector<std::string> experts = local_experts->nonfinite(
            [&](const std::string& name) -> const Tensor* {
              const Tensor* g = grads.find(name);
              if (!g || !g->defined() || g->device().is_cpu()) return g;
              return &(host_copies[name] = g->to(Device::cpu()));
            },
            par->world(), kNonFiniteNamed);
        nonfinite.insert(nonfinite.end(), experts.begin(), experts.end());
      }
    }
    // A non-finite loss with finite gradients is skipped too: its update would rest on nothing.
    const double applied_norm =
        nonfinite.empty() ? grad_norm : std::numeric_limits<double>::quiet_NaN();
    const StepReport rep = sharded     ? sharded->step(lr, applied_norm)
                           : gpu_adamw ? gpu_adamw.step(lr, grad_norm, !nonfinite.empty())
                                       : optimizer.step(grad_list, lr, applied_norm);
    // The same norm skips or applies every update together.
    if (layer_optimizer) layer_optimizer->step(lr, applied_norm);
    if (expert_optimizer) expert_optimizer->step(lr, applied_norm);
    // The bias moves from the step's loads even when the update was skipped (docs/training.md).
    const double maxvio =
        update_router_biases(loads, recipe.router_bias_update_rate,
                             [&](const std::string& name) -> Tensor& { return store.get(name); });
    if (vl)
      vl->model().refresh(store);
    else if (on_gpu)
      refresh_router_biases(model, store);
    else
      refresh_model(model, store);
    for (const std::string& name : biases_in_store)
      sharded_layers->set_parameter(name, store.get(name));
    ++st.step;
    if (rep.skipped) ++st.skipped_steps;

    StepMetrics m;
    m.step = st.step;
    m.total_steps = total;
    m.epoch = sampler.epoch();
    m.loss = lm_loss;
    double mtp_mean = 0;
    for (size_t k = 0; k < mtp_sum.size(); ++k) mtp_mean += mtp_sum[k] / topt.mtp_denominators[k];
    m.mtp_loss = mtp_sum.empty() ? 0.0 : recipe.mtp_scale * mtp_mean / double(mtp_sum.size());
    m.balancing_loss = balancing;
    m.grad_norm = grad_norm;
    m.lr = lr;
    m.maxvio = maxvio;
    m.skipped = rep.skipped;
    m.nonfinite = nonfinite;
    const MemoryPeaks peaks = take_memory_peaks(device);
    m.max_memory = peaks.max_memory;
    m.reserved_memory = peaks.reserved_memory;
    // Throughput per rank (tgs is per GPU-second): this rank's share of the step's tokens.
    meter.record(m, batch.text_tokens / dp, batch.slots / dp, seconds_since(step_start));
    // Model FLOPs per rank and second: the step's packs (their documents, padding left out) over
    // every rank of the job.
    double step_flops = 0;
    for (const model::text::PackInput& in : batch.inputs) {
      const Tensor cu = in.cu_seqlens.to(DType::i64).contiguous();
      std::vector<int64_t> lengths;
      for (int64_t d = 0; d + 1 < cu.numel(); ++d)
        lengths.push_back(cu.data<int64_t>()[d + 1] - cu.data<int64_t>()[d]);
      if (in.padding_tokens > 0 && !lengths.empty()) lengths.pop_back();
      int64_t tokens = 0;
      for (int64_t n : lengths) tokens += n;
      step_flops += count_flops(tc, lengths, topt.mtp).step(tokens);
    }
    const int64_t ranks = distributed ? par->sizes().world : 1;
    m.model_tflops = m.step_time > 0 ? step_flops / double(ranks) / m.step_time / 1e12 : 0.0;
    if (on_gpu) m.mfu = m.model_tflops / kH200Bf16PeakTflops;
    if (on_gpu && distributed) m.comm_time = par->take_gpu_busy_seconds();
    if (log) log->write(m);
    summary.steps.push_back(m);
    summary.text_tokens += batch.text_tokens;
    if (options.on_step) options.on_step(m);
    if (!nonfinite.empty() && recipe.on_nonfinite == NonFinitePolicy::kStop)
      throw Error(fmt::format("step {}: not finite: {}; the run stops without saving this step",
                              st.step, fmt::join(nonfinite, ", ")),
                  recipe.source() + ": train.on_nonfinite",
                  "resume from the last checkpoint (--resume) with a lower optimizer.lr, or set "
                  "train.on_nonfinite = \"skip\" to skip such steps");

    bool stop = options.stop && options.stop->load();
    // A signal may reach the ranks at different steps: stop together.
    if (distributed) stop = par->world().all_reduce_max(int64_t(stop)) > 0;
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
