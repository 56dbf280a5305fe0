// libFuzzer entry: arbitrary bytes encoded by two loaded tokenizers: the bundled tiny GLM-style one
// (Split regex + ByteLevel, many added tokens, no normalizer) and the GPT-2-style golden one (NFC
// normalizer, ByteLevel with add_prefix_space, single_word / lstrip / rstrip added tokens). Any
// bytes must encode to ids inside the vocabulary; without a normalizer decode(encode(x)) == x
// exactly; encode_batch agrees with encode. Anything else (a crash, a sanitizer report, an
// exception, a hang) is a bug.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "glmtune/base/error.h"
#include "glmtune/data/tokenizer.h"

namespace {

using namespace glmtune::data;
using glmtune::fuzz::bug;

const Tokenizer* g_tiny = nullptr;
const Tokenizer* g_gpt2 = nullptr;

std::vector<int32_t> checked_encode(const Tokenizer& tok, const std::string& text) {
  std::vector<int32_t> ids = tok.encode(text);
  for (int32_t id : ids)
    if (id < 0 || id >= tok.vocab_size() || !tok.id_to_token(id))
      bug("encode gave an id that names no token");
  return ids;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("OMP_NUM_THREADS", "1", 1);
  static Tokenizer tiny =
      Tokenizer::from_file(glmtune::fuzz::source_path("examples/tiny/tokenizer/tokenizer.json"));
  static Tokenizer gpt2 = Tokenizer::from_file(
      glmtune::fuzz::source_path("tests/golden/tokenizer/gpt2_style_tokenizer.json"));
  g_tiny = &tiny;
  g_gpt2 = &gpt2;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const std::vector<int32_t> ids = checked_encode(*g_tiny, text);
  if (g_tiny->decode(ids) != text) bug("tiny tokenizer: decode(encode(x)) != x");
  (void)g_tiny->decode(ids, /*skip_special=*/true);
  const std::vector<int32_t> ids2 = checked_encode(*g_gpt2, text);
  (void)g_gpt2->decode(ids2);
  // Encoding is a pure function of the text: two texts in one batch give what each gives alone.
  const auto batch = g_tiny->encode_batch({text, text.substr(0, size / 2)});
  if (batch.size() != 2 || batch[0] != ids || batch[1] != g_tiny->encode(text.substr(0, size / 2)))
    bug("encode_batch differs from encode");
  return 0;
}
