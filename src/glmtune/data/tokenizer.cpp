#include "glmtune/data/tokenizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "glmtune/base/error.h"
#include "glmtune/data/tokenizer_bpe.h"
#include "glmtune/data/tokenizer_regex.h"
#include "glmtune/data/tokenizer_unicode.h"

namespace glmtune::data {

using json = nlohmann::json;
using detail::BpeModel;
using detail::SplitPattern;
using detail::StringMap;

namespace {

// The pre-tokenizer regex of GPT-2, which a ByteLevel pre-tokenizer with use_regex applies.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

constexpr const char* kFixUseShippedFile =
    "use the tokenizer.json shipped with the model (Hugging Face `tokenizers` format)";

struct AddedToken {
  std::string content;
  std::int32_t id = 0;
  bool special = false;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
};

// Byte trie over added-token contents. Matching is leftmost-longest over non-overlapping matches,
// the way HF's AddedVocabulary finds them.
class TokenTrie {
 public:
  TokenTrie() : nodes_(1) {}

  void add(std::string_view pattern, std::int32_t token_index) {
    std::int32_t node = 0;
    for (char c : pattern) {
      const auto byte = static_cast<unsigned char>(c);
      std::int32_t child = find_child(node, byte);
      if (child < 0) {
        child = static_cast<std::int32_t>(nodes_.size());
        nodes_[static_cast<std::size_t>(node)].children.emplace_back(byte, child);
        nodes_.emplace_back();
      }
      node = child;
    }
    nodes_[static_cast<std::size_t>(node)].token = token_index;
    first_byte_[static_cast<unsigned char>(pattern.front())] = true;
    empty_ = false;
  }

  bool empty() const { return empty_; }

  // The longest pattern starting at text[pos]: sets `end` and returns its token index, or -1.
  std::int32_t longest_at(std::string_view text, std::size_t pos, std::size_t& end) const {
    if (!first_byte_[static_cast<unsigned char>(text[pos])]) return -1;
    std::int32_t node = 0;
    std::int32_t best = -1;
    for (std::size_t j = pos; j < text.size(); ++j) {
      node = find_child(node, static_cast<unsigned char>(text[j]));
      if (node < 0) break;
      const std::int32_t token = nodes_[static_cast<std::size_t>(node)].token;
      if (token >= 0) {
        best = token;
        end = j + 1;
      }
    }
    return best;
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, std::int32_t>> children;
    std::int32_t token = -1;
  };
  std::int32_t find_child(std::int32_t node, unsigned char byte) const {
    for (const auto& [b, child] : nodes_[static_cast<std::size_t>(node)].children) {
      if (b == byte) return child;
    }
    return -1;
  }
  std::vector<Node> nodes_;
  std::array<bool, 256> first_byte_{};
  bool empty_ = true;
};

// A piece of input after added-token matching: either text [begin, end) or an added token.
struct Segment {
  std::size_t begin, end;
  std::int32_t token;  // index into the added tokens, -1 for text
};

std::size_t trailing_space_start(std::string_view text) {
  std::size_t i = text.size();
  while (i > 0) {
    std::size_t lead = i - 1;
    while (lead > 0 && i - lead < 4 && (static_cast<unsigned char>(text[lead]) & 0xC0) == 0x80) {
      --lead;
    }
    const detail::Utf8Char ch = detail::decode_utf8(text, lead);
    if (!ch.valid || lead + static_cast<std::size_t>(ch.len) != i ||
        !detail::is_white_space(ch.cp)) {
      break;
    }
    i = lead;
  }
  return i;
}

std::size_t leading_space_length(std::string_view text) {
  std::size_t i = 0;
  while (i < text.size()) {
    const detail::Utf8Char ch = detail::decode_utf8(text, i);
    if (!ch.valid || !detail::is_white_space(ch.cp)) break;
    i += static_cast<std::size_t>(ch.len);
  }
  return i;
}

// Splits `text` around the added tokens of `trie`, applying single_word / lstrip / rstrip as HF
// does. A single_word match that touches a word is skipped whole: scanning resumes after it.
void split_added(std::string_view text, const TokenTrie& trie,
                 const std::vector<AddedToken>& tokens, std::vector<Segment>& out) {
  if (trie.empty()) {
    if (!text.empty()) out.push_back({0, text.size(), -1});
    return;
  }
  std::size_t consumed = 0;  // end of the last emitted segment
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t match_end = 0;
    const std::int32_t index = trie.longest_at(text, pos, match_end);
    if (index < 0) {
      ++pos;
      continue;
    }
    const AddedToken& token = tokens[static_cast<std::size_t>(index)];
    std::size_t start = pos;
    std::size_t stop = match_end;
    pos = match_end;
    if (token.single_word) {
      const bool free_before = start == 0 || !detail::is_word_char_at_end(text.substr(0, start));
      const bool free_after =
          stop == text.size() || !detail::is_word_char_at_start(text.substr(stop));
      if (!free_before || !free_after) continue;
    }
    if (token.lstrip) start = std::max(trailing_space_start(text.substr(0, start)), consumed);
    if (token.rstrip) stop += leading_space_length(text.substr(stop));
    if (consumed < start) out.push_back({consumed, start, -1});
    out.push_back({start, stop, index});
    consumed = stop;
  }
  if (consumed < text.size()) out.push_back({consumed, text.size(), -1});
}

// ---------------------------------------------------------------------------------------------
// Loading helpers: every problem names the file and the JSON path.

class Loader {
 public:
  explicit Loader(std::string source) : source_(std::move(source)) {}

  [[noreturn]] void fail(const std::string& path, const std::string& what,
                         const std::string& fix = kFixUseShippedFile) const {
    throw Error(what, path.empty() ? source_ : fmt::format("{}, at {}", source_, path), fix);
  }

  const json& member(const json& obj, const std::string& obj_path, const char* key) const {
    const auto it = obj.find(key);
    if (it == obj.end()) {
      fail(obj_path, fmt::format("missing required key \"{}\"", key));
    }
    return *it;
  }

  // Optional member: nullptr when absent or null.
  const json* optional(const json& obj, const char* key) const {
    const auto it = obj.find(key);
    return (it == obj.end() || it->is_null()) ? nullptr : &*it;
  }

  bool get_bool(const json& obj, const std::string& obj_path, const char* key, bool dflt) const {
    const json* v = optional(obj, key);
    if (v == nullptr) return dflt;
    if (!v->is_boolean()) fail(join(obj_path, key), "expected true or false");
    return v->get<bool>();
  }

  std::optional<std::string> get_string(const json& obj, const std::string& obj_path,
                                        const char* key) const {
    const json* v = optional(obj, key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_string()) fail(join(obj_path, key), "expected a string");
    return v->get<std::string>();
  }

  std::string type_of(const json& obj, const std::string& obj_path) const {
    if (!obj.is_object()) fail(obj_path, "expected an object with a \"type\"");
    const json& t = member(obj, obj_path, "type");
    if (!t.is_string()) fail(join(obj_path, "type"), "expected a string");
    return t.get<std::string>();
  }

  static std::string join(const std::string& base, const std::string& key) {
    return base.empty() ? key : base + "." + key;
  }
  static std::string index(const std::string& base, std::size_t i) {
    return fmt::format("{}[{}]", base, i);
  }
  static std::string quoted(std::string_view s) { return json(std::string(s)).dump(); }

  const std::string& source() const { return source_; }

 private:
  std::string source_;
};

std::int32_t get_id(const Loader& L, const json& v, const std::string& path) {
  if (!v.is_number_integer()) L.fail(path, "expected a non-negative integer token id");
  const auto raw = v.get<std::int64_t>();
  if (raw < 0 || raw >= std::numeric_limits<std::int32_t>::max()) {
    L.fail(path, fmt::format("token id {} is out of range (0 .. 2^31-2)", raw));
  }
  return static_cast<std::int32_t>(raw);
}

}  // namespace

// ---------------------------------------------------------------------------------------------

namespace detail {
// Everything between added-token matching and BPE, as read from the tokenizer.json.
struct PreTokenizerPipeline {
  bool nfc = false;
  std::vector<std::unique_ptr<SplitPattern>> splits;
  bool add_prefix_space = false;
  std::unique_ptr<SplitPattern> byte_level_split;
};
}  // namespace detail

struct Tokenizer::Impl {
  std::string source;
  StringMap<std::int32_t> vocab;
  std::vector<AddedToken> added;
  StringMap<std::int32_t> added_by_content;  // content -> index into `added`
  TokenTrie raw_trie;                        // added tokens matched before normalisation
  TokenTrie normalized_trie;                 // added tokens matched on normalised text
  detail::PreTokenizerPipeline pipeline;
  std::unique_ptr<BpeModel> bpe;

  // Per id: the token string (vocab form), its decoded bytes, and flags.
  std::vector<std::string> token_of;
  std::vector<std::string> bytes_of;
  std::vector<std::uint8_t> present;
  std::vector<std::uint8_t> special;

  void encode_normalized(std::string_view text, std::vector<std::int32_t>& out) const;
  void pre_tokenize(std::string_view text, std::size_t stage, std::vector<std::int32_t>& out) const;
  void encode_byte_level(std::string_view text, std::vector<std::int32_t>& out) const;
};

namespace {

void parse_normalizer(const Loader& L, const json& root, detail::PreTokenizerPipeline& impl) {
  const json* norm = L.optional(root, "normalizer");
  if (norm == nullptr) return;
  const std::string fix =
      "glmtune supports `\"normalizer\": null` and NFC (also inside a Sequence); use the model's "
      "own tokenizer.json";
  auto one = [&](const json& n, const std::string& path) {
    const std::string type = L.type_of(n, path);
    if (type != "NFC") {
      L.fail(L.join(path, "type"), fmt::format("unsupported normalizer \"{}\"", type), fix);
    }
    impl.nfc = true;
  };
  const std::string type = L.type_of(*norm, "normalizer");
  if (type == "Sequence") {
    const json& list = L.member(*norm, "normalizer", "normalizers");
    if (!list.is_array()) L.fail("normalizer.normalizers", "expected an array");
    for (std::size_t i = 0; i < list.size(); ++i) {
      one(list[i], L.index("normalizer.normalizers", i));
    }
  } else {
    one(*norm, "normalizer");
  }
}

std::unique_ptr<SplitPattern> compile_pattern(const Loader& L, std::string_view pattern,
                                              bool literal, const std::string& path) {
  try {
    return std::make_unique<SplitPattern>(pattern, literal);
  } catch (const std::invalid_argument& e) {
    L.fail(path, fmt::format("invalid regex {}: {}", Loader::quoted(pattern), e.what()),
           "fix the pattern (it is compiled by PCRE2 with Unicode properties) or use the model's "
           "own tokenizer.json");
  }
}

void parse_byte_level(const Loader& L, const json& bl, const std::string& path,
                      detail::PreTokenizerPipeline& impl) {
  impl.add_prefix_space = L.get_bool(bl, path, "add_prefix_space", true);
  if (L.get_bool(bl, path, "use_regex", true)) {
    impl.byte_level_split = compile_pattern(L, kGpt2Pattern, false, path);
  }
}

void parse_split(const Loader& L, const json& split, const std::string& path,
                 detail::PreTokenizerPipeline& impl) {
  const std::string fix =
      "glmtune supports Split with a Regex or String pattern, behavior \"Isolated\" and invert "
      "false (what GLM's tokenizer.json uses)";
  const json& pattern = L.member(split, path, "pattern");
  const std::string ppath = L.join(path, "pattern");
  if (!pattern.is_object() || pattern.size() != 1) {
    L.fail(ppath, "expected {\"Regex\": \"...\"} or {\"String\": \"...\"}", fix);
  }
  const bool literal = pattern.contains("String");
  if (!literal && !pattern.contains("Regex")) {
    L.fail(ppath, "expected {\"Regex\": \"...\"} or {\"String\": \"...\"}", fix);
  }
  const json& text = pattern.begin().value();
  const std::string tpath = L.join(ppath, literal ? "String" : "Regex");
  if (!text.is_string()) L.fail(tpath, "expected a string");
  if (text.get_ref<const std::string&>().empty()) L.fail(tpath, "the pattern is empty", fix);

  const std::optional<std::string> behavior = L.get_string(split, path, "behavior");
  if (behavior.value_or("") != "Isolated") {
    L.fail(L.join(path, "behavior"),
           fmt::format("unsupported Split behavior \"{}\"", behavior.value_or("(missing)")), fix);
  }
  if (L.get_bool(split, path, "invert", false)) {
    L.fail(L.join(path, "invert"), "inverted Split patterns are not supported", fix);
  }
  impl.splits.push_back(compile_pattern(L, text.get_ref<const std::string&>(), literal, tpath));
}

void parse_pre_tokenizer(const Loader& L, const json& root, detail::PreTokenizerPipeline& impl) {
  const std::string fix =
      "glmtune reads byte-level BPE tokenizers: the pre_tokenizer must be ByteLevel, or a "
      "Sequence of Split steps ending in ByteLevel";
  const json* pt = L.optional(root, "pre_tokenizer");
  if (pt == nullptr) {
    L.fail("pre_tokenizer", "no pre_tokenizer; a byte-level BPE tokenizer needs ByteLevel", fix);
  }
  const std::string type = L.type_of(*pt, "pre_tokenizer");
  if (type == "ByteLevel") {
    parse_byte_level(L, *pt, "pre_tokenizer", impl);
    return;
  }
  if (type != "Sequence") {
    L.fail("pre_tokenizer.type", fmt::format("unsupported pre-tokenizer \"{}\"", type), fix);
  }
  const std::string lpath = "pre_tokenizer.pretokenizers";
  const json& list = L.member(*pt, "pre_tokenizer", "pretokenizers");
  if (!list.is_array()) L.fail(lpath, "expected an array");
  if (list.empty()) L.fail(lpath, "the Sequence is empty; it must end in ByteLevel", fix);
  for (std::size_t i = 0; i < list.size(); ++i) {
    const std::string path = L.index(lpath, i);
    const std::string t = L.type_of(list[i], path);
    const bool last = i + 1 == list.size();
    if (last && t == "ByteLevel") {
      parse_byte_level(L, list[i], path, impl);
    } else if (!last && t == "Split") {
      parse_split(L, list[i], path, impl);
    } else if (last) {
      L.fail(L.join(path, "type"),
             fmt::format("the pre-tokenizer Sequence ends in \"{}\"; it must end in ByteLevel", t),
             fix);
    } else {
      L.fail(L.join(path, "type"), fmt::format("unsupported pre-tokenizer \"{}\"", t), fix);
    }
  }
}

void parse_decoder(const Loader& L, const json& root) {
  const std::string fix = "byte-level BPE tokenizers use {\"type\": \"ByteLevel\"} as decoder";
  const json* dec = L.optional(root, "decoder");
  if (dec == nullptr) L.fail("decoder", "no decoder; expected ByteLevel", fix);
  const std::string type = L.type_of(*dec, "decoder");
  if (type != "ByteLevel") {
    L.fail("decoder.type", fmt::format("unsupported decoder \"{}\"", type), fix);
  }
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

Tokenizer Tokenizer::from_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw Error("this is a directory, not a tokenizer file", path,
                "pass the path of tokenizer.json inside the model directory");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw Error(fmt::format("cannot open tokenizer file: {}", std::strerror(errno)), path,
                "check the path; it should point at the model's tokenizer.json");
  }
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) {
    throw Error("cannot read tokenizer file", path, "check the file's permissions and the disk");
  }
  return from_json(buffer.str(), path);
}

Tokenizer Tokenizer::from_json(std::string_view json_text, const std::string& source_name) {
  const Loader L(source_name);
  json root;
  try {
    root = json::parse(json_text.begin(), json_text.end());
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number like 1e999
    std::string msg = e.what();
    // Drop nlohmann's "[json.exception.parse_error.101] " tag; the rest says where and why.
    if (const auto close = msg.find("] ");
        msg.rfind("[json.exception", 0) == 0 && close != std::string::npos) {
      msg = msg.substr(close + 2);
    }
    L.fail("", fmt::format("not valid JSON: {}", msg),
           "the file is damaged or not a tokenizer.json; download the model's tokenizer.json "
           "again");
  }
  if (!root.is_object()) L.fail("", "expected a JSON object at the top level");

  auto impl = std::make_unique<Impl>();
  impl->source = source_name;

  // --- model -----------------------------------------------------------------------------------
  const json* model_ptr = L.optional(root, "model");
  if (model_ptr == nullptr) L.fail("model", "no \"model\" section; this is not a tokenizer.json");
  const json& model = *model_ptr;
  if (!model.is_object()) L.fail("model", "expected an object");
  if (const json* t = L.optional(model, "type")) {
    if (!t->is_string()) L.fail("model.type", "expected a string");
    if (t->get_ref<const std::string&>() != "BPE") {
      L.fail("model.type",
             fmt::format("unsupported model type \"{}\"; only BPE is supported",
                         t->get_ref<const std::string&>()),
             "glmtune reads byte-level BPE tokenizers such as GLM's; use the model's own "
             "tokenizer.json");
    }
  } else if (!model.contains("merges")) {
    L.fail("model.type", "the model has no \"type\" and no \"merges\"; expected a BPE model");
  }

  const json* vocab_json = L.optional(model, "vocab");
  if (vocab_json == nullptr) L.fail("model.vocab", "missing the BPE vocabulary");
  if (!vocab_json->is_object()) L.fail("model.vocab", "expected an object of token -> id");
  std::int32_t max_id = -1;
  {
    // Ids index flat tables, so a stray huge id would allocate gigabytes; real vocabularies are
    // dense. Check the range before allocating.
    std::vector<std::pair<std::string_view, std::int32_t>> entries;
    entries.reserve(vocab_json->size());
    for (auto it = vocab_json->begin(); it != vocab_json->end(); ++it) {
      const std::int32_t id =
          get_id(L, it.value(), fmt::format("model.vocab[{}]", Loader::quoted(it.key())));
      entries.emplace_back(it.key(), id);
      max_id = std::max(max_id, id);
    }
    const std::int64_t limit = 2 * static_cast<std::int64_t>(entries.size()) + (1 << 20);
    if (max_id >= limit) {
      const auto far = std::find_if(entries.begin(), entries.end(),
                                    [&](const auto& e) { return e.second == max_id; });
      L.fail(fmt::format("model.vocab[{}]", Loader::quoted(far->first)),
             fmt::format("id {} is far beyond the {} vocabulary entries", max_id, entries.size()));
    }
    impl->token_of.resize(static_cast<std::size_t>(max_id) + 1);
    impl->present.resize(static_cast<std::size_t>(max_id) + 1, 0);
    impl->vocab.reserve(entries.size());
    for (const auto& [token, id] : entries) {
      const auto slot = static_cast<std::size_t>(id);
      if (impl->present[slot]) {
        L.fail(fmt::format("model.vocab[{}]", Loader::quoted(token)),
               fmt::format("id {} is also used by {}", id, Loader::quoted(impl->token_of[slot])));
      }
      impl->present[slot] = 1;
      impl->token_of[slot] = std::string(token);
      impl->vocab.emplace(token, id);
    }
  }
  if (impl->vocab.empty()) L.fail("model.vocab", "the vocabulary is empty");

  detail::BpeOptions options;
  options.unk_token = L.get_string(model, "model", "unk_token");
  options.continuing_subword_prefix = L.get_string(model, "model", "continuing_subword_prefix");
  options.end_of_word_suffix = L.get_string(model, "model", "end_of_word_suffix");
  options.fuse_unk = L.get_bool(model, "model", "fuse_unk", false);
  options.byte_fallback = L.get_bool(model, "model", "byte_fallback", false);
  options.ignore_merges = L.get_bool(model, "model", "ignore_merges", false);
  if (options.unk_token && !impl->vocab.contains(*options.unk_token)) {
    L.fail("model.unk_token",
           fmt::format("unk_token {} is not in model.vocab", Loader::quoted(*options.unk_token)));
  }
  if (const json* dropout = L.optional(model, "dropout")) {
    if (!dropout->is_number()) L.fail("model.dropout", "expected a number or null");
    if (dropout->get<double>() != 0.0) {
      L.fail("model.dropout", "BPE dropout is not supported (tokenization must be deterministic)",
             "set \"dropout\" to null in tokenizer.json");
    }
  }

  std::vector<BpeModel::Merge> merges;
  {
    const json* merges_json = L.optional(model, "merges");
    if (merges_json == nullptr) L.fail("model.merges", "missing the BPE merges");
    if (!merges_json->is_array()) L.fail("model.merges", "expected an array");
    const std::size_t prefix_len =
        options.continuing_subword_prefix ? options.continuing_subword_prefix->size() : 0;
    merges.reserve(merges_json->size());
    auto lookup = [&](const std::string& token, const std::string& path, const char* role) {
      const auto it = impl->vocab.find(token);
      if (it == impl->vocab.end()) {
        L.fail(path, fmt::format("merge {} {} is not in model.vocab", role, Loader::quoted(token)),
               "the merges do not belong to this vocabulary; use the model's own, unmodified "
               "tokenizer.json");
      }
      return it->second;
    };
    std::string left, right;
    for (std::size_t i = 0; i < merges_json->size(); ++i) {
      const json& m = (*merges_json)[i];
      const std::string path = L.index("model.merges", i);
      if (m.is_string()) {
        const std::string& s = m.get_ref<const std::string&>();
        const std::size_t space = s.find(' ');
        if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
          L.fail(path, fmt::format("merge {} is not two tokens separated by one space",
                                   Loader::quoted(s)));
        }
        left.assign(s, 0, space);
        right.assign(s, space + 1);
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        left = m[0].get<std::string>();
        right = m[1].get<std::string>();
      } else {
        L.fail(path, "a merge must be \"left right\" or [\"left\", \"right\"]");
      }
      const std::int32_t a = lookup(left, path, "token");
      const std::int32_t b = lookup(right, path, "token");
      if (right.size() < prefix_len) {
        L.fail(path, fmt::format("merge token {} is shorter than continuing_subword_prefix",
                                 Loader::quoted(right)));
      }
      const std::int32_t merged = lookup(left + right.substr(prefix_len), path, "result");
      merges.push_back({a, b, merged});
    }
  }
  impl->bpe = std::make_unique<BpeModel>(impl->vocab, merges, options);

  // --- normalizer, pre-tokenizer, decoder (the post-processor is not applied) -----------------
  parse_normalizer(L, root, impl->pipeline);
  parse_pre_tokenizer(L, root, impl->pipeline);
  parse_decoder(L, root);

  // --- added tokens ----------------------------------------------------------------------------
  if (const json* added = L.optional(root, "added_tokens")) {
    if (!added->is_array()) L.fail("added_tokens", "expected an array");
    std::int32_t max_added = -1;
    for (std::size_t i = 0; i < added->size(); ++i) {
      const json& a = (*added)[i];
      const std::string path = L.index("added_tokens", i);
      if (!a.is_object()) L.fail(path, "expected an object");
      AddedToken t;
      t.id = get_id(L, L.member(a, path, "id"), L.join(path, "id"));
      const json& content = L.member(a, path, "content");
      if (!content.is_string() || content.get_ref<const std::string&>().empty()) {
        L.fail(L.join(path, "content"), "expected a non-empty string");
      }
      t.content = content.get<std::string>();
      t.special = L.get_bool(a, path, "special", false);
      t.single_word = L.get_bool(a, path, "single_word", false);
      t.lstrip = L.get_bool(a, path, "lstrip", false);
      t.rstrip = L.get_bool(a, path, "rstrip", false);
      t.normalized = L.get_bool(a, path, "normalized", !t.special);
      if (impl->added_by_content.contains(t.content)) {
        L.fail(L.join(path, "content"),
               fmt::format("added token {} is listed twice", Loader::quoted(t.content)));
      }
      // HF ignores the stored id: a token already in the vocabulary keeps that id, any other one
      // gets the next id after the vocabulary and the added tokens so far. Ids that disagree
      // would silently shift every id the model was trained with, so refuse them.
      const auto in_vocab = impl->vocab.find(t.content);
      const std::int32_t expected =
          in_vocab != impl->vocab.end()
              ? in_vocab->second
              : std::max(static_cast<std::int32_t>(impl->vocab.size()), max_added + 1);
      if (t.id != expected) {
        L.fail(L.join(path, "id"),
               fmt::format("added token {} has id {}, but Hugging Face tokenizers assigns it id "
                           "{} ({})",
                           Loader::quoted(t.content), t.id, expected,
                           in_vocab != impl->vocab.end()
                               ? "its id in model.vocab"
                               : "the next id after model.vocab and the earlier added tokens"),
               "added tokens must follow the vocabulary in order; use the model's own "
               "tokenizer.json");
      }
      if (in_vocab == impl->vocab.end() && static_cast<std::size_t>(t.id) < impl->present.size() &&
          impl->present[static_cast<std::size_t>(t.id)]) {
        L.fail(L.join(path, "id"),
               fmt::format("id {} of added token {} is already used by {} in model.vocab", t.id,
                           Loader::quoted(t.content),
                           Loader::quoted(impl->token_of[static_cast<std::size_t>(t.id)])));
      }
      max_added = std::max(max_added, t.id);
      max_id = std::max(max_id, t.id);
      impl->added_by_content.emplace(t.content, static_cast<std::int32_t>(impl->added.size()));
      impl->added.push_back(std::move(t));
    }
  }

  // Tables by id. Added tokens take precedence over the vocabulary entry of the same id, as HF's
  // id_to_token does.
  const auto n = static_cast<std::size_t>(max_id) + 1;
  impl->token_of.resize(n);
  impl->present.resize(n, 0);
  impl->special.assign(n, 0);
  for (const AddedToken& t : impl->added) {
    const auto id = static_cast<std::size_t>(t.id);
    impl->token_of[id] = t.content;
    impl->present[id] = 1;
    impl->special[id] = t.special ? 1 : 0;
  }
  // HF's ByteLevel decoder maps a token character by character when every character is a
  // byte-level one and passes its UTF-8 through unchanged otherwise; added tokens included.
  impl->bytes_of.resize(n);
  for (std::size_t id = 0; id < n; ++id) {
    if (!impl->present[id]) continue;
    std::optional<std::string> bytes = detail::byte_level_to_bytes(impl->token_of[id]);
    impl->bytes_of[id] = bytes ? std::move(*bytes) : impl->token_of[id];
  }

  for (std::size_t i = 0; i < impl->added.size(); ++i) {
    const AddedToken& t = impl->added[i];
    const auto index = static_cast<std::int32_t>(i);
    if (!t.normalized) {
      impl->raw_trie.add(t.content, index);
    } else if (impl->pipeline.nfc) {
      impl->normalized_trie.add(detail::nfc(t.content), index);
    } else {
      impl->normalized_trie.add(t.content, index);
    }
  }
  return Tokenizer(std::move(impl));
}

// ---------------------------------------------------------------------------------------------
// Encoding: added tokens (raw) -> normalizer -> added tokens (normalised) -> Split steps ->
// ByteLevel -> BPE.

void Tokenizer::Impl::encode_normalized(std::string_view text,
                                        std::vector<std::int32_t>& out) const {
  std::string storage;
  if (pipeline.nfc && !detail::nfc_trivially_stable(text)) {
    storage = detail::nfc(text);
    text = storage;
  }
  if (normalized_trie.empty()) {
    pre_tokenize(text, 0, out);
    return;
  }
  std::vector<Segment> segments;
  split_added(text, normalized_trie, added, segments);
  for (const Segment& s : segments) {
    if (s.token >= 0) {
      out.push_back(added[static_cast<std::size_t>(s.token)].id);
    } else {
      pre_tokenize(text.substr(s.begin, s.end - s.begin), 0, out);
    }
  }
}

void Tokenizer::Impl::pre_tokenize(std::string_view text, std::size_t stage,
                                   std::vector<std::int32_t>& out) const {
  if (stage == pipeline.splits.size()) {
    encode_byte_level(text, out);
    return;
  }
  std::vector<std::pair<std::size_t, std::size_t>> pieces;
  pipeline.splits[stage]->split_isolated(text, pieces);
  for (const auto& [b, e] : pieces) pre_tokenize(text.substr(b, e - b), stage + 1, out);
}

void Tokenizer::Impl::encode_byte_level(std::string_view text,
                                        std::vector<std::int32_t>& out) const {
  std::string prefixed;
  if (pipeline.add_prefix_space && !text.empty() && text.front() != ' ') {
    prefixed.reserve(text.size() + 1);
    prefixed.push_back(' ');
    prefixed.append(text);
    text = prefixed;
  }
  if (!pipeline.byte_level_split) {
    bpe->encode_word(text, out);
    return;
  }
  std::vector<std::pair<std::size_t, std::size_t>> pieces;
  pipeline.byte_level_split->split_isolated(text, pieces);
  for (const auto& [b, e] : pieces) bpe->encode_word(text.substr(b, e - b), out);
}

std::vector<std::int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<std::int32_t> out;
  out.reserve(text.size() / 3 + 4);
  std::vector<Segment> segments;
  split_added(text, impl_->raw_trie, impl_->added, segments);
  for (const Segment& s : segments) {
    if (s.token >= 0) {
      out.push_back(impl_->added[static_cast<std::size_t>(s.token)].id);
    } else {
      impl_->encode_normalized(text.substr(s.begin, s.end - s.begin), out);
    }
  }
  return out;
}

std::vector<std::vector<std::int32_t>> Tokenizer::encode_batch(
    const std::vector<std::string>& texts) const {
  std::vector<std::vector<std::int32_t>> out(texts.size());
  std::exception_ptr error;
  const auto n = static_cast<std::int64_t>(texts.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t i = 0; i < n; ++i) {
    try {
      out[static_cast<std::size_t>(i)] = encode(texts[static_cast<std::size_t>(i)]);
    } catch (...) {
#pragma omp critical(glmtune_tokenizer_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  return out;
}

std::string Tokenizer::decode(const std::vector<std::int32_t>& ids, bool skip_special) const {
  std::string out;
  const auto n = impl_->bytes_of.size();
  for (const std::int32_t id : ids) {
    // Ids without a token (negative, padding rows past the vocabulary) are skipped, as in HF.
    if (id < 0 || static_cast<std::size_t>(id) >= n ||
        !impl_->present[static_cast<std::size_t>(id)]) {
      continue;
    }
    if (skip_special && impl_->special[static_cast<std::size_t>(id)]) continue;
    out += impl_->bytes_of[static_cast<std::size_t>(id)];
  }
  return out;
}

std::optional<std::int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (const auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end()) {
    return impl_->added[static_cast<std::size_t>(it->second)].id;
  }
  if (const auto it = impl_->vocab.find(token); it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

std::int32_t Tokenizer::require_id(std::string_view token) const {
  if (const std::optional<std::int32_t> id = token_to_id(token)) return *id;
  throw Error(fmt::format("token {} is not in the tokenizer's vocabulary", Loader::quoted(token)),
              impl_->source,
              "check the token's spelling, or use the tokenizer.json that belongs to the model");
}

std::optional<std::string> Tokenizer::id_to_token(std::int32_t id) const {
  if (id < 0 || static_cast<std::size_t>(id) >= impl_->present.size() ||
      !impl_->present[static_cast<std::size_t>(id)]) {
    return std::nullopt;
  }
  return impl_->token_of[static_cast<std::size_t>(id)];
}

std::int32_t Tokenizer::vocab_size() const {
  return static_cast<std::int32_t>(impl_->present.size());
}

}  // namespace glmtune::data
