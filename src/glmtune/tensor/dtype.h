#pragma once
// Element types and exact scalar conversions. The conversion functions are usable from host and
// device code, so CPU and CUDA round identically.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <optional>
#include <string_view>
#include <type_traits>

#if defined(__CUDACC__)
#define GLMTUNE_HD __host__ __device__ __forceinline__
#else
#define GLMTUNE_HD inline
#endif

namespace glmtune {

enum class DType : uint8_t { f32, f64, bf16, f16, fp8e4m3, i32, i64, boolean };

inline constexpr DType kAllDTypes[] = {DType::f32,     DType::f64, DType::bf16, DType::f16,
                                       DType::fp8e4m3, DType::i32, DType::i64,  DType::boolean};

size_t dtype_size(DType t);
bool dtype_is_floating(DType t);
// Short human name: "f32", "bf16", "fp8e4m3", ...
std::string_view dtype_name(DType t);
std::optional<DType> dtype_from_name(std::string_view name);
// Safetensors header names: "F32", "F64", "BF16", "F16", "F8_E4M3", "I32", "I64", "BOOL".
std::string_view dtype_safetensors_name(DType t);
std::optional<DType> dtype_from_safetensors(std::string_view name);

GLMTUNE_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
GLMTUNE_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// bfloat16: the upper 16 bits of an IEEE float32. Rounding is to nearest, ties to even; NaNs stay
// NaN (quiet) and infinities stay infinite.
GLMTUNE_HD float bf16_to_f32(uint16_t h) { return bits_float(uint32_t(h) << 16); }
GLMTUNE_HD uint16_t f32_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// IEEE binary16, round to nearest even, overflow to infinity, subnormals exact.
GLMTUNE_HD float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    // Subnormal: value = man * 2^-24, exact in float32.
    float v = float(man) * bits_float(0x33800000u);
    return bits_float(sign | float_bits(v));
  }
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}
GLMTUNE_HD uint16_t f32_to_f16(float f) {
  uint32_t u = float_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: infinity
  if (a < 0x38800000u) {
    // Result is subnormal (or zero): scale so that the integer part is the f16 mantissa.
    // 2^-24 is one f16 subnormal step; adding 0.5 (2^-1) as a float forces RNE at that step.
    float v = bits_float(a) + 0.5f;
    return uint16_t(sign | uint16_t(float_bits(v) - 0x3f000000u));
  }
  uint32_t rounded = a + 0xfffu + ((a >> 13) & 1u);
  return uint16_t(sign | uint16_t((rounded - 0x38000000u) >> 13));
}

// float8 e4m3fn (the FP8 of the released checkpoint): bias 7, no infinities, 0x7f/0xff are NaN,
// largest finite 448. Conversion from float32 rounds to nearest even; values that round beyond 448
// become NaN, as torch.float8_e4m3fn does.
GLMTUNE_HD float fp8e4m3_to_f32(uint8_t v) {
  uint32_t sign = uint32_t(v & 0x80u) << 24;
  uint32_t exp = (v >> 3) & 0xfu;
  uint32_t man = v & 0x7u;
  if (exp == 0xf && man == 0x7) return bits_float(sign | 0x7fc00000u);
  if (exp == 0) {
    float mag = float(man) * 0.001953125f;  // man * 2^-9
    return bits_float(sign | float_bits(mag));
  }
  return bits_float(sign | ((exp + 120u) << 23) | (man << 20));
}
GLMTUNE_HD uint8_t f32_to_fp8e4m3(float f) {
  uint32_t u = float_bits(f);
  uint8_t sign = uint8_t((u >> 24) & 0x80u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint8_t(sign | 0x7fu);
  if (a >= 0x43f00000u) return uint8_t(sign | 0x7fu);  // >= 480 rounds past 448: NaN
  if (a < 0x3c800000u) {
    // Subnormal range, steps of 2^-9: adding 2^14 (whose float ulp is 2^-9) rounds to nearest
    // even at exactly that step; a result of 8 steps is the smallest normal, encoded as 0x08.
    float v = bits_float(a) + 16384.0f;
    return uint8_t(sign | uint8_t(float_bits(v) - 0x46800000u));
  }
  uint32_t rounded = a + 0x7ffffu + ((a >> 20) & 1u);
  return uint8_t(sign | uint8_t((rounded - 0x3c000000u) >> 20));
}

// Storage types, so templates can name them.
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};
struct fp8e4m3_t {
  uint8_t bits;
};

// The storage type of each DType, in the enum's order: dtype_of<T> is T's position here, so the
// mapping has one home and cannot drift from the enum (the static_asserts below pin it).
template <typename... Ts>
struct StorageTypes {
  template <typename T>
  static constexpr size_t index_of() {
    size_t i = 0;
    // Counts the types before the first match; sizeof...(Ts) when none matches.
    (void)((std::is_same_v<T, Ts> || (++i, false)) || ...);
    return i;
  }
};
using DTypeStorage = StorageTypes<float, double, bf16_t, f16_t, fp8e4m3_t, int32_t, int64_t, bool>;

template <typename T>
struct dtype_of {
  static constexpr size_t index = DTypeStorage::index_of<T>();
  static_assert(index < std::size(kAllDTypes), "no DType stores this C++ type");
  static constexpr DType value = kAllDTypes[index];
};

static_assert(dtype_of<float>::value == DType::f32 && dtype_of<double>::value == DType::f64 &&
              dtype_of<bf16_t>::value == DType::bf16 && dtype_of<f16_t>::value == DType::f16 &&
              dtype_of<fp8e4m3_t>::value == DType::fp8e4m3 &&
              dtype_of<int32_t>::value == DType::i32 && dtype_of<int64_t>::value == DType::i64 &&
              dtype_of<bool>::value == DType::boolean);

}  // namespace glmtune
