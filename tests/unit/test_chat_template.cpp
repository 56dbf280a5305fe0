// Chat template "glm5.3": render parity with the released jinja template (goldens rendered by
// tools/golden/chat_template_goldens.py), loss masks on hand-checked conversations, every input
// error, the Python-compatible helpers, and ids / labels on the tiny tokenizer.

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/data/chat_template.h"
#include "glmtune/data/tokenizer.h"

namespace {

using glmtune::data::ChatSegment;
using glmtune::data::ChatTemplateKind;
using glmtune::data::ChatTemplateOptions;
using glmtune::data::kIgnoreIndex;
using glmtune::data::OrderedJson;
using glmtune::data::RenderedChat;

const std::string kSourceDir = GLMTUNE_SOURCE_DIR;
const std::string kPrefix = "[gMASK]<sop><|system|>Reasoning Effort: Max";

OrderedJson load_goldens() {
  std::ifstream in(kSourceDir + "/tests/golden/chat_template/renders.json");
  EXPECT_TRUE(in) << "missing tests/golden/chat_template/renders.json";
  return OrderedJson::parse(in);
}

ChatTemplateOptions options_of(const OrderedJson& o) {
  ChatTemplateOptions opt;
  if (o.contains("reasoning_effort"))
    opt.reasoning_effort = o["reasoning_effort"].get<std::string>();
  if (o.contains("clear_thinking")) opt.clear_thinking = o["clear_thinking"].get<bool>();
  if (o.contains("add_generation_prompt"))
    opt.add_generation_prompt = o["add_generation_prompt"].get<bool>();
  return opt;
}

RenderedChat render(const OrderedJson& messages, const OrderedJson& tools = nullptr,
                    ChatTemplateOptions opt = {}) {
  return glmtune::data::render_chat(ChatTemplateKind::kGlm53, messages, tools, opt, 7);
}

std::vector<std::pair<std::string, bool>> pairs(const RenderedChat& r) {
  std::vector<std::pair<std::string, bool>> out;
  for (const auto& s : r.segments) out.emplace_back(s.text, s.trained);
  return out;
}

using Segs = std::vector<std::pair<std::string, bool>>;

// ---------------------------------------------------------------------------------------------
// Render parity

TEST(ChatTemplate, GoldenRenderParity) {
  OrderedJson doc = load_goldens();
  ASSERT_GE(doc["cases"].size(), 30u);
  for (const auto& c : doc["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    ChatTemplateOptions opt = options_of(c["options"]);
    const OrderedJson tools = c.contains("tools") ? c["tools"] : OrderedJson();
    const std::string expected = c["expected"].get<std::string>();

    opt.final_stop = false;
    RenderedChat plain =
        glmtune::data::render_chat(ChatTemplateKind::kGlm53, c["messages"], tools, opt);
    EXPECT_EQ(plain.text(), expected);

    // The training render differs only by the trained stop after a final assistant turn.
    opt.final_stop = true;
    RenderedChat train =
        glmtune::data::render_chat(ChatTemplateKind::kGlm53, c["messages"], tools, opt);
    const bool final_assistant =
        c["messages"].back()["role"] == "assistant" && !opt.add_generation_prompt;
    EXPECT_EQ(train.text(), expected + (final_assistant ? "<|endoftext|>" : ""));
    if (final_assistant) {
      EXPECT_TRUE(train.segments.back().trained);
    }
    for (size_t i = 1; i < train.segments.size(); ++i) {
      EXPECT_NE(train.segments[i].trained, train.segments[i - 1].trained) << "segments not merged";
    }
    EXPECT_FALSE(train.segments.front().trained);
    EXPECT_EQ(train.segments.front().text.rfind("[gMASK]<sop>", 0), 0u);
  }
}

TEST(ChatTemplate, GoldenTemplateIsTheReleasedOne) {
  // The goldens were rendered from the byte-exact released template in tools/golden/.
  OrderedJson doc = load_goldens();
  EXPECT_EQ(doc["template_sha256"],
            "0c4099f3382d6c92700dfb99725025360966fd73032f0ecf32377c0d9e6309c5");
  std::ifstream in(kSourceDir + "/tools/golden/glm53_chat_template.jinja", std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text.size(), 10950u);
}

TEST(ChatTemplate, MediaCounts) {
  OrderedJson doc = load_goldens();
  for (const auto& c : doc["cases"]) {
    if (c["name"] != "media_in_user_content") continue;
    RenderedChat r = render(c["messages"]);
    EXPECT_EQ(r.num_images, 2);
    EXPECT_EQ(r.num_videos, 2);
    return;
  }
  FAIL() << "golden case media_in_user_content not found";
}

// ---------------------------------------------------------------------------------------------
// Loss masks, checked by hand against the rules in docs/data.md

TEST(ChatTemplateMask, SingleTurn) {
  auto r = render(OrderedJson::parse(R"([{"role":"user","content":"What is 2 + 3?"},
                                         {"role":"assistant","content":"5"}])"));
  EXPECT_EQ(pairs(r), (Segs{{kPrefix + "<|user|>What is 2 + 3?<|assistant|><think>", false},
                            {"</think>5<|endoftext|>", true}}));
}

TEST(ChatTemplateMask, ToolsReasoningAndStops) {
  auto msgs = OrderedJson::parse(R"([
    {"role":"user","content":"Weather in Oslo?"},
    {"role":"assistant","content":"","reasoning_content":"Need the tool.",
     "tool_calls":[{"id":"c1","type":"function","function":{"name":"get_weather","arguments":{"city":"Oslo"}}}]},
    {"role":"tool","tool_call_id":"c1","content":"-3C"},
    {"role":"assistant","content":"It is -3C."},
    {"role":"user","content":"Thanks"},
    {"role":"assistant","content":"You're welcome."}])");
  auto tools = OrderedJson::parse(R"([{"name":"get_weather"}])");
  const std::string tools_block =
      "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
      "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
      "{\"name\": \"get_weather\"}\n</tools>\n\nFor each function call, output the function name "
      "and "
      "arguments within the following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}"
      "</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>"
      "{arg-value-2}</arg_value>...</tool_call>";
  EXPECT_EQ(
      pairs(render(msgs, tools)),
      (Segs{{kPrefix + tools_block + "<|user|>Weather in Oslo?<|assistant|><think>", false},
            {"Need the tool.</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo"
             "</arg_value></tool_call><|observation|>",
             true},
            {"<tool_response>-3C</tool_response><|assistant|><think>", false},
            {"</think>It is -3C.<|user|>", true},
            {"Thanks<|assistant|><think>", false},
            {"</think>You're welcome.<|endoftext|>", true}}));
}

TEST(ChatTemplateMask, LossFalseTurnAndItsStopAreNotTrained) {
  auto msgs = OrderedJson::parse(R"([{"role":"user","content":"q1"},
    {"role":"assistant","content":"a1","loss":false},
    {"role":"user","content":"q2"},{"role":"assistant","content":"a2"}])");
  EXPECT_EQ(
      pairs(render(msgs)),
      (Segs{{kPrefix + "<|user|>q1<|assistant|><think></think>a1<|user|>q2<|assistant|><think>",
             false},
            {"</think>a2<|endoftext|>", true}}));
  // A final turn with loss off gets no stop at all.
  auto last_off = OrderedJson::parse(R"([{"role":"user","content":"q"},
    {"role":"assistant","content":"a","loss":false}])");
  EXPECT_EQ(pairs(render(last_off)),
            (Segs{{kPrefix + "<|user|>q<|assistant|><think></think>a", false}}));
}

TEST(ChatTemplateMask, ClearThinkingDropsAndUntrainsEarlierReasoningTurns) {
  auto msgs = OrderedJson::parse(R"([{"role":"user","content":"q1"},
    {"role":"assistant","content":"a1","reasoning_content":"r1"},
    {"role":"user","content":"q2"},
    {"role":"assistant","content":"a2","reasoning_content":"r2"}])");
  ChatTemplateOptions opt;
  opt.clear_thinking = true;
  EXPECT_EQ(
      pairs(render(msgs, nullptr, opt)),
      (Segs{{kPrefix + "<|user|>q1<|assistant|><think></think>a1<|user|>q2<|assistant|><think>",
             false},
            {"r2</think>a2<|endoftext|>", true}}));
  // Without reasoning to drop, an earlier turn stays trained under clear_thinking.
  auto plain =
      OrderedJson::parse(R"([{"role":"user","content":"q1"},{"role":"assistant","content":"a1"},
    {"role":"user","content":"q2"},{"role":"assistant","content":"a2"}])");
  EXPECT_EQ(pairs(render(plain, nullptr, opt)),
            (Segs{{kPrefix + "<|user|>q1<|assistant|><think>", false},
                  {"</think>a1<|user|>", true},
                  {"q2<|assistant|><think>", false},
                  {"</think>a2<|endoftext|>", true}}));
  // Released default keeps (and trains) every turn's reasoning.
  EXPECT_EQ(pairs(render(msgs)), (Segs{{kPrefix + "<|user|>q1<|assistant|><think>", false},
                                       {"r1</think>a1<|user|>", true},
                                       {"q2<|assistant|><think>", false},
                                       {"r2</think>a2<|endoftext|>", true}}));
}

TEST(ChatTemplateMask, InlineReasoningIsSplitAndTrained) {
  auto msgs = OrderedJson::parse(R"([{"role":"user","content":"x"},
    {"role":"assistant","content":"<think>because</think>\n\n answer "}])");
  EXPECT_EQ(pairs(render(msgs)), (Segs{{kPrefix + "<|user|>x<|assistant|><think>", false},
                                       {"because</think>answer<|endoftext|>", true}}));
}

TEST(ChatTemplateMask, NoStopBeforeSystemOrAssistant) {
  // The released template writes no separator there; glmtune keeps the text and trains no stop.
  auto msgs = OrderedJson::parse(R"([{"role":"user","content":"q"},
    {"role":"assistant","content":"one"},{"role":"assistant","content":"two"},
    {"role":"system","content":"s"},{"role":"user","content":"q2"},{"role":"assistant","content":"three"}])");
  EXPECT_EQ(pairs(render(msgs)), (Segs{{kPrefix + "<|user|>q<|assistant|><think>", false},
                                       {"</think>one", true},
                                       {"<|assistant|><think>", false},
                                       {"</think>two", true},
                                       {"<|system|>s<|user|>q2<|assistant|><think>", false},
                                       {"</think>three<|endoftext|>", true}}));
}

TEST(ChatTemplateMask, GenerationPromptAndLeadingTool) {
  ChatTemplateOptions opt;
  opt.add_generation_prompt = true;
  auto msgs =
      OrderedJson::parse(R"([{"role":"user","content":"q"},{"role":"assistant","content":"a"},
    {"role":"user","content":"q2"}])");
  EXPECT_EQ(pairs(render(msgs, nullptr, opt)),
            (Segs{{kPrefix + "<|user|>q<|assistant|><think>", false},
                  {"</think>a<|user|>", true},
                  {"q2<|assistant|><think>", false}}));
  // An observation that follows no assistant turn is context, not a stop.
  auto tool_first =
      OrderedJson::parse(R"([{"role":"tool","content":"r"},{"role":"user","content":"q"},
    {"role":"assistant","content":"a"}])");
  EXPECT_EQ(
      pairs(render(tool_first)),
      (Segs{
          {kPrefix + "<|observation|><tool_response>r</tool_response><|user|>q<|assistant|><think>",
           false},
          {"</think>a<|endoftext|>", true}}));
}

TEST(ChatTemplateMask, ReasoningEffortAndStringArguments) {
  ChatTemplateOptions opt;
  opt.reasoning_effort = "high";
  auto msgs = OrderedJson::parse(R"([{"role":"user","content":"q"},
    {"role":"assistant","content":null,"tool_calls":[{"function":{"name":"f","arguments":"{\"b\": [1, 2.0], \"a\": \"x\"}"}}]}])");
  EXPECT_EQ(
      pairs(render(msgs, nullptr, opt)),
      (Segs{{"[gMASK]<sop><|system|>Reasoning Effort: High<|user|>q<|assistant|><think>", false},
            {"</think><tool_call>f<arg_key>b</arg_key><arg_value>[1, 2.0]</arg_value><arg_key>a"
             "</arg_key><arg_value>x</arg_value></tool_call><|endoftext|>",
             true}}));
}

// ---------------------------------------------------------------------------------------------
// Errors: each names the sample and message index and says what is wrong.

struct ErrorCase {
  const char* messages;
  const char* tools;
  const char* where;
  const char* problem;  // substring of Error::problem()
};

TEST(ChatTemplateErrors, EveryErrorNamesSampleMessageAndProblem) {
  const std::vector<ErrorCase> cases = {
      {R"({"role":"user"})", "null", "sample 7",
       "\"messages\" must be a list of message objects, got object"},
      {"[]", "null", "sample 7", "\"messages\" is empty"},
      {"[5]", "null", "sample 7, message 0", "message must be an object, got number"},
      {R"([{"role":"user","content":"a"},{"content":"x"}])", "null", "sample 7, message 1",
       "message has no string \"role\""},
      {R"([{"role":"user","content":"a"},{"role":"bot","content":"x"}])", "null",
       "sample 7, message 1", "unknown role \"bot\""},
      {R"([{"role":"user","content":{"a":1}}])", "null", "sample 7, message 0",
       "content must be a string, a list of content items or null, got object"},
      {R"([{"role":"user","content":42}])", "null", "sample 7, message 0",
       "content must be a string, a list of content items or null, got number"},
      {R"([{"role":"user","content":[5]}])", "null", "sample 7, message 0",
       "content item 0 must be a string or an object, got number"},
      {R"([{"role":"user","content":["a",{"text":"b"}]}])", "null", "sample 7, message 0",
       "content item 1 has no string \"type\""},
      {R"([{"role":"user","content":[{"type":"text","text":3}]}])", "null", "sample 7, message 0",
       "content item 0 of type \"text\" needs a string \"text\""},
      {R"([{"role":"user","content":[{"type":"file","file":"a.pdf"}]}])", "null",
       "sample 7, message 0", "content item 0 has unknown type \"file\""},
      {R"([{"role":"user","content":"q"},{"role":"assistant","content":[{"type":"image","image":"a.png"}]}])",
       "null", "sample 7, message 1",
       "content item 0 (image) is in a assistant message; media is only allowed in user and tool "
       "content"},
      {R"([{"role":"system","content":[{"type":"video_url","video_url":{"url":"v"}}]}])", "null",
       "sample 7, message 0", "content item 0 (video_url) is in a system message"},
      {R"([{"role":"user","content":[{"type":"input_audio","input_audio":{}}]}])", "null",
       "sample 7, message 0", "content item 0 is audio, which GLM-5.3-Flash cannot read"},
      {R"([{"role":"user","content":"q"},{"role":"assistant","content":"a","reasoning_content":["r"]}])",
       "null", "sample 7, message 1", "\"reasoning_content\" must be a string, got array"},
      {R"([{"role":"user","content":"q"},{"role":"assistant","content":"a","loss":1}])", "null",
       "sample 7, message 1", "\"loss\" must be true or false"},
      {R"([{"role":"user","content":"q"},{"role":"assistant","content":"a","tool_calls":{"name":"f"}}])",
       "null", "sample 7, message 1", "\"tool_calls\" must be a list, got object"},
      {R"([{"role":"user","content":"q"},{"role":"assistant","content":"a","tool_calls":["f"]}])",
       "null", "sample 7, message 1", "tool call 0 must be an object, got string"},
      {R"([{"role":"user","content":"q"},{"role":"assistant","tool_calls":[{"function":"f"}]}])",
       "null", "sample 7, message 1", "tool call 0: \"function\" must be an object"},
      {R"([{"role":"user","content":"q"},{"role":"assistant","tool_calls":[{"function":{"arguments":{}}}]}])",
       "null", "sample 7, message 1", "tool call 0 has no function name"},
      {R"([{"role":"user","content":"q"},{"role":"assistant","tool_calls":[{"function":{"name":"f","arguments":{}}},{"name":"g"}]}])",
       "null", "sample 7, message 1", "tool call 1 (g) has no \"arguments\""},
      {R"([{"role":"user","content":"q"},{"role":"assistant","tool_calls":[{"name":"g","arguments":"{city: 1}"}]}])",
       "null", "sample 7, message 1",
       "tool call 0 (g): \"arguments\" is a string that is not valid JSON"},
      {R"([{"role":"user","content":"q"},{"role":"assistant","tool_calls":[{"name":"g","arguments":"[1]"}]}])",
       "null", "sample 7, message 1",
       "tool call 0 (g): \"arguments\" must hold a JSON object, got array"},
      {R"([{"role":"user","content":"q"},{"role":"assistant","tool_calls":[{"name":"g","arguments":3}]}])",
       "null", "sample 7, message 1",
       "tool call 0 (g): \"arguments\" must be an object or a JSON string, got number"},
      {R"([{"role":"user","content":"q"},{"role":"tool","tool_call_id":7,"content":"r"}])", "null",
       "sample 7, message 1", "\"tool_call_id\" must be a string, got number"},
      {R"([{"role":"user","content":"q"},{"role":"tool","content":[{"type":"tool_reference","name":"f"}]}])",
       "null", "sample 7, message 1",
       "a tool_reference result needs the conversation's \"tools\" list"},
      {R"([{"role":"user","content":"q"},{"role":"tool","content":[{"type":"tool_reference","name":"f"},{"type":"text","text":"x"}]}])",
       R"([{"name":"f"}])", "sample 7, message 1",
       "tool_reference item 1 must be {\"type\": \"tool_reference\", \"name\": ...}"},
      {R"([{"role":"user","content":"q"},{"role":"tool","content":"ok"},{"role":"tool","content":[{"output":"a"},{"id":"x"}]}])",
       "null", "sample 7, message 2", "tool result item 1 has no \"output\""},
      {R"([{"role":"user","content":"q"}])", R"({"name":"f"})", "sample 7",
       "\"tools\" must be a list of tool objects, got object"},
      {R"([{"role":"user","content":"q"}])", R"([{"name":"f"},"g"])", "sample 7",
       "tool 1 must be an object, got string"},
      {R"([{"role":"user","content":"q"}])", R"([{"type":"function","function":[1]}])", "sample 7",
       "tool 0: \"function\" must be an object"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.messages);
    try {
      render(OrderedJson::parse(c.messages), OrderedJson::parse(c.tools));
      ADD_FAILURE() << "no error";
    } catch (const glmtune::Error& e) {
      EXPECT_EQ(e.where(), c.where);
      EXPECT_NE(e.problem().find(c.problem), std::string::npos) << "problem was: " << e.problem();
    }
  }
}

TEST(ChatTemplateErrors, UnknownTemplateName) {
  EXPECT_EQ(glmtune::data::chat_template_from_name("glm5.3"), ChatTemplateKind::kGlm53);
  try {
    glmtune::data::chat_template_from_name("chatml");
    ADD_FAILURE() << "no error";
  } catch (const glmtune::Error& e) {
    EXPECT_EQ(e.problem(), "unknown chat template \"chatml\"");
    EXPECT_EQ(e.where(), "chat_template");
  }
}

// ---------------------------------------------------------------------------------------------
// Python-compatible helpers (expected strings printed by CPython's json.dumps and str.strip).

TEST(ChatTemplateHelpers, PythonJsonDumps) {
  auto v = OrderedJson::parse(
      R"([0.1, 1e-5, 1e16, 1e15, 100.0, -0.0, 2.5e-300, 1.7976931348623157e308, 5e-324, 123456789.125,)"
      R"( 0.0001, 1e-4, 1E2, 12345678901234567890, 1, -2, 18446744073709551615, true, false, null,)"
      R"( "a\u0001\"\\/\u00e9\u2028\u007f\b\f\n\r\t", {}, [], {"b": 1, "a": [1, {"c": null}]}])");
  EXPECT_EQ(
      glmtune::data::python_json_dumps(v),
      "[0.1, 1e-05, 1e+16, 1000000000000000.0, 100.0, -0.0, 2.5e-300, 1.7976931348623157e+308, "
      "5e-324, 123456789.125, 0.0001, 0.0001, 100.0, 12345678901234567890, 1, -2, "
      "18446744073709551615, true, false, null, "
      "\"a\\u0001\\\"\\\\/\u00e9\u2028\x7f\\b\\f\\n\\r\\t\", "
      "{}, [], {\"b\": 1, \"a\": [1, {\"c\": null}]}]");
}

TEST(ChatTemplateHelpers, PythonJsonDumpsStrings) {
  // Every control character, DEL, quotes, backslashes, '/' and non-ASCII text, as a value and as
  // a key; expected bytes printed by CPython's json.dumps(..., ensure_ascii=False).
  std::string all;
  for (int c = 0; c < 0x20; ++c) all += char(c);
  all += "\x7f\"\\/ \u00e9\u2028\U0001F600";
  const std::string want =
      "\"\\u0000\\u0001\\u0002\\u0003\\u0004\\u0005\\u0006\\u0007\\b\\t\\n\\u000b\\f\\r\\u000e"
      "\\u000f\\u0010\\u0011\\u0012\\u0013\\u0014\\u0015\\u0016\\u0017\\u0018\\u0019\\u001a"
      "\\u001b\\u001c\\u001d\\u001e\\u001f\x7f\\\"\\\\/ \u00e9\u2028\U0001F600\"";
  EXPECT_EQ(glmtune::data::python_json_dumps(OrderedJson(all)), want);
  OrderedJson keyed = OrderedJson::object();
  keyed["k\"\\\n"] = OrderedJson::array({std::string(1, '\0')});
  EXPECT_EQ(glmtune::data::python_json_dumps(keyed), "{\"k\\\"\\\\\\n\": [\"\\u0000\"]}");
  // A Python string cannot hold invalid UTF-8: such bytes (only reachable through the C++ API,
  // the JSON parser rejects them) are an error, not text the reference would never write.
  try {
    glmtune::data::python_json_dumps(OrderedJson::array({"ok", "bad \xff byte"}));
    ADD_FAILURE() << "no error";
  } catch (const glmtune::Error& e) {
    EXPECT_NE(e.problem().find("not valid UTF-8"), std::string::npos) << e.what();
    EXPECT_EQ(e.where(), "chat template");
  }
}

TEST(ChatTemplateHelpers, PythonStrip) {
  using glmtune::data::python_strip;
  EXPECT_EQ(python_strip(" \u3000\u00a0\x1c x y \u200b\u2029\u0085"), "x y \u200b");
  EXPECT_EQ(python_strip("\t\n\v\f\r "), "");
  EXPECT_EQ(python_strip("é"), "é");
  EXPECT_EQ(python_strip(""), "");
  EXPECT_EQ(python_strip("\u2000a\u205f"), "a");
}

// ---------------------------------------------------------------------------------------------
// Token ids and labels on the tiny tokenizer (same 36 added tokens as the release).

class ChatTemplateTokens : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string path = kSourceDir + "/examples/tiny/tokenizer/tokenizer.json";
    ASSERT_TRUE(std::filesystem::exists(path)) << path;
    tokenizer_ = new glmtune::data::Tokenizer(glmtune::data::Tokenizer::from_file(path));
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    tokenizer_ = nullptr;
  }
  static glmtune::data::Tokenizer* tokenizer_;
};
glmtune::data::Tokenizer* ChatTemplateTokens::tokenizer_ = nullptr;

TEST_F(ChatTemplateTokens, GoldenIdsEqualWholeTextEncodingAndLabelsFollowSegments) {
  const auto& tok = *tokenizer_;
  OrderedJson doc = load_goldens();
  const int32_t eos = tok.require_id("<|endoftext|>");
  for (const auto& c : doc["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    const OrderedJson tools = c.contains("tools") ? c["tools"] : OrderedJson();
    RenderedChat r = glmtune::data::render_chat(ChatTemplateKind::kGlm53, c["messages"], tools,
                                                options_of(c["options"]));
    auto sample = glmtune::data::tokenize_segments(r.segments, tok);
    // Segment boundaries sit at added tokens, so per-segment encoding equals whole-text encoding.
    EXPECT_EQ(sample.input_ids, tok.encode(r.text()));
    ASSERT_EQ(sample.labels.size(), sample.input_ids.size());
    size_t pos = 0;
    int64_t trained = 0;
    for (const auto& seg : r.segments) {
      const size_t n = tok.encode(seg.text).size();
      for (size_t i = pos; i < pos + n; ++i)
        EXPECT_EQ(sample.labels[i], seg.trained ? sample.input_ids[i] : kIgnoreIndex)
            << "token " << i;
      trained += seg.trained ? static_cast<int64_t>(n) : 0;
      pos += n;
    }
    EXPECT_EQ(sample.num_trained(), trained);
    EXPECT_EQ(sample.input_ids.front(), tok.require_id("[gMASK]"));
    EXPECT_EQ(sample.labels.front(), kIgnoreIndex);
    if (r.segments.back().trained) {
      EXPECT_EQ(sample.input_ids.back(), eos);
      EXPECT_EQ(sample.labels.back(), eos);
    }
  }
}

TEST_F(ChatTemplateTokens, StopTokensCarryTheirOwnIdsAsLabels) {
  const auto& tok = *tokenizer_;
  auto msgs = OrderedJson::parse(R"([
    {"role":"user","content":"q1"},
    {"role":"assistant","content":"","tool_calls":[{"name":"f","arguments":{"x":1}}]},
    {"role":"tool","content":"r"},
    {"role":"assistant","content":"a1","loss":false},
    {"role":"user","content":"q2"},
    {"role":"assistant","content":"a2"}])");
  auto r = render(msgs, OrderedJson::parse(R"([{"name":"f"}])"));
  auto s = glmtune::data::tokenize_segments(r.segments, tok);
  const int32_t user = tok.require_id("<|user|>"), obs = tok.require_id("<|observation|>");
  const int32_t think = tok.require_id("<think>"), end_think = tok.require_id("</think>");
  std::vector<int32_t> user_labels, obs_labels, think_labels, end_think_labels;
  for (size_t i = 0; i < s.input_ids.size(); ++i) {
    if (s.input_ids[i] == user) user_labels.push_back(s.labels[i]);
    if (s.input_ids[i] == obs) obs_labels.push_back(s.labels[i]);
    if (s.input_ids[i] == think) think_labels.push_back(s.labels[i]);
    if (s.input_ids[i] == end_think) end_think_labels.push_back(s.labels[i]);
  }
  // First <|user|> opens the chat; the second follows an assistant turn with loss off.
  EXPECT_EQ(user_labels, (std::vector<int32_t>{kIgnoreIndex, kIgnoreIndex}));
  EXPECT_EQ(obs_labels, (std::vector<int32_t>{obs}));
  EXPECT_EQ(think_labels, (std::vector<int32_t>(3, kIgnoreIndex)));
  EXPECT_EQ(end_think_labels, (std::vector<int32_t>{end_think, kIgnoreIndex, end_think}));
  EXPECT_EQ(s.input_ids.back(), tok.require_id("<|endoftext|>"));
  EXPECT_EQ(s.labels.back(), s.input_ids.back());
}

TEST(ChatTemplateTokensAssemble, LabelsFromPreEncodedSegments) {
  std::vector<ChatSegment> segs = {{"a", false}, {"b", true}, {"c", false}};
  auto s = glmtune::data::assemble_segments(segs, {{1, 2}, {3}, {4, 5, 6}});
  EXPECT_EQ(s.input_ids, (std::vector<int32_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(s.labels, (std::vector<int32_t>{kIgnoreIndex, kIgnoreIndex, 3, kIgnoreIndex,
                                            kIgnoreIndex, kIgnoreIndex}));
  EXPECT_EQ(s.num_trained(), 1);
}

}  // namespace
