// libFuzzer entry: arbitrary bytes as a training recipe (TOML). Every input must either be
// rejected with a glmtune::Error or give a recipe whose effective TOML (to_toml, what a run
// writes next to its checkpoints) parses back to the same recipe, and whose derived settings
// (run length, warmup, learning-rate schedule) are computed without overflow: the schedule either
// refuses the combination with a glmtune::Error or gives finite rates in [0, lr]. Anything else
// escaping (a crash, a sanitizer report, toml++'s or another exception) is a bug.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

#include "fuzz_util.h"
#include "glmtune/base/error.h"
#include "glmtune/train/recipe.h"
#include "glmtune/train/schedule.h"

using glmtune::fuzz::bug;
using glmtune::train::Recipe;
using glmtune::train::Schedule;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::optional<Recipe> recipe;
  try {
    recipe.emplace(Recipe::parse(text, "fuzz.toml"));
  } catch (const glmtune::Error& e) {
    if (e.where().empty()) bug("a rejected recipe does not say where");
    return 0;
  }
  const Recipe& r = *recipe;

  // The effective recipe is written with every run; it must read back as the same recipe.
  const std::string effective = r.to_toml();
  try {
    const Recipe again = Recipe::parse(effective, "effective.toml");
    if (again.to_toml() != effective) bug("to_toml is not a fixed point");
    if (again.fingerprint() != r.fingerprint()) bug("the effective recipe has another fingerprint");
  } catch (const glmtune::Error& e) {
    bug("the effective recipe (to_toml) does not parse back");
  }

  (void)r.dataset_config();
  (void)r.packing_config(0);
  (void)r.adamw_config();
  (void)r.fingerprint(int64_t(1 + size % 7));

  // Run length from epochs needs the packs per epoch and the data-parallel ranks.
  const int64_t packs_per_epoch = 1 + int64_t(size % 1000);
  const int64_t ranks = 1 + int64_t(size / 1000 % 8);
  int64_t total;
  try {
    total = r.resolve_total_steps(packs_per_epoch, ranks);
  } catch (const glmtune::Error&) {
    return 0;  // more steps than an int64 counts: refused, naming train.epochs
  }
  if (total < 1) bug("a run of no steps");
  const int64_t warmup = r.resolve_warmup_steps(total);
  if (warmup < 0) bug("a negative warmup");
  try {
    const Schedule s = r.schedule(total);
    for (int64_t step : {int64_t{0}, warmup / 2, warmup, (warmup + total) / 2, total - 1, total}) {
      const double lr = s.lr(step);
      if (!std::isfinite(lr) || lr < 0 || lr > r.lr * (1 + 1e-12))
        bug("a learning rate outside [0, lr]");
    }
  } catch (const glmtune::Error&) {
    // e.g. a warmup of 10 steps for a run that turns out to have 5: refused at start, with a fix
  }
  return 0;
}
