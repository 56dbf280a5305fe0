#pragma once
// Byte-level BPE tokenizer loaded from a Hugging Face tokenizer.json (the format GLM-5.3-Flash
// ships). Added/special tokens are matched before pre-tokenisation; the pre-tokenizer's Split regex
// runs through PCRE2 with JIT.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace glmtune::data {

class Tokenizer {
 public:
  // Throws glmtune::Error naming the file and the problem for anything it cannot load.
  static Tokenizer from_file(const std::string& path);
  static Tokenizer from_json(std::string_view json_text, const std::string& source_name);
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // Encodes text; added/special tokens written literally in `text` become their ids. Same ids as
  // HF `encode(text, add_special_tokens=False)`: the file's post_processor is not applied. Any
  // bytes are accepted; invalid UTF-8 is encoded through its byte tokens.
  std::vector<int32_t> encode(std::string_view text) const;
  // Encodes many texts on all cores; result[i] == encode(texts[i]).
  std::vector<std::vector<int32_t>> encode_batch(const std::vector<std::string>& texts) const;
  // Decodes ids back to text (special tokens included unless skip_special). Returns the exact
  // bytes, so decode(encode(x)) == x without a normalizer; ids that name no token are skipped.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  // Throws glmtune::Error when `token` is not in the vocabulary (names the token).
  int32_t require_id(std::string_view token) const;
  std::optional<std::string> id_to_token(int32_t id) const;
  // One past the largest id (base vocabulary and added tokens).
  int32_t vocab_size() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace glmtune::data
