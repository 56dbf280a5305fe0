#include "glmtune/data/tokenizer_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <fmt/format.h>
#include <pcre2.h>

#include <stdexcept>

#include "glmtune/data/tokenizer_unicode.h"

namespace glmtune::data::detail {
namespace {

constexpr std::string_view kOnigWordClass = R"(\p{Alphabetic}\p{M}\p{N}\p{Pc})";
// The word-character set of HF's single_word test (Unicode \w of Rust's regex crate).
constexpr std::string_view kHfWordCharPattern =
    R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}])";

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  const int n = pcre2_get_error_message(code, buffer, sizeof(buffer));
  return n < 0 ? fmt::format("PCRE2 error {}", code) : std::string(reinterpret_cast<char*>(buffer));
}

// Per-thread matching state. Match data with one pair is enough: only the overall match is read.
// The JIT stack is sized for long runs of a single class (e.g. a megabyte of spaces), and the
// match limit is lifted: the split patterns backtrack linearly over a whitespace run, so a run of
// tens of megabytes is slow but legitimate input, never a reason to fail.
struct ThreadMatchState {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;

  ThreadMatchState() {
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    jit_stack = pcre2_jit_stack_create(64 * 1024, 16 * 1024 * 1024, nullptr);
    if (data == nullptr || context == nullptr || jit_stack == nullptr) throw std::bad_alloc();
    pcre2_jit_stack_assign(context, nullptr, jit_stack);
    pcre2_set_match_limit(context, ~uint32_t{0});
  }
  ~ThreadMatchState() {
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
  ThreadMatchState(const ThreadMatchState&) = delete;
  ThreadMatchState& operator=(const ThreadMatchState&) = delete;
};

ThreadMatchState& thread_state() {
  thread_local ThreadMatchState state;
  return state;
}

pcre2_code* compile_or_throw(std::string_view pattern, uint32_t options) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   options, &error, &offset, nullptr);
  if (code == nullptr) {
    throw std::invalid_argument(
        fmt::format("{} at offset {} of the pattern", pcre2_message(error), offset));
  }
  // JIT is an optimisation only: pcre2_match falls back to the interpreter when it is missing.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  return code;
}

constexpr uint32_t kBaseOptions = PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF;

// Returns the match [start, end) at or after `from`, or false when there is none.
bool find(const pcre2_code* code, std::string_view text, std::size_t from, std::size_t& start,
          std::size_t& end) {
  ThreadMatchState& st = thread_state();
  const int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), from, 0,
                             st.data, st.context);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) {
    // Only resource limits can get here (the pattern compiled and the subject may be invalid
    // UTF-8); they are a limitation of this process, not of the user's input.
    throw std::runtime_error(
        fmt::format("tokenizer pre-tokenizer regex failed: {}", pcre2_message(rc)));
  }
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.data);
  start = ov[0];
  end = ov[1];
  return true;
}

const pcre2_code* hf_word_char_code() {
  // Anchored at both ends so that it tests exactly one character.
  static pcre2_code* code = compile_or_throw(fmt::format("^{}$", kHfWordCharPattern), kBaseOptions);
  return code;
}

bool is_hf_word_char(std::string_view ch) {
  std::size_t s = 0, e = 0;
  return find(hf_word_char_code(), ch, 0, s, e);
}

}  // namespace

std::string onig_to_pcre2(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 32);
  bool in_class = false;
  for (std::size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[++i];
      switch (e) {
        case 's':
          out += R"(\p{White_Space})";
          break;
        case 'S':
          out += R"(\P{White_Space})";
          break;
        case 'w':
          out += in_class ? std::string(kOnigWordClass) : fmt::format("[{}]", kOnigWordClass);
          break;
        case 'h':
          out += in_class ? "0-9a-fA-F" : "[0-9a-fA-F]";
          break;
        case 'W':
        case 'H':
          if (in_class) {
            throw std::invalid_argument(fmt::format(
                "\\{} inside a character class at offset {} is not supported", e, i - 1));
          }
          out += e == 'W' ? fmt::format("[^{}]", kOnigWordClass) : "[^0-9a-fA-F]";
          break;
        case 'Q': {
          // Quoted text is literal up to \E; copy it untouched.
          const std::size_t close = p.find("\\E", i + 1);
          const std::size_t stop = close == std::string_view::npos ? p.size() : close + 2;
          out += p.substr(i - 1, stop - (i - 1));
          i = stop - 1;
          break;
        }
        default:
          out.push_back('\\');
          out.push_back(e);
      }
      continue;
    }
    if (in_class) {
      if (c == '[' && i + 1 < p.size() && p[i + 1] == ':') {
        // POSIX bracket expression such as [:alpha:]; both engines read it the same way.
        const std::size_t close = p.find(":]", i + 2);
        if (close == std::string_view::npos) {
          throw std::invalid_argument(
              fmt::format("unterminated POSIX class at offset {} of the pattern", i));
        }
        out += p.substr(i, close + 2 - i);
        i = close + 1;
        continue;
      }
      if (c == '[') {
        throw std::invalid_argument(
            fmt::format("nested character class at offset {} is not supported", i));
      }
      if (c == '&' && i + 1 < p.size() && p[i + 1] == '&') {
        throw std::invalid_argument(
            fmt::format("character class intersection (&&) at offset {} is not supported", i));
      }
      if (c == ']') in_class = false;
      out.push_back(c);
      continue;
    }
    out.push_back(c);
    if (c == '[') {
      in_class = true;
      // A ']' right after '[' or '[^' is a literal member, not the end of the class.
      if (i + 1 < p.size() && p[i + 1] == '^') out.push_back(p[++i]);
      if (i + 1 < p.size() && p[i + 1] == ']') out.push_back(p[++i]);
    }
  }
  return out;
}

struct SplitPattern::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

SplitPattern::SplitPattern(std::string_view pattern, bool literal)
    : code_(std::make_unique<Code>()) {
  if (literal) {
    code_->code = compile_or_throw(pattern, kBaseOptions | PCRE2_LITERAL);
  } else {
    code_->code =
        compile_or_throw(onig_to_pcre2(pattern), kBaseOptions | PCRE2_MULTILINE | PCRE2_DOTALL);
  }
}

SplitPattern::~SplitPattern() = default;

void SplitPattern::split_isolated(std::string_view text,
                                  std::vector<std::pair<std::size_t, std::size_t>>& out) const {
  std::size_t prev = 0;  // end of the last piece emitted
  std::size_t from = 0;  // where the next search starts
  std::size_t start = 0, end = 0;
  while (from <= text.size() && find(code_->code, text, from, start, end)) {
    if (start > prev) out.emplace_back(prev, start);
    if (end > start) {
      out.emplace_back(start, end);
      from = end;
    } else {
      // An empty match: step over one character so the scan advances.
      if (start >= text.size()) {
        prev = start;
        break;
      }
      from = start + utf8_len_at(text, start);
    }
    prev = end;
  }
  if (prev < text.size()) out.emplace_back(prev, text.size());
}

bool is_word_char_at_end(std::string_view text) {
  if (text.empty()) return false;
  std::size_t i = text.size() - 1;
  // Walk back to the lead byte of the last character (at most three continuation bytes).
  while (i > 0 && text.size() - i < 4 && (static_cast<unsigned char>(text[i]) & 0xC0) == 0x80) --i;
  const Utf8Char ch = decode_utf8(text, i);
  if (!ch.valid || i + static_cast<std::size_t>(ch.len) != text.size()) return false;
  return is_hf_word_char(text.substr(i));
}

bool is_word_char_at_start(std::string_view text) {
  if (text.empty()) return false;
  const Utf8Char ch = decode_utf8(text, 0);
  if (!ch.valid) return false;
  return is_hf_word_char(text.substr(0, static_cast<std::size_t>(ch.len)));
}

}  // namespace glmtune::data::detail
