#include "glmtune/train/checkpointer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "glmtune/base/error.h"
#include "glmtune/model/lora.h"
#include "glmtune/train/trainer.h"

namespace glmtune::train {
namespace {

namespace fs = std::filesystem;

int64_t save_delay_ms() {
  const char* v = std::getenv(kSaveDelayEnv);
  return v ? std::atoll(v) : 0;
}

}  // namespace

Checkpointer::Checkpointer(const Recipe& recipe, const ParallelLayout& layout,
                           model::ParamStore& store, Optimizer& optimizer,
                           std::filesystem::path tokenizer_dir,
                           const io::CheckpointReader* deferred_source)
    : recipe_(recipe),
      layout_(layout),
      store_(store),
      optimizer_(optimizer),
      tokenizer_dir_(std::move(tokenizer_dir)),
      deferred_source_(deferred_source) {}

std::optional<fs::path> Checkpointer::save(TrainerState& st, const data::PackSampler& sampler,
                                           const ThroughputTotals& totals) {
  const fs::path out_dir = recipe_.output_dir;
  // The store's values are the checkpoint's: where the optimizer owns the weights elsewhere they
  // are brought up to date here, one tensor at a time.
  optimizer_.write_weights(store_);
  // Never a checkpoint of weights that are not finite (a run resumed from it could only fail).
  const std::vector<std::string> bad = optimizer_.nonfinite_weights(store_, kNonFiniteNamed);
  if (!bad.empty())
    throw Error(fmt::format("not saving step {}: the weights hold non-finite values (in {})",
                            st.step, fmt::join(bad, ", ")),
                (out_dir / kCheckpointsDir).string(),
                "check the model checkpoint the run started from, or resume from an earlier "
                "checkpoint with a lower optimizer.lr");
  st.epoch = sampler.epoch();
  st.sampler = sampler.save_state();
  st.totals = totals;
  const int64_t delay = save_delay_ms();
  model::ParamStore::WholeValue whole_value = optimizer_.weights_for_save();
  if (deferred_source_)
    // Frozen tensors held in FP8 on the device: their (unchanged) values come from the file they
    // were loaded from, dequantised, one tensor at a time, by the rank that writes (the others
    // visit the tensors for the collectives of the sharded ones only).
    whole_value = [this, held = std::move(whole_value)](const model::InternalParam& p) {
      if (p.deferred)
        return layout_.root
                   ? store_.read_elements(*deferred_source_, p.name, 0, shape_numel(p.shape))
                         .view(p.shape)
                   : Tensor();
      return held ? held(p) : p.value;
    };
  const ModelWriter writer = [&](const fs::path& dir) {
    if (store_.has_adapters()) {
      // A LoRA run saves its adapters alone, in PEFT's layout, beside where the model would go:
      // the base stays as loaded (router biases included), so the checkpoint does not copy it
      // (for the released model that would be hundreds of GB per save); a resume reads the base
      // from [model] path again.
      model::save_lora_adapter(store_, *recipe_.lora, dir.parent_path() / "adapter", whole_value,
                               recipe_.model_path);
    } else {
      if (whole_value)
        store_.save(dir, whole_value);
      else
        store_.save(dir);
      io::copy_tokenizer_files(tokenizer_dir_, dir);
    }
    if (delay > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay));
  };
  const auto t0 = std::chrono::steady_clock::now();
  std::optional<fs::path> written;
  if (layout_.root) {
    try {
      written = save_checkpoint(
                    out_dir, st, writer, [&](const fs::path& dir) { optimizer_.write_state(dir); },
                    recipe_.keep_last)
                    .dir;
    } catch (const std::exception& e) {
      if (!layout_.distributed) throw;
      layout_.par->abort(fmt::format("saving step {} failed: {}", st.step, e.what()));
    }
    spdlog::info("saved {} in {:.1f}s", written->string(),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  } else {
    if (!store_.has_adapters())
      store_.visit_for_save(whole_value);
    else if (whole_value)
      model::visit_lora_adapters(store_, whole_value);
    optimizer_.visit_state();
  }
  if (!layout_.distributed) return written;
  layout_.par->world().barrier();
  if (!layout_.root)
    if (const auto last = load_latest_checkpoint(out_dir, {.verify = false}))
      written = last->checkpoint.dir;
  return written;
}

}  // namespace glmtune::train
