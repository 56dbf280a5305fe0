#include "glmtune/data/chat_template.h"

#include <fmt/format.h>

#include <charconv>
#include <cstdlib>
#include <utility>

#include "glmtune/base/error.h"
#include "glmtune/data/tokenizer.h"

namespace glmtune::data {
namespace {

using Json = OrderedJson;

// ---------------------------------------------------------------------------------------------
// Python semantics the released template relies on.

// Python `str.isspace()` for one code point (the full list: Python's `str.strip()` with no
// argument strips exactly these).
bool is_python_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// Decodes the code point of the UTF-8 sequence starting at s[pos] of length `len`. The text comes
// from a JSON parser that validated UTF-8, so lead and continuation bytes are well formed.
uint32_t decode_utf8(std::string_view s, size_t pos, size_t len) {
  auto b = [&](size_t i) { return static_cast<uint32_t>(static_cast<unsigned char>(s[pos + i])); };
  switch (len) {
    case 1:
      return b(0);
    case 2:
      return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
    case 3:
      return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
    default:
      return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
  }
}

size_t utf8_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead >> 5) == 0x6) return 2;
  if ((lead >> 4) == 0xE) return 3;
  if ((lead >> 3) == 0x1E) return 4;
  return 1;  // stray byte: treat as one opaque unit, never whitespace
}

// Python `float.__repr__`: the shortest digits that round-trip, written in fixed notation when the
// decimal exponent is in [-4, 16), else as `d.ddde±XX`; fixed notation always shows a fraction.
std::string python_float_repr(double value) {
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), value, std::chars_format::scientific);
  std::string_view s(buf, static_cast<size_t>(res.ptr - buf));
  std::string out;
  if (!s.empty() && s[0] == '-') {
    out.push_back('-');
    s.remove_prefix(1);
  }
  size_t e = s.find('e');
  std::string digits;
  for (char c : s.substr(0, e))
    if (c != '.') digits.push_back(c);
  int exponent = std::atoi(std::string(s.substr(e + 1)).c_str());
  int decpt = exponent + 1;  // position of the decimal point relative to the digit string
  int n = static_cast<int>(digits.size());
  if (decpt <= -4 || decpt > 16) {
    out.push_back(digits[0]);
    if (n > 1) out.append(".").append(digits, 1);
    out += fmt::format("e{}{:02d}", exponent < 0 ? '-' : '+', std::abs(exponent));
  } else if (decpt <= 0) {
    out.append("0.").append(static_cast<size_t>(-decpt), '0').append(digits);
  } else if (decpt < n) {
    out.append(digits, 0, static_cast<size_t>(decpt))
        .append(".")
        .append(digits, static_cast<size_t>(decpt));
  } else {
    out.append(digits).append(static_cast<size_t>(decpt - n), '0').append(".0");
  }
  return out;
}

// Python's json.dumps(s, ensure_ascii=False) of one string, which is nlohmann's dump without
// ensure_ascii byte for byte: `"` `\\` \b \f \n \r \t by their short escapes, the other control
// characters as \u00xx (lowercase hex), DEL and all non-ASCII text as is. A Python string cannot
// hold invalid UTF-8 (the reference renders no such text), so such bytes are an error here.
void append_python_json_string(std::string& out, std::string_view s) {
  try {
    out += Json(s).dump(-1, ' ', false, Json::error_handler_t::strict);
  } catch (const Json::type_error& e) {
    throw Error(fmt::format("a string written as JSON is not valid UTF-8 ({})", e.what()),
                "chat template", "give the conversation's text in UTF-8");
  }
}

// Containers and numbers are written here rather than by nlohmann's dump: Python separates items
// with ", " and keys with ": ", and writes floats by repr (python_float_repr), none of which
// nlohmann's dump can be told to do.
void append_python_json(std::string& out, const Json& v) {
  switch (v.type()) {
    case Json::value_t::null:
      out += "null";
      break;
    case Json::value_t::boolean:
      out += v.get<bool>() ? "true" : "false";
      break;
    case Json::value_t::number_integer:
      out += std::to_string(v.get<int64_t>());
      break;
    case Json::value_t::number_unsigned:
      out += std::to_string(v.get<uint64_t>());
      break;
    case Json::value_t::number_float:
      out += python_float_repr(v.get<double>());
      break;
    case Json::value_t::string:
      append_python_json_string(out, v.get_ref<const std::string&>());
      break;
    case Json::value_t::array: {
      out.push_back('[');
      bool first = true;
      for (const auto& item : v) {
        if (!first) out += ", ";
        first = false;
        append_python_json(out, item);
      }
      out.push_back(']');
      break;
    }
    case Json::value_t::object: {
      out.push_back('{');
      bool first = true;
      for (const auto& [key, item] : v.items()) {
        if (!first) out += ", ";
        first = false;
        append_python_json_string(out, key);
        out += ": ";
        append_python_json(out, item);
      }
      out.push_back('}');
      break;
    }
    default:
      // Binary and discarded values cannot come out of the JSON parser.
      GLMTUNE_ASSERT(false, "unexpected JSON value type {}", v.type_name());
  }
}

// Python truthiness of a JSON value, as the template's `{% if x %}` sees it.
bool truthy(const Json& v) {
  switch (v.type()) {
    case Json::value_t::null:
      return false;
    case Json::value_t::boolean:
      return v.get<bool>();
    case Json::value_t::number_integer:
      return v.get<int64_t>() != 0;
    case Json::value_t::number_unsigned:
      return v.get<uint64_t>() != 0;
    case Json::value_t::number_float:
      return v.get<double>() != 0.0;
    case Json::value_t::string:
      return !v.get_ref<const std::string&>().empty();
    default:
      return !v.empty();
  }
}

// Python `str.split(sep)` pieces that the template uses: the part before the first separator,
// and the part after the last one.
std::string_view before_first(std::string_view s, std::string_view sep) {
  size_t p = s.find(sep);
  return p == std::string_view::npos ? s : s.substr(0, p);
}
std::string_view after_last(std::string_view s, std::string_view sep) {
  size_t p = s.rfind(sep);
  return p == std::string_view::npos ? s : s.substr(p + sep.size());
}

const Json kNull;

// Member `key` of an object, or null when absent (the template reads absent and null alike).
const Json& member(const Json& obj, std::string_view key) {
  if (!obj.is_object()) return kNull;
  auto it = obj.find(key);
  return it == obj.end() ? kNull : *it;
}

// ---------------------------------------------------------------------------------------------
// The renderer: one pass over the messages that mirrors the jinja template's control flow.

class Glm53Renderer {
 public:
  Glm53Renderer(const Json& messages, const Json& tools, const ChatTemplateOptions& options,
                int64_t sample_index)
      : messages_(messages), tools_(tools), options_(options), sample_(sample_index) {}

  RenderedChat run() {
    check_messages();
    check_tools();
    emit("[gMASK]<sop>", false);
    const std::string& effort = options_.reasoning_effort.value_or("");
    emit(fmt::format("<|system|>Reasoning Effort: {}", effort == "low"    ? "Low"
                                                       : effort == "high" ? "High"
                                                                          : "Max"),
         false);
    if (truthy(tools_)) emit_tools_block();

    const int64_t n = static_cast<int64_t>(messages_.size());
    int64_t last_user = -1;
    for (int64_t i = 0; i < n; ++i)
      if (role(i) == "user") last_user = i;

    // Whether the message just rendered is an assistant turn that carries loss: the next role
    // token is then its trained stop.
    bool prev_trained_assistant = false;
    for (int64_t i = 0; i < n; ++i) {
      msg_ = i;
      const Json& m = messages_[static_cast<size_t>(i)];
      const std::string r = role(i);
      bool this_trained_assistant = false;
      if (r == "user") {
        emit("<|user|>", prev_trained_assistant);
        emit(visible_text(member(m, "content"), r), false);
      } else if (r == "assistant") {
        this_trained_assistant = render_assistant(m, i, last_user);
      } else if (r == "tool") {
        // One `<|observation|>` opens a run of consecutive tool messages; the first message of
        // the run renders all of them and the others add nothing.
        if (i == 0 || role(i - 1) != "tool") {
          emit("<|observation|>", prev_trained_assistant);
          render_tool_block(i);
        }
      } else {  // system
        emit("<|system|>", false);
        emit(visible_text(member(m, "content"), r), false);
      }
      prev_trained_assistant = this_trained_assistant;
    }
    msg_ = -1;
    if (options_.add_generation_prompt) {
      emit("<|assistant|><think>", false);
    } else if (options_.final_stop && prev_trained_assistant) {
      emit("<|endoftext|>", true);
    }
    return std::move(out_);
  }

 private:
  [[noreturn]] void fail(std::string what, std::string fix = {}) const {
    std::string where = msg_ >= 0 ? fmt::format("sample {}, message {}", sample_, msg_)
                                  : fmt::format("sample {}", sample_);
    throw Error(std::move(what), std::move(where), std::move(fix));
  }

  void emit(std::string_view text, bool trained) {
    if (text.empty()) return;
    if (!out_.segments.empty() && out_.segments.back().trained == trained) {
      out_.segments.back().text += text;
    } else {
      out_.segments.push_back({std::string(text), trained});
    }
  }

  // "observation" is the GLM data format's name for a tool result; the released template only
  // knows "tool" (and would silently drop an "observation" message).
  std::string role(int64_t i) const {
    const std::string& r = messages_[static_cast<size_t>(i)]["role"].get_ref<const std::string&>();
    return r == "observation" ? std::string("tool") : r;
  }

  void check_messages() {
    if (!messages_.is_array())
      fail(fmt::format("\"messages\" must be a list of message objects, got {}",
                       messages_.type_name()));
    if (messages_.empty())
      fail("\"messages\" is empty", "give each conversation at least one message");
    for (size_t i = 0; i < messages_.size(); ++i) {
      msg_ = static_cast<int64_t>(i);
      const Json& m = messages_[i];
      if (!m.is_object()) fail(fmt::format("message must be an object, got {}", m.type_name()));
      const Json& r = member(m, "role");
      if (!r.is_string()) fail("message has no string \"role\"");
      const std::string& rs = r.get_ref<const std::string&>();
      if (rs != "system" && rs != "user" && rs != "assistant" && rs != "tool" &&
          rs != "observation")
        fail(fmt::format("unknown role \"{}\"", rs),
             "use one of system, user, assistant, tool (or observation)");
      const Json& content = member(m, "content");
      if (!content.is_null() && !content.is_string() && !content.is_array())
        fail(fmt::format("content must be a string, a list of content items or null, got {}",
                         content.type_name()));
      const Json& loss = member(m, "loss");
      if (!loss.is_null() && !loss.is_boolean()) fail("\"loss\" must be true or false");
    }
    msg_ = -1;
  }

  void check_tools() {
    if (tools_.is_null()) return;
    if (!tools_.is_array())
      fail(fmt::format("\"tools\" must be a list of tool objects, got {}", tools_.type_name()));
    for (size_t j = 0; j < tools_.size(); ++j) {
      const Json& t = tools_[j];
      if (!t.is_object()) fail(fmt::format("tool {} must be an object, got {}", j, t.type_name()));
      if (t.contains("function") && !t["function"].is_object())
        fail(fmt::format("tool {}: \"function\" must be an object", j));
    }
  }

  // The tool definition the template writes: the OpenAI wrapper's `function` object, or the tool
  // itself when it has no wrapper.
  static const Json& tool_definition(const Json& tool) {
    return tool.contains("function") ? tool["function"] : tool;
  }

  static std::string tool_to_json(const Json& def) {
    // Keys are written raw between quotes (the template prints `"{{ k }}"`), values through tojson.
    std::string out = "{";
    bool first = true;
    for (const auto& [key, value] : def.items()) {
      if (key == "defer_loading" || key == "strict") continue;
      if (!first) out += ", ";
      first = false;
      out += "\"" + key + "\": ";
      append_python_json(out, value);
    }
    out += "}";
    return out;
  }

  void emit_tools_block() {
    std::string text =
        "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n";
    for (const Json& tool : tools_) {
      const Json& def = tool_definition(tool);
      if (truthy(member(def, "defer_loading"))) continue;  // loaded on demand via tool_reference
      text += tool_to_json(def) + "\n";
    }
    text +=
        "</tools>\n\nFor each function call, output the function name and arguments within the "
        "following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>"
        "{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</"
        "arg_value>"
        "...</tool_call>";
    emit(text, false);
  }

  // The template's `visible_text` macro, stricter: it silently drops items it does not know and
  // prints Python reprs of odd values, glmtune rejects them. Media markers are allowed only where
  // a processor can attach pixels without training on them (user and tool content).
  std::string visible_text(const Json& content, const std::string& where_role) {
    if (content.is_null()) return {};
    if (content.is_string()) return content.get<std::string>();
    if (!content.is_array())
      fail(fmt::format("content must be a string, a list of content items or null, got {}",
                       content.type_name()));
    const bool media_ok = where_role == "user" || where_role == "tool";
    std::string out;
    for (size_t j = 0; j < content.size(); ++j) {
      const Json& item = content[j];
      if (item.is_string()) {
        out += item.get_ref<const std::string&>();
        continue;
      }
      if (!item.is_object())
        fail(fmt::format("content item {} must be a string or an object, got {}", j,
                         item.type_name()));
      const Json& type = member(item, "type");
      if (!type.is_string()) fail(fmt::format("content item {} has no string \"type\"", j));
      const std::string& t = type.get_ref<const std::string&>();
      if (t == "text") {
        const Json& text = member(item, "text");
        if (!text.is_string())
          fail(fmt::format("content item {} of type \"text\" needs a string \"text\"", j));
        out += text.get_ref<const std::string&>();
      } else if (t == "image" || t == "image_url" || t == "video" || t == "video_url") {
        if (!media_ok)
          fail(fmt::format("content item {} ({}) is in a {} message; media is only allowed in user "
                           "and tool content",
                           j, t, where_role),
               "move the media into a user message");
        if (t[0] == 'i') {
          out += "<|begin_of_image|><|image|><|end_of_image|>";
          ++out_.num_images;
        } else {
          out += "<|begin_of_video|><|video|><|end_of_video|>";
          ++out_.num_videos;
        }
      } else if (t == "audio" || t == "audio_url" || t == "input_audio") {
        fail(fmt::format("content item {} is audio, which GLM-5.3-Flash cannot read", j),
             "remove audio items from the data");
      } else {
        fail(fmt::format("content item {} has unknown type \"{}\"", j, t),
             "use text, image, image_url, video or video_url items");
      }
    }
    return out;
  }

  // Returns whether the turn carries loss.
  bool render_assistant(const Json& m, int64_t index, int64_t last_user) {
    std::string content = visible_text(member(m, "content"), "assistant");
    std::optional<std::string> reasoning;
    const Json& rc = member(m, "reasoning_content");
    if (rc.is_string()) {
      reasoning = rc.get<std::string>();
    } else if (!rc.is_null()) {
      fail(fmt::format("\"reasoning_content\" must be a string, got {}", rc.type_name()));
    } else if (content.find("</think>") != std::string::npos) {
      // Reasoning inlined in the content: the text between the last `<think>` and the first
      // `</think>` is the reasoning; the answer is everything after the last `</think>`.
      reasoning = std::string(after_last(before_first(content, "</think>"), "<think>"));
      content = std::string(after_last(content, "</think>"));
    }
    const bool keep_reasoning = !options_.clear_thinking || index > last_user;
    const Json& loss = member(m, "loss");
    const bool trained = (loss.is_null() || loss.get<bool>()) && (keep_reasoning || !reasoning);

    std::string calls = render_tool_calls(member(m, "tool_calls"));
    emit("<|assistant|><think>", false);
    emit((keep_reasoning && reasoning ? *reasoning : std::string()) + "</think>", trained);
    emit(python_strip(content), trained);
    emit(calls, trained);
    return trained;
  }

  // Parses one tool call to (name, arguments object) after the same unwrapping as the template.
  std::pair<std::string, Json> tool_call_parts(const Json& tc, size_t j) {
    if (!tc.is_object())
      fail(fmt::format("tool call {} must be an object, got {}", j, tc.type_name()));
    const Json* fn = &tc;
    if (truthy(member(tc, "function"))) {
      fn = &tc["function"];
      if (!fn->is_object()) fail(fmt::format("tool call {}: \"function\" must be an object", j));
    }
    const Json& name = member(*fn, "name");
    if (!name.is_string() || name.get_ref<const std::string&>().empty())
      fail(fmt::format("tool call {} has no function name", j),
           "give each tool call {\"function\": {\"name\": ..., \"arguments\": {...}}}");
    const Json& args = member(*fn, "arguments");
    if (args.is_object()) return {name.get<std::string>(), args};
    if (args.is_string()) {
      // OpenAI's wire format carries arguments as a JSON string; the template needs the object.
      Json parsed = Json::parse(args.get_ref<const std::string&>(), nullptr, false);
      if (parsed.is_discarded())
        fail(fmt::format("tool call {} ({}): \"arguments\" is a string that is not valid JSON", j,
                         name.get_ref<const std::string&>()));
      if (!parsed.is_object())
        fail(fmt::format("tool call {} ({}): \"arguments\" must hold a JSON object, got {}", j,
                         name.get_ref<const std::string&>(), parsed.type_name()));
      return {name.get<std::string>(), std::move(parsed)};
    }
    if (args.is_null())
      fail(fmt::format("tool call {} ({}) has no \"arguments\"", j,
                       name.get_ref<const std::string&>()),
           "use \"arguments\": {} for a call without arguments");
    fail(fmt::format("tool call {} ({}): \"arguments\" must be an object or a JSON string, got {}",
                     j, name.get_ref<const std::string&>(), args.type_name()));
  }

  std::string render_tool_calls(const Json& tool_calls) {
    if (tool_calls.is_null()) return {};
    if (!tool_calls.is_array())
      fail(fmt::format("\"tool_calls\" must be a list, got {}", tool_calls.type_name()));
    std::string out;
    for (size_t j = 0; j < tool_calls.size(); ++j) {
      auto [name, args] = tool_call_parts(tool_calls[j], j);
      out += "<tool_call>" + name;
      for (const auto& [key, value] : args.items()) {
        out += "<arg_key>" + key + "</arg_key><arg_value>";
        if (value.is_string())
          out += value.get_ref<const std::string&>();
        else
          append_python_json(out, value);
        out += "</arg_value>";
      }
      out += "</tool_call>";
    }
    return out;
  }

  // The template's `id_of`: `tool_call_id` when non-empty, else `id`, else "".
  std::string id_of(const Json& obj) const {
    for (const char* key : {"tool_call_id", "id"}) {
      const Json& v = member(obj, key);
      if (v.is_null()) continue;
      if (!v.is_string()) fail(fmt::format("\"{}\" must be a string, got {}", key, v.type_name()));
      if (!v.get_ref<const std::string&>().empty()) return v.get<std::string>();
    }
    return {};
  }

  // The template's `is_list_of_outputs`: content whose first item has an `output` key.
  static bool is_list_of_outputs(const Json& m) {
    const Json& c = member(m, "content");
    return c.is_array() && !c.empty() && c[0].is_object() && c[0].contains("output");
  }

  static bool starts_with_tool_reference(const Json& list) {
    return list.is_array() && !list.empty() && list[0].is_object() &&
           member(list[0], "type") == "tool_reference";
  }

  std::string tool_response(const std::string& text) {
    return "<tool_response>" + text + "</tool_response>";
  }

  // A tool-search result: the full definitions of the referenced (deferred) tools.
  std::string tool_references_to_response(const Json& refs) {
    if (!truthy(tools_))
      fail("a tool_reference result needs the conversation's \"tools\" list",
           "add the referenced tools to \"tools\" (defer_loading: true keeps them out of the "
           "prompt)");
    std::string out = "<tool_response><tools>\n";
    for (size_t j = 0; j < refs.size(); ++j) {
      const Json& name = member(refs[j], "name");
      if (!refs[j].is_object() || member(refs[j], "type") != "tool_reference" || !name.is_string())
        fail(fmt::format(
            "tool_reference item {} must be {{\"type\": \"tool_reference\", \"name\": ...}}", j));
      for (const Json& tool : tools_) {
        const Json& def = tool_definition(tool);
        if (member(def, "name") == name) out += tool_to_json(def) + "\n";
      }
    }
    return out + "</tools></tool_response>";
  }

  std::string render_output_entry(const Json& entry, size_t j) {
    if (!entry.is_object() || !entry.contains("output"))
      fail(fmt::format(
          "tool result item {} has no \"output\" (the first item has one, so all must)", j));
    const Json& output = entry["output"];
    if (starts_with_tool_reference(output)) return tool_references_to_response(output);
    return tool_response(visible_text(output, "tool"));
  }

  // The template's `render_tool_response` for one tool message.
  std::string render_tool_response(const Json& m) {
    const Json& c = member(m, "content");
    if (c.is_string()) return tool_response(c.get<std::string>());
    if (starts_with_tool_reference(c)) return tool_references_to_response(c);
    if (is_list_of_outputs(m)) {
      std::string out;
      for (size_t j = 0; j < c.size(); ++j) out += render_output_entry(c[j], j);
      return out;
    }
    return tool_response(visible_text(c, "tool"));
  }

  // Renders the run of tool messages starting at `start`. When every result id matches exactly
  // one of the preceding assistant's (unique, non-empty) tool-call ids, results are written in
  // tool-call order; otherwise in message order.
  void render_tool_block(int64_t start) {
    const int64_t n = static_cast<int64_t>(messages_.size());
    int64_t end = start;
    while (end + 1 < n && role(end + 1) == "tool") ++end;

    const Json* calls = nullptr;
    if (start > 0 && role(start - 1) == "assistant") {
      const Json& tc = member(messages_[static_cast<size_t>(start - 1)], "tool_calls");
      if (truthy(tc)) calls = &tc;
    }

    // (message index, entry index or -1 for the whole message, id) of every result in the run.
    struct Result {
      int64_t msg;
      int64_t entry;
      std::string id;
    };
    std::vector<Result> results;
    for (int64_t k = start; k <= end; ++k) {
      msg_ = k;
      const Json& m = messages_[static_cast<size_t>(k)];
      if (is_list_of_outputs(m)) {
        const Json& c = m["content"];
        for (size_t j = 0; j < c.size(); ++j)
          results.push_back({k, static_cast<int64_t>(j), id_of(c[j])});
      } else {
        results.push_back({k, -1, id_of(m)});
      }
    }
    msg_ = start;

    bool can_sort = calls != nullptr;
    std::vector<std::string> call_ids;
    if (can_sort) {
      for (const Json& tc : *calls) call_ids.push_back(id_of(tc));
      for (size_t i = 0; i < call_ids.size() && can_sort; ++i) {
        if (call_ids[i].empty()) can_sort = false;
        for (size_t j = i + 1; j < call_ids.size() && can_sort; ++j)
          if (call_ids[j] == call_ids[i]) can_sort = false;
      }
      for (const Result& r : results) {
        if (!can_sort) break;
        if (r.id.empty()) {
          can_sort = false;
          break;
        }
        int64_t same = 0, known = 0;
        for (const Result& o : results) same += o.id == r.id;
        for (const std::string& id : call_ids) known += id == r.id;
        if (same > 1 || known == 0) can_sort = false;
      }
    }

    auto render_result = [&](const Result& r) {
      msg_ = r.msg;
      const Json& m = messages_[static_cast<size_t>(r.msg)];
      std::string text = r.entry < 0
                             ? render_tool_response(m)
                             : render_output_entry(m["content"][static_cast<size_t>(r.entry)],
                                                   static_cast<size_t>(r.entry));
      emit(text, false);
    };
    if (can_sort) {
      for (const std::string& id : call_ids)
        for (const Result& r : results)
          if (r.id == id) render_result(r);
    } else {
      // Message order; a list-of-outputs message renders all its entries in order.
      for (int64_t k = start; k <= end; ++k) {
        msg_ = k;
        emit(render_tool_response(messages_[static_cast<size_t>(k)]), false);
      }
    }
    msg_ = start;
  }

  const Json& messages_;
  const Json& tools_;
  const ChatTemplateOptions& options_;
  int64_t sample_;
  int64_t msg_ = -1;
  RenderedChat out_;
};

}  // namespace

ChatTemplateKind chat_template_from_name(std::string_view name) {
  if (name == "glm5.3") return ChatTemplateKind::kGlm53;
  throw Error(fmt::format("unknown chat template \"{}\"", name), "chat_template",
              "use \"glm5.3\" (the released GLM-5.3-Flash template)");
}

std::string RenderedChat::text() const {
  std::string out;
  for (const auto& s : segments) out += s.text;
  return out;
}

RenderedChat render_chat(ChatTemplateKind kind, const OrderedJson& messages,
                         const OrderedJson& tools, const ChatTemplateOptions& options,
                         int64_t sample_index) {
  GLMTUNE_ASSERT(kind == ChatTemplateKind::kGlm53, "unhandled chat template kind {}",
                 static_cast<int>(kind));
  return Glm53Renderer(messages, tools, options, sample_index).run();
}

int64_t TokenizedSample::num_trained() const {
  int64_t n = 0;
  for (int32_t l : labels) n += l != kIgnoreIndex;
  return n;
}

TokenizedSample assemble_segments(const std::vector<ChatSegment>& segments,
                                  const std::vector<std::vector<int32_t>>& encoded) {
  GLMTUNE_ASSERT(segments.size() == encoded.size(), "{} segments but {} encodings", segments.size(),
                 encoded.size());
  TokenizedSample out;
  size_t total = 0;
  for (const auto& e : encoded) total += e.size();
  out.input_ids.reserve(total);
  out.labels.reserve(total);
  for (size_t i = 0; i < segments.size(); ++i) {
    for (int32_t id : encoded[i]) {
      out.input_ids.push_back(id);
      out.labels.push_back(segments[i].trained ? id : kIgnoreIndex);
    }
  }
  return out;
}

TokenizedSample tokenize_segments(const std::vector<ChatSegment>& segments,
                                  const Tokenizer& tokenizer) {
  std::vector<std::vector<int32_t>> encoded;
  encoded.reserve(segments.size());
  for (const auto& s : segments) encoded.push_back(tokenizer.encode(s.text));
  return assemble_segments(segments, encoded);
}

std::string python_json_dumps(const OrderedJson& value) {
  std::string out;
  append_python_json(out, value);
  return out;
}

std::string_view python_strip(std::string_view text) {
  size_t begin = 0, end = text.size();
  while (begin < end) {
    size_t len = utf8_length(static_cast<unsigned char>(text[begin]));
    if (begin + len > end || !is_python_space(decode_utf8(text, begin, len))) break;
    begin += len;
  }
  while (end > begin) {
    size_t start = end - 1;
    // Step back over continuation bytes (10xxxxxx) to the lead byte of the last code point.
    while (start > begin && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
    size_t len = utf8_length(static_cast<unsigned char>(text[start]));
    if (start + len != end || !is_python_space(decode_utf8(text, start, len))) break;
    end = start;
  }
  return text.substr(begin, end - begin);
}

}  // namespace glmtune::data
