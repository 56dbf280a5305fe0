#pragma once
// The GLM-5.3 video processor (transformers 5.17.0 `Glm5NextVideoProcessor`) and the video side of
// the text/vision splice:
//
//   scan metadata -> frame sampling (fps rule, max frames, deduplicated, padded to an even count
//   with the last index) -> one smart_resize canvas for the whole clip (the token budget is over
//   all frames) -> per frame: bicubic antialiased resize when needed, zero pad, normalise ->
//   tubelets of 2 frames in merge-block-major rows + grid_thw [frames/2, gh, gw].
//
// In the prompt a video with grid (T, h, w) becomes, between the template's <|begin_of_video|> and
// <|end_of_video|>, T segments `<|begin_of_image|>` + h·w/4 × `<|image|>` + `<|end_of_image|>` +
// "{t:.1f} seconds", t the timestamp of the tubelet's first frame. The sampling, geometry and
// token counts need only the scan (VideoInfo), never decoded pixels.

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "glmtune/data/media/processor.h"
#include "glmtune/data/media/video.h"

namespace glmtune::data::media {

// The `video_processor` section of processor_config.json (or a bare video preprocessor config).
struct VideoProcessorConfig {
  ProcessorConfig geometry = default_geometry();  // patch sizes, normalisation, token budget
  double fps = 2.0;                               // frames sampled per second
  int64_t max_frames = 2048;
  double max_duration = 0.0;  // seconds; 0 keeps the whole clip
  bool do_sample_frames = true;

  static VideoProcessorConfig from_file(const std::string& path);
  static VideoProcessorConfig from_json_text(std::string_view text, const std::string& source);
  // Image-processor geometry with the video budget: min 16, max 240000 merged tokens per video.
  static ProcessorConfig default_geometry();
};

// numpy.linspace(a, b, n, dtype=int): float64 steps, the last element exactly b, truncated.
std::vector<int64_t> linspace_floor(int64_t a, int64_t b, int64_t n);

// The reference `sample_frames`: frame indices for a clip of `total_frames` frames at `fps`
// (duration 0 means unknown: the reference then estimates it from the frame count). An odd count
// is padded with the last index. Throws glmtune::Error naming `source` when no frame is sampled
// (a clip shorter than 1 / config.fps seconds) or the metadata is unusable.
std::vector<int64_t> sample_frame_indices(const VideoProcessorConfig& config, int64_t total_frames,
                                          double fps, double duration, const std::string& source);

struct VideoGeometry {
  int64_t num_frames = 0;  // frames after sampling (before the temporal padding)
  int64_t height = 0, width = 0;
  int64_t canvas_height = 0, canvas_width = 0;
  int64_t content_height = 0, content_width = 0;
  int64_t grid_t = 0, grid_h = 0, grid_w = 0;
  int64_t merge_size = 2;

  bool resized() const { return content_height != height || content_width != width; }
  int64_t num_patches() const { return grid_t * grid_h * grid_w; }
  int64_t tokens_per_frame() const { return grid_h * grid_w / (merge_size * merge_size); }
  // `<|image|>` tokens of the whole video (markers and timestamp text not included).
  int64_t num_image_tokens() const { return grid_t * tokens_per_frame(); }
};

VideoGeometry video_geometry(const VideoProcessorConfig& config, int64_t num_frames, int64_t height,
                             int64_t width);

// Everything decided before decoding: which frames, their timestamps, the geometry.
struct VideoPlan {
  std::vector<int64_t> frame_indices;
  std::vector<double> timestamps;  // per sampled frame: index / fps
  VideoGeometry geometry;
  // One timestamp per tubelet (every other sampled frame, padded with the last).
  std::vector<double> tubelet_timestamps() const;
};

VideoPlan plan_video(const VideoProcessorConfig& config, const VideoInfo& info,
                     const std::string& source);

// Pixel rows of already sampled frames (all of one size), e.g. a clip given as images.
struct ProcessedVideo {
  VideoPlan plan;
  std::vector<float> rows;  // [grid_t·gh·gw, row_size]
};
ProcessedVideo process_video_frames(const VideoProcessorConfig& config,
                                    std::span<const RgbImage> frames,
                                    std::span<const double> timestamps);
// Scans, samples, decodes and processes a video file, one decoded frame in memory at a time.
ProcessedVideo process_video_file(const VideoProcessorConfig& config,
                                  const std::filesystem::path& path,
                                  const VideoLimits& limits = {});
// The same from a reader (already scanned).
ProcessedVideo process_video(const VideoProcessorConfig& config, VideoReader& reader);

// "{t:.1f} seconds" as Python formats it (correct rounding of the binary value).
std::string timestamp_text(double seconds);

// The text that replaces one "<|video|>" (see the top of this file).
std::string video_replacement_text(const VideoGeometry& geometry,
                                   std::span<const double> tubelet_timestamps);
// The same as token ids: the markers and image tokens by id, the timestamp text through the
// tokenizer (it sits between added tokens, so encoding it alone gives the ids of the full text).
std::vector<int32_t> video_replacement_ids(const VideoGeometry& geometry,
                                           std::span<const double> tubelet_timestamps,
                                           const MediaTokenIds& media, const Tokenizer& tokenizer);

}  // namespace glmtune::data::media
