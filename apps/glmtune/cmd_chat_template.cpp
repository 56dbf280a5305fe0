// `glmtune chat-template`: renders one conversation and prints what training would see.
//
// Output (one JSON object): `text` is exactly the released template's rendering (no trained final
// `<|endoftext|>`, which the template never writes), while `input_ids` / `loss_mask` are the
// training sequence, i.e. with that `<|endoftext|>` after a last trained assistant turn. Printing
// both lets a script compare the text against transformers and the ids against a training batch.

#include <cstdio>
#include <string>

#include "chat_request.h"
#include "command.h"
#include "glmtune/base/error.h"
#include "glmtune/data/chat_template.h"
#include "glmtune/data/token_cache.h"
#include "glmtune/data/tokenizer.h"

namespace {

using namespace glmtune;
using data::OrderedJson;

struct ChatTemplateArgs {
  std::string tokenizer;
  std::string messages;
  std::string template_name = "glm5.3";
};

}  // namespace

GLMTUNE_COMMAND(
    chat_template, "chat-template",
    "Render a conversation: released-template text plus training ids and loss mask (JSON)",
    [](CLI::App& app) {
      auto a = std::make_shared<ChatTemplateArgs>();
      app.add_option("--tokenizer", a->tokenizer, "Tokenizer directory (or its tokenizer.json)")
          ->required();
      app.add_option("--messages", a->messages,
                     "JSON file with one object: messages, optional tools, reasoning_effort, "
                     "clear_thinking, add_generation_prompt ('-' reads stdin)")
          ->required();
      app.add_option("--template", a->template_name, "Chat template name")->capture_default_str();
      return [a] {
        const auto kind = data::chat_template_from_name(a->template_name);
        const auto tok =
            data::Tokenizer::from_file(data::resolve_tokenizer_json(a->tokenizer).string());
        cli::ChatRequest req = cli::read_chat_request(a->messages);
        data::ChatTemplateOptions& options = req.options;
        const OrderedJson& tools = req.tools;

        options.final_stop = false;
        const std::string text = data::render_chat(kind, req.messages, tools, options).text();
        options.final_stop = true;
        const auto trained = data::render_chat(kind, req.messages, tools, options);
        const auto sample = data::tokenize_segments(trained.segments, tok);
        OrderedJson mask = OrderedJson::array();
        for (int32_t label : sample.labels) mask.push_back(label == data::kIgnoreIndex ? 0 : 1);
        OrderedJson out = {{"text", text}, {"input_ids", sample.input_ids}, {"loss_mask", mask}};
        std::puts(out.dump().c_str());
        return 0;
      };
    });
