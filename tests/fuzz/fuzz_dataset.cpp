// libFuzzer entry: arbitrary bytes as a JSONL data file (chat, plain-text or auto format), read by
// the streaming reader and by the indexed dataset, tokenized with the bundled tiny tokenizer.
// A bad line must be skipped and counted (or, under on_bad_line = "fail", rejected with a
// glmtune::Error naming file and line); every kept sample must be well formed: as many labels as
// ids, every id in the vocabulary, every label its id or the ignore index, no longer than
// max_length, at least one trained target. The indexed dataset must find the same samples again
// by byte offset. Anything else escaping (a crash, a sanitizer report, another exception) is a bug.
//
// The format and the policies are picked from the input's length, so that one corpus file is read
// one way and its mutations every other way.

#include <spdlog/spdlog.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <vector>

#include "fuzz_util.h"
#include "glmtune/base/error.h"
#include "glmtune/data/dataset.h"
#include "glmtune/data/tokenizer.h"

namespace {

using namespace glmtune::data;
using glmtune::fuzz::bug;

const Tokenizer* g_tokenizer = nullptr;
glmtune::fuzz::InputFile* g_file = nullptr;

void check_sample(const TokenizedSample& t, const DatasetConfig& cfg) {
  if (t.input_ids.size() != t.labels.size()) bug("ids and labels differ in length");
  if (t.input_ids.empty() || int64_t(t.input_ids.size()) > cfg.max_length)
    bug("sample length outside [1, max_length]");
  int64_t targets = 0;
  for (size_t i = 0; i < t.input_ids.size(); ++i) {
    const int32_t id = t.input_ids[i];
    if (id < 0 || id >= g_tokenizer->vocab_size()) bug("token id outside the vocabulary");
    if (t.labels[i] != id && t.labels[i] != kIgnoreIndex) bug("label is neither its id nor -100");
    targets += i > 0 && t.labels[i] != kIgnoreIndex;
  }
  if (targets == 0) bug("kept sample has nothing to train");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // One encoding thread: the fuzzer measures the parser, not OpenMP start-up.
  setenv("OMP_NUM_THREADS", "1", 1);
  spdlog::set_level(spdlog::level::off);  // skipped lines are logged as warnings
  static Tokenizer tokenizer =
      Tokenizer::from_file(glmtune::fuzz::source_path("examples/tiny/tokenizer/tokenizer.json"));
  static glmtune::fuzz::InputFile file;
  g_tokenizer = &tokenizer;
  g_file = &file;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  g_file->write(data, size);
  DatasetConfig cfg;
  cfg.files = {g_file->path()};
  cfg.format = static_cast<SampleFormat>(size % 3);
  cfg.on_overlong = (size / 3) % 2 ? OverlongPolicy::kDrop : OverlongPolicy::kTruncate;
  cfg.on_bad_line = (size / 6) % 4 == 0 ? BadLinePolicy::kFail : BadLinePolicy::kSkip;
  cfg.max_length = 64;
  cfg.batch_lines = 3;  // several batches per file, so batch boundaries are crossed too
  if ((size / 24) % 2) cfg.reasoning_effort = "low";
  cfg.clear_thinking = (size / 48) % 2;

  std::vector<Sample> samples;
  DatasetStats stats;
  try {
    JsonlSampleReader reader(cfg, *g_tokenizer);
    while (std::optional<Sample> s = reader.next()) samples.push_back(std::move(*s));
    stats = reader.stats();
  } catch (const glmtune::Error& e) {
    if (cfg.on_bad_line != BadLinePolicy::kFail) bug("a bad line threw although it is skipped");
    return 0;
  }
  if (stats.samples != int64_t(samples.size())) bug("stats.samples differs from the samples");
  int64_t tokens = 0;
  int64_t previous_line = 0;
  for (const Sample& s : samples) {
    check_sample(s.tokens, cfg);
    if (s.line <= previous_line || s.offset >= size) bug("sample line or offset out of order");
    previous_line = s.line;
    tokens += int64_t(s.tokens.input_ids.size());
  }
  if (tokens != stats.tokens) bug("stats.tokens differs from the samples");

  // The indexed dataset scans the same file and seeks back to each line by offset.
  try {
    JsonlDataset ds = JsonlDataset::scan(cfg, *g_tokenizer);
    if (ds.size() != int64_t(samples.size())) bug("scan found another number of samples");
    std::vector<int64_t> all(size_t(ds.size()));
    for (size_t i = 0; i < all.size(); ++i) all[i] = int64_t(i);
    std::vector<TokenizedSample> loaded = ds.load(all);
    for (size_t i = 0; i < loaded.size(); ++i)
      if (loaded[i].input_ids != samples[i].tokens.input_ids ||
          loaded[i].labels != samples[i].tokens.labels)
        bug("the indexed dataset loads another sample than the reader read");
  } catch (const glmtune::Error&) {
    bug("the indexed dataset rejected a file the reader accepted");
  }
  return 0;
}
