#include "glmtune/data/media/processor.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <utility>

#include "glmtune/base/error.h"
#include "glmtune/base/fs.h"
#include "glmtune/data/tokenizer.h"

namespace glmtune::data::media {
namespace {

// Python's round(): half to even.
double round_half_even(double v) { return std::nearbyint(v); }

// ceil(value / factor) · factor with a float64 quotient, as the reference's `align`.
int64_t align_up(int64_t value, int64_t factor) {
  return int64_t(std::ceil(double(value) / double(factor))) * factor;
}

}  // namespace

// ---- Config -------------------------------------------------------------------------------------

ProcessorConfig ProcessorConfig::from_file(const std::string& path) {
  return from_json_text(read_text_file(path, "processor config"), path);
}

ProcessorConfig ProcessorConfig::from_json_text(std::string_view text, const std::string& source) {
  return from_json_section(text, source, "image_processor", ProcessorConfig{});
}

ProcessorConfig ProcessorConfig::from_json_section(std::string_view text, const std::string& source,
                                                   std::string_view section_name,
                                                   const ProcessorConfig& defaults) {
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("invalid JSON: {}", e.what()), source,
                "fix the file or use the processor_config.json of the released model");
  }
  const nlohmann::json* section = &doc;
  const std::string key(section_name);
  if (doc.is_object() && doc.contains(key)) section = &doc[key];
  if (!section->is_object())
    throw Error(fmt::format("expected a JSON object with the {} settings", key), source);
  ProcessorConfig config = defaults;
  // An absent key keeps the default; a present one must be of the kind `fits` accepts, which
  // `expected` names in the error.
  auto get = [&]<typename T>(const char* key, T& out, const char* expected, auto fits) {
    if (!section->contains(key)) return;
    const auto& v = (*section)[key];
    if (!fits(v))
      throw Error(fmt::format("`{}` must be {}, got {}", key, expected, v.dump()), source);
    out = v.template get<T>();
  };
  auto get_int = [&](const char* key, int64_t& out) {
    get(key, out, "an integer", [](const nlohmann::json& v) { return v.is_number_integer(); });
  };
  auto get_bool = [&](const char* key, bool& out) {
    get(key, out, "true or false", [](const nlohmann::json& v) { return v.is_boolean(); });
  };
  auto get_triple = [&](const char* key, std::array<double, 3>& out) {
    if (!section->contains(key)) return;
    const auto& v = (*section)[key];
    if (v.is_number()) {
      out.fill(v.get<double>());
      return;
    }
    if (!v.is_array() || v.size() != 3 ||
        !std::all_of(v.begin(), v.end(), [](const auto& x) { return x.is_number(); }))
      throw Error(
          fmt::format("`{}` must be a number or a list of 3 numbers, got {}", key, v.dump()),
          source);
    for (int i = 0; i < 3; ++i) out[size_t(i)] = v[size_t(i)].get<double>();
  };
  get_int("patch_size", config.patch_size);
  get_int("temporal_patch_size", config.temporal_patch_size);
  get_int("merge_size", config.merge_size);
  get_int("patch_expand_factor", config.patch_expand_factor);
  get_int("min_image_tokens", config.min_image_tokens);
  get_int("max_image_tokens", config.max_image_tokens);
  get_bool("do_resize", config.do_resize);
  get_bool("do_rescale", config.do_rescale);
  get_bool("do_normalize", config.do_normalize);
  if (section->contains("rescale_factor")) {
    const auto& v = (*section)["rescale_factor"];
    if (!v.is_number()) throw Error("`rescale_factor` must be a number", source);
    config.rescale_factor = v.get<double>();
  }
  get_triple("image_mean", config.image_mean);
  get_triple("image_std", config.image_std);
  config.validate(source);
  return config;
}

void ProcessorConfig::validate(const std::string& source) const {
  auto positive = [&](const char* key, int64_t v) {
    if (v <= 0 || v > 4096)
      throw Error(fmt::format("`{}` must be between 1 and 4096, got {}", key, v), source);
  };
  positive("patch_size", patch_size);
  positive("temporal_patch_size", temporal_patch_size);
  positive("merge_size", merge_size);
  positive("patch_expand_factor", patch_expand_factor);
  if (min_image_tokens < 0 || max_image_tokens <= 0 || max_image_tokens > (int64_t(1) << 40))
    throw Error(fmt::format("`min_image_tokens` ({}) must be >= 0 and `max_image_tokens` ({}) "
                            "positive and below 2^40",
                            min_image_tokens, max_image_tokens),
                source);
  for (double s : image_std)
    if (s == 0.0 || !std::isfinite(s))
      throw Error("`image_std` must be finite and non-zero", source);
  for (double m : image_mean)
    if (!std::isfinite(m)) throw Error("`image_mean` must be finite", source);
  if (!(rescale_factor > 0.0) || !std::isfinite(rescale_factor))
    throw Error("`rescale_factor` must be positive", source);
}

// ---- Geometry -----------------------------------------------------------------------------------

std::array<int64_t, 2> smart_resize(int64_t num_frames, int64_t height, int64_t width,
                                    int64_t temporal_factor, int64_t factor, int64_t min_tokens,
                                    int64_t max_tokens) {
  if (height <= 0 || width <= 0 || num_frames <= 0)
    throw Error(
        fmt::format("cannot size an image of {}x{} with {} frame(s)", height, width, num_frames));
  const int64_t pixels_per_token = temporal_factor * factor * factor;
  const int64_t min_pixels = min_tokens * pixels_per_token;
  const int64_t max_pixels = max_tokens * pixels_per_token;
  const int64_t aligned_frames = std::max<int64_t>(
      temporal_factor,
      int64_t(round_half_even(double(num_frames) / double(temporal_factor))) * temporal_factor);
  int64_t h = align_up(height, factor);
  int64_t w = align_up(width, factor);
  int64_t budget = aligned_frames * h * w;

  if (budget < min_pixels) {
    // The raw frame count, not the aligned one, as the reference has it.
    const double scale = std::sqrt(double(min_pixels) / double(num_frames * height * width));
    h = align_up(std::max<int64_t>(1, int64_t(std::ceil(double(height) * scale))), factor);
    w = align_up(std::max<int64_t>(1, int64_t(std::ceil(double(width) * scale))), factor);
    budget = aligned_frames * h * w;
  }
  if (budget > max_pixels) {
    const int64_t minimum = aligned_frames * factor * factor;
    if (max_pixels < minimum)
      throw Error(fmt::format("max_pixels={} is too small. At least {} pixels are required for one "
                              "aligned patch.",
                              max_pixels, minimum),
                  "image processor", "raise max_image_tokens");
    // Binary search over the content height for the largest canvas within the budget.
    int64_t lo = 1, hi = height;
    int64_t best_h = factor, best_w = factor;
    while (lo <= hi) {
      const int64_t ch = (lo + hi) / 2;
      const int64_t cw =
          std::max<int64_t>(1, int64_t(std::floor(double(width * ch) / double(height))));
      const int64_t cand_h = align_up(ch, factor), cand_w = align_up(cw, factor);
      if (aligned_frames * cand_h * cand_w <= max_pixels) {
        best_h = cand_h;
        best_w = cand_w;
        lo = ch + 1;
      } else {
        hi = ch - 1;
      }
    }
    h = best_h;
    w = best_w;
  }
  return {h, w};
}

ImageGeometry image_geometry(const ProcessorConfig& config, int64_t height, int64_t width) {
  ImageGeometry g;
  g.height = height;
  g.width = width;
  const int64_t tf = config.temporal_patch_size;
  const auto [th, tw] = smart_resize(tf, height, width, tf, config.factor(),
                                     config.min_image_tokens, config.max_image_tokens);
  g.canvas_height = th;
  g.canvas_width = tw;
  g.content_height = height;
  g.content_width = width;
  if (config.do_resize) {
    // The content keeps the aspect ratio inside the canvas; no upscaling unless the image is
    // below the minimum budget. All float64, as in the reference (floor(111·(112/111)) is 111).
    double scale = std::min(double(th) / double(height), double(tw) / double(width));
    const int64_t pixels_per_token = tf * config.factor() * config.factor();
    if (tf * height * width >= pixels_per_token * config.min_image_tokens)
      scale = std::min(1.0, scale);
    g.content_height =
        std::max<int64_t>(1, std::min<int64_t>(th, int64_t(std::floor(double(height) * scale))));
    g.content_width =
        std::max<int64_t>(1, std::min<int64_t>(tw, int64_t(std::floor(double(width) * scale))));
  } else {
    // Without resizing, the reference patchifies the image as it is: it must already be a
    // whole number of merge blocks.
    g.canvas_height = height;
    g.canvas_width = width;
  }
  g.grid_h = g.canvas_height / config.patch_size;
  g.grid_w = g.canvas_width / config.patch_size;
  return g;
}

int64_t num_image_tokens(const ProcessorConfig& config, int64_t height, int64_t width) {
  const ImageGeometry g = image_geometry(config, height, width);
  return g.num_patches() / (config.merge_size * config.merge_size);
}

// ---- Resize -------------------------------------------------------------------------------------

namespace {

// Keys' cubic convolution with a = −0.5, in torch's operation order (UpSample.h
// cubic_convolution1/2): the weights are compared at the precision boundary below, so the
// exact double matters.
double keys_cubic(double x) {
  constexpr double a = -0.5;
  x = std::abs(x);
  if (x < 1.0) return ((a + 2) * x - (a + 3)) * x * x + 1;
  if (x < 2.0) return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a;
  return 0.0;
}

// One axis of torch's antialiased uint8 resampling: for each output index its first input index,
// tap count and int16 weights, at one fixed-point precision for the whole axis.
struct AxisWeights {
  int64_t taps = 0;  // weights per output index (max over the axis)
  std::vector<int64_t> first, count;
  std::vector<int32_t> weights;  // [out, taps], int16 values
  int precision = 0;
};

AxisWeights axis_weights(int64_t in_size, int64_t out_size) {
  AxisWeights aw;
  const double scale = double(in_size) / double(out_size);
  const double support = scale >= 1.0 ? 2.0 * scale : 2.0;  // interp_size 4 · 0.5
  aw.taps = int64_t(std::ceil(support)) * 2 + 1;
  aw.first.resize(size_t(out_size));
  aw.count.resize(size_t(out_size));
  std::vector<double> w(size_t(out_size * aw.taps), 0.0);
  double w_max = 0.0;
  const double invscale = scale >= 1.0 ? 1.0 / scale : 1.0;
  for (int64_t i = 0; i < out_size; ++i) {
    const double center = scale * (double(i) + 0.5);
    const int64_t xmin = std::max<int64_t>(int64_t(center - support + 0.5), 0);
    int64_t xsize = std::min<int64_t>(int64_t(center + support + 0.5), in_size) - xmin;
    xsize = std::clamp<int64_t>(xsize, 0, aw.taps);
    double* wi = &w[size_t(i * aw.taps)];
    double total = 0.0;
    for (int64_t j = 0; j < xsize; ++j) {
      wi[j] = keys_cubic((double(j + xmin) - center + 0.5) * invscale);
      total += wi[j];
    }
    if (total != 0.0) {
      for (int64_t j = 0; j < xsize; ++j) {
        wi[j] /= total;
        w_max = std::max(w_max, wi[j]);
      }
    }
    aw.first[size_t(i)] = xmin;
    aw.count[size_t(i)] = xsize;
  }
  // The largest precision (up to 22 bits) at which the largest weight still fits in int16.
  int precision = 0;
  for (precision = 0; precision < 22; ++precision) {
    const int next = int(0.5 + w_max * double(1 << (precision + 1)));
    if (next >= (1 << 15)) break;
  }
  aw.precision = precision;
  aw.weights.resize(w.size());
  for (size_t k = 0; k < w.size(); ++k) {
    const double v = w[k] * double(1 << precision);
    aw.weights[k] = int16_t(v < 0 ? int(-0.5 + v) : int(0.5 + v));
  }
  return aw;
}

inline uint8_t fixed_to_u8(int32_t acc, int precision) {
  // Arithmetic shift (floor) then saturation, as the kernel's srai + packs/packus.
  return uint8_t(std::clamp(acc >> precision, 0, 255));
}

}  // namespace

RgbImage resize_bicubic_antialias(const RgbImage& image, int64_t height, int64_t width) {
  GLMTUNE_ASSERT(height > 0 && width > 0 && image.height > 0 && image.width > 0,
                 "resize {}x{} -> {}x{}", image.height, image.width, height, width);
  RgbImage current = image;
  // Horizontal pass first, then vertical; an axis whose size does not change is skipped.
  if (width != current.width) {
    const AxisWeights aw = axis_weights(current.width, width);
    RgbImage out;
    out.height = current.height;
    out.width = width;
    out.pixels.resize(size_t(out.height * out.width * 3));
    const int32_t bias = aw.precision > 0 ? int32_t(1) << (aw.precision - 1) : 0;
    for (int64_t y = 0; y < current.height; ++y) {
      const uint8_t* src = &current.pixels[size_t(y * current.width * 3)];
      uint8_t* dst = &out.pixels[size_t(y * width * 3)];
      for (int64_t x = 0; x < width; ++x) {
        const int32_t* k = &aw.weights[size_t(x * aw.taps)];
        const uint8_t* s = src + aw.first[size_t(x)] * 3;
        int32_t acc[3] = {bias, bias, bias};
        for (int64_t j = 0; j < aw.count[size_t(x)]; ++j)
          for (int c = 0; c < 3; ++c) acc[c] += int32_t(s[j * 3 + c]) * k[j];
        for (int c = 0; c < 3; ++c) dst[x * 3 + c] = fixed_to_u8(acc[c], aw.precision);
      }
    }
    current = std::move(out);
  }
  if (height != current.height) {
    const AxisWeights aw = axis_weights(current.height, height);
    RgbImage out;
    out.height = height;
    out.width = current.width;
    const int64_t row = current.width * 3;
    out.pixels.resize(size_t(height * row));
    const int32_t bias = aw.precision > 0 ? int32_t(1) << (aw.precision - 1) : 0;
    std::vector<int32_t> acc(static_cast<size_t>(row));
    for (int64_t y = 0; y < height; ++y) {
      std::fill(acc.begin(), acc.end(), bias);
      const int32_t* k = &aw.weights[size_t(y * aw.taps)];
      for (int64_t j = 0; j < aw.count[size_t(y)]; ++j) {
        const uint8_t* s = &current.pixels[size_t((aw.first[size_t(y)] + j) * row)];
        const int32_t kj = k[j];
        for (int64_t x = 0; x < row; ++x) acc[size_t(x)] += int32_t(s[x]) * kj;
      }
      uint8_t* dst = &out.pixels[size_t(y * row)];
      for (int64_t x = 0; x < row; ++x) dst[x] = fixed_to_u8(acc[size_t(x)], aw.precision);
    }
    current = std::move(out);
  }
  return current;
}

RgbImage resize_and_pad_to(const RgbImage& image, int64_t content_height, int64_t content_width,
                           int64_t canvas_height, int64_t canvas_width) {
  const bool resized = content_height != image.height || content_width != image.width;
  const RgbImage content =
      resized ? resize_bicubic_antialias(image, content_height, content_width) : image;
  if (canvas_height == content.height && canvas_width == content.width) return content;
  RgbImage canvas;
  canvas.height = canvas_height;
  canvas.width = canvas_width;
  canvas.pixels.assign(size_t(canvas.height * canvas.width * 3), 0);
  for (int64_t y = 0; y < content.height; ++y)
    std::memcpy(&canvas.pixels[size_t(y * canvas.width * 3)],
                &content.pixels[size_t(y * content.width * 3)], size_t(content.width * 3));
  return canvas;
}

RgbImage resize_and_pad(const ProcessorConfig& config, const RgbImage& image) {
  const ImageGeometry g = image_geometry(config, image.height, image.width);
  return resize_and_pad_to(image, g.content_height, g.content_width, g.canvas_height,
                           g.canvas_width);
}

// ---- Normalise and patchify --------------------------------------------------------------------

void write_canvas_rows(const ProcessorConfig& config, const RgbImage& canvas, int64_t slot,
                       float* rows) {
  const int64_t p = config.patch_size, m = config.merge_size, t = config.temporal_patch_size;
  if (canvas.height % (p * m) != 0 || canvas.width % (p * m) != 0)
    throw Error(fmt::format("the {}x{} image is not a whole number of {}x{} merge blocks (resizing "
                            "is off in the processor config)",
                            canvas.height, canvas.width, p * m, p * m),
                "image processor", "enable do_resize or pass images of a matching size");
  GLMTUNE_ASSERT(slot >= 0 && slot < t, "temporal slot {} of {}", slot, t);
  // Fused rescale + normalise, with the constants as torch rounds them: the float32 mean/std
  // tensors times 1/rescale_factor (a float32 product), then (x − m′) / s′ in float32.
  float mean[3], stdev[3];
  for (int c = 0; c < 3; ++c) {
    if (config.do_rescale && config.do_normalize) {
      const float inv = float(1.0 / config.rescale_factor);
      mean[c] = float(config.image_mean[size_t(c)]) * inv;
      stdev[c] = float(config.image_std[size_t(c)]) * inv;
    } else {
      mean[c] = float(config.image_mean[size_t(c)]);
      stdev[c] = float(config.image_std[size_t(c)]);
    }
  }
  const bool normalize = config.do_normalize;
  const bool rescale_only = !config.do_normalize && config.do_rescale;
  const float rescale = float(config.rescale_factor);
  auto value = [&](uint8_t x, int c) -> float {
    if (normalize) return (float(x) - mean[c]) / stdev[c];
    if (rescale_only) return float(x) * rescale;
    return float(x);
  };

  const int64_t gh = canvas.height / p, gw = canvas.width / p;
  const int64_t row_size = 3 * t * p * p;
  // Rows in merge-block-major order: block (bh, bw), then (mh, mw) inside it; each row holds
  // (channel, frame, i, j).
  int64_t r = 0;
  for (int64_t bh = 0; bh < gh / m; ++bh)
    for (int64_t bw = 0; bw < gw / m; ++bw)
      for (int64_t mh = 0; mh < m; ++mh)
        for (int64_t mw = 0; mw < m; ++mw, ++r) {
          const int64_t ph = bh * m + mh, pw = bw * m + mw;
          float* row = rows + r * row_size;
          for (int c = 0; c < 3; ++c) {
            float* plane = row + (c * t + slot) * p * p;
            for (int64_t i = 0; i < p; ++i) {
              const uint8_t* src =
                  &canvas.pixels[size_t(((ph * p + i) * canvas.width + pw * p) * 3)];
              for (int64_t j = 0; j < p; ++j) plane[i * p + j] = value(src[j * 3 + c], c);
            }
          }
        }
}

void copy_temporal_slot(const ProcessorConfig& config, float* rows, int64_t count, int64_t from,
                        int64_t to) {
  const int64_t p = config.patch_size, t = config.temporal_patch_size;
  const int64_t row_size = 3 * t * p * p;
  for (int64_t r = 0; r < count; ++r)
    for (int c = 0; c < 3; ++c)
      std::memcpy(rows + r * row_size + (c * t + to) * p * p,
                  rows + r * row_size + (c * t + from) * p * p, size_t(p * p) * sizeof(float));
}

std::array<int64_t, 2> process_image_into(const ProcessorConfig& config, const RgbImage& image,
                                          std::vector<float>& rows) {
  if (image.height <= 0 || image.width <= 0 ||
      image.pixels.size() != size_t(image.height * image.width * 3))
    throw Error(fmt::format("image of {}x{} with {} bytes is not an RGB8 image", image.height,
                            image.width, image.pixels.size()),
                "image processor");
  const RgbImage canvas = resize_and_pad(config, image);
  const int64_t p = config.patch_size;
  const int64_t gh = canvas.height / p, gw = canvas.width / p;
  const size_t base = rows.size();
  rows.resize(base + size_t(gh * gw * config.row_size()));
  float* out = rows.data() + base;
  write_canvas_rows(config, canvas, 0, out);
  // The image is its own second frame.
  for (int64_t f = 1; f < config.temporal_patch_size; ++f)
    copy_temporal_slot(config, out, gh * gw, 0, f);
  return {gh, gw};
}

ProcessedImages process_images(const ProcessorConfig& config, std::span<const RgbImage> images) {
  ProcessedImages result;
  std::vector<float> rows;
  std::vector<int64_t> grid;
  for (const RgbImage& image : images) {
    const auto [gh, gw] = process_image_into(config, image, rows);
    grid.insert(grid.end(), {1, gh, gw});
    result.num_tokens.push_back(gh * gw / (config.merge_size * config.merge_size));
  }
  const int64_t n = int64_t(rows.size()) / config.row_size();
  result.pixel_values = Tensor::from_vector(rows, {n, config.row_size()});
  result.grid_thw = Tensor::from_vector(grid, {int64_t(images.size()), 3});
  return result;
}

// ---- Token stream -------------------------------------------------------------------------------

MediaTokenIds MediaTokenIds::from_tokenizer(const Tokenizer& tokenizer) {
  MediaTokenIds ids;
  const std::pair<std::string_view, int32_t*> tokens[] = {
      {"<|begin_of_image|>", &ids.begin_of_image},
      {"<|end_of_image|>", &ids.end_of_image},
      {"<|begin_of_video|>", &ids.begin_of_video},
      {"<|end_of_video|>", &ids.end_of_video},
      {"<|image|>", &ids.image},
      {"<|video|>", &ids.video}};
  for (const auto& [token, out] : tokens) {
    const auto id = tokenizer.token_to_id(token);
    if (!id)
      throw Error(fmt::format("the tokenizer has no `{}` token", token), "tokenizer",
                  "use the tokenizer.json of GLM-5.3 (or a tokenizer with its media tokens)");
    *out = *id;
  }
  return ids;
}

namespace {

// The counts both expansions check, each in its own words: `stream` holds the placeholders ("the
// text"), `placeholder` names one.
struct PlaceholderCount {
  std::string_view stream, placeholder;
  size_t images;
  const std::string& source;

  // Before placeholder number k (from 0) is expanded.
  void check_next(size_t k) const {
    if (k >= images)
      throw Error(
          fmt::format("{} has more {}s than the {} image(s) given", stream, placeholder, images),
          source, "give one image per placeholder");
  }
  // After the whole stream, in which k placeholders were met.
  void check_total(size_t k) const {
    if (k != images)
      throw Error(
          fmt::format("{} image(s) given but {} has {} {}(s)", images, stream, k, placeholder),
          source, "give one image per placeholder");
  }
};

}  // namespace

std::string expand_image_placeholders(std::string_view text,
                                      std::span<const int64_t> tokens_per_image,
                                      const std::string& source) {
  const PlaceholderCount count{"the text", "`<|image|>` placeholder", tokens_per_image.size(),
                               source};
  std::string out;
  size_t pos = 0, k = 0;
  for (;;) {
    const size_t hit = text.find(kImagePlaceholder, pos);
    if (hit == std::string_view::npos) break;
    count.check_next(k);
    out.append(text.substr(pos, hit - pos));
    for (int64_t i = 0; i < tokens_per_image[k]; ++i) out.append(kImagePlaceholder);
    ++k;
    pos = hit + kImagePlaceholder.size();
  }
  count.check_total(k);
  out.append(text.substr(pos));
  return out;
}

std::vector<int32_t> expand_image_tokens(std::span<const int32_t> ids,
                                         std::span<const int64_t> tokens_per_image,
                                         const MediaTokenIds& media, const std::string& source) {
  const PlaceholderCount count{"the token stream", "image placeholder", tokens_per_image.size(),
                               source};
  std::vector<int32_t> out;
  out.reserve(ids.size());
  size_t k = 0;
  int64_t starts = 0, ends = 0;
  for (int32_t id : ids) {
    starts += id == media.begin_of_video;
    ends += id == media.end_of_video;
    if (id != media.image || starts > ends) {
      out.push_back(id);
      continue;
    }
    count.check_next(k);
    out.insert(out.end(), size_t(tokens_per_image[k]), media.image);
    ++k;
  }
  count.check_total(k);
  return out;
}

std::vector<int32_t> mm_token_type_ids(std::span<const int32_t> ids, const MediaTokenIds& media) {
  std::vector<int32_t> types(ids.size(), 0);
  int64_t starts = 0, ends = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    starts += ids[i] == media.begin_of_video;
    ends += ids[i] == media.end_of_video;
    if (ids[i] == media.image) types[i] = starts > ends ? 2 : 1;
  }
  return types;
}

}  // namespace glmtune::data::media
