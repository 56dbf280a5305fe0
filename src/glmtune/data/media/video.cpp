#include "glmtune/data/media/video.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>

#include "glmtune/base/error.h"

#if GLMTUNE_WITH_VIDEO
extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/display.h>
#include <libavutil/error.h>
#include <libavutil/imgutils.h>
#include <libavutil/log.h>
#include <libswscale/swscale.h>
}
#endif

namespace glmtune::data::media {

#if GLMTUNE_WITH_VIDEO

namespace {

constexpr const char* kCorruptFix =
    "check that the file is a complete, playable video (re-encode it, e.g. to H.264 MP4)";

std::string av_error_text(int code) {
  char buf[AV_ERROR_MAX_STRING_SIZE] = {};
  av_strerror(code, buf, sizeof(buf));
  return buf;
}

// FFmpeg reports corrupt input on stderr as well as through return codes; glmtune reports the
// failure itself, so only FFmpeg's fatal messages stay visible.
void quiet_ffmpeg_logging() {
  static const bool done = [] {
    av_log_set_level(AV_LOG_FATAL);
    return true;
  }();
  (void)done;
}

// The bytes FFmpeg reads: a file opened by glmtune or a caller's buffer. FFmpeg only sees them
// through these callbacks, never a path it could reinterpret as a protocol.
struct ByteSource {
  std::FILE* file = nullptr;
  std::span<const uint8_t> bytes;
  int64_t position = 0;
  int64_t size = 0;

  ~ByteSource() {
    if (file) std::fclose(file);
  }

  static int read(void* opaque, uint8_t* buf, int buf_size) {
    auto* self = static_cast<ByteSource*>(opaque);
    if (buf_size <= 0) return 0;
    size_t got = 0;
    if (self->file) {
      got = std::fread(buf, 1, size_t(buf_size), self->file);
      // A read error is not the end of the file: the demuxer reports it instead of a truncation.
      if (got == 0 && std::ferror(self->file)) return AVERROR(EIO);
    } else {
      const int64_t left = self->size - self->position;
      got = size_t(std::clamp<int64_t>(left, 0, buf_size));
      if (got) std::memcpy(buf, self->bytes.data() + self->position, got);
    }
    self->position += int64_t(got);
    return got == 0 ? AVERROR_EOF : int(got);
  }

  static int64_t seek(void* opaque, int64_t offset, int whence) {
    auto* self = static_cast<ByteSource*>(opaque);
    whence &= ~AVSEEK_FORCE;
    if (whence == AVSEEK_SIZE) return self->size;
    int64_t target = offset;
    if (whence == SEEK_CUR) target = self->position + offset;
    if (whence == SEEK_END) target = self->size + offset;
    if (whence != SEEK_SET && whence != SEEK_CUR && whence != SEEK_END) return AVERROR(EINVAL);
    if (target < 0) return AVERROR(EINVAL);
    if (self->file && fseeko(self->file, off_t(target), SEEK_SET) != 0) return AVERROR(EIO);
    self->position = target;
    return target;
  }
};

// Nested resources (HLS segments, concat lists, external references of a MOV) are refused.
int refuse_nested_open(AVFormatContext*, AVIOContext**, const char* url, int, AVDictionary**) {
  (void)url;
  return AVERROR(EPERM);
}

struct FormatContextDeleter {
  void operator()(AVFormatContext* ctx) const {
    if (ctx) avformat_close_input(&ctx);
  }
};
struct IoContextDeleter {
  void operator()(AVIOContext* io) const {
    if (!io) return;
    av_freep(&io->buffer);
    avio_context_free(&io);
  }
};
struct CodecContextDeleter {
  void operator()(AVCodecContext* ctx) const { avcodec_free_context(&ctx); }
};
struct PacketDeleter {
  void operator()(AVPacket* p) const { av_packet_free(&p); }
};
struct FrameDeleter {
  void operator()(AVFrame* f) const { av_frame_free(&f); }
};
struct SwsDeleter {
  void operator()(SwsContext* s) const { sws_freeContext(s); }
};

using FormatContextPtr = std::unique_ptr<AVFormatContext, FormatContextDeleter>;
using IoContextPtr = std::unique_ptr<AVIOContext, IoContextDeleter>;
using CodecContextPtr = std::unique_ptr<AVCodecContext, CodecContextDeleter>;
using PacketPtr = std::unique_ptr<AVPacket, PacketDeleter>;
using FramePtr = std::unique_ptr<AVFrame, FrameDeleter>;
using SwsPtr = std::unique_ptr<SwsContext, SwsDeleter>;

// One demuxer over the source, positioned at its start. The IO context must outlive the format
// context, hence the member order.
struct Demuxer {
  IoContextPtr io;
  FormatContextPtr format;
  int stream_index = -1;
  const AVCodec* decoder = nullptr;

  AVStream* stream() const { return format->streams[stream_index]; }
};

int rotation_of(const AVStream* stream) {
  const uint8_t* matrix = nullptr;
#if LIBAVFORMAT_VERSION_INT >= AV_VERSION_INT(60, 15, 100)
  const AVPacketSideData* sd =
      av_packet_side_data_get(stream->codecpar->coded_side_data,
                              stream->codecpar->nb_coded_side_data, AV_PKT_DATA_DISPLAYMATRIX);
  if (sd && sd->size >= 9 * 4) matrix = sd->data;
#else
  size_t size = 0;
  matrix = av_stream_get_side_data(stream, AV_PKT_DATA_DISPLAYMATRIX, &size);
  if (size < 9 * 4) matrix = nullptr;
#endif
  if (!matrix) return 0;
  const double degrees = av_display_rotation_get(reinterpret_cast<const int32_t*>(matrix));
  if (!std::isfinite(degrees)) return 0;
  // Nearest multiple of 90, counter-clockwise, as torchcodec rounds it.
  const long quarter = std::lround(degrees / 90.0);
  return int(((quarter % 4) + 4) % 4) * 90;
}

}  // namespace

struct VideoReader::Impl {
  std::string source;
  VideoLimits limits;
  ByteSource bytes;
  VideoInfo info;
  AVRational time_base{0, 1};

  [[noreturn]] void fail(const std::string& what, const std::string& fix = kCorruptFix) const {
    throw Error(what, source, fix);
  }

  Demuxer open_demuxer() {
    ByteSource::seek(&bytes, 0, SEEK_SET);
    Demuxer d;
    constexpr int kBufferSize = 1 << 16;
    auto* buffer = static_cast<uint8_t*>(av_malloc(kBufferSize));
    if (!buffer) fail("out of memory opening the video");
    d.io.reset(avio_alloc_context(buffer, kBufferSize, 0, &bytes, &ByteSource::read, nullptr,
                                  &ByteSource::seek));
    if (!d.io) {
      av_free(buffer);
      fail("out of memory opening the video");
    }
    AVFormatContext* ctx = avformat_alloc_context();
    if (!ctx) fail("out of memory opening the video");
    ctx->pb = d.io.get();
    ctx->flags |= AVFMT_FLAG_CUSTOM_IO;
    ctx->io_open = &refuse_nested_open;
    // avformat_open_input frees the context on failure.
    const int rc = avformat_open_input(&ctx, nullptr, nullptr, nullptr);
    if (rc < 0)
      fail(fmt::format("not a readable video ({}): unknown container or corrupt header",
                       av_error_text(rc)));
    d.format.reset(ctx);
    const int info_rc = avformat_find_stream_info(ctx, nullptr);
    if (info_rc < 0)
      fail(fmt::format("cannot read the video's stream information ({})", av_error_text(info_rc)));
    d.stream_index = av_find_best_stream(ctx, AVMEDIA_TYPE_VIDEO, -1, -1, &d.decoder, 0);
    if (d.stream_index == AVERROR_DECODER_NOT_FOUND)
      fail("the video's codec has no decoder in the installed FFmpeg libraries",
           "re-encode the video with a common codec (H.264, VP9, AV1)");
    if (d.stream_index < 0)
      fail("the file has no video stream", "give a video file (MP4, WebM, MKV, ...)");
    for (unsigned i = 0; i < ctx->nb_streams; ++i)
      if (int(i) != d.stream_index) ctx->streams[i]->discard = AVDISCARD_ALL;
    return d;
  }

  void scan() {
    Demuxer d = open_demuxer();
    const AVStream* stream = d.stream();
    const AVCodecParameters* par = stream->codecpar;
    time_base = stream->time_base;
    if (time_base.num <= 0 || time_base.den <= 0) fail("the video stream has no valid time base");
    info.container = d.format->iformat->name ? d.format->iformat->name : "";
    info.codec = avcodec_get_name(par->codec_id);
    info.rotation = rotation_of(stream);
    if (par->width <= 0 || par->height <= 0)
      fail(
          fmt::format("the video stream has no valid frame size ({}x{})", par->width, par->height));
    check_frame_size(par->width, par->height);
    const bool swap = info.rotation == 90 || info.rotation == 270;
    info.width = swap ? par->height : par->width;
    info.height = swap ? par->width : par->height;

    PacketPtr packet(av_packet_alloc());
    if (!packet) fail("out of memory reading the video");
    int64_t begin = std::numeric_limits<int64_t>::max();
    int64_t end = std::numeric_limits<int64_t>::min();
    for (;;) {
      const int rc = av_read_frame(d.format.get(), packet.get());
      if (rc == AVERROR_EOF) break;
      if (rc < 0) fail(fmt::format("corrupt video data ({})", av_error_text(rc)));
      const bool ours = packet->stream_index == d.stream_index;
      const bool discard = packet->flags & AV_PKT_FLAG_DISCARD;
      const int64_t pts = packet->pts != AV_NOPTS_VALUE ? packet->pts : packet->dts;
      const int64_t duration = packet->duration;
      av_packet_unref(packet.get());
      if (!ours || discard) continue;
      if (pts == AV_NOPTS_VALUE) fail("a video packet carries no timestamp");
      if (int64_t(info.frame_pts.size()) >= limits.max_frames)
        fail(fmt::format("the video has more than {} frames", limits.max_frames),
             "cut the video into shorter clips");
      begin = std::min(begin, pts);
      // Saturating: corrupt timestamps must not overflow.
      int64_t stop = 0;
      if (__builtin_add_overflow(pts, duration, &stop)) fail("corrupt video timestamps");
      end = std::max(end, stop);
      info.frame_pts.push_back(pts);
    }
    info.num_frames = int64_t(info.frame_pts.size());
    if (info.num_frames == 0) fail("the video stream has no frames");
    std::sort(info.frame_pts.begin(), info.frame_pts.end());
    // Multiply before dividing, as torchcodec converts timestamps.
    auto seconds = [&](int64_t t) { return double(t) * time_base.num / time_base.den; };
    info.begin = seconds(begin);
    info.duration = seconds(end) - info.begin;
    if (!std::isfinite(info.duration) || info.duration < 0.0)
      fail("corrupt video timestamps (negative duration)");
    if (info.duration > limits.max_duration_seconds)
      fail(fmt::format("the video lasts {:.0f} s, more than the limit of {:.0f} s", info.duration,
                       limits.max_duration_seconds),
           "cut the video into shorter clips");
    if (info.duration != 0.0) {
      info.fps = double(info.num_frames) / info.duration;
    } else {
      const double header = av_q2d(stream->r_frame_rate);
      info.fps = header > 0 && std::isfinite(header) ? header : 0.0;
    }
  }

  void check_frame_size(int64_t width, int64_t height) const {
    if (width <= 0 || height <= 0 || uint64_t(width) * uint64_t(height) > limits.max_frame_pixels)
      fail(fmt::format("video frames of {}x{} exceed the limit of {} pixels", width, height,
                       limits.max_frame_pixels),
           "downscale the video before training on it");
  }

  RgbImage to_rgb(const AVFrame* frame, SwsPtr& sws) const {
    check_frame_size(frame->width, frame->height);
    const auto format = AVPixelFormat(frame->format);
    if (!sws_isSupportedInput(format))
      fail(fmt::format("unsupported pixel format {}", int(frame->format)));
    sws.reset(sws_getCachedContext(sws.release(), frame->width, frame->height, format, frame->width,
                                   frame->height, AV_PIX_FMT_RGB24, SWS_BILINEAR, nullptr, nullptr,
                                   nullptr));
    if (!sws) fail("cannot convert the video's frames to RGB");
    int *inv_table = nullptr, *table = nullptr;
    int src_range = 0, dst_range = 0, brightness = 0, contrast = 0, saturation = 0;
    if (sws_getColorspaceDetails(sws.get(), &inv_table, &src_range, &table, &dst_range, &brightness,
                                 &contrast, &saturation) >= 0) {
      if (frame->color_range != AVCOL_RANGE_UNSPECIFIED)
        src_range = frame->color_range == AVCOL_RANGE_JPEG;
      const int* coefficients = sws_getCoefficients(frame->colorspace);
      sws_setColorspaceDetails(sws.get(), coefficients, src_range, coefficients, dst_range,
                               brightness, contrast, saturation);
    }
    // swscale's SIMD converters only fill whole blocks of pixels that fit the destination
    // stride (a tight stride leaves the last width % 8 pixels unwritten), so convert into padded
    // rows, as FFmpeg's own frame buffers are, and copy them out.
    const int64_t stride = ((frame->width + 31) / 32 * 32 * 3 + 63) / 64 * 64;
    std::vector<uint8_t> padded(size_t(stride * frame->height));
    uint8_t* dst[4] = {padded.data(), nullptr, nullptr, nullptr};
    const int dst_stride[4] = {int(stride), 0, 0, 0};
    const int rows =
        sws_scale(sws.get(), frame->data, frame->linesize, 0, frame->height, dst, dst_stride);
    if (rows != frame->height) fail("cannot convert the video's frames to RGB");
    RgbImage rgb;
    rgb.height = frame->height;
    rgb.width = frame->width;
    rgb.pixels.resize(size_t(rgb.height * rgb.width * 3));
    for (int64_t y = 0; y < rgb.height; ++y)
      std::memcpy(&rgb.pixels[size_t(y * rgb.width * 3)], &padded[size_t(y * stride)],
                  size_t(rgb.width * 3));
    return info.rotation == 0 ? rgb : rotate(rgb, info.rotation);
  }

  // torch.rot90 on an H×W×3 image, k = degrees / 90 (counter-clockwise).
  static RgbImage rotate(const RgbImage& in, int degrees) {
    RgbImage out;
    const bool swap = degrees != 180;
    out.height = swap ? in.width : in.height;
    out.width = swap ? in.height : in.width;
    out.pixels.resize(in.pixels.size());
    for (int64_t y = 0; y < out.height; ++y)
      for (int64_t x = 0; x < out.width; ++x) {
        int64_t sy = 0, sx = 0;
        if (degrees == 90) {
          sy = x;
          sx = in.width - 1 - y;
        } else if (degrees == 180) {
          sy = in.height - 1 - y;
          sx = in.width - 1 - x;
        } else {
          sy = in.height - 1 - x;
          sx = y;
        }
        std::memcpy(&out.pixels[size_t((y * out.width + x) * 3)],
                    &in.pixels[size_t((sy * in.width + sx) * 3)], 3);
      }
    return out;
  }

  void read_frames(std::span<const int64_t> indices,
                   const std::function<void(size_t, const RgbImage&)>& sink) {
    for (int64_t index : indices)
      if (index < 0 || index >= info.num_frames)
        throw Error(fmt::format("frame index {} is out of range: the video has {} frames", index,
                                info.num_frames),
                    source);
    if (indices.empty()) return;
    // Wanted positions sorted by frame index: each takes the first decoded frame whose
    // timestamp reaches its packet's pts.
    std::vector<size_t> order(indices.size());
    std::iota(order.begin(), order.end(), size_t(0));
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return indices[a] < indices[b]; });
    size_t next = 0;

    Demuxer d = open_demuxer();
    CodecContextPtr codec(avcodec_alloc_context3(d.decoder));
    if (!codec) fail("out of memory opening the video decoder");
    if (avcodec_parameters_to_context(codec.get(), d.stream()->codecpar) < 0)
      fail("cannot configure the video decoder");
    codec->pkt_timebase = d.stream()->time_base;
    codec->thread_count = std::max(limits.decoder_threads, 0);
    codec->max_pixels = int64_t(std::min<uint64_t>(limits.max_frame_pixels, INT64_MAX));
    const int open_rc = avcodec_open2(codec.get(), d.decoder, nullptr);
    if (open_rc < 0)
      fail(fmt::format("cannot open the video decoder ({})", av_error_text(open_rc)));

    PacketPtr packet(av_packet_alloc());
    FramePtr frame(av_frame_alloc());
    if (!packet || !frame) fail("out of memory decoding the video");
    SwsPtr sws;
    auto drain = [&]() {
      for (;;) {
        const int rc = avcodec_receive_frame(codec.get(), frame.get());
        if (rc == AVERROR(EAGAIN) || rc == AVERROR_EOF) return;
        if (rc < 0) fail(fmt::format("corrupt video data ({})", av_error_text(rc)));
        const int64_t pts = frame->best_effort_timestamp;
        if (pts != AV_NOPTS_VALUE && next < order.size() &&
            info.frame_pts[size_t(indices[order[next]])] <= pts) {
          const RgbImage rgb = to_rgb(frame.get(), sws);
          if (rgb.height != info.height || rgb.width != info.width)
            fail(fmt::format("the frame size changes inside the video ({}x{}, then {}x{})",
                             info.width, info.height, rgb.width, rgb.height),
                 "re-encode the video at one frame size");
          while (next < order.size() && info.frame_pts[size_t(indices[order[next]])] <= pts)
            sink(order[next++], rgb);
        }
        av_frame_unref(frame.get());
      }
    };
    int64_t packets = 0;
    while (next < order.size()) {
      const int rc = av_read_frame(d.format.get(), packet.get());
      if (rc == AVERROR_EOF) break;
      if (rc < 0) fail(fmt::format("corrupt video data ({})", av_error_text(rc)));
      if (packet->stream_index != d.stream_index) {
        av_packet_unref(packet.get());
        continue;
      }
      // The scan counted these packets; more now means the data changed under us.
      if (++packets > limits.max_frames + 16) fail("the video changed while it was read");
      const int send_rc = avcodec_send_packet(codec.get(), packet.get());
      av_packet_unref(packet.get());
      // A damaged packet is skipped as players skip it; a frame it held is then missing below.
      if (send_rc < 0 && send_rc != AVERROR(EAGAIN) && send_rc != AVERROR_INVALIDDATA)
        fail(fmt::format("corrupt video data ({})", av_error_text(send_rc)));
      drain();
    }
    if (next < order.size()) {
      avcodec_send_packet(codec.get(), nullptr);
      drain();
    }
    if (next < order.size())
      fail(fmt::format("frame {} of {} could not be decoded (the video is truncated or corrupt)",
                       indices[order[next]], info.num_frames));
  }
};

VideoReader VideoReader::open_file(const std::filesystem::path& path, const VideoLimits& limits) {
  quiet_ffmpeg_logging();
  auto impl = std::make_unique<Impl>();
  impl->source = path.string();
  impl->limits = limits;
  const uint64_t size = media_file_size(path, "a video file");
  impl->bytes.file = std::fopen(path.c_str(), "rb");
  if (!impl->bytes.file)
    throw Error(fmt::format("cannot open the video: {}", std::strerror(errno)), impl->source,
                "check that the file is readable (its permissions)");
  if (size == 0) throw Error("the video file is empty", impl->source, kCorruptFix);
  impl->bytes.size = int64_t(size);
  impl->scan();
  return VideoReader(std::move(impl));
}

VideoReader VideoReader::open_bytes(std::span<const uint8_t> bytes, const std::string& source,
                                    const VideoLimits& limits) {
  quiet_ffmpeg_logging();
  auto impl = std::make_unique<Impl>();
  impl->source = source;
  impl->limits = limits;
  if (bytes.empty()) throw Error("the video data is empty", source, kCorruptFix);
  impl->bytes.bytes = bytes;
  impl->bytes.size = int64_t(bytes.size());
  impl->scan();
  return VideoReader(std::move(impl));
}

void VideoReader::read_frames(std::span<const int64_t> indices,
                              const std::function<void(size_t, const RgbImage&)>& sink) {
  impl_->read_frames(indices, sink);
}

bool video_decoding_available() { return true; }

#else  // !GLMTUNE_WITH_VIDEO

struct VideoReader::Impl {
  std::string source;
  VideoInfo info;
};

namespace {
[[noreturn]] void no_video(const std::string& source) {
  throw Error(
      "this glmtune was built without video support (GLMTUNE_VIDEO=OFF or the FFmpeg "
      "libraries were missing)",
      source,
      "install libavformat-dev libavcodec-dev libavutil-dev libswscale-dev "
      "(scripts/install-deps.sh) and rebuild with -DGLMTUNE_VIDEO=ON");
}
}  // namespace

VideoReader VideoReader::open_file(const std::filesystem::path& path, const VideoLimits&) {
  no_video(path.string());
}

VideoReader VideoReader::open_bytes(std::span<const uint8_t>, const std::string& source,
                                    const VideoLimits&) {
  no_video(source);
}

void VideoReader::read_frames(std::span<const int64_t>,
                              const std::function<void(size_t, const RgbImage&)>&) {
  no_video(impl_->source);
}

bool video_decoding_available() { return false; }

#endif  // GLMTUNE_WITH_VIDEO

VideoReader::VideoReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
VideoReader::VideoReader(VideoReader&&) noexcept = default;
VideoReader& VideoReader::operator=(VideoReader&&) noexcept = default;
VideoReader::~VideoReader() = default;

const VideoInfo& VideoReader::info() const { return impl_->info; }
const std::string& VideoReader::source() const { return impl_->source; }

std::vector<RgbImage> VideoReader::read_frames(std::span<const int64_t> indices) {
  std::vector<RgbImage> frames(indices.size());
  read_frames(indices, [&](size_t k, const RgbImage& frame) { frames[k] = frame; });
  return frames;
}

VideoInfo probe_video_file(const std::filesystem::path& path, const VideoLimits& limits) {
  return VideoReader::open_file(path, limits).info();
}

}  // namespace glmtune::data::media
