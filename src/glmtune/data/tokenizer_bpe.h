#pragma once
// The BPE model of a byte-level tokenizer. Words arrive as raw bytes; their initial symbols are the
// vocabulary entries of the GPT-2 byte characters, which are then merged by merge rank (lowest
// first, leftmost first among equal ranks), as HF's BPE does.

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace glmtune::data::detail {

// Lets maps keyed by std::string be searched with a std::string_view without a copy.
struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

// GPT-2's reversible byte <-> printable character mapping.
const std::array<char32_t, 256>& byte_to_char();
// The byte a byte-level character stands for, or nullopt for any other character.
std::optional<std::uint8_t> char_to_byte(char32_t c);
// "Ġhello" -> " hello"; nullopt when a character is not a byte-level character.
std::optional<std::string> byte_level_to_bytes(std::string_view token);
std::string bytes_to_byte_level(std::string_view bytes);

struct BpeOptions {
  std::optional<std::string> unk_token;
  std::optional<std::string> continuing_subword_prefix;
  std::optional<std::string> end_of_word_suffix;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
};

// Open-addressing map from a merge pair of ids to (rank, merged id).
class MergeTable {
 public:
  struct Value {
    std::int32_t rank;
    std::int32_t id;
  };
  void reserve(std::size_t n);
  // Later insertions of the same pair overwrite earlier ones, as in HF.
  void insert(std::int32_t left, std::int32_t right, Value value);
  const Value* find(std::int32_t left, std::int32_t right) const {
    if (slots_.empty()) return nullptr;
    const std::uint64_t key = pack(left, right);
    for (std::size_t i = hash(key);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key == key) return &s.value;
      if (s.key == kEmpty) return nullptr;
    }
  }
  std::size_t size() const { return size_; }

 private:
  static constexpr std::uint64_t kEmpty = ~std::uint64_t{0};
  struct Slot {
    std::uint64_t key = kEmpty;
    Value value{};
  };
  static std::uint64_t pack(std::int32_t a, std::int32_t b) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) |
           static_cast<std::uint32_t>(b);
  }
  std::size_t hash(std::uint64_t key) const {
    return static_cast<std::size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_) & mask_;
  }
  void grow();
  std::vector<Slot> slots_;
  std::size_t mask_ = 0;
  int shift_ = 64;
  std::size_t size_ = 0;
};

// Bounded word -> ids cache shared by all threads. Sharded so that parallel encoders rarely wait;
// a full shard is emptied rather than evicted entry by entry, which keeps the hot set cheap.
class WordCache {
 public:
  explicit WordCache(std::size_t capacity);
  bool lookup(std::string_view word, std::vector<std::int32_t>& out) const;
  void insert(std::string_view word, const std::int32_t* ids, std::size_t n);

 private:
  static constexpr std::size_t kShards = 64;
  struct Shard {
    mutable std::shared_mutex mutex;
    StringMap<std::vector<std::int32_t>> map;
  };
  std::size_t shard_capacity_;
  std::unique_ptr<Shard[]> shards_;
};

class BpeModel {
 public:
  struct Merge {
    std::int32_t left, right, merged;
  };
  // `vocab`: token string -> id; `merges` in rank order, already resolved and checked by the
  // loader. `options.unk_token`, when set, must be in `vocab`.
  BpeModel(const StringMap<std::int32_t>& vocab, const std::vector<Merge>& merges,
           BpeOptions options);

  // Appends the ids of one pre-tokenized word given as raw bytes.
  void encode_word(std::string_view bytes, std::vector<std::int32_t>& out) const;

 private:
  // Initial symbols for a character: its id, or its byte-fallback ids, or nothing (unknown).
  struct Initial {
    std::int32_t id = -1;
    std::vector<std::int32_t> fallback;
  };
  void initial_symbols(std::string_view bytes, std::vector<std::int32_t>& ids) const;
  static void merge_small(std::vector<std::int32_t>& ids, const MergeTable& merges);
  static void merge_heap(std::vector<std::int32_t>& ids, const MergeTable& merges);

  BpeOptions options_;
  MergeTable merges_;
  // Indexed by [position kind][byte]; kind bit 0: not first (prefix), bit 1: last (suffix).
  std::array<std::array<Initial, 256>, 4> initial_;
  std::int32_t unk_id_ = -1;
  // Whole-word lookups for ignore_merges, keyed by raw bytes.
  StringMap<std::int32_t> byte_vocab_;
  mutable WordCache cache_;
};

}  // namespace glmtune::data::detail
