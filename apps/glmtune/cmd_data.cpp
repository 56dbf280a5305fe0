// `glmtune data prepare`: tokenizes JSONL datasets once into a memory-mapped token cache
// (token_cache.h) that training reads instead of the JSONL files.
// `glmtune data inspect`: what a cache holds: counts, a length histogram, the share of trained
// tokens, and one decoded sample with its trained spans marked.

#include <fmt/format.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "command.h"
#include "glmtune/base/error.h"
#include "glmtune/base/fs.h"
#include "glmtune/base/progress.h"
#include "glmtune/data/dataset.h"
#include "glmtune/data/token_cache.h"
#include "glmtune/data/tokenizer.h"

namespace {

using namespace glmtune;
namespace fs = std::filesystem;

struct PrepareArgs {
  std::string tokenizer;
  std::vector<std::string> inputs;
  std::string out;
  std::string format = "auto";
  int64_t max_length = 4096;
  std::string on_overlong = "truncate";
  std::string on_bad_line = "fail";
  std::string reasoning_effort;
  bool clear_thinking = false;
  int threads = 0;
  int64_t batch_lines = 256;
};

struct InspectArgs {
  std::string cache;
  int64_t sample = 0;
  std::string tokenizer;
  std::string color = "auto";
};

int prepare(const PrepareArgs& a) {
  if (a.threads > 0) omp_set_num_threads(a.threads);
  const fs::path tokenizer_json = data::resolve_tokenizer_json(a.tokenizer);
  const auto tok = data::Tokenizer::from_file(tokenizer_json.string());
  data::DatasetConfig config;
  config.files = a.inputs;
  config.format = data::sample_format_from_name(a.format, "--format");
  config.max_length = a.max_length;
  config.on_overlong = data::overlong_policy_from_name(a.on_overlong, "--on-overlong");
  config.on_bad_line = data::bad_line_policy_from_name(a.on_bad_line, "--on-bad-line");
  if (!a.reasoning_effort.empty()) config.reasoning_effort = a.reasoning_effort;
  config.clear_thinking = a.clear_thinking;
  config.batch_lines = a.batch_lines;

  data::JsonlSampleReader reader(config, tok);
  // The cache's directory, cleared of what killed runs of `data prepare` left there.
  create_parent_directory(a.out, "--out");
  const fs::path cache_dir =
      fs::path(a.out).has_parent_path() ? fs::path(a.out).parent_path() : fs::path(".");
  remove_stale_temporary_files(cache_dir);
  data::TokenCacheWriter writer(a.out, config, tokenizer_json);
  // Progress counts input bytes: a sample's position is the size of the files before its own
  // plus its line's byte offset.
  std::vector<uint64_t> file_start;
  uint64_t total = 0;
  for (const auto& f : a.inputs) {
    file_start.push_back(total);
    total += fs::file_size(f);
  }
  Progress progress("tokenizing", total);
  uint64_t reported = 0;
  while (auto sample = reader.next()) {
    const uint64_t at = file_start[static_cast<size_t>(sample->file)] + sample->offset;
    if (at > reported) {
      progress.advance(at - reported);
      reported = at;
    }
    writer.add(*sample);
  }
  progress.advance(total - reported);
  progress.finish();
  const auto& stats = reader.stats();
  if (writer.samples() == 0)
    throw Error(fmt::format("no usable samples in {} lines ({} skipped, {} without a trained "
                            "token, {} over max_length dropped)",
                            stats.lines, stats.skipped_total(), stats.dropped_untrained,
                            stats.dropped_overlong),
                a.inputs.front(), "check --format and the data files");
  writer.finish(stats);
  std::printf("wrote %s: %ld samples, %ld tokens (%ld loss targets)\n", a.out.c_str(),
              writer.samples(), writer.tokens(), stats.trained_tokens);
  std::printf(
      "  %ld lines read, %ld bad lines skipped, %ld truncated, %ld dropped as too long, "
      "%ld dropped with nothing to train\n",
      stats.lines, stats.skipped_total(), stats.truncated, stats.dropped_overlong,
      stats.dropped_untrained);
  if (stats.skipped_total() > 0) std::printf("  %s\n", stats.skipped_report().c_str());
  for (const auto& e : stats.first_errors) std::printf("  skipped: %s\n", e.c_str());
  return 0;
}

// Power-of-two buckets [2^k, 2^(k+1)) from the shortest to the longest sample.
void print_histogram(const data::TokenCache& cache) {
  std::vector<int64_t> counts(33, 0);
  for (int64_t i = 0; i < cache.size(); ++i) {
    const int64_t len = std::max<int64_t>(cache.length(i), 1);
    ++counts[static_cast<size_t>(63 - __builtin_clzll(static_cast<uint64_t>(len)))];
  }
  size_t lo = 0, hi = counts.size() - 1;
  while (lo < hi && counts[lo] == 0) ++lo;
  while (hi > lo && counts[hi] == 0) --hi;
  const int64_t peak = *std::max_element(counts.begin(), counts.end());
  std::printf("length histogram (tokens per sample):\n");
  for (size_t k = lo; k <= hi; ++k) {
    const int bar = peak > 0 ? static_cast<int>((counts[k] * 40 + peak - 1) / peak) : 0;
    std::printf("  [%7ld, %7ld) %8ld %s\n", int64_t{1} << k, int64_t{1} << (k + 1), counts[k],
                std::string(static_cast<size_t>(bar), '#').c_str());
  }
}

int inspect(const InspectArgs& a) {
  std::optional<data::Tokenizer> tok;
  std::optional<uint64_t> expected_hash;
  if (!a.tokenizer.empty()) {
    const fs::path json = data::resolve_tokenizer_json(a.tokenizer);
    expected_hash = data::tokenizer_file_hash(json);
    tok.emplace(data::Tokenizer::from_file(json.string()));
  }
  const auto cache = data::TokenCache::open(a.cache, expected_hash);
  cache.verify();
  const auto& meta = cache.metadata();
  if (!tok) {
    // Without --tokenizer, the one recorded at prepare time decodes the sample if it is still
    // there unchanged.
    const std::string recorded = meta["tokenizer"].value("path", "");
    std::error_code ec;
    if (!recorded.empty() && fs::is_regular_file(recorded, ec) &&
        data::tokenizer_file_hash(recorded) == cache.tokenizer_hash())
      tok.emplace(data::Tokenizer::from_file(recorded));
  }

  const int64_t trained = cache.num_trained_tokens();
  std::printf("token cache %s (%s, format version %u)\n", a.cache.c_str(),
              format_bytes(static_cast<double>(fs::file_size(a.cache))).c_str(),
              data::kTokenCacheVersion);
  std::printf("  tokenizer: %s (hash %s)\n", meta["tokenizer"].value("path", "?").c_str(),
              data::hash_hex(cache.tokenizer_hash()).c_str());
  const auto stale = cache.stale_sources();
  for (const auto& s : meta["sources"]) {
    const std::string p = s.value("path", "");
    const bool changed = std::find(stale.begin(), stale.end(), p) != stale.end();
    std::printf("  source: %s (%s)%s\n", p.c_str(), format_bytes(s.value("size", 0.0)).c_str(),
                changed ? "  [changed or missing since prepare]" : "");
  }
  const auto& c = meta["config"];
  std::printf("  settings: format %s, max_length %ld, on_overlong %s, on_bad_line %s\n",
              c.value("format", "?").c_str(), c.value("max_length", int64_t{0}),
              c.value("on_overlong", "?").c_str(), c.value("on_bad_line", "?").c_str());
  std::printf("samples: %ld\n", cache.size());
  std::printf("tokens: %ld\n", cache.num_tokens());
  std::printf("trained tokens: %ld\n", trained);
  std::printf("loss-token fraction: %.4f\n",
              cache.num_tokens() > 0 ? static_cast<double>(trained) / cache.num_tokens() : 0.0);
  if (cache.size() > 0) {
    int64_t lo = INT64_MAX, hi = 0;
    for (int64_t i = 0; i < cache.size(); ++i) {
      lo = std::min(lo, cache.length(i));
      hi = std::max(hi, cache.length(i));
    }
    std::printf("sample length: min %ld, mean %.1f, max %ld\n", lo,
                static_cast<double>(cache.num_tokens()) / cache.size(), hi);
  }
  if (meta.contains("stats")) {
    const auto& s = meta["stats"];
    // Fewer than the trained tokens: a sample's first token has no earlier token predicting it.
    std::printf("loss targets: %ld\n", s.value("trained_tokens", int64_t{0}));
    std::printf(
        "prepare: %ld lines, %ld skipped, %ld truncated, %ld dropped as too long, %ld "
        "dropped with nothing to train\n",
        s.value("lines", int64_t{0}), s.value("skipped", int64_t{0}),
        s.value("truncated", int64_t{0}), s.value("dropped_overlong", int64_t{0}),
        s.value("dropped_untrained", int64_t{0}));
  }
  print_histogram(cache);

  if (cache.size() == 0) return 0;
  if (a.sample < 0 || a.sample >= cache.size())
    throw Error(
        fmt::format("sample {} is out of range: the cache has {} samples", a.sample, cache.size()),
        "--sample", fmt::format("use 0..{}", cache.size() - 1));
  const auto s = cache.sample(a.sample);
  const auto ids = cache.ids(a.sample);
  const auto mask = cache.loss_mask(a.sample);
  const std::string file = meta["sources"].at(static_cast<size_t>(s.file)).value("path", "?");
  const bool color = a.color == "always" || (a.color == "auto" && ::isatty(::fileno(stdout)) == 1);
  std::printf("sample %ld (%s:%ld, %zu tokens, %s trained%s):\n", a.sample, file.c_str(), s.line,
              ids.size(), color ? "\x1b[1;32mgreen\x1b[0m" : "[[bracketed]]",
              s.truncated ? ", truncated" : "");
  // Spans of equal mask are decoded as a unit; span boundaries sit next to added tokens (or at a
  // truncation point), so no UTF-8 character is cut by them.
  std::string out;
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j < ids.size() && mask[j] == mask[i]) ++j;
    std::string text;
    if (tok) {
      text = tok->decode(std::vector<int32_t>(ids.begin() + i, ids.begin() + j));
    } else {
      for (size_t t = i; t < j; ++t) text += (t > i ? " " : "") + std::to_string(ids[t]);
      text = (i > 0 ? " " : "") + text;
    }
    if (mask[i])
      out += color ? "\x1b[1;32m" + text + "\x1b[0m" : "[[" + text + "]]";
    else
      out += text;
    i = j;
  }
  std::printf("%s\n", out.c_str());
  if (!tok)
    std::printf(
        "(token ids shown: pass --tokenizer to decode; the recorded tokenizer is missing "
        "or changed)\n");
  return 0;
}

}  // namespace

GLMTUNE_COMMAND(
    data, "data", "Tokenize datasets into a token cache (prepare) and inspect a cache",
    [](CLI::App& app) {
      app.require_subcommand(1);
      auto p = std::make_shared<PrepareArgs>();
      CLI::App* prep = app.add_subcommand(
          "prepare", "Tokenize JSONL files once into a memory-mapped token cache");
      prep->add_option("--tokenizer", p->tokenizer, "Tokenizer directory (or its tokenizer.json)")
          ->required();
      prep->add_option("--input", p->inputs, "JSONL data files, in order")
          ->required()
          ->expected(1, -1)
          ->check(CLI::ExistingFile);
      prep->add_option("--out", p->out, "Cache file to write")->required();
      prep->add_option("--format", p->format, "auto (per line), chat or text")
          ->check(CLI::IsMember({"auto", "chat", "text"}))
          ->capture_default_str();
      prep->add_option("--max-length", p->max_length, "Longest sample in tokens")
          ->capture_default_str();
      prep->add_option("--on-overlong", p->on_overlong, "Longer samples: truncate or drop")
          ->check(CLI::IsMember({"truncate", "drop"}))
          ->capture_default_str();
      prep->add_option("--on-bad-line", p->on_bad_line, "Unusable lines: fail or skip")
          ->check(CLI::IsMember({"fail", "skip"}))
          ->capture_default_str();
      prep->add_option("--reasoning-effort", p->reasoning_effort,
                       "Chat template reasoning effort for lines that set none");
      prep->add_flag("--clear-thinking", p->clear_thinking,
                     "Drop reasoning of turns before the last user message");
      prep->add_option("--threads", p->threads, "Encoder threads (0: all cores)")
          ->check(CLI::NonNegativeNumber)
          ->capture_default_str();
      prep->add_option("--batch-lines", p->batch_lines, "Lines encoded together")
          ->check(CLI::PositiveNumber)
          ->capture_default_str();

      auto i = std::make_shared<InspectArgs>();
      CLI::App* insp = app.add_subcommand("inspect", "Summarise a token cache and show a sample");
      insp->add_option("cache", i->cache, "Token cache file")->required();
      insp->add_option("--sample", i->sample, "Sample to decode")->capture_default_str();
      insp->add_option("--tokenizer", i->tokenizer,
                       "Tokenizer to decode with (default: the one recorded in the cache)");
      insp->add_option("--color", i->color, "Highlight trained spans: auto, always or never")
          ->check(CLI::IsMember({"auto", "always", "never"}))
          ->capture_default_str();
      return [p, i, prep, insp] { return prep->parsed() ? prepare(*p) : inspect(*i); };
    });
