#include "glmtune/tensor/device.h"

#include <charconv>

#include "glmtune/base/error.h"

namespace glmtune {

std::string Device::str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }

Device Device::parse(const std::string& text) {
  if (text == "cpu") return cpu();
  if (text == "cuda") return cuda(0);
  if (text.rfind("cuda:", 0) == 0) {
    int index = -1;
    const char* begin = text.data() + 5;
    const char* end = text.data() + text.size();
    auto [ptr, ec] = std::from_chars(begin, end, index);
    if (ec == std::errc() && ptr == end && begin != end && index >= 0) return cuda(index);
  }
  throw Error("unknown device '" + text + "'", "device", "use 'cpu', 'cuda' or 'cuda:N'");
}

#ifndef GLMTUNE_WITH_CUDA
bool cuda_available() { return false; }
int cuda_device_count() { return 0; }
void use_cuda_device(int index) {
  throw Error(
      "GPU " + std::to_string(index) + " asked for, but this glmtune was built without CUDA",
      "device", "build with -DGLMTUNE_CUDA=ON, or use device = \"cpu\"");
}
#endif

}  // namespace glmtune
