// The safetensors reader and writer: round trips for every dtype, byte parity with files written by
// Hugging Face's `safetensors`, and one test per malformed-file kind with its message checked.

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/io/safetensors.h"
#include "support/temp_dir.h"

namespace fs = std::filesystem;
using namespace glmtune;
using namespace glmtune::io;

namespace {

using glmtune::test::TempDir;

const fs::path kGolden = fs::path(GLMTUNE_SOURCE_DIR) / "tests" / "golden" / "safetensors";

std::vector<uint8_t> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& p, const std::vector<uint8_t>& bytes) {
  std::ofstream out(p, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

// A file from a raw header text and `data_bytes` bytes of data (0, 1, 2, ...).
std::vector<uint8_t> raw_file(const std::string& header, size_t data_bytes) {
  std::vector<uint8_t> out(8 + header.size() + data_bytes);
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[size_t(i)] = uint8_t(n >> (8 * i));
  if (!header.empty()) std::memcpy(out.data() + 8, header.data(), header.size());
  for (size_t i = 0; i < data_bytes; ++i) out[8 + header.size() + i] = uint8_t(i);
  return out;
}

// Parsing `bytes` must fail with a glmtune::Error whose message contains `expected` and names the
// source.
void expect_rejected(const std::vector<uint8_t>& bytes, const std::string& expected) {
  const std::string source = "case.safetensors";
  try {
    SafetensorsFile::parse(bytes, source);
    ADD_FAILURE() << "accepted a malformed file; expected an error containing: " << expected;
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(expected), std::string::npos) << "message: " << msg;
    EXPECT_NE(msg.find(source), std::string::npos) << "message does not name the file: " << msg;
  }
}

// The golden fixtures' closed-form values (see tools/golden/make_safetensors_golden.py).
double golden_float(int64_t i) { return double((i * 7) % 23 - 11) / 4.0; }
int64_t golden_int(int64_t i, bool wide) {
  int64_t v = (i * 7919) % 2001 - 1000;
  return wide ? v * 1000000000000LL + i : v;
}

// Random values exactly representable in `dtype`.
Tensor random_tensor(const Shape& shape, DType dtype, std::mt19937& rng) {
  std::vector<double> values(size_t(shape_numel(shape)));
  std::uniform_int_distribution<int> small(-40, 40);
  for (auto& v : values) {
    switch (dtype) {
      case DType::boolean:
        v = small(rng) > 0;
        break;
      case DType::i32:
      case DType::i64:
        v = double(small(rng)) * 1000 + small(rng);
        break;
      default:
        v = double(small(rng)) / 8.0;
        break;
    }
  }
  return Tensor::from_doubles(values, shape, dtype);
}

std::vector<uint8_t> tensor_bytes(const Tensor& t) {
  Tensor c = t.contiguous();
  const auto* p = static_cast<const uint8_t*>(c.data_ptr());
  return {p, p + c.nbytes()};
}

}  // namespace

TEST(Safetensors, RoundTripEveryDType) {
  TempDir dir;
  std::mt19937 rng(1234);
  NamedTensors tensors;
  for (DType dt : kAllDTypes)
    tensors.emplace_back("t." + std::string(dtype_name(dt)), random_tensor({3, 5}, dt, rng));
  tensors.emplace_back("scalar", random_tensor({}, DType::f32, rng));
  tensors.emplace_back("empty", Tensor::empty({0, 7}, DType::bf16));
  tensors.emplace_back("rank4", random_tensor({2, 1, 3, 2}, DType::f16, rng));
  save_safetensors(dir / "x.safetensors", tensors, {{"format", "pt"}, {"note", "round trip"}});

  auto file = SafetensorsFile::open(dir / "x.safetensors");
  EXPECT_EQ(file.size(), tensors.size());
  EXPECT_EQ(file.metadata().at("note"), "round trip");
  for (const auto& [name, t] : tensors) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(file.contains(name));
    const TensorInfo& info = file.info(name);
    EXPECT_EQ(info.dtype, t.dtype());
    EXPECT_EQ(info.shape, t.shape());
    Tensor back = file.tensor(name);
    EXPECT_EQ(back.dtype(), t.dtype());
    EXPECT_EQ(back.shape(), t.shape());
    EXPECT_EQ(tensor_bytes(back), tensor_bytes(t));
    auto raw = file.bytes(name);
    EXPECT_EQ(std::vector<uint8_t>(raw.begin(), raw.end()), tensor_bytes(t));
  }
  // Nothing but the file itself is left behind by the atomic write.
  size_t entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.path())) ++entries;
  EXPECT_EQ(entries, 1u);
}

TEST(Safetensors, NonContiguousTensorsAreWrittenInLogicalOrder) {
  TempDir dir;
  std::vector<double> v(12);
  for (size_t i = 0; i < v.size(); ++i) v[i] = double(i) + 0.5;
  Tensor base = Tensor::from_doubles(v, {3, 4}, DType::f32);
  Tensor transposed = base.transpose(0, 1);  // [4, 3], strided
  Tensor sliced = base.slice(1, 1, 3);       // [3, 2], strided
  ASSERT_FALSE(transposed.is_contiguous());
  save_safetensors(dir / "v.safetensors", {{"t", transposed}, {"s", sliced}});
  auto file = SafetensorsFile::open(dir / "v.safetensors");
  EXPECT_EQ(file.tensor("t").to_doubles(), transposed.to_doubles());
  EXPECT_EQ(file.tensor("s").to_doubles(), sliced.to_doubles());
  EXPECT_EQ(file.info("t").shape, (Shape{4, 3}));
}

TEST(Safetensors, TensorsKeepTheMappingAlive) {
  TempDir dir;
  std::mt19937 rng(7);
  Tensor t = random_tensor({64, 64}, DType::bf16, rng);
  save_safetensors(dir / "a.safetensors", {{"w", t}});
  Tensor view;
  {
    auto file = SafetensorsFile::open(dir / "a.safetensors");
    view = file.tensor("w");
    // Zero-copy: the tensor's memory lies inside the mapping.
    const uint8_t* begin = file.mapping()->data();
    const auto* p = static_cast<const uint8_t*>(view.data_ptr());
    EXPECT_GE(p, begin);
    EXPECT_LT(p, begin + file.mapping()->size());
    file.release("w");  // dropping resident pages must not invalidate the bytes
  }
  fs::remove(dir / "a.safetensors");  // the mapping outlives the directory entry too
  EXPECT_EQ(tensor_bytes(view), tensor_bytes(t));
}

TEST(Safetensors, ReadsFilesWrittenByHuggingFace) {
  auto file = SafetensorsFile::open(kGolden / "all_dtypes.safetensors");
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_EQ(file.size(), 10u);
  // Data order of the reference writer: descending dtype alignment, then name.
  std::vector<std::string> order = {"i64.index",  "f64.weight",  "f32.weight", "scalar",
                                    "i32.index",  "bf16.weight", "empty",      "f16.weight",
                                    "fp8.weight", "bool.mask"};
  EXPECT_EQ(file.names(), order);
  struct Float {
    const char* name;
    DType dtype;
    Shape shape;
  };
  for (const Float& f :
       {Float{"f32.weight", DType::f32, {2, 3}}, Float{"f64.weight", DType::f64, {5}},
        Float{"bf16.weight", DType::bf16, {3, 4}}, Float{"f16.weight", DType::f16, {7}},
        Float{"fp8.weight", DType::fp8e4m3, {2, 5}}}) {
    SCOPED_TRACE(f.name);
    Tensor t = file.tensor(f.name);
    EXPECT_EQ(t.dtype(), f.dtype);
    EXPECT_EQ(t.shape(), f.shape);
    auto values = t.to_doubles();
    for (size_t i = 0; i < values.size(); ++i) EXPECT_EQ(values[i], golden_float(int64_t(i)));
  }
  auto i32 = file.tensor("i32.index");
  EXPECT_EQ(i32.dtype(), DType::i32);
  for (int64_t i = 0; i < 9; ++i) EXPECT_EQ(i32.data<int32_t>()[i], golden_int(i, false));
  auto i64 = file.tensor("i64.index");
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(i64.data<int64_t>()[i], golden_int(i, true));
  auto mask = file.bytes("bool.mask");
  for (size_t i = 0; i < mask.size(); ++i) EXPECT_EQ(mask[i], i % 3 == 0 ? 1 : 0);
  EXPECT_EQ(file.tensor("scalar").item(), 1.5);
  EXPECT_EQ(file.info("empty").shape, (Shape{0, 4}));
  EXPECT_EQ(file.tensor("empty").numel(), 0);
}

TEST(Safetensors, WritesTheSameBytesAsHuggingFace) {
  for (const char* golden : {"all_dtypes.safetensors", "escaped_name.safetensors"}) {
    SCOPED_TRACE(golden);
    auto file = SafetensorsFile::open(kGolden / golden);
    NamedTensors tensors;
    // Feed them in reverse name order: the writer must sort as the reference does.
    auto names = file.names();
    std::sort(names.rbegin(), names.rend());
    for (const auto& name : names) tensors.emplace_back(name, file.tensor(name));
    EXPECT_EQ(serialize_safetensors(tensors, file.metadata()), read_bytes(kGolden / golden));
    TempDir dir;
    save_safetensors(dir / "out.safetensors", tensors, file.metadata());
    EXPECT_EQ(read_bytes(dir / "out.safetensors"), read_bytes(kGolden / golden));
  }
}

TEST(Safetensors, HeaderLayoutMatchesTheReferenceWriter) {
  // The reference crate's own serialisation test: {"attn.0": F32 [1, 2, 3]} -> a 64-byte header
  // with no padding; and an empty dict -> "{}" padded with six spaces.
  std::vector<double> v = {0, 1, 2, 3, 4, 5};
  auto bytes = serialize_safetensors({{"attn.0", Tensor::from_doubles(v, {1, 2, 3}, DType::f32)}});
  std::string header(bytes.begin() + 8, bytes.begin() + 8 + 64);
  EXPECT_EQ(bytes[0], 64);
  EXPECT_EQ(header, R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})");
  auto empty = serialize_safetensors({});
  EXPECT_EQ(std::string(empty.begin(), empty.end()), std::string("\x08\0\0\0\0\0\0\0{}      ", 16));
}

TEST(Safetensors, HeaderStringsAreEscapedAsSerdeEscapesThem) {
  // serde_json (the reference writer): `"` `\` and \b \f \n \r \t by their short escapes, the
  // other control characters as \u00xx in lowercase hex, DEL, '/' and non-ASCII text as is.
  const std::string name("q\"b\\s/\b\f\n\r\t\x00\x01\x1f\x7f é日😀", 25);
  const Metadata metadata = {{"k\"\\\x02", "v\n\x1e\xc3\xbc"}};
  const auto layout =
      plan_safetensors({{name, DType::f32, {1}}, {"plain", DType::bf16, {}}}, metadata);
  EXPECT_EQ(layout.header,
            "{\"__metadata__\":{\"k\\\"\\\\\\u0002\":\"v\\n\\u001e\xc3\xbc\"},"
            "\"q\\\"b\\\\s/\\b\\f\\n\\r\\t\\u0000\\u0001\\u001f\x7f "
            "\xc3\xa9\xe6\x97\xa5\xf0\x9f\x98\x80\":"
            "{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
            "\"plain\":{\"dtype\":\"BF16\",\"shape\":[],\"data_offsets\":[4,6]}}      ");
  // Every control character survives the round trip through the reader.
  for (int c = 0; c < 0x20; ++c) {
    SCOPED_TRACE(c);
    const std::string n = "t" + std::string(1, char(c));
    auto bytes = serialize_safetensors({{n, Tensor::zeros({1}, DType::f32)}}, {{n, n}});
    auto file = SafetensorsFile::parse(bytes, "escaped");
    EXPECT_TRUE(file.contains(n));
    EXPECT_EQ(file.metadata().at(n), n);
  }
}

TEST(Safetensors, Utf8Validation) {
  size_t bad = 99;
  EXPECT_TRUE(is_valid_utf8("ascii é 日本 😀"));
  EXPECT_FALSE(is_valid_utf8("ab\xff", &bad));
  EXPECT_EQ(bad, 2u);
  EXPECT_FALSE(is_valid_utf8("\xc0\xaf"));          // overlong '/'
  EXPECT_FALSE(is_valid_utf8("\xed\xa0\x80"));      // surrogate
  EXPECT_FALSE(is_valid_utf8("\xf4\x90\x80\x80"));  // past U+10FFFF
  EXPECT_FALSE(is_valid_utf8("\xe6\x97"));          // truncated sequence
}

TEST(Safetensors, UnalignedDataIsCopiedToAnAlignedTensor) {
  // A BOOL[1] before an F32[2] puts the floats at an odd data offset; files from other writers can
  // look like this and are valid.
  std::string header =
      R"({"b":{"dtype":"BOOL","shape":[1],"data_offsets":[0,1]},"f":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}})";
  std::vector<uint8_t> bytes = raw_file(header, 9);
  const size_t data = bytes.size() - 9;
  bytes[data] = 1;
  const float values[2] = {1.25f, -3.5f};
  std::memcpy(bytes.data() + data + 1, values, sizeof(values));
  TempDir dir;
  write_bytes(dir / "u.safetensors", bytes);
  auto file = SafetensorsFile::open(dir / "u.safetensors");
  Tensor f = file.tensor("f");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f.data_ptr()) % 4, 0u);
  EXPECT_EQ(f.to_doubles(), (std::vector<double>{1.25, -3.5}));
}

TEST(Safetensors, PlannedWriterTakesTensorsInAnyOrder) {
  TempDir dir;
  std::mt19937 rng(3);
  Tensor a = random_tensor({4, 4}, DType::bf16, rng);
  Tensor b = random_tensor({3}, DType::f32, rng);
  {
    SafetensorsWriter w(dir / "p.safetensors", {{"a", DType::bf16, {4, 4}}, {"b", DType::f32, {3}}},
                        {{"format", "pt"}});
    w.write("b", b);
    auto ab = tensor_bytes(a);
    w.write_bytes("a", ab);
    w.finish();
  }
  EXPECT_EQ(read_bytes(dir / "p.safetensors"),
            serialize_safetensors({{"a", a}, {"b", b}}, {{"format", "pt"}}));
}

TEST(Safetensors, PlannedWriterTakesLargeTensorsInParts) {
  TempDir dir;
  std::mt19937 rng(11);
  Tensor a = random_tensor({10, 7}, DType::f32, rng);  // 280 bytes
  const auto bytes = tensor_bytes(a);
  {
    SafetensorsWriter w(dir / "p.safetensors", {{"a", DType::f32, {10, 7}}});
    // Out of order and of uneven sizes; byte offsets need not fall on elements.
    w.write_part("a", 101, std::span(bytes).subspan(101, 179));
    w.write_part("a", 0, std::span(bytes).subspan(0, 101));
    w.finish();
  }
  EXPECT_EQ(tensor_bytes(SafetensorsFile::open(dir / "p.safetensors").tensor("a")), bytes);

  SafetensorsWriter w(dir / "q.safetensors", {{"a", DType::f32, {10, 7}}});
  w.write_part("a", 0, std::span(bytes).subspan(0, 200));
  try {
    w.write_part("a", 200, std::span(bytes).subspan(0, 100));  // past the end
    ADD_FAILURE() << "accepted bytes past the tensor";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bytes [200, 300) of tensor \"a\" fall outside"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(w.write_bytes("a", bytes), Error);  // already partly written
  try {
    w.finish();
    ADD_FAILURE() << "finished a partly written tensor";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"a\" was planned but never written"), std::string::npos)
        << e.what();
  }
}

TEST(Safetensors, PlannedWriterRejectsMistakes) {
  TempDir dir;
  SafetensorsWriter w(dir / "p.safetensors", {{"a", DType::bf16, {4, 4}}, {"b", DType::f32, {3}}});
  try {
    w.write("a", Tensor::zeros({4, 5}, DType::bf16));
    ADD_FAILURE() << "accepted a wrong shape";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the plan says bf16[4, 4]"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(w.write("zzz", Tensor::zeros({3}, DType::f32)), Error);
  w.write("b", Tensor::zeros({3}, DType::f32));
  try {
    w.finish();
    ADD_FAILURE() << "finished with a tensor missing";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"a\" was planned but never written"), std::string::npos)
        << e.what();
  }
}

TEST(Safetensors, WriterRejectsBadNames) {
  TempDir dir;
  auto t = Tensor::zeros({2}, DType::f32);
  try {
    save_safetensors(dir / "d.safetensors", {{"x", t}, {"x", t}});
    ADD_FAILURE() << "accepted duplicate names";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("given twice"), std::string::npos) << e.what();
  }
  EXPECT_THROW(save_safetensors(dir / "m.safetensors", {{"__metadata__", t}}), Error);
  EXPECT_THROW(save_safetensors(dir / "u.safetensors", {{"bad\xff", t}}), Error);
  EXPECT_THROW(save_safetensors(dir / "v.safetensors", {{"x", t}}, {{"key", "bad\xc3"}}), Error);
  // A failed write leaves nothing behind.
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

TEST(Safetensors, FailedAtomicWriteLeavesNoFiles) {
  TempDir dir;
  EXPECT_THROW(
      save_safetensors(dir / "missing" / "x.safetensors", {{"x", Tensor::zeros({2}, DType::f32)}}),
      Error);
  EXPECT_TRUE(fs::is_empty(dir.path()));
  // Overwriting replaces the old file whole.
  save_safetensors(dir / "x.safetensors", {{"x", Tensor::zeros({2}, DType::f32)}});
  save_safetensors(dir / "x.safetensors", {{"y", Tensor::full({3}, 2.0, DType::bf16)}});
  auto file = SafetensorsFile::open(dir / "x.safetensors");
  EXPECT_FALSE(file.contains("x"));
  EXPECT_EQ(file.tensor("y").to_doubles(), (std::vector<double>{2, 2, 2}));
}

TEST(Safetensors, AnAtomicWriterTouchesThePathOnlyWhenFinished) {
  TempDir dir;
  const fs::path path = dir / "w.safetensors";
  save_safetensors(path, {{"old", Tensor::zeros({2}, DType::f32)}});
  const auto before = read_bytes(path);
  {
    SafetensorsWriter w(path, {{"a", DType::f32, {3}}}, {}, WriteMode::kAtomic);
    EXPECT_EQ(w.path(), path);
    w.write("a", Tensor::full({3}, 1.0, DType::f32));
    EXPECT_EQ(read_bytes(path), before);
  }  // never finished: the old file stays, the temporary file goes
  EXPECT_EQ(read_bytes(path), before);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
  {
    SafetensorsWriter w(path, {{"a", DType::f32, {3}}}, {}, WriteMode::kAtomic);
    w.write("a", Tensor::full({3}, 1.0, DType::f32));
    w.finish();
  }
  EXPECT_EQ(read_bytes(path), serialize_safetensors({{"a", Tensor::full({3}, 1.0, DType::f32)}}));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
  // A directory in the way: the error names the path and nothing is left behind.
  fs::create_directories(dir / "d.safetensors" / "x");
  try {
    SafetensorsWriter w(dir / "d.safetensors", {{"a", DType::f32, {1}}}, {}, WriteMode::kAtomic);
    w.write("a", Tensor::zeros({1}, DType::f32));
    w.finish();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.where(), (dir / "d.safetensors").string());
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 2);
}

TEST(MappedFile, ClearErrors) {
  TempDir dir;
  auto expect_error = [](const fs::path& p, const std::string& what) {
    try {
      SafetensorsFile::open(p);
      ADD_FAILURE() << "opened " << p;
    } catch (const Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find(what), std::string::npos) << msg;
      EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
    }
  };
  expect_error(dir / "nope.safetensors", "file not found");
  expect_error(dir.path(), "is a directory");
  write_bytes(dir / "empty.safetensors", {});
  expect_error(dir / "empty.safetensors", "shorter than the 8-byte header length");
  if (::geteuid() != 0) {
    // Root reads anything, so the permission case can only be exercised as a normal user.
    write_bytes(dir / "secret.safetensors", raw_file("{}", 0));
    ::chmod((dir / "secret.safetensors").c_str(), 0);
    expect_error(dir / "secret.safetensors", "permission denied");
  }
}

// One test per malformed kind, each with its message checked.
TEST(SafetensorsMalformed, EachKindHasAClearMessage) {
  const std::string a = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string b = R"("b":{"dtype":"BF16","shape":[2,2],"data_offsets":[8,16]})";
  // The valid baseline parses.
  EXPECT_NO_THROW(SafetensorsFile::parse(raw_file("{" + a + "," + b + "}", 16), "ok"));

  // Too short for the length prefix; header length beyond the file and beyond the format's cap.
  expect_rejected({1, 2, 3}, "file is 3 bytes, shorter than the 8-byte header length");
  {
    auto bytes = raw_file("{" + a + "}", 8);
    bytes[0] = 200;  // claims a 200-byte header in a 70-byte file
    expect_rejected(bytes, "runs past the end of the file");
    auto huge = raw_file("{}", 0);
    uint64_t n = kSafetensorsMaxHeaderBytes + 1;
    for (int i = 0; i < 8; ++i) huge[size_t(i)] = uint8_t(n >> (8 * i));
    expect_rejected(huge, "exceeds the format's limit of 100000000 bytes");
    for (int i = 0; i < 8; ++i) huge[size_t(i)] = 0xff;  // 2^64 - 1: no overflow either
    expect_rejected(huge, "exceeds the format's limit");
  }
  expect_rejected(raw_file("{\"a\":", 0), "not valid JSON");
  expect_rejected(raw_file("", 0), "not valid JSON");
  expect_rejected(raw_file("{} x", 0), "not valid JSON");
  expect_rejected(raw_file("[1, 2]", 0), "not a JSON object");
  expect_rejected(raw_file("\"text\"", 0), "not a JSON object");
  expect_rejected(raw_file("{\"\xff\":1}", 0), "not valid UTF-8");
  expect_rejected(raw_file(R"({"a":{"dtype":"F8_E5M2","shape":[2],"data_offsets":[0,2]}})", 2),
                  "unknown dtype \"F8_E5M2\"");
  expect_rejected(raw_file(R"({"a":{"dtype":7,"shape":[2],"data_offsets":[0,2]}})", 2),
                  "\"dtype\" is not a string");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8),
                  "dimensions must be non-negative integers");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8),
                  "dimensions must be non-negative integers");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})", 8),
                  "dimensions must be non-negative integers");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", 8),
                  "\"shape\" is not an array");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
                  "shape [3] of F32 needs 12 bytes but data_offsets [0, 8] span 8");
  expect_rejected(
      raw_file(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8),
      "overflows a 64-bit byte count");
  expect_rejected(
      raw_file(R"({"a":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,8]}})", 8),
      "overflows a 64-bit byte count");
  expect_rejected(
      raw_file(R"({"a":{"dtype":"F32","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}})",
               0),
      "its strides overflow 64 bits");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4),
                  "run past the end of the data section (4 bytes)");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8),
                  "end before they begin");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8),
                  "must be [begin, end]");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-1,7]}})", 8),
                  "must be non-negative integers");
  expect_rejected(raw_file(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", 8), "missing \"dtype\"");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", 8),
                  "missing \"shape\"");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2]}})", 8), "missing \"data_offsets\"");
  expect_rejected(raw_file(R"({"a":[1,2]})", 0), "entry is not an object");
  // Overlap: b starts inside a.
  expect_rejected(
      raw_file("{" + a + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
      "tensors \"a\" and \"b\" overlap");
  // Hole between a and b, hole before the first tensor, bytes after the last.
  expect_rejected(
      raw_file("{" + a + R"(,"b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})", 16),
      "data section bytes [8, 12) before tensor \"b\" belong to no tensor; the format requires the "
      "tensors to cover the data section without holes");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
                  "without holes");
  expect_rejected(raw_file("{" + a + "}", 12),
                  "the last 4 bytes of the data section belong to no tensor");
  // Duplicate tensor names (nlohmann would keep only the last), and duplicate fields.
  expect_rejected(raw_file("{" + a + "," + a + "}", 8), "duplicate key \"a\"");
  expect_rejected(
      raw_file(R"({"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8),
      "duplicate key \"dtype\"");
  // Metadata must map strings to strings.
  expect_rejected(raw_file(R"({"__metadata__":{"format":1}})", 0),
                  "__metadata__ value for \"format\" is not a string");
  expect_rejected(raw_file(R"({"__metadata__":["pt"]})", 0), "__metadata__ is not an object");
  EXPECT_NO_THROW(SafetensorsFile::parse(raw_file(R"({"__metadata__":null})", 0), "null metadata"));
}

TEST(SafetensorsMalformed, ZeroSizeTensorsMayShareAnOffset) {
  // Valid per the reference rules: empty tensors occupy no bytes.
  auto file = SafetensorsFile::parse(
      raw_file(
          R"({"e1":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"e2":{"dtype":"BF16","shape":[3,0],"data_offsets":[0,0]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
          4),
      "zero");
  EXPECT_EQ(file.size(), 3u);
  EXPECT_EQ(file.info("e2").shape, (Shape{3, 0}));
}

TEST(SafetensorsMalformed, MissingTensorLookupNamesTheFile) {
  auto file = SafetensorsFile::parse(raw_file("{}", 0), "lookup.safetensors");
  try {
    file.info("nope");
    ADD_FAILURE();
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("no tensor named \"nope\""), std::string::npos) << msg;
    EXPECT_NE(msg.find("lookup.safetensors"), std::string::npos) << msg;
  }
}
