// libFuzzer entry: arbitrary bytes as a tokenizer.json. Every input must either be rejected with a
// glmtune::Error or give a tokenizer that works: encoding a probe text (and the input itself)
// gives ids the tokenizer can name, which decode and id_to_token / token_to_id agree on.
// Anything else escaping (a crash, a sanitizer report, another exception, a hang, an allocation
// the file's size does not justify) is a bug.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_util.h"
#include "glmtune/base/error.h"
#include "glmtune/data/tokenizer.h"

namespace {

using namespace glmtune::data;
using glmtune::fuzz::bug;

void check_encoding(const Tokenizer& tok, std::string_view text) {
  const std::vector<int32_t> ids = tok.encode(text);
  for (int32_t id : ids) {
    if (id < 0 || id >= tok.vocab_size()) bug("encode gave an id outside the vocabulary");
    const std::optional<std::string> token = tok.id_to_token(id);
    if (!token) bug("encode gave an id that names no token");
    const std::optional<int32_t> back = tok.token_to_id(*token);
    if (!back) bug("token_to_id does not know a token that id_to_token gave");
  }
  (void)tok.decode(ids);
  (void)tok.decode(ids, /*skip_special=*/true);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::optional<Tokenizer> tok;
  try {
    tok.emplace(Tokenizer::from_json(text, "fuzz tokenizer.json"));
  } catch (const glmtune::Error& e) {
    if (e.where().empty()) bug("a rejected tokenizer.json does not name the file");
    return 0;
  }
  check_encoding(*tok, "Hello, world! <|endoftext|> caf\xc3\xa9 \xe2\x80\x94 123456 \n\n\t  x");
  check_encoding(*tok, text.substr(0, 512));
  return 0;
}
