#pragma once
// One vision-language conversation -> what the model trains on, as transformers 5.17.0
// `Glm5NextProcessor` builds it from the released chat template's text:
//   input_ids / labels  the chat template's training sequence with every image placeholder
//                       expanded to its `<|image|>` run and every video placeholder to its
//                       per-tubelet image runs and "{t:.1f} seconds" text;
//   mm_token_type_ids   1 for image tokens, 2 for image tokens inside video spans, 0 otherwise;
//   pixel_values (f32 [Σ rows, 1176]) + image_grid_thw (i64 [n_images, 3]), and
//   pixel_values_videos + video_grid_thw (i64 [n_videos, 3]), in order of appearance.
//
// Media are content items of user and tool messages, as the chat template renders them:
//   {"type": "image", "image": PATH}          also "path" or "url" instead of "image"
//   {"type": "image_url", "image_url": {"url": PATH}}   (or a plain string)
//   {"type": "video", "video": PATH} / {"type": "video_url", "video_url": {"url": PATH}}
// PATH is a local file (optionally "file://..."); relative paths resolve against the media root.
// The token stream can be computed from the file headers and the video packet scan alone
// (`with_pixels = false`); it equals the decoded path's.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "glmtune/data/chat_template.h"
#include "glmtune/data/media/processor.h"
#include "glmtune/data/media/video_processor.h"
#include "glmtune/data/tokenizer.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::data::media {

enum class MediaKind { image, video };

struct MediaRef {
  MediaKind kind = MediaKind::image;
  std::filesystem::path path;  // resolved against the media root
  std::string where;           // "message 2, content item 0" for errors
};

// The media of `messages` in the order the chat template writes their placeholders. Throws
// glmtune::Error (naming `source` and the message) for items without a usable local path.
std::vector<MediaRef> collect_media(const OrderedJson& messages,
                                    const std::filesystem::path& media_root,
                                    const std::string& source);

struct VlSample {
  std::vector<int32_t> input_ids;
  std::vector<int32_t> labels;  // unshifted; kIgnoreIndex where not trained
  std::vector<int32_t> mm_token_type_ids;
  std::vector<std::array<int64_t, 3>> image_grid_thw;
  std::vector<std::array<int64_t, 3>> video_grid_thw;
  std::vector<std::vector<double>> video_timestamps;  // per video, per tubelet
  // Empty ([0, 1176]) unless pixels were asked for or when there is no such media.
  Tensor pixel_values;
  Tensor pixel_values_videos;
};

// A processor directory as a release ships it: tokenizer.json (+ tokenizer_config.json),
// processor_config.json with "image_processor" and "video_processor" sections (or
// preprocessor_config.json / video_preprocessor_config.json).
class VlProcessor {
 public:
  static VlProcessor from_dir(const std::filesystem::path& dir);
  VlProcessor(Tokenizer tokenizer, ProcessorConfig image, VideoProcessorConfig video);

  // Renders, tokenizes and expands one conversation. `source` names it in errors (a file, a
  // dataset line). Without pixels, images are only probed and videos only scanned.
  VlSample process(const OrderedJson& messages, const OrderedJson& tools,
                   const ChatTemplateOptions& options, const std::filesystem::path& media_root,
                   const std::string& source, bool with_pixels = true,
                   ChatTemplateKind kind = ChatTemplateKind::kGlm53) const;

  const Tokenizer& tokenizer() const { return tokenizer_; }
  const ProcessorConfig& image_config() const { return image_; }
  const VideoProcessorConfig& video_config() const { return video_; }
  const MediaTokenIds& media_ids() const { return media_; }

  DecodeOptions image_decode_options;
  VideoLimits video_limits;

 private:
  Tokenizer tokenizer_;
  ProcessorConfig image_;
  VideoProcessorConfig video_;
  MediaTokenIds media_;
};

}  // namespace glmtune::data::media
