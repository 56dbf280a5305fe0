#include "glmtune/data/tokenizer_unicode.h"

#include <algorithm>
#include <vector>

namespace glmtune::data::detail {
namespace {

inline bool is_cont(unsigned char c) { return (c & 0xC0) == 0x80; }

// Invalid bytes travel through normalisation as values above the code space so that they come
// out exactly as they went in.
constexpr char32_t kRawByteBase = 0x110000;

constexpr char32_t kHangulS = 0xAC00, kHangulL = 0x1100, kHangulV = 0x1161, kHangulT = 0x11A7;
constexpr char32_t kHangulLCount = 19, kHangulVCount = 21, kHangulTCount = 28;
constexpr char32_t kHangulNCount = kHangulVCount * kHangulTCount;
constexpr char32_t kHangulSCount = kHangulLCount * kHangulNCount;

std::uint8_t combining_class(char32_t cp) {
  if (cp < 0x300 || cp >= kRawByteBase) return 0;
  const CombiningClassRange* end = kCombiningClassRanges + kCombiningClassRangeCount;
  const CombiningClassRange* it =
      std::upper_bound(kCombiningClassRanges, end, cp,
                       [](char32_t value, const CombiningClassRange& r) { return value < r.lo; });
  if (it == kCombiningClassRanges) return 0;
  --it;
  return cp <= it->hi ? it->ccc : 0;
}

const CanonicalDecomposition* find_decomposition(char32_t cp) {
  if (cp < 0xC0 || cp >= kRawByteBase) return nullptr;
  const CanonicalDecomposition* end = kCanonicalDecompositions + kCanonicalDecompositionCount;
  const CanonicalDecomposition* it = std::lower_bound(
      kCanonicalDecompositions, end, cp,
      [](const CanonicalDecomposition& d, char32_t value) { return d.cp < value; });
  return (it != end && it->cp == cp) ? it : nullptr;
}

void decompose(char32_t cp, std::vector<char32_t>& out) {
  if (cp >= kHangulS && cp < kHangulS + kHangulSCount) {
    const char32_t s = cp - kHangulS;
    out.push_back(kHangulL + s / kHangulNCount);
    out.push_back(kHangulV + (s % kHangulNCount) / kHangulTCount);
    if (s % kHangulTCount != 0) out.push_back(kHangulT + s % kHangulTCount);
    return;
  }
  const CanonicalDecomposition* d = find_decomposition(cp);
  if (d == nullptr) {
    out.push_back(cp);
    return;
  }
  decompose(d->first, out);
  if (d->second != 0) decompose(d->second, out);
}

// Returns 0 when the pair has no primary composite.
char32_t compose(char32_t a, char32_t b) {
  if (a >= kHangulL && a < kHangulL + kHangulLCount && b >= kHangulV &&
      b < kHangulV + kHangulVCount) {
    return kHangulS + ((a - kHangulL) * kHangulVCount + (b - kHangulV)) * kHangulTCount;
  }
  if (a >= kHangulS && a < kHangulS + kHangulSCount && (a - kHangulS) % kHangulTCount == 0 &&
      b > kHangulT && b < kHangulT + kHangulTCount) {
    return a + (b - kHangulT);
  }
  if (a >= kRawByteBase || b >= kRawByteBase) return 0;
  const Composition* end = kCompositions + kCompositionCount;
  const Composition* it =
      std::lower_bound(kCompositions, end, std::make_pair(a, b),
                       [](const Composition& c, std::pair<char32_t, char32_t> v) {
                         return c.first != v.first ? c.first < v.first : c.second < v.second;
                       });
  return (it != end && it->first == a && it->second == b) ? it->composite : 0;
}

}  // namespace

Utf8Char decode_utf8(std::string_view s, std::size_t i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return {b0, 1, true};
  const std::size_t left = s.size() - i;
  auto byte = [&](std::size_t k) { return static_cast<unsigned char>(s[i + k]); };
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    if (left >= 2 && is_cont(byte(1))) {
      return {static_cast<char32_t>(((b0 & 0x1F) << 6) | (byte(1) & 0x3F)), 2, true};
    }
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    if (left >= 3) {
      const unsigned char b1 = byte(1);
      const bool ok1 = b0 == 0xE0   ? (b1 >= 0xA0 && b1 <= 0xBF)
                       : b0 == 0xED ? (b1 >= 0x80 && b1 <= 0x9F)
                                    : is_cont(b1);
      if (ok1 && is_cont(byte(2))) {
        return {static_cast<char32_t>(((b0 & 0x0F) << 12) | ((b1 & 0x3F) << 6) | (byte(2) & 0x3F)),
                3, true};
      }
    }
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    if (left >= 4) {
      const unsigned char b1 = byte(1);
      const bool ok1 = b0 == 0xF0   ? (b1 >= 0x90 && b1 <= 0xBF)
                       : b0 == 0xF4 ? (b1 >= 0x80 && b1 <= 0x8F)
                                    : is_cont(b1);
      if (ok1 && is_cont(byte(2)) && is_cont(byte(3))) {
        return {static_cast<char32_t>(((b0 & 0x07) << 18) | ((b1 & 0x3F) << 12) |
                                      ((byte(2) & 0x3F) << 6) | (byte(3) & 0x3F)),
                4, true};
      }
    }
  }
  return {b0, 1, false};
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool is_white_space(char32_t cp) {
  if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
  if (cp < 0x85) return false;
  return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
         cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

bool nfc_trivially_stable(std::string_view text) {
  // U+0300 starts with 0xCC; every lead byte below it is < 0xCC.
  for (char c : text) {
    if (static_cast<unsigned char>(c) >= 0xCC) return false;
  }
  return true;
}

std::string nfc(std::string_view text) {
  if (nfc_trivially_stable(text)) return std::string(text);

  std::vector<char32_t> buf;
  buf.reserve(text.size() + 8);
  for (std::size_t i = 0; i < text.size();) {
    const Utf8Char ch = decode_utf8(text, i);
    if (ch.valid) {
      decompose(ch.cp, buf);
    } else {
      buf.push_back(kRawByteBase + ch.cp);
    }
    i += static_cast<std::size_t>(ch.len);
  }

  // Canonical ordering: stable sort of every run of non-starters by combining class.
  for (std::size_t i = 0; i < buf.size();) {
    if (combining_class(buf[i]) == 0) {
      ++i;
      continue;
    }
    std::size_t j = i;
    while (j < buf.size() && combining_class(buf[j]) != 0) ++j;
    std::stable_sort(
        buf.begin() + static_cast<std::ptrdiff_t>(i), buf.begin() + static_cast<std::ptrdiff_t>(j),
        [](char32_t a, char32_t b) { return combining_class(a) < combining_class(b); });
    i = j;
  }

  // Canonical composition. last_class is the class of the last character kept after the current
  // starter; 256 marks "no starter seen yet", which blocks every composition.
  if (!buf.empty()) {
    std::size_t starter_pos = 0;
    int last_class = combining_class(buf[0]) == 0 ? 0 : 256;
    std::size_t write = 1;
    for (std::size_t read = 1; read < buf.size(); ++read) {
      const char32_t ch = buf[read];
      const int ch_class = combining_class(ch);
      const char32_t composite = last_class == 256 ? 0 : compose(buf[starter_pos], ch);
      if (composite != 0 && (last_class < ch_class || last_class == 0)) {
        buf[starter_pos] = composite;
        continue;
      }
      if (ch_class == 0) {
        starter_pos = write;
        last_class = 0;
      } else {
        last_class = last_class == 256 ? 256 : ch_class;
      }
      buf[write++] = ch;
    }
    buf.resize(write);
  }

  std::string out;
  out.reserve(text.size());
  for (char32_t cp : buf) {
    if (cp >= kRawByteBase) {
      out.push_back(static_cast<char>(cp - kRawByteBase));
    } else {
      append_utf8(out, cp);
    }
  }
  return out;
}

}  // namespace glmtune::data::detail
