#include "glmtune/data/tokenizer_bpe.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <mutex>
#include <queue>

#include "glmtune/data/tokenizer_unicode.h"

namespace glmtune::data::detail {
namespace {

std::array<char32_t, 256> make_byte_to_char() {
  // Printable Latin-1 bytes stand for themselves; the rest (controls, space, 0x7F-0xA0, 0xAD) are
  // moved to U+0100 and up in byte order so that every byte is a visible, non-space character.
  std::array<char32_t, 256> table{};
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    table[static_cast<std::size_t>(b)] = printable ? static_cast<char32_t>(b) : next++;
  }
  return table;
}

// Words longer than this are rare and would bloat the cache.
constexpr std::size_t kMaxCachedWordBytes = 256;
// Up to this many initial symbols a quadratic scan beats heap bookkeeping.
constexpr std::size_t kSmallWordSymbols = 24;

}  // namespace

const std::array<char32_t, 256>& byte_to_char() {
  static const std::array<char32_t, 256> table = make_byte_to_char();
  return table;
}

std::optional<std::uint8_t> char_to_byte(char32_t c) {
  static const std::array<int, 324> inverse = [] {
    std::array<int, 324> inv{};
    inv.fill(-1);
    const auto& fwd = byte_to_char();
    for (int b = 0; b < 256; ++b) inv[fwd[static_cast<std::size_t>(b)]] = b;
    return inv;
  }();
  if (c >= inverse.size() || inverse[c] < 0) return std::nullopt;
  return static_cast<std::uint8_t>(inverse[c]);
}

std::optional<std::string> byte_level_to_bytes(std::string_view token) {
  std::string out;
  out.reserve(token.size());
  for (std::size_t i = 0; i < token.size();) {
    const Utf8Char ch = decode_utf8(token, i);
    if (!ch.valid) return std::nullopt;
    const std::optional<std::uint8_t> b = char_to_byte(ch.cp);
    if (!b) return std::nullopt;
    out.push_back(static_cast<char>(*b));
    i += static_cast<std::size_t>(ch.len);
  }
  return out;
}

std::string bytes_to_byte_level(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  const auto& table = byte_to_char();
  for (char c : bytes) append_utf8(out, table[static_cast<unsigned char>(c)]);
  return out;
}

// ---------------------------------------------------------------------------------------------
// MergeTable

void MergeTable::reserve(std::size_t n) {
  std::size_t cap = 16;
  while (cap < n * 2) cap <<= 1;
  if (cap <= slots_.size()) return;
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(cap, Slot{});
  mask_ = cap - 1;
  shift_ = 64 - __builtin_ctzll(cap);
  size_ = 0;
  for (const Slot& s : old) {
    if (s.key != kEmpty) {
      insert(static_cast<std::int32_t>(s.key >> 32), static_cast<std::int32_t>(s.key & 0xFFFFFFFFu),
             s.value);
    }
  }
}

void MergeTable::grow() { reserve(slots_.empty() ? 8 : slots_.size()); }

void MergeTable::insert(std::int32_t left, std::int32_t right, Value value) {
  if ((size_ + 1) * 2 > slots_.size()) grow();
  const std::uint64_t key = pack(left, right);
  for (std::size_t i = hash(key);; i = (i + 1) & mask_) {
    Slot& s = slots_[i];
    if (s.key == key) {
      s.value = value;
      return;
    }
    if (s.key == kEmpty) {
      s.key = key;
      s.value = value;
      ++size_;
      return;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// WordCache

WordCache::WordCache(std::size_t capacity)
    : shard_capacity_(std::max<std::size_t>(1, capacity / kShards)),
      shards_(std::make_unique<Shard[]>(kShards)) {}

bool WordCache::lookup(std::string_view word, std::vector<std::int32_t>& out) const {
  Shard& shard = shards_[std::hash<std::string_view>{}(word) % kShards];
  std::shared_lock lock(shard.mutex);
  const auto it = shard.map.find(word);
  if (it == shard.map.end()) return false;
  out.insert(out.end(), it->second.begin(), it->second.end());
  return true;
}

void WordCache::insert(std::string_view word, const std::int32_t* ids, std::size_t n) {
  Shard& shard = shards_[std::hash<std::string_view>{}(word) % kShards];
  std::unique_lock lock(shard.mutex);
  if (shard.map.size() >= shard_capacity_) shard.map.clear();
  shard.map.try_emplace(std::string(word), ids, ids + n);
}

// ---------------------------------------------------------------------------------------------
// BpeModel

BpeModel::BpeModel(const StringMap<std::int32_t>& vocab, const std::vector<Merge>& merges,
                   BpeOptions options)
    : options_(std::move(options)), cache_(1 << 18) {
  merges_.reserve(merges.size());
  for (std::size_t rank = 0; rank < merges.size(); ++rank) {
    const Merge& m = merges[rank];
    merges_.insert(m.left, m.right, {static_cast<std::int32_t>(rank), m.merged});
  }
  if (options_.unk_token) unk_id_ = vocab.find(*options_.unk_token)->second;

  auto lookup = [&](std::string_view s) -> std::int32_t {
    const auto it = vocab.find(s);
    return it == vocab.end() ? -1 : it->second;
  };
  const auto& table = byte_to_char();
  for (int kind = 0; kind < 4; ++kind) {
    for (int b = 0; b < 256; ++b) {
      std::string s;
      if ((kind & 1) && options_.continuing_subword_prefix)
        s += *options_.continuing_subword_prefix;
      append_utf8(s, table[static_cast<std::size_t>(b)]);
      if ((kind & 2) && options_.end_of_word_suffix) s += *options_.end_of_word_suffix;
      Initial& init = initial_[static_cast<std::size_t>(kind)][static_cast<std::size_t>(b)];
      init.id = lookup(s);
      if (init.id < 0 && options_.byte_fallback) {
        // HF falls back on the bytes of the symbol string (prefix and suffix included), and only
        // when every one of them has a <0xXX> token.
        std::vector<std::int32_t> ids;
        for (char c : s) {
          const std::int32_t id = lookup(fmt::format("<0x{:02X}>", static_cast<unsigned char>(c)));
          if (id < 0) {
            ids.clear();
            break;
          }
          ids.push_back(id);
        }
        init.fallback = std::move(ids);
      }
    }
  }

  if (options_.ignore_merges) {
    for (const auto& [token, id] : vocab) {
      if (std::optional<std::string> bytes = byte_level_to_bytes(token)) {
        byte_vocab_.emplace(std::move(*bytes), id);
      }
    }
  }
}

void BpeModel::initial_symbols(std::string_view bytes, std::vector<std::int32_t>& ids) const {
  bool unk_pending = false;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    const std::size_t kind = (i > 0 ? 1u : 0u) | (i + 1 == bytes.size() ? 2u : 0u);
    const Initial& init = initial_[kind][static_cast<unsigned char>(bytes[i])];
    if (init.id >= 0) {
      if (unk_pending) ids.push_back(unk_id_);
      unk_pending = false;
      ids.push_back(init.id);
    } else if (!init.fallback.empty()) {
      // Matches HF: a pending unknown token is not flushed before byte-fallback tokens.
      ids.insert(ids.end(), init.fallback.begin(), init.fallback.end());
    } else if (unk_id_ >= 0) {
      if (unk_pending && !options_.fuse_unk) ids.push_back(unk_id_);
      unk_pending = true;
    }
    // Without an unk token an unknown character is dropped, as in HF.
  }
  if (unk_pending) ids.push_back(unk_id_);
}

void BpeModel::merge_small(std::vector<std::int32_t>& ids, const MergeTable& merges) {
  while (ids.size() > 1) {
    std::int32_t best_rank = -1;
    std::size_t best_pos = 0;
    std::int32_t best_id = 0;
    for (std::size_t i = 0; i + 1 < ids.size(); ++i) {
      const MergeTable::Value* m = merges.find(ids[i], ids[i + 1]);
      if (m != nullptr && (best_rank < 0 || m->rank < best_rank)) {
        best_rank = m->rank;
        best_pos = i;
        best_id = m->id;
      }
    }
    if (best_rank < 0) return;
    ids[best_pos] = best_id;
    ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(best_pos) + 1);
  }
}

void BpeModel::merge_heap(std::vector<std::int32_t>& ids, const MergeTable& merges) {
  struct Symbol {
    std::int32_t id, prev, next;
  };
  struct Candidate {
    std::int32_t rank, pos;
    // std::priority_queue pops the largest: make that the lowest rank, then the leftmost.
    bool operator<(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  const auto n = static_cast<std::int32_t>(ids.size());
  std::vector<Symbol> syms(ids.size());
  std::vector<Candidate> storage;
  storage.reserve(ids.size());
  for (std::int32_t i = 0; i < n; ++i) {
    syms[static_cast<std::size_t>(i)] = {ids[static_cast<std::size_t>(i)], i - 1,
                                         i + 1 < n ? i + 1 : -1};
    if (i + 1 < n) {
      if (const auto* m =
              merges.find(ids[static_cast<std::size_t>(i)], ids[static_cast<std::size_t>(i) + 1])) {
        storage.push_back({m->rank, i});
      }
    }
  }
  std::priority_queue<Candidate> queue(std::less<Candidate>{}, std::move(storage));
  constexpr std::int32_t kDead = -1;
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = syms[static_cast<std::size_t>(top.pos)];
    if (left.id == kDead || left.next < 0) continue;
    Symbol& right = syms[static_cast<std::size_t>(left.next)];
    const MergeTable::Value* m = merges.find(left.id, right.id);
    // Entries go stale when a neighbour merged first; a pair's rank identifies it uniquely.
    if (m == nullptr || m->rank != top.rank) continue;
    left.id = m->id;
    right.id = kDead;
    left.next = right.next;
    if (left.next >= 0) syms[static_cast<std::size_t>(left.next)].prev = top.pos;
    if (left.prev >= 0) {
      if (const auto* pm = merges.find(syms[static_cast<std::size_t>(left.prev)].id, left.id)) {
        queue.push({pm->rank, left.prev});
      }
    }
    if (left.next >= 0) {
      if (const auto* nm = merges.find(left.id, syms[static_cast<std::size_t>(left.next)].id)) {
        queue.push({nm->rank, top.pos});
      }
    }
  }
  ids.clear();
  for (std::int32_t i = 0; i >= 0; i = syms[static_cast<std::size_t>(i)].next) {
    ids.push_back(syms[static_cast<std::size_t>(i)].id);
  }
}

void BpeModel::encode_word(std::string_view bytes, std::vector<std::int32_t>& out) const {
  if (bytes.empty()) return;
  if (options_.ignore_merges) {
    const auto it = byte_vocab_.find(bytes);
    if (it != byte_vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = bytes.size() <= kMaxCachedWordBytes;
  if (cacheable && cache_.lookup(bytes, out)) return;

  thread_local std::vector<std::int32_t> ids;
  ids.clear();
  initial_symbols(bytes, ids);
  if (ids.size() <= kSmallWordSymbols) {
    merge_small(ids, merges_);
  } else {
    merge_heap(ids, merges_);
  }
  if (cacheable) cache_.insert(bytes, ids.data(), ids.size());
  out.insert(out.end(), ids.begin(), ids.end());
}

}  // namespace glmtune::data::detail
