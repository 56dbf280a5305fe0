// CUDA block-scaled FP8 (ops/cuda/fp8.h): the quantisers bit for bit against the CPU reference
// (ops/fp8.h) on random inputs, edge shapes and non-finite values, and the three FP8 GEMMs (y = x
// Wᵀ, dx = dy W, dW = dyᵀ x) plus their per-expert forms against an f64 product of the dequantised
// operands computed on the CPU. Inputs are fresh random values (seed printed; GLMTUNE_TEST_SEED
// reproduces a run) whose magnitude varies by row and by 128-block, so a scale applied to the wrong
// tile is visible. Skipped (not failed) where no GPU is visible; a GPU on which cuBLASLt has no
// block-scaled FP8 algorithm fails, with the cuBLAS status.
//
// The GEMM bound, per output element, with S = Σ_k |x̂_k ŵ_k| over the dequantised operands:
//   |y − ref| ≤ 2^-8 · S + (K/128 + 2) · 2^-24 · S + rounding of the output (2^-8 |ref| for bf16,
//   2^-23 |ref| for f32).
// Hopper's FP8 tensor cores add the products of one 128-wide block keeping about 14 bits (the
// reason cuBLASLt promotes every block's partial sum to f32 before scaling it), which in the worst
// case leaves a block's partial sum within 128 · 2^-13 = 2^-6 of the sum of its |products|; the
// scaled partials then add in f32. That worst case needs every truncation to point the same way;
// measured on an H200 (cuBLASLt 13.1) the worst |err| / S over all cases was 7.75e-4 with f32
// output (forward 1.2e-4, dX 4.4e-4, dW 7.8e-4) and at most 7.1e-3 with bf16 output, where the
// output's own rounding (the separate 2^-8 |ref| term, measured against S) dominates. The bar
// 2^-8 = 3.9e-3 keeps a margin of 5 over the f32 figures. A scale taken from the wrong tile moves
// the result by a fraction of S far above it for these inputs. Each case prints its worst
// |y − ref| / S, so the margin shows.

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/io/fp8.h"
#include "glmtune/ops/fp8.h"
#include "glmtune/ops/linear.h"
#include "glmtune/tensor/dtype.h"
#include "glmtune/tensor/tensor.h"
#include "support/cuda_test_support.h"
#ifdef GLMTUNE_WITH_CUDA
#include "glmtune/ops/cuda/fp8.h"
#include "glmtune/tensor/cuda_check.h"
#endif

using namespace glmtune;
using namespace glmtune::test;

namespace {

#ifdef GLMTUNE_WITH_CUDA

std::string shape_name(int64_t a, int64_t b, int64_t c = -1) {
  std::string s = std::to_string(a) + "x" + std::to_string(b);
  if (c >= 0) s += "x" + std::to_string(c);
  return s;
}

// N(0, 1) scaled by exp(N(0, 1)) per row and per 128-column block: tiles of very different amax.
Tensor varied(int64_t rows, int64_t cols, DType dtype, uint64_t stream) {
  Tensor x = random_cpu({rows, cols}, DType::f32, stream);
  const Tensor row_f = random_cpu({rows}, DType::f32, stream + 1000);
  const Tensor blk_f = random_cpu({(cols + 127) / 128 + 1}, DType::f32, stream + 2000);
  float* p = x.data<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      p[r * cols + c] *= std::exp(row_f.data<float>()[r] + blk_f.data<float>()[c / 128]);
  return x.to(dtype);
}

bool is_nan_code(uint8_t v) { return (v & 0x7f) == 0x7f; }

// Codes equal, or both NaN (the sign of a NaN is not part of the contract).
::testing::AssertionResult same_codes(const Tensor& got, const Tensor& want) {
  const Tensor g = got.to(Device::cpu()).contiguous(), w = want.to(Device::cpu()).contiguous();
  if (g.shape() != w.shape())
    return ::testing::AssertionFailure() << "shape " << g.str() << " vs " << w.str();
  const auto* gp = static_cast<const uint8_t*>(g.data_ptr());
  const auto* wp = static_cast<const uint8_t*>(w.data_ptr());
  for (int64_t i = 0; i < g.numel(); ++i)
    if (gp[i] != wp[i] && !(is_nan_code(gp[i]) && is_nan_code(wp[i])))
      return ::testing::AssertionFailure()
             << "code " << i << " (row " << i / g.size(1) << ", col " << i % g.size(1)
             << "): got 0x" << std::hex << int(gp[i]) << ", CPU 0x" << int(wp[i]);
  return ::testing::AssertionSuccess();
}

// Scales bit-equal, or both NaN.
::testing::AssertionResult same_scales(const Tensor& got, const Tensor& want) {
  const Tensor g = got.to(Device::cpu()).contiguous(), w = want.to(Device::cpu()).contiguous();
  if (g.shape() != w.shape())
    return ::testing::AssertionFailure() << "shape " << g.str() << " vs " << w.str();
  for (int64_t i = 0; i < g.numel(); ++i) {
    const float a = g.data<float>()[i], b = w.data<float>()[i];
    if (float_bits(a) != float_bits(b) && !(std::isnan(a) && std::isnan(b)))
      return ::testing::AssertionFailure() << "scale " << i << ": got " << a << ", CPU " << b;
  }
  return ::testing::AssertionSuccess();
}

void expect_same_quantisation(const ops::Fp8Blocks& gpu, const ops::Fp8Blocks& cpu,
                              const std::string& what) {
  EXPECT_EQ(gpu.block_rows, cpu.block_rows) << what;
  EXPECT_EQ(gpu.block_cols, cpu.block_cols) << what;
  EXPECT_TRUE(gpu.values.device().is_cuda()) << what;
  EXPECT_TRUE(cuda::is_fp8_gemm_layout(gpu)) << what;
  EXPECT_TRUE(same_codes(gpu.values, cpu.values)) << ctx(what);
  EXPECT_TRUE(same_scales(gpu.scales, cpu.scales)) << ctx(what);
}

// The dequantised values in double: code · scale, exact.
std::vector<double> dequantised(const ops::Fp8Blocks& q) {
  const Tensor v = q.values.to(Device::cpu()).contiguous();
  const Tensor s = q.scales.to(Device::cpu()).contiguous();
  const int64_t rows = v.size(0), cols = v.size(1), scols = s.size(1);
  std::vector<double> out(size_t(rows * cols));
  const auto* vp = static_cast<const uint8_t*>(v.data_ptr());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out[size_t(r * cols + c)] =
          double(fp8e4m3_to_f32(vp[r * cols + c])) *
          double(s.data<float>()[(r / q.block_rows) * scols + c / q.block_cols]);
  return out;
}

// C[m, n] = Σ_k A(m, k) B(n, k) in f64 with S = Σ |A B|; A(m, k) = a[m·sa_m + k·sa_k] etc.
struct Reference {
  std::vector<double> value, abs_sum;
};
Reference reference(const std::vector<double>& a, int64_t sa_m, int64_t sa_k,
                    const std::vector<double>& b, int64_t sb_n, int64_t sb_k, int64_t m, int64_t n,
                    int64_t k) {
  Reference r{std::vector<double>(size_t(m * n)), std::vector<double>(size_t(m * n))};
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0, abs = 0;
      for (int64_t t = 0; t < k; ++t) {
        const double p = a[size_t(i * sa_m + t * sa_k)] * b[size_t(j * sb_n + t * sb_k)];
        acc += p;
        abs += std::fabs(p);
      }
      r.value[size_t(i * n + j)] = acc;
      r.abs_sum[size_t(i * n + j)] = abs;
    }
  return r;
}

// Every element within the bound of the header comment; `base` is added to the reference (the
// prior content of an accumulated output). Prints the worst |error| / S.
void expect_within_bound(const Tensor& got, const Reference& ref, int64_t k,
                         const std::vector<double>& base, const std::string& what) {
  const Tensor g = f32(got);
  const double out_round = got.dtype() == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -23);
  const double per_s = std::ldexp(1.0, -8) + double(k / 128 + 2) * std::ldexp(1.0, -24);
  double worst = 0;
  int64_t bad = 0, first_bad = -1;
  for (int64_t i = 0; i < g.numel(); ++i) {
    const double want = ref.value[size_t(i)] + (base.empty() ? 0.0 : base[size_t(i)]);
    const double err = std::fabs(double(g.data<float>()[i]) - want);
    const double s = ref.abs_sum[size_t(i)];
    const double bound = per_s * s + out_round * std::fabs(want) + 1e-30;
    if (s > 0) worst = std::max(worst, err / s);
    if (!(err <= bound)) {
      if (first_bad < 0) first_bad = i;
      ++bad;
    }
  }
  std::printf("[ measure  ] %s: max |err| / sum|ab| %.2e (bar %.2e)\n", what.c_str(), worst, per_s);
  EXPECT_EQ(bad, 0) << ctx(what) << ": " << bad << " elements outside the bound, first at "
                    << first_bad << " (got " << g.data<float>()[std::max<int64_t>(first_bad, 0)]
                    << ", want " << ref.value[size_t(std::max<int64_t>(first_bad, 0))] << ")";
}

// Runs `fn`; a glmtune::Error (e.g. no cuBLASLt algorithm) fails the test with its full message.
template <typename Fn>
void run_or_fail(const std::string& what, Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    FAIL() << what << ": " << e.what() << " [" << e.where() << "] " << e.fix();
  }
}

#endif

}  // namespace

// First in the file: the block-scaled FP8 GEMMs exist on this GPU. No algorithm is a failure that
// names the cuBLAS status, never a skip.
TEST(CudaFp8, CublasLtHasBlockScaledAlgorithms) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const Tensor x = varied(128, 256, DType::bf16, 1).to(kGpu);
  const Tensor w = varied(128, 256, DType::bf16, 2).to(kGpu);
  const Tensor dy = varied(128, 128, DType::bf16, 3).to(kGpu);
  run_or_fail("forward (VEC128 x BLK128x128)", [&] {
    cuda::fp8_linear(cuda::quantize_fp8_blocks(x, 1, 128), cuda::quantize_fp8_blocks(w, 128, 128));
  });
  run_or_fail("input gradient (VEC128 x BLK128x128, transposed weight)", [&] {
    Tensor dx = Tensor::empty({128, 256}, DType::bf16, kGpu);
    cuda::fp8_linear_backward_input_out(
        dx, cuda::quantize_fp8_blocks(dy, 1, 128),
        cuda::transpose_fp8_weight(cuda::quantize_fp8_blocks(w, 128, 128)));
  });
  run_or_fail("weight gradient (VEC128 x VEC128)", [&] {
    Tensor dw = Tensor::zeros({128, 256}, DType::f32, kGpu);
    cuda::fp8_linear_backward_weight(dw, cuda::quantize_fp8_blocks(dy, 128, 1),
                                     cuda::quantize_fp8_blocks(x, 128, 1));
  });
  // Asynchronous failures of the launches surface here, inside this test.
  GLMTUNE_CUDA_CHECK(cudaDeviceSynchronize());
#endif
}

TEST(CudaFp8, QuantisersMatchTheCpuReferenceBitForBit) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  // Partial tiles on both edges, a single element, rows not a multiple of 4 or 16, a wide case.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 1},     {3, 130},  {130, 200},
                                                           {257, 384}, {129, 17}, {1000, 1024}};
  uint64_t stream = 10;
  for (const auto& [rows, cols] : shapes)
    for (DType dt : {DType::bf16, DType::f32}) {
      const Tensor x = varied(rows, cols, dt, stream += 3);
      const Tensor xg = x.to(kGpu);
      for (const auto& [br, bc] :
           std::vector<std::pair<int64_t, int64_t>>{{1, 128}, {128, 128}, {128, 1}}) {
        const std::string what = shape_name(rows, cols) + " " + std::string(dtype_name(dt)) +
                                 " blocks " + shape_name(br, bc);
        const ops::Fp8Blocks cpu = ops::quantize_fp8_blocks(x, br, bc);
        // Through the leaf-op dispatch and directly.
        expect_same_quantisation(ops::quantize_fp8_blocks(xg, br, bc), cpu, what + " (dispatch)");
        expect_same_quantisation(cuda::quantize_fp8_blocks(xg, br, bc), cpu, what);
      }
    }
#endif
}

// Released FP8 weights stacked as pieces (the fused experts' gate_e, up_e, …), each with its own
// 128 × 128 block grid, partial blocks included: the device's dequantisation equals the CPU's
// (io::dequantize_fp8_block per piece) bit for bit, into bf16 and into f32, for rows of whole
// 8-code vectors and for odd widths. Every finite e4m3 code occurs (NaN codes are not weights).
TEST(CudaFp8, StackedReleasedWeightsDequantiseAsOnTheCpu) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  uint64_t stream = 40;
  for (const auto& [pieces, rows, cols] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {1, 1, 8}, {3, 130, 200}, {2, 256, 384}, {5, 17, 129}, {4, 300, 136}}) {
    const std::string what = std::to_string(pieces) + " pieces of " + shape_name(rows, cols) +
                             " (seed " + std::to_string(test_seed()) + ")";
    Tensor codes = Tensor::empty({pieces * rows, cols}, DType::fp8e4m3);
    auto* c = static_cast<uint8_t*>(codes.data_ptr());
    const Tensor draw = random_cpu({codes.numel()}, DType::f32, stream++);
    for (int64_t i = 0; i < codes.numel(); ++i) {
      uint8_t v = uint8_t(int64_t(std::fabs(draw.data<float>()[i]) * 1e6) % 256);
      if ((v & 0x7f) == 0x7f) v ^= 1;  // e4m3fn's NaN codes
      c[i] = v;
    }
    const Tensor scales =
        random_cpu({pieces, (rows + 127) / 128, (cols + 127) / 128}, DType::f32, stream++, 1e-3);
    const Shape shape{pieces, rows, cols};
    for (DType out : {DType::bf16, DType::f32}) {
      const Tensor cpu = ops::dequantize_fp8_pieces(codes, scales, rows, shape, out);
      const Tensor gpu =
          ops::dequantize_fp8_pieces(codes.to(kGpu), scales.to(kGpu), rows, shape, out);
      EXPECT_EQ(gpu.shape(), shape) << ctx(what);
      EXPECT_TRUE(bit_identical(gpu.to(Device::cpu()), cpu))
          << ctx(what + " into " + std::string(dtype_name(out)));
    }
    // Each piece is its own released tensor dequantised.
    const Tensor all = ops::dequantize_fp8_pieces(codes, scales, rows, shape, DType::bf16);
    const Tensor last = io::dequantize_fp8_block(codes.narrow(0, (pieces - 1) * rows, rows),
                                                 scales.select(0, pieces - 1));
    EXPECT_TRUE(bit_identical(all.select(0, pieces - 1).contiguous(), last)) << ctx(what);
  }
#endif
}

TEST(CudaFp8, QuantisersFollowTheNonFiniteRules) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const int64_t rows = 260, cols = 300;
  Tensor x = varied(rows, cols, DType::f32, 40);
  float* p = x.data<float>();
  for (int64_t c = 0; c < 128; ++c)  // a block of zeros (rows 0..127, cols 0..127), −0 included
    for (int64_t r = 0; r < 128; ++r) p[r * cols + c] = (r + c) % 2 ? 0.0f : -0.0f;
  p[5 * cols + 200] = NAN;           // NaN
  p[140 * cols + 10] = INFINITY;     // +inf
  p[141 * cols + 250] = -INFINITY;   // −inf
  p[200 * cols + 140] = 3.0e38f;     // huge: its block's other values go subnormal or to 0
  p[201 * cols + 141] = -1.0e-30f;   // tiny, in the huge value's block
  p[259 * cols + 299] = 448.0f * 3;  // the last (partial) tile's amax
  for (DType dt : {DType::f32, DType::bf16}) {
    const Tensor xd = x.to(dt);
    for (const auto& [br, bc] :
         std::vector<std::pair<int64_t, int64_t>>{{1, 128}, {128, 128}, {128, 1}}) {
      const std::string what = std::string(dtype_name(dt)) + " blocks " + shape_name(br, bc);
      expect_same_quantisation(cuda::quantize_fp8_blocks(xd.to(kGpu), br, bc),
                               ops::quantize_fp8_blocks(xd, br, bc), what);
    }
  }
  // The zero block: scale 1e-12 / 448, codes ±0.
  const ops::Fp8Blocks q = cuda::quantize_fp8_blocks(x.to(kGpu), 128, 128);
  EXPECT_EQ(f32(q.scales).data<float>()[0], float(1e-12 / 448.0));
#endif
}

TEST(CudaFp8, PaddingOfTheGemmLayoutIsZero) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  // 128 x 1: 37 tokens are stored in rows of 48 codes; codes 37..47 of every column are 0 (they
  // join the weight gradient's reduction). 1 x 128 with 37 rows: scales padded to 40 per block.
  const Tensor x = varied(37, 50, DType::bf16, 50).to(kGpu);
  const ops::Fp8Blocks c = cuda::quantize_fp8_blocks(x, 128, 1);
  ASSERT_EQ(c.values.stride(1), 48);
  const Tensor raw = Tensor::from_storage(c.values.storage(), c.values.storage_offset(), {50, 48},
                                          {48, 1}, DType::fp8e4m3)
                         .to(Device::cpu());
  for (int64_t col = 0; col < 50; ++col)
    for (int64_t r = 37; r < 48; ++r)
      EXPECT_EQ(static_cast<const uint8_t*>(raw.data_ptr())[col * 48 + r], 0) << col << "," << r;
  // The GEMM runs on 40 rows (cuBLASLt's VEC128 takes outer dimensions that are multiples of 4):
  // codes of rows 37..39 are there and 0, so the padding rows of the product are 0.
  const ops::Fp8Blocks t = cuda::quantize_fp8_blocks(x, 1, 128);
  ASSERT_EQ(t.scales.stride(1), 40);
  const Tensor sraw = Tensor::from_storage(t.scales.storage(), t.scales.storage_offset(), {1, 40},
                                           {40, 1}, DType::f32)
                          .to(Device::cpu());
  for (int64_t r = 37; r < 40; ++r) EXPECT_EQ(sraw.data<float>()[r], 0.0f) << r;
  ASSERT_GE(t.values.storage()->bytes(), size_t(40 * 50));
  const Tensor vraw = Tensor::from_storage(t.values.storage(), t.values.storage_offset(), {40, 50},
                                           {50, 1}, DType::fp8e4m3)
                          .to(Device::cpu());
  for (int64_t r = 37; r < 40; ++r)
    for (int64_t col = 0; col < 50; ++col)
      EXPECT_EQ(static_cast<const uint8_t*>(vraw.data_ptr())[r * 50 + col], 0) << r << "," << col;
  // The same layout when a CPU quantisation is moved.
  const ops::Fp8Blocks moved =
      cuda::fp8_blocks_to_device(ops::quantize_fp8_blocks(x.to(Device::cpu()), 1, 128), kGpu);
  ASSERT_GE(moved.values.storage()->bytes(), size_t(40 * 50));
#endif
}

TEST(CudaFp8, TransposedWeightAndDeviceLayoutMatchTheCpu) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{{272, 320}, {640, 1152}}) {
    const Tensor w = varied(n, k, DType::bf16, 60 + uint64_t(n));
    const std::string what = shape_name(n, k);
    const ops::Fp8Blocks wg = cuda::quantize_fp8_blocks(w.to(kGpu), 128, 128);
    expect_same_quantisation(cuda::transpose_fp8_weight(wg),
                             ops::quantize_fp8_blocks(w.transpose(0, 1).contiguous(), 128, 128),
                             what + " transposed");
    for (const auto& [br, bc] :
         std::vector<std::pair<int64_t, int64_t>>{{1, 128}, {128, 128}, {128, 1}}) {
      const ops::Fp8Blocks cpu = ops::quantize_fp8_blocks(w, br, bc);
      expect_same_quantisation(cuda::fp8_blocks_to_device(cpu, kGpu), cpu,
                               what + " moved, blocks " + shape_name(br, bc));
    }
  }
#endif
}

TEST(CudaFp8, ForwardMatchesTheDequantisedProduct) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  // K = 320 and 1040 are not multiples of 128 (a partial last block); M = 1001, 37, 3 and 1 are
  // not multiples of 4 (the GEMM runs on rows padded to 4 through a staging output).
  struct Case {
    int64_t m, n, k;
  };
  const Case cases[] = {
      {256, 256, 512}, {1001, 384, 320}, {37, 128, 1040}, {3, 64, 256}, {1, 16, 16}};
  uint64_t stream = 70;
  for (const Case& c : cases) {
    const Tensor x = varied(c.m, c.k, DType::bf16, stream += 3);
    const Tensor w = varied(c.n, c.k, DType::bf16, stream += 3);
    const ops::Fp8Blocks xq = ops::quantize_fp8_blocks(x, 1, 128);
    const ops::Fp8Blocks wq = ops::quantize_fp8_blocks(w, 128, 128);
    const Reference ref =
        reference(dequantised(xq), c.k, 1, dequantised(wq), c.k, 1, c.m, c.n, c.k);
    const ops::Fp8Blocks xg = cuda::quantize_fp8_blocks(x.to(kGpu), 1, 128);
    const ops::Fp8Blocks wg = cuda::quantize_fp8_blocks(w.to(kGpu), 128, 128);
    for (DType out : {DType::bf16, DType::f32}) {
      const std::string what = "forward M" + std::to_string(c.m) + " N" + std::to_string(c.n) +
                               " K" + std::to_string(c.k) + " " + std::string(dtype_name(out));
      Tensor y = Tensor::full({c.m, c.n}, NAN, out, kGpu);
      run_or_fail(what, [&] { cuda::fp8_linear_out(y, xg, wg); });
      expect_within_bound(y, ref, c.k, {}, what);
      // Operands laid out from the CPU quantisation give the same bits; a rerun too.
      Tensor y2 = Tensor::full({c.m, c.n}, NAN, out, kGpu);
      run_or_fail(what, [&] {
        cuda::fp8_linear_out(y2, cuda::fp8_blocks_to_device(xq, kGpu),
                             cuda::fp8_blocks_to_device(wq, kGpu));
      });
      EXPECT_TRUE(bit_identical(y, y2)) << ctx(what);
      // Accumulation adds to what y holds. y is rows 4 .. 4 + M of a larger buffer whose other
      // rows hold a sentinel: nothing outside y is written (the padded GEMM rows included).
      const Tensor base = varied(c.m, c.n, out, stream + 1);
      Tensor big = Tensor::full({c.m + 8, c.n}, 7.0, out, kGpu);
      Tensor acc = big.slice(0, 4, 4 + c.m);
      acc.copy_(base.to(kGpu));
      run_or_fail(what, [&] { cuda::fp8_linear_out(acc, xg, wg, true); });
      expect_within_bound(acc, ref, c.k, base.to(DType::f64).to_doubles(), what + " accumulated");
      const Tensor around = f32(big);
      for (int64_t r : {int64_t(0), int64_t(3), c.m + 4, c.m + 7})
        for (int64_t j = 0; j < c.n; ++j)
          ASSERT_EQ(around.data<float>()[r * c.n + j], 7.0f)
              << what << ": row " << r << " outside y was written";
    }
  }
#endif
}

TEST(CudaFp8, InputGradientMatchesTheDequantisedProduct) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  struct Case {
    int64_t m, n, k;
  };
  const Case cases[] = {{300, 256, 384}, {77, 400, 144}, {2, 128, 128}};
  uint64_t stream = 90;
  for (const Case& c : cases) {
    const Tensor dy = varied(c.m, c.n, DType::bf16, stream += 3);
    const Tensor w = varied(c.n, c.k, DType::bf16, stream += 3);
    const ops::Fp8Blocks dyq = ops::quantize_fp8_blocks(dy, 1, 128);
    const ops::Fp8Blocks wq = ops::quantize_fp8_blocks(w, 128, 128);
    // dx[m, k] = Σ_n dy(m, n) w(n, k).
    const Reference ref =
        reference(dequantised(dyq), c.n, 1, dequantised(wq), 1, c.k, c.m, c.k, c.n);
    const ops::Fp8Blocks w_t =
        cuda::transpose_fp8_weight(cuda::quantize_fp8_blocks(w.to(kGpu), 128, 128));
    for (DType out : {DType::bf16, DType::f32}) {
      const std::string what = "dX M" + std::to_string(c.m) + " N" + std::to_string(c.n) + " K" +
                               std::to_string(c.k) + " " + std::string(dtype_name(out));
      Tensor dx = Tensor::full({c.m, c.k}, NAN, out, kGpu);
      run_or_fail(what, [&] {
        cuda::fp8_linear_backward_input_out(dx, cuda::quantize_fp8_blocks(dy.to(kGpu), 1, 128),
                                            w_t);
      });
      expect_within_bound(dx, ref, c.n, {}, what);
    }
  }
#endif
}

TEST(CudaFp8, WeightGradientMatchesTheDequantisedProduct) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  // Token counts not multiples of 16 (zero-padded reduction) or of 128 (a partial last tile).
  struct Case {
    int64_t t, n, k;
  };
  const Case cases[] = {{300, 256, 384}, {17, 128, 64}, {1024, 144, 272}};
  uint64_t stream = 110;
  for (const Case& c : cases) {
    const Tensor dy = varied(c.t, c.n, DType::bf16, stream += 3);
    const Tensor x = varied(c.t, c.k, DType::bf16, stream += 3);
    const ops::Fp8Blocks dyq = ops::quantize_fp8_blocks(dy, 128, 1);
    const ops::Fp8Blocks xq = ops::quantize_fp8_blocks(x, 128, 1);
    // dw[n, k] = Σ_t dy(t, n) x(t, k).
    const Reference ref =
        reference(dequantised(dyq), 1, c.n, dequantised(xq), 1, c.k, c.n, c.k, c.t);
    const ops::Fp8Blocks dyg = cuda::quantize_fp8_blocks(dy.to(kGpu), 128, 1);
    const ops::Fp8Blocks xg = cuda::quantize_fp8_blocks(x.to(kGpu), 128, 1);
    for (DType out : {DType::f32, DType::bf16}) {
      const std::string what = "dW T" + std::to_string(c.t) + " N" + std::to_string(c.n) + " K" +
                               std::to_string(c.k) + " " + std::string(dtype_name(out));
      Tensor dw = Tensor::full({c.n, c.k}, NAN, out, kGpu);
      run_or_fail(what, [&] { cuda::fp8_linear_backward_weight(dw, dyg, xg, false); });
      expect_within_bound(dw, ref, c.t, {}, what);
      const Tensor base = varied(c.n, c.k, out, stream + 1);
      Tensor acc = base.to(kGpu);
      run_or_fail(what, [&] { cuda::fp8_linear_backward_weight(acc, dyg, xg, true); });
      expect_within_bound(acc, ref, c.t, base.to(DType::f64).to_doubles(), what + " accumulated");
    }
  }
#endif
}

// The experts' quantisations of one permuted buffer (one launch for up to
// fp8_kernels::kMaxGroupsPerLaunch groups, one per group above): each group's codes and scales bit
// for bit the CPU reference on its rows alone, in the GEMM layout, for 1 × 128 and 128 × 1 tiles,
// bf16 and f32, rows of a wider buffer, and groups of 0, 1, 3, 127, 128, 129 and 300 rows.
TEST(CudaFp8, GroupedQuantisersMatchEachGroupAlone) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const std::vector<int64_t> sizes = {0, 1, 3, 127, 128, 129, 300, 0, 17, 64};
  for (const int64_t groups : {int64_t(10), int64_t(40), int64_t(330)}) {
    std::vector<int64_t> offsets = {0};
    for (int64_t g = 0; g < groups; ++g)
      offsets.push_back(offsets.back() + sizes[size_t(g) % sizes.size()] / (groups > 40 ? 8 : 1));
    const int64_t rows = offsets.back();
    // 130 columns: no four-value loads, a partial last tile.
    for (const auto& [cols, dtype] :
         {std::pair{int64_t(272), DType::bf16}, std::pair{int64_t(272), DType::f32},
          std::pair{int64_t(130), DType::bf16}}) {
      // Rows of a wider buffer: the row pitch is not the width.
      const Tensor wide = varied(rows, cols + 48, dtype, 960 + uint64_t(groups + cols));
      const Tensor x = wide.to(kGpu).narrow(1, 16, cols);
      const Tensor x_cpu = wide.narrow(1, 16, cols).to(DType::f32);
      for (const auto& [br, bc] : {std::pair<int64_t, int64_t>{1, 128}, {128, 1}}) {
        std::vector<ops::Fp8Blocks> got;
        run_or_fail("quantize_fp8_grouped",
                    [&] { got = cuda::quantize_fp8_grouped(x, offsets, br, bc); });
        ASSERT_EQ(got.size(), size_t(groups));
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t r0 = offsets[size_t(g)], n = offsets[size_t(g) + 1] - r0;
          if (n == 0) continue;
          const std::string what = fmt::format("{} groups, {} cols {}, {} x {}, group {} ({} rows)",
                                               groups, cols, dtype_name(dtype), br, bc, g, n);
          expect_same_quantisation(
              got[size_t(g)],
              ops::quantize_fp8_blocks(x_cpu.slice(0, r0, r0 + n).contiguous(), br, bc), what);
        }
      }
    }
  }
#endif
}

TEST(CudaFp8, GroupedGemmsMatchPerExpertProducts) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  // Five experts with 0, 130, 1, 257 and 64 rows; N 256, K 384.
  const std::vector<int64_t> offsets = {0, 0, 130, 131, 388, 452};
  const int64_t g_count = 5, total = offsets.back(), n = 256, k = 384;
  const Tensor x = varied(total, k, DType::bf16, 130);
  const Tensor dy = varied(total, n, DType::bf16, 133);
  Tensor w = Tensor::empty({g_count, n, k}, DType::bf16);
  for (int64_t g = 0; g < g_count; ++g)
    w.select(0, g).copy_(varied(n, k, DType::bf16, 140 + uint64_t(g)));
  const Tensor xg = x.to(kGpu), dyg = dy.to(kGpu), wg = w.to(kGpu);
  const std::vector<ops::Fp8Blocks> w_q = cuda::quantize_fp8_weight_grouped(wg);
  Tensor y = Tensor::full({total, n}, NAN, DType::bf16, kGpu);
  Tensor dx = Tensor::full({total, k}, NAN, DType::f32, kGpu);
  Tensor dw = Tensor::zeros({g_count, n, k}, DType::f32, kGpu);
  // One call each, so that a refused product does not keep the others from running.
  run_or_fail("grouped forward", [&] {
    cuda::fp8_grouped_linear(y, cuda::quantize_fp8_grouped(xg, offsets, 1, 128), w_q, offsets);
  });
  run_or_fail("grouped dX", [&] {
    cuda::fp8_grouped_linear_backward_input(dx, cuda::quantize_fp8_grouped(dyg, offsets, 1, 128),
                                            w_q, offsets);
  });
  run_or_fail("grouped dW", [&] {
    cuda::fp8_grouped_linear_backward_weight(dw, cuda::quantize_fp8_grouped(dyg, offsets, 128, 1),
                                             cuda::quantize_fp8_grouped(xg, offsets, 128, 1),
                                             offsets);
  });
  for (int64_t g = 0; g < g_count; ++g) {
    const int64_t r0 = offsets[size_t(g)], rows = offsets[size_t(g) + 1] - r0;
    const std::string what = "expert " + std::to_string(g) + " (" + std::to_string(rows) + " rows)";
    const ops::Fp8Blocks wq = ops::quantize_fp8_blocks(w.select(0, g).contiguous(), 128, 128);
    expect_same_quantisation(w_q[size_t(g)], wq, what + " weight");
    const std::vector<double> wd = dequantised(wq);
    const Tensor dwg = dw.select(0, g);
    if (rows == 0) {
      // No rows, no gradient.
      const Tensor d = f32(dwg);
      for (int64_t i = 0; i < d.numel(); ++i) ASSERT_EQ(d.data<float>()[i], 0.0f) << what;
      continue;
    }
    const Tensor xs = x.slice(0, r0, r0 + rows).contiguous();
    const Tensor dys = dy.slice(0, r0, r0 + rows).contiguous();
    const std::vector<double> xd = dequantised(ops::quantize_fp8_blocks(xs, 1, 128));
    const std::vector<double> dyd = dequantised(ops::quantize_fp8_blocks(dys, 1, 128));
    expect_within_bound(y.slice(0, r0, r0 + rows), reference(xd, k, 1, wd, k, 1, rows, n, k), k, {},
                        what + " forward");
    expect_within_bound(dx.slice(0, r0, r0 + rows), reference(dyd, n, 1, wd, 1, k, rows, k, n), n,
                        {}, what + " dX");
    const ops::Fp8Blocks dy_cols = ops::quantize_fp8_blocks(dys, 128, 1);
    const ops::Fp8Blocks x_cols = ops::quantize_fp8_blocks(xs, 128, 1);
    expect_within_bound(
        dwg, reference(dequantised(dy_cols), 1, n, dequantised(x_cols), 1, k, n, k, rows), rows, {},
        what + " dW");
    // Each expert is the dense product of its own rows quantised on the CPU: the same problem,
    // hence the same cached algorithm, so the same bits. A slip in an expert's row range, offset or
    // padding shows here independently of the GEMM's rounding.
    Tensor y_dense = Tensor::full({rows, n}, NAN, DType::bf16, kGpu);
    Tensor dx_dense = Tensor::full({rows, k}, NAN, DType::f32, kGpu);
    Tensor dw_dense = Tensor::zeros({n, k}, DType::f32, kGpu);
    run_or_fail(what + " dense", [&] {
      const ops::Fp8Blocks wq_dev = cuda::fp8_blocks_to_device(wq, kGpu);
      cuda::fp8_linear_out(
          y_dense, cuda::fp8_blocks_to_device(ops::quantize_fp8_blocks(xs, 1, 128), kGpu), wq_dev);
      cuda::fp8_linear_backward_input_out(
          dx_dense, cuda::fp8_blocks_to_device(ops::quantize_fp8_blocks(dys, 1, 128), kGpu),
          cuda::transpose_fp8_weight(wq_dev));
      cuda::fp8_linear_backward_weight(dw_dense, cuda::fp8_blocks_to_device(dy_cols, kGpu),
                                       cuda::fp8_blocks_to_device(x_cols, kGpu), true);
    });
    EXPECT_TRUE(bit_identical(y.slice(0, r0, r0 + rows), y_dense)) << ctx(what + " forward");
    EXPECT_TRUE(bit_identical(dx.slice(0, r0, r0 + rows), dx_dense)) << ctx(what + " dX");
    EXPECT_TRUE(bit_identical(dwg, dw_dense)) << ctx(what + " dW");
  }
#endif
}

// The grouped kernel with the offsets on the device (Hopper): every expert in one launch, reading
// the whole buffer's 1 × 128 tiles and the experts' weights as one stack of 128 × 128 blocks. Each
// expert's rows within the bound of its dequantised product (empty experts, a row tile of one row,
// tiles running into the next expert, a partial last k block); the rows past the offsets' end
// untouched; a rerun bit-identical; the input gradient through transposed chunks of two experts
// the same bits as through one chunk; the weight gradient's token tiles and its product. Skipped on
// a GPU without the sm_90a kernels.
TEST(CudaFp8, GroupedKernelWithDeviceOffsetsMatchesTheDequantisedProduct) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  if (!cuda::fp8_grouped_device_offsets_possible(kGpu.index, 1, 128, 128))
    GTEST_SKIP() << "the grouped FP8 kernel needs an sm_90a build on a compute capability 9.x GPU";
  struct Case {
    std::vector<int32_t> offsets;
    int64_t extra_rows, n, k;
  };
  const Case cases[] = {{{0, 0, 130, 131, 388, 452, 752}, 5, 256, 384},
                        {{0, 50, 50, 250}, 3, 128, 336}};
  uint64_t stream = 160;
  for (const Case& c : cases) {
    const int64_t groups = int64_t(c.offsets.size()) - 1, used = c.offsets.back();
    const int64_t total = used + c.extra_rows, n = c.n, k = c.k;
    const std::string name =
        std::to_string(groups) + " experts N" + std::to_string(n) + " K" + std::to_string(k);
    const Tensor x = varied(total, k, DType::bf16, stream += 7);
    const Tensor dy = varied(total, n, DType::bf16, stream += 7);
    Tensor w = Tensor::empty({groups, n, k}, DType::bf16);
    for (int64_t g = 0; g < groups; ++g)
      w.select(0, g).copy_(varied(n, k, DType::bf16, stream + 100 + uint64_t(g)));
    const Tensor offsets = Tensor::from_vector(c.offsets, {groups + 1}).to(kGpu);
    const ops::Fp8Blocks xq = cuda::quantize_fp8_blocks(x.to(kGpu), 1, 128);
    const ops::Fp8Blocks dyq = cuda::quantize_fp8_blocks(dy.to(kGpu), 1, 128);
    const ops::Fp8Blocks w_stack =
        cuda::quantize_fp8_blocks(w.to(kGpu).reshape({groups * n, k}), 128, 128);
    const std::vector<double> xd = dequantised(ops::quantize_fp8_blocks(x, 1, 128));
    const std::vector<double> dyd = dequantised(ops::quantize_fp8_blocks(dy, 1, 128));

    Tensor y_bf16 = Tensor::full({total, n}, 7.0, DType::bf16, kGpu);
    Tensor y_f32 = Tensor::full({total, n}, 7.0, DType::f32, kGpu);
    Tensor y_again = Tensor::full({total, n}, 7.0, DType::f32, kGpu);
    const Tensor base = varied(total, n, DType::f32, stream + 50);
    Tensor y_acc = base.to(kGpu);
    run_or_fail(name + " forward", [&] {
      ASSERT_TRUE(cuda::fp8_grouped_device_offsets_fit(xq, w_stack, y_bf16, groups));
      cuda::fp8_grouped_linear(y_bf16, xq, w_stack, offsets);
      cuda::fp8_grouped_linear(y_f32, xq, w_stack, offsets);
      cuda::fp8_grouped_linear(y_again, xq, w_stack, offsets);
      cuda::fp8_grouped_linear(y_acc, xq, w_stack, offsets, nullptr, /*accumulate=*/true);
    });
    EXPECT_TRUE(bit_identical(y_f32, y_again)) << ctx(name + " forward rerun");
    const bool dx_possible = k % 128 == 0;
    Tensor dx = Tensor::full({total, k}, 7.0, DType::bf16, kGpu);
    Tensor dx_chunked = Tensor::full({total, k}, 7.0, DType::bf16, kGpu);
    if (dx_possible) {
      run_or_fail(name + " dX", [&] {
        cuda::fp8_grouped_linear_backward_input(dx, dyq, w_stack, offsets);
        cuda::fp8_grouped_linear_backward_input(dx_chunked, dyq, w_stack, offsets, nullptr,
                                                2 * n * k);
      });
      // Only where dX ran: two untouched buffers would compare equal whatever the kernel did.
      EXPECT_TRUE(bit_identical(dx, dx_chunked)) << ctx(name + " dX in chunks of two experts");
    }

    const Tensor base_cpu = base.contiguous();
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t r0 = c.offsets[size_t(g)], rows = c.offsets[size_t(g) + 1] - r0;
      const std::string what =
          name + ", expert " + std::to_string(g) + " (" + std::to_string(rows) + " rows)";
      const ops::Fp8Blocks wq = ops::quantize_fp8_blocks(w.select(0, g).contiguous(), 128, 128);
      // The stack holds each expert's own blocks.
      EXPECT_TRUE(same_codes(w_stack.values.narrow(0, g * n, n), wq.values)) << ctx(what);
      EXPECT_TRUE(same_scales(w_stack.scales.narrow(0, g * n / 128, n / 128), wq.scales))
          << ctx(what);
      if (dx_possible) {
        const ops::Fp8Blocks t_stack = cuda::transpose_fp8_weight_stack(w_stack, n, g, 1);
        const ops::Fp8Blocks t_one =
            cuda::transpose_fp8_weight(cuda::fp8_blocks_to_device(wq, kGpu));
        EXPECT_TRUE(same_codes(t_stack.values, t_one.values)) << ctx(what + " transposed");
        EXPECT_TRUE(same_scales(t_stack.scales, t_one.scales)) << ctx(what + " transposed");
      }
      if (rows == 0) continue;
      const std::vector<double> wd = dequantised(wq);
      const std::vector<double> xs(xd.begin() + r0 * k, xd.begin() + (r0 + rows) * k);
      const Reference ref = reference(xs, k, 1, wd, k, 1, rows, n, k);
      expect_within_bound(y_bf16.slice(0, r0, r0 + rows), ref, k, {}, what + " forward bf16");
      expect_within_bound(y_f32.slice(0, r0, r0 + rows), ref, k, {}, what + " forward f32");
      const Tensor b = base_cpu.slice(0, r0, r0 + rows).contiguous();
      expect_within_bound(y_acc.slice(0, r0, r0 + rows), ref, k,
                          std::vector<double>(b.data<float>(), b.data<float>() + b.numel()),
                          what + " forward accumulated");
      if (dx_possible) {
        const std::vector<double> dys(dyd.begin() + r0 * n, dyd.begin() + (r0 + rows) * n);
        expect_within_bound(dx.slice(0, r0, r0 + rows), reference(dys, n, 1, wd, 1, k, rows, k, n),
                            n, {}, what + " dX");
      }
    }
    // The weight gradient: dy and x in 128 × 1 tiles per expert, every expert's tiles in one
    // transposed matrix (bit for bit each expert's CPU quantisation, zero past its rows), then
    // dw[g] += dy_gᵀ x_g in one launch, into an f32 gradient that holds values already.
    if (dx_possible) {
      cuda::Fp8TokenTiles dy_t, x_t;
      run_or_fail(name + " token tiles", [&] {
        dy_t = cuda::quantize_fp8_token_tiles(dy.to(kGpu), offsets);
        x_t = cuda::quantize_fp8_token_tiles(x.to(kGpu), offsets);
      });
      const Tensor tiles = dy_t.tiles.to(Device::cpu());
      const Tensor dw_base = varied(groups * n, k, DType::f32, stream + 60);
      Tensor dw = dw_base.to(kGpu).reshape({groups, n, k});
      run_or_fail(name + " dW",
                  [&] { cuda::fp8_grouped_linear_backward_weight(dw, dy_t, x_t, offsets); });
      for (const auto& [q, src, cols] : {std::tuple{&dy_t, &dy, n}, std::tuple{&x_t, &x, k}}) {
        const Tensor codes = q->codes.to(Device::cpu()).contiguous();
        const Tensor scales = q->scales.to(Device::cpu()).contiguous();
        const auto* cp = static_cast<const uint8_t*>(codes.data_ptr());
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t r0 = c.offsets[size_t(g)], rows = c.offsets[size_t(g) + 1] - r0;
          const int64_t first = tiles.data<int32_t>()[g];
          ASSERT_EQ(tiles.data<int32_t>()[g + 1] - first, (rows + 127) / 128) << name;
          if (rows == 0) continue;
          const ops::Fp8Blocks want =
              ops::quantize_fp8_blocks(src->slice(0, r0, r0 + rows).contiguous(), 128, 1);
          const Tensor wv = want.values.contiguous(), ws = want.scales.contiguous();
          const auto* wp = static_cast<const uint8_t*>(wv.data_ptr());
          for (int64_t col = 0; col < cols; ++col) {
            for (int64_t r = 0; r < (rows + 127) / 128 * 128; ++r) {
              const uint8_t got = cp[col * q->padded + 128 * first + r];
              const uint8_t exp = r < rows ? wp[r * cols + col] : uint8_t(0);
              ASSERT_EQ(got, exp) << name << ": expert " << g << " token tile code (row " << r
                                  << ", column " << col << ")";
            }
            for (int64_t t = 0; t < (rows + 127) / 128; ++t)
              ASSERT_EQ(float_bits(scales.data<float>()[(first + t) * scales.size(1) + col]),
                        float_bits(ws.data<float>()[t * cols + col]))
                  << name << ": expert " << g << " token tile " << t << " scale, column " << col;
          }
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t r0 = c.offsets[size_t(g)], rows = c.offsets[size_t(g) + 1] - r0;
        const std::string what = name + ", expert " + std::to_string(g) + " dW";
        const Tensor base_g = dw_base.slice(0, g * n, (g + 1) * n).contiguous();
        const std::vector<double> before(base_g.data<float>(),
                                         base_g.data<float>() + base_g.numel());
        if (rows == 0) {
          EXPECT_TRUE(bit_identical(dw.select(0, g).to(Device::cpu()), base_g))
              << ctx(what + ": an expert without rows was written");
          continue;
        }
        const ops::Fp8Blocks dy_cols =
            ops::quantize_fp8_blocks(dy.slice(0, r0, r0 + rows).contiguous(), 128, 1);
        const ops::Fp8Blocks x_cols =
            ops::quantize_fp8_blocks(x.slice(0, r0, r0 + rows).contiguous(), 128, 1);
        expect_within_bound(
            dw.select(0, g),
            reference(dequantised(dy_cols), 1, n, dequantised(x_cols), 1, k, n, k, rows), rows,
            before, what);
      }
    }
    // Rows past the offsets' end are no expert's: left as they were.
    const Tensor tail = f32(y_bf16.slice(0, used, total));
    const Tensor tail_acc = f32(y_acc.slice(0, used, total));
    const Tensor tail_base = base_cpu.slice(0, used, total).contiguous();
    for (int64_t i = 0; i < tail.numel(); ++i) {
      ASSERT_EQ(tail.data<float>()[i], 7.0f) << name << ": row " << used + i / n << " written";
      ASSERT_EQ(tail_acc.data<float>()[i], tail_base.data<float>()[i])
          << name << ": row " << used + i / n << " accumulated into";
    }
    if (dx_possible) {
      const Tensor dx_tail = f32(dx.slice(0, used, total));
      for (int64_t i = 0; i < dx_tail.numel(); ++i)
        ASSERT_EQ(dx_tail.data<float>()[i], 7.0f) << name << ": dX row " << used + i / k;
    }
  }
#endif
}

// The leaf ops of tile-wise FP8 training (ops/fp8.h: linear_fp8, linear_fp8_backward_add) and a
// projection marked Linear::fp8, on a [B, T, in] input: each product is the one of the operands
// quantised as the CPU op quantises them (1 × 128 tiles for x and dy, 128 × 128 weight blocks,
// 128 × 1 token tiles for the weight gradient), within the bound above; the CPU op on the same
// bf16 values is within it too.
TEST(CudaFp8, TrainingLeafOpsMatchTheCpuOps) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const int64_t b = 2, t = 150, tokens = b * t, in = 272, out = 96;
  const Tensor x = varied(tokens, in, DType::bf16, 900).view({b, t, in});
  const Tensor w = varied(out, in, DType::bf16, 903);
  const Tensor dy = varied(tokens, out, DType::bf16, 906).view({b, t, out});
  const Tensor xc = x.to(DType::f32), wc = w.to(DType::f32), dyc = dy.to(DType::f32);
  const auto deq = [](const Tensor& a, int64_t br, int64_t bc) {
    return dequantised(
        ops::quantize_fp8_blocks(a.view({a.numel() / a.size(-1), a.size(-1)}), br, bc));
  };
  const Reference y_ref =
      reference(deq(xc, 1, 128), in, 1, deq(wc, 128, 128), in, 1, tokens, out, in);
  const Reference dx_ref =
      reference(deq(dyc, 1, 128), out, 1, deq(wc, 128, 128), 1, in, tokens, in, out);
  const Reference dw_ref =
      reference(deq(dyc, 128, 1), 1, out, deq(xc, 128, 1), 1, in, out, in, tokens);

  ops::Linear l(w.to(kGpu));
  l.fp8 = true;
  const Tensor xg = x.to(kGpu), dyg = dy.to(kGpu);
  Tensor y;
  run_or_fail("linear_fp8", [&] { y = ops::linear(xg, l); });
  ASSERT_EQ(y.shape(), (Shape{b, t, out}));
  expect_within_bound(y.view({tokens, out}), y_ref, in, {}, "linear_fp8 forward (bf16)");
  ops::Linear grads;
  Tensor dx;
  run_or_fail("linear_fp8 backward", [&] { ops::linear_backward_add(dx, dyg, xg, l, &grads); });
  ASSERT_EQ(dx.dtype(), DType::f32);
  expect_within_bound(dx.view({tokens, in}), dx_ref, out, {}, "linear_fp8 dx (f32)");
  expect_within_bound(grads.weight, dw_ref, tokens, {}, "linear_fp8 dW (f32)");
  // The projection's own input gradient (nothing else adds to it) comes out of the GEMM in x's
  // dtype, and the weight gradient is the same bits.
  ops::Linear grads_alone;
  Tensor dx_alone;
  run_or_fail("linear_fp8 backward alone",
              [&] { dx_alone = ops::linear_backward(dyg, xg, l, &grads_alone, true); });
  ASSERT_EQ(dx_alone.dtype(), DType::bf16);
  ASSERT_EQ(dx_alone.shape(), x.shape());
  expect_within_bound(dx_alone.view({tokens, in}), dx_ref, out, {}, "linear_fp8 dx (bf16)");
  EXPECT_TRUE(bit_identical(grads_alone.weight, grads.weight)) << "linear_fp8 dW alone";

  const Tensor y_cpu = ops::linear_fp8(xc, wc);
  Tensor dx_cpu, dw_cpu;
  ops::linear_fp8_backward_add(&dx_cpu, dyc, xc, wc, &dw_cpu);
  expect_within_bound(y_cpu.view({tokens, out}), y_ref, in, {}, "CPU linear_fp8 forward");
  expect_within_bound(dx_cpu.view({tokens, in}), dx_ref, out, {}, "CPU linear_fp8 dx");
  expect_within_bound(dw_cpu, dw_ref, tokens, {}, "CPU linear_fp8 dW");
  Tensor dw_cpu_alone;
  const Tensor dx_cpu_alone = ops::linear_fp8_backward(dyc, xc, wc, &dw_cpu_alone);
  EXPECT_TRUE(bit_identical(dx_cpu_alone, dx_cpu)) << "CPU linear_fp8 dx alone";
  EXPECT_TRUE(bit_identical(dw_cpu_alone, dw_cpu)) << "CPU linear_fp8 dW alone";

  // Dimensions the GPU's FP8 GEMMs cannot take are refused before any kernel runs, naming
  // train.fp8 (the trainer refuses such a model up front where it sees the shapes).
  const Tensor odd = varied(40, 100, DType::bf16, 909).to(kGpu);
  EXPECT_THROW(ops::linear_fp8(varied(8, 100, DType::bf16, 910).to(kGpu), odd), Error);
#endif
}

// A pinned weight on the GPU (ops/fp8.h): fp8_weight_from_codes lays released codes and scales
// out for the GEMMs with the codes shared, and the forward and input gradient of the pinned weight
// are the products of those codes' values, within the bound above; inside a reuse scope a
// weight's blocks are made once (the same buffers at each use) and the products are bit for bit
// those of a fresh quantisation.
TEST(CudaFp8, PinnedAndReusedWeightBlocks) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const int64_t tokens = 70, in = 256, out = 144;
  // Released codes and scales that are no quantiser's (no block reaches ±448).
  const ops::Fp8Blocks released = [&] {
    ops::Fp8Blocks q = ops::quantize_fp8_weight(varied(out, in, DType::f32, 920));
    auto* c = static_cast<uint8_t*>(q.values.data_ptr());
    for (int64_t i = 0; i < q.values.numel(); ++i)
      if ((c[i] & 0x7f) == 0x7e) c[i] = uint8_t((c[i] & 0x80) | 0x6e);
    for (int64_t i = 0; i < q.scales.numel(); ++i) q.scales.data<float>()[i] *= 1.37f;
    return q;
  }();
  const ops::Fp8Blocks on_gpu =
      ops::fp8_weight_from_codes(released.values.to(kGpu), released.scales.to(kGpu));
  EXPECT_TRUE(cuda::is_fp8_gemm_layout(on_gpu));
  EXPECT_TRUE(same_codes(on_gpu.values, released.values));
  EXPECT_TRUE(same_scales(on_gpu.scales, released.scales));

  const Tensor w = ops::dequantize_fp8_blocks(released, DType::bf16).to(kGpu);
  const Tensor x = varied(tokens, in, DType::bf16, 921).to(kGpu);
  const Tensor dy = varied(tokens, out, DType::bf16, 922).to(kGpu);
  const std::vector<double> wq = dequantised(released);
  const auto deq = [](const Tensor& a, int64_t br, int64_t bc) {
    return dequantised(ops::quantize_fp8_blocks(a.to(Device::cpu()).to(DType::f32), br, bc));
  };
  ops::pin_fp8_weight(w, on_gpu);
  EXPECT_EQ(ops::fp8_weight_blocks(w).values.storage(), on_gpu.values.storage());
  Tensor y, dx;
  run_or_fail("pinned linear_fp8", [&] {
    y = ops::linear_fp8(x, w);
    ops::linear_fp8_backward_add(&dx, dy, x, w, nullptr);
  });
  expect_within_bound(y, reference(deq(x, 1, 128), in, 1, wq, in, 1, tokens, out, in), in, {},
                      "pinned linear_fp8 forward");
  expect_within_bound(dx, reference(deq(dy, 1, 128), out, 1, wq, 1, in, tokens, in, out), out, {},
                      "pinned linear_fp8 dx");

  const Tensor v = varied(out, in, DType::bf16, 923).to(kGpu);
  const Tensor fresh = ops::linear_fp8(x, v);
  {
    ops::Fp8WeightReuse scope;
    const ops::Fp8Blocks first = ops::fp8_weight_blocks(v);
    EXPECT_EQ(ops::fp8_weight_blocks(v).values.storage(), first.values.storage());
    expect_same_quantisation(first, ops::quantize_fp8_weight(v.to(Device::cpu()).to(DType::f32)),
                             "reused blocks");
    const Tensor reused = ops::linear_fp8(x, v).to(Device::cpu());
    const Tensor want = fresh.to(Device::cpu());
    EXPECT_EQ(std::memcmp(reused.data_ptr(), want.data_ptr(), want.nbytes()), 0);
  }
  EXPECT_NE(ops::fp8_weight_blocks(v).values.storage(), ops::fp8_weight_blocks(v).values.storage());
#endif
}

TEST(CudaFp8, RefusesWhatCublasLtCannotTake) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  auto message_of = [](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what()) + " | " + e.fix();
    }
    return "";
  };
  // K = 100: rows of 100 bytes, not 16-byte aligned.
  const Tensor x = varied(64, 100, DType::bf16, 150).to(kGpu);
  const Tensor w = varied(128, 100, DType::bf16, 151).to(kGpu);
  const std::string k_msg = message_of([&] {
    cuda::fp8_linear(cuda::quantize_fp8_blocks(x, 1, 128), cuda::quantize_fp8_blocks(w, 128, 128));
  });
  EXPECT_NE(k_msg.find("K (reduced dimension) = 100 is not a multiple of 16"), std::string::npos)
      << k_msg;
  // N = 24 outputs.
  const Tensor x2 = varied(64, 128, DType::bf16, 152).to(kGpu);
  const Tensor w2 = varied(24, 128, DType::bf16, 153).to(kGpu);
  const std::string n_msg = message_of([&] {
    cuda::fp8_linear(cuda::quantize_fp8_blocks(x2, 1, 128),
                     cuda::quantize_fp8_blocks(w2, 128, 128));
  });
  EXPECT_NE(n_msg.find("N (output columns) = 24 is not a multiple of 16"), std::string::npos)
      << n_msg;
  // Blocks without a GPU layout.
  const std::string b_msg = message_of([&] { cuda::quantize_fp8_blocks(x2, 64, 64); });
  EXPECT_NE(b_msg.find("blocks of 64 x 64 have no GPU layout"), std::string::npos) << b_msg;
  // A CPU quantisation copied naively (scales row-major, not the rows-fastest GEMM layout).
  const ops::Fp8Blocks cpu = ops::quantize_fp8_blocks(varied(64, 256, DType::bf16, 154), 1, 128);
  ops::Fp8Blocks naive = cpu;
  naive.values = cpu.values.to(kGpu);
  naive.scales = cpu.scales.to(kGpu);
  EXPECT_FALSE(cuda::is_fp8_gemm_layout(naive));
  const std::string l_msg = message_of([&] {
    cuda::fp8_linear(
        naive, cuda::quantize_fp8_blocks(varied(128, 256, DType::bf16, 155).to(kGpu), 128, 128));
  });
  EXPECT_NE(l_msg.find("GPU GEMM layout"), std::string::npos) << l_msg;
  // Codes copied without the padding rows the GEMM reads (37 rows: it reads 40), scales in place.
  const ops::Fp8Blocks cpu37 = ops::quantize_fp8_blocks(varied(37, 256, DType::bf16, 156), 1, 128);
  ops::Fp8Blocks short_rows = cuda::fp8_blocks_to_device(cpu37, kGpu);
  ASSERT_TRUE(cuda::is_fp8_gemm_layout(short_rows));
  short_rows.values = cpu37.values.to(kGpu);
  EXPECT_FALSE(cuda::is_fp8_gemm_layout(short_rows));
#endif
}
