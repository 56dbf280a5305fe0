// libFuzzer entry: arbitrary bytes as a token cache file (`glmtune data prepare` output), opened
// through TokenCache::open (memory-mapped, like training does). Every input must either be
// rejected with a glmtune::Error or give a cache whose every sample can be read: ids and loss mask
// spans of the indexed length inside the file, labels that are the id or the ignore index, a
// checksum check (verify) that either passes or says the file is corrupt, and the staleness check
// of the recorded source files. Anything else escaping (a crash, a read outside the file, a
// sanitizer report, nlohmann's or another exception) is a bug.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <vector>

#include "fuzz_util.h"
#include "glmtune/base/error.h"
#include "glmtune/data/token_cache.h"

using glmtune::fuzz::bug;
using namespace glmtune::data;

namespace {
glmtune::fuzz::InputFile* g_file = nullptr;
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  static glmtune::fuzz::InputFile file;
  g_file = &file;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  g_file->write(data, size);
  std::optional<TokenCache> cache;
  try {
    cache.emplace(TokenCache::open(g_file->path()));
  } catch (const glmtune::Error& e) {
    if (e.where().empty()) bug("a rejected cache does not name the file");
    return 0;
  }
  if (cache->size() < 0 || cache->num_tokens() < 0) bug("negative counts");
  int64_t tokens = 0;
  std::vector<int64_t> all;
  for (int64_t i = 0; i < cache->size(); ++i) {
    const int64_t n = cache->length(i);
    if (n < 0 || cache->ids(i).size() != size_t(n) || cache->loss_mask(i).size() != size_t(n))
      bug("sample spans disagree with the indexed length");
    const Sample s = cache->sample(i);
    if (s.tokens.input_ids.size() != size_t(n) || s.tokens.labels.size() != size_t(n))
      bug("sample() disagrees with the indexed length");
    for (size_t t = 0; t < size_t(n); ++t)
      if (s.tokens.labels[t] != s.tokens.input_ids[t] && s.tokens.labels[t] != kIgnoreIndex)
        bug("a label that is neither its id nor -100");
    tokens += n;
    all.push_back(i);
  }
  if (tokens != cache->num_tokens()) bug("samples do not cover the tokens");
  if (cache->load(all).size() != all.size()) bug("load() lost samples");
  const int64_t trained = cache->num_trained_tokens();
  if (trained < 0 || trained > cache->num_tokens()) bug("trained tokens out of range");
  try {
    cache->verify();
  } catch (const glmtune::Error&) {
    // a corrupt checksum or mask byte is reported, not a crash
  }
  (void)cache->stale_sources();
  (void)cache->fingerprint();
  (void)cache->metadata().dump();
  return 0;
}
