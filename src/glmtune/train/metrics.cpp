#include "glmtune/train/metrics.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cmath>
#include <cstring>
#include <sstream>

#include "glmtune/base/error.h"
#include "glmtune/base/fs.h"
#include "glmtune/tensor/allocator.h"

namespace glmtune::train {
namespace {

nlohmann::json finite_or_null(double v) { return std::isfinite(v) ? nlohmann::json(v) : nullptr; }

constexpr double kGB = 1024.0 * 1024.0 * 1024.0;

}  // namespace

nlohmann::json StepMetrics::to_json() const {
  return {{"step", step},
          {"total_steps", total_steps},
          {"epoch", epoch},
          {"loss", finite_or_null(loss)},
          {"mtp_loss", finite_or_null(mtp_loss)},
          {"balancing_loss", finite_or_null(balancing_loss)},
          {"grad_norm", finite_or_null(grad_norm)},
          {"lr", lr},
          {"tgs", tgs},
          {"seqlen_tgs", seqlen_tgs},
          {"exp_tgs", exp_tgs},
          {"max_memory", max_memory},
          {"reserved_memory", reserved_memory},
          {"maxvio", maxvio},
          {"eta", eta},
          {"model_tflops", model_tflops},
          {"mfu", finite_or_null(mfu)},
          {"comm_time", finite_or_null(comm_time)},
          {"step_time", step_time},
          {"text_tokens", text_tokens},
          {"seqlen_tokens", seqlen_tokens},
          {"consumed_tokens", consumed_tokens},
          {"skipped", skipped},
          {"nonfinite", nonfinite}};
}

std::string format_eta(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) seconds = 0;
  const int64_t s = int64_t(std::llround(seconds));
  return fmt::format("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60);
}

std::string StepMetrics::log_line() const {
  std::string line = fmt::format(
      "step {}/{} loss {:.4f} mtp_loss {:.4f} balancing_loss {:.6f} grad_norm {:.4f} lr {:.3e} "
      "tgs {:.1f} seqlen_tgs {:.1f} exp_tgs {:.1f} max_memory {:.2f}GB reserved_memory {:.2f}GB "
      "maxvio {:.4f} eta {}",
      step, total_steps, loss, mtp_loss, balancing_loss, grad_norm, lr, tgs, seqlen_tgs, exp_tgs,
      max_memory, reserved_memory, maxvio, format_eta(eta));
  if (std::isfinite(mfu))
    line += fmt::format(" model_tflops {:.1f} mfu {:.1f}%", model_tflops, 100 * mfu);
  if (std::isfinite(comm_time)) line += fmt::format(" comm_time {:.3f}s", comm_time);
  if (skipped) {
    std::string what;
    for (const std::string& n : nonfinite) what += (what.empty() ? "" : ", ") + n;
    line += fmt::format(" (update skipped: not finite: {})",
                        what.empty() ? std::string("gradient norm") : what);
  }
  return line;
}

nlohmann::json ThroughputTotals::to_json() const {
  return {{"steps", steps},
          {"text_tokens", text_tokens},
          {"seqlen_tokens", seqlen_tokens},
          {"seconds", seconds}};
}

ThroughputTotals ThroughputTotals::from_json(const nlohmann::json& j, const std::string& source) {
  const std::string fix = "the trainer state is damaged: resume from another checkpoint";
  if (!j.is_object()) throw Error("'totals' must be an object", source, fix);
  ThroughputTotals t;
  auto integer = [&](const char* key) {
    if (!j.contains(key) || !j[key].is_number_integer() || j[key].get<int64_t>() < 0)
      throw Error(fmt::format("totals.{} must be an integer >= 0", key), source, fix);
    return j[key].get<int64_t>();
  };
  t.steps = integer("steps");
  t.text_tokens = integer("text_tokens");
  t.seqlen_tokens = integer("seqlen_tokens");
  if (!j.contains("seconds") || !j["seconds"].is_number() || !(j["seconds"].get<double>() >= 0))
    throw Error("totals.seconds must be a number >= 0", source, fix);
  t.seconds = j["seconds"].get<double>();
  return t;
}

void ThroughputMeter::record(StepMetrics& m, int64_t text_tokens, int64_t seqlen_tokens,
                             double seconds) {
  totals_.steps += 1;
  totals_.text_tokens += text_tokens;
  totals_.seqlen_tokens += seqlen_tokens;
  totals_.seconds += seconds;
  m.step_time = seconds;
  m.text_tokens = text_tokens;
  m.seqlen_tokens = seqlen_tokens;
  m.consumed_tokens = totals_.text_tokens;
  m.tgs = seconds > 0 ? double(text_tokens) / seconds : 0.0;
  m.seqlen_tgs = seconds > 0 ? double(seqlen_tokens) / seconds : 0.0;
  m.exp_tgs = totals_.seconds > 0 ? double(totals_.text_tokens) / totals_.seconds : 0.0;
  const double mean_step = totals_.seconds / double(totals_.steps);
  m.eta = double(std::max<int64_t>(0, m.total_steps - m.step)) * mean_step;
}

MemoryPeaks take_memory_peaks(Device device) {
  Allocator& a = allocator_for(device);
  const MemoryStats s = a.stats();
  a.reset_peak();
  return {double(s.peak_allocated) / kGB, double(s.peak_reserved) / kGB};
}

MetricsLog::MetricsLog(const std::filesystem::path& output_dir, int64_t resume_step,
                       int64_t log_every)
    : path_(output_dir / "metrics.jsonl"), log_every_(std::max<int64_t>(1, log_every)) {
  std::error_code ec;
  std::filesystem::create_directories(output_dir, ec);
  if (ec)
    throw Error("cannot create the output directory: " + ec.message(), output_dir.string(),
                "check the path and its permissions (output.dir in the recipe)");
  if (std::filesystem::exists(path_)) {
    std::istringstream in(read_text_file(path_.string(), "metrics"));
    std::string kept, line;
    bool changed = false;
    while (std::getline(in, line)) {
      bool keep = false;
      try {
        const auto j = nlohmann::json::parse(line);
        keep = j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
               j["step"].get<int64_t>() <= resume_step;
      } catch (const nlohmann::json::parse_error&) {
        keep = false;  // a line torn by a kill mid-write
      }
      if (keep)
        kept += line + "\n";
      else
        changed = true;
    }
    if (changed) write_file_atomic(path_.string(), kept);
  }
  out_.open(path_, std::ios::app | std::ios::binary);
  if (!out_)
    throw Error(std::string("cannot open for appending: ") + std::strerror(errno), path_.string(),
                "check that the output directory is writable");
}

void MetricsLog::write(const StepMetrics& m) {
  out_ << m.to_json().dump() << '\n';
  out_.flush();
  if (!out_)
    throw Error("write failed", path_.string(), "check free disk space in the output directory");
  if (m.step % log_every_ == 0 || m.step == m.total_steps || m.skipped)
    spdlog::info("{}", m.log_line());
}

}  // namespace glmtune::train
