// `glmtune preprocess` end to end on the bundled tiny VL example: the printed ids, loss mask,
// mm_token_type_ids and grids against the library (which the media tests pin to transformers),
// the pixels file against the grids, the geometry-only path (no --pixels) against the decoded one,
// and the errors for bad media, bad paths and an incomplete processor folder.

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "glmtune/data/chat_template.h"
#include "glmtune/data/media/video.h"
#include "glmtune/data/media/vl_processor.h"
#include "glmtune/io/safetensors.h"
#include "support/cli.h"
#include "support/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using glmtune::data::OrderedJson;
using nlohmann::json;

const std::string kSource = GLMTUNE_SOURCE_DIR;
const std::string kExample = kSource + "/examples/tiny-vl";
const std::string kProcessor = kSource + "/examples/tiny/tokenizer";

using Result = glmtune::test::CliResult;

class CliPreprocessTest : public ::testing::Test {
 protected:
  Result run(const std::string& args) const {
    return glmtune::test::run_glmtune(args, dir_ / "stderr.txt");
  }

  std::string write(const std::string& name, const std::string& content) const {
    std::ofstream(dir_ / name, std::ios::binary) << content;
    return (dir_ / name).string();
  }

  // The example's conversations, one JSON object per line.
  static std::vector<OrderedJson> example_chats() {
    std::vector<OrderedJson> out;
    std::ifstream in(kExample + "/chat.jsonl");
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) out.push_back(OrderedJson::parse(line));
    return out;
  }

  static int count_items(const OrderedJson& chat, const std::string& kind) {
    int n = 0;
    for (const auto& m : chat["messages"])
      if (m["content"].is_array())
        for (const auto& item : m["content"])
          n += item.is_object() && item.value("type", "").starts_with(kind);
    return n;
  }

  glmtune::test::TempDir dir_{"cli-preprocess"};
};

#define EXPECT_CONTAINS(text, part) EXPECT_NE((text).find(part), std::string::npos) << (text)

TEST_F(CliPreprocessTest, PrintsTheLibrarysSampleAndWritesPixels) {
  if (!glmtune::data::media::video_decoding_available()) GTEST_SKIP() << "built without FFmpeg";
  const auto processor = glmtune::data::media::VlProcessor::from_dir(kProcessor);
  const auto chats = example_chats();
  ASSERT_GE(chats.size(), 4u);
  int with_video = 0, with_images = 0;
  for (size_t i = 0; i < chats.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "chat.jsonl line " << i + 1);
    const std::string messages = write("messages.json", chats[i].dump());
    const std::string pixels = (dir_ / "pixels.safetensors").string();
    const Result r = run("preprocess --processor " + kProcessor + " --messages " + messages +
                         " --media-root " + kExample + " --pixels " + pixels);
    ASSERT_EQ(r.code, 0) << r.err;
    const json out = json::parse(r.out);

    const auto sample = processor.process(chats[i]["messages"], OrderedJson(), {}, kExample, "chat",
                                          /*with_pixels=*/true);
    EXPECT_EQ(out["input_ids"].get<std::vector<int32_t>>(), sample.input_ids);
    EXPECT_EQ(out["mm_token_type_ids"].get<std::vector<int32_t>>(), sample.mm_token_type_ids);
    const auto mask = out["loss_mask"].get<std::vector<int32_t>>();
    ASSERT_EQ(mask.size(), sample.labels.size());
    for (size_t k = 0; k < mask.size(); ++k)
      EXPECT_EQ(mask[k], sample.labels[k] == glmtune::data::kIgnoreIndex ? 0 : 1);

    // Grids account for every image token, and the pixels file for every grid.
    const auto images = out["image_grid_thw"].get<std::vector<std::array<int64_t, 3>>>();
    const auto videos = out["video_grid_thw"].get<std::vector<std::array<int64_t, 3>>>();
    EXPECT_EQ(int(images.size()), count_items(chats[i], "image"));
    EXPECT_EQ(int(videos.size()), count_items(chats[i], "video"));
    int64_t image_rows = 0, video_rows = 0, type1 = 0, type2 = 0;
    for (const auto& g : images) image_rows += g[0] * g[1] * g[2];
    for (const auto& g : videos) video_rows += g[0] * g[1] * g[2];
    for (int32_t t : sample.mm_token_type_ids) {
      type1 += t == 1;
      type2 += t == 2;
    }
    EXPECT_EQ(type1, image_rows / 4);
    EXPECT_EQ(type2, video_rows / 4);
    const auto file = glmtune::io::SafetensorsFile::open(pixels);
    EXPECT_EQ(file.tensor("pixel_values").shape(), (glmtune::Shape{image_rows, 1176}));
    EXPECT_EQ(file.tensor("pixel_values_videos").shape(), (glmtune::Shape{video_rows, 1176}));
    EXPECT_EQ(file.tensor("pixel_values").to_doubles(), sample.pixel_values.to_doubles());
    EXPECT_EQ(file.tensor("pixel_values_videos").to_doubles(),
              sample.pixel_values_videos.to_doubles());
    EXPECT_EQ(file.tensor("video_grid_thw").shape(), (glmtune::Shape{int64_t(videos.size()), 3}));

    // Without --pixels nothing is decoded, and the token stream is the same.
    const Result geometry_only = run("preprocess --processor " + kProcessor + " --messages " +
                                     messages + " --media-root " + kExample);
    ASSERT_EQ(geometry_only.code, 0) << geometry_only.err;
    EXPECT_EQ(json::parse(geometry_only.out), out);
    with_video += !videos.empty();
    with_images += !images.empty();
  }
  EXPECT_GE(with_video, 1);
  EXPECT_GE(with_images, 2);
}

TEST_F(CliPreprocessTest, MediaPathsResolveAgainstTheMessagesFolder) {
  // The example's media paths are relative to its folder: a copy of a conversation elsewhere
  // needs --media-root, and the error names where it looked.
  const OrderedJson chat = example_chats().at(0);
  const std::string copy = write("chat.json", chat.dump());
  const Result without_root = run("preprocess --processor " + kProcessor + " --messages " + copy);
  EXPECT_NE(without_root.code, 0);
  EXPECT_CONTAINS(without_root.err, dir_.path().string());
  const Result with_root = run("preprocess --processor " + kProcessor + " --messages " + copy +
                               " --media-root " + kExample);
  EXPECT_EQ(with_root.code, 0) << with_root.err;
}

TEST_F(CliPreprocessTest, BadMediaAreErrorsNamingTheFile) {
  const std::string garbage = write("broken.jpg", std::string(300, 'x'));
  const OrderedJson chat = OrderedJson::parse(
      R"({"messages": [{"role": "user", "content": [{"type": "image", "image": "broken.jpg"},
          {"type": "text", "text": "What is this?"}]}, {"role": "assistant", "content": "Noise."}]})");
  const std::string messages = write("m.json", chat.dump());
  const Result r = run("preprocess --processor " + kProcessor + " --messages " + messages);
  EXPECT_NE(r.code, 0);
  EXPECT_CONTAINS(r.err, garbage);

  const std::string missing = write(
      "v.json",
      R"({"messages": [{"role": "user", "content": [{"type": "video", "video": "nowhere.mp4"}]}]})");
  const Result r2 = run("preprocess --processor " + kProcessor + " --messages " + missing);
  EXPECT_NE(r2.code, 0);
  EXPECT_CONTAINS(r2.err, "nowhere.mp4");

  const std::string url = write("u.json",
                                R"({"messages": [{"role": "user", "content": [{"type": "image_url",
          "image_url": {"url": "https://example.com/a.png"}}]}]})");
  const Result r3 = run("preprocess --processor " + kProcessor + " --messages " + url);
  EXPECT_NE(r3.code, 0);
  EXPECT_CONTAINS(r3.err, "not a local file");

  const std::string literal =
      write("l.json", R"({"messages": [{"role": "user", "content": "look: <|image|>"}]})");
  const Result r4 = run("preprocess --processor " + kProcessor + " --messages " + literal);
  EXPECT_NE(r4.code, 0);
  EXPECT_CONTAINS(r4.err, "placeholder");
}

TEST_F(CliPreprocessTest, MediaPathsThatAreFoldersAreErrorsNamingThem) {
  // With or without --pixels, a folder where an image or a video should be is named, not read.
  fs::create_directories(dir_ / "album.jpg");
  fs::create_directories(dir_ / "clip.mp4");
  const std::string image =
      write("i.json", R"({"messages": [{"role": "user", "content": [{"type": "image", "image": )"
                      R"("album.jpg"}]}, {"role": "assistant", "content": "A folder."}]})");
  const std::string video =
      write("v.json", R"({"messages": [{"role": "user", "content": [{"type": "video", "video": )"
                      R"("clip.mp4"}]}, {"role": "assistant", "content": "A folder."}]})");
  std::vector<std::pair<std::string, std::string>> cases = {{image, "album.jpg"}};
  if (glmtune::data::media::video_decoding_available()) cases.push_back({video, "clip.mp4"});
  for (const auto& [messages, name] : cases)
    for (const std::string& pixels :
         {std::string(), " --pixels " + (dir_ / "px.safetensors").string()}) {
      const Result r =
          run("preprocess --processor " + kProcessor + " --messages " + messages + pixels);
      EXPECT_EQ(r.code, 2) << r.err;
      EXPECT_CONTAINS(r.err, (dir_ / name).string());
      EXPECT_CONTAINS(r.err, "is a directory");
    }
}

TEST_F(CliPreprocessTest, ProcessorFolderNeedsItsConfig) {
  fs::create_directories(dir_ / "proc");
  fs::copy_file(kProcessor + "/tokenizer.json", dir_ / "proc" / "tokenizer.json");
  const std::string messages =
      write("m.json", R"({"messages": [{"role": "user", "content": "hi"}]})");
  const Result r =
      run("preprocess --processor " + (dir_ / "proc").string() + " --messages " + messages);
  EXPECT_NE(r.code, 0);
  EXPECT_CONTAINS(r.err, "processor_config.json");
}

}  // namespace
