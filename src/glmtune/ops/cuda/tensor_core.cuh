#pragma once
// Tensor-core building blocks of the hand-written CUDA kernels (KDA core, mHC): mma.sync
// m16n8k16 (bf16 in, fp32 accumulate) on fragments whose fp32 operands are split into bf16
// parts: a hi part, a lo part (the rounding error of hi) and, where fp32 accuracy is wanted, a
// lo2 part (the rounding error of hi + lo). hi·hi + hi·lo + lo·hi keeps about 16 bits of every
// operand; the six products of three parts keep about 24, fp32's own precision. Also
// shared-memory fragment loads (ldmatrix and plain 32-bit loads), cp.async staging and L2
// prefetch.

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "glmtune/ops/cuda/common.cuh"

namespace glmtune::cuda::tc {

using detail::bf16;

// m16n8k16 fragments (g = lane/4, t = lane%4): A rows g, g+8 × cols 2t, 2t+1 (+8); B k 2t, 2t+1
// (+8) × col g; C rows g, g+8 × cols 2t, 2t+1. The lower index sits in the low 16 bits.

__device__ __forceinline__ uint32_t pack2(bf16 lo, bf16 hi) {
  return uint32_t(__bfloat16_as_ushort(lo)) | (uint32_t(__bfloat16_as_ushort(hi)) << 16);
}
// (x0, x1) → a pair of bf16 hi parts and a pair of the lo parts (what hi rounded away).
__device__ __forceinline__ void split2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const bf16 h0 = __float2bfloat16_rn(x0), h1 = __float2bfloat16_rn(x1);
  hi = pack2(h0, h1);
  lo = pack2(__float2bfloat16_rn(x0 - __bfloat162float(h0)),
             __float2bfloat16_rn(x1 - __bfloat162float(h1)));
}

// (x0, x1) → pairs of the three parts: what split2 gives, then the bf16 rounding of what hi + lo
// left.
__device__ __forceinline__ void split3(float x0, float x1, uint32_t& hi, uint32_t& lo,
                                       uint32_t& lo2) {
  const bf16 h0 = __float2bfloat16_rn(x0), h1 = __float2bfloat16_rn(x1);
  const float r0 = x0 - __bfloat162float(h0), r1 = x1 - __bfloat162float(h1);
  const bf16 l0 = __float2bfloat16_rn(r0), l1 = __float2bfloat16_rn(r1);
  hi = pack2(h0, h1);
  lo = pack2(l0, l1);
  lo2 = pack2(__float2bfloat16_rn(r0 - __bfloat162float(l0)),
              __float2bfloat16_rn(r1 - __bfloat162float(l1)));
}

// Fragments carry every part; a product reads the ones its precision needs (the compiler drops
// the others).
struct FragA {
  uint32_t hi[4], lo[4], lo2[4];
};
struct FragB {
  uint32_t hi[2], lo[2], lo2[2];
};

__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// c += a·b with both operands in hi/lo form; the small cross terms go in first.
__device__ __forceinline__ void mma3(float (&c)[4], const FragA& a, const FragB& b) {
  mma(c, a.hi, b.lo);
  mma(c, a.lo, b.hi);
  mma(c, a.hi, b.hi);
}

// c += a·b at the operand precision of kParts parts: 1, the bf16 hi parts alone (one MMA: bf16
// operands, fp32 accumulation); 2, hi + lo (mma3, about 16 bits each); 3, hi + lo + lo2 (six
// MMAs, the terms below 2^-24 of the product left out: about fp32's 24 bits).
template <int kParts>
__device__ __forceinline__ void mma_x(float (&c)[4], const FragA& a, const FragB& b) {
  static_assert(kParts >= 1 && kParts <= 3, "one, two or three parts per operand");
  if constexpr (kParts == 1) {
    mma(c, a.hi, b.hi);
  } else if constexpr (kParts == 2) {
    mma3(c, a, b);
  } else {
    mma(c, a.hi, b.lo2);
    mma(c, a.lo2, b.hi);
    mma(c, a.lo, b.lo);
    mma3(c, a, b);
  }
}

// Two accumulator tiles (n-tiles 2j, 2j+1 of a product) as the A operand of the k-tile j of the
// next product, times `sign`: the C layout of two 16×8 tiles is the A layout of one 16×16.
__device__ __forceinline__ FragA frag_from_acc(const float (&c0)[4], const float (&c1)[4],
                                               float sign) {
  FragA f;
  split3(sign * c0[0], sign * c0[1], f.hi[0], f.lo[0], f.lo2[0]);
  split3(sign * c0[2], sign * c0[3], f.hi[1], f.lo[1], f.lo2[1]);
  split3(sign * c1[0], sign * c1[1], f.hi[2], f.lo[2], f.lo2[2]);
  split3(sign * c1[2], sign * c1[3], f.hi[3], f.lo[3], f.lo2[3]);
  return f;
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const bf16* p) {
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16* p) {
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// The A operand (rows m0..m0+15, k-tile k0) from a bf16 [m][k] tile (k contiguous): one ldmatrix
// where lds_a_mk takes four 32-bit loads.
__device__ __forceinline__ void ldsm_a_mk(const bf16* tile, int ld, int m0, int k0,
                                          uint32_t (&a)[4]) {
  const int lane = threadIdx.x & 31;
  ldsm_x4(a, tile + (m0 + (lane & 15)) * ld + k0 + (lane >> 4) * 8);
}
// The B operands of n-tiles n0 and n0 + 8 (k-tile k0) from a bf16 [n][k] tile (k contiguous):
// Bᵀ stored row-major is B column-major, what the MMA takes.
__device__ __forceinline__ void ldsm_b_nk(const bf16* tile, int ld, int n0, int k0,
                                          uint32_t (&b0)[2], uint32_t (&b1)[2]) {
  const int lane = threadIdx.x & 31;
  uint32_t r[4];
  ldsm_x4(r, tile + (n0 + (lane & 7) + ((lane >> 4) & 1) * 8) * ld + k0 + ((lane >> 3) & 1) * 8);
  b0[0] = r[0];
  b0[1] = r[1];
  b1[0] = r[2];
  b1[1] = r[3];
}
// B operands of n-tiles n0 and n0+8 for k-tile k0 from a bf16 [k][n] tile (n contiguous).
__device__ __forceinline__ void ldsm_b_kn(const bf16* tile, int ld, int k0, int n0,
                                          uint32_t (&b0)[2], uint32_t (&b1)[2]) {
  const int lane = threadIdx.x & 31;
  uint32_t r[4];
  ldsm_x4_trans(r,
                tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + n0 + ((lane >> 4) & 1) * 8);
  b0[0] = r[0];
  b0[1] = r[1];
  b1[0] = r[2];
  b1[1] = r[3];
}
// The parts of a staged operand: tiles of its hi, lo and lo2 parts (those past the precision in
// use may be null).
struct Parts {
  const bf16 *hi, *lo, *lo2;
};
// ldsm_b_kn from staged part tiles, the first kParts of them.
template <int kParts>
__device__ __forceinline__ void ldsm_b_kn_x(const Parts& t, int ld, int k0, int n0, FragB& b0,
                                            FragB& b1) {
  ldsm_b_kn(t.hi, ld, k0, n0, b0.hi, b1.hi);
  if constexpr (kParts > 1) ldsm_b_kn(t.lo, ld, k0, n0, b0.lo, b1.lo);
  if constexpr (kParts > 2) ldsm_b_kn(t.lo2, ld, k0, n0, b0.lo2, b1.lo2);
}
// The A operand (rows m0.., k-tile k0) from a bf16 [k][m] tile (m contiguous).
__device__ __forceinline__ void ldsm_a_km(const bf16* tile, int ld, int k0, int m0,
                                          uint32_t (&a)[4]) {
  const int lane = threadIdx.x & 31;
  ldsm_x4_trans(a,
                tile + (k0 + (lane & 7) + ((lane >> 4) & 1) * 8) * ld + m0 + ((lane >> 3) & 1) * 8);
}
// The B operand (n-tile n0, k-tile k0) from a bf16 [n][k] tile (k contiguous).
__device__ __forceinline__ void lds_b_nk(const bf16* tile, int ld, int n0, int k0,
                                         uint32_t (&b)[2]) {
  const int lane = threadIdx.x & 31;
  const bf16* p = tile + (n0 + (lane >> 2)) * ld + k0 + 2 * (lane & 3);
  b[0] = *reinterpret_cast<const uint32_t*>(p);
  b[1] = *reinterpret_cast<const uint32_t*>(p + 8);
}
// lds_b_nk from staged part tiles, the first kParts of them.
template <int kParts>
__device__ __forceinline__ FragB lds_b_nk_x(const Parts& t, int ld, int n0, int k0) {
  FragB b;
  lds_b_nk(t.hi, ld, n0, k0, b.hi);
  if constexpr (kParts > 1) lds_b_nk(t.lo, ld, n0, k0, b.lo);
  if constexpr (kParts > 2) lds_b_nk(t.lo2, ld, n0, k0, b.lo2);
  return b;
}
// The A operand (rows m0.., k-tile k0) from a bf16 [m][k] tile (k contiguous).
__device__ __forceinline__ void lds_a_mk(const bf16* tile, int ld, int m0, int k0,
                                         uint32_t (&a)[4]) {
  const int lane = threadIdx.x & 31;
  const bf16* p = tile + (m0 + (lane >> 2)) * ld + k0 + 2 * (lane & 3);
  a[0] = *reinterpret_cast<const uint32_t*>(p);
  a[1] = *reinterpret_cast<const uint32_t*>(p + 8 * ld);
  a[2] = *reinterpret_cast<const uint32_t*>(p + 8);
  a[3] = *reinterpret_cast<const uint32_t*>(p + 8 * ld + 8);
}
// The B operand (k-tile k0, n-tile n0) from an f32 [k][n] tile, split on the fly.
__device__ __forceinline__ FragB load_b_f32(const float* __restrict__ tile, int ld, int k0,
                                            int n0) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const float* p = tile + (k0 + 2 * t) * ld + n0 + g;
  FragB f;
  split3(p[0], p[ld], f.hi[0], f.lo[0], f.lo2[0]);
  split3(p[8 * ld], p[9 * ld], f.hi[1], f.lo[1], f.lo2[1]);
  return f;
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr), "l"(src));
}
// 16 bytes global → shared, or 16 zero bytes where !valid (src is then not read, but must still
// be a valid address). The destination as a shared-memory address, or as a pointer.
__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool valid) {
  cp_async16_zfill(static_cast<uint32_t>(__cvta_generic_to_shared(dst)), src, valid);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// The B operand (k-tile 0, n-tile n0) from a bf16 [k][n] tile (n contiguous): ldmatrix .x2 takes
// the row addresses of lanes 0–15.
__device__ __forceinline__ void ldsm_b_kn8(const bf16* tile, int ld, int n0, uint32_t (&b)[2]) {
  const int lane = threadIdx.x & 31;
  const auto addr = static_cast<uint32_t>(
      __cvta_generic_to_shared(tile + ((lane & 7) + ((lane >> 3) & 1) * 8) * ld + n0));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(b[0]), "=r"(b[1])
               : "r"(addr));
}
// The A operand of a 16×16 f32 matrix whose element (m, k) sits at src[m·sm + k·sk], split.
__device__ __forceinline__ FragA load_a_f32(const float* src, int sm, int sk) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  auto at = [&](int m, int kx) { return src[m * sm + kx * sk]; };
  FragA f;
  split3(at(g, 2 * t), at(g, 2 * t + 1), f.hi[0], f.lo[0], f.lo2[0]);
  split3(at(g + 8, 2 * t), at(g + 8, 2 * t + 1), f.hi[1], f.lo[1], f.lo2[1]);
  split3(at(g, 2 * t + 8), at(g, 2 * t + 9), f.hi[2], f.lo[2], f.lo2[2]);
  split3(at(g + 8, 2 * t + 8), at(g + 8, 2 * t + 9), f.hi[3], f.lo[3], f.lo2[3]);
  return f;
}
// A B operand from four values of this lane (k rows 2t, 2t+1, 2t+8, 2t+9 of its column g).
__device__ __forceinline__ FragB frag_b(const float (&x)[4]) {
  FragB f;
  split3(x[0], x[1], f.hi[0], f.lo[0], f.lo2[0]);
  split3(x[2], x[3], f.hi[1], f.lo[1], f.lo2[1]);
  return f;
}
template <typename T>
__device__ __forceinline__ void store2(T* p, float x, float y) {
  if constexpr (std::is_same_v<T, float>)
    *reinterpret_cast<float2*>(p) = make_float2(x, y);
  else
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
}

// movmatrix: the transpose of an 8×8 bf16 matrix held in the fragment layout (lane (g, t) holds
// row g, columns 2t, 2t+1), returned in the same layout.
__device__ __forceinline__ uint32_t mov_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Prefetches `bytes` (a multiple of 16) at a 16-byte aligned global address into L2.
__device__ __forceinline__ void prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
}

}  // namespace glmtune::cuda::tc
