#pragma once
// Chat template "glm5.3": renders OpenAI-style conversations to exactly the text the released
// GLM-5.3-Flash `chat_template.jinja` produces (as transformers renders it), split into segments
// that carry the loss mask, and turns those segments into token ids and labels.
//
// The loss mask follows the reference trainer (docs/data.md, "Loss mask"): the prompt prefix and
// system / user / tool text are context; an assistant turn trains its reasoning with `</think>`,
// its content and its tool calls; the `<|user|>` / `<|observation|>` token right after a trained
// assistant turn is trained as that turn's stop, and a final trained assistant turn gets a trained
// `<|endoftext|>` (the only text the released template does not write; see `final_stop`).

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace glmtune::data {

class Tokenizer;

// Conversations keep the key order of their input: the tool JSON written into the prompt lists
// keys in input order, as Python dicts do in the reference renderer.
using OrderedJson = nlohmann::ordered_json;

// Label of a token that carries no loss (PyTorch's cross-entropy ignore index).
inline constexpr int32_t kIgnoreIndex = -100;

// The chat templates glmtune knows. Only the released GLM-5.3 template exists today; the name is
// what configs and the CLI spell.
enum class ChatTemplateKind { kGlm53 };
// "glm5.3" -> kGlm53; anything else throws glmtune::Error listing the known names.
ChatTemplateKind chat_template_from_name(std::string_view name);

struct ChatTemplateOptions {
  // The released template honours "low" and "high"; anything else, or nothing, renders "Max".
  std::optional<std::string> reasoning_effort;
  // Drop the reasoning of assistant turns before the last user message (released default: off).
  // Such a turn is not trained: its rendered `<think></think>` is not what the model reasoned.
  bool clear_thinking = false;
  // Append `<|assistant|><think>` (an inference prompt). Nothing after it is trained.
  bool add_generation_prompt = false;
  // Append a trained `<|endoftext|>` after a final trained assistant turn, as the reference trainer
  // does for training. With false the text is byte-identical to the released template's output.
  bool final_stop = true;
};

struct ChatSegment {
  std::string text;
  bool trained = false;
};

struct RenderedChat {
  // Concatenated, the segments are the rendered text. Adjacent segments differ in `trained`, and
  // every boundary between them sits next to an added token (`<think>`, `</think>`, `<|user|>`,
  // ...), so encoding segments one by one gives the ids of encoding the whole text.
  std::vector<ChatSegment> segments;
  // `<|image|>` / `<|video|>` placeholders written (user and tool content only).
  int64_t num_images = 0;
  int64_t num_videos = 0;

  std::string text() const;
};

// Renders one conversation. `messages` is a JSON array of message objects; `tools` is a JSON array
// of tool definitions, or null / empty for none. Roles: system, user, assistant, tool (and
// "observation", read as tool). Assistant tool-call `arguments` may be an object or a JSON string
// holding one. Input the released template would render as garbage or not at all (unknown roles,
// malformed tool calls, media outside user/tool content, content of the wrong type) throws
// glmtune::Error whose `where()` names `sample_index` and the message index.
RenderedChat render_chat(ChatTemplateKind kind, const OrderedJson& messages,
                         const OrderedJson& tools, const ChatTemplateOptions& options,
                         int64_t sample_index = 0);

struct TokenizedSample {
  std::vector<int32_t> input_ids;
  // Unshifted: labels[i] == input_ids[i] where token i is trained, kIgnoreIndex elsewhere. Packing
  // aligns them to next-token targets per document.
  std::vector<int32_t> labels;

  int64_t num_trained() const;
};

// Encodes each segment (special tokens written literally become their ids) and labels it.
TokenizedSample tokenize_segments(const std::vector<ChatSegment>& segments,
                                  const Tokenizer& tokenizer);
// Same, from ids the caller already encoded (encoded[i] belongs to segments[i]); lets a dataset
// encode the segments of many samples in one parallel batch.
TokenizedSample assemble_segments(const std::vector<ChatSegment>& segments,
                                  const std::vector<std::vector<int32_t>>& encoded);

// Python's `json.dumps(value, ensure_ascii=False)` with default separators: the `tojson` filter
// the reference renderer uses for tool schemas and non-string tool-call arguments. Floats use
// Python's shortest repr (`1e-05`, `100.0`, `1e+16`).
std::string python_json_dumps(const OrderedJson& value);
// Python's `str.strip()`: removes leading and trailing Unicode whitespace (`str.isspace`).
std::string_view python_strip(std::string_view text);

}  // namespace glmtune::data
