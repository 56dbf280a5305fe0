// libFuzzer entry: decode arbitrary bytes as an image and as a video, and run what decodes through
// the processors. Every input must either be rejected with a glmtune::Error or give frames and
// pixel rows of exactly the announced geometry; anything else (a crash, a hang, a sanitizer report,
// an internal assertion, a size mismatch) is a bug. The limits are small so that every input stays
// cheap: the fuzzer looks for memory errors and unbounded work, not for big files.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/data/media/image.h"
#include "glmtune/data/media/processor.h"
#include "glmtune/data/media/video.h"
#include "glmtune/data/media/video_processor.h"

namespace {

using namespace glmtune::data::media;

[[noreturn]] void bug() { std::abort(); }

void fuzz_image(std::span<const uint8_t> bytes) {
  DecodeOptions options;
  options.max_pixels = 1 << 22;
  RgbImage image;
  try {
    image = decode_image(bytes, "fuzz input", options);
  } catch (const glmtune::Error&) {
    return;
  }
  if (image.height <= 0 || image.width <= 0 ||
      image.pixels.size() != size_t(image.height * image.width * 3))
    bug();
  ProcessorConfig config;
  config.max_image_tokens = 64;
  const ImageGeometry g = image_geometry(config, image.height, image.width);
  std::vector<float> rows;
  const auto grid = process_image_into(config, image, rows);
  if (grid[0] != g.grid_h || grid[1] != g.grid_w ||
      rows.size() != size_t(g.num_patches() * config.row_size()))
    bug();
}

void fuzz_video(std::span<const uint8_t> bytes) {
  VideoLimits limits;
  limits.max_frame_pixels = 1 << 20;
  limits.max_frames = 4096;
  limits.max_duration_seconds = 3600.0;
  VideoProcessorConfig config;
  config.geometry.max_image_tokens = 256;
  config.max_frames = 8;
  try {
    VideoReader reader = VideoReader::open_bytes(bytes, "fuzz input", limits);
    const VideoInfo& info = reader.info();
    if (info.num_frames <= 0 || int64_t(info.frame_pts.size()) != info.num_frames) bug();
    if (info.width <= 0 || info.height <= 0 ||
        uint64_t(info.width) * uint64_t(info.height) > limits.max_frame_pixels)
      bug();
    const ProcessedVideo video = process_video(config, reader);
    const VideoGeometry& g = video.plan.geometry;
    if (video.rows.size() != size_t(g.num_patches() * config.geometry.row_size())) bug();
    if (int64_t(video.plan.tubelet_timestamps().size()) != g.grid_t) bug();
  } catch (const glmtune::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  fuzz_image(bytes);
  fuzz_video(bytes);
  return 0;
}
