#pragma once
// Image decoding to 8-bit RGB, reproducing what the reference pipeline feeds its image processor:
// transformers' `load_image` opens the file with PIL, applies `ImageOps.exif_transpose` and then
// `convert("RGB")`. So, as PIL does:
//   - the format is recognised by its magic bytes (JPEG, PNG, WebP, GIF), never by the extension;
//   - EXIF orientation (tag 0x0112 of IFD0, values 2-8) is applied; other values are ignored;
//   - alpha is dropped, not composited (convert("RGB") keeps the colour of transparent pixels);
//   - grayscale is replicated to three channels; 1/2/4-bit grayscale scales to 0-255;
//   - 16-bit RGB(A) and gray+alpha keep their high byte; 16-bit grayscale (PIL mode "I;16") is
//     clipped at 255, not scaled (PIL's I;16 -> RGB conversion);
//   - palette images look colours up in their palette (indices past its end give black);
//   - CMYK JPEGs are taken as Adobe-inverted (PIL assumes so for every CMYK JPEG) and converted
//     with PIL's cmyk2rgb: v = (255 - k) - (255 - k)·c / 255 in PIL's rounding;
//   - a GIF gives its first frame on the logical screen (grown to the frame if the frame is
//     larger), the area outside the frame filled with the frame's transparent index, else index 0;
//   - WebP gives its first frame the way libwebp's animation decoder composes it (as Pillow does).
// Every failure (empty, truncated or corrupt data, an unknown format, more pixels than the
// configured cap) is a glmtune::Error naming the source; dimensions are checked against the cap
// from the header before any pixel buffer is allocated.

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

namespace glmtune::data::media {

enum class ImageFormat { unknown, jpeg, png, webp, gif };

const char* to_string(ImageFormat format);

// The format named by the first bytes of `bytes` (unknown when none matches).
ImageFormat sniff_image_format(std::span<const uint8_t> bytes);

struct DecodeOptions {
  // PIL refuses images of more than 2 × Image.MAX_IMAGE_PIXELS pixels as decompression bombs;
  // the same bound by default. Checked against the stored size, before decoding.
  uint64_t max_pixels = 178'956'970;
  bool apply_exif_orientation = true;
};

// Interleaved 8-bit RGB, row-major: pixel (y, x) channel c is at (y·width + x)·3 + c.
struct RgbImage {
  int64_t height = 0;
  int64_t width = 0;
  std::vector<uint8_t> pixels;
};

// What the header says, without decoding pixels: the stored size and the size after the EXIF
// orientation is applied (orientations 5-8 swap width and height).
struct ImageInfo {
  ImageFormat format = ImageFormat::unknown;
  int64_t stored_height = 0;
  int64_t stored_width = 0;
  int orientation = 1;  // EXIF orientation, 1 when absent or not applied
  int64_t height = 0;   // as decoded
  int64_t width = 0;
};

// `source` names the data in errors (a file path, "sample 12 of data.jsonl", ...).
RgbImage decode_image(std::span<const uint8_t> bytes, const std::string& source,
                      const DecodeOptions& options = {});
ImageInfo probe_image(std::span<const uint8_t> bytes, const std::string& source,
                      const DecodeOptions& options = {});

// Reads and decodes a file; errors name the path.
RgbImage load_image(const std::filesystem::path& path, const DecodeOptions& options = {});
ImageInfo probe_image_file(const std::filesystem::path& path, const DecodeOptions& options = {});

// The size of a media file, after checking that `path` names a regular file: a directory, a FIFO
// or a device is an Error naming the path (a directory would otherwise "open" and report an absurd
// size, a FIFO would block). `expected` completes the message ("an image file", "a video file").
uint64_t media_file_size(const std::filesystem::path& path, const std::string& expected);

// Applies an EXIF orientation (1-8) to an interleaved RGB image, as PIL's exif_transpose does.
RgbImage apply_orientation(const RgbImage& image, int orientation);

}  // namespace glmtune::data::media
