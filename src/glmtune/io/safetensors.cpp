#include "glmtune/io/safetensors.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <unordered_set>

#include "glmtune/base/error.h"

namespace glmtune::io {
namespace {

using json = nlohmann::json;

constexpr std::string_view kSupportedDTypes = "F32, F64, BF16, F16, F8_E4M3, I32, I64, BOOL";
constexpr std::string_view kFormatFix =
    "the file is damaged or was not written by a safetensors writer; re-download or re-export it";

uint64_t read_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

std::string show_name(std::string_view s) {
  // For messages: keep them one line and readable even when the name is hostile.
  std::string out = "\"";
  for (unsigned char c : s.substr(0, 200)) {
    if (c < 0x20 || c == 0x7f) {
      out += fmt::format("\\x{:02x}", c);
    } else {
      out += char(c);
    }
  }
  if (s.size() > 200) out += "...";
  return out + "\"";
}

template <typename Json>
Json parse_json_no_duplicates(std::string_view text, const std::string& source,
                              const std::string& fix) {
  std::vector<std::optional<std::unordered_set<std::string>>> open_containers;
  std::string duplicate;
  typename Json::parser_callback_t track = [&](int, typename Json::parse_event_t event,
                                               Json& parsed) {
    using E = typename Json::parse_event_t;
    switch (event) {
      case E::object_start:
        open_containers.emplace_back(std::in_place);
        break;
      case E::array_start:
        open_containers.emplace_back(std::nullopt);
        break;
      case E::object_end:
      case E::array_end:
        if (!open_containers.empty()) open_containers.pop_back();
        break;
      case E::key:
        if (duplicate.empty() && !open_containers.empty() && open_containers.back() &&
            !open_containers.back()->insert(parsed.template get<std::string>()).second)
          duplicate = parsed.template get<std::string>();
        break;
      default:
        break;
    }
    return true;
  };
  Json value;
  try {
    value = Json::parse(text.begin(), text.end(), track);
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("not valid JSON: ") + e.what(), source, fix);
  }
  if (!duplicate.empty())
    throw Error("duplicate key " + show_name(duplicate) + " (a name or field is listed twice)",
                source, fix);
  return value;
}

// A JSON value as a non-negative integer, or nullopt (negative, fractional, too large, not a
// number).
std::optional<uint64_t> as_u64(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer()) {
    int64_t i = v.get<int64_t>();
    if (i >= 0) return uint64_t(i);
  }
  return std::nullopt;
}

std::string describe(const json& v) {
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 60) + "...";
  return s;
}

TensorInfo parse_entry(const std::string& name, const json& entry, uint64_t data_size,
                       const std::string& source) {
  const std::string who = "tensor " + show_name(name);
  auto fail = [&](const std::string& what) -> Error {
    return Error(who + ": " + what, source, std::string(kFormatFix));
  };
  if (!entry.is_object())
    throw fail("entry is not an object (expected {dtype, shape, data_offsets})");
  TensorInfo info;
  info.name = name;

  auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end()) throw fail("missing \"dtype\"");
  if (!dtype_it->is_string()) throw fail("\"dtype\" is not a string: " + describe(*dtype_it));
  const auto& dtype_name = dtype_it->get_ref<const std::string&>();
  auto dtype = dtype_from_safetensors(dtype_name);
  if (!dtype)
    throw Error(who + ": unknown dtype " + show_name(dtype_name) +
                    " (supported: " + std::string(kSupportedDTypes) + ")",
                source, "convert the tensor to a supported dtype before loading");
  info.dtype = *dtype;

  auto shape_it = entry.find("shape");
  if (shape_it == entry.end()) throw fail("missing \"shape\"");
  if (!shape_it->is_array()) throw fail("\"shape\" is not an array: " + describe(*shape_it));
  uint64_t numel = 1;
  bool overflow = false;
  for (size_t i = 0; i < shape_it->size(); ++i) {
    const json& d = (*shape_it)[i];
    auto dim = as_u64(d);
    if (!dim)
      throw fail("shape dimension " + std::to_string(i) + " is " + describe(d) +
                 "; dimensions must be non-negative integers");
    if (*dim > uint64_t(std::numeric_limits<int64_t>::max()))
      throw fail("shape dimension " + std::to_string(i) + " (" + std::to_string(*dim) +
                 ") is too large");
    info.shape.push_back(int64_t(*dim));
    overflow = overflow || __builtin_mul_overflow(numel, *dim, &numel);
  }
  uint64_t expected_bytes = 0;
  overflow = overflow || numel > uint64_t(std::numeric_limits<int64_t>::max()) ||
             __builtin_mul_overflow(numel, uint64_t(dtype_size(info.dtype)), &expected_bytes);
  if (overflow) throw fail("shape " + shape_str(info.shape) + " overflows a 64-bit byte count");
  // An empty tensor may still have huge dimensions ([0, 2^62, 2^62]); their strides would overflow
  // in every consumer, so the product of the non-zero dimensions must fit as well.
  uint64_t extent = 1;
  for (int64_t d : info.shape) {
    if (__builtin_mul_overflow(extent, uint64_t(std::max<int64_t>(d, 1)), &extent) ||
        extent > uint64_t(std::numeric_limits<int64_t>::max()))
      throw fail("shape " + shape_str(info.shape) + " is too large: its strides overflow 64 bits");
  }

  auto off_it = entry.find("data_offsets");
  if (off_it == entry.end()) throw fail("missing \"data_offsets\"");
  if (!off_it->is_array() || off_it->size() != 2)
    throw fail("\"data_offsets\" must be [begin, end], got " + describe(*off_it));
  auto begin = as_u64((*off_it)[0]);
  auto end = as_u64((*off_it)[1]);
  if (!begin || !end)
    throw fail("\"data_offsets\" must be non-negative integers, got " + describe(*off_it));
  info.begin = *begin;
  info.end = *end;
  const std::string offsets =
      "[" + std::to_string(info.begin) + ", " + std::to_string(info.end) + "]";
  if (info.end < info.begin) throw fail("data_offsets " + offsets + " end before they begin");
  if (info.end > data_size)
    throw fail("data_offsets " + offsets + " run past the end of the data section (" +
               std::to_string(data_size) + " bytes); the file may be truncated");
  if (info.end - info.begin != expected_bytes)
    throw fail("shape " + shape_str(info.shape) + " of " + dtype_name + " needs " +
               std::to_string(expected_bytes) + " bytes but data_offsets " + offsets + " span " +
               std::to_string(info.end - info.begin));
  return info;
}

}  // namespace

nlohmann::json parse_json_strict(std::string_view text, const std::string& source,
                                 const std::string& fix) {
  return parse_json_no_duplicates<nlohmann::json>(text, source, fix);
}

nlohmann::ordered_json parse_ordered_json_strict(std::string_view text, const std::string& source,
                                                 const std::string& fix) {
  return parse_json_no_duplicates<nlohmann::ordered_json>(text, source, fix);
}

bool is_valid_utf8(std::string_view text, size_t* bad_offset) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  auto fail = [&] {
    if (bad_offset) *bad_offset = i;
    return false;
  };
  while (i < n) {
    unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp;
    if ((c & 0xe0) == 0xc0) {
      len = 2;
      cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      len = 3;
      cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return fail();
    }
    if (n - i < len) return fail();
    for (size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xc0) != 0x80) return fail();
      cp = (cp << 6) | (s[i + k] & 0x3f);
    }
    static constexpr uint32_t kMinForLength[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMinForLength[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return fail();
    i += len;
  }
  return true;
}

int safetensors_dtype_rank(DType dtype) {
  // The reference implementation's Dtype enum order (BOOL < ... < F8_E4M3 < ... < F16 < BF16 <
  // I32 < ... < F32 < F64 < I64), restricted to the dtypes glmtune has.
  switch (dtype) {
    case DType::boolean:
      return 0;
    case DType::fp8e4m3:
      return 1;
    case DType::f16:
      return 2;
    case DType::bf16:
      return 3;
    case DType::i32:
      return 4;
    case DType::f32:
      return 5;
    case DType::f64:
      return 6;
    case DType::i64:
      return 7;
  }
  return 0;
}

SafetensorsFile SafetensorsFile::open(const std::filesystem::path& path) {
  auto mapping = MappedFile::open(path);
  SafetensorsFile file = parse(mapping->bytes(), path.string(), mapping);
  file.mapping_ = std::move(mapping);
  return file;
}

SafetensorsFile SafetensorsFile::parse(std::span<const uint8_t> bytes, std::string source,
                                       std::shared_ptr<const void> owner) {
  SafetensorsFile file;
  file.source_ = std::move(source);
  file.owner_ = std::move(owner);
  file.file_ = bytes;
  const std::string& where = file.source_;
  const std::string fix(kFormatFix);

  if (bytes.size() < 8)
    throw Error("file is " + std::to_string(bytes.size()) +
                    " bytes, shorter than the 8-byte header length: truncated or not a "
                    "safetensors file",
                where, fix);
  const uint64_t n = read_le64(bytes.data());
  if (n > kSafetensorsMaxHeaderBytes)
    throw Error("header length " + std::to_string(n) + " exceeds the format's limit of " +
                    std::to_string(kSafetensorsMaxHeaderBytes) +
                    " bytes (corrupt length prefix or not a safetensors file)",
                where, fix);
  if (n > bytes.size() - 8)
    throw Error("header length " + std::to_string(n) + " runs past the end of the file (" +
                    std::to_string(bytes.size()) + " bytes): the file is truncated",
                where, fix);
  file.header_size_ = n;
  std::string_view text(reinterpret_cast<const char*>(bytes.data() + 8), size_t(n));
  size_t bad = 0;
  if (!is_valid_utf8(text, &bad))
    throw Error("header is not valid UTF-8 (bad byte at header offset " + std::to_string(bad) + ")",
                where, fix);
  json header;
  try {
    header = parse_json_strict(text, where, fix);
  } catch (const Error& e) {
    throw Error("invalid header: " + e.problem(), where, fix);
  }
  if (!header.is_object())
    throw Error("header is not a JSON object (it is " + std::string(header.type_name()) + ")",
                where, fix);

  const uint64_t data_size = bytes.size() - 8 - n;
  file.tensors_.reserve(header.size());
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (it->is_null()) continue;
      if (!it->is_object())
        throw Error("__metadata__ is not an object of strings: " + describe(*it), where, fix);
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string())
          throw Error(
              "__metadata__ value for " + show_name(m.key()) + " is not a string: " + describe(*m),
              where, fix);
        file.metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    file.tensors_.push_back(parse_entry(it.key(), *it, data_size, where));
  }

  // The data section must be covered exactly: tensors back to back from offset 0 to its end, no
  // overlap, no hole, nothing after the last tensor (the reference implementation's rule).
  std::sort(file.tensors_.begin(), file.tensors_.end(),
            [](const TensorInfo& a, const TensorInfo& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  uint64_t covered = 0;
  const TensorInfo* previous = nullptr;
  for (const auto& t : file.tensors_) {
    if (t.begin < covered)
      throw Error("tensors " + show_name(previous->name) + " and " + show_name(t.name) +
                      " overlap (data_offsets [" + std::to_string(previous->begin) + ", " +
                      std::to_string(previous->end) + "] and [" + std::to_string(t.begin) + ", " +
                      std::to_string(t.end) + "])",
                  where, fix);
    if (t.begin > covered)
      throw Error("data section bytes [" + std::to_string(covered) + ", " +
                      std::to_string(t.begin) + ") before tensor " + show_name(t.name) +
                      " belong to no tensor; the format requires the tensors to cover the data "
                      "section without holes",
                  where, fix);
    covered = t.end;
    previous = &t;
  }
  if (covered != data_size)
    throw Error("the last " + std::to_string(data_size - covered) +
                    " bytes of the data section belong to no tensor (trailing bytes); the format "
                    "requires the tensors to cover the data section exactly",
                where, fix);
  for (size_t i = 0; i < file.tensors_.size(); ++i) file.index_.emplace(file.tensors_[i].name, i);
  return file;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& t : tensors_) out.push_back(t.name);
  return out;
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& SafetensorsFile::info(std::string_view name) const {
  const TensorInfo* t = find(name);
  if (!t)
    throw Error("no tensor named " + show_name(name) + " in this file (it has " +
                    std::to_string(tensors_.size()) + " tensors)",
                source_, "check the tensor name (names are case-sensitive)");
  return *t;
}

std::span<const uint8_t> SafetensorsFile::bytes(std::string_view name) const {
  const TensorInfo& t = info(name);
  return file_.subspan(size_t(data_offset() + t.begin), size_t(t.nbytes()));
}

Tensor SafetensorsFile::tensor(std::string_view name) const {
  const TensorInfo& t = info(name);
  const uint8_t* p = file_.data() + data_offset() + t.begin;
  const bool aligned = reinterpret_cast<uintptr_t>(p) % dtype_size(t.dtype) == 0;
  if (owner_ && aligned)
    return Tensor::from_external(const_cast<uint8_t*>(p), t.shape, t.dtype, Device::cpu(), owner_);
  Tensor copy = Tensor::empty(t.shape, t.dtype);
  if (t.nbytes()) std::memcpy(copy.data_ptr(), p, size_t(t.nbytes()));
  return copy;
}

void SafetensorsFile::release(std::string_view name, uint64_t offset, uint64_t length) const {
  if (!mapping_) return;
  const TensorInfo& t = info(name);
  if (offset >= t.nbytes()) return;
  length = std::min(length, t.nbytes() - offset);
  mapping_->release(size_t(data_offset() + t.begin + offset), size_t(length));
}

const TensorInfo* SafetensorsLayout::find(std::string_view name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

SafetensorsLayout plan_safetensors(std::vector<TensorSpec> specs, const Metadata& metadata) {
  std::unordered_set<std::string_view> seen;
  for (const auto& s : specs) {
    if (s.name == "__metadata__")
      throw Error("\"__metadata__\" is reserved by the format and cannot name a tensor",
                  "safetensors writer");
    if (!is_valid_utf8(s.name))
      throw Error("tensor name " + show_name(s.name) + " is not valid UTF-8", "safetensors writer");
    if (!seen.insert(s.name).second)
      throw Error("tensor " + show_name(s.name) + " is given twice", "safetensors writer",
                  "every tensor in a file needs a distinct name");
    for (int64_t d : s.shape)
      if (d < 0)
        throw Error("tensor " + show_name(s.name) + " has negative dimension in shape " +
                        shape_str(s.shape),
                    "safetensors writer");
  }
  for (const auto& [k, v] : metadata)
    if (!is_valid_utf8(k) || !is_valid_utf8(v))
      throw Error("metadata entry " + show_name(k) + " is not valid UTF-8", "safetensors writer");

  std::sort(specs.begin(), specs.end(), [](const TensorSpec& a, const TensorSpec& b) {
    int ra = safetensors_dtype_rank(a.dtype), rb = safetensors_dtype_rank(b.dtype);
    return ra != rb ? ra > rb : a.name < b.name;
  });

  // The reference writer's serde_json output: compact, metadata first, then the tensors in the
  // order above. nlohmann's compact dump without ensure_ascii writes the same bytes (strings
  // escaped alike); the names and metadata are valid UTF-8 (checked above), so the strict handler
  // never throws. The top-level object is joined entry by entry: an ordered_json object looks its
  // keys up linearly, quadratic in the thousands of tensors of a shard.
  using ordered_json = nlohmann::ordered_json;
  const auto dump = [](const ordered_json& j) {
    return j.dump(-1, ' ', false, ordered_json::error_handler_t::strict);
  };
  SafetensorsLayout layout;
  std::string& h = layout.header;
  h += '{';
  if (!metadata.empty()) {
    ordered_json meta = ordered_json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    h += dump("__metadata__") + ':' + dump(meta);
  }
  uint64_t offset = 0;
  for (auto& s : specs) {
    TensorInfo info;
    info.name = std::move(s.name);
    info.dtype = s.dtype;
    info.shape = std::move(s.shape);
    info.begin = offset;
    info.end = offset + uint64_t(shape_numel(info.shape)) * dtype_size(info.dtype);
    offset = info.end;
    const ordered_json entry = {{"dtype", dtype_safetensors_name(info.dtype)},
                                {"shape", info.shape},
                                {"data_offsets", {info.begin, info.end}}};
    if (h.size() > 1) h += ',';
    h += dump(info.name) + ':' + dump(entry);
    layout.tensors.push_back(std::move(info));
  }
  h += '}';
  // Pad so that the data section starts 8-byte aligned, as the reference writer does.
  h.append((8 - h.size() % 8) % 8, ' ');
  layout.data_bytes = offset;
  if (h.size() > kSafetensorsMaxHeaderBytes)
    throw Error("header of " + std::to_string(h.size()) + " bytes exceeds the format's limit of " +
                    std::to_string(kSafetensorsMaxHeaderBytes) + " bytes",
                "safetensors writer", "split the tensors over several files (shards)");
  return layout;
}

SafetensorsWriter::SafetensorsWriter(const std::filesystem::path& path,
                                     std::vector<TensorSpec> specs, const Metadata& metadata,
                                     WriteMode mode)
    : layout_(plan_safetensors(std::move(specs), metadata)), path_(path), mode_(mode) {
  if (mode_ == WriteMode::kAtomic)
    out_ = std::make_unique<AtomicFile>(path);
  else
    out_ = std::make_unique<OutputFile>(path);
  for (size_t i = 0; i < layout_.tensors.size(); ++i) index_.emplace(layout_.tensors[i].name, i);
  written_.assign(layout_.tensors.size(), 0);
  uint8_t prefix[8];
  uint64_t n = layout_.header.size();
  for (int i = 0; i < 8; ++i) prefix[i] = uint8_t(n >> (8 * i));
  out_->write(prefix, 8);
  out_->write(layout_.header);
  out_->truncate(layout_.file_bytes());
}

SafetensorsWriter::~SafetensorsWriter() = default;

size_t SafetensorsWriter::slot(std::string_view name, uint64_t nbytes) {
  auto it = index_.find(name);
  if (it == index_.end())
    throw Error("tensor \"" + std::string(name) + "\" was not planned for this file",
                path_.string());
  const TensorInfo& t = layout_.tensors[it->second];
  if (nbytes != t.nbytes())
    throw Error("tensor \"" + std::string(name) + "\" has " + std::to_string(nbytes) +
                    " bytes; the plan says " + std::to_string(t.nbytes()),
                path_.string());
  return it->second;
}

void SafetensorsWriter::write(std::string_view name, const Tensor& tensor) {
  auto it = index_.find(name);
  if (it != index_.end()) {
    const TensorInfo& t = layout_.tensors[it->second];
    if (tensor.dtype() != t.dtype || tensor.shape() != t.shape)
      throw Error("tensor \"" + std::string(name) + "\" is " +
                      std::string(dtype_name(tensor.dtype())) + shape_str(tensor.shape()) +
                      "; the plan says " + std::string(dtype_name(t.dtype)) + shape_str(t.shape),
                  path_.string());
  }
  if (tensor.numel() == 0) {
    slot(name, 0);  // nothing to write, but the name must be planned
    return;
  }
  Tensor host = tensor.to(Device::cpu()).contiguous();
  write_bytes(name, {static_cast<const uint8_t*>(host.data_ptr()), host.nbytes()});
}

void SafetensorsWriter::write_bytes(std::string_view name, std::span<const uint8_t> bytes) {
  size_t i = slot(name, bytes.size());
  if (written_[i] != 0)
    throw Error("tensor \"" + std::string(name) + "\" is written twice", path_.string());
  write_part(name, 0, bytes);
}

void SafetensorsWriter::write_part(std::string_view name, uint64_t offset,
                                   std::span<const uint8_t> bytes) {
  auto it = index_.find(name);
  if (it == index_.end())
    throw Error("tensor \"" + std::string(name) + "\" was not planned for this file",
                path_.string());
  const size_t i = it->second;
  const TensorInfo& t = layout_.tensors[i];
  if (offset > t.nbytes() || bytes.size() > t.nbytes() - offset ||
      written_[i] + bytes.size() > t.nbytes())
    throw Error("bytes [" + std::to_string(offset) + ", " + std::to_string(offset + bytes.size()) +
                    ") of tensor \"" + std::string(name) + "\" fall outside its " +
                    std::to_string(t.nbytes()) + " bytes or were written before",
                path_.string());
  if (!bytes.empty())
    out_->pwrite(bytes.data(), bytes.size(), layout_.data_offset() + t.begin + offset);
  written_[i] += bytes.size();
}

void SafetensorsWriter::finish() {
  if (finished_) return;
  for (size_t i = 0; i < written_.size(); ++i)
    if (written_[i] != layout_.tensors[i].nbytes())
      throw Error("tensor \"" + layout_.tensors[i].name + "\" was planned but never written",
                  path_.string());
  if (mode_ == WriteMode::kAtomic) {
    static_cast<AtomicFile&>(*out_).commit();
  } else {
    out_->sync();
    out_->close();
  }
  finished_ = true;
}

namespace {
std::vector<TensorSpec> specs_of(const NamedTensors& tensors) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    GLMTUNE_ASSERT(t.defined(), "tensor {} is undefined", name);
    specs.push_back({name, t.dtype(), t.shape()});
  }
  return specs;
}
}  // namespace

void save_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                      const Metadata& metadata) {
  SafetensorsWriter writer(path, specs_of(tensors), metadata, WriteMode::kAtomic);
  for (const auto& [name, t] : tensors) writer.write(name, t);
  writer.finish();
}

std::vector<uint8_t> serialize_safetensors(const NamedTensors& tensors, const Metadata& metadata) {
  SafetensorsLayout layout = plan_safetensors(specs_of(tensors), metadata);
  std::vector<uint8_t> out(size_t(layout.file_bytes()));
  uint64_t n = layout.header.size();
  for (int i = 0; i < 8; ++i) out[size_t(i)] = uint8_t(n >> (8 * i));
  std::memcpy(out.data() + 8, layout.header.data(), layout.header.size());
  for (const auto& [name, t] : tensors) {
    const TensorInfo* info = layout.find(name);
    if (t.numel() == 0) continue;
    Tensor host = t.to(Device::cpu()).contiguous();
    std::memcpy(out.data() + layout.data_offset() + info->begin, host.data_ptr(), host.nbytes());
  }
  return out;
}

}  // namespace glmtune::io
