// `glmtune chat-template`: renders one conversation and prints what training would see.
//
// Output (one JSON object): `text` is exactly the released template's rendering (no trained final
// `<|endoftext|>`, which the template never writes), while `input_ids` / `loss_mask` are the
// training sequence, i.e. with that `<|endoftext|>` after a last trained assistant turn. Printing
// both lets a script compare the text against transformers and the ids against a training batch.

#include <cstdio>
#include <iostream>
#include <iterator>
#include <string>

#include "command.h"
#include "glmtune/base/error.h"
#include "glmtune/data/chat_template.h"
#include "glmtune/data/token_cache.h"
#include "glmtune/data/tokenizer.h"
#include "glmtune/io/mmap_file.h"

namespace {

using namespace glmtune;
using data::OrderedJson;

struct ChatTemplateArgs {
  std::string tokenizer;
  std::string messages;
  std::string template_name = "glm5.3";
};

std::string read_input(const std::string& path) {
  if (path == "-")
    return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  return io::read_text_file(path);
}

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
        const std::string where = a->messages == "-" ? "stdin" : a->messages;
        const auto kind = data::chat_template_from_name(a->template_name);
        const auto tok =
            data::Tokenizer::from_file(data::resolve_tokenizer_json(a->tokenizer).string());
        OrderedJson in;
        try {
          in = OrderedJson::parse(read_input(a->messages));
        } catch (const nlohmann::json::exception& e) {
          throw Error(std::string("not valid JSON: ") + e.what(), where,
                      "give one JSON object with a \"messages\" array");
        }
        if (!in.is_object() || !in.contains("messages") || !in["messages"].is_array())
          throw Error("expected a JSON object with a \"messages\" array", where);
        data::ChatTemplateOptions options;
        if (in.contains("reasoning_effort") && !in["reasoning_effort"].is_null()) {
          if (!in["reasoning_effort"].is_string())
            throw Error("\"reasoning_effort\" must be a string", where);
          options.reasoning_effort = in["reasoning_effort"].get<std::string>();
        }
        auto flag = [&](const char* key) {
          if (!in.contains(key) || in[key].is_null()) return false;
          if (!in[key].is_boolean())
            throw Error(std::string("\"") + key + "\" must be true or false", where);
          return in[key].get<bool>();
        };
        options.clear_thinking = flag("clear_thinking");
        options.add_generation_prompt = flag("add_generation_prompt");
        const OrderedJson tools = in.contains("tools") ? in["tools"] : OrderedJson();

        options.final_stop = false;
        const std::string text = data::render_chat(kind, in["messages"], tools, options).text();
        options.final_stop = true;
        const auto trained = data::render_chat(kind, in["messages"], tools, options);
        const auto sample = data::tokenize_segments(trained.segments, tok);
        OrderedJson mask = OrderedJson::array();
        for (int32_t label : sample.labels) mask.push_back(label == data::kIgnoreIndex ? 0 : 1);
        OrderedJson out = {{"text", text}, {"input_ids", sample.input_ids}, {"loss_mask", mask}};
        std::puts(out.dump().c_str());
        return 0;
      };
    });
