// libFuzzer entry: one conversation, written as a dataset line ({"messages": [...], "tools":
// [...], "reasoning_effort": ..., "clear_thinking": ...}), rendered with the glm5.3 chat template
// and tokenized with the bundled tiny tokenizer. A malformed conversation must be rejected with a
// glmtune::Error; a rendered one must keep the documented shape: adjacent segments differ in
// `trained`, the segments concatenate to text(), encoding the segments one by one gives the ids of
// encoding the whole text (so the loss mask lines up with the tokens), every label is its id or
// the ignore index, and nothing after a generation prompt is trained. Anything else escaping is a
// bug.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "fuzz_util.h"
#include "glmtune/base/error.h"
#include "glmtune/data/chat_template.h"
#include "glmtune/data/tokenizer.h"

namespace {

using namespace glmtune::data;
using glmtune::fuzz::bug;

const Tokenizer* g_tokenizer = nullptr;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  static Tokenizer tokenizer =
      Tokenizer::from_file(glmtune::fuzz::source_path("examples/tiny/tokenizer/tokenizer.json"));
  g_tokenizer = &tokenizer;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The JSON parser is the dataset's (and rejects invalid UTF-8); not what is under test here.
  OrderedJson doc = OrderedJson::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (!doc.is_object() || !doc.contains("messages")) return 0;
  static const OrderedJson kNoTools;
  const OrderedJson& tools = doc.contains("tools") ? doc["tools"] : kNoTools;

  ChatTemplateOptions opts;
  if (doc.contains("reasoning_effort") && doc["reasoning_effort"].is_string())
    opts.reasoning_effort = doc["reasoning_effort"].get<std::string>();
  if (doc.contains("clear_thinking") && doc["clear_thinking"].is_boolean())
    opts.clear_thinking = doc["clear_thinking"].get<bool>();
  // The options the dataset never sets come from the length, so both ways are exercised.
  opts.add_generation_prompt = size % 2;
  opts.final_stop = (size / 2) % 2;

  RenderedChat chat;
  try {
    chat = render_chat(ChatTemplateKind::kGlm53, doc["messages"], tools, opts, 7);
  } catch (const glmtune::Error& e) {
    if (e.where().empty()) bug("a rejected conversation does not say where");
    return 0;
  }
  std::string text;
  for (size_t i = 0; i < chat.segments.size(); ++i) {
    if (i > 0 && chat.segments[i].trained == chat.segments[i - 1].trained)
      bug("adjacent segments with the same loss flag");
    text += chat.segments[i].text;
  }
  if (text != chat.text()) bug("segments do not concatenate to text()");
  if (opts.add_generation_prompt && !chat.segments.empty() && chat.segments.back().trained)
    bug("text after the generation prompt is trained");
  if (chat.num_images < 0 || chat.num_videos < 0) bug("negative media count");

  const TokenizedSample t = tokenize_segments(chat.segments, *g_tokenizer);
  if (t.input_ids != g_tokenizer->encode(text))
    bug("segment-wise ids differ from the ids of the whole text: the loss mask is misaligned");
  if (t.labels.size() != t.input_ids.size()) bug("ids and labels differ in length");
  for (size_t i = 0; i < t.labels.size(); ++i)
    if (t.labels[i] != t.input_ids[i] && t.labels[i] != kIgnoreIndex)
      bug("label is neither its id nor -100");
  if (g_tokenizer->decode(t.input_ids) != text) bug("decode(encode(text)) != text");
  return 0;
}
