#pragma once
#include <string>

namespace glmtune {

struct Device {
  enum class Kind : uint8_t { cpu, cuda };
  Kind kind = Kind::cpu;
  int index = 0;

  static Device cpu() { return {Kind::cpu, 0}; }
  static Device cuda(int index = 0) { return {Kind::cuda, index}; }
  bool is_cpu() const { return kind == Kind::cpu; }
  bool is_cuda() const { return kind == Kind::cuda; }
  bool operator==(const Device&) const = default;
  // "cpu" or "cuda:N".
  std::string str() const;
  // Parses "cpu", "cuda", "cuda:N"; throws glmtune::Error naming the text otherwise.
  static Device parse(const std::string& text);
};

// True when this build has the CUDA backend and a device is visible.
bool cuda_available();
int cuda_device_count();
// Makes GPU `index` the one this thread's kernels and allocations go to (a process that drives one
// GPU of several calls it once, before any work); glmtune::Error if it does not exist.
void use_cuda_device(int index);

}  // namespace glmtune
