#include "glmtune/train/plot.h"

#include <fmt/format.h>
#include <png.h>

#include <algorithm>
#include <cmath>
#include <csetjmp>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <tuple>

#include "glmtune/base/error.h"

namespace glmtune::train {
namespace {

namespace fs = std::filesystem;

// 5x7 glyphs of ASCII 32..126, one byte per row, bit 4 the leftmost column.
constexpr uint8_t kFont[95][7] = {
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00},  // ' '
    {0x04, 0x04, 0x04, 0x04, 0x04, 0x00, 0x04},  // '!'
    {0x0a, 0x0a, 0x00, 0x00, 0x00, 0x00, 0x00},  // '"'
    {0x0a, 0x0a, 0x1f, 0x0a, 0x1f, 0x0a, 0x0a},  // '#'
    {0x04, 0x0f, 0x14, 0x0e, 0x05, 0x1e, 0x04},  // '$'
    {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03},  // '%'
    {0x0c, 0x12, 0x14, 0x08, 0x15, 0x12, 0x0d},  // '&'
    {0x04, 0x04, 0x00, 0x00, 0x00, 0x00, 0x00},  // "'"
    {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02},  // '('
    {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08},  // ')'
    {0x00, 0x04, 0x15, 0x0e, 0x15, 0x04, 0x00},  // '*'
    {0x00, 0x04, 0x04, 0x1f, 0x04, 0x04, 0x00},  // '+'
    {0x00, 0x00, 0x00, 0x00, 0x0c, 0x04, 0x08},  // ','
    {0x00, 0x00, 0x00, 0x1f, 0x00, 0x00, 0x00},  // '-'
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x0c, 0x0c},  // '.'
    {0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00},  // '/'
    {0x0e, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0e},  // '0'
    {0x04, 0x0c, 0x04, 0x04, 0x04, 0x04, 0x0e},  // '1'
    {0x0e, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1f},  // '2'
    {0x1f, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0e},  // '3'
    {0x02, 0x06, 0x0a, 0x12, 0x1f, 0x02, 0x02},  // '4'
    {0x1f, 0x10, 0x1e, 0x01, 0x01, 0x11, 0x0e},  // '5'
    {0x06, 0x08, 0x10, 0x1e, 0x11, 0x11, 0x0e},  // '6'
    {0x1f, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08},  // '7'
    {0x0e, 0x11, 0x11, 0x0e, 0x11, 0x11, 0x0e},  // '8'
    {0x0e, 0x11, 0x11, 0x0f, 0x01, 0x02, 0x0c},  // '9'
    {0x00, 0x0c, 0x0c, 0x00, 0x0c, 0x0c, 0x00},  // ':'
    {0x00, 0x0c, 0x0c, 0x00, 0x0c, 0x04, 0x08},  // ';'
    {0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02},  // '<'
    {0x00, 0x00, 0x1f, 0x00, 0x1f, 0x00, 0x00},  // '='
    {0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08},  // '>'
    {0x0e, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04},  // '?'
    {0x0e, 0x11, 0x01, 0x0d, 0x15, 0x15, 0x0e},  // '@'
    {0x0e, 0x11, 0x11, 0x1f, 0x11, 0x11, 0x11},  // 'A'
    {0x1e, 0x11, 0x11, 0x1e, 0x11, 0x11, 0x1e},  // 'B'
    {0x0e, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0e},  // 'C'
    {0x1c, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1c},  // 'D'
    {0x1f, 0x10, 0x10, 0x1e, 0x10, 0x10, 0x1f},  // 'E'
    {0x1f, 0x10, 0x10, 0x1e, 0x10, 0x10, 0x10},  // 'F'
    {0x0e, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0f},  // 'G'
    {0x11, 0x11, 0x11, 0x1f, 0x11, 0x11, 0x11},  // 'H'
    {0x0e, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0e},  // 'I'
    {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0c},  // 'J'
    {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11},  // 'K'
    {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1f},  // 'L'
    {0x11, 0x1b, 0x15, 0x15, 0x11, 0x11, 0x11},  // 'M'
    {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11},  // 'N'
    {0x0e, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0e},  // 'O'
    {0x1e, 0x11, 0x11, 0x1e, 0x10, 0x10, 0x10},  // 'P'
    {0x0e, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0d},  // 'Q'
    {0x1e, 0x11, 0x11, 0x1e, 0x14, 0x12, 0x11},  // 'R'
    {0x0f, 0x10, 0x10, 0x0e, 0x01, 0x01, 0x1e},  // 'S'
    {0x1f, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04},  // 'T'
    {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0e},  // 'U'
    {0x11, 0x11, 0x11, 0x11, 0x11, 0x0a, 0x04},  // 'V'
    {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0a},  // 'W'
    {0x11, 0x11, 0x0a, 0x04, 0x0a, 0x11, 0x11},  // 'X'
    {0x11, 0x11, 0x0a, 0x04, 0x04, 0x04, 0x04},  // 'Y'
    {0x1f, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1f},  // 'Z'
    {0x0e, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0e},  // '['
    {0x00, 0x10, 0x08, 0x04, 0x02, 0x01, 0x00},  // '\\'
    {0x0e, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0e},  // ']'
    {0x04, 0x0a, 0x11, 0x00, 0x00, 0x00, 0x00},  // '^'
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1f},  // '_'
    {0x08, 0x04, 0x00, 0x00, 0x00, 0x00, 0x00},  // '`'
    {0x00, 0x00, 0x0e, 0x01, 0x0f, 0x11, 0x0f},  // 'a'
    {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1e},  // 'b'
    {0x00, 0x00, 0x0e, 0x10, 0x10, 0x11, 0x0e},  // 'c'
    {0x01, 0x01, 0x0d, 0x13, 0x11, 0x11, 0x0f},  // 'd'
    {0x00, 0x00, 0x0e, 0x11, 0x1f, 0x10, 0x0e},  // 'e'
    {0x06, 0x09, 0x08, 0x1c, 0x08, 0x08, 0x08},  // 'f'
    {0x00, 0x0f, 0x11, 0x11, 0x0f, 0x01, 0x0e},  // 'g'
    {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11},  // 'h'
    {0x04, 0x00, 0x0c, 0x04, 0x04, 0x04, 0x0e},  // 'i'
    {0x02, 0x00, 0x06, 0x02, 0x02, 0x12, 0x0c},  // 'j'
    {0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12},  // 'k'
    {0x0c, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0e},  // 'l'
    {0x00, 0x00, 0x1a, 0x15, 0x15, 0x11, 0x11},  // 'm'
    {0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11},  // 'n'
    {0x00, 0x00, 0x0e, 0x11, 0x11, 0x11, 0x0e},  // 'o'
    {0x00, 0x00, 0x1e, 0x11, 0x1e, 0x10, 0x10},  // 'p'
    {0x00, 0x00, 0x0d, 0x13, 0x0f, 0x01, 0x01},  // 'q'
    {0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10},  // 'r'
    {0x00, 0x00, 0x0e, 0x10, 0x0e, 0x01, 0x1e},  // 's'
    {0x08, 0x08, 0x1c, 0x08, 0x08, 0x09, 0x06},  // 't'
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0d},  // 'u'
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x0a, 0x04},  // 'v'
    {0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0a},  // 'w'
    {0x00, 0x00, 0x11, 0x0a, 0x04, 0x0a, 0x11},  // 'x'
    {0x00, 0x00, 0x11, 0x11, 0x0f, 0x01, 0x0e},  // 'y'
    {0x00, 0x00, 0x1f, 0x02, 0x04, 0x08, 0x1f},  // 'z'
    {0x02, 0x04, 0x04, 0x08, 0x04, 0x04, 0x02},  // '{'
    {0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04},  // '|'
    {0x08, 0x04, 0x04, 0x02, 0x04, 0x04, 0x08},  // '}'
    {0x00, 0x00, 0x08, 0x15, 0x02, 0x00, 0x00},  // '~'
};
constexpr int kGlyphW = 5, kGlyphH = 7;

constexpr Rgb kWhite{255, 255, 255};
constexpr Rgb kText{40, 40, 40};
constexpr Rgb kAxis{90, 90, 90};
constexpr Rgb kGrid{228, 228, 228};

class Canvas {
 public:
  Canvas(int width, int height) {
    image_.width = width;
    image_.height = height;
    image_.rgb.assign(size_t(width) * size_t(height) * 3, 255);
  }
  Image take() { return std::move(image_); }

  void set(int x, int y, Rgb c) {
    if (x < 0 || y < 0 || x >= image_.width || y >= image_.height) return;
    const size_t i = (size_t(y) * size_t(image_.width) + size_t(x)) * 3;
    image_.rgb[i] = c.r;
    image_.rgb[i + 1] = c.g;
    image_.rgb[i + 2] = c.b;
  }
  void fill(int x0, int y0, int x1, int y1, Rgb c) {
    for (int y = y0; y <= y1; ++y)
      for (int x = x0; x <= x1; ++x) set(x, y, c);
  }
  // A line `thickness` pixels wide (Bresenham, each point drawn as a square).
  void line(int x0, int y0, int x1, int y1, Rgb c, int thickness = 1) {
    const int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0);
    const int sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
    const int lo = -(thickness - 1) / 2, hi = thickness / 2;
    int err = dx + dy;
    for (;;) {
      fill(x0 + lo, y0 + lo, x0 + hi, y0 + hi, c);
      if (x0 == x1 && y0 == y1) break;
      const int e2 = 2 * err;
      if (e2 >= dy) err += dy, x0 += sx;
      if (e2 <= dx) err += dx, y0 += sy;
    }
  }
  void dashed_vline(int x, int y0, int y1, Rgb c) {
    for (int y = y0; y <= y1; ++y)
      if ((y - y0) % 8 < 5) set(x, y, c);
  }

  static int text_width(const std::string& s, int scale) {
    return s.empty() ? 0 : int(s.size()) * (kGlyphW + 1) * scale - scale;
  }
  static int text_height(int scale) { return kGlyphH * scale; }
  // Text with its top-left corner at (x, y); characters outside ASCII print as '?'.
  void text(int x, int y, const std::string& s, Rgb c, int scale) {
    for (const char ch : s) {
      const int code = (ch >= 32 && ch < 127) ? ch : '?';
      const uint8_t* rows = kFont[code - 32];
      for (int r = 0; r < kGlyphH; ++r)
        for (int col = 0; col < kGlyphW; ++col)
          if (rows[r] & (1 << (kGlyphW - 1 - col)))
            fill(x + col * scale, y + r * scale, x + (col + 1) * scale - 1, y + (r + 1) * scale - 1,
                 c);
      x += (kGlyphW + 1) * scale;
    }
  }

 private:
  Image image_;
};

// Tick positions at 1, 2 or 5 times a power of ten, about `target` of them over [lo, hi].
std::vector<double> nice_ticks(double lo, double hi, int target) {
  const double raw = (hi - lo) / std::max(1, target);
  if (!(raw > 0) || !std::isfinite(raw)) return {};
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (const double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  std::vector<double> ticks;
  for (double t = std::ceil(lo / step - 1e-9) * step; t <= hi + step * 1e-9; t += step)
    ticks.push_back(std::abs(t) < step * 1e-9 ? 0.0 : t);
  return ticks;
}

std::string tick_label(double v) {
  if (v != 0 && (std::abs(v) >= 1e6 || std::abs(v) < 1e-3)) return fmt::format("{:.3g}", v);
  std::string s = fmt::format("{:.6f}", v);
  s.erase(s.find_last_not_of('0') + 1);
  if (s.back() == '.') s.pop_back();
  return s;
}

// The value range a panel shows: the data's, padded by 5%, never empty.
std::pair<double, double> padded_range(double lo, double hi) {
  if (!(lo <= hi)) return {0.0, 1.0};
  if (hi - lo < 1e-12 * std::max(1.0, std::abs(hi))) {
    const double half = std::max(0.5, std::abs(hi) * 0.1);
    return {lo - half, hi + half};
  }
  const double pad = (hi - lo) * 0.05;
  return {lo - pad, hi + pad};
}

constexpr int kScale = 2;  // glyph pixels per font pixel

void draw_axes(Canvas& c, const PlotLayout& layout, const PanelLayout& p, const std::string& label,
               bool step_labels) {
  for (const double t : nice_ticks(p.y_min, p.y_max, 5)) {
    const int y = p.y_of(t);
    if (y < p.top || y > p.bottom) continue;
    c.line(p.left, y, p.right, y, kGrid);
    c.line(p.left - 6, y, p.left - 1, y, kAxis);
    const std::string s = tick_label(t);
    c.text(p.left - 10 - Canvas::text_width(s, kScale), y - Canvas::text_height(kScale) / 2, s,
           kText, kScale);
  }
  const double span = double(layout.step_max - layout.step_min);
  for (double t : nice_ticks(double(layout.step_min), double(layout.step_max), 8)) {
    if (span >= 8) t = std::round(t);  // steps are integers; fractional ticks only when zoomed in
    const int x = layout.x_of(t);
    if (x < p.left || x > p.right) continue;
    c.line(x, p.top, x, p.bottom, kGrid);
    c.line(x, p.bottom + 1, x, p.bottom + 6, kAxis);
    if (step_labels) {
      const std::string s = tick_label(t);
      c.text(x - Canvas::text_width(s, kScale) / 2, p.bottom + 10, s, kText, kScale);
    }
  }
  c.line(p.left, p.top, p.left, p.bottom, kAxis, 2);
  c.line(p.left, p.bottom, p.right, p.bottom, kAxis, 2);
  c.text(p.left, p.top - Canvas::text_height(kScale) - 8, label, kText, kScale);
}

// A polyline through the finite points, broken where a value is missing; lone points get a dot.
void draw_series(Canvas& c, const PlotLayout& layout, const PanelLayout& p,
                 const std::vector<MetricsRecord>& records,
                 const std::function<std::optional<double>(const MetricsRecord&)>& value,
                 Rgb colour) {
  std::optional<std::pair<int, int>> prev;
  for (size_t i = 0; i < records.size(); ++i) {
    const std::optional<double> v = value(records[i]);
    if (!v || !std::isfinite(*v)) {
      prev.reset();
      continue;
    }
    const int x = layout.x_of(double(records[i].step));
    const int y = std::clamp(p.y_of(*v), p.top, p.bottom);
    if (prev) {
      c.line(prev->first, prev->second, x, y, colour, 2);
    } else {
      const bool next_drawn = i + 1 < records.size() && value(records[i + 1]).has_value() &&
                              std::isfinite(*value(records[i + 1]));
      if (!next_drawn) c.fill(x - 2, y - 2, x + 2, y + 2, colour);
    }
    prev = {x, y};
  }
}

void legend(Canvas& c, const PanelLayout& p,
            const std::vector<std::pair<std::string, Rgb>>& items) {
  int width = 0;
  for (const auto& [s, _] : items) width = std::max(width, Canvas::text_width(s, kScale));
  const int row = Canvas::text_height(kScale) + 8;
  const int x0 = p.right - width - 44, y0 = p.top + 10;
  c.fill(x0 - 8, y0 - 6, p.right - 6, y0 + row * int(items.size()), kWhite);
  for (size_t i = 0; i < items.size(); ++i) {
    const int y = y0 + row * int(i);
    c.fill(x0, y + 4, x0 + 22, y + 9, items[i].second);
    c.text(x0 + 30, y, items[i].first, kText, kScale);
  }
}

[[noreturn]] void png_fail(png_structp png, png_const_charp) { png_longjmp(png, 1); }

void png_append(png_structp png, png_bytep data, png_size_t size) {
  static_cast<std::string*>(png_get_io_ptr(png))->append(reinterpret_cast<const char*>(data), size);
}

// Encodes into `out`; false when libpng reported an error (it longjmps back here, so nothing in
// this frame is modified after setjmp).
bool write_rows(png_structp png, png_infop info, const Image& image, png_bytepp rows,
                std::string* out) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_set_write_fn(png, out, png_append, nullptr);
  png_set_IHDR(png, info, png_uint_32(image.width), png_uint_32(image.height), 8,
               PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  png_write_image(png, rows);
  png_write_end(png, nullptr);
  return true;
}

}  // namespace

int PanelLayout::y_of(double value) const {
  return int(
      std::lround(double(bottom) - (value - y_min) / (y_max - y_min) * double(bottom - top)));
}

int PlotLayout::x_of(double step) const {
  const double span = double(step_max - step_min);
  return int(std::lround(double(loss.left) +
                         (step - double(step_min)) / span * double(loss.right - loss.left)));
}

std::vector<MetricsRecord> read_metrics_file(const fs::path& file) {
  const std::string fix =
      "give the metrics.jsonl that glmtune train writes into its output directory";
  std::ifstream in(file, std::ios::binary);
  if (!fs::is_regular_file(file) || !in)
    throw Error("no metrics file", file.string(),
                "point glmtune plot at a training run's output directory (it holds metrics.jsonl)");
  std::vector<MetricsRecord> records;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("{}:{}", file.string(), n);
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object())
      throw Error("the line is not a JSON object", where, fix);
    if (!j.contains("step") || !j["step"].is_number_integer())
      throw Error("the record has no integer \"step\"", where, fix);
    MetricsRecord r;
    r.step = j["step"].get<int64_t>();
    auto number = [&](const char* key) -> std::optional<double> {
      if (!j.contains(key) || j[key].is_null()) return std::nullopt;
      if (!j[key].is_number())
        throw Error(fmt::format("\"{}\" is {}, expected a number or null", key, j[key].dump()),
                    where, fix);
      return j[key].get<double>();
    };
    if (!j.contains("loss")) throw Error("the record has no \"loss\"", where, fix);
    r.loss = number("loss");
    r.mtp_loss = number("mtp_loss");
    r.tgs = number("tgs").value_or(0.0);
    if (j.contains("skipped")) {
      if (!j["skipped"].is_boolean())
        throw Error(fmt::format("\"skipped\" is {}, expected true or false", j["skipped"].dump()),
                    where, fix);
      r.skipped = j["skipped"].get<bool>();
    }
    records.push_back(r);
  }
  if (records.empty())
    throw Error("the metrics file holds no step", file.string(),
                "plot a run that has completed at least one step");
  std::stable_sort(records.begin(), records.end(),
                   [](const MetricsRecord& a, const MetricsRecord& b) { return a.step < b.step; });
  return records;
}

Plot render_metrics_plot(const std::vector<MetricsRecord>& records, const PlotOptions& options) {
  GLMTUNE_ASSERT(!records.empty(), "nothing to plot");
  if (options.width < 320 || options.height < 240)
    throw Error(
        fmt::format("a plot of {} x {} pixels is too small to read", options.width, options.height),
        "glmtune plot", "use at least 320 x 240 (the default is 1200 x 800)");
  const size_t colours = std::size(kCompareColours);
  if (options.compare.size() > colours)
    throw Error(fmt::format("{} runs to compare; one plot draws at most {} over the first",
                            options.compare.size(), colours),
                "glmtune plot --compare", "compare fewer runs at a time");
  Plot plot;
  PlotLayout& L = plot.layout;
  L.step_min = records.front().step;
  L.step_max = records.back().step;
  for (const ComparedRun& run : options.compare) {
    GLMTUNE_ASSERT(!run.records.empty(), "nothing to plot for {}", run.name);
    L.step_min = std::min(L.step_min, run.records.front().step);
    L.step_max = std::max(L.step_max, run.records.back().step);
  }
  if (L.step_max == L.step_min) L.step_min -= 1, L.step_max += 1;

  const bool has_mtp = std::any_of(records.begin(), records.end(), [](const MetricsRecord& r) {
    return r.mtp_loss && std::isfinite(*r.mtp_loss) && *r.mtp_loss != 0;
  });
  double lo = INFINITY, hi = -INFINITY, t_lo = INFINITY, t_hi = -INFINITY;
  for (const MetricsRecord& r : records) {
    for (const std::optional<double>& v : {r.loss, has_mtp ? r.mtp_loss : std::nullopt})
      if (v && std::isfinite(*v)) lo = std::min(lo, *v), hi = std::max(hi, *v);
    if (std::isfinite(r.tgs)) t_lo = std::min(t_lo, r.tgs), t_hi = std::max(t_hi, r.tgs);
  }
  for (const ComparedRun& run : options.compare)
    for (const MetricsRecord& r : run.records) {
      if (r.loss && std::isfinite(*r.loss)) lo = std::min(lo, *r.loss), hi = std::max(hi, *r.loss);
      if (std::isfinite(r.tgs)) t_lo = std::min(t_lo, r.tgs), t_hi = std::max(t_hi, r.tgs);
    }
  std::tie(L.loss.y_min, L.loss.y_max) = padded_range(lo, hi);
  // Throughput from 0, so that its level reads at a glance.
  if (t_lo >= 0 && t_hi > 0)
    L.throughput.y_min = 0, L.throughput.y_max = t_hi * 1.05;
  else
    std::tie(L.throughput.y_min, L.throughput.y_max) = padded_range(t_lo, t_hi);

  const int W = options.width, H = options.height;
  const int title_h = Canvas::text_height(kScale) + 24, label_h = Canvas::text_height(kScale) + 12;
  const int left = 20 + Canvas::text_width("0.000000", kScale), right = W - 30;
  const int usable = H - title_h - 3 * label_h - 50;
  L.loss.left = L.throughput.left = left;
  L.loss.right = L.throughput.right = right;
  L.loss.top = title_h + label_h;
  L.loss.bottom = L.loss.top + usable * 3 / 5;
  L.throughput.top = L.loss.bottom + 2 * label_h + 10;
  L.throughput.bottom = H - label_h - 40;

  Canvas c(W, H);
  std::string title = options.title.empty() ? std::string("training run") : options.title;
  title += fmt::format("  (steps {}-{})", records.front().step, records.back().step);
  c.text((W - Canvas::text_width(title, kScale)) / 2, 12, title, kText, kScale);
  draw_axes(c, L, L.loss, has_mtp ? "loss, mtp_loss" : "loss", false);
  draw_axes(c, L, L.throughput, "tokens/s (tgs)", true);
  const std::string xlabel = "step";
  c.text((left + right - Canvas::text_width(xlabel, kScale)) / 2,
         H - Canvas::text_height(kScale) - 8, xlabel, kText, kScale);

  int64_t skipped = 0;
  for (const MetricsRecord& r : records) {
    if (!r.skipped) continue;
    ++skipped;
    const int x = L.x_of(double(r.step));
    c.dashed_vline(x, L.loss.top, L.loss.bottom, kSkippedColour);
    c.dashed_vline(x, L.throughput.top, L.throughput.bottom, kSkippedColour);
  }
  draw_series(
      c, L, L.loss, records, [](const MetricsRecord& r) { return r.loss; }, kLossColour);
  if (has_mtp)
    draw_series(
        c, L, L.loss, records, [](const MetricsRecord& r) { return r.mtp_loss; }, kMtpLossColour);
  draw_series(
      c, L, L.throughput, records,
      [](const MetricsRecord& r) { return std::optional<double>(r.tgs); }, kThroughputColour);

  std::vector<std::pair<std::string, Rgb>> items = {
      {options.compare.empty() ? std::string("loss") : "loss " + options.title, kLossColour}};
  if (has_mtp) items.emplace_back("mtp_loss", kMtpLossColour);
  for (size_t i = 0; i < options.compare.size(); ++i) {
    const ComparedRun& run = options.compare[i];
    draw_series(
        c, L, L.loss, run.records, [](const MetricsRecord& r) { return r.loss; },
        kCompareColours[i]);
    draw_series(
        c, L, L.throughput, run.records,
        [](const MetricsRecord& r) { return std::optional<double>(r.tgs); }, kCompareColours[i]);
    items.emplace_back("loss " + run.name, kCompareColours[i]);
  }
  if (skipped > 0) items.emplace_back(fmt::format("skipped ({})", skipped), kSkippedColour);
  legend(c, L.loss, items);
  plot.image = c.take();
  return plot;
}

LossGap loss_gap(const std::vector<MetricsRecord>& a, const std::vector<MetricsRecord>& b,
                 int64_t from) {
  std::map<int64_t, double> of_b;
  for (const MetricsRecord& r : b)
    if (r.loss && std::isfinite(*r.loss) && r.step >= from) of_b[r.step] = *r.loss;
  LossGap gap;
  for (const MetricsRecord& r : a) {
    const auto it = of_b.find(r.step);
    if (it == of_b.end() || !r.loss || !std::isfinite(*r.loss)) continue;
    const double rel = std::fabs(*r.loss - it->second) / std::fabs(it->second);
    if (gap.steps == 0 || rel > gap.worst) gap.worst = rel, gap.worst_step = r.step;
    if (gap.steps == 0 || r.step > gap.last_step) gap.last = rel, gap.last_step = r.step;
    ++gap.steps;
  }
  return gap;
}

std::string encode_png(const Image& image) {
  GLMTUNE_ASSERT(image.width > 0 && image.height > 0 &&
                     image.rgb.size() == size_t(image.width) * size_t(image.height) * 3,
                 "image of {} x {} with {} bytes", image.width, image.height, image.rgb.size());
  std::string out;
  std::vector<png_bytep> rows(size_t(image.height));
  for (int y = 0; y < image.height; ++y)
    rows[size_t(y)] = const_cast<png_bytep>(image.rgb.data() + size_t(y) * size_t(image.width) * 3);
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, png_fail, nullptr);
  png_infop info = png ? png_create_info_struct(png) : nullptr;
  const bool ok = png && info && write_rows(png, info, image, rows.data(), &out);
  png_destroy_write_struct(png ? &png : nullptr, info ? &info : nullptr);
  GLMTUNE_ASSERT(ok, "libpng failed to encode a {} x {} image", image.width, image.height);
  return out;
}

}  // namespace glmtune::train
