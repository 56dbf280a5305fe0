// `glmtune plot`: draws a training run's loss curves and throughput from its metrics.jsonl into a
// PNG (docs/training.md, "Plotting a run").

#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

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
};

}  // namespace

GLMTUNE_COMMAND(
    plot, "plot", "Plot a training run's loss and throughput (metrics.jsonl) to a PNG",
    [](CLI::App& app) {
      auto a = std::make_shared<PlotArgs>();
      app.add_option("run", a->run, "Training output directory (or its metrics.jsonl)")->required();
      app.add_option("--out", a->out, "PNG file to write (default: RUN/metrics.png)");
      app.add_option("--width", a->width, "Image width in pixels")->capture_default_str();
      app.add_option("--height", a->height, "Image height in pixels")->capture_default_str();
      return [a] {
        const fs::path run(a->run);
        const bool is_file = fs::is_regular_file(run);
        const fs::path metrics = is_file ? run : run / "metrics.jsonl";
        const fs::path dir = is_file ? run.parent_path() : run;
        const fs::path out = a->out.empty() ? dir / "metrics.png" : fs::path(a->out);
        const auto records = train::read_metrics_file(metrics);
        train::PlotOptions options;
        options.width = a->width;
        options.height = a->height;
        options.title = fs::absolute(dir).lexically_normal().filename().string();
        if (options.title.empty())
          options.title = fs::absolute(dir).lexically_normal().parent_path().filename().string();
        const train::Plot plot = train::render_metrics_plot(records, options);
        write_file_atomic(out.string(), train::encode_png(plot.image));
        int64_t skipped = 0;
        for (const auto& r : records) skipped += r.skipped ? 1 : 0;
        std::printf("wrote %s: %zu steps (%lld-%lld), %lld skipped\n", out.string().c_str(),
                    records.size(), (long long)records.front().step, (long long)records.back().step,
                    (long long)skipped);
        return 0;
      };
    });
