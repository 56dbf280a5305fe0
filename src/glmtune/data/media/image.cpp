#include "glmtune/data/media/image.h"

// clang-format off
#include <csetjmp>
#include <cstdio>  // jpeglib.h needs FILE and size_t declared first
#include <jpeglib.h>
#include <jerror.h>
// clang-format on
#include <fmt/format.h>
#include <gif_lib.h>
#include <libexif/exif-data.h>
#include <png.h>
#include <webp/decode.h>
#include <webp/demux.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <new>

#include "glmtune/base/error.h"

namespace glmtune::data::media {
namespace {

constexpr const char* kFormatsFix =
    "supported formats are JPEG, PNG, WebP and GIF; re-encode the image in one of them";

[[noreturn]] void fail(const std::string& source, const std::string& what,
                       const std::string& fix = {}) {
  throw Error(what, source, fix);
}

void check_pixel_cap(const std::string& source, uint64_t width, uint64_t height,
                     const DecodeOptions& options) {
  if (width == 0 || height == 0)
    fail(source, fmt::format("image has no pixels ({}x{})", width, height));
  // Both fit in 32 bits in every supported format, so the product cannot overflow.
  if (width * height > options.max_pixels)
    fail(source,
         fmt::format("image is {}x{} = {} pixels, more than the limit of {} (a decompression bomb "
                     "or an image far larger than any vision model input)",
                     width, height, width * height, options.max_pixels),
         "downscale the image, or raise DecodeOptions::max_pixels if it is genuine");
}

// ---- EXIF orientation ---------------------------------------------------------------------------

// PIL reads the orientation from IFD0 only and uses it only when it is a single integer; any other
// value (absent, a list, out of 2..8) leaves the image as stored.
int exif_orientation(const uint8_t* data, size_t size) {
  if (data == nullptr || size == 0) return 1;
  // libexif wants the "Exif\0\0" header that JPEG APP1 segments carry; PNG eXIf chunks (and some
  // WebP EXIF chunks) hold the bare TIFF structure.
  static const uint8_t header[6] = {'E', 'x', 'i', 'f', 0, 0};
  std::vector<uint8_t> buffer;
  if (size < 6 || std::memcmp(data, header, 6) != 0) {
    buffer.assign(header, header + 6);
    buffer.insert(buffer.end(), data, data + size);
    data = buffer.data();
    size = buffer.size();
  }
  ExifData* ed = exif_data_new();
  if (ed == nullptr) return 1;
  // Following the specification makes libexif add or "fix" entries on load; PIL reads the raw
  // values.
  exif_data_unset_option(ed, EXIF_DATA_OPTION_FOLLOW_SPECIFICATION);
  exif_data_load_data(ed, data, static_cast<unsigned int>(std::min<size_t>(size, 0xFFFFFFFFu)));
  int orientation = 1;
  ExifEntry* entry = exif_content_get_entry(ed->ifd[EXIF_IFD_0], EXIF_TAG_ORIENTATION);
  if (entry != nullptr && entry->components == 1 && entry->data != nullptr) {
    ExifByteOrder order = exif_data_get_byte_order(ed);
    long value = 0;
    switch (entry->format) {
      case EXIF_FORMAT_SHORT:
        if (entry->size >= 2) value = exif_get_short(entry->data, order);
        break;
      case EXIF_FORMAT_SSHORT:
        if (entry->size >= 2) value = exif_get_sshort(entry->data, order);
        break;
      case EXIF_FORMAT_LONG:
        if (entry->size >= 4) value = static_cast<long>(exif_get_long(entry->data, order));
        break;
      case EXIF_FORMAT_SLONG:
        if (entry->size >= 4) value = exif_get_slong(entry->data, order);
        break;
      case EXIF_FORMAT_BYTE:
        value = entry->data[0];
        break;
      default:
        break;
    }
    if (value >= 2 && value <= 8) orientation = static_cast<int>(value);
  }
  exif_data_unref(ed);
  return orientation;
}

void finish_info(ImageInfo& info, int orientation, const DecodeOptions& options) {
  info.orientation = options.apply_exif_orientation ? orientation : 1;
  bool swap = info.orientation >= 5;
  info.height = swap ? info.stored_width : info.stored_height;
  info.width = swap ? info.stored_height : info.stored_width;
}

// PIL's MULDIV255: a·b/255 rounded, in integer arithmetic.
inline int muldiv255(int a, int b) {
  int t = a * b + 128;
  return ((t >> 8) + t) >> 8;
}

// ---- JPEG (libjpeg-turbo)
// ------------------------------------------------------------------------

struct JpegErrorManager {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

void jpeg_error_exit(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<JpegErrorManager*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

void jpeg_emit_message(j_common_ptr cinfo, int level) {
  auto* err = reinterpret_cast<JpegErrorManager*>(cinfo->err);
  // Warnings (level -1) about corrupt but decodable data are ignored, as PIL ignores them. Running
  // out of data is not: libjpeg would pad the image with gray, PIL refuses a truncated file.
  if (level == -1 && cinfo->err->msg_code == JWRN_JPEG_EOF) {
    std::snprintf(err->message, sizeof(err->message), "the JPEG data is truncated");
    std::longjmp(err->jump, 1);
  }
}

void jpeg_output_message(j_common_ptr) {}

// Progressive JPEGs can hold thousands of tiny scans that each cost a pass over the coefficients:
// a small file could keep the decoder busy for minutes. Real encoders write at most a few dozen.
constexpr int kMaxJpegScans = 1000;

void jpeg_progress(j_common_ptr cinfo) {
  auto* d = reinterpret_cast<j_decompress_ptr>(cinfo);
  if (d->input_scan_number > kMaxJpegScans) {
    auto* err = reinterpret_cast<JpegErrorManager*>(cinfo->err);
    std::snprintf(err->message, sizeof(err->message),
                  "the JPEG has more than %d scans (a malformed or hostile progressive file)",
                  kMaxJpegScans);
    std::longjmp(err->jump, 1);
  }
}

struct JpegJob {
  const uint8_t* data;
  size_t size;
  bool header_only;
  const DecodeOptions* options;
  ImageInfo* info;
  RgbImage* out;   // stored orientation
  int components;  // 1, 3 or 4
  bool too_large;  // set instead of throwing inside the setjmp frame
  bool bad_components;
  int orientation;
};

// All libjpeg calls live here; the frame holds only trivially destructible objects so that a
// longjmp out of libjpeg skips no destructor. Returns false with `err.message` set on failure.
bool run_jpeg(JpegJob& job, jpeg_decompress_struct& cinfo, JpegErrorManager& err) {
  if (setjmp(err.jump)) return false;
  jpeg_mem_src(&cinfo, job.data, static_cast<unsigned long>(job.size));
  jpeg_save_markers(&cinfo, JPEG_APP0 + 1, 0xFFFF);
  jpeg_read_header(&cinfo, TRUE);
  job.info->stored_width = cinfo.image_width;
  job.info->stored_height = cinfo.image_height;
  job.components = cinfo.num_components;
  // PIL keeps the first APP1 segment that starts with "Exif\0\0".
  for (jpeg_saved_marker_ptr m = cinfo.marker_list; m != nullptr; m = m->next) {
    if (m->marker == JPEG_APP0 + 1 && m->data_length >= 6 &&
        std::memcmp(m->data, "Exif\0\0", 6) == 0) {
      job.orientation = exif_orientation(m->data, m->data_length);
      break;
    }
  }
  if (uint64_t(cinfo.image_width) * cinfo.image_height > job.options->max_pixels ||
      cinfo.image_width == 0 || cinfo.image_height == 0) {
    job.too_large = true;
    return true;
  }
  if (job.components != 1 && job.components != 3 && job.components != 4) {
    job.bad_components = true;
    return true;
  }
  if (job.header_only) return true;
  // The colour spaces PIL asks for: L, RGB (libjpeg converts YCbCr) and CMYK (libjpeg converts
  // YCCK). DCT method and upsampling stay at libjpeg's defaults (islow, fancy), as in PIL.
  cinfo.out_color_space =
      job.components == 1 ? JCS_GRAYSCALE : (job.components == 3 ? JCS_RGB : JCS_CMYK);
  jpeg_start_decompress(&cinfo);
  const size_t w = cinfo.output_width, h = cinfo.output_height;
  const int comps = cinfo.output_components;
  JSAMPARRAY row = (*cinfo.mem->alloc_sarray)(reinterpret_cast<j_common_ptr>(&cinfo), JPOOL_IMAGE,
                                              JDIMENSION(w * comps), 1);
  job.out->height = int64_t(h);
  job.out->width = int64_t(w);
  job.out->pixels.resize(w * h * 3);
  uint8_t* dst = job.out->pixels.data();
  while (cinfo.output_scanline < cinfo.output_height) {
    const size_t y = cinfo.output_scanline;
    if (jpeg_read_scanlines(&cinfo, row, 1) != 1) {
      std::snprintf(err.message, sizeof(err.message), "the decoder produced no scanline %zu", y);
      return false;
    }
    const uint8_t* src = row[0];
    uint8_t* line = dst + y * w * 3;
    if (comps == 1) {
      for (size_t x = 0; x < w; ++x) line[3 * x] = line[3 * x + 1] = line[3 * x + 2] = src[x];
    } else if (comps == 3) {
      std::memcpy(line, src, w * 3);
    } else {
      // PIL reads every CMYK JPEG as Adobe-inverted ("CMYK;I": v -> 255 - v), then converts
      // with cmyk2rgb: out = nk - nk·c/255 with nk = 255 - k.
      for (size_t x = 0; x < w; ++x) {
        const int c = 255 - src[4 * x], m = 255 - src[4 * x + 1], yy = 255 - src[4 * x + 2];
        const int nk = src[4 * x + 3];  // 255 - (255 - stored k)
        line[3 * x] = uint8_t(std::clamp(nk - muldiv255(c, nk), 0, 255));
        line[3 * x + 1] = uint8_t(std::clamp(nk - muldiv255(m, nk), 0, 255));
        line[3 * x + 2] = uint8_t(std::clamp(nk - muldiv255(yy, nk), 0, 255));
      }
    }
  }
  // jpeg_finish_decompress is skipped on purpose: it only reads the trailing markers, and a file
  // whose pixels are complete but whose EOI marker is missing decodes in PIL.
  return true;
}

RgbImage decode_jpeg(std::span<const uint8_t> bytes, const std::string& source,
                     const DecodeOptions& options, bool header_only, ImageInfo& info) {
  RgbImage out;
  jpeg_decompress_struct cinfo;
  JpegErrorManager err;
  std::memset(&err, 0, sizeof(err));
  cinfo.err = jpeg_std_error(&err.pub);
  err.pub.error_exit = jpeg_error_exit;
  err.pub.emit_message = jpeg_emit_message;
  err.pub.output_message = jpeg_output_message;
  jpeg_progress_mgr progress;
  progress.progress_monitor = jpeg_progress;
  JpegJob job{bytes.data(), bytes.size(), header_only, &options, &info, &out, 0, false, false, 1};
  volatile bool ok = false;
  if (setjmp(err.jump) == 0) {
    jpeg_create_decompress(&cinfo);
    cinfo.progress = &progress;
    ok = run_jpeg(job, cinfo, err);
  }
  jpeg_destroy_decompress(&cinfo);
  if (!ok) fail(source, fmt::format("cannot decode JPEG: {}", err.message));
  if (job.too_large)
    check_pixel_cap(source, uint64_t(info.stored_width), uint64_t(info.stored_height), options);
  if (job.bad_components)
    fail(source,
         fmt::format("JPEG with {} colour components is not supported (1, 3 or 4 are)",
                     job.components),
         kFormatsFix);
  finish_info(info, job.orientation, options);
  return out;
}

// ---- PNG (libpng)
// --------------------------------------------------------------------------------

struct PngReader {
  const uint8_t* data;
  size_t size;
  size_t pos;
  char message[256];
};

void png_read_callback(png_structp png, png_bytep out, png_size_t length) {
  auto* r = static_cast<PngReader*>(png_get_io_ptr(png));
  if (length > r->size - r->pos) png_error(png, "the PNG data is truncated");
  std::memcpy(out, r->data + r->pos, length);
  r->pos += length;
}

void png_error_callback(png_structp png, png_const_charp message) {
  auto* r = static_cast<PngReader*>(png_get_error_ptr(png));
  std::snprintf(r->message, sizeof(r->message), "%s", message);
  png_longjmp(png, 1);
}

void png_warning_callback(png_structp, png_const_charp) {}

struct PngJob {
  bool header_only;
  const DecodeOptions* options;
  ImageInfo* info;
  RgbImage* out;
  std::vector<uint8_t>* scratch;
  std::vector<png_bytep>* rows;
  bool too_large;
};

// The orientation of the first eXIf chunk, wherever it sits: PIL also finds one that follows the
// image data (it reads to IEND before answering getexif()). Walking the chunk list needs no
// decoding, so probing stays cheap.
int png_exif_orientation(std::span<const uint8_t> bytes) {
  size_t pos = 8;
  while (pos + 12 <= bytes.size()) {
    const uint32_t length = (uint32_t(bytes[pos]) << 24) | (uint32_t(bytes[pos + 1]) << 16) |
                            (uint32_t(bytes[pos + 2]) << 8) | uint32_t(bytes[pos + 3]);
    const uint8_t* type = &bytes[pos + 4];
    if (length > bytes.size() - pos - 12) break;
    if (std::memcmp(type, "eXIf", 4) == 0) return exif_orientation(&bytes[pos + 8], length);
    if (std::memcmp(type, "IEND", 4) == 0) break;
    pos += 12 + size_t(length);
  }
  return 1;
}

bool run_png(PngJob& job, png_structp png, png_infop info) {
  if (setjmp(png_jmpbuf(png))) return false;
  // libpng's own size limits would reject before our check with a less useful message.
  png_set_user_limits(png, 0x7fffffffL, 0x7fffffffL);
  png_read_info(png, info);
  png_uint_32 width = 0, height = 0;
  int bit_depth = 0, color_type = 0, interlace = 0;
  png_get_IHDR(png, info, &width, &height, &bit_depth, &color_type, &interlace, nullptr, nullptr);
  job.info->stored_width = width;
  job.info->stored_height = height;
  if (uint64_t(width) * height > job.options->max_pixels) {
    job.too_large = true;
    return true;
  }
  if (job.header_only) return true;

  // Palette look-up is done here rather than by libpng: PIL maps indices past the end of PLTE to
  // black, and libpng's expansion would read whatever follows the palette.
  uint8_t palette[256 * 3] = {};
  if (color_type == PNG_COLOR_TYPE_PALETTE) {
    png_colorp plte = nullptr;
    int count = 0;
    if (png_get_PLTE(png, info, &plte, &count) != 0 && plte != nullptr) {
      for (int i = 0; i < std::min(count, 256); ++i) {
        palette[3 * i] = plte[i].red;
        palette[3 * i + 1] = plte[i].green;
        palette[3 * i + 2] = plte[i].blue;
      }
    }
    png_set_packing(png);  // 1/2/4-bit indices to one byte each, values unchanged
  } else if ((color_type & PNG_COLOR_MASK_COLOR) == 0 && bit_depth < 8) {
    png_set_expand_gray_1_2_4_to_8(png);  // v · 255/(2^bits − 1), as PIL's L;1, L;2, L;4
  }
  const bool gray16 = color_type == PNG_COLOR_TYPE_GRAY && bit_depth == 16;
  // 16-bit samples keep their high byte (PIL's RGB;16B, RGBA;16B, LA;16B unpackers); 16-bit
  // grayscale is the exception, handled below.
  if (bit_depth == 16 && !gray16) png_set_strip_16(png);
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  const size_t rowbytes = png_get_rowbytes(png, info);
  const int channels = png_get_channels(png, info);
  job.scratch->resize(rowbytes * height);
  job.rows->resize(height);
  for (png_uint_32 y = 0; y < height; ++y) (*job.rows)[y] = job.scratch->data() + y * rowbytes;
  png_read_image(png, job.rows->data());
  // png_read_end is not called: chunks after the image data are not needed (the eXIf chunk is
  // found by png_exif_orientation), and PIL accepts a file whose trailing chunks are cut off.

  job.out->height = height;
  job.out->width = width;
  job.out->pixels.resize(size_t(width) * height * 3);
  for (png_uint_32 y = 0; y < height; ++y) {
    const uint8_t* src = (*job.rows)[y];
    uint8_t* dst = job.out->pixels.data() + size_t(y) * width * 3;
    for (png_uint_32 x = 0; x < width; ++x, dst += 3) {
      if (color_type == PNG_COLOR_TYPE_PALETTE) {
        std::memcpy(dst, palette + 3 * src[x], 3);
      } else if (gray16) {
        // PIL opens 16-bit grayscale as "I;16"; its conversion to RGB saturates at 255.
        const unsigned v = (unsigned(src[2 * x]) << 8) | src[2 * x + 1];
        dst[0] = dst[1] = dst[2] = uint8_t(std::min(v, 255u));
      } else if (channels <= 2) {
        dst[0] = dst[1] = dst[2] = src[channels * x];  // gray, alpha dropped
      } else {
        std::memcpy(dst, src + size_t(channels) * x, 3);  // RGB, alpha dropped
      }
    }
  }
  return true;
}

RgbImage decode_png(std::span<const uint8_t> bytes, const std::string& source,
                    const DecodeOptions& options, bool header_only, ImageInfo& info) {
  RgbImage out;
  std::vector<uint8_t> scratch;
  std::vector<png_bytep> rows;
  PngReader reader{bytes.data(), bytes.size(), 0, {}};
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &reader, png_error_callback,
                                           png_warning_callback);
  if (png == nullptr) fail(source, "cannot decode PNG: out of memory");
  png_infop pinfo = png_create_info_struct(png);
  PngJob job{header_only, &options, &info, &out, &scratch, &rows, false};
  bool ok = false;
  if (pinfo != nullptr) {
    png_set_read_fn(png, &reader, png_read_callback);
    ok = run_png(job, png, pinfo);
  } else {
    std::snprintf(reader.message, sizeof(reader.message), "out of memory");
  }
  png_destroy_read_struct(&png, &pinfo, nullptr);
  if (!ok) fail(source, fmt::format("cannot decode PNG: {}", reader.message));
  if (job.too_large)
    check_pixel_cap(source, uint64_t(info.stored_width), uint64_t(info.stored_height), options);
  finish_info(info, png_exif_orientation(bytes), options);
  return out;
}

// ---- WebP (libwebp, libwebpdemux)
// ----------------------------------------------------------------

RgbImage decode_webp(std::span<const uint8_t> bytes, const std::string& source,
                     const DecodeOptions& options, bool header_only, ImageInfo& info) {
  WebPBitstreamFeatures features;
  VP8StatusCode status = WebPGetFeatures(bytes.data(), bytes.size(), &features);
  if (status != VP8_STATUS_OK)
    fail(source, status == VP8_STATUS_NOT_ENOUGH_DATA ? "cannot decode WebP: the data is truncated"
                                                      : "cannot decode WebP: invalid header");
  check_pixel_cap(source, uint64_t(features.width), uint64_t(features.height), options);
  // Pillow decodes every WebP file, still or animated, with libwebp's animation decoder in
  // non-premultiplied RGBA; the first frame it returns is what convert("RGB") sees.
  WebPData data{bytes.data(), bytes.size()};
  WebPAnimDecoderOptions dec_options;
  if (!WebPAnimDecoderOptionsInit(&dec_options)) fail(source, "cannot decode WebP: libwebp ABI");
  dec_options.color_mode = MODE_RGBA;
  dec_options.use_threads = 0;
  std::unique_ptr<WebPAnimDecoder, void (*)(WebPAnimDecoder*)> dec(
      WebPAnimDecoderNew(&data, &dec_options), WebPAnimDecoderDelete);
  if (!dec) fail(source, "cannot decode WebP: corrupt or truncated file");
  WebPAnimInfo anim;
  if (!WebPAnimDecoderGetInfo(dec.get(), &anim)) fail(source, "cannot decode WebP: corrupt file");
  check_pixel_cap(source, anim.canvas_width, anim.canvas_height, options);
  info.stored_width = anim.canvas_width;
  info.stored_height = anim.canvas_height;
  int orientation = 1;
  if (const WebPDemuxer* demux = WebPAnimDecoderGetDemuxer(dec.get())) {
    WebPChunkIterator chunk;
    if (WebPDemuxGetChunk(demux, "EXIF", 1, &chunk)) {
      orientation = exif_orientation(chunk.chunk.bytes, chunk.chunk.size);
      WebPDemuxReleaseChunkIterator(&chunk);
    }
  }
  finish_info(info, orientation, options);
  RgbImage out;
  if (header_only) return out;
  uint8_t* rgba = nullptr;
  int timestamp = 0;
  if (!WebPAnimDecoderGetNext(dec.get(), &rgba, &timestamp) || rgba == nullptr)
    fail(source, "cannot decode WebP: corrupt or truncated image data");
  out.height = anim.canvas_height;
  out.width = anim.canvas_width;
  const size_t n = size_t(out.height) * size_t(out.width);
  out.pixels.resize(n * 3);
  for (size_t i = 0; i < n; ++i) std::memcpy(&out.pixels[3 * i], rgba + 4 * i, 3);
  return out;
}

// ---- GIF (giflib)
// --------------------------------------------------------------------------------

struct GifReader {
  const uint8_t* data;
  size_t size;
  size_t pos;
};

int gif_read_callback(GifFileType* gif, GifByteType* out, int length) {
  auto* r = static_cast<GifReader*>(gif->UserData);
  const size_t n = std::min(size_t(std::max(length, 0)), r->size - r->pos);
  std::memcpy(out, r->data + r->pos, n);
  r->pos += n;
  return int(n);
}

struct GifCloser {
  void operator()(GifFileType* gif) const {
    int error = 0;
    DGifCloseFile(gif, &error);
  }
};

[[noreturn]] void gif_fail(const std::string& source, int code) {
  const char* text = GifErrorString(code);
  fail(source, fmt::format("cannot decode GIF: {}", text != nullptr ? text : "unknown error"));
}

RgbImage decode_gif(std::span<const uint8_t> bytes, const std::string& source,
                    const DecodeOptions& options, bool header_only, ImageInfo& info) {
  GifReader reader{bytes.data(), bytes.size(), 0};
  int error = 0;
  std::unique_ptr<GifFileType, GifCloser> gif(DGifOpen(&reader, gif_read_callback, &error));
  if (!gif) gif_fail(source, error);
  int transparency = -1;
  for (;;) {
    GifRecordType type;
    if (DGifGetRecordType(gif.get(), &type) == GIF_ERROR) gif_fail(source, gif->Error);
    if (type == TERMINATE_RECORD_TYPE) fail(source, "cannot decode GIF: the file holds no image");
    if (type == EXTENSION_RECORD_TYPE) {
      int code = 0;
      GifByteType* block = nullptr;
      if (DGifGetExtension(gif.get(), &code, &block) == GIF_ERROR) gif_fail(source, gif->Error);
      // Graphic control extension: PIL takes the transparent index of any such block before the
      // first image (a later block without one does not clear it).
      if (code == GRAPHICS_EXT_FUNC_CODE && block != nullptr && block[0] >= 4 && (block[1] & 1))
        transparency = block[4];
      while (block != nullptr) {
        if (DGifGetExtensionNext(gif.get(), &block) == GIF_ERROR) gif_fail(source, gif->Error);
      }
      continue;
    }
    if (type != IMAGE_DESC_RECORD_TYPE) continue;
    if (DGifGetImageDesc(gif.get()) == GIF_ERROR) gif_fail(source, gif->Error);
    break;
  }
  const GifImageDesc& desc = gif->Image;
  const int64_t left = desc.Left, top = desc.Top, fw = desc.Width, fh = desc.Height;
  // PIL grows the screen to hold a first frame that extends past it.
  const int64_t width = std::max<int64_t>(gif->SWidth, left + fw);
  const int64_t height = std::max<int64_t>(gif->SHeight, top + fh);
  check_pixel_cap(source, uint64_t(width), uint64_t(height), options);
  info.stored_width = width;
  info.stored_height = height;
  finish_info(info, 1, options);  // GIF carries no EXIF
  RgbImage out;
  if (header_only) return out;

  const ColorMapObject* map = desc.ColorMap != nullptr ? desc.ColorMap : gif->SColorMap;
  // PIL treats a palette whose entry i is (i, i, i) for every i as no palette (mode "L"), so the
  // index itself is the gray value, also past the palette's end; otherwise indices past the end
  // give black.
  uint8_t lut[256 * 3] = {};
  bool identity = true;
  if (map != nullptr) {
    for (int i = 0; i < map->ColorCount; ++i) {
      const GifColorType& c = map->Colors[i];
      if (!(c.Red == i && c.Green == i && c.Blue == i)) identity = false;
    }
  }
  for (int i = 0; i < 256; ++i) {
    if (map == nullptr || identity) {
      lut[3 * i] = lut[3 * i + 1] = lut[3 * i + 2] = uint8_t(i);
    } else if (i < map->ColorCount) {
      lut[3 * i] = map->Colors[i].Red;
      lut[3 * i + 1] = map->Colors[i].Green;
      lut[3 * i + 2] = map->Colors[i].Blue;
    }
  }
  // The first frame is drawn on a canvas of its transparent index (or index 0).
  std::vector<uint8_t> indices(size_t(width) * size_t(height),
                               uint8_t(transparency >= 0 ? transparency : 0));
  std::vector<GifPixelType> line(size_t(std::max<int64_t>(fw, 1)));
  auto read_row = [&](int64_t row) {
    if (DGifGetLine(gif.get(), line.data(), int(fw)) == GIF_ERROR) gif_fail(source, gif->Error);
    std::memcpy(&indices[size_t(top + row) * size_t(width) + size_t(left)], line.data(),
                size_t(fw));
  };
  if (desc.Interlace) {
    static const int start[4] = {0, 4, 2, 1}, step[4] = {8, 8, 4, 2};
    for (int pass = 0; pass < 4; ++pass)
      for (int64_t row = start[pass]; row < fh; row += step[pass]) read_row(row);
  } else {
    for (int64_t row = 0; row < fh; ++row) read_row(row);
  }
  out.height = height;
  out.width = width;
  out.pixels.resize(indices.size() * 3);
  for (size_t i = 0; i < indices.size(); ++i)
    std::memcpy(&out.pixels[3 * i], lut + 3 * indices[i], 3);
  return out;
}

RgbImage decode_any(std::span<const uint8_t> bytes, const std::string& source,
                    const DecodeOptions& options, bool header_only, ImageInfo& info) {
  if (bytes.empty()) fail(source, "the image file is empty");
  info.format = sniff_image_format(bytes);
  switch (info.format) {
    case ImageFormat::jpeg:
      return decode_jpeg(bytes, source, options, header_only, info);
    case ImageFormat::png:
      return decode_png(bytes, source, options, header_only, info);
    case ImageFormat::webp:
      return decode_webp(bytes, source, options, header_only, info);
    case ImageFormat::gif:
      return decode_gif(bytes, source, options, header_only, info);
    case ImageFormat::unknown:
      break;
  }
  fail(source, "unknown image format (the first bytes match no JPEG, PNG, WebP or GIF signature)",
       kFormatsFix);
}

std::vector<uint8_t> read_file(const std::filesystem::path& path) {
  const std::string source = path.string();
  const uint64_t size = media_file_size(path, "an image file");
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"),
                                                       &std::fclose);
  if (!file)
    fail(source, fmt::format("cannot open the image file: {}", std::strerror(errno)),
         "check that the file is readable (its permissions)");
  std::vector<uint8_t> bytes;
  try {
    bytes.resize(size_t(size));
  } catch (const std::bad_alloc&) {
    fail(source, fmt::format("the image file is {} bytes, too large to read into memory", size),
         "check that the path names an image, not some other large file");
  }
  // Reads what is there: a file that shrank since the size was taken ends early, not in garbage.
  const size_t got = std::fread(bytes.data(), 1, bytes.size(), file.get());
  if (std::ferror(file.get()))
    fail(source, fmt::format("cannot read the image file: {}", std::strerror(errno)),
         "check the file and the disk it is on (an I/O error)");
  bytes.resize(got);
  return bytes;
}

}  // namespace

uint64_t media_file_size(const std::filesystem::path& path, const std::string& expected) {
  namespace fs = std::filesystem;
  const std::string source = path.string();
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (status.type() == fs::file_type::not_found)
    fail(source, "no such file",
         "check the path (relative paths resolve against the media root or the data's folder)");
  if (ec)
    fail(source, fmt::format("cannot read the file: {}", ec.message()),
         "check the path and the permissions of its folders");
  if (status.type() == fs::file_type::directory)
    fail(source, fmt::format("is a directory; {} was expected", expected),
         "name the file inside the folder, not the folder itself");
  // A FIFO would block the open, a device would be read without end.
  if (status.type() != fs::file_type::regular)
    fail(source,
         fmt::format("is not a regular file (a device, pipe or socket); {} was expected", expected),
         "copy the data into a regular file and name that");
  const uintmax_t size = fs::file_size(path, ec);
  if (ec)
    fail(source, fmt::format("cannot read the file's size: {}", ec.message()),
         "check the path and the permissions of its folders");
  return uint64_t(size);
}

const char* to_string(ImageFormat format) {
  switch (format) {
    case ImageFormat::jpeg:
      return "jpeg";
    case ImageFormat::png:
      return "png";
    case ImageFormat::webp:
      return "webp";
    case ImageFormat::gif:
      return "gif";
    case ImageFormat::unknown:
      break;
  }
  return "unknown";
}

ImageFormat sniff_image_format(std::span<const uint8_t> b) {
  auto starts = [&](std::initializer_list<uint8_t> sig, size_t at = 0) {
    if (b.size() < at + sig.size()) return false;
    return std::equal(sig.begin(), sig.end(), b.begin() + at);
  };
  if (starts({0xFF, 0xD8, 0xFF})) return ImageFormat::jpeg;
  if (starts({0x89, 'P', 'N', 'G', 0x0D, 0x0A, 0x1A, 0x0A})) return ImageFormat::png;
  if (starts({'R', 'I', 'F', 'F'}) && starts({'W', 'E', 'B', 'P'}, 8)) return ImageFormat::webp;
  if (starts({'G', 'I', 'F', '8', '7', 'a'}) || starts({'G', 'I', 'F', '8', '9', 'a'}))
    return ImageFormat::gif;
  return ImageFormat::unknown;
}

RgbImage apply_orientation(const RgbImage& image, int orientation) {
  if (orientation < 2 || orientation > 8) return image;
  const int64_t h = image.height, w = image.width;
  const bool swap = orientation >= 5;
  RgbImage out;
  out.height = swap ? w : h;
  out.width = swap ? h : w;
  out.pixels.resize(image.pixels.size());
  for (int64_t y = 0; y < out.height; ++y) {
    for (int64_t x = 0; x < out.width; ++x) {
      int64_t sy = 0, sx = 0;  // source pixel of output (y, x), PIL's Image.Transpose semantics
      switch (orientation) {
        case 2:  // FLIP_LEFT_RIGHT
          sy = y;
          sx = w - 1 - x;
          break;
        case 3:  // ROTATE_180
          sy = h - 1 - y;
          sx = w - 1 - x;
          break;
        case 4:  // FLIP_TOP_BOTTOM
          sy = h - 1 - y;
          sx = x;
          break;
        case 5:  // TRANSPOSE
          sy = x;
          sx = y;
          break;
        case 6:  // ROTATE_270 (90° clockwise)
          sy = h - 1 - x;
          sx = y;
          break;
        case 7:  // TRANSVERSE
          sy = h - 1 - x;
          sx = w - 1 - y;
          break;
        case 8:  // ROTATE_90 (90° counter-clockwise)
          sy = x;
          sx = w - 1 - y;
          break;
      }
      std::memcpy(&out.pixels[size_t(y * out.width + x) * 3],
                  &image.pixels[size_t(sy * w + sx) * 3], 3);
    }
  }
  return out;
}

RgbImage decode_image(std::span<const uint8_t> bytes, const std::string& source,
                      const DecodeOptions& options) {
  ImageInfo info;
  RgbImage image = decode_any(bytes, source, options, false, info);
  if (info.orientation != 1) image = apply_orientation(image, info.orientation);
  return image;
}

ImageInfo probe_image(std::span<const uint8_t> bytes, const std::string& source,
                      const DecodeOptions& options) {
  ImageInfo info;
  decode_any(bytes, source, options, true, info);
  return info;
}

RgbImage load_image(const std::filesystem::path& path, const DecodeOptions& options) {
  const std::vector<uint8_t> bytes = read_file(path);
  return decode_image(bytes, path.string(), options);
}

ImageInfo probe_image_file(const std::filesystem::path& path, const DecodeOptions& options) {
  const std::vector<uint8_t> bytes = read_file(path);
  return probe_image(bytes, path.string(), options);
}

}  // namespace glmtune::data::media
