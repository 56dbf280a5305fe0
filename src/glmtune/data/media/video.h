#pragma once
// Video decoding to 8-bit RGB frames with the FFmpeg libraries (any container and codec the
// installed libavformat / libavcodec read), reproducing what the reference pipeline feeds its video
// processor: transformers 5.17.0 decodes video files with torchcodec in "exact" seek mode, so
//   - the metadata comes from a scan of every packet of the best video stream (no decoding):
//     num_frames = packets counted, begin / end = min pts and max (pts + duration) in seconds,
//     duration = end − begin, fps = num_frames / duration (the header's frame rate when the
//     duration is 0);
//   - frame i is the i-th packet in pts order; decoding returns, for each wanted index, the first
//     decoded frame whose timestamp reaches that packet's pts;
//   - YUV -> RGB24 goes through libswscale (bilinear flags, the frame's colour matrix and range);
//   - the container's display matrix is applied (rotations by multiples of 90 degrees).
//
// Untrusted input is bounded: the container is read through glmtune's own I/O (FFmpeg never opens
// another file or URL, so playlists and concat lists cannot reach outside the given data), the
// frame size is checked before any frame buffer is allocated, and the packet count and duration
// are capped. Every failure is a glmtune::Error naming the source. Builds without FFmpeg
// (GLMTUNE_VIDEO=OFF) compile this interface; opening a video then throws an Error saying so.

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "glmtune/data/media/image.h"

namespace glmtune::data::media {

// Whether this build decodes videos (configured with GLMTUNE_VIDEO and FFmpeg found).
bool video_decoding_available();

struct VideoLimits {
  // Width · height of a frame (after rotation), checked on the stream header and on every
  // decoded frame.
  uint64_t max_frame_pixels = uint64_t(8192) * 8192;
  // Packets (frames) of the video stream; a scan stops with an error past it.
  int64_t max_frames = 1'000'000;
  // Stream duration in seconds.
  double max_duration_seconds = 24.0 * 3600.0;
  // Decoder threads per video; 0 lets FFmpeg choose (about one per core). Callers that decode
  // many short clips at once, or want reproducible decoder timing, pass 1.
  int decoder_threads = 0;
};

// What the packet scan says, before any frame is decoded.
struct VideoInfo {
  std::string container;  // demuxer name ("mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", ...)
  std::string codec;      // decoder name ("h264", "vp9", ...)
  int64_t width = 0;      // decoded frames, after rotation
  int64_t height = 0;
  int rotation = 0;                // counter-clockwise degrees applied: 0, 90, 180 or 270
  int64_t num_frames = 0;          // packets of the stream
  double begin = 0.0;              // seconds
  double duration = 0.0;           // seconds (end − begin)
  double fps = 0.0;                // num_frames / duration, or the header's rate when duration is 0
  std::vector<int64_t> frame_pts;  // per frame index, in the stream's time base (sorted)
};

class VideoReader {
 public:
  // Opens and scans a file. `source` names it in errors (defaults to the path).
  static VideoReader open_file(const std::filesystem::path& path, const VideoLimits& limits = {});
  // Opens and scans bytes held by the caller, who keeps them alive as long as the reader.
  static VideoReader open_bytes(std::span<const uint8_t> bytes, const std::string& source,
                                const VideoLimits& limits = {});

  VideoReader(VideoReader&&) noexcept;
  VideoReader& operator=(VideoReader&&) noexcept;
  ~VideoReader();

  const VideoInfo& info() const;
  const std::string& source() const;

  // Decodes the frames at `indices` (each in [0, num_frames), any order, repeats allowed) in one
  // pass from the start, and calls `sink(k, frame)` for position k of `indices` as each becomes
  // available (positions in order of their frame index). Throws glmtune::Error when an index is
  // out of range or the stream ends (truncated, corrupt) before a wanted frame was decoded.
  void read_frames(std::span<const int64_t> indices,
                   const std::function<void(size_t position, const RgbImage& frame)>& sink);
  // The same, collected in the order of `indices`.
  std::vector<RgbImage> read_frames(std::span<const int64_t> indices);

 private:
  struct Impl;
  explicit VideoReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The packet scan of a file, without decoding.
VideoInfo probe_video_file(const std::filesystem::path& path, const VideoLimits& limits = {});

}  // namespace glmtune::data::media
