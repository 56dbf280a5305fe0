#include "glmtune/base/progress.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>

namespace glmtune {

std::string format_bytes(double bytes) {
  static constexpr const char* kUnits[] = {"B", "KB", "MB", "GB", "TB", "PB"};
  int unit = 0;
  while (std::abs(bytes) >= 1000.0 && unit < 5) {
    bytes /= 1000.0;
    ++unit;
  }
  return unit == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.2f} {}", bytes, kUnits[unit]);
}

std::string format_count(double count, const std::string& unit) {
  static constexpr const char* kPrefixes[] = {"", "k", "M", "G", "T"};
  int prefix = 0;
  while (std::abs(count) >= 1000.0 && prefix < 4) {
    count /= 1000.0;
    ++prefix;
  }
  return prefix == 0 ? fmt::format("{:.0f} {}", count, unit)
                     : fmt::format("{:.3g}{} {}", count, kPrefixes[prefix], unit);
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto s = int64_t(std::llround(seconds));
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m{:02d}s", s / 60, s % 60);
  return fmt::format("{}h{:02d}m", s / 3600, (s % 3600) / 60);
}

Progress::Progress(std::string label, uint64_t total_bytes)
    : Progress(std::move(label), total_bytes, Options{}) {}

Progress::Progress(std::string label, uint64_t total_bytes, Options options)
    : label_(std::move(label)), total_(total_bytes), options_(options) {
  tty_ = options_.force_tty >= 0 ? options_.force_tty == 1 : ::isatty(::fileno(options_.out)) == 1;
  start_ = last_draw_ = Clock::now();
}

Progress::~Progress() {
  std::lock_guard lock(mu_);
  // An abandoned bar (an exception unwound past it) must not leave the cursor mid-line.
  if (!finished_ && tty_) std::fputc('\n', options_.out);
}

uint64_t Progress::done() const {
  std::lock_guard lock(mu_);
  return done_;
}

double Progress::elapsed_s() const {
  return std::chrono::duration<double>(Clock::now() - start_).count();
}

std::string Progress::status() const {
  std::lock_guard lock(mu_);
  return status_locked(Clock::now());
}

std::string Progress::status_locked(Clock::time_point now) const {
  const double secs = std::chrono::duration<double>(now - start_).count();
  const double rate = secs > 0 ? double(done_) / secs : 0.0;
  const double fraction = total_ ? std::min(1.0, double(done_) / double(total_)) : 1.0;
  const auto amount = [&](double v) {
    return options_.unit.empty() ? format_bytes(v) : format_count(v, options_.unit);
  };
  std::string text = fmt::format("{}: {} / {} ({:.0f}%)", label_, amount(double(done_)),
                                 amount(double(total_)), 100.0 * fraction);
  if (finished_) return text + fmt::format(" in {}, {}/s", format_duration(secs), amount(rate));
  text += fmt::format(", {}/s", amount(rate));
  if (rate > 0 && done_ < total_) text += ", ETA " + format_duration(double(total_ - done_) / rate);
  return text;
}

void Progress::draw_locked(Clock::time_point now, bool final) {
  last_draw_ = now;
  if (tty_) {
    constexpr int kWidth = 24;
    const double fraction = total_ ? std::min(1.0, double(done_) / double(total_)) : 1.0;
    const int filled = int(fraction * kWidth);
    std::string bar(size_t(filled), '#');
    bar.append(size_t(kWidth - filled), '.');
    // \r and "erase to end of line" redraw in place without scrolling.
    std::fprintf(options_.out, "\r[%s] %s\x1b[K%s", bar.c_str(), status_locked(now).c_str(),
                 final ? "\n" : "");
    std::fflush(options_.out);
  } else {
    spdlog::info("{}", status_locked(now));
  }
}

void Progress::advance(uint64_t bytes) {
  std::lock_guard lock(mu_);
  done_ += bytes;
  if (finished_) return;
  const auto now = Clock::now();
  const double since = std::chrono::duration<double>(now - last_draw_).count();
  if (since >= (tty_ ? 0.1 : options_.log_interval_s)) draw_locked(now, false);
}

void Progress::finish() {
  std::lock_guard lock(mu_);
  if (finished_) return;
  finished_ = true;
  draw_locked(Clock::now(), true);
}

}  // namespace glmtune
