#pragma once
// The GLM-5.3 image processor (transformers 5.17.0 `Glm5NextImageProcessor`, the torchvision
// backend that processor_config.json names) and the image side of the text/vision splice:
//
//   decoded RGB8 -> smart_resize canvas (multiples of 28) -> content size -> bicubic antialiased
//   resize of the uint8 image (only when out of budget or below the minimum) -> zero pad bottom
//   and right -> (x − 255·mean) / (255·std) in float32 -> merge-block-major rows of
//   3·2·14·14 = 1176 values (the frame duplicated along the temporal axis) + grid_thw [1, gh, gw].
//
// Every step reproduces the reference bit for bit: smart_resize in float64 with Python's rounding,
// the resize as torch's CPU uint8 kernel (Keys a = −0.5 filter widened by the downscale factor,
// int16 weights at the precision torch picks, horizontal pass then vertical, each rounded to
// uint8), and the fused normalisation constants as torch rounds them to float32. Token counts come
// from the geometry alone (image_geometry / num_image_tokens), equal to the decoded path.

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "glmtune/data/media/image.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::data {
class Tokenizer;
}

namespace glmtune::data::media {

// The `image_processor` section of processor_config.json (defaults = the class defaults, which
// the released file repeats).
struct ProcessorConfig {
  int64_t patch_size = 14;
  int64_t temporal_patch_size = 2;
  int64_t merge_size = 2;
  int64_t patch_expand_factor = 1;
  int64_t min_image_tokens = 16, max_image_tokens = 8000;
  bool do_resize = true;
  bool do_rescale = true;
  double rescale_factor = 1.0 / 255.0;
  bool do_normalize = true;
  std::array<double, 3> image_mean = {0.48145466, 0.4578275, 0.40821073};  // OPENAI_CLIP_MEAN
  std::array<double, 3> image_std = {0.26862954, 0.26130258, 0.27577711};  // OPENAI_CLIP_STD

  // Reads the "image_processor" object of a processor_config.json (or a bare image processor
  // config). Unknown keys are ignored, as transformers ignores them; invalid values are
  // glmtune::Errors naming the file and key.
  static ProcessorConfig from_file(const std::string& path);
  static ProcessorConfig from_json_text(std::string_view text, const std::string& source);
  // The same for any section ("video_processor" for the video processor's geometry), starting
  // from `defaults`; a file without that section is read as the bare section.
  static ProcessorConfig from_json_section(std::string_view text, const std::string& source,
                                           std::string_view section,
                                           const ProcessorConfig& defaults);

  // The canvas alignment: patch · merge · expand = 28.
  int64_t factor() const { return patch_size * merge_size * patch_expand_factor; }
  // Values per pixel row: 3 · temporal · patch² = 1176.
  int64_t row_size() const { return 3 * temporal_patch_size * patch_size * patch_size; }
  // Checks the values (positive sizes, canvas divisible into merge blocks, std ≠ 0); throws
  // glmtune::Error naming `source`.
  void validate(const std::string& source) const;
};

// The reference `smart_resize` (GLM's own, not Qwen's): the canvas (height, width), multiples of
// `factor`, within min/max_tokens · temporal_factor · factor² pixels over `num_frames` frames.
// Throws glmtune::Error when max_tokens is too small for one aligned patch.
std::array<int64_t, 2> smart_resize(int64_t num_frames, int64_t height, int64_t width,
                                    int64_t temporal_factor, int64_t factor, int64_t min_tokens,
                                    int64_t max_tokens);

// Everything the processor decides from an image's size alone.
struct ImageGeometry {
  int64_t height = 0, width = 0;                  // input
  int64_t canvas_height = 0, canvas_width = 0;    // after padding (multiples of factor)
  int64_t content_height = 0, content_width = 0;  // after the resize (== input when none)
  int64_t grid_h = 0, grid_w = 0;                 // canvas / patch_size

  bool resized() const { return content_height != height || content_width != width; }
  int64_t num_patches() const { return grid_h * grid_w; }
};

ImageGeometry image_geometry(const ProcessorConfig& config, int64_t height, int64_t width);
// `<|image|>` tokens the image expands to: patches / merge².
int64_t num_image_tokens(const ProcessorConfig& config, int64_t height, int64_t width);

// torch's CPU bicubic antialiased resize of uint8 images (interpolate(..., mode="bicubic",
// antialias=True) as torchvision's resize calls it), exactly.
RgbImage resize_bicubic_antialias(const RgbImage& image, int64_t height, int64_t width);

// The uint8 canvas the reference normalises: resized to the content size if needed, zero-padded
// at the bottom and right.
RgbImage resize_and_pad(const ProcessorConfig& config, const RgbImage& image);

// Writes the patch rows of one uint8 canvas (whole merge blocks) as temporal slot `slot` of
// gh·gw consecutive rows starting at `rows`, normalised as the reference does. Images fill slot 0
// and copy it to the other slots; video frame f of a tubelet fills slot f.
void write_canvas_rows(const ProcessorConfig& config, const RgbImage& canvas, int64_t slot,
                       float* rows);
// Copies temporal slot `from` to slot `to` in `count` rows (frame duplication / padding).
void copy_temporal_slot(const ProcessorConfig& config, float* rows, int64_t count, int64_t from,
                        int64_t to);
// Resizes to the content size (when it differs) and zero-pads to the canvas.
RgbImage resize_and_pad_to(const RgbImage& image, int64_t content_height, int64_t content_width,
                           int64_t canvas_height, int64_t canvas_width);

struct ProcessedImages {
  Tensor pixel_values;              // f32 [Σ gh·gw, row_size], images in input order
  Tensor grid_thw;                  // i64 [n_images, 3], rows (1, gh, gw)
  std::vector<int64_t> num_tokens;  // per image: gh·gw / merge²
};

// One image's rows, appended to `rows` (row_size floats per patch); returns (gh, gw).
std::array<int64_t, 2> process_image_into(const ProcessorConfig& config, const RgbImage& image,
                                          std::vector<float>& rows);
ProcessedImages process_images(const ProcessorConfig& config, std::span<const RgbImage> images);

// ---- The token stream -------------------------------------------------------------------------

// Ids of the media tokens (released tokenizer: 154830/154831 image begin/end, 154832/154833
// video begin/end, 154854 <|image|>, 154855 <|video|>).
struct MediaTokenIds {
  int32_t begin_of_image = 154830, end_of_image = 154831;
  int32_t begin_of_video = 154832, end_of_video = 154833;
  int32_t image = 154854, video = 154855;

  // Looks the six tokens up; throws glmtune::Error naming the missing one.
  static MediaTokenIds from_tokenizer(const Tokenizer& tokenizer);
};

inline constexpr std::string_view kImagePlaceholder = "<|image|>";

// The reference processor's text expansion: the k-th "<|image|>" of `text` (left to right, one
// pass over the original text) becomes tokens_per_image[k] copies of itself. The chat template
// already wrote `<|begin_of_image|>` and `<|end_of_image|>` around each placeholder. Throws
// glmtune::Error when the number of placeholders differs from the number of images.
std::string expand_image_placeholders(std::string_view text,
                                      std::span<const int64_t> tokens_per_image,
                                      const std::string& source = "text");

// The same on token ids: each `ids.image` token outside a video span becomes tokens_per_image[k]
// image tokens (tokenising the expanded text gives the same ids, since <|image|> is an atomic
// added token). Image tokens inside `<|begin_of_video|>` ... `<|end_of_video|>` are left alone.
std::vector<int32_t> expand_image_tokens(std::span<const int32_t> ids,
                                         std::span<const int64_t> tokens_per_image,
                                         const MediaTokenIds& media, const std::string& source);

// The processor's mm_token_type_ids: 1 for an image token outside a video span, 2 for one inside
// (a position is inside when the count of <|begin_of_video|> up to and including it exceeds the
// count of <|end_of_video|>), 0 for everything else (markers and timestamp text included).
std::vector<int32_t> mm_token_type_ids(std::span<const int32_t> ids, const MediaTokenIds& media);

}  // namespace glmtune::data::media
