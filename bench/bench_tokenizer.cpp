// Tokenizer throughput in MB/s of input text (the "bytes_per_second" counter).
//
// Uses the bundled tiny tokenizer by default; set GLMTUNE_BENCH_TOKENIZER to a tokenizer.json
// (e.g. the released GLM-5.3-Flash one) to measure a real vocabulary. The text is about 4 MB of
// the tokenizer training corpus, shuffled line by line and salted with numbers and identifiers so
// that the word cache sees a realistic mix of repeated and new words. Set GLMTUNE_BENCH_TEXT to a
// JSONL file of JSON strings (one document per line, as `bench/tokenizer_vs_hf.py make-text`
// writes) to encode exactly the text another tokenizer is measured on.
//
// BM_TokenizerEncodeSerial is the single-thread number compared with Hugging Face `tokenizers`
// (docs/PERF.md); run it with --benchmark_filter=Serial --benchmark_repetitions=N.

#include <benchmark/benchmark.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "glmtune/data/tokenizer.h"

namespace {

using glmtune::data::Tokenizer;

std::string tokenizer_path() {
  if (const char* env = std::getenv("GLMTUNE_BENCH_TOKENIZER"); env != nullptr && *env != '\0') {
    return env;
  }
  return std::string(GLMTUNE_SOURCE_DIR) + "/examples/tiny/tokenizer/tokenizer.json";
}

const Tokenizer& tokenizer() {
  static const Tokenizer tok = Tokenizer::from_file(tokenizer_path());
  return tok;
}

// About 4 MB split into documents of a few KB each.
const std::vector<std::string>& documents() {
  static const std::vector<std::string> docs = [] {
    if (const char* env = std::getenv("GLMTUNE_BENCH_TEXT"); env != nullptr && *env != '\0') {
      std::ifstream in(env);
      if (!in) throw std::runtime_error(std::string("cannot read GLMTUNE_BENCH_TEXT ") + env);
      std::vector<std::string> out;
      for (std::string line; std::getline(in, line);)
        if (!line.empty()) out.push_back(nlohmann::json::parse(line).get<std::string>());
      return out;
    }
    std::ifstream in(std::string(GLMTUNE_SOURCE_DIR) + "/tools/tokenizer/corpus.txt");
    std::vector<std::string> lines;
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    if (lines.empty()) lines.push_back("The quick brown fox jumps over the lazy dog.");
    std::mt19937 rng(1234);
    std::vector<std::string> out;
    std::string doc;
    std::size_t total = 0;
    while (total < (4u << 20)) {
      doc += lines[rng() % lines.size()];
      switch (rng() % 4) {
        case 0:
          doc += " id_" + std::to_string(rng() % 100000);
          break;
        case 1:
          doc += " " + std::to_string(rng()) + "." + std::to_string(rng() % 1000);
          break;
        default:
          break;
      }
      doc += '\n';
      if (doc.size() > 4096) {
        total += doc.size();
        out.push_back(std::move(doc));
        doc.clear();
      }
    }
    return out;
  }();
  return docs;
}

std::size_t total_bytes() {
  std::size_t n = 0;
  for (const std::string& d : documents()) n += d.size();
  return n;
}

// One thread, warm word cache.
void BM_TokenizerEncodeSerial(benchmark::State& state) {
  const Tokenizer& tok = tokenizer();
  const auto& docs = documents();
  std::size_t tokens = 0;
  for (auto _ : state) {
    for (const std::string& d : docs) {
      auto ids = tok.encode(d);
      tokens += ids.size();
      benchmark::DoNotOptimize(ids.data());
    }
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * total_bytes()));
  state.counters["tokens_per_byte"] =
      static_cast<double>(tokens) / static_cast<double>(state.iterations() * total_bytes());
}
BENCHMARK(BM_TokenizerEncodeSerial)->Unit(benchmark::kMillisecond)->UseRealTime();

// One thread, a freshly loaded tokenizer per iteration: every word misses the cache at first.
void BM_TokenizerEncodeColdCache(benchmark::State& state) {
  const auto& docs = documents();
  for (auto _ : state) {
    state.PauseTiming();
    const Tokenizer tok = Tokenizer::from_file(tokenizer_path());
    state.ResumeTiming();
    for (const std::string& d : docs) benchmark::DoNotOptimize(tok.encode(d).data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * total_bytes()));
}
BENCHMARK(BM_TokenizerEncodeColdCache)->Unit(benchmark::kMillisecond)->UseRealTime();

// All cores through encode_batch.
void BM_TokenizerEncodeBatch(benchmark::State& state) {
  const Tokenizer& tok = tokenizer();
  const auto& docs = documents();
  for (auto _ : state) {
    auto out = tok.encode_batch(docs);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * total_bytes()));
}
BENCHMARK(BM_TokenizerEncodeBatch)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_TokenizerDecode(benchmark::State& state) {
  const Tokenizer& tok = tokenizer();
  const auto encoded = tok.encode_batch(documents());
  for (auto _ : state) {
    for (const auto& ids : encoded) benchmark::DoNotOptimize(tok.decode(ids).data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * total_bytes()));
}
BENCHMARK(BM_TokenizerDecode)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
