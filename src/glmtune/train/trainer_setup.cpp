#include "glmtune/train/trainer_setup.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>

#include "glmtune/base/error.h"
#include "glmtune/base/fs.h"
#include "glmtune/train/optimizer_variants.h"

namespace glmtune::train {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

model::ModelConfig read_model_config(const fs::path& dir) {
  const fs::path config_file = dir / "config.json";
  if (!fs::exists(config_file))
    throw Error("no config.json in the model directory", dir.string(),
                "point [model] path at a checkpoint (glmtune init writes one)");
  return model::ModelConfig::from_file(config_file.string());
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

// [lora]: adapters on the recipe's targets, fresh (PEFT's initialisation from train.seed) or, when
// resuming, the checkpoint's; every other parameter frozen.
void attach_lora(const Recipe& recipe, const ParallelLayout& layout, const ResumePoint* resume,
                 model::ParamStore& store) {
  const model::LoraConfig& c = *recipe.lora;
  const std::string where = recipe.source() + ": lora";
  auto refuse = [&](const std::string& what, const std::string& key, const std::string& fix) {
    throw Error(what + " with LoRA adapters is not supported yet", recipe.source() + ": " + key,
                fix);
  };
  // This also covers adapters on the routed experts under expert parallelism on GPUs, which the
  // GPU exchange does not apply (dist/expert_parallel.h); the CPU exchange does.
  if (layout.on_gpu && layout.distributed)
    refuse("training on several GPUs", "train.device",
           "train the adapters on one GPU (no mpirun), or on the CPU for multi-process layouts");
  // The sharded layer optimizer on a GPU keeps an f32-stored tensor's master in its flat, which
  // holds the layer in bf16 there: an adapter (f32 in the checkpoint, bf16 on the device) would
  // lose its master's precision.
  if (layout.on_gpu && layout.fsdp)
    refuse("fully sharded layers (train.fsdp) on a GPU", "train.fsdp",
           "leave fsdp off: the frozen base has no gradients or optimizer state, and the adapters "
           "are small");
  const std::vector<std::string> modules = model::resolve_lora_targets(store, c, where);
  if (resume) {
    const fs::path dir = resume->checkpoint.dir / "adapter";
    if (!fs::exists(dir))
      throw Error("the checkpoint to resume has no adapter: a run without [lora] wrote it",
                  resume->checkpoint.dir.string(),
                  "resume it with the recipe it was written with, or start a new run (another "
                  "output dir) with [lora] and [model] path = its model/ directory");
    const model::LoraConfig saved = model::load_lora_adapter(store, dir);
    if (saved.rank != c.rank || saved.scale() != c.scale())
      throw Error(fmt::format("the checkpoint's adapter has r = {} and scale {}, the recipe asks "
                              "for r = {} and scale {}",
                              saved.rank, saved.scale(), c.rank, c.scale()),
                  where, "resume with the [lora] settings the run started with");
    const std::vector<std::string> held = model::adapted_modules(store);
    if (held != modules)
      throw Error(fmt::format("the checkpoint's adapter is on {} projections, the recipe's "
                              "target_modules select another set of {}",
                              held.size(), modules.size()),
                  where + ".target_modules", "resume with the target_modules the run started with");
  } else {
    model::add_lora_adapters(store, c, modules, recipe.seed);
  }
  // Whole shapes: under expert parallelism the routed experts' adapters are held in slices.
  int64_t adapter_elements = 0, base_elements = 0;
  for (const model::InternalParam& p : store.params()) {
    if (p.adapter) {
      adapter_elements += shape_numel(p.shape);
      continue;
    }
    base_elements += shape_numel(p.shape);
    store.set_trainable(p.name, false);
  }
  spdlog::info(
      "lora: rank {} on {} projections, {} trainable parameters ({:.3f}% of {}), the "
      "base frozen",
      c.rank, modules.size(), adapter_elements,
      100.0 * double(adapter_elements) / double(std::max<int64_t>(base_elements, 1)),
      base_elements);
}

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

fs::path checked_tokenizer_file(const fs::path& tokenizer_dir) {
  const fs::path tokenizer_file = tokenizer_dir / "tokenizer.json";
  if (!fs::exists(tokenizer_file))
    throw Error("no tokenizer.json", tokenizer_file.string(),
                "set [model] tokenizer to the directory holding tokenizer.json");
  return tokenizer_file;
}

}  // namespace

void check_cuda_build(const Recipe& recipe) {
#ifndef GLMTUNE_WITH_CUDA
  if (recipe.device.is_cuda())
    throw Error(fmt::format("device {} asked for, but this glmtune was built without CUDA",
                            recipe.device.str()),
                recipe.source() + ": train.device",
                "set device = \"cpu\", or build with -DGLMTUNE_CUDA=ON on a machine with the CUDA "
                "toolkit");
#else
  (void)recipe;
#endif
}

std::optional<ResumePoint> prepare_output(const Recipe& recipe, const ParallelLayout& layout,
                                          bool resume) {
  const fs::path out_dir = recipe.output_dir;
  // A path that cannot hold the output fails now, not after loading everything.
  create_output_directory(out_dir, recipe.source() + ": output.dir");
  if (layout.root) {
    remove_stale_temporary_files(out_dir, {"metrics.jsonl", "recipe.toml"});
    remove_stale_temporary_files(out_dir / kCheckpointsDir, {kLatestFile});
  }
  // Resume point, decided before anything heavy is loaded: the newest checkpoint that verifies.
  std::optional<ResumePoint> point;
  if (resume) {
    LoadCheckpointOptions load;
    load.set_aside_failed = layout.root;
    point = load_latest_checkpoint(out_dir, load);
    if (!point)
      spdlog::info("no complete checkpoint under {}: starting from step 0",
                   (out_dir / kCheckpointsDir).string());
  } else if (!complete_checkpoint_steps(out_dir).empty()) {
    throw Error("the output directory already holds checkpoints of a run",
                (out_dir / kCheckpointsDir).string(),
                "pass --resume to continue that run, or choose another [output] dir");
  }
  if (layout.distributed) {
    const int64_t step = point ? point->state.step : -1;
    dist::Communicator& world = layout.par->world();
    if (world.all_reduce_max(step) != step || -world.all_reduce_max(-step) != step)
      throw Error("the ranks found different checkpoints to resume from",
                  (out_dir / kCheckpointsDir).string(),
                  "put [output] dir on a file system that every rank shares");
  }
  return point;
}

TrainingData::TrainingData(const Recipe& recipe, const fs::path& tokenizer_dir)
    : tokenizer_file_(checked_tokenizer_file(tokenizer_dir)),
      tokenizer_(data::Tokenizer::from_file(tokenizer_file_.string())) {
  const int32_t pad_id = tokenizer_.require_id("<|endoftext|>");
  const auto data_start = Clock::now();
  int64_t data_tokens = 0, trained_tokens = 0;
  if (!recipe.media_root.empty()) {
    // Vision-language data (data.media_root set): conversations with images and videos.
    vl_ = std::make_unique<VlTraining>(recipe, tokenizer_dir);
    if (vl_->dataset().size() == 0)
      throw Error("no usable sample in the data", recipe.source() + ": data.files",
                  "check the conversations and their media (docs/vision.md)");
    data_tokens = vl_->dataset().stats().tokens;
    trained_tokens = vl_->dataset().stats().trained_tokens;
  } else if (!recipe.data_cache.empty()) {
    cache_.emplace(open_cache(recipe, tokenizer_file_));
    data_tokens = cache_->num_tokens();
    trained_tokens = cache_->num_trained_tokens();
  } else {
    dataset_.emplace(data::JsonlDataset::scan(recipe.dataset_config(), tokenizer_));
    if (dataset_->size() == 0)
      throw Error("no usable sample in the data", recipe.source() + ": data.files",
                  "check the files' format (docs/data.md)");
    data_tokens = dataset_->stats().tokens;
    trained_tokens = dataset_->stats().trained_tokens;
  }
  const data::SampleSource& source = vl_ ? static_cast<const data::SampleSource&>(vl_->dataset())
                                     : cache_ ? static_cast<const data::SampleSource&>(*cache_)
                                              : *dataset_;
  sampler_.emplace(source, recipe.packing_config(pad_id));
  spdlog::info("data: {} samples, {} tokens ({} trained) in {:.1f}s; {} packs of {} per epoch",
               source.size(), data_tokens, trained_tokens,
               std::chrono::duration<double>(Clock::now() - data_start).count(),
               sampler_->packs_in_epoch(), recipe.pack_max_length);
  // Only the first bad lines were logged one by one while reading; the totals come once.
  if (const data::DatasetStats* read = vl_        ? &vl_->dataset().stats()
                                       : dataset_ ? &dataset_->stats()
                                                  : nullptr;
      read && read->skipped_total() > 0)
    spdlog::warn("data: {}", read->skipped_report());
}

TrainingWeights load_weights(const Recipe& recipe, ParallelLayout& layout,
                             const ResumePoint* resume, const TrainingData& data) {
  // A LoRA checkpoint has no model/: its base is [model] path, unchanged by the run.
  if (resume && !recipe.lora && fs::exists(resume->checkpoint.dir / "adapter"))
    throw Error("the checkpoint to resume holds a LoRA adapter, and the recipe has no [lora]",
                resume->checkpoint.dir.string(),
                "resume with the recipe's [lora] section as the run started, or merge the "
                "adapter (glmtune merge) and start a new run from the merged model");
  const fs::path weights_dir = resume && fs::exists(resume->checkpoint.model_dir())
                                   ? resume->checkpoint.model_dir()
                                   : fs::path(recipe.model_path);
  model::ModelConfig config = read_model_config(weights_dir);
  layout.plan_experts(recipe, config.text().n_routed_experts);
  const int64_t num_layers = config.text().num_hidden_layers;
  // With fsdp the decoder layers' tensors are not read here: the store holds placeholders and each
  // rank reads only the elements of its slices from the mapped checkpoint once the layout is known
  // (parallelize). The router correction biases stay whole: the bias rule updates them in the
  // store. So do the routed-expert slices of expert parallelism: they differ per ep rank, so they
  // stay out of the dp layout and are loaded (this rank's experts) and trained as without fsdp.
  std::optional<io::CheckpointReader> reader = io::CheckpointReader::open(weights_dir);
  const bool expert_sharded = layout.expert_sharded;
  const auto sliced_later = [&](const std::string& name) {
    return in_decoder_layer(name, num_layers) && !name.ends_with("e_score_correction_bias") &&
           !(expert_sharded && model::is_fused_expert_tensor(name));
  };
  // lora.base = "fp8" (or train.frozen_weights = "fp8"): the base's (the frozen tensors') FP8
  // decoder-layer weights are not dequantised here either; they go to the device as codes and
  // scales (hold_fp8_base). Every FP8 tensor is deferred first; the ones the run trains are read
  // once the freeze patterns have said which they are.
  const bool fp8_base = recipe.lora && recipe.lora->fp8_base;
  const bool fp8_frozen = recipe.frozen_fp8;
  const std::string fp8_key = fp8_base ? "lora.base" : "train.frozen_weights";
  // Under expert parallelism each rank holds its own experts' codes (model/text/fp8_layers.h);
  // a checkpoint reads the frozen experts back from the file.
  if ((fp8_base || fp8_frozen) && layout.fsdp)
    throw Error(
        fmt::format("{} = \"fp8\" with train.fsdp: FP8 tensors are held whole by each "
                    "process, not in slices",
                    fp8_key),
        recipe.source() + ": " + fp8_key,
        fmt::format("write {} = \"bf16\", or drop fsdp", fp8_key.substr(fp8_key.find('.') + 1)));
  const auto held_in_fp8 = [&](const std::string& name) {
    return model::text::stored_in_fp8(*reader, name, num_layers);
  };
  model::ParamStore store = model::ParamStore::load(
      *reader, config, layout.expert_range(),
      layout.fsdp              ? std::function<bool(const std::string&)>(sliced_later)
      : fp8_base || fp8_frozen ? std::function<bool(const std::string&)>(held_in_fp8)
                               : nullptr);
  // The checkpoint mapping is read-only; the optimizer and the bias update write in place.
  make_params_writable(store);
  if (!layout.fsdp && !fp8_base && !fp8_frozen) reader.reset();
  VlTraining* vl = data.vl();
  if (recipe.lora) attach_lora(recipe, layout, resume, store);
  const FreezePlan freeze = freeze_parameters(recipe, store, vl != nullptr);
  if (fp8_frozen)
    for (const model::InternalParam& p : store.params())
      if (p.deferred && p.trainable) store.load_deferred(*reader, p.name);
  // Under [lora] the tower and projector are part of the frozen base.
  if (vl) vl->freeze(freeze.vision_tower || recipe.lora, freeze.projector || recipe.lora);
  if (data.tokenizer().vocab_size() > store.config().text().vocab_size)
    throw Error(fmt::format("the tokenizer has {} tokens but the model only {}",
                            data.tokenizer().vocab_size(), store.config().text().vocab_size),
                data.tokenizer_file().string(), "use the tokenizer that came with the checkpoint");
  return TrainingWeights{std::move(config), std::move(reader), std::move(store)};
}

PieceReader TrainingWeights::read_piece() const {
  return [this](const std::string& name, int64_t begin, int64_t count) {
    const model::InternalParam& p = store.param(name);
    return p.deferred ? store.read_elements(*reader, name, begin, count)
                      : p.value.reshape({-1}).narrow(0, begin, count).clone();
  };
}

void hold_fp8_base(const Recipe& recipe, ParallelLayout& layout, TrainingWeights& weights,
                   model::text::TextModel& model, model::text::TrainOptions& train) {
  if (!weights.reader || layout.fsdp) return;
  const bool any = std::any_of(weights.store.params().begin(), weights.store.params().end(),
                               [](const model::InternalParam& p) { return p.deferred; });
  const char* key = weights.store.has_adapters() ? "lora.base" : "train.frozen_weights";
  if (!any) {
    spdlog::warn(
        "{} = \"fp8\": the checkpoint stores no frozen decoder-layer weight in FP8; the "
        "weights are held as stored",
        key);
    return;
  }
  layout.fp8_base.emplace(model.weights(), weights.store, *weights.reader, recipe.fp8_tilewise);
  train.layer_params = &*layout.fp8_base;
  train.mtp_params = &*layout.fp8_base;
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  spdlog::info(
      "{} = \"fp8\": {} frozen layer tensors held in FP8 on {}: {:.2f} GiB ({:.2f} "
      "GiB in bf16), dequantised per layer around each use unless only FP8 GEMMs read them",
      key, layout.fp8_base->tensors(), model.weights().device.str(),
      double(layout.fp8_base->held_bytes()) / kGiB, double(layout.fp8_base->bf16_bytes()) / kGiB);
  if (recipe.fp8_tilewise)
    spdlog::info(
        "train.fp8 = \"tilewise\": the FP8 GEMMs read the released codes and scales of {} frozen "
        "weights (an expert's slice counted as one); {} held tensors are read by FP8 GEMMs alone "
        "and never dequantised",
        layout.fp8_base->fed_weights(), layout.fp8_base->codes_only_tensors());
}

model::text::TextModel& build_model(const Recipe& recipe, const ParallelLayout& layout,
                                    const model::ParamStore& store, VlTraining* vl,
                                    std::optional<model::text::TextModel>& text_model) {
  if (vl && layout.on_gpu && layout.distributed)
    throw Error(
        "vision-language training on GPUs runs on one GPU in this version: the vision tower's "
        "gradients and sequence parallel exchanges are not wired to NCCL yet",
        recipe.source() + ": train.device",
        "train on one GPU (no mpirun), or on the CPU for data-parallel vision-language runs");
  if (vl) {
    // On a GPU the text model and the tower both live there (bf16), and the device optimizer
    // updates both in place.
    vl->load_model(store, layout.on_gpu ? model::text::TextModelOptions{DType::bf16, layout.device}
                                        : model::text::TextModelOptions{});
    return vl->model().text();
  }
  if (layout.on_gpu)
    // bf16 weights on the device (fp32-kept parameters in f32). On one GPU the optimizer updates
    // them in place; a distributed GPU run's sharded optimizers update their shards on the device
    // and all-gather the weights into it.
    text_model.emplace(store, model::text::TextModelOptions{DType::bf16, layout.device});
  else
    text_model.emplace(store);
  return *text_model;
}

model::text::TrainOptions train_options(const Recipe& recipe, const model::text::TextModel& model,
                                        int64_t dp) {
  const model::TextConfig& tc = model.text();
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
  return topt;
}

TrainerState start_state(const Recipe& recipe, int64_t dp, const ResumePoint* resume,
                         data::PackSampler& sampler, TrainSummary& summary) {
  TrainerState st;
  st.seed = recipe.seed;
  st.recipe_fingerprint = recipe.fingerprint(dp);
  if (!resume) return st;
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
  return st;
}

void log_start(const Recipe& recipe, const ParallelLayout& layout,
               const model::text::TrainOptions& train, const model::TextConfig& tc,
               int64_t total_steps, int64_t start_step) {
  const dist::ParallelContext* par = layout.par;
  if (layout.distributed)
    spdlog::info(
        "distributed: {} ranks, data parallel over {} (rank {}){}{}, optimizer sharded{}{}",
        par->sizes().world, layout.dp, par->rank(),
        layout.on_gpu ? fmt::format(" on {} (gradients over NCCL)", layout.device.str())
                      : std::string(),
        layout.sequence_parallel ? fmt::format(", sequence parallel over {} (shard {})",
                                               par->sizes().sp, par->sp().rank())
                                 : std::string(),
        layout.experts
            ? fmt::format(", experts {}..{} of {} here (ep_size {})",
                          layout.experts->first_expert(),
                          layout.experts->first_expert() + layout.experts->local_experts() - 1,
                          tc.n_routed_experts, par->sizes().ep)
            : std::string(),
        layout.layers ? ", decoder-layer weights sharded (fsdp)" : "");
  const auto layers_with = [&](model::text::ActivationPolicy policy) {
    return std::count(train.activations.begin(), train.activations.end(), policy);
  };
  const auto offloaded = layers_with(model::text::ActivationPolicy::offload);
  spdlog::info(
      "training {} steps from step {} ({} packs of {} tokens per step, lr {} -> {}, "
      "{} of {} layers recomputed, {} offloaded{})",
      total_steps, start_step, recipe.micro_packs, recipe.pack_max_length, recipe.lr, recipe.lr_min,
      layers_with(model::text::ActivationPolicy::recompute), tc.num_hidden_layers, offloaded,
      offloaded > 0 && !layout.on_gpu ? "; on the CPU offloaded layers are kept" : "");
}

}  // namespace glmtune::train
