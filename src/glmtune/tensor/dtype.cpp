#include "glmtune/tensor/dtype.h"

#include "glmtune/base/error.h"

namespace glmtune {
namespace {
struct DTypeInfo {
  DType type;
  size_t size;
  bool floating;
  std::string_view name;
  std::string_view safetensors;
};
constexpr DTypeInfo kInfo[] = {
    {DType::f32, 4, true, "f32", "F32"},
    {DType::f64, 8, true, "f64", "F64"},
    {DType::bf16, 2, true, "bf16", "BF16"},
    {DType::f16, 2, true, "f16", "F16"},
    {DType::fp8e4m3, 1, true, "fp8e4m3", "F8_E4M3"},
    {DType::i32, 4, false, "i32", "I32"},
    {DType::i64, 8, false, "i64", "I64"},
    {DType::boolean, 1, false, "bool", "BOOL"},
};
const DTypeInfo& info(DType t) {
  auto i = size_t(t);
  GLMTUNE_ASSERT(i < std::size(kInfo), "bad dtype {}", i);
  return kInfo[i];
}
}  // namespace

size_t dtype_size(DType t) { return info(t).size; }
bool dtype_is_floating(DType t) { return info(t).floating; }
std::string_view dtype_name(DType t) { return info(t).name; }
std::string_view dtype_safetensors_name(DType t) { return info(t).safetensors; }

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const auto& i : kInfo)
    if (i.name == name) return i.type;
  if (name == "float32") return DType::f32;
  if (name == "bfloat16") return DType::bf16;
  if (name == "float16") return DType::f16;
  if (name == "float64") return DType::f64;
  return std::nullopt;
}

std::optional<DType> dtype_from_safetensors(std::string_view name) {
  for (const auto& i : kInfo)
    if (i.safetensors == name) return i.type;
  return std::nullopt;
}

}  // namespace glmtune
