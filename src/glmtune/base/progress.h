#pragma once
// A progress report for long jobs: bytes (checkpoint conversion, writes) or any other count
// (tokens evaluated).
//
// On a terminal it redraws one line in place (bar, bytes done / total, rate, ETA) at most ten
// times a second. When stderr is a file or a pipe (batch jobs, CI logs) redrawing would only litter
// the log, so it logs one line every few seconds instead.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>

namespace glmtune {

// "0 B", "512 B", "1.50 KB", "3.21 GB" (decimal units, as disk sizes are quoted).
std::string format_bytes(double bytes);
// "950 tokens", "12.3k tokens", "4.56M tokens" (decimal prefixes).
std::string format_count(double count, const std::string& unit);
// "42s", "3m05s", "2h07m".
std::string format_duration(double seconds);

class Progress {
 public:
  struct Options {
    // Seconds between log lines when not on a terminal.
    double log_interval_s = 5.0;
    // Forces terminal (true) or log (false) mode; by default decided by isatty(stderr).
    int force_tty = -1;
    FILE* out = stderr;
    // The counted unit: empty for bytes ("1.50 GB"), else a word ("12.3k tokens").
    std::string unit;
  };

  Progress(std::string label, uint64_t total_bytes);
  Progress(std::string label, uint64_t total_bytes, Options options);
  // Finishes the line (terminal mode) if finish() was not called.
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Thread-safe.
  void advance(uint64_t bytes);
  // Prints the final state (total, elapsed, mean rate).
  void finish();

  uint64_t done() const;
  uint64_t total() const { return total_; }
  double elapsed_s() const;
  // The status text, without terminal control characters.
  std::string status() const;

 private:
  using Clock = std::chrono::steady_clock;
  std::string status_locked(Clock::time_point now) const;
  void draw_locked(Clock::time_point now, bool final);

  std::string label_;
  uint64_t total_ = 0;
  Options options_;
  bool tty_ = false;
  mutable std::mutex mu_;
  uint64_t done_ = 0;
  Clock::time_point start_;
  Clock::time_point last_draw_;
  bool finished_ = false;
};

}  // namespace glmtune
