#include "glmtune/data/media/vl_processor.h"

#include <fmt/format.h>

#include <cstring>

#include "glmtune/base/error.h"
#include "glmtune/data/token_cache.h"

namespace glmtune::data::media {
namespace {

// The path an item names: its type's own key, or the "path" / "url" keys transformers' chat
// templates accept; for *_url types also {"url": ...}.
std::optional<std::string> item_path(const OrderedJson& item, const std::string& type) {
  const std::string base = type.starts_with("image") ? "image" : "video";
  for (const std::string& key : {type, base, std::string("path"), std::string("url")}) {
    if (!item.contains(key)) continue;
    const OrderedJson& v = item[key];
    if (v.is_string()) return v.get<std::string>();
    if (v.is_object() && v.contains("url") && v["url"].is_string())
      return v["url"].get<std::string>();
  }
  return std::nullopt;
}

std::filesystem::path resolve(const std::string& name, const std::filesystem::path& root,
                              const std::string& where, const std::string& source) {
  std::string local = name;
  if (local.starts_with("file://")) local = local.substr(7);
  if (local.starts_with("http://") || local.starts_with("https://") || local.starts_with("data:") ||
      local.find("://") != std::string::npos)
    throw Error(fmt::format("{}: `{}` is not a local file; glmtune reads media from disk only",
                            where, name.substr(0, 80)),
                source, "download the file and give its path");
  if (local.empty()) throw Error(fmt::format("{}: the media path is empty", where), source);
  const std::filesystem::path path(local);
  return path.is_absolute() ? path : root / path;
}

}  // namespace

std::vector<MediaRef> collect_media(const OrderedJson& messages,
                                    const std::filesystem::path& media_root,
                                    const std::string& source) {
  std::vector<MediaRef> out;
  if (!messages.is_array()) return out;
  for (size_t m = 0; m < messages.size(); ++m) {
    const OrderedJson& msg = messages[m];
    if (!msg.is_object() || !msg.contains("role") || !msg["role"].is_string()) continue;
    const std::string role = msg["role"].get<std::string>();
    if (role != "user" && role != "tool" && role != "observation") continue;
    if (!msg.contains("content") || !msg["content"].is_array()) continue;
    const OrderedJson& content = msg["content"];
    for (size_t j = 0; j < content.size(); ++j) {
      const OrderedJson& item = content[j];
      if (!item.is_object() || !item.contains("type") || !item["type"].is_string()) continue;
      const std::string type = item["type"].get<std::string>();
      const bool image = type == "image" || type == "image_url";
      const bool video = type == "video" || type == "video_url";
      if (!image && !video) continue;
      MediaRef ref;
      ref.kind = image ? MediaKind::image : MediaKind::video;
      ref.where = fmt::format("message {}, content item {}", m, j);
      const auto name = item_path(item, type);
      if (!name)
        throw Error(fmt::format("{}: the {} item names no file", ref.where, type), source,
                    fmt::format("write {{\"type\": \"{}\", \"{}\": \"path/to/file\"}}", type,
                                image ? "image" : "video"));
      ref.path = resolve(*name, media_root, ref.where, source);
      out.push_back(std::move(ref));
    }
  }
  return out;
}

VlProcessor::VlProcessor(Tokenizer tokenizer, ProcessorConfig image, VideoProcessorConfig video)
    : tokenizer_(std::move(tokenizer)),
      image_(std::move(image)),
      video_(std::move(video)),
      media_(MediaTokenIds::from_tokenizer(tokenizer_)) {}

VlProcessor VlProcessor::from_dir(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir))
    throw Error("not a directory", dir.string(),
                "give the folder with tokenizer.json and processor_config.json");
  Tokenizer tokenizer = Tokenizer::from_file(resolve_tokenizer_json(dir).string());
  ProcessorConfig image;
  VideoProcessorConfig video;
  const fs::path combined = dir / "processor_config.json";
  const fs::path image_only = dir / "preprocessor_config.json";
  const fs::path video_only = dir / "video_preprocessor_config.json";
  if (fs::exists(combined)) {
    image = ProcessorConfig::from_file(combined.string());
    video = VideoProcessorConfig::from_file(fs::exists(video_only) ? video_only.string()
                                                                   : combined.string());
  } else if (fs::exists(image_only)) {
    image = ProcessorConfig::from_file(image_only.string());
    if (fs::exists(video_only)) video = VideoProcessorConfig::from_file(video_only.string());
  } else {
    throw Error("no processor_config.json (nor preprocessor_config.json)", dir.string(),
                "copy processor_config.json from the model release into the folder");
  }
  return VlProcessor(std::move(tokenizer), std::move(image), std::move(video));
}

VlSample VlProcessor::process(const OrderedJson& messages, const OrderedJson& tools,
                              const ChatTemplateOptions& options,
                              const std::filesystem::path& media_root, const std::string& source,
                              bool with_pixels, ChatTemplateKind kind) const {
  const RenderedChat rendered = render_chat(kind, messages, tools, options);
  const TokenizedSample tokens = tokenize_segments(rendered.segments, tokenizer_);
  const std::vector<MediaRef> media = collect_media(messages, media_root, source);

  // Placeholders written literally in message text would be taken for media.
  {
    int64_t images = 0, videos = 0, open = 0, close = 0;
    for (int32_t id : tokens.input_ids) {
      open += id == media_.begin_of_video;
      close += id == media_.end_of_video;
      images += id == media_.image && open <= close;
      videos += id == media_.video;
    }
    if (images != rendered.num_images || videos != rendered.num_videos)
      throw Error(fmt::format("the conversation has {} image and {} video placeholder tokens for "
                              "{} image and {} video items",
                              images, videos, rendered.num_images, rendered.num_videos),
                  source, "do not write <|image|> or <|video|> (or their markers) in message text");
  }

  VlSample sample;
  std::vector<int64_t> image_tokens;
  std::vector<std::vector<int32_t>> video_ids;
  std::vector<float> image_rows, video_rows;
  for (const MediaRef& ref : media) {
    if (ref.kind == MediaKind::image) {
      int64_t gh = 0, gw = 0;
      if (with_pixels) {
        const RgbImage image = load_image(ref.path, image_decode_options);
        const auto grid = process_image_into(image_, image, image_rows);
        gh = grid[0];
        gw = grid[1];
      } else {
        const ImageInfo info = probe_image_file(ref.path, image_decode_options);
        const ImageGeometry g = image_geometry(image_, info.height, info.width);
        gh = g.grid_h;
        gw = g.grid_w;
      }
      sample.image_grid_thw.push_back({1, gh, gw});
      image_tokens.push_back(gh * gw / (image_.merge_size * image_.merge_size));
    } else {
      VideoReader reader = VideoReader::open_file(ref.path, video_limits);
      VideoPlan plan;
      if (with_pixels) {
        ProcessedVideo video = process_video(video_, reader);
        video_rows.insert(video_rows.end(), video.rows.begin(), video.rows.end());
        plan = std::move(video.plan);
      } else {
        plan = plan_video(video_, reader.info(), reader.source());
      }
      const VideoGeometry& g = plan.geometry;
      sample.video_grid_thw.push_back({g.grid_t, g.grid_h, g.grid_w});
      const std::vector<double> stamps = plan.tubelet_timestamps();
      video_ids.push_back(video_replacement_ids(g, stamps, media_, tokenizer_));
      sample.video_timestamps.push_back(stamps);
    }
  }
  GLMTUNE_ASSERT(int64_t(image_tokens.size()) == rendered.num_images &&
                     int64_t(video_ids.size()) == rendered.num_videos,
                 "{} images / {} videos collected, {} / {} rendered", image_tokens.size(),
                 video_ids.size(), rendered.num_images, rendered.num_videos);

  // One pass over the template's ids: an image placeholder outside a video span becomes its
  // run, a video placeholder its tubelet segments; inserted tokens take the placeholder's label.
  size_t next_image = 0, next_video = 0;
  int64_t starts = 0, ends = 0;
  for (size_t i = 0; i < tokens.input_ids.size(); ++i) {
    const int32_t id = tokens.input_ids[i];
    const int32_t label = tokens.labels[i];
    starts += id == media_.begin_of_video;
    ends += id == media_.end_of_video;
    if (id == media_.image && starts <= ends) {
      sample.input_ids.insert(sample.input_ids.end(), size_t(image_tokens[next_image]), id);
      sample.labels.insert(sample.labels.end(), size_t(image_tokens[next_image]),
                           label == kIgnoreIndex ? kIgnoreIndex : id);
      ++next_image;
    } else if (id == media_.video) {
      const std::vector<int32_t>& run = video_ids[next_video++];
      sample.input_ids.insert(sample.input_ids.end(), run.begin(), run.end());
      for (int32_t r : run) sample.labels.push_back(label == kIgnoreIndex ? kIgnoreIndex : r);
    } else {
      sample.input_ids.push_back(id);
      sample.labels.push_back(label);
    }
  }
  sample.mm_token_type_ids = mm_token_type_ids(sample.input_ids, media_);

  const int64_t row = image_.row_size();
  sample.pixel_values = Tensor::from_vector(image_rows, {int64_t(image_rows.size()) / row, row});
  const int64_t video_row = video_.geometry.row_size();
  sample.pixel_values_videos =
      Tensor::from_vector(video_rows, {int64_t(video_rows.size()) / video_row, video_row});
  return sample;
}

}  // namespace glmtune::data::media
