// Video decoding and the video processor against transformers 5.17.0 (`Glm5NextVideoProcessor`
// decoding files with torchcodec): packet-scan metadata, frame sampling, decoded RGB frames
// (exact), pixel rows, grid_thw, timestamps and the prompt expansion; geometry for many sizes; and
// the failure modes of untrusted files. Fixtures: tools/golden/media_video.py.

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/data/media/video.h"
#include "glmtune/data/media/video_processor.h"
#include "glmtune/data/tokenizer.h"
#include "glmtune/io/safetensors.h"
#include "support/temp_dir.h"

namespace glmtune::data::media {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kRoot = GLMTUNE_SOURCE_DIR;
const std::string kGolden = kRoot + "/tests/golden/media_video";

struct Golden {
  io::SafetensorsFile file;
  json doc;
};

const Golden& golden() {
  static const Golden g = [] {
    Golden out{io::SafetensorsFile::open(kGolden + "/video.safetensors"), {}};
    out.doc = json::parse(out.file.metadata().at("golden"));
    return out;
  }();
  return g;
}

std::vector<uint8_t> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& p, const std::vector<uint8_t>& bytes) {
  std::ofstream out(p, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

// Runs `fn`, expects a glmtune::Error and returns it.
template <typename Fn>
Error error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "expected a glmtune::Error";
  return Error("none");
}

#define REQUIRE_VIDEO() \
  if (!video_decoding_available()) GTEST_SKIP() << "built without FFmpeg (GLMTUNE_VIDEO)"

TEST(MediaVideo, SamplingMatchesReference) {
  const json& cases = golden().doc["sampling"];
  ASSERT_GE(cases.size(), 60u);
  for (const json& c : cases) {
    VideoProcessorConfig config;
    const json& s = c["settings"];
    if (s.contains("fps")) config.fps = s["fps"].get<double>();
    if (s.contains("max_frames")) config.max_frames = s["max_frames"];
    if (s.contains("max_duration")) config.max_duration = s["max_duration"].get<double>();
    const int64_t total = c["total_frames"];
    const double fps = c["fps"], duration = c["duration"];
    SCOPED_TRACE(testing::Message() << total << " frames at " << fps << " fps, " << duration
                                    << " s, settings " << s.dump());
    // The reference returns no frame at all (and fails further down); glmtune says why at once.
    if (c["indices"].is_string() || c["indices"].empty()) {
      const Error e = error_of([&] { sample_frame_indices(config, total, fps, duration, "clip"); });
      EXPECT_EQ(e.where(), "clip");
      continue;
    }
    EXPECT_EQ(sample_frame_indices(config, total, fps, duration, "clip"),
              c["indices"].get<std::vector<int64_t>>());
  }
}

TEST(MediaVideo, LinspaceIsNumpys) {
  EXPECT_EQ(linspace_floor(0, 285, 22),
            (std::vector<int64_t>{0,   13,  27,  40,  54,  67,  81,  95,  108, 122, 135,
                                  149, 162, 176, 190, 203, 217, 230, 244, 257, 271, 285}));
  EXPECT_EQ(linspace_floor(7, 7, 3), (std::vector<int64_t>{7, 7, 7}));
  EXPECT_EQ(linspace_floor(3, 9, 1), (std::vector<int64_t>{3}));
  EXPECT_TRUE(linspace_floor(0, 9, 0).empty());
}

TEST(MediaVideo, GeometryMatchesReference) {
  const VideoProcessorConfig config;
  for (const json& g : golden().doc["video_geometry"]) {
    const int64_t f = g["frames"], h = g["height"], w = g["width"];
    SCOPED_TRACE(testing::Message() << f << " frames of " << h << "x" << w);
    const VideoGeometry geo = video_geometry(config, f, h, w);
    EXPECT_EQ(geo.canvas_height, g["canvas"][0].get<int64_t>());
    EXPECT_EQ(geo.canvas_width, g["canvas"][1].get<int64_t>());
    EXPECT_EQ(geo.content_height, g["content"][0].get<int64_t>());
    EXPECT_EQ(geo.content_width, g["content"][1].get<int64_t>());
    EXPECT_EQ(geo.grid_t, g["grid"][0].get<int64_t>());
    EXPECT_EQ(geo.grid_h, g["grid"][1].get<int64_t>());
    EXPECT_EQ(geo.grid_w, g["grid"][2].get<int64_t>());
    EXPECT_LE(geo.num_image_tokens(), 240000 + geo.tokens_per_frame());
  }
  const ProcessorConfig image;
  for (const json& g : golden().doc["image_geometry"]) {
    const int64_t h = g["height"], w = g["width"];
    SCOPED_TRACE(testing::Message() << "image " << h << "x" << w);
    const ImageGeometry geo = image_geometry(image, h, w);
    EXPECT_EQ(geo.canvas_height, g["canvas"][0].get<int64_t>());
    EXPECT_EQ(geo.canvas_width, g["canvas"][1].get<int64_t>());
    EXPECT_EQ(geo.content_height, g["content"][0].get<int64_t>());
    EXPECT_EQ(geo.content_width, g["content"][1].get<int64_t>());
    EXPECT_EQ(geo.num_patches(), g["patches"].get<int64_t>());
  }
}

TEST(MediaVideo, TimestampTextRoundsLikePython) {
  EXPECT_EQ(timestamp_text(0.0), "0.0 seconds");
  EXPECT_EQ(timestamp_text(0.25), "0.2 seconds");
  EXPECT_EQ(timestamp_text(0.35), "0.3 seconds");
  EXPECT_EQ(timestamp_text(0.75), "0.8 seconds");
  EXPECT_EQ(timestamp_text(12.0), "12.0 seconds");
  EXPECT_EQ(timestamp_text(1.0 / 3.0), "0.3 seconds");
}

TEST(MediaVideo, DecodesLikeTorchcodecAndProcessesLikeReference) {
  REQUIRE_VIDEO();
  const Golden& g = golden();
  const auto tokenizer = Tokenizer::from_file(kRoot + "/examples/tiny/tokenizer/tokenizer.json");
  const MediaTokenIds media = MediaTokenIds::from_tokenizer(tokenizer);
  const std::vector<int32_t> prompt = tokenizer.encode(g.doc["prompt"].get<std::string>());
  const VideoProcessorConfig config;
  ASSERT_GE(g.doc["videos"].size(), 7u);
  for (const auto& [name, want] : g.doc["videos"].items()) {
    SCOPED_TRACE(name);
    const fs::path path = kGolden + "/videos/" + name;
    VideoReader reader = VideoReader::open_file(path);
    const VideoInfo& info = reader.info();
    EXPECT_EQ(info.num_frames, want["num_frames"].get<int64_t>());
    EXPECT_EQ(info.fps, want["fps"].get<double>());
    EXPECT_EQ(info.duration, want["duration"].get<double>());
    EXPECT_EQ(info.width, want["width"].get<int64_t>());
    EXPECT_EQ(info.height, want["height"].get<int64_t>());

    const VideoPlan plan = plan_video(config, info, path.string());
    EXPECT_EQ(plan.frame_indices, want["frame_indices"].get<std::vector<int64_t>>());
    EXPECT_EQ(plan.timestamps, want["timestamps"].get<std::vector<double>>());

    // Decoded RGB bytes, frame by frame.
    const std::vector<RgbImage> frames = reader.read_frames(plan.frame_indices);
    const std::vector<double> sums = g.file.tensor(name + ".frame_sums").to_doubles();
    ASSERT_EQ(sums.size(), frames.size() * 2);
    for (size_t f = 0; f < frames.size(); ++f) {
      int64_t sum = 0, weighted = 0;
      for (size_t i = 0; i < frames[f].pixels.size(); ++i) {
        sum += frames[f].pixels[i];
        weighted += int64_t(frames[f].pixels[i]) * int64_t(i % 251 + 1);
      }
      EXPECT_EQ(sum, int64_t(sums[2 * f])) << "frame " << f;
      EXPECT_EQ(weighted, int64_t(sums[2 * f + 1])) << "frame " << f;
    }

    // Pixel rows, streamed from the file.
    const ProcessedVideo processed = process_video(config, reader);
    const VideoGeometry& geo = processed.plan.geometry;
    EXPECT_EQ((std::vector<int64_t>{geo.grid_t, geo.grid_h, geo.grid_w}),
              want["video_grid_thw"].get<std::vector<int64_t>>());
    const std::vector<double> row_sums = g.file.tensor(name + ".row_sums").to_doubles();
    const std::vector<double> row_wsums = g.file.tensor(name + ".row_wsums").to_doubles();
    const int64_t row = config.geometry.row_size();
    ASSERT_EQ(int64_t(processed.rows.size()), int64_t(row_sums.size()) * row);
    double worst = 0.0;
    for (size_t r = 0; r < row_sums.size(); ++r) {
      double s = 0.0, ws = 0.0;
      for (int64_t e = 0; e < row; ++e) {
        const double v = processed.rows[r * size_t(row) + size_t(e)];
        s += v;
        ws += v * double(e % 97 + 1);
      }
      worst = std::max({worst, std::abs(s - row_sums[r]), std::abs(ws - row_wsums[r]) / 97.0});
    }
    EXPECT_LT(worst, 1e-6 * double(row));
    const std::vector<double> head = g.file.tensor(name + ".rows_head").to_doubles();
    for (size_t i = 0; i < head.size(); ++i)
      ASSERT_NEAR(processed.rows[i], head[i], 1e-6) << "element " << i;

    // The prompt: <|video|> becomes the tubelet segments with their timestamps.
    std::vector<int32_t> ids;
    for (int32_t id : prompt) {
      if (id != media.video) {
        ids.push_back(id);
        continue;
      }
      const auto run =
          video_replacement_ids(geo, processed.plan.tubelet_timestamps(), media, tokenizer);
      ids.insert(ids.end(), run.begin(), run.end());
    }
    EXPECT_EQ(ids, want["input_ids"].get<std::vector<int32_t>>());
    EXPECT_EQ(mm_token_type_ids(ids, media), want["mm_token_type_ids"].get<std::vector<int32_t>>());
    // The text form tokenizes to the same ids.
    std::string text = g.doc["prompt"].get<std::string>();
    const size_t at = text.find("<|video|>");
    text.replace(at, 9, video_replacement_text(geo, processed.plan.tubelet_timestamps()));
    EXPECT_EQ(tokenizer.encode(text), ids);
  }
}

TEST(MediaVideo, TokenCountsNeedNoDecoding) {
  REQUIRE_VIDEO();
  const VideoProcessorConfig config;
  for (const auto& [name, want] : golden().doc["videos"].items()) {
    const fs::path path = kGolden + "/videos/" + name;
    const VideoPlan plan = plan_video(config, probe_video_file(path), path.string());
    const ProcessedVideo processed = process_video_file(config, path);
    EXPECT_EQ(plan.geometry.num_image_tokens(), processed.plan.geometry.num_image_tokens()) << name;
    EXPECT_EQ(plan.frame_indices, processed.plan.frame_indices) << name;
    EXPECT_EQ(int64_t(processed.rows.size()),
              plan.geometry.num_patches() * config.geometry.row_size());
  }
}

TEST(MediaVideo, DecodesFromMemoryLikeFromFile) {
  REQUIRE_VIDEO();
  const fs::path path = kGolden + "/videos/vp9_25fps.webm";
  const std::vector<uint8_t> bytes = read_bytes(path);
  VideoReader from_file = VideoReader::open_file(path);
  VideoReader from_memory = VideoReader::open_bytes(bytes, "clip in memory");
  EXPECT_EQ(from_memory.info().frame_pts, from_file.info().frame_pts);
  const std::vector<int64_t> indices = {32, 0, 7, 7};
  const auto a = from_file.read_frames(indices);
  const auto b = from_memory.read_frames(indices);
  ASSERT_EQ(a.size(), 4u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].pixels, b[i].pixels);
  EXPECT_EQ(a[2].pixels, a[3].pixels);
  EXPECT_NE(a[0].pixels, a[1].pixels);
}

TEST(MediaVideo, OneDecoderThreadDecodesTheSameFrames) {
  REQUIRE_VIDEO();
  VideoLimits one_thread;
  one_thread.decoder_threads = 1;
  for (const auto& entry : fs::directory_iterator(kGolden + "/videos")) {
    const fs::path& path = entry.path();
    VideoReader automatic = VideoReader::open_file(path);
    VideoReader single = VideoReader::open_file(path, one_thread);
    const int64_t last = automatic.info().num_frames - 1;
    const std::vector<int64_t> indices = {0, last / 2, last};
    const auto a = automatic.read_frames(indices);
    const auto b = single.read_frames(indices);
    ASSERT_EQ(a.size(), b.size()) << path;
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].pixels, b[i].pixels) << path << " " << i;
  }
}

TEST(MediaVideo, OddFrameCountsPadTheLastTubelet) {
  // Frames given directly (no sampling): 3 frames make 2 tubelets, the last holding frame 2 twice.
  VideoProcessorConfig config;
  std::vector<RgbImage> frames(3);
  for (size_t f = 0; f < frames.size(); ++f) {
    frames[f].height = 56;
    frames[f].width = 84;
    frames[f].pixels.resize(56 * 84 * 3);
    for (size_t i = 0; i < frames[f].pixels.size(); ++i)
      frames[f].pixels[i] = uint8_t((i * 7 + f * 50) % 256);
  }
  const std::vector<double> stamps = {0.0, 0.5, 1.0};
  const ProcessedVideo v = process_video_frames(config, frames, stamps);
  EXPECT_EQ(v.plan.geometry.grid_t, 2);
  EXPECT_EQ(v.plan.tubelet_timestamps(), (std::vector<double>{0.0, 1.0}));
  const int64_t patches = v.plan.geometry.grid_h * v.plan.geometry.grid_w;
  const int64_t row = config.geometry.row_size(), plane = 14 * 14;
  for (int64_t r = patches; r < 2 * patches; ++r)
    for (int64_t c = 0; c < 3; ++c)
      for (int64_t e = 0; e < plane; ++e)
        ASSERT_EQ(v.rows[size_t(r * row + (c * 2 + 1) * plane + e)],
                  v.rows[size_t(r * row + (c * 2) * plane + e)]);
  // The first tubelet holds two different frames.
  EXPECT_NE(v.rows[size_t(2 * plane)], v.rows[size_t(3 * plane)]);
}

TEST(MediaVideo, BadFilesAreErrorsNamingTheFile) {
  REQUIRE_VIDEO();
  test::TempDir dir("media-video");
  const std::vector<uint8_t> mp4 = read_bytes(kGolden + "/videos/h264_30fps.mp4");
  const std::vector<uint8_t> webm = read_bytes(kGolden + "/videos/vp8_2997fps.webm");
  std::vector<std::pair<std::string, std::vector<uint8_t>>> cases = {
      {"empty.mp4", {}},
      {"garbage.mp4", std::vector<uint8_t>(5000, 0x5a)},
      {"text.webm", std::vector<uint8_t>{'h', 'e', 'l', 'l', 'o', '\n'}},
      {"half.mp4", std::vector<uint8_t>(mp4.begin(), mp4.begin() + long(mp4.size() / 2))},
      {"head.webm", std::vector<uint8_t>(webm.begin(), webm.begin() + 200)},
  };
  // A playlist pointing elsewhere must not be followed.
  const std::string playlist = "#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\n" +
                               (fs::path(kGolden) / "videos" / "h264_30fps.mp4").string() +
                               "\n#EXT-X-ENDLIST\n";
  cases.push_back({"list.m3u8", std::vector<uint8_t>(playlist.begin(), playlist.end())});
  // Bytes flipped through the middle of a valid stream.
  std::vector<uint8_t> flipped = webm;
  for (size_t i = flipped.size() / 3; i < flipped.size(); i += 7) flipped[i] ^= 0xff;
  cases.push_back({"flipped.webm", flipped});
  for (const auto& [name, bytes] : cases) {
    SCOPED_TRACE(name);
    const fs::path p = dir / name;
    write_bytes(p, bytes);
    try {
      const ProcessedVideo v = process_video_file(VideoProcessorConfig{}, p);
      // Damage that leaves a decodable stream may pass, but then yields whole tubelets.
      EXPECT_EQ(int64_t(v.rows.size()),
                v.plan.geometry.num_patches() * VideoProcessorConfig{}.geometry.row_size());
      EXPECT_TRUE(name == "flipped.webm") << "accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.where(), p.string());
      EXPECT_FALSE(e.fix().empty());
    }
  }
  EXPECT_EQ(error_of([&] { VideoReader::open_file(dir / "missing.mp4"); }).where(),
            (dir / "missing.mp4").string());
  EXPECT_EQ(error_of([&] { VideoReader::open_file(dir.path()); }).where(), dir.path().string());
  EXPECT_EQ(error_of([&] { VideoReader::open_bytes({}, "no bytes"); }).where(), "no bytes");
}

TEST(MediaVideo, PathsThatAreNotVideoFilesAreErrorsNamingThem) {
  REQUIRE_VIDEO();
  // A FIFO would block the open and a device would be read without end: both are refused first.
  test::TempDir dir("media-video-paths");
  fs::create_directories(dir / "clip.mp4");
  ASSERT_EQ(::mkfifo((dir / "pipe.mp4").c_str(), 0600), 0);
  for (const auto& [path, expect] : {std::pair{dir / "clip.mp4", "is a directory"},
                                     {dir / "pipe.mp4", "not a regular file"},
                                     {fs::path("/dev/zero"), "not a regular file"},
                                     {dir / "missing.mp4", "no such file"}}) {
    SCOPED_TRACE(path.string());
    const Error e = error_of([&] { VideoReader::open_file(path); });
    EXPECT_EQ(e.where(), path.string());
    EXPECT_NE(e.problem().find(expect), std::string::npos) << e.what();
    EXPECT_FALSE(e.fix().empty()) << e.what();
  }
}

TEST(MediaVideo, LimitsAreEnforcedBeforeDecoding) {
  REQUIRE_VIDEO();
  const fs::path path = kGolden + "/videos/h264_12fps_long.mp4";
  VideoLimits pixels;
  pixels.max_frame_pixels = 31 * 32;
  EXPECT_NE(
      std::string(error_of([&] { VideoReader::open_file(path, pixels); }).what()).find("pixels"),
      std::string::npos);
  VideoLimits frames;
  frames.max_frames = 100;
  EXPECT_NE(std::string(error_of([&] { VideoReader::open_file(path, frames); }).what())
                .find("more than 100 frames"),
            std::string::npos);
  VideoLimits duration;
  duration.max_duration_seconds = 10.0;
  EXPECT_NE(
      std::string(error_of([&] { VideoReader::open_file(path, duration); }).what()).find("lasts"),
      std::string::npos);
  VideoReader reader = VideoReader::open_file(path);
  EXPECT_EQ(error_of([&] { reader.read_frames(std::vector<int64_t>{150}); }).where(),
            path.string());
}

TEST(MediaVideo, ShortClipsAreErrors) {
  // 0.4 s at 2 frames per second samples nothing: the reference would fail further down.
  const Error e =
      error_of([&] { sample_frame_indices(VideoProcessorConfig{}, 12, 30.0, 0.4, "short.mp4"); });
  EXPECT_EQ(e.where(), "short.mp4");
  EXPECT_NE(std::string(e.what()).find("too short"), std::string::npos);
}

TEST(MediaVideo, BuildsWithoutFfmpegSayWhatIsMissing) {
  if (video_decoding_available()) GTEST_SKIP() << "this build decodes videos";
  const Error e = error_of([&] { VideoReader::open_file(kGolden + "/videos/h264_30fps.mp4"); });
  EXPECT_NE(std::string(e.what()).find("GLMTUNE_VIDEO"), std::string::npos);
}

TEST(MediaVideo, ConfigReadsTheVideoSection) {
  const std::string text = R"({
    "image_processor": {"max_image_tokens": 8000},
    "video_processor": {"max_image_tokens": 1000, "fps": 4, "max_frames": 64,
                        "temporal_patch_size": 2, "patch_size": 14, "merge_size": 2}
  })";
  const VideoProcessorConfig c = VideoProcessorConfig::from_json_text(text, "p.json");
  EXPECT_EQ(c.geometry.max_image_tokens, 1000);
  EXPECT_EQ(c.fps, 4.0);
  EXPECT_EQ(c.max_frames, 64);
  EXPECT_EQ(VideoProcessorConfig::from_json_text("{}", "p.json").geometry.max_image_tokens, 240000);
  EXPECT_EQ(VideoProcessorConfig::from_json_text(R"({"image_processor": {"max_image_tokens": 9}})",
                                                 "p.json")
                .geometry.max_image_tokens,
            240000);
  EXPECT_EQ(
      error_of([&] { VideoProcessorConfig::from_json_text(R"({"fps": -1})", "p.json"); }).where(),
      "p.json");
}

}  // namespace
}  // namespace glmtune::data::media
