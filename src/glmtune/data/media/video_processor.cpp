#include "glmtune/data/media/video_processor.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "glmtune/base/error.h"
#include "glmtune/base/fs.h"
#include "glmtune/data/tokenizer.h"

namespace glmtune::data::media {

// ---- Config -------------------------------------------------------------------------------------

ProcessorConfig VideoProcessorConfig::default_geometry() {
  ProcessorConfig geometry;
  geometry.min_image_tokens = 16;
  geometry.max_image_tokens = 240000;
  return geometry;
}

VideoProcessorConfig VideoProcessorConfig::from_file(const std::string& path) {
  return from_json_text(read_text_file(path, "processor config"), path);
}

VideoProcessorConfig VideoProcessorConfig::from_json_text(std::string_view text,
                                                          const std::string& source) {
  VideoProcessorConfig config;
  // A processor_config.json without a video section leaves the video processor at its defaults
  // rather than reading the image processor's keys.
  {
    nlohmann::json probe = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (probe.is_object() && probe.contains("image_processor") &&
        !probe.contains("video_processor"))
      return config;
  }
  config.geometry =
      ProcessorConfig::from_json_section(text, source, "video_processor", default_geometry());
  // The geometry parse above has validated the JSON and the section.
  const nlohmann::json doc = nlohmann::json::parse(text);
  const nlohmann::json& section = doc.contains("video_processor") ? doc["video_processor"] : doc;
  auto number = [&](const char* key, double& out) {
    if (!section.contains(key) || section[key].is_null()) return;
    if (!section[key].is_number())
      throw Error(fmt::format("`{}` must be a number, got {}", key, section[key].dump()), source);
    out = section[key].get<double>();
  };
  number("fps", config.fps);
  number("max_duration", config.max_duration);
  if (section.contains("max_frames")) {
    if (!section["max_frames"].is_number_integer() || section["max_frames"].get<int64_t>() <= 0)
      throw Error(fmt::format("`max_frames` must be a positive integer, got {}",
                              section["max_frames"].dump()),
                  source);
    config.max_frames = section["max_frames"].get<int64_t>();
  }
  if (section.contains("do_sample_frames")) {
    if (!section["do_sample_frames"].is_boolean())
      throw Error("`do_sample_frames` must be true or false", source);
    config.do_sample_frames = section["do_sample_frames"].get<bool>();
  }
  if (!(config.fps > 0.0) || !std::isfinite(config.fps))
    throw Error(fmt::format("`fps` must be positive, got {}", config.fps), source);
  if (!std::isfinite(config.max_duration))
    throw Error("`max_duration` must be a finite number of seconds", source);
  return config;
}

// ---- Sampling -----------------------------------------------------------------------------------

std::vector<int64_t> linspace_floor(int64_t a, int64_t b, int64_t n) {
  std::vector<int64_t> out;
  if (n <= 0) return out;
  out.reserve(size_t(n));
  if (n == 1) {
    out.push_back(a);
    return out;
  }
  // numpy: step = (b − a) / (n − 1); y_i = i·step + a, two roundings; y_last = b exactly.
  const double step = double(b - a) / double(n - 1);
  for (int64_t i = 0; i + 1 < n; ++i) {
    const double scaled = double(i) * step;
    out.push_back(int64_t(scaled + double(a)));
  }
  out.push_back(b);
  return out;
}

std::vector<int64_t> sample_frame_indices(const VideoProcessorConfig& config, int64_t total_frames,
                                          double fps, double duration, const std::string& source) {
  if (total_frames <= 0) throw Error("the video has no frames", source);
  if (!(fps > 0.0) || !std::isfinite(fps))
    throw Error("the video's frame rate is unknown, so frames cannot be sampled per second", source,
                "re-encode the video with a constant frame rate");
  // Python: `metadata.duration or round(max_frame_idx / fps) + 1` (round half to even).
  if (duration == 0.0) duration = std::nearbyint(double(total_frames - 1) / fps) + 1.0;
  const double max_seconds = std::trunc(duration);
  if (config.max_duration > 0.0) duration = std::min(duration, config.max_duration);
  const double extract = std::trunc(duration * config.fps);
  const int64_t extract_t = std::min<int64_t>(
      extract > double(INT64_MAX / 2) ? INT64_MAX / 2 : int64_t(extract), config.max_frames);

  std::vector<int64_t> indices;
  if (total_frames < extract_t) {
    indices = linspace_floor(0, total_frames - 1, extract_t);
  } else {
    // One frame each time the frame clock passes the next sampling instant.
    const double frame_time = 1.0 / fps;
    const double step = 1.0 / config.fps;
    double next = 0.0;
    for (int64_t k = 0; k < total_frames; ++k) {
      if (double(k) * frame_time >= next) {
        next += step;
        indices.push_back(k);
        if (next >= max_seconds) break;
      }
    }
  }
  if (int64_t(indices.size()) < extract_t) {
    const int64_t first = indices.empty() ? 0 : indices.front();
    const int64_t last = indices.empty() ? std::max<int64_t>(total_frames - 1, 0) : indices.back();
    indices = linspace_floor(first, last, extract_t);
  } else if (int64_t(indices.size()) > extract_t) {
    indices = linspace_floor(0, total_frames - 1, extract_t);
  }

  std::vector<int64_t> unique;
  std::unordered_set<int64_t> seen;
  for (int64_t i : indices)
    if (seen.insert(i).second) unique.push_back(i);
  if (unique.empty())
    throw Error(fmt::format("the video is too short: {:.3f} s gives no frame at {} frame(s) per "
                            "second",
                            duration, config.fps),
                source, fmt::format("use clips of at least {:.2f} s", 1.0 / config.fps));
  if (unique.size() % 2 == 1) unique.push_back(unique.back());
  return unique;
}

// ---- Geometry -----------------------------------------------------------------------------------

VideoGeometry video_geometry(const VideoProcessorConfig& config, int64_t num_frames, int64_t height,
                             int64_t width) {
  const ProcessorConfig& c = config.geometry;
  if (num_frames <= 0 || height <= 0 || width <= 0)
    throw Error(
        fmt::format("cannot size a video of {} frame(s) of {}x{}", num_frames, height, width));
  VideoGeometry g;
  g.num_frames = num_frames;
  g.height = height;
  g.width = width;
  g.merge_size = c.merge_size;
  const int64_t tf = c.temporal_patch_size;
  g.canvas_height = height;
  g.canvas_width = width;
  g.content_height = height;
  g.content_width = width;
  if (c.do_resize) {
    const auto [th, tw] = smart_resize(num_frames, height, width, tf, c.factor(),
                                       c.min_image_tokens, c.max_image_tokens);
    g.canvas_height = th;
    g.canvas_width = tw;
    // As for images, with the whole clip's pixels in the no-upscale test.
    double scale = std::min(double(th) / double(height), double(tw) / double(width));
    const int64_t pixels_per_token = tf * c.factor() * c.factor();
    if (num_frames * height * width >= pixels_per_token * c.min_image_tokens)
      scale = std::min(1.0, scale);
    g.content_height =
        std::max<int64_t>(1, std::min<int64_t>(th, int64_t(std::floor(double(height) * scale))));
    g.content_width =
        std::max<int64_t>(1, std::min<int64_t>(tw, int64_t(std::floor(double(width) * scale))));
  }
  g.grid_t = (num_frames + tf - 1) / tf;
  g.grid_h = g.canvas_height / c.patch_size;
  g.grid_w = g.canvas_width / c.patch_size;
  return g;
}

std::vector<double> VideoPlan::tubelet_timestamps() const {
  std::vector<double> out;
  for (size_t i = 0; i < timestamps.size() && int64_t(out.size()) < geometry.grid_t; i += 2)
    out.push_back(timestamps[i]);
  while (int64_t(out.size()) < geometry.grid_t) out.push_back(out.empty() ? 0.0 : out.back());
  return out;
}

VideoPlan plan_video(const VideoProcessorConfig& config, const VideoInfo& info,
                     const std::string& source) {
  VideoPlan plan;
  if (config.do_sample_frames) {
    plan.frame_indices =
        sample_frame_indices(config, info.num_frames, info.fps, info.duration, source);
  } else {
    if (info.num_frames > config.max_frames)
      throw Error(fmt::format("the video has {} frames and frame sampling is off; the limit is {}",
                              info.num_frames, config.max_frames),
                  source, "enable do_sample_frames or cut the video");
    for (int64_t i = 0; i < info.num_frames; ++i) plan.frame_indices.push_back(i);
  }
  // The reference falls back to 24 fps for timestamps when the rate is unknown.
  const double fps = info.fps > 0.0 ? info.fps : 24.0;
  for (int64_t i : plan.frame_indices) plan.timestamps.push_back(double(i) / fps);
  plan.geometry =
      video_geometry(config, int64_t(plan.frame_indices.size()), info.height, info.width);
  return plan;
}

// ---- Pixels -------------------------------------------------------------------------------------

namespace {

// Writes the frames of a clip into its rows as they arrive, in any order.
class ClipWriter {
 public:
  ClipWriter(const VideoProcessorConfig& config, const VideoGeometry& geometry,
             std::vector<float>& rows)
      : config_(config.geometry), g_(geometry), rows_(rows) {
    const int64_t p = config_.patch_size, m = config_.merge_size;
    if (g_.canvas_height % (p * m) != 0 || g_.canvas_width % (p * m) != 0)
      throw Error(fmt::format("the {}x{} video is not a whole number of {}x{} merge blocks "
                              "(resizing is off in the processor config)",
                              g_.canvas_height, g_.canvas_width, p * m, p * m),
                  "video processor", "enable do_resize or pass videos of a matching size");
    rows_.assign(size_t(g_.num_patches() * config_.row_size()), 0.0f);
  }

  void put(int64_t frame_position, const RgbImage& frame) {
    if (frame.height != g_.height || frame.width != g_.width)
      throw Error(fmt::format("frame {} is {}x{}, the clip's first frame {}x{}", frame_position,
                              frame.height, frame.width, g_.height, g_.width),
                  "video processor", "give frames of one size");
    const RgbImage canvas = resize_and_pad_to(frame, g_.content_height, g_.content_width,
                                              g_.canvas_height, g_.canvas_width);
    const int64_t tf = config_.temporal_patch_size;
    write_canvas_rows(config_, canvas, frame_position % tf, tubelet(frame_position / tf));
  }

  // The reference pads an incomplete last tubelet with copies of the last frame.
  void pad_last_tubelet() {
    const int64_t tf = config_.temporal_patch_size;
    const int64_t filled = g_.num_frames % tf;
    if (filled == 0) return;
    for (int64_t slot = filled; slot < tf; ++slot)
      copy_temporal_slot(config_, tubelet(g_.grid_t - 1), g_.grid_h * g_.grid_w, filled - 1, slot);
  }

 private:
  float* tubelet(int64_t k) {
    return rows_.data() + size_t(k * g_.grid_h * g_.grid_w * config_.row_size());
  }

  const ProcessorConfig& config_;
  const VideoGeometry& g_;
  std::vector<float>& rows_;
};

}  // namespace

ProcessedVideo process_video_frames(const VideoProcessorConfig& config,
                                    std::span<const RgbImage> frames,
                                    std::span<const double> timestamps) {
  if (frames.empty()) throw Error("a video needs at least one frame", "video processor");
  ProcessedVideo out;
  for (size_t i = 0; i < frames.size(); ++i) out.plan.frame_indices.push_back(int64_t(i));
  out.plan.timestamps.assign(timestamps.begin(), timestamps.end());
  out.plan.geometry =
      video_geometry(config, int64_t(frames.size()), frames[0].height, frames[0].width);
  ClipWriter writer(config, out.plan.geometry, out.rows);
  for (size_t i = 0; i < frames.size(); ++i) writer.put(int64_t(i), frames[i]);
  writer.pad_last_tubelet();
  return out;
}

ProcessedVideo process_video(const VideoProcessorConfig& config, VideoReader& reader) {
  ProcessedVideo out;
  out.plan = plan_video(config, reader.info(), reader.source());
  ClipWriter writer(config, out.plan.geometry, out.rows);
  reader.read_frames(out.plan.frame_indices, [&](size_t position, const RgbImage& frame) {
    writer.put(int64_t(position), frame);
  });
  writer.pad_last_tubelet();
  return out;
}

ProcessedVideo process_video_file(const VideoProcessorConfig& config,
                                  const std::filesystem::path& path, const VideoLimits& limits) {
  VideoReader reader = VideoReader::open_file(path, limits);
  return process_video(config, reader);
}

// ---- Prompt text --------------------------------------------------------------------------------

std::string timestamp_text(double seconds) {
  // glibc's printf rounds the exact binary value correctly (0.25 -> "0.2"), as Python does.
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.1f seconds", seconds);
  return buf;
}

std::string video_replacement_text(const VideoGeometry& geometry,
                                   std::span<const double> tubelet_timestamps) {
  GLMTUNE_ASSERT(int64_t(tubelet_timestamps.size()) == geometry.grid_t, "{} timestamps for {}",
                 tubelet_timestamps.size(), geometry.grid_t);
  std::string out;
  for (double t : tubelet_timestamps) {
    out += "<|begin_of_image|>";
    for (int64_t i = 0; i < geometry.tokens_per_frame(); ++i) out += kImagePlaceholder;
    out += "<|end_of_image|>";
    out += timestamp_text(t);
  }
  return out;
}

std::vector<int32_t> video_replacement_ids(const VideoGeometry& geometry,
                                           std::span<const double> tubelet_timestamps,
                                           const MediaTokenIds& media, const Tokenizer& tokenizer) {
  GLMTUNE_ASSERT(int64_t(tubelet_timestamps.size()) == geometry.grid_t, "{} timestamps for {}",
                 tubelet_timestamps.size(), geometry.grid_t);
  std::vector<int32_t> out;
  out.reserve(size_t(geometry.grid_t * (geometry.tokens_per_frame() + 6)));
  for (double t : tubelet_timestamps) {
    out.push_back(media.begin_of_image);
    out.insert(out.end(), size_t(geometry.tokens_per_frame()), media.image);
    out.push_back(media.end_of_image);
    const std::vector<int32_t> text = tokenizer.encode(timestamp_text(t));
    out.insert(out.end(), text.begin(), text.end());
  }
  return out;
}

}  // namespace glmtune::data::media
