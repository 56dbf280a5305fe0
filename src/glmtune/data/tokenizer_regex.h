#pragma once
// PCRE2-backed pattern for the pre-tokenizer's Split step. Hugging Face tokenizers runs these
// patterns through Oniguruma, so the pattern is first rewritten where the two engines disagree
// (see onig_to_pcre2) and compiled so that ^/$ work per line and `.` matches newlines, as they do
// there.

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace glmtune::data::detail {

// Rewrites Oniguruma escapes whose meaning differs in PCRE2 under UCP: \s and \S become the
// White_Space property (PCRE2 also counts U+180E), \w/\W become Oniguruma's word class, and \h/\H
// are hexadecimal digits. Throws std::invalid_argument for Oniguruma-only class syntax (nested
// classes, `&&`, a negated class escape inside a class) that would change meaning silently.
std::string onig_to_pcre2(std::string_view pattern);

class SplitPattern {
 public:
  // `literal`: match `pattern` as plain text (HF's {"String": ...} pattern). Throws
  // std::invalid_argument with PCRE2's message and the offset when the pattern does not compile.
  SplitPattern(std::string_view pattern, bool literal);
  ~SplitPattern();
  SplitPattern(const SplitPattern&) = delete;
  SplitPattern& operator=(const SplitPattern&) = delete;

  // Appends the [begin, end) byte ranges of `text` (offsets relative to text) that the "Isolated"
  // split behaviour yields: every match and every stretch between matches, empty pieces dropped.
  // Empty matches only separate neighbouring stretches, as they do in HF. Invalid UTF-8 never
  // matches, so it ends up in the stretches between matches.
  void split_isolated(std::string_view text,
                      std::vector<std::pair<std::size_t, std::size_t>>& out) const;

 private:
  struct Code;
  std::unique_ptr<Code> code_;
};

// Tests for HF's single_word added-token rule: a letter, mark, number or underscore next to the
// token makes it part of a longer word.
bool is_word_char_at_end(std::string_view text);
bool is_word_char_at_start(std::string_view text);

}  // namespace glmtune::data::detail
