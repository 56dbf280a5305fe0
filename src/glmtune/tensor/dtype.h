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

// binary16 and float8 e4m3fn are one layout with other widths: a sign bit, `ExpBits` exponent bits
// at bias 2^(ExpBits−1) − 1 and `ManBits` mantissa bits. Their finite values decode, and round to
// nearest even, by one rule each, written here once; only the codes for NaN and infinity (and
// where overflow starts) are each format's own.
template <int ExpBits, int ManBits>
struct SmallFloat {
  static constexpr int kSignBit = ExpBits + ManBits;
  static constexpr uint32_t kBias = (1u << (ExpBits - 1)) - 1;
  static constexpr int kShift = 23 - ManBits;  // mantissa bits float32 has beyond this format's
  static constexpr uint32_t kRebias = (127u - kBias) << 23;  // float32's exponent field over ours
  // float32 bits of the smallest normal, 2^(1 − bias), and of one subnormal step,
  // 2^(1 − bias − ManBits).
  static constexpr uint32_t kMinNormal = (128u - kBias) << 23;
  static constexpr uint32_t kSubnormalStep = (128u - kBias - ManBits) << 23;
  // float32 bits of 2^23 subnormal steps: the float32 whose ulp is one step.
  static constexpr uint32_t kStepUlpCarrier = (128u - kBias - ManBits + 23) << 23;

  static GLMTUNE_HD uint32_t sign_to_f32(uint32_t code) {
    return (code & (1u << kSignBit)) << (31 - kSignBit);
  }
  static GLMTUNE_HD uint32_t sign_from_f32(uint32_t u) {
    return (u >> (31 - kSignBit)) & (1u << kSignBit);
  }

  // A code whose exponent field is not the format's reserved one, as float32 (exactly).
  static GLMTUNE_HD float finite_to_f32(uint32_t code) {
    const uint32_t sign = sign_to_f32(code);
    const uint32_t exp = (code >> ManBits) & ((1u << ExpBits) - 1);
    const uint32_t man = code & ((1u << ManBits) - 1);
    if (exp == 0) {
      // Subnormal: value = man · 2^(1 − bias − ManBits), exact in float32.
      const float v = float(man) * bits_float(kSubnormalStep);
      return bits_float(sign | float_bits(v));
    }
    return bits_float(sign | ((exp + 127u - kBias) << 23) | (man << kShift));
  }

  // The code of float32 bits `u` whose magnitude rounds to a finite value of the format.
  static GLMTUNE_HD uint32_t round_from_f32(uint32_t u) {
    const uint32_t sign = sign_from_f32(u);
    const uint32_t a = u & 0x7fffffffu;
    if (a < kMinNormal) {
      // Subnormal (or zero): adding the float32 whose ulp is one subnormal step rounds to nearest
      // even at exactly that step, and leaves the count of steps in its low mantissa bits.
      const float v = bits_float(a) + bits_float(kStepUlpCarrier);
      return sign | (float_bits(v) - kStepUlpCarrier);
    }
    const uint32_t rounded = a + ((1u << (kShift - 1)) - 1) + ((a >> kShift) & 1u);
    return sign | ((rounded - kRebias) >> kShift);
  }
};

// IEEE binary16, round to nearest even, overflow to infinity, subnormals exact.
using F16Layout = SmallFloat<5, 10>;
GLMTUNE_HD float f16_to_f32(uint16_t h) {
  // All-ones exponent: infinity, or NaN with its payload.
  if ((h & 0x7c00u) == 0x7c00u)
    return bits_float(F16Layout::sign_to_f32(h) | 0x7f800000u | (uint32_t(h & 0x3ffu) << 13));
  return F16Layout::finite_to_f32(h);
}
GLMTUNE_HD uint16_t f32_to_f16(float f) {
  const uint32_t u = float_bits(f), a = u & 0x7fffffffu;
  const uint32_t sign = F16Layout::sign_from_f32(u);
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: infinity
  return uint16_t(F16Layout::round_from_f32(u));
}

// float8 e4m3fn (the FP8 of the released checkpoint): bias 7, no infinities, 0x7f/0xff are NaN,
// largest finite 448. Conversion from float32 rounds to nearest even; values that round beyond 448
// become NaN, as torch.float8_e4m3fn does.
using E4M3Layout = SmallFloat<4, 3>;
GLMTUNE_HD float fp8e4m3_to_f32(uint8_t v) {
  if ((v & 0x7fu) == 0x7fu) return bits_float(E4M3Layout::sign_to_f32(v) | 0x7fc00000u);
  return E4M3Layout::finite_to_f32(v);
}
GLMTUNE_HD uint8_t f32_to_fp8e4m3(float f) {
  const uint32_t u = float_bits(f);
  // NaN, infinity and >= 480 (which rounds past 448) all become NaN.
  if ((u & 0x7fffffffu) >= 0x43f00000u) return uint8_t(E4M3Layout::sign_from_f32(u) | 0x7fu);
  return uint8_t(E4M3Layout::round_from_f32(u));
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
