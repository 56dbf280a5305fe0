// libFuzzer entry: decode arbitrary bytes as an image and run what decodes through the image
// processor. Every input must either be rejected with a glmtune::Error or give a picture and pixel
// rows of exactly the announced geometry; anything else (a crash, a hang, a sanitizer report, an
// internal assertion, a size mismatch) is a bug. The limits are small so that every input stays
// cheap: the fuzzer looks for memory errors and unbounded work, not for big files. (Videos have a
// target of their own, fuzz_video: FFmpeg probing every input as a container costs about 100 times
// what the image decoders do.)

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/data/media/image.h"
#include "glmtune/data/media/processor.h"

namespace {

using namespace glmtune::data::media;

[[noreturn]] void bug() { std::abort(); }

void fuzz_image(std::span<const uint8_t> bytes) {
  DecodeOptions options;
  options.max_pixels = 1 << 14;
  RgbImage image;
  try {
    image = decode_image(bytes, "fuzz input", options);
  } catch (const glmtune::Error&) {
    return;
  }
  if (image.height <= 0 || image.width <= 0 ||
      image.pixels.size() != size_t(image.height * image.width * 3))
    bug();
  ProcessorConfig config;
  config.max_image_tokens = 16;
  const ImageGeometry g = image_geometry(config, image.height, image.width);
  std::vector<float> rows;
  const auto grid = process_image_into(config, image, rows);
  if (grid[0] != g.grid_h || grid[1] != g.grid_w ||
      rows.size() != size_t(g.num_patches() * config.row_size()))
    bug();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz_image(std::span<const uint8_t>(data, size));
  return 0;
}
