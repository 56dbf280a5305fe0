// `glmtune plot`: draws a training run's loss curves and throughput from its metrics.jsonl into a
// PNG (docs/training.md, "Plotting a run").

#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "command.h"
#include "glmtune/base/fs.h"
#include "glmtune/train/plot.h"

namespace {

using namespace glmtune;
namespace fs = std::filesystem;

struct PlotArgs {
  std::string run;
  std::string out;
  int width = 1200;
  int height = 800;
  std::vector<std::string> compare;  // other runs drawn over the first
  int64_t gap_from = 0;              // the loss gaps printed count from this step
};

// A run directory or its metrics.jsonl: the file, and the run's name (its directory's).
std::pair<fs::path, std::string> metrics_of(const std::string& arg) {
  const fs::path run(arg);
  const bool is_file = fs::is_regular_file(run);
  const fs::path dir = fs::absolute(is_file ? run.parent_path() : run).lexically_normal();
  std::string name = dir.filename().string();
  if (name.empty()) name = dir.parent_path().filename().string();
  return {is_file ? run : run / "metrics.jsonl", name};
}

}  // namespace

GLMTUNE_COMMAND(
    plot, "plot", "Plot a training run's loss and throughput (metrics.jsonl) to a PNG",
    [](CLI::App& app) {
      auto a = std::make_shared<PlotArgs>();
      app.add_option("run", a->run, "Training output directory (or its metrics.jsonl)")->required();
      app.add_option("--out", a->out, "PNG file to write (default: RUN/metrics.png)");
      app.add_option("--width", a->width, "Image width in pixels")->capture_default_str();
      app.add_option("--height", a->height, "Image height in pixels")->capture_default_str();
      app.add_option("--compare", a->compare,
                     "Another run (directory or metrics.jsonl) drawn over the first, with the "
                     "largest relative gap between their losses printed (repeatable, up to 4)");
      app.add_option("--gap-from", a->gap_from,
                     "With --compare: the printed loss gaps count from this step on");
      return [a] {
        const auto [metrics, name] = metrics_of(a->run);
        const fs::path out =
            a->out.empty() ? metrics.parent_path() / "metrics.png" : fs::path(a->out);
        const auto records = train::read_metrics_file(metrics);
        train::PlotOptions options;
        options.width = a->width;
        options.height = a->height;
        options.title = name;
        for (const std::string& other : a->compare) {
          const auto [file, other_name] = metrics_of(other);
          options.compare.push_back({other_name, train::read_metrics_file(file)});
        }
        const train::Plot plot = train::render_metrics_plot(records, options);
        write_file_atomic(out.string(), train::encode_png(plot.image));
        int64_t skipped = 0;
        for (const auto& r : records) skipped += r.skipped ? 1 : 0;
        std::printf("wrote %s: %zu steps (%lld-%lld), %lld skipped\n", out.string().c_str(),
                    records.size(), (long long)records.front().step, (long long)records.back().step,
                    (long long)skipped);
        for (const train::ComparedRun& other : options.compare) {
          const train::LossGap gap = train::loss_gap(records, other.records, a->gap_from);
          if (gap.steps == 0) {
            std::printf("loss vs %s: no common step with a finite loss%s\n", other.name.c_str(),
                        a->gap_from > 0 ? fmt::format(" from step {}", a->gap_from).c_str() : "");
            continue;
          }
          std::printf(
              "loss vs %s: %lld common steps from step %lld; largest relative gap %.3f%% at step "
              "%lld, %.3f%% at step %lld\n",
              other.name.c_str(), (long long)gap.steps,
              (long long)std::max<int64_t>(a->gap_from, 0), 100 * gap.worst,
              (long long)gap.worst_step, 100 * gap.last, (long long)gap.last_step);
        }
        return 0;
      };
    });
