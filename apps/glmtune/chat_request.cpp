#include "chat_request.h"

#include <iostream>
#include <iterator>

#include "glmtune/base/error.h"
#include "glmtune/io/mmap_file.h"

namespace glmtune::cli {

ChatRequest read_chat_request(const std::string& path) {
  using data::OrderedJson;
  ChatRequest r;
  r.where = path == "-" ? "stdin" : path;
  const std::string text = path == "-" ? std::string(std::istreambuf_iterator<char>(std::cin),
                                                     std::istreambuf_iterator<char>())
                                       : io::read_text_file(path);
  OrderedJson in;
  try {
    in = OrderedJson::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("not valid JSON: ") + e.what(), r.where,
                "give one JSON object with a \"messages\" array");
  }
  if (!in.is_object() || !in.contains("messages") || !in["messages"].is_array())
    throw Error("expected a JSON object with a \"messages\" array", r.where);
  if (in.contains("reasoning_effort") && !in["reasoning_effort"].is_null()) {
    if (!in["reasoning_effort"].is_string())
      throw Error("\"reasoning_effort\" must be a string", r.where);
    r.options.reasoning_effort = in["reasoning_effort"].get<std::string>();
  }
  auto flag = [&](const char* key) {
    if (!in.contains(key) || in[key].is_null()) return false;
    if (!in[key].is_boolean())
      throw Error(std::string("\"") + key + "\" must be true or false", r.where);
    return in[key].get<bool>();
  };
  r.options.clear_thinking = flag("clear_thinking");
  r.options.add_generation_prompt = flag("add_generation_prompt");
  r.messages = in["messages"];
  r.tools = in.contains("tools") ? in["tools"] : OrderedJson();
  return r;
}

}  // namespace glmtune::cli
