// CUDA parity for the tensor core: copies and conversions, fills, the caching allocator and the
// RNG stream, against the CPU path. Skipped (not failed) where no GPU is visible.

#include <gtest/gtest.h>

#include <random>

#include "glmtune/tensor/allocator.h"
#include "glmtune/tensor/rng.h"
#include "glmtune/tensor/tensor.h"

using namespace glmtune;

namespace {

uint64_t test_seed() {
  static const uint64_t seed = std::random_device{}();
  return seed;
}

#define REQUIRE_GPU()                                                \
  do {                                                               \
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible"; \
  } while (0)

}  // namespace

TEST(CudaTensor, RoundTripAndConvertMatchCpu) {
  REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  Tensor host = Tensor::empty({33, 17, 5}, DType::f32);
  fill_normal(host, test_seed(), 0, 0.0, 300.0);  // wide range: exercises fp8 NaN/saturation paths
  Tensor dev = host.to(gpu);
  EXPECT_EQ(dev.device(), gpu);
  EXPECT_EQ(dev.to(Device::cpu()).to_doubles(), host.to_doubles());
  for (DType t : kAllDTypes) {
    Tensor on_gpu = dev.to(t).to(Device::cpu());
    Tensor on_cpu = host.to(t);
    auto a = on_gpu.to_doubles(), b = on_cpu.to_doubles();
    for (size_t i = 0; i < a.size(); ++i) {
      if (std::isnan(b[i])) {
        ASSERT_TRUE(std::isnan(a[i])) << dtype_name(t) << " element " << i;
        continue;
      }
      ASSERT_EQ(a[i], b[i]) << dtype_name(t) << " element " << i << " seed " << test_seed();
    }
  }
}

TEST(CudaTensor, StridedCopiesAndFill) {
  REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  Tensor host = Tensor::empty({6, 7, 8}, DType::f64);
  fill_uniform(host, test_seed(), 3, -2, 2);
  Tensor dev = host.to(gpu);
  Tensor permuted_dev = dev.permute({2, 0, 1}).contiguous();
  Tensor permuted_host = host.permute({2, 0, 1}).contiguous();
  EXPECT_EQ(permuted_dev.to(Device::cpu()).to_doubles(), permuted_host.to_doubles());
  // Strided cross-device copy with a dtype change: GPU slice into a CPU transposed view.
  Tensor dst = Tensor::zeros({8, 3}, DType::bf16);
  dst.copy_(dev.select(0, 2).slice(0, 1, 4).transpose(0, 1));
  for (int64_t i = 0; i < 8; ++i)
    for (int64_t j = 0; j < 3; ++j)
      EXPECT_EQ(dst.item({i, j}), bf16_to_f32(f32_to_bf16(float(host.item({2, 1 + j, i})))));
  Tensor filled = Tensor::zeros({5, 9}, DType::f16, gpu);
  filled.select(1, 4).fill_(-0.75);
  auto v = filled.to_doubles();
  for (int64_t r = 0; r < 5; ++r)
    for (int64_t c = 0; c < 9; ++c) EXPECT_EQ(v[size_t(r * 9 + c)], c == 4 ? -0.75 : 0.0);
}

TEST(CudaTensor, RngMatchesCpuBitForBit) {
  REQUIRE_GPU();
  const uint64_t seed = test_seed();
  for (DType t : {DType::f32, DType::f64, DType::bf16}) {
    Tensor cpu = Tensor::empty({100003}, t);
    Tensor gpu = Tensor::empty({100003}, t, Device::cuda(0));
    fill_normal(cpu, seed, 12345, 0.5, 0.02);
    fill_normal(gpu, seed, 12345, 0.5, 0.02);
    ASSERT_EQ(gpu.to_doubles(), cpu.to_doubles()) << dtype_name(t) << " seed " << seed;
    fill_uniform(cpu, seed, 7, -1, 3);
    fill_uniform(gpu, seed, 7, -1, 3);
    ASSERT_EQ(gpu.to_doubles(), cpu.to_doubles()) << dtype_name(t) << " seed " << seed;
  }
}

TEST(CudaAllocator, CachesAndTracksPeak) {
  REQUIRE_GPU();
  Allocator& a = cuda_allocator(0);
  a.release_cached();
  a.reset_peak();
  const MemoryStats start = a.stats();
  {
    Tensor x = Tensor::empty({1 << 20}, DType::f32, Device::cuda(0));  // 4 MiB
    Tensor y = Tensor::empty({1 << 18}, DType::f32, Device::cuda(0));  // 1 MiB
    EXPECT_EQ(a.stats().allocated, start.allocated + (5u << 20));
  }
  const MemoryStats freed = a.stats();
  EXPECT_EQ(freed.allocated, start.allocated);
  EXPECT_EQ(freed.peak_allocated, start.allocated + (5u << 20));
  EXPECT_EQ(freed.reserved, start.reserved + (5u << 20));  // cached, not returned
  const uint64_t system_allocs = freed.num_system_allocs;
  for (int i = 0; i < 10; ++i) Tensor z = Tensor::empty({1 << 20}, DType::f32, Device::cuda(0));
  EXPECT_EQ(a.stats().num_system_allocs, system_allocs);  // served from the cache
  a.release_cached();
  EXPECT_EQ(a.stats().reserved, start.reserved);
}

TEST(CudaAllocator, OutOfMemoryIsAClearError) {
  REQUIRE_GPU();
  try {
    Tensor huge = Tensor::empty({int64_t(1) << 46}, DType::f32, Device::cuda(0));  // 256 TiB
    FAIL() << "allocation should fail";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot allocate"), std::string::npos) << e.what();
  }
  Tensor still_works = Tensor::full({4}, 2.0, DType::f32, Device::cuda(0));
  EXPECT_EQ(still_works.to_doubles(), (std::vector<double>{2, 2, 2, 2}));
}
