// libFuzzer entry: parse arbitrary bytes as a safetensors file. Every input must either be
// rejected with a glmtune::Error or yield tensors whose bytes all lie inside the input; anything
// else (a crash, a sanitizer report, an internal assertion, a view outside the input) is a bug.
// Accepted files must also survive a round trip through the writer's layout unchanged.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/io/safetensors.h"

namespace {

using namespace glmtune::io;

[[noreturn]] void bug() { std::abort(); }

// Rebuilds the file with the writer's layout, parses it again and checks that nothing changed:
// what the reader accepts, the writer reproduces.
void check_round_trip(const SafetensorsFile& file) {
  std::vector<TensorSpec> specs;
  for (const auto& t : file.tensors()) specs.push_back({t.name, t.dtype, t.shape});
  SafetensorsLayout layout = plan_safetensors(specs, file.metadata());
  std::vector<uint8_t> out(size_t(layout.file_bytes()));
  const uint64_t n = layout.header.size();
  for (int i = 0; i < 8; ++i) out[size_t(i)] = uint8_t(n >> (8 * i));
  std::memcpy(out.data() + 8, layout.header.data(), layout.header.size());
  for (const auto& t : layout.tensors) {
    auto bytes = file.bytes(t.name);
    if (bytes.size() != t.nbytes()) bug();
    if (!bytes.empty())
      std::memcpy(out.data() + layout.data_offset() + t.begin, bytes.data(), bytes.size());
  }
  SafetensorsFile again = SafetensorsFile::parse(out, "round trip");
  if (again.size() != file.size() || again.metadata() != file.metadata()) bug();
  for (const auto& t : file.tensors()) {
    const TensorInfo* u = again.find(t.name);
    if (!u || u->dtype != t.dtype || u->shape != t.shape) bug();
    auto a = file.bytes(t.name), b = again.bytes(t.name);
    if (a.size() != b.size() || (!a.empty() && std::memcmp(a.data(), b.data(), a.size()) != 0))
      bug();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const uint8_t> input(data, size);
  std::optional<SafetensorsFile> file;
  try {
    file.emplace(SafetensorsFile::parse(input, "fuzz input"));
  } catch (const glmtune::Error&) {
    return 0;  // rejected with a message: the expected outcome for most inputs
  }
  try {
    unsigned checksum = 0;
    for (const auto& t : file->tensors()) {
      auto bytes = file->bytes(t.name);
      if (!bytes.empty() && (bytes.data() < data || bytes.data() + bytes.size() > data + size))
        bug();
      for (uint8_t b : bytes) checksum += b;
      // Without an owner the tensor is a copy: this exercises shape handling in the tensor core.
      glmtune::Tensor copy = file->tensor(t.name);
      if (copy.nbytes() != bytes.size()) bug();
    }
    check_round_trip(*file);
    // Keep the reads observable so they are not optimised away.
    volatile unsigned sink = checksum;
    (void)sink;
  } catch (const glmtune::Error&) {
    bug();  // an accepted file must be fully usable
  }
  return 0;
}
