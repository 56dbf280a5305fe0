#include "glmtune/train/trainer.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <memory>
#include <optional>

#include "glmtune/base/fs.h"
#include "glmtune/train/checkpointer.h"
#include "glmtune/train/parallelize.h"
#include "glmtune/train/schedule.h"
#include "glmtune/train/step_loop.h"
#include "glmtune/train/trainer_optimizer.h"
#include "glmtune/train/trainer_setup.h"

namespace glmtune::train {

namespace fs = std::filesystem;

TrainSummary run_training(const Recipe& recipe, const TrainerOptions& options) {
  check_cuda_build(recipe);
  const fs::path out_dir = recipe.output_dir;
  const fs::path tok_dir =
      recipe.tokenizer_path.empty() ? fs::path(recipe.model_path) : fs::path(recipe.tokenizer_path);
  TrainSummary summary;
  summary.metrics = out_dir / "metrics.jsonl";
  ParallelLayout layout(recipe, options.parallel);
  const std::optional<ResumePoint> resume = prepare_output(recipe, layout, options.resume);
  const ResumePoint* resume_point = resume ? &*resume : nullptr;
  TrainingData data(recipe, tok_dir);
  VlTraining* const vl = data.vl();
  if (vl) vl->set_prefetch(options.prefetch_media);

  // The weights, then the optimizer that owns them from here on (trainer_optimizer.h), restored
  // from the checkpoint before the model is built from the store.
  TrainingWeights weights = load_weights(recipe, layout, resume_point, data);
  model::ParamStore& store = weights.store;
  layout.hold_experts(store);
  const int64_t num_layers = weights.config.text().num_hidden_layers;
  OptimizerSetup setup;
  setup.recipe = &recipe;
  setup.store = &store;
  setup.vl = vl;
  setup.device = layout.device;
  setup.dp_group = layout.dp_group;
  setup.device_dp_group = layout.device_dp_group;
  setup.parallel = layout.par;
  setup.local_experts = layout.local_experts ? &*layout.local_experts : nullptr;
  setup.fsdp = layout.fsdp;
  setup.num_layers = num_layers;
  setup.resume = resume_point;
  const std::unique_ptr<Optimizer> optimizer = make_optimizer(setup);
  TrainerState st = start_state(recipe, layout.dp, resume_point, data.sampler(), summary);

  std::optional<model::text::TextModel> text_model;
  model::text::TextModel& model = build_model(recipe, layout, store, vl, text_model);
  if (recipe.fp8_tilewise) {
    if (layout.sequence_parallel)
      dist::check_fp8_head_slices(model.text(), recipe.sp_size, recipe.source() + ": train.fp8");
    const int64_t n = model::text::use_fp8_gemms(model.weights(), layout.on_gpu ? 16 : 0);
    spdlog::info("train.fp8 = \"tilewise\": {} projections run their GEMMs in block-scaled FP8", n);
  }
  const int64_t total = recipe.resolve_total_steps(data.sampler().packs_in_epoch(), layout.dp);
  const Schedule schedule = recipe.schedule(total);
  st.total_steps = total;
  summary.start_step = st.step;
  summary.total_steps = total;

  model::text::TrainOptions topt = train_options(recipe, model, layout.dp);
  model::text::TextGrads grads = model::text::TextGrads::zeros_like(model.weights());
  optimizer->attach(model, grads);
  parallelize(layout, recipe, model, grads, topt, store, weights.read_piece(), num_layers);
  hold_fp8_base(recipe, layout, weights, model, topt);
  if (layout.layers) optimizer->shard_layers(*layout.layers, weights.read_piece());
  // A full fine-tuning run that holds frozen FP8 tensors saves their values from the file.
  const bool saves_deferred = layout.fp8_base && !store.has_adapters();
  if (!saves_deferred) weights.reader.reset();
  optimizer->log_memory(model, grads);

  if (layout.root) write_file_atomic((out_dir / "recipe.toml").string(), recipe.to_toml());
  ThroughputMeter meter(st.totals);
  std::optional<MetricsLog> log;
  if (layout.root)
    log.emplace(out_dir, st.step, options.print_steps ? recipe.log_every : (int64_t(1) << 62));
  log_start(recipe, layout, topt, model.text(), total, st.step);

  Checkpointer checkpointer(recipe, layout, store, *optimizer, tok_dir,
                            saves_deferred ? &*weights.reader : nullptr);
  TrainingRun run{recipe,
                  options,
                  layout,
                  store,
                  model,
                  grads,
                  topt,
                  *optimizer,
                  vl,
                  data.sampler(),
                  schedule,
                  meter,
                  log ? &*log : nullptr,
                  checkpointer,
                  st,
                  summary};
  const auto run_start = std::chrono::steady_clock::now();
  run_steps(run);
  if (summary.checkpoint.empty()) {
    // Nothing left to run (resumed at the end): the latest checkpoint is the result.
    if (const auto last = load_latest_checkpoint(out_dir))
      summary.checkpoint = last->checkpoint.dir;
  }
  summary.end_step = st.step;
  summary.skipped_steps = st.skipped_steps;
  summary.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
  return summary;
}

}  // namespace glmtune::train
