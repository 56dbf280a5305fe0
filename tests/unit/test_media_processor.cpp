// The image processor against transformers 5.17.0 `Glm5NextImageProcessor` (torchvision backend):
// smart_resize geometry, the bicubic antialiased resize (exact uint8), normalisation and
// merge-block-major patchify (exact float32), token counts from geometry alone, placeholder
// expansion and mm_token_type_ids. Fixtures: tools/golden/vision.py.

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/data/media/image.h"
#include "glmtune/data/media/processor.h"
#include "glmtune/data/tokenizer.h"
#include "glmtune/io/safetensors.h"

namespace glmtune::data::media {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kRoot = GLMTUNE_SOURCE_DIR;
const std::string kGolden = kRoot + "/tests/golden/vision";

json read_json(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::stringstream s;
  s << in.rdbuf();
  return json::parse(s.str());
}

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a glmtune::Error";
  return {};
}

// The decoded image as PIL gave it (decode.safetensors), so that processor parity does not lean
// on the decoder under test elsewhere.
RgbImage pil_image(const io::SafetensorsFile& decode, const std::string& file) {
  const Tensor t = decode.tensor("decode." + file);
  RgbImage image;
  image.height = t.size(0);
  image.width = t.size(1);
  for (double v : t.to_doubles()) image.pixels.push_back(uint8_t(v));
  return image;
}

TEST(MediaProcessor, GeometryMatchesReference) {
  const json doc = read_json(kGolden + "/processor.json");
  ASSERT_GE(doc["geometry"].size(), 60u);
  for (const json& g : doc["geometry"]) {
    const int64_t h = g["height"], w = g["width"], max_tokens = g["max_image_tokens"];
    SCOPED_TRACE(testing::Message() << h << "x" << w << " max " << max_tokens);
    ProcessorConfig config;
    config.max_image_tokens = max_tokens;
    const ImageGeometry geo = image_geometry(config, h, w);
    EXPECT_EQ(geo.canvas_height, g["canvas"][0].get<int64_t>());
    EXPECT_EQ(geo.canvas_width, g["canvas"][1].get<int64_t>());
    EXPECT_EQ(geo.content_height, g["content"][0].get<int64_t>());
    EXPECT_EQ(geo.content_width, g["content"][1].get<int64_t>());
    EXPECT_EQ(geo.num_patches(), g["patches"].get<int64_t>());
    EXPECT_EQ(num_image_tokens(config, h, w), g["patches"].get<int64_t>() / 4);
    const auto canvas = smart_resize(2, h, w, 2, 28, 16, max_tokens);
    EXPECT_EQ(canvas[0], geo.canvas_height);
    EXPECT_EQ(canvas[1], geo.canvas_width);
  }
  // Worked examples of the sizing: a mid-size image, one above the pixel limit (scaled down) and
  // a small one.
  ProcessorConfig config;
  EXPECT_EQ(num_image_tokens(config, 700, 1000), 900);
  EXPECT_EQ(num_image_tokens(config, 3000, 4000), 7931);
  EXPECT_EQ(num_image_tokens(config, 111, 113), 20);
  EXPECT_EQ(image_geometry(config, 111, 113).content_height, 111);  // floor(111·(112/111)) = 111
  EXPECT_NE(error_of([] { smart_resize(2, 100, 100, 2, 28, 16, 0); }).find("too small"),
            std::string::npos);
}

TEST(MediaProcessor, PixelValuesMatchReference) {
  const auto decode = io::SafetensorsFile::open(kGolden + "/decode.safetensors");
  const auto ref = io::SafetensorsFile::open(kGolden + "/processor.safetensors");
  const json cases = json::parse(ref.metadata().at("cases"));
  ASSERT_GE(cases.size(), 20u);
  int canvases = 0, full = 0;
  for (const auto& [name, c] : cases.items()) {
    SCOPED_TRACE(name);
    ProcessorConfig config;
    config.max_image_tokens = c["max_image_tokens"];
    const RgbImage image = pil_image(decode, c["file"]);
    const ProcessedImages out = process_images(config, std::span<const RgbImage>(&image, 1));

    const std::vector<double> grid = ref.tensor(name + ".grid_thw").to_doubles();
    ASSERT_EQ(out.grid_thw.to_doubles(), grid);
    const int64_t rows = int64_t(grid[1] * grid[2]);
    ASSERT_EQ(out.pixel_values.size(0), rows);
    ASSERT_EQ(out.pixel_values.size(1), 1176);
    EXPECT_EQ(out.num_tokens[0], rows / 4);
    EXPECT_EQ(num_image_tokens(config, image.height, image.width), rows / 4);

    if (ref.contains(name + ".canvas")) {
      ++canvases;
      const Tensor want = ref.tensor(name + ".canvas");  // [3, Ht, Wt]
      const RgbImage canvas = resize_and_pad(config, image);
      ASSERT_EQ(canvas.height, want.size(1));
      ASSERT_EQ(canvas.width, want.size(2));
      const std::vector<double> w = want.to_doubles();
      int64_t differing = 0;
      for (int64_t ch = 0; ch < 3; ++ch)
        for (int64_t y = 0; y < canvas.height; ++y)
          for (int64_t x = 0; x < canvas.width; ++x)
            differing += double(canvas.pixels[size_t((y * canvas.width + x) * 3 + ch)]) !=
                         w[size_t((ch * canvas.height + y) * canvas.width + x)];
      EXPECT_EQ(differing, 0) << "canvas bytes differing from torch's resize";
    }

    // Row sums pin every value: one byte off moves a sum by about 0.03.
    const std::vector<double> sums = ref.tensor(name + ".row_sums").to_doubles();
    const float* pv = out.pixel_values.data<float>();
    double worst = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
      double s = 0.0;
      for (int64_t e = 0; e < 1176; ++e) s += double(pv[r * 1176 + e]);
      worst = std::max(worst, std::abs(s - sums[size_t(r)]));
    }
    EXPECT_LE(worst, 1e-9);

    if (ref.contains(name + ".pixel_values")) {
      ++full;
      const Tensor want = ref.tensor(name + ".pixel_values");
      ASSERT_EQ(want.shape(), out.pixel_values.shape());
      const float* w = want.data<float>();
      int64_t differing = 0;
      for (int64_t i = 0; i < want.numel(); ++i) differing += w[i] != pv[i];
      EXPECT_EQ(differing, 0) << "pixel values not bitwise equal to the reference";
    }
  }
  EXPECT_GE(canvases, 3);
  EXPECT_GE(full, 1);
}

TEST(MediaProcessor, DecodedFilesGiveReferencePixels) {
  // The whole path from bytes: our decoder, then the processor, for every golden file.
  const auto ref = io::SafetensorsFile::open(kGolden + "/processor.safetensors");
  const json cases = json::parse(ref.metadata().at("cases"));
  for (const auto& [name, c] : cases.items()) {
    if (c["max_image_tokens"] != 8000) continue;
    SCOPED_TRACE(name);
    const RgbImage image = load_image(kGolden + "/images/" + c["file"].get<std::string>());
    const ProcessedImages out =
        process_images(ProcessorConfig{}, std::span<const RgbImage>(&image, 1));
    const std::vector<double> sums = ref.tensor(name + ".row_sums").to_doubles();
    ASSERT_EQ(out.pixel_values.size(0), int64_t(sums.size()));
    const float* pv = out.pixel_values.data<float>();
    for (size_t r = 0; r < sums.size(); ++r) {
      double s = 0.0;
      for (int64_t e = 0; e < 1176; ++e) s += double(pv[r * 1176 + size_t(e)]);
      ASSERT_NEAR(s, sums[r], 1e-9) << "row " << r;
    }
  }
}

TEST(MediaProcessor, BatchConcatenatesInOrderAndLayoutIsMergeBlockMajor) {
  // Fresh random images every run; the seed is printed so that a failure can be replayed.
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  auto random_image = [&](int64_t h, int64_t w) {
    RgbImage im;
    im.height = h;
    im.width = w;
    im.pixels.resize(size_t(h * w * 3));
    for (auto& p : im.pixels) p = uint8_t(rng());
    return im;
  };
  // 112 x 140 and 140 x 112 need no resize (exactly at the minimum budget and aligned).
  const std::vector<RgbImage> images = {random_image(112, 140), random_image(140, 112)};
  const ProcessorConfig config;
  const ProcessedImages batch = process_images(config, images);
  EXPECT_EQ(batch.grid_thw.to_doubles(), (std::vector<double>{1, 8, 10, 1, 10, 8}));
  ASSERT_EQ(batch.pixel_values.size(0), 160);
  const float* pv = batch.pixel_values.data<float>();
  const float mean[3] = {float(0.48145466) * 255.0f, float(0.4578275) * 255.0f,
                         float(0.40821073) * 255.0f};
  const float stdev[3] = {float(0.26862954) * 255.0f, float(0.26130258) * 255.0f,
                          float(0.27577711) * 255.0f};
  std::uniform_int_distribution<int> pick(0, 1);
  for (int trial = 0; trial < 500; ++trial) {
    const int which = pick(rng);
    const RgbImage& im = images[size_t(which)];
    const int64_t gh = im.height / 14, gw = im.width / 14;
    const int64_t ph = std::uniform_int_distribution<int64_t>(0, gh - 1)(rng);
    const int64_t pw = std::uniform_int_distribution<int64_t>(0, gw - 1)(rng);
    const int c = int(rng() % 3), t = int(rng() % 2), i = int(rng() % 14), j = int(rng() % 14);
    const int64_t row =
        (which == 0 ? 0 : 80) + (((ph / 2) * (gw / 2) + pw / 2) * 2 + ph % 2) * 2 + pw % 2;
    const int64_t element = ((c * 2 + t) * 14 + i) * 14 + j;
    const uint8_t byte = im.pixels[size_t(((ph * 14 + i) * im.width + pw * 14 + j) * 3 + c)];
    EXPECT_EQ(pv[row * 1176 + element], (float(byte) - mean[c]) / stdev[c])
        << "patch (" << ph << "," << pw << ") c" << c << " t" << t << " i" << i << " j" << j;
  }
}

TEST(MediaProcessor, ConfigFromJson) {
  const std::string released = R"({
    "image_processor": {"do_rescale": true, "patch_expand_factor": 1, "merge_size": 2,
      "image_mean": [0.48145466, 0.4578275, 0.40821073],
      "image_std": [0.26862954, 0.26130258, 0.27577711], "temporal_patch_size": 2,
      "patch_size": 14, "min_image_tokens": 16, "max_image_tokens": 8000,
      "image_processor_type": "Glm5NextImageProcessor"},
    "video_processor": {"max_image_tokens": 240000},
    "processor_class": "Glm5NextProcessor"})";
  const ProcessorConfig c = ProcessorConfig::from_json_text(released, "processor_config.json");
  EXPECT_EQ(c.max_image_tokens, 8000);
  EXPECT_EQ(c.factor(), 28);
  EXPECT_EQ(c.row_size(), 1176);
  EXPECT_DOUBLE_EQ(c.image_std[2], 0.27577711);
  const fs::path path = fs::temp_directory_path() /
                        ("glmtune_test_processor_config_" + std::to_string(::getpid()) + ".json");
  std::ofstream(path) << R"({"max_image_tokens": 64, "patch_size": 14})";
  EXPECT_EQ(ProcessorConfig::from_file(path.string()).max_image_tokens, 64);
  fs::remove(path);
  const std::string bad =
      error_of([] { ProcessorConfig::from_json_text(R"({"patch_size": "14"})", "p.json"); });
  EXPECT_NE(bad.find("p.json"), std::string::npos);
  EXPECT_NE(bad.find("patch_size"), std::string::npos);
  EXPECT_NE(
      error_of([] { ProcessorConfig::from_json_text("{", "broken.json"); }).find("broken.json"),
      std::string::npos);
  EXPECT_NE(error_of([] {
              ProcessorConfig::from_json_text(R"({"image_std": [1, 0, 1]})", "s.json");
            }).find("image_std"),
            std::string::npos);
}

TEST(MediaProcessor, PlaceholdersAndTokenTypesMatchReference) {
  const json doc = read_json(kGolden + "/processor.json")["tokens"];
  MediaTokenIds ids;
  EXPECT_EQ(ids.begin_of_image, doc["token_ids"]["<|begin_of_image|>"].get<int32_t>());
  EXPECT_EQ(ids.end_of_image, doc["token_ids"]["<|end_of_image|>"].get<int32_t>());
  EXPECT_EQ(ids.begin_of_video, doc["token_ids"]["<|begin_of_video|>"].get<int32_t>());
  EXPECT_EQ(ids.end_of_video, doc["token_ids"]["<|end_of_video|>"].get<int32_t>());
  EXPECT_EQ(ids.image, doc["token_ids"]["<|image|>"].get<int32_t>());
  EXPECT_EQ(ids.video, doc["token_ids"]["<|video|>"].get<int32_t>());

  // Expansion counts are t·h·w / 4 per grid, as the reference's replace_image_token.
  std::vector<int64_t> counts;
  for (const json& g : doc["grids"])
    counts.push_back(g[0].get<int64_t>() * g[1].get<int64_t>() * g[2].get<int64_t>() / 4);
  EXPECT_EQ(counts, doc["image_token_counts"].get<std::vector<int64_t>>());

  const std::string text =
      "<|user|><|begin_of_image|><|image|><|end_of_image|>A<|begin_of_image|><|image|>"
      "<|end_of_image|>B<|begin_of_image|><|image|><|end_of_image|>";
  const std::string expanded = expand_image_placeholders(text, counts);
  std::string want = "<|user|><|begin_of_image|>";
  for (int i = 0; i < 20; ++i) want += "<|image|>";
  want += "<|end_of_image|>A<|begin_of_image|>";
  for (int i = 0; i < 4; ++i) want += "<|image|>";
  want += "<|end_of_image|>B<|begin_of_image|>";
  for (int i = 0; i < 900; ++i) want += "<|image|>";
  want += "<|end_of_image|>";
  EXPECT_EQ(expanded, want);
  EXPECT_NE(error_of([&] {
              expand_image_placeholders(text, std::vector<int64_t>{20, 4}, "doc 7");
            }).find("doc 7"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              expand_image_placeholders(text, std::vector<int64_t>{20, 4, 900, 1}, "doc 8");
            }).find("4 image(s) given but the text has 3"),
            std::string::npos);

  // mm_token_type_ids on the reference's stream: images 1, frames inside a video span 2.
  const auto stream = doc["stream"].get<std::vector<int32_t>>();
  EXPECT_EQ(mm_token_type_ids(stream, ids), doc["mm_token_type_ids"].get<std::vector<int32_t>>());

  // Token-level expansion gives the stream the reference tokenises from the expanded text:
  // collapse the two images of the stream back to one placeholder each and expand again.
  std::vector<int32_t> collapsed;
  int64_t starts = 0, ends = 0;
  for (size_t i = 0; i < stream.size(); ++i) {
    starts += stream[i] == ids.begin_of_video;
    ends += stream[i] == ids.end_of_video;
    const bool image_outside_video = stream[i] == ids.image && starts <= ends;
    if (image_outside_video && i > 0 && stream[i - 1] == ids.image) continue;
    collapsed.push_back(stream[i]);
  }
  const std::vector<int64_t> stream_counts = {counts[0], counts[1]};
  EXPECT_EQ(expand_image_tokens(collapsed, stream_counts, ids, "stream"), stream);
  EXPECT_NE(error_of([&] {
              expand_image_tokens(collapsed, std::vector<int64_t>{20}, ids, "pack 3");
            }).find("pack 3"),
            std::string::npos);
}

TEST(MediaProcessor, MediaTokenIdsFromTokenizer) {
  const std::string path = kRoot + "/examples/tiny/tokenizer/tokenizer.json";
  if (!fs::exists(path)) GTEST_SKIP() << "no tiny tokenizer at " << path;
  const Tokenizer tok = Tokenizer::from_file(path);
  const MediaTokenIds ids = MediaTokenIds::from_tokenizer(tok);
  EXPECT_EQ(tok.encode("<|image|>"), std::vector<int32_t>{ids.image});
  EXPECT_EQ(tok.encode("<|begin_of_video|>"), std::vector<int32_t>{ids.begin_of_video});
  EXPECT_NE(ids.image, ids.video);
}

}  // namespace
}  // namespace glmtune::data::media
