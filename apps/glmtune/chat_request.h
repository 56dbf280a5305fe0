#pragma once
// The conversation request that `glmtune chat-template` and `glmtune preprocess` read: one JSON
// object with a "messages" array and optional "tools", "reasoning_effort", "clear_thinking" and
// "add_generation_prompt", from a file or from stdin ("-").

#include <string>

#include "glmtune/data/chat_template.h"

namespace glmtune::cli {

struct ChatRequest {
  data::OrderedJson messages;
  data::OrderedJson tools;  // null when absent
  data::ChatTemplateOptions options;
  std::string where;  // the file name, or "stdin"
};

// Throws glmtune::Error naming the file for text that is not such an object.
ChatRequest read_chat_request(const std::string& path);

}  // namespace glmtune::cli
