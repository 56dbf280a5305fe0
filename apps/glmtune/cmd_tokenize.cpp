// `glmtune tokenize`: one JSON string per stdin line in, one JSON array of token ids per stdout
// line out. Meant for scripts and parity checks against other tokenizers, so the ids are exactly
// Tokenizer::encode's (no special tokens added; special tokens written in the text are matched).

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "command.h"
#include "glmtune/base/error.h"
#include "glmtune/data/token_cache.h"
#include "glmtune/data/tokenizer.h"

namespace {

using namespace glmtune;

struct TokenizeArgs {
  std::string tokenizer;
};

}  // namespace

GLMTUNE_COMMAND(
    tokenize, "tokenize",
    "Encode text: one JSON string per stdin line -> one JSON array of token ids per line",
    [](CLI::App& app) {
      auto a = std::make_shared<TokenizeArgs>();
      app.add_option("--tokenizer", a->tokenizer, "Tokenizer directory (or its tokenizer.json)")
          ->required();
      return [a] {
        const auto tok =
            data::Tokenizer::from_file(data::resolve_tokenizer_json(a->tokenizer).string());
        std::ios::sync_with_stdio(false);
        std::string line, out;
        int64_t number = 0;
        while (std::getline(std::cin, line)) {
          ++number;
          // Accept CRLF input: the carriage return is line ending, not text.
          if (!line.empty() && line.back() == '\r') line.pop_back();
          nlohmann::json value;
          try {
            value = nlohmann::json::parse(line);
          } catch (const nlohmann::json::exception&) {
            value = nullptr;
          }
          // A bad line stops the run: emitting a placeholder would silently shift every later
          // line's ids against the caller's input.
          if (!value.is_string())
            throw Error("expected one JSON string per line", "stdin line " + std::to_string(number),
                        "write each text as a JSON string, e.g. \"Hello\\nworld\"");
          const auto ids = tok.encode(value.get_ref<const std::string&>());
          out.clear();
          out += '[';
          for (size_t i = 0; i < ids.size(); ++i) {
            if (i) out += ',';
            out += std::to_string(ids[i]);
          }
          out += "]\n";
          std::fwrite(out.data(), 1, out.size(), stdout);
        }
        std::fflush(stdout);
        return 0;
      };
    });
