// Image decoding: parity with PIL (transformers' load_image: open, exif_transpose, convert("RGB"))
// on the golden images of tools/golden/vision.py, header probing, format sniffing and the error
// every bad file gets.

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/data/media/image.h"
#include "glmtune/io/safetensors.h"
#include "support/temp_dir.h"

namespace glmtune::data::media {
namespace {

namespace fs = std::filesystem;

const std::string kGolden = std::string(GLMTUNE_SOURCE_DIR) + "/tests/golden/vision";

std::vector<uint8_t> read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<std::string> golden_files() {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(kGolden + "/images"))
    names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// The error `fn` throws; fails the test when it throws nothing.
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

uint32_t crc32(const uint8_t* data, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= data[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
  }
  return ~c;
}

void put_be32(std::vector<uint8_t>& out, uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) out.push_back(uint8_t(v >> s));
}

std::vector<uint8_t> png_chunk(const char* type, const std::vector<uint8_t>& data) {
  std::vector<uint8_t> body(type, type + 4);
  body.insert(body.end(), data.begin(), data.end());
  std::vector<uint8_t> out;
  put_be32(out, uint32_t(data.size()));
  out.insert(out.end(), body.begin(), body.end());
  put_be32(out, crc32(body.data(), body.size()));
  return out;
}

// A PNG whose header claims `w` x `h` 8-bit RGB, followed by a few bytes of (garbage) data.
std::vector<uint8_t> png_with_header(uint32_t w, uint32_t h) {
  std::vector<uint8_t> png = {0x89, 'P', 'N', 'G', 0x0D, 0x0A, 0x1A, 0x0A};
  std::vector<uint8_t> ihdr;
  put_be32(ihdr, w);
  put_be32(ihdr, h);
  ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});
  auto c = png_chunk("IHDR", ihdr);
  png.insert(png.end(), c.begin(), c.end());
  auto d = png_chunk("IDAT", {0x78, 0x9C, 0x03, 0x00});
  png.insert(png.end(), d.begin(), d.end());
  return png;
}

TEST(MediaImage, DecodesLikePil) {
  const auto ref = io::SafetensorsFile::open(kGolden + "/decode.safetensors");
  const auto files = golden_files();
  ASSERT_GE(files.size(), 20u);
  for (const std::string& name : files) {
    SCOPED_TRACE(name);
    const RgbImage image = load_image(kGolden + "/images/" + name);
    const Tensor expected = ref.tensor("decode." + name);
    ASSERT_EQ(expected.dim(), 3);
    ASSERT_EQ(image.height, expected.size(0));
    ASSERT_EQ(image.width, expected.size(1));
    ASSERT_EQ(expected.size(2), 3);
    const std::vector<double> want = expected.to_doubles();  // byte values stored as f16
    // Every format, lossy ones included, decodes to PIL's bytes exactly: libjpeg-turbo with the
    // same (default) settings and libwebp's decoder are deterministic across the versions in use.
    int64_t differing = 0, first = -1;
    for (size_t i = 0; i < image.pixels.size(); ++i) {
      if (double(image.pixels[i]) != want[i]) {
        if (first < 0) first = int64_t(i);
        ++differing;
      }
    }
    EXPECT_EQ(differing, 0) << "first difference at byte " << first << ": got "
                            << int(image.pixels[size_t(std::max<int64_t>(first, 0))]) << ", PIL "
                            << want[size_t(std::max<int64_t>(first, 0))];
  }
}

TEST(MediaImage, ProbeMatchesDecodedSize) {
  for (const std::string& name : golden_files()) {
    SCOPED_TRACE(name);
    const ImageInfo info = probe_image_file(kGolden + "/images/" + name);
    const RgbImage image = load_image(kGolden + "/images/" + name);
    EXPECT_EQ(info.height, image.height);
    EXPECT_EQ(info.width, image.width);
    EXPECT_NE(info.format, ImageFormat::unknown);
  }
  // Orientation 6 swaps the stored 40x24 to 24 wide, 40 high.
  const ImageInfo rot = probe_image_file(kGolden + "/images/exif_rot6.jpg");
  EXPECT_EQ(rot.format, ImageFormat::jpeg);
  EXPECT_EQ(rot.orientation, 6);
  EXPECT_EQ(rot.stored_width, 40);
  EXPECT_EQ(rot.stored_height, 24);
  EXPECT_EQ(rot.width, 24);
  EXPECT_EQ(rot.height, 40);
}

TEST(MediaImage, OrientationCanBeIgnored) {
  DecodeOptions keep;
  keep.apply_exif_orientation = false;
  const RgbImage stored = load_image(kGolden + "/images/exif_rot6.jpg", keep);
  EXPECT_EQ(stored.width, 40);
  EXPECT_EQ(stored.height, 24);
  const RgbImage rotated = apply_orientation(stored, 6);
  const RgbImage decoded = load_image(kGolden + "/images/exif_rot6.jpg");
  EXPECT_EQ(rotated.pixels, decoded.pixels);
  // Each orientation and its inverse give back the original.
  const int inverse[9] = {0, 1, 2, 3, 4, 5, 8, 7, 6};
  for (int o = 1; o <= 8; ++o)
    EXPECT_EQ(apply_orientation(apply_orientation(stored, o), inverse[o]).pixels, stored.pixels)
        << "orientation " << o;
}

TEST(MediaImage, SniffsByMagicBytesNotExtension) {
  const auto png = read_bytes(kGolden + "/images/rgb_small.png");
  EXPECT_EQ(sniff_image_format(png), ImageFormat::png);
  EXPECT_EQ(sniff_image_format(read_bytes(kGolden + "/images/photo.jpg")), ImageFormat::jpeg);
  EXPECT_EQ(sniff_image_format(read_bytes(kGolden + "/images/lossy.webp")), ImageFormat::webp);
  EXPECT_EQ(sniff_image_format(read_bytes(kGolden + "/images/anim.gif")), ImageFormat::gif);
  // A PNG saved under a misleading name decodes as the PNG it is.
  const fs::path renamed = fs::temp_directory_path() / ("glmtune_test_media_really_a_png_" +
                                                        std::to_string(::getpid()) + ".jpg");
  std::ofstream(renamed, std::ios::binary)
      .write(reinterpret_cast<const char*>(png.data()), std::streamsize(png.size()));
  const RgbImage a = load_image(renamed);
  const RgbImage b = load_image(kGolden + "/images/rgb_small.png");
  fs::remove(renamed);
  EXPECT_EQ(a.pixels, b.pixels);
}

TEST(MediaImage, BadFilesAreErrorsNamingTheSource) {
  const auto jpeg = read_bytes(kGolden + "/images/photo.jpg");
  const auto progressive = read_bytes(kGolden + "/images/progressive.jpg");
  const auto png = read_bytes(kGolden + "/images/rgb_wide.png");
  const auto webp = read_bytes(kGolden + "/images/lossy.webp");
  const auto gif = read_bytes(kGolden + "/images/anim.gif");
  auto cut = [](const std::vector<uint8_t>& v, size_t n) {
    return std::vector<uint8_t>(v.begin(), v.begin() + ptrdiff_t(n));
  };
  struct Case {
    std::string name;
    std::vector<uint8_t> bytes;
    std::string expect;
  };
  std::mt19937 rng(12345);
  std::vector<uint8_t> noise(4096);
  for (auto& b : noise) b = uint8_t(rng());
  noise[0] = 'N';  // no accidental signature
  std::vector<uint8_t> jpeg_noise = {0xFF, 0xD8, 0xFF};
  jpeg_noise.insert(jpeg_noise.end(), noise.begin(), noise.end());
  std::vector<uint8_t> png_noise(png.begin(), png.begin() + 8);
  png_noise.insert(png_noise.end(), noise.begin(), noise.end());
  // A JPEG whose frame header claims 65000 x 65000 pixels.
  std::vector<uint8_t> huge_jpeg = jpeg;
  for (size_t i = 2; i + 9 < huge_jpeg.size(); ++i) {
    if (huge_jpeg[i] == 0xFF && (huge_jpeg[i + 1] == 0xC0 || huge_jpeg[i + 1] == 0xC2)) {
      huge_jpeg[i + 5] = 0xFD;
      huge_jpeg[i + 6] = 0xE8;
      huge_jpeg[i + 7] = 0xFD;
      huge_jpeg[i + 8] = 0xE8;
      break;
    }
  }
  std::vector<Case> cases = {
      {"empty.png", {}, "empty"},
      {"random.bin", noise, "unknown image format"},
      {"bmp.bmp", {'B', 'M', 0, 0, 0, 0, 0, 0, 0, 0}, "unknown image format"},
      {"truncated.jpg", cut(jpeg, jpeg.size() / 2), "truncated"},
      {"truncated_progressive.jpg", cut(progressive, progressive.size() * 2 / 3), "truncated"},
      {"header_only.jpg", cut(jpeg, 20), "cannot decode JPEG"},
      {"noise.jpg", jpeg_noise, "cannot decode JPEG"},
      {"huge.jpg", huge_jpeg, "more than the limit"},
      {"truncated.png", cut(png, png.size() / 2), "cannot decode PNG"},
      {"noise.png", png_noise, "cannot decode PNG"},
      {"huge.png", png_with_header(100000, 100000), "100000x100000"},
      {"zero.png", png_with_header(0, 5), "cannot decode PNG"},
      {"truncated.webp", cut(webp, webp.size() / 2), "WebP"},
      {"signature.webp", cut(webp, 12), "WebP"},
      {"truncated.gif", cut(gif, gif.size() / 2), "cannot decode GIF"},
      {"screen_only.gif", cut(gif, 13), "cannot decode GIF"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string what = error_of([&] { decode_image(c.bytes, c.name); });
    EXPECT_NE(what.find(c.name), std::string::npos) << what;
    EXPECT_NE(what.find(c.expect), std::string::npos) << what;
    const std::string probe_what = error_of([&] {
      const ImageInfo info = probe_image(c.bytes, c.name);
      // A header that is intact may probe fine; then the full decode is what must fail.
      if (info.width > 0) throw Error("header intact", c.name);
    });
    EXPECT_NE(probe_what.find(c.name), std::string::npos) << probe_what;
  }
  // Complete pixels without the trailing EOI marker / IEND chunk decode, as in PIL.
  EXPECT_EQ(decode_image(cut(jpeg, jpeg.size() - 2), "no_eoi.jpg").pixels,
            decode_image(jpeg, "photo.jpg").pixels);
  EXPECT_EQ(decode_image(cut(png, png.size() - 12), "no_iend.png").pixels,
            decode_image(png, "rgb_wide.png").pixels);
  // Files that do not exist or are empty on disk.
  EXPECT_NE(error_of([] { load_image("/nonexistent/dir/picture.png"); }).find("picture.png"),
            std::string::npos);
  const fs::path empty = fs::temp_directory_path() /
                         ("glmtune_test_media_empty_" + std::to_string(::getpid()) + ".png");
  std::ofstream(empty, std::ios::binary).close();
  const std::string what = error_of([&] { load_image(empty); });
  fs::remove(empty);
  EXPECT_NE(what.find("empty"), std::string::npos) << what;
}

TEST(MediaImage, PathsThatAreNotImageFilesAreErrorsNamingThem) {
  // A directory opens on Linux and reports an absurd size; a FIFO blocks the open; a device never
  // ends. Each is refused before it is read, naming the path and what to do.
  test::TempDir dir("media-image-paths");
  fs::create_directories(dir / "folder.png");
  ASSERT_EQ(::mkfifo((dir / "pipe.png").c_str(), 0600), 0);
  struct Case {
    fs::path path;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {dir / "folder.png", "is a directory"},
      {dir / "pipe.png", "not a regular file"},
      {"/dev/zero", "not a regular file"},
      {dir / "missing.png", "no such file"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.path.string());
    for (bool probe : {false, true}) {
      try {
        if (probe)
          probe_image_file(c.path);
        else
          load_image(c.path);
        ADD_FAILURE() << "expected a glmtune::Error";
      } catch (const Error& e) {
        EXPECT_EQ(e.where(), c.path.string());
        EXPECT_NE(e.problem().find(c.expect), std::string::npos) << e.what();
        EXPECT_FALSE(e.fix().empty()) << e.what();
      }
    }
  }
  // A file that cannot be opened (permissions do not stop the superuser).
  const fs::path locked = dir / "locked.png";
  std::ofstream(locked, std::ios::binary) << "x";
  fs::permissions(locked, fs::perms::none);
  if (::access(locked.c_str(), R_OK) != 0) {
    const std::string what = error_of([&] { load_image(locked); });
    EXPECT_NE(what.find("locked.png"), std::string::npos) << what;
    EXPECT_NE(what.find("cannot open"), std::string::npos) << what;
  }
}

TEST(MediaImage, CorruptedFilesNeverCrash) {
  // Fresh corruptions every run (seed printed): flipped bytes and cuts anywhere in every golden
  // file either decode or fail with a glmtune::Error; anything else (a crash, another exception
  // type) fails the test.
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  int decoded = 0, refused = 0;
  for (const std::string& name : golden_files()) {
    const auto original = read_bytes(kGolden + "/images/" + name);
    for (int trial = 0; trial < 12; ++trial) {
      std::vector<uint8_t> bytes = original;
      if (trial % 3 == 0) {
        bytes.resize(std::uniform_int_distribution<size_t>(0, bytes.size() - 1)(rng));
      } else {
        const int flips = 1 + int(rng() % 8);
        for (int f = 0; f < flips; ++f)
          bytes[std::uniform_int_distribution<size_t>(0, bytes.size() - 1)(rng)] = uint8_t(rng());
      }
      try {
        const RgbImage image = decode_image(bytes, name);
        EXPECT_EQ(image.pixels.size(), size_t(image.height * image.width * 3));
        ++decoded;
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
        ++refused;
      }
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(decoded + refused, 200);
}

TEST(MediaImage, PixelCapIsConfigurable) {
  DecodeOptions small;
  small.max_pixels = 800;  // each image below is larger (anim.gif, the smallest, is 36 x 24)
  for (const char* name : {"rgb_small.png", "photo.jpg", "lossy.webp", "anim.gif"}) {
    SCOPED_TRACE(name);
    const std::string what = error_of([&] { load_image(kGolden + "/images/" + name, small); });
    EXPECT_NE(what.find("more than the limit of 800"), std::string::npos) << what;
    EXPECT_NE(what.find(name), std::string::npos) << what;
  }
  small.max_pixels = 1961;  // rgb_small.png is 53 x 37 = 1961 pixels: at the limit is fine
  EXPECT_EQ(load_image(kGolden + "/images/rgb_small.png", small).width, 53);
}

}  // namespace
}  // namespace glmtune::data::media
