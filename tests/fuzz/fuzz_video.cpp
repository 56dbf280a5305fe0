// libFuzzer entry: open arbitrary bytes as a video (FFmpeg's demuxers and decoders behind
// glmtune's reader: nested opens refused, frame size, count and duration limited) and run what
// decodes through the video processor. Every input must either be rejected with a glmtune::Error or
// give frames and pixel rows of exactly the announced geometry; anything else (a crash, a hang, a
// sanitizer report, an internal assertion, a size mismatch) is a bug. The limits are small so that
// every input stays cheap.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "glmtune/base/error.h"
#include "glmtune/data/media/video.h"
#include "glmtune/data/media/video_processor.h"

namespace {

using namespace glmtune::data::media;

[[noreturn]] void bug() { std::abort(); }

void fuzz_video(std::span<const uint8_t> bytes) {
  // The processor's resize (which fuzz_image exercises on its own) took 60% of each execution at
  // 64 Ki pixels and 8 frames; this target is about the demuxers, the decoders and the sampling.
  VideoLimits limits;
  limits.max_frame_pixels = 1 << 14;
  limits.max_frames = 256;
  limits.max_duration_seconds = 3600.0;
  // A decoder thread pool per input costs more than the decoding, and makes coverage timing-bound.
  limits.decoder_threads = 1;
  VideoProcessorConfig config;
  config.geometry.min_image_tokens = 4;
  config.geometry.max_image_tokens = 16;
  config.max_frames = 4;
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
  fuzz_video(std::span<const uint8_t>(data, size));
  return 0;
}
