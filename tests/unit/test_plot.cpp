// `glmtune plot`: metrics.jsonl in, PNG out. The image is decoded back and the curves are found
// where the data puts them; malformed metrics files are errors naming the file and line.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/data/media/image.h"
#include "glmtune/train/metrics.h"
#include "glmtune/train/plot.h"
#include "support/temp_dir.h"

using namespace glmtune;
using namespace glmtune::train;
namespace fs = std::filesystem;
using glmtune::test::TempDir;

namespace {

constexpr int64_t kSteps = 40;
constexpr int64_t kSkippedStep = 20;

double loss_at(int64_t s) { return 5.0 - 0.1 * double(s); }
double mtp_at(int64_t s) { return 0.9 - 0.01 * double(s); }
double tgs_at(int64_t s) { return 1000.0 + 25.0 * double(s); }

// A run's metrics.jsonl as the trainer writes it (StepMetrics::to_json), with one skipped step
// whose loss is not finite.
void write_run(const fs::path& dir) {
  fs::create_directories(dir);
  std::ofstream out(dir / "metrics.jsonl");
  for (int64_t s = 1; s <= kSteps; ++s) {
    StepMetrics m;
    m.step = s;
    m.total_steps = kSteps;
    m.loss = s == kSkippedStep ? NAN : loss_at(s);
    m.mtp_loss = s == kSkippedStep ? NAN : mtp_at(s);
    m.tgs = tgs_at(s);
    m.skipped = s == kSkippedStep;
    if (m.skipped) m.nonfinite = {"loss"};
    out << m.to_json().dump() << "\n";
  }
}

std::vector<uint8_t> read_bytes(const fs::path& p) {
  const std::string s = glmtune::test::read_text(p);
  return {s.begin(), s.end()};
}

bool is(const data::media::RgbImage& img, int x, int y, Rgb c) {
  const size_t i = (size_t(y) * size_t(img.width) + size_t(x)) * 3;
  return img.pixels[i] == c.r && img.pixels[i + 1] == c.g && img.pixels[i + 2] == c.b;
}

// Rows of column x inside [top, bottom] painted `c`.
std::vector<int> rows_of(const data::media::RgbImage& img, int x, int top, int bottom, Rgb c) {
  std::vector<int> rows;
  for (int y = top; y <= bottom; ++y)
    if (is(img, x, y, c)) rows.push_back(y);
  return rows;
}

double mean(const std::vector<int>& v) {
  double s = 0;
  for (int x : v) s += x;
  return v.empty() ? NAN : s / double(v.size());
}

int run_cli(const std::string& args, const fs::path& log) {
  const std::string cmd =
      std::string(GLMTUNE_BINARY) + " plot " + args + " > " + log.string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace

TEST(Plot, CurvesLandWhereTheDataSays) {
  TempDir dir("plot");
  write_run(dir.path());
  ASSERT_EQ(run_cli(dir.path().string(), dir / "log.txt"), 0) << test::read_text(dir / "log.txt");
  EXPECT_NE(test::read_text(dir / "log.txt").find("40 steps (1-40), 1 skipped"), std::string::npos);
  const data::media::RgbImage img =
      data::media::decode_image(read_bytes(dir / "metrics.png"), "metrics.png");
  ASSERT_EQ(img.width, 1200);
  ASSERT_EQ(img.height, 800);

  // The PNG holds exactly the rendered pixels.
  const Plot plot = render_metrics_plot(read_metrics_file(dir / "metrics.jsonl"),
                                        {1200, 800, dir.path().filename().string()});
  ASSERT_TRUE(plot.image.rgb == img.pixels) << "the PNG differs from the rendered image";
  const PlotLayout& L = plot.layout;
  EXPECT_EQ(L.step_min, 1);
  EXPECT_EQ(L.step_max, kSteps);

  // Each drawn step's loss pixel sits at the height its value maps to, in every series.
  for (int64_t s = 2; s < kSteps; s += 3) {
    if (std::abs(s - kSkippedStep) <= 1) continue;
    const int x = L.x_of(double(s));
    const auto loss_rows = rows_of(img, x, L.loss.top, L.loss.bottom, kLossColour);
    ASSERT_FALSE(loss_rows.empty()) << "no loss pixel at step " << s;
    EXPECT_NEAR(mean(loss_rows), L.loss.y_of(loss_at(s)), 3.0) << "step " << s;
    const auto mtp_rows = rows_of(img, x, L.loss.top, L.loss.bottom, kMtpLossColour);
    ASSERT_FALSE(mtp_rows.empty()) << "no mtp_loss pixel at step " << s;
    EXPECT_NEAR(mean(mtp_rows), L.loss.y_of(mtp_at(s)), 3.0) << "step " << s;
    const auto tgs_rows = rows_of(img, x, L.throughput.top, L.throughput.bottom, kThroughputColour);
    ASSERT_FALSE(tgs_rows.empty()) << "no throughput pixel at step " << s;
    EXPECT_NEAR(mean(tgs_rows), L.throughput.y_of(tgs_at(s)), 3.0) << "step " << s;
  }

  // Independently of the layout: the falling loss runs from high on the left to low on the
  // right, the rising throughput the other way.
  const int left_x = L.loss.left + 20, right_x = L.loss.right - 20;
  const double loss_left = mean(rows_of(img, left_x, L.loss.top, L.loss.bottom, kLossColour));
  const double loss_right = mean(rows_of(img, right_x, L.loss.top, L.loss.bottom, kLossColour));
  EXPECT_LT(loss_left + 200, loss_right) << "loss should fall across the panel";
  const double tgs_left =
      mean(rows_of(img, left_x, L.throughput.top, L.throughput.bottom, kThroughputColour));
  const double tgs_right =
      mean(rows_of(img, right_x, L.throughput.top, L.throughput.bottom, kThroughputColour));
  EXPECT_GT(tgs_left, tgs_right + 20) << "throughput should rise across the panel";

  // The skipped step: a marker in both panels, and the loss line broken there.
  const int xs = L.x_of(double(kSkippedStep));
  EXPECT_GT(rows_of(img, xs, L.loss.top, L.loss.bottom, kSkippedColour).size(), 50u);
  EXPECT_GT(rows_of(img, xs, L.throughput.top, L.throughput.bottom, kSkippedColour).size(), 20u);
  EXPECT_TRUE(rows_of(img, xs, L.loss.top, L.loss.bottom, kLossColour).empty());

  // Text (axis labels, ticks, title) is drawn: dark pixels left of the plot area.
  int text_pixels = 0;
  for (int y = L.loss.top; y <= L.loss.bottom; ++y)
    for (int x = 0; x < L.loss.left - 8; ++x) text_pixels += is(img, x, y, {40, 40, 40}) ? 1 : 0;
  EXPECT_GT(text_pixels, 200);
}

TEST(Plot, OutFlagAndSingleStep) {
  TempDir dir("plot1");
  std::ofstream(dir / "metrics.jsonl") << R"({"step": 1, "loss": 2.5, "tgs": 100})"
                                       << "\n";
  const fs::path png = dir / "sub.png";
  ASSERT_EQ(run_cli((dir / "metrics.jsonl").string() + " --out " + png.string(), dir / "log"), 0)
      << test::read_text(dir / "log");
  const auto img = data::media::decode_image(read_bytes(png), "sub.png");
  const Plot plot = render_metrics_plot(read_metrics_file(dir / "metrics.jsonl"),
                                        {1200, 800, dir.path().filename().string()});
  ASSERT_TRUE(plot.image.rgb == img.pixels) << "the PNG differs from the rendered image";
  const int x = plot.layout.x_of(1.0);
  const auto rows = rows_of(img, x, plot.layout.loss.top, plot.layout.loss.bottom, kLossColour);
  ASSERT_FALSE(rows.empty()) << "a one-step run still shows its point";
  EXPECT_NEAR(mean(rows), plot.layout.loss.y_of(2.5), 3.0);
  EXPECT_FALSE(fs::exists(dir / "metrics.png"));
}

// --compare draws another run's loss and throughput over the first in a colour of its own, on a
// step axis that spans both, and prints the largest relative gap between the two losses.
TEST(Plot, CompareDrawsTheOtherRunAndPrintsTheLossGap) {
  // The other run's loss drifts away from the first's: 0.1% per step.
  const auto other_loss = [](int64_t s) { return (1 + 0.001 * double(s)) * loss_at(s); };
  TempDir dir("plotcmp");
  write_run(dir / "a");
  fs::create_directories(dir / "b");
  {
    std::ofstream out(dir / "b" / "metrics.jsonl");
    for (int64_t s = 1; s <= kSteps + 10; ++s)
      out << nlohmann::json{{"step", s}, {"loss", other_loss(s)}, {"tgs", 500.0}}.dump() << "\n";
  }
  ASSERT_EQ(run_cli((dir / "a").string() + " --compare " + (dir / "b").string() +
                        " --gap-from 5 --out " + (dir / "cmp.png").string(),
                    dir / "log"),
            0)
      << test::read_text(dir / "log");
  // Steps 5 to 40 of run a, less its skipped step 20: 35 common steps, the widest gap the last,
  // 0.04 / 1.04.
  EXPECT_NE(
      test::read_text(dir / "log")
          .find("loss vs b: 35 common steps from step 5; largest relative gap 3.846% at step 40, "
                "3.846% at step 40"),
      std::string::npos)
      << test::read_text(dir / "log");

  PlotOptions options{1200, 800, "a"};
  options.compare.push_back({"b", read_metrics_file(dir / "b" / "metrics.jsonl")});
  const Plot plot = render_metrics_plot(read_metrics_file(dir / "a" / "metrics.jsonl"), options);
  const auto img = data::media::decode_image(read_bytes(dir / "cmp.png"), "cmp.png");
  ASSERT_TRUE(plot.image.rgb == img.pixels) << "the PNG differs from the rendered image";
  const PlotLayout& L = plot.layout;
  EXPECT_EQ(L.step_max, kSteps + 10);
  for (int64_t s : {3, 31, 47}) {
    const int x = L.x_of(double(s));
    const auto rows = rows_of(img, x, L.loss.top, L.loss.bottom, kCompareColours[0]);
    ASSERT_FALSE(rows.empty()) << "no compared loss pixel at step " << s;
    EXPECT_NEAR(mean(rows), L.loss.y_of(other_loss(s)), 3.0) << "step " << s;
    const auto tgs = rows_of(img, x, L.throughput.top, L.throughput.bottom, kCompareColours[0]);
    ASSERT_FALSE(tgs.empty()) << "no compared throughput pixel at step " << s;
    EXPECT_NEAR(mean(tgs), L.throughput.y_of(500.0), 3.0) << "step " << s;
  }
  // The first run ends at its last step.
  EXPECT_TRUE(
      rows_of(img, L.x_of(double(kSteps + 5)), L.loss.top, L.loss.bottom, kLossColour).empty());

  const LossGap gap =
      loss_gap(read_metrics_file(dir / "a" / "metrics.jsonl"), options.compare[0].records, 0);
  EXPECT_EQ(gap.steps, kSteps - 1);
  EXPECT_NEAR(gap.worst, 0.04 / 1.04, 1e-12);
  EXPECT_EQ(gap.worst_step, kSteps);

  options.compare.assign(5, options.compare[0]);
  EXPECT_THROW(render_metrics_plot(read_metrics_file(dir / "a" / "metrics.jsonl"), options), Error);
}

TEST(Plot, BadMetricsFilesNameFileAndLine) {
  TempDir dir("plotbad");
  auto expect_error = [&](const std::string& content, const std::string& where_part,
                          const std::string& what_part) {
    const fs::path f = dir / "metrics.jsonl";
    std::ofstream(f) << content;
    try {
      read_metrics_file(f);
      ADD_FAILURE() << "accepted: " << content;
    } catch (const Error& e) {
      EXPECT_NE(e.where().find(where_part), std::string::npos) << e.what();
      EXPECT_NE(e.problem().find(what_part), std::string::npos) << e.what();
    }
  };
  expect_error("", "metrics.jsonl", "no step");
  expect_error("\n\n", "metrics.jsonl", "no step");
  expect_error("{\"step\": 1, \"loss\": 2}\n{\"step\": 2, \"loss\": 2", "metrics.jsonl:2",
               "not a JSON object");
  expect_error("{\"step\": 1, \"loss\": 2}\n[1, 2]\n", "metrics.jsonl:2", "not a JSON object");
  expect_error("{\"loss\": 2}\n", "metrics.jsonl:1", "\"step\"");
  expect_error("{\"step\": 1}\n", "metrics.jsonl:1", "\"loss\"");
  expect_error("{\"step\": 1, \"loss\": \"high\"}\n", "metrics.jsonl:1", "\"loss\"");
  expect_error("{\"step\": 1, \"loss\": 1, \"skipped\": 3}\n", "metrics.jsonl:1", "\"skipped\"");
  try {
    read_metrics_file(dir / "absent" / "metrics.jsonl");
    ADD_FAILURE() << "a missing file was accepted";
  } catch (const Error& e) {
    EXPECT_NE(e.where().find("absent"), std::string::npos);
  }
  // The command reports the same and writes nothing.
  fs::create_directories(dir / "empty-run");
  EXPECT_NE(run_cli((dir / "empty-run").string(), dir / "log"), 0);
  EXPECT_NE(test::read_text(dir / "log").find("metrics.jsonl"), std::string::npos);
  EXPECT_FALSE(fs::exists(dir / "empty-run" / "metrics.png"));
}
