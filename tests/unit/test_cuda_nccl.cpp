// The NCCL backend of the communicators (dist/comm_nccl.h) on one GPU: a group of one rank,
// bootstrapped over the single-rank communicator, runs every collective through NCCL on device
// tensors (bf16 and f32) and must return exactly what a group of one defines (the input, in
// place or copied); outputs are poisoned with NaN first, so an unwritten element fails. The
// multi-rank parity of the collectives is tested over MPI on the CPU (tests/dist/); this checks
// that the NCCL path initialises, queues after the default stream's work, and completes. Skipped
// where no GPU is visible.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <vector>

#include "glmtune/dist/comm.h"
#include "glmtune/tensor/tensor.h"
#include "support/cuda_test_support.h"
#ifdef GLMTUNE_WITH_CUDA
#include "glmtune/dist/comm_nccl.h"
#endif

using namespace glmtune;
using namespace glmtune::test;

namespace {

TEST(CudaNccl, EveryCollectiveOfAOneRankGroup) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  std::unique_ptr<dist::Communicator> self = dist::make_self_communicator("world");
  std::unique_ptr<dist::Communicator> nccl = dist::make_nccl_communicator(*self, 0, 60.0);
  EXPECT_STREQ(nccl->backend(), "nccl");
  ASSERT_EQ(nccl->size(), 1);
  ASSERT_EQ(nccl->rank(), 0);
  for (DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor host = random_cpu({1000}, dtype, 1);
    const Tensor nan = Tensor::full({1000}, NAN, dtype, kGpu);

    Tensor t = host.to(kGpu);
    nccl->all_reduce(t, dist::ReduceOp::sum);
    EXPECT_TRUE(bit_identical(t, host)) << "all_reduce";
    nccl->all_reduce(t, dist::ReduceOp::max);
    EXPECT_TRUE(bit_identical(t, host)) << "all_reduce max";

    Tensor out = nan.clone();
    nccl->reduce_scatter(host.to(kGpu), out, dist::ReduceOp::sum);
    EXPECT_TRUE(bit_identical(out, host)) << "reduce_scatter";

    out = nan.clone();
    nccl->all_gather(host.to(kGpu), out);
    EXPECT_TRUE(bit_identical(out, host)) << "all_gather";

    // The started forms: queued behind the work already on the GPU, complete once waited for.
    out = nan.clone();
    std::unique_ptr<dist::PendingCollective> pending = nccl->start_all_gather(host.to(kGpu), out);
    pending->wait();
    pending->wait();  // idempotent
    EXPECT_TRUE(bit_identical(out, host)) << "start_all_gather";
    out = nan.clone();
    pending = nccl->start_reduce_scatter(host.to(kGpu), out);
    pending.reset();  // an abandoned one completes before its tensors can go
    EXPECT_TRUE(bit_identical(out, host)) << "start_reduce_scatter";

    out = nan.clone();
    const std::vector<int64_t> counts = {1000};
    nccl->all_to_all(host.to(kGpu), counts, out, counts);
    EXPECT_TRUE(bit_identical(out, host)) << "all_to_all";

    t = host.to(kGpu);
    nccl->broadcast(t, 0);
    EXPECT_TRUE(bit_identical(t, host)) << "broadcast";
  }
  nccl->barrier();

  // Busy time: every collective above counted once, then nothing until the next one; a queued
  // all-gather of 256 MiB (a copy on one rank) takes measurable time on the GPU.
  EXPECT_GE(nccl->take_busy_seconds(), 0.0);
  EXPECT_EQ(nccl->take_busy_seconds(), 0.0);
  Tensor big = Tensor::zeros({int64_t(1) << 26}, DType::f32, kGpu);
  nccl->all_reduce(big, dist::ReduceOp::sum);
  Tensor gathered = Tensor::empty({int64_t(1) << 26}, DType::f32, kGpu);
  nccl->start_all_gather(big, gathered)->wait();
  const double busy = nccl->take_busy_seconds();
  std::printf("[ measure  ] 256 MiB all_reduce + all_gather on one rank: %.3f ms busy\n",
              1e3 * busy);
  EXPECT_GT(busy, 0.0);
  EXPECT_LT(busy, 10.0);
#endif
}

}  // namespace
