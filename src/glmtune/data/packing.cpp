#include "glmtune/data/packing.h"

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <utility>

#include "glmtune/base/error.h"

namespace glmtune::data {
namespace {

// SplitMix64 (Steele, Lea, Flood 2014): tiny, well mixed, and fully specified, so shuffles are
// reproducible across compilers and standard libraries.
uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform integer in [0, n) without modulo bias (Lemire's multiply-and-reject).
uint64_t uniform_below(uint64_t& state, uint64_t n) {
  unsigned __int128 m = static_cast<unsigned __int128>(splitmix64(state)) * n;
  auto low = static_cast<uint64_t>(m);
  if (low < n) {
    const uint64_t threshold = (0 - n) % n;
    while (low < threshold) {
      m = static_cast<unsigned __int128>(splitmix64(state)) * n;
      low = static_cast<uint64_t>(m);
    }
  }
  return static_cast<uint64_t>(m >> 64);
}

std::string hex64(uint64_t v) { return fmt::format("{:016x}", v); }

constexpr const char* kStateFormat = "glmtune.pack_sampler";
constexpr int kStateVersion = 1;

}  // namespace

Pack build_pack(const std::vector<TokenizedSample>& docs,
                const std::vector<int64_t>& sample_indices, int64_t pack_max_length,
                int32_t pad_id) {
  if (pack_max_length < 1 || pack_max_length > INT32_MAX)
    throw Error(fmt::format("pack_max_length {} is out of range", pack_max_length),
                "pack_max_length");
  if (pad_id < 0)
    throw Error(fmt::format("pad id {} is invalid", pad_id), "pad_id",
                "use the id of <|endoftext|>");
  GLMTUNE_ASSERT(docs.size() == sample_indices.size(), "{} documents but {} sample indices",
                 docs.size(), sample_indices.size());
  int64_t total = 0;
  for (size_t d = 0; d < docs.size(); ++d) {
    const auto& doc = docs[d];
    GLMTUNE_ASSERT(!doc.input_ids.empty() && doc.input_ids.size() == doc.labels.size(),
                   "document {} has {} ids and {} labels", d, doc.input_ids.size(),
                   doc.labels.size());
    total += static_cast<int64_t>(doc.input_ids.size());
  }
  if (total > pack_max_length)
    throw Error(fmt::format("{} documents of {} tokens do not fit a pack of {}", docs.size(), total,
                            pack_max_length),
                "pack_max_length", "truncate samples to at most pack_max_length tokens");

  Pack p;
  const auto L = static_cast<size_t>(pack_max_length);
  p.input_ids.reserve(L);
  p.labels.reserve(L);
  p.cu_seqlens.push_back(0);
  p.sample_indices = sample_indices;
  for (const auto& doc : docs) {
    const size_t n = doc.input_ids.size();
    p.input_ids.insert(p.input_ids.end(), doc.input_ids.begin(), doc.input_ids.end());
    // Shift inside the document: position i predicts token i+1 of the same document, so no
    // document ever learns to predict the start of the next one.
    for (size_t i = 0; i + 1 < n; ++i) p.labels.push_back(doc.labels[i + 1]);
    p.labels.push_back(kIgnoreIndex);
    p.cu_seqlens.push_back(static_cast<int32_t>(p.input_ids.size()));
    p.max_seqlen = std::max(p.max_seqlen, static_cast<int32_t>(n));
  }
  p.num_padding = static_cast<int32_t>(L - p.input_ids.size());
  if (p.num_padding > 0) {
    // One trailing document: it attends only to itself and its outputs carry no loss.
    p.input_ids.resize(L, pad_id);
    p.labels.resize(L, kIgnoreIndex);
    p.cu_seqlens.push_back(static_cast<int32_t>(L));
    p.max_seqlen = std::max(p.max_seqlen, p.num_padding);
  }
  for (int32_t l : p.labels) p.num_targets += l != kIgnoreIndex;
  return p;
}

std::vector<std::vector<int64_t>> plan_packs(const std::vector<int64_t>& order,
                                             const std::function<int64_t(int64_t)>& length,
                                             int64_t pack_max_length, int64_t lookahead) {
  if (pack_max_length < 1)
    throw Error(fmt::format("pack_max_length {} must be positive", pack_max_length),
                "pack_max_length");
  if (lookahead < 0)
    throw Error(fmt::format("lookahead {} must not be negative", lookahead), "lookahead");
  struct Item {
    int64_t sample;
    int64_t length;
  };
  std::deque<Item> pending;
  for (int64_t s : order) {
    const int64_t n = length(s);
    if (n < 1 || n > pack_max_length)
      throw Error(fmt::format("sample {} has {} tokens; a pack holds {}", s, n, pack_max_length),
                  "pack_max_length", "set the dataset's max_length to at most pack_max_length");
    pending.push_back({s, n});
  }

  std::vector<std::vector<int64_t>> packs;
  std::vector<size_t> candidates;
  while (!pending.empty()) {
    std::vector<int64_t> pack;
    int64_t used = 0;
    while (!pending.empty() && used + pending.front().length <= pack_max_length) {
      used += pending.front().length;
      pack.push_back(pending.front().sample);
      pending.pop_front();
    }
    if (used < pack_max_length && pending.size() > 1 && lookahead > 0) {
      // The front sample does not fit. Fill the tail from the next `lookahead` pending samples,
      // longest first (first-fit decreasing), ties by position; the rest keep their order.
      const size_t window = std::min(pending.size(), static_cast<size_t>(lookahead) + 1);
      candidates.clear();
      for (size_t k = 1; k < window; ++k) candidates.push_back(k);
      std::stable_sort(candidates.begin(), candidates.end(),
                       [&](size_t a, size_t b) { return pending[a].length > pending[b].length; });
      std::vector<size_t> taken;
      for (size_t k : candidates) {
        if (used + pending[k].length > pack_max_length) continue;
        used += pending[k].length;
        pack.push_back(pending[k].sample);
        taken.push_back(k);
        if (used == pack_max_length) break;
      }
      std::sort(taken.rbegin(), taken.rend());
      for (size_t k : taken) pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(k));
    }
    packs.push_back(std::move(pack));
  }
  return packs;
}

std::vector<int64_t> shuffled_order(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  // Independent streams per (seed, epoch): both go through the mixer before combining.
  uint64_t a = seed, b = static_cast<uint64_t>(epoch) ^ 0x5EEDBA5Eull;
  uint64_t state = splitmix64(a) ^ (splitmix64(b) * 0xD1342543DE82EF95ull);
  for (int64_t i = n - 1; i > 0; --i) {
    auto j = static_cast<int64_t>(uniform_below(state, static_cast<uint64_t>(i) + 1));
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  return order;
}

PackSampler::PackSampler(const SampleSource& source, PackingConfig config)
    : source_(source), config_(config), fingerprint_(source.fingerprint()) {
  if (source_.size() == 0)
    throw Error("the dataset has no samples", "data.files",
                "check the data files and the skipped-line report");
  if (config_.pack_max_length < 1 || config_.pack_max_length > INT32_MAX)
    throw Error(fmt::format("pack_max_length {} is out of range", config_.pack_max_length),
                "pack_max_length");
  if (config_.pad_id < 0)
    throw Error(fmt::format("pad id {} is invalid", config_.pad_id), "pad_id",
                "set it to the tokenizer's id of <|endoftext|>");
  plan_epoch(0);
}

void PackSampler::plan_epoch(int64_t epoch) {
  std::vector<int64_t> order;
  if (config_.shuffle) {
    order = shuffled_order(source_.size(), config_.seed, epoch);
  } else {
    order.resize(static_cast<size_t>(source_.size()));
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  }
  plan_ = plan_packs(
      order, [this](int64_t i) { return source_.length(i); }, config_.pack_max_length,
      config_.lookahead);
  epoch_ = epoch;
  index_ = 0;
}

Pack PackSampler::next() {
  const std::vector<int64_t>& indices = plan_[static_cast<size_t>(index_)];
  Pack p = build_pack(source_.load(indices), indices, config_.pack_max_length, config_.pad_id);
  // Advance eagerly so that the position always names the next pack to produce.
  if (++index_ == packs_in_epoch()) plan_epoch(epoch_ + 1);
  return p;
}

std::vector<std::vector<int64_t>> PackSampler::peek(int64_t n) const {
  std::vector<std::vector<int64_t>> out;
  for (int64_t i = index_; i < packs_in_epoch() && i < index_ + n; ++i)
    out.push_back(plan_[static_cast<size_t>(i)]);
  return out;
}

nlohmann::json PackSampler::save_state() const {
  return {{"format", kStateFormat},
          {"version", kStateVersion},
          {"epoch", epoch_},
          {"index_in_epoch", index_},
          {"seed", hex64(config_.seed)},
          {"shuffle", config_.shuffle},
          {"pack_max_length", config_.pack_max_length},
          {"lookahead", config_.lookahead},
          {"num_samples", source_.size()},
          {"data_fingerprint", hex64(fingerprint_)}};
}

void PackSampler::restore_state(const nlohmann::json& state) {
  const std::string where = "sampler state";
  auto field = [&](const char* key) -> const nlohmann::json& {
    if (!state.is_object() || !state.contains(key))
      throw Error(fmt::format("missing \"{}\"", key), where, "pass the JSON that save_state wrote");
    return state.at(key);
  };
  auto expect = [&](const char* key, const nlohmann::json& mine, const char* fix) {
    if (field(key) != mine)
      throw Error(fmt::format("\"{}\" is {} in the saved state but {} now", key, field(key).dump(),
                              mine.dump()),
                  where, fix);
  };
  expect("format", kStateFormat, "pass the JSON that save_state wrote");
  expect("version", kStateVersion, "the state was written by another glmtune version");
  expect("seed", hex64(config_.seed), "resume with the run's original data.seed");
  expect("shuffle", config_.shuffle, "resume with the run's original shuffle setting");
  expect("pack_max_length", config_.pack_max_length,
         "resume with the run's original pack_max_length");
  expect("lookahead", config_.lookahead, "resume with the run's original packing lookahead");
  expect("num_samples", source_.size(),
         "the data changed since the state was saved; resume with the same files and settings");
  expect("data_fingerprint", hex64(fingerprint_),
         "the data changed since the state was saved; resume with the same files and settings");
  const auto& epoch = field("epoch");
  const auto& index = field("index_in_epoch");
  if (!epoch.is_number_integer() || epoch.get<int64_t>() < 0 || !index.is_number_integer() ||
      index.get<int64_t>() < 0)
    throw Error("\"epoch\" and \"index_in_epoch\" must be non-negative integers", where);
  plan_epoch(epoch.get<int64_t>());
  if (index.get<int64_t>() > packs_in_epoch())
    throw Error(fmt::format("index_in_epoch {} is past the epoch's {} packs", index.get<int64_t>(),
                            packs_in_epoch()),
                where, "the data or packing settings changed since the state was saved");
  index_ = index.get<int64_t>();
  if (index_ == packs_in_epoch()) plan_epoch(epoch_ + 1);
}

}  // namespace glmtune::data
