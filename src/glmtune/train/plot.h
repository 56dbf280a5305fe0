#pragma once
// `glmtune plot`: the loss curves and the throughput of a training run, drawn from its
// metrics.jsonl into a PNG (docs/training.md, "Plotting a run").
//
// Two panels over the step axis: the LM loss (and the MTP loss when the run has one), with every
// skipped step marked by a vertical line; below it the throughput in tokens per second (tgs).
// Axes carry ticks at round values and labels in an embedded 5x7 bitmap font, so the image needs
// no font on the machine.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace glmtune::train {

// The fields of one metrics.jsonl record the plot uses.
struct MetricsRecord {
  int64_t step = 0;
  std::optional<double> loss;      // null in the file when not finite
  std::optional<double> mtp_loss;  // absent, null, or 0 for runs without MTP
  double tgs = 0;
  bool skipped = false;
};

// Reads a metrics.jsonl written by the trainer, sorted by step. Throws glmtune::Error naming the
// file (and the line) for a missing or empty file, a line that is not a JSON object, and a record
// without an integer "step" or with a field of the wrong type.
std::vector<MetricsRecord> read_metrics_file(const std::filesystem::path& file);

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
  bool operator==(const Rgb&) const = default;
};
inline constexpr Rgb kLossColour{31, 119, 180};
inline constexpr Rgb kMtpLossColour{255, 127, 14};
inline constexpr Rgb kThroughputColour{44, 160, 44};
inline constexpr Rgb kSkippedColour{214, 39, 40};

// Interleaved 8-bit RGB, row-major.
struct Image {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;
  Rgb at(int x, int y) const {
    const size_t i = (size_t(y) * size_t(width) + size_t(x)) * 3;
    return {rgb[i], rgb[i + 1], rgb[i + 2]};
  }
};

// Up to four other runs drawn over the first, each in its own colour.
inline constexpr Rgb kCompareColours[] = {
    {148, 103, 189}, {140, 86, 75}, {227, 119, 194}, {23, 190, 207}};

struct ComparedRun {
  std::string name;  // in the legend
  std::vector<MetricsRecord> records;
};

struct PlotOptions {
  int width = 1200;
  int height = 800;
  std::string title;  // drawn above the panels; the first run's name in the legend
  // Drawn over the first run: each one's loss in the loss panel and its throughput below, in
  // kCompareColours order (more than four is an error). Their steps widen the step axis.
  std::vector<ComparedRun> compare;
};

// Where the data lands in the image: plot areas in pixels and the value ranges they span.
struct PanelLayout {
  int left = 0, top = 0, right = 0, bottom = 0;  // inclusive pixel bounds of the plot area
  double y_min = 0, y_max = 1;
  int y_of(double value) const;
};
struct PlotLayout {
  int64_t step_min = 0, step_max = 1;
  PanelLayout loss, throughput;
  int x_of(double step) const;  // the same for both panels
};

struct Plot {
  Image image;
  PlotLayout layout;
};

// Draws the records (at least one). Throws glmtune::Error for a size below 320 x 240.
Plot render_metrics_plot(const std::vector<MetricsRecord>& records, const PlotOptions& options);

// The loss of run `a` against run `b` over the steps both logged with a finite loss, from step
// `from` on: the largest |a − b| / |b| and where, and the same at the last common step.
struct LossGap {
  int64_t steps = 0;  // common steps compared (0: none, the rest is unset)
  double worst = 0;
  int64_t worst_step = 0;
  double last = 0;
  int64_t last_step = 0;
};
LossGap loss_gap(const std::vector<MetricsRecord>& a, const std::vector<MetricsRecord>& b,
                 int64_t from = 0);

// PNG bytes of the image (8-bit RGB, libpng).
std::string encode_png(const Image& image);

}  // namespace glmtune::train
