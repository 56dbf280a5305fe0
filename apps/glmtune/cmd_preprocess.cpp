// `glmtune preprocess`: the vision-language twin of `glmtune chat-template`. Renders one
// conversation with images and videos and prints what training would see, as transformers'
// `Glm5NextProcessor` builds it: `input_ids` (the training sequence: template text with every media
// placeholder expanded, plus the trained final `<|endoftext|>`), `loss_mask`, `mm_token_type_ids`,
// `image_grid_thw`, `video_grid_thw` and per video the tubelet timestamps. With --pixels it also
// decodes the media and writes float32 `pixel_values` / `pixel_values_videos` and the grids to a
// safetensors file; without it, images are only probed and videos only scanned (no decoding).

#include <cstdio>
#include <string>

#include "chat_request.h"
#include "command.h"
#include "glmtune/base/error.h"
#include "glmtune/data/chat_template.h"
#include "glmtune/data/media/vl_processor.h"
#include "glmtune/io/safetensors.h"

namespace {

using namespace glmtune;
using data::OrderedJson;

struct PreprocessArgs {
  std::string processor;
  std::string messages;
  std::string media_root;
  std::string pixels;
  std::string template_name = "glm5.3";
};

Tensor grid_tensor(const std::vector<std::array<int64_t, 3>>& grid) {
  std::vector<int64_t> flat;
  for (const auto& g : grid) flat.insert(flat.end(), g.begin(), g.end());
  return Tensor::from_vector(flat, {int64_t(grid.size()), 3});
}

}  // namespace

GLMTUNE_COMMAND(
    preprocess, "preprocess",
    "Render a conversation with images/videos: training ids, mm_token_type_ids, grids (JSON)",
    [](CLI::App& app) {
      auto a = std::make_shared<PreprocessArgs>();
      app.add_option("--processor", a->processor,
                     "Processor directory: tokenizer.json and processor_config.json")
          ->required();
      app.add_option("--messages", a->messages,
                     "JSON file with one object: messages (media as content items), optional "
                     "tools, reasoning_effort, clear_thinking, add_generation_prompt ('-' reads "
                     "stdin)")
          ->required();
      app.add_option("--media-root", a->media_root,
                     "Folder that relative media paths resolve against (default: the messages "
                     "file's folder, or the current one for stdin)");
      app.add_option("--pixels", a->pixels,
                     "Decode the media and write pixel_values, pixel_values_videos and the grids "
                     "(float32 / int64) to this safetensors file");
      app.add_option("--template", a->template_name, "Chat template name")->capture_default_str();
      return [a] {
        const std::string where = a->messages == "-" ? "stdin" : a->messages;
        const auto kind = data::chat_template_from_name(a->template_name);
        const auto processor = data::media::VlProcessor::from_dir(a->processor);
        cli::ChatRequest req = cli::read_chat_request(a->messages);
        const data::ChatTemplateOptions& options = req.options;
        const OrderedJson& tools = req.tools;
        std::filesystem::path root = a->media_root;
        if (root.empty())
          root = a->messages == "-" ? std::filesystem::current_path()
                                    : std::filesystem::absolute(a->messages).parent_path();

        const bool with_pixels = !a->pixels.empty();
        const auto sample =
            processor.process(req.messages, tools, options, root, where, with_pixels, kind);

        OrderedJson mask = OrderedJson::array();
        for (int32_t label : sample.labels) mask.push_back(label == data::kIgnoreIndex ? 0 : 1);
        OrderedJson out = {{"input_ids", sample.input_ids},
                           {"loss_mask", mask},
                           {"mm_token_type_ids", sample.mm_token_type_ids},
                           {"image_grid_thw", sample.image_grid_thw},
                           {"video_grid_thw", sample.video_grid_thw},
                           {"video_timestamps", sample.video_timestamps}};
        if (with_pixels) {
          io::NamedTensors tensors = {{"pixel_values", sample.pixel_values},
                                      {"image_grid_thw", grid_tensor(sample.image_grid_thw)},
                                      {"pixel_values_videos", sample.pixel_values_videos},
                                      {"video_grid_thw", grid_tensor(sample.video_grid_thw)}};
          io::save_safetensors(a->pixels, tensors);
        }
        std::puts(out.dump().c_str());
        return 0;
      };
    });
