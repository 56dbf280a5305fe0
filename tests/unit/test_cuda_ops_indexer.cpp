// CUDA parity for the KPool DSA indexer (ops/cuda/indexer.h) against the CPU op
// (ops::indexer_forward): packed documents of odd lengths (an empty one, a one-token one, ones
// shorter than a pool), the tail on and off, and exact ties (every score equal) where the lower
// pool must win. The selected token ids must be identical; on random inputs a row may differ only
// where two candidate scores tie to within fp32 rounding (counted and bounded), while the tail
// slots and the −1 layout must match everywhere. Reruns are bit-identical. Fresh random bf16
// inputs each run (seed printed; GLMTUNE_TEST_SEED reproduces a run); the CPU reference runs in
// f32 on the same bf16 values. Skipped (not failed) where no GPU is visible or CUDA is not built.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "glmtune/ops/indexer.h"
#include "glmtune/tensor/tensor.h"
#include "support/cuda_test_support.h"
#ifdef GLMTUNE_WITH_CUDA
#include "glmtune/ops/cuda/indexer.h"
#endif

using namespace glmtune;
using namespace glmtune::test;

namespace {

#ifdef GLMTUNE_WITH_CUDA
struct IndexerData {
  ops::IndexerParams cpu, gpu;
  Tensor x, q_resid;  // bf16 CPU
};

IndexerData make_data(const ops::IndexerConfig& cfg, int64_t tokens, int64_t dim, int64_t rank,
                      uint64_t stream, bool zero_queries) {
  IndexerData d;
  auto both = [&](Tensor& cpu, Tensor& gpu, const Shape& shape, double mean, double std) {
    const Tensor t = random_cpu(shape, DType::bf16, stream++, mean, std);
    cpu = f32(t);
    gpu = t.to(kGpu);
  };
  const int64_t ih = cfg.n_heads, id = cfg.head_dim;
  both(d.cpu.wq_b.weight, d.gpu.wq_b.weight, {ih * id, rank}, 0.0,
       zero_queries ? 0.0 : 1.0 / std::sqrt(double(rank)));
  both(d.cpu.wk.weight, d.gpu.wk.weight, {id, dim}, 0.0, 1.0 / std::sqrt(double(dim)));
  both(d.cpu.k_norm_weight, d.gpu.k_norm_weight, {id}, 1.0, 0.2);
  both(d.cpu.k_norm_bias, d.gpu.k_norm_bias, {id}, 0.0, 0.2);
  both(d.cpu.weights_proj.weight, d.gpu.weights_proj.weight, {ih, dim}, 0.0,
       1.0 / std::sqrt(double(dim)));
  both(d.cpu.kpool_ape, d.gpu.kpool_ape, {cfg.kpool, id}, 0.0, 0.5);
  both(d.cpu.kpool_gate, d.gpu.kpool_gate, {id, dim}, 0.0, 1.0 / std::sqrt(double(dim)));
  d.x = random_cpu({tokens, dim}, DType::bf16, stream++);
  d.q_resid = random_cpu({tokens, rank}, DType::bf16, stream++);
  return d;
}

Tensor seqlens(const std::vector<int64_t>& bounds) {
  Tensor t = Tensor::empty({int64_t(bounds.size())}, DType::i64);
  std::copy(bounds.begin(), bounds.end(), t.data<int64_t>());
  return t;
}

// Compares two [T, W] selections: returns the rows whose pool part differs, and expects the tail
// slots and the positions of −1 to agree in every row.
std::vector<int64_t> compare_rows(const Tensor& got_t, const Tensor& want_t,
                                  const ops::IndexerConfig& cfg, const std::string& what) {
  const Tensor got = got_t.to(Device::cpu()), want = want_t.to(Device::cpu());
  EXPECT_EQ(got.shape(), want.shape()) << what;
  const int64_t rows = want.size(0), width = want.size(1);
  std::vector<int64_t> bad;
  int64_t layout_errors = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* g = got.data<int32_t>() + r * width;
    const int32_t* w = want.data<int32_t>() + r * width;
    bool differs = false;
    for (int64_t c = 0; c < width; ++c) {
      if ((g[c] < 0) != (w[c] < 0)) ++layout_errors;
      if (g[c] != w[c]) {
        differs = true;
        // Beyond the selected pools only the tail and padding live: those must be exact.
        if (c >= cfg.topk) ++layout_errors;
      }
    }
    if (differs) bad.push_back(r);
  }
  EXPECT_EQ(layout_errors, 0) << ctx(what + ": tail or −1 layout differs");
  return bad;
}

void check_case(const ops::IndexerConfig& cfg, const std::vector<int64_t>& bounds, uint64_t stream,
                bool ties) {
  const int64_t tokens = bounds.back(), dim = 96, rank = 48;
  const IndexerData d = make_data(cfg, tokens, dim, rank, stream, ties);
  const Tensor cu = seqlens(bounds);
  const std::string what = std::string(ties ? "tied scores" : "random") +
                           " P=" + std::to_string(cfg.kpool) + " TK=" + std::to_string(cfg.topk) +
                           " tail=" + std::to_string(cfg.always_select_tail) +
                           " T=" + std::to_string(tokens);
  const Tensor ref = ops::indexer_forward(cfg, d.cpu, f32(d.x), f32(d.q_resid), cu);
  {
    Tensor poison = Tensor::empty({tokens, ops::indexer_width(cfg)}, DType::i32, kGpu);
    poison.fill_(12345);
  }
  const Tensor got = cuda::indexer_forward(cfg, d.gpu, d.x.to(kGpu), d.q_resid.to(kGpu), cu);
  const std::vector<int64_t> bad = compare_rows(got, ref, cfg, what);
  std::printf("[ measure  ] %s: %zu of %lld rows select differently\n", what.c_str(), bad.size(),
              static_cast<long long>(tokens));
  if (ties) {
    EXPECT_TRUE(bad.empty()) << ctx(what + ": exact ties must pick the lower pools");
  } else {
    EXPECT_LE(int64_t(bad.size()), std::max<int64_t>(1, tokens / 100)) << ctx(what);
  }
  const Tensor again = cuda::indexer_forward(cfg, d.gpu, d.x.to(kGpu), d.q_resid.to(kGpu), cu);
  EXPECT_TRUE(bit_identical(got, again)) << ctx("rerun " + what);
}
#endif

}  // namespace

TEST(CudaOpsIndexer, PackedDocumentsMatchCpu) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  ops::IndexerConfig cfg;
  cfg.n_heads = 4;
  cfg.head_dim = 32;
  cfg.kpool = 4;
  cfg.topk = 16;
  // An empty document, a one-token one, one shorter than a pool, odd lengths.
  const std::vector<int64_t> bounds = {0, 45, 46, 46, 49, 131, 300};
  check_case(cfg, bounds, 1, false);
  cfg.always_select_tail = false;
  check_case(cfg, bounds, 21, false);
#endif
}

TEST(CudaOpsIndexer, LongDocumentMatchesCpu) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  // 425 pools per query at the end: the selection sorts 512 keys per row.
  ops::IndexerConfig cfg;
  cfg.n_heads = 8;
  cfg.head_dim = 64;
  cfg.kpool = 4;
  cfg.topk = 128;
  check_case(cfg, {0, 1703, 1790}, 41, false);
#endif
}

TEST(CudaOpsIndexer, ExactTiesPickLowerPools) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  ops::IndexerConfig cfg;
  cfg.n_heads = 4;
  cfg.head_dim = 32;
  cfg.kpool = 4;
  cfg.topk = 16;
  check_case(cfg, {0, 77, 78, 203}, 61, true);
#endif
}
