// Speed of the MoE, indexer and sparse-attention CUDA ops at GLM-5.3-Flash sizes (hidden 4096,
// MoE width 2048, 36 local experts of the 288 under 8-way expert parallelism, top-8; MLA with 64
// heads of 256; indexer 32 heads of 128 over 4-token pools, top-2048 tokens), on the device the
// program runs on. A plain program that prints one table:
//
//   op, shape, median time, achieved rate, share of the measured dense bf16 rate
//
// The grouped expert GEMMs run at the expert-parallel training shapes (36 groups of ~910 and ~3641
// rows, what an expert receives from 8 ranks' 4096- and 16384-token packs at top-8 of 288; gate_up
// N 4096 K 4096, down N 4096 K 2048) through both backends of
// ops/cuda/grouped_gemm.h; bench/grouped_mm_vs_torch.py times torch._grouped_mm at the same
// shapes in the same call. The ceiling is an 8192³ bf16 product timed in this run. Each time is
// the median of event-timed runs after warm-up runs; inputs are random (never zeros).

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#ifdef GLMTUNE_WITH_CUDA
#include <cuda_runtime.h>

#include <numeric>
#include <random>

#include "cuda_bench.h"
#include "glmtune/ops/cuda/gemm.h"
#include "glmtune/ops/cuda/grouped_gemm.h"
#include "glmtune/ops/cuda/indexer.h"
#include "glmtune/ops/cuda/mla.h"
#include "glmtune/ops/cuda/moe.h"
#include "glmtune/tensor/allocator.h"
#include "glmtune/tensor/cuda_check.h"
#include "glmtune/tensor/rng.h"
#include "glmtune/tensor/tensor.h"

namespace {

using namespace glmtune;

constexpr int64_t kD = 4096, kMoe = 2048, kExperts = 36, kTopK = 8;
using cudabench::kGpu;
using cudabench::median_ms;
using cudabench::random_gpu;

struct Row {
  std::string op, shape;
  double ms = 0, tflops = 0;
};
std::vector<Row> rows;
double dense_tflops = 0;

void add(const std::string& op, const std::string& shape, double ms, double flop) {
  rows.push_back({op, shape, ms, flop > 0 ? flop / (ms * 1e-3) / 1e12 : 0});
  std::fprintf(stderr, "  %-44s %9.3f ms\n", op.c_str(), ms);
}

void bench_dense() {
  const int64_t n = 8192;
  const Tensor a = random_gpu({n, n}, DType::bf16, 1);
  const Tensor b = random_gpu({n, n}, DType::bf16, 2, 1.0 / std::sqrt(double(n)));
  Tensor c = Tensor::empty({n, n}, DType::bf16, kGpu);
  cuda::GemmArgs g;
  g.trans_b = true;
  g.m = g.n = g.k = n;
  g.a = a.data_ptr(), g.lda = n, g.b = b.data_ptr(), g.ldb = n, g.c = c.data_ptr(), g.ldc = n;
  const double ms = median_ms([&] { cuda::gemm(g); }, 3, 20);
  add("dense gemm 8192^3 (ceiling)", "8192x8192x8192", ms, 2.0 * n * n * n);
  dense_tflops = rows.back().tflops;
}

// One grouped GEMM family (forward, dX, dW) at `per_group` rows in each of kExperts groups.
void bench_grouped(const std::string& name, int64_t per_group, int64_t n, int64_t k) {
  const int64_t total = per_group * kExperts;
  std::vector<int64_t> offsets(size_t(kExperts) + 1);
  for (int64_t g = 0; g <= kExperts; ++g) offsets[size_t(g)] = g * per_group;
  const Tensor x = random_gpu({total, k}, DType::bf16, 11);
  const Tensor w = random_gpu({kExperts, n, k}, DType::bf16, 12, 1.0 / std::sqrt(double(k)));
  const Tensor dy = random_gpu({total, n}, DType::bf16, 13);
  Tensor y = Tensor::empty({total, n}, DType::bf16, kGpu);
  Tensor dx = Tensor::empty({total, k}, DType::bf16, kGpu);
  Tensor dw32 = Tensor::zeros({kExperts, n, k}, DType::f32, kGpu);
  Tensor dw16 = Tensor::zeros({kExperts, n, k}, DType::bf16, kGpu);
  const double flop = 2.0 * double(total) * double(n) * double(k);
  const std::string shape =
      "36x" + std::to_string(per_group) + " N" + std::to_string(n) + " K" + std::to_string(k);
  for (cuda::GroupedGemmBackend b :
       {cuda::GroupedGemmBackend::kCublasGrouped, cuda::GroupedGemmBackend::kLtPerGroup}) {
    const std::string tag = std::string(" [") + cuda::grouped_gemm_backend_name(b) + "]";
    add(name + " fwd" + tag, shape,
        median_ms([&] { cuda::grouped_linear(y, x, w, offsets, b); }, 3, 20), flop);
    add(name + " dX" + tag, shape,
        median_ms([&] { cuda::grouped_linear_backward_input(dx, dy, w, offsets, b); }, 3, 20),
        flop);
    add(name + " dW->bf16" + tag, shape,
        median_ms([&] { cuda::grouped_linear_backward_weight(dw16, dy, x, offsets, b); }, 3, 20),
        flop);
  }
  add(name + " dW->f32 [cuBLASLt per group]", shape,
      median_ms([&] { cuda::grouped_linear_backward_weight(dw32, dy, x, offsets); }, 3, 20), flop);
}

// The whole MoE block (router, permutation, experts, shared expert, combine) at T tokens.
void bench_moe_block(int64_t tokens) {
  ops::MoeConfig cfg;
  cfg.n_experts = kExperts;
  cfg.top_k = kTopK;
  ops::MoeParams p;
  p.router_weight = random_gpu({kExperts, kD}, DType::bf16, 21, 1.0 / std::sqrt(double(kD)));
  p.e_score_correction_bias = random_gpu({kExperts}, DType::f32, 22, 0.01);
  p.gate_up_proj.weight =
      random_gpu({kExperts, 2 * kMoe, kD}, DType::bf16, 23, 1.0 / std::sqrt(double(kD)));
  p.down_proj.weight =
      random_gpu({kExperts, kD, kMoe}, DType::bf16, 24, 1.0 / std::sqrt(double(kMoe)));
  p.shared.gate_proj.weight = random_gpu({kMoe, kD}, DType::bf16, 25, 1.0 / std::sqrt(double(kD)));
  p.shared.up_proj.weight = random_gpu({kMoe, kD}, DType::bf16, 26, 1.0 / std::sqrt(double(kD)));
  p.shared.down_proj.weight =
      random_gpu({kD, kMoe}, DType::bf16, 27, 1.0 / std::sqrt(double(kMoe)));
  const Tensor x = random_gpu({tokens, kD}, DType::bf16, 28);
  const Tensor dy = random_gpu({tokens, kD}, DType::bf16, 29);
  // Useful FLOPs: routed experts 3 GEMMs of TK·D·Im, shared 3 of T·D·Is, router T·D·E.
  const double fwd = 2.0 * (3.0 * tokens * kTopK * kD * kMoe + 3.0 * tokens * kD * kMoe +
                            double(tokens) * kD * kExperts);
  const std::string shape = "T" + std::to_string(tokens) + " E36 K8";
  for (cuda::GroupedGemmBackend b :
       {cuda::GroupedGemmBackend::kCublasGrouped, cuda::GroupedGemmBackend::kLtPerGroup}) {
    const std::string tag = std::string(" [") + cuda::grouped_gemm_backend_name(b) + "]";
    cuda::MoeContext ctx;
    add("moe block fwd" + tag, shape,
        median_ms([&] { cuda::moe_forward(cfg, p, x, -1, &ctx, b); }, 2, 10), fwd);
    ops::MoeParams grads;
    // The backward recomputes the experts' forward: 2x the forward's useful FLOPs plus that.
    add("moe block bwd (recompute incl.)" + tag, shape,
        median_ms([&] { cuda::moe_backward(cfg, p, ctx, dy, grads, Tensor(), b); }, 2, 10),
        2.0 * fwd);
  }
}

// Causal sparse attention of one document: query i sees min(i + 1, topk) of its past tokens.
void bench_sparse_attention(int64_t tokens, int64_t heads, int64_t dim, int64_t topk) {
  const int64_t width = topk + 3;
  std::vector<int32_t> idx(size_t(tokens * width), -1);
  std::mt19937_64 eng(7);
  std::vector<int32_t> pool;
  double pairs = 0;
  for (int64_t i = 0; i < tokens; ++i) {
    pool.resize(size_t(i + 1));
    std::iota(pool.begin(), pool.end(), 0);
    const int64_t n = std::min(i + 1, topk);
    for (int64_t c = 0; c < n; ++c) {
      std::uniform_int_distribution<int64_t> pick(c, i);
      std::swap(pool[size_t(c)], pool[size_t(pick(eng))]);
      idx[size_t(i * width + c)] = pool[size_t(c)];
    }
    pairs += double(n);
  }
  Tensor idx_cpu = Tensor::empty({tokens, width}, DType::i32);
  std::copy(idx.begin(), idx.end(), idx_cpu.data<int32_t>());
  const Tensor idx_gpu = idx_cpu.to(kGpu);
  Tensor cu = Tensor::empty({2}, DType::i64);
  cu.data<int64_t>()[0] = 0;
  cu.data<int64_t>()[1] = tokens;
  const Tensor q = random_gpu({tokens, heads, dim}, DType::bf16, 31);
  const Tensor k = random_gpu({tokens, heads, dim}, DType::bf16, 32);
  const Tensor v = random_gpu({tokens, heads, dim}, DType::bf16, 33);
  const Tensor dout = random_gpu({tokens, heads, dim}, DType::bf16, 34);
  const double scale = 1.0 / std::sqrt(double(dim));
  const std::string shape = "T" + std::to_string(tokens) + " H" + std::to_string(heads) + " D" +
                            std::to_string(dim) + " top" + std::to_string(topk);
  cuda::SparseKeySets sets;
  add("sparse attn key sets (+key-major)", shape,
      median_ms([&] { sets = cuda::sparse_key_sets(idx_gpu, cu, true); }, 1, 5), 0);
  // FLOPs as FlashAttention counts them: 4·pairs·H·D forward, 2.5x that backward.
  const double fwd = 4.0 * pairs * double(heads) * double(dim);
  cuda::SparseAttentionOutput out;
  add("sparse attn fwd", shape,
      median_ms([&] { out = cuda::sparse_attention_forward(q, k, v, sets, scale); }, 1, 5), fwd);
  add("sparse attn bwd", shape,
      median_ms(
          [&] { cuda::sparse_attention_backward(q, k, v, out.out, out.lse, sets, scale, dout); }, 1,
          3),
      2.5 * fwd);
}

void bench_indexer(int64_t tokens) {
  ops::IndexerConfig cfg;
  cfg.n_heads = 32;
  cfg.head_dim = 128;
  cfg.kpool = 4;
  cfg.topk = 2048;
  const int64_t rank = 1536, ih = cfg.n_heads, id = cfg.head_dim;
  ops::IndexerParams p;
  p.wq_b.weight = random_gpu({ih * id, rank}, DType::bf16, 41, 1.0 / std::sqrt(double(rank)));
  p.wk.weight = random_gpu({id, kD}, DType::bf16, 42, 1.0 / std::sqrt(double(kD)));
  p.k_norm_weight = random_gpu({id}, DType::bf16, 43);
  p.k_norm_bias = random_gpu({id}, DType::bf16, 44);
  p.weights_proj.weight = random_gpu({ih, kD}, DType::bf16, 45, 1.0 / std::sqrt(double(kD)));
  p.kpool_ape = random_gpu({cfg.kpool, id}, DType::bf16, 46);
  p.kpool_gate = random_gpu({id, kD}, DType::bf16, 47, 1.0 / std::sqrt(double(kD)));
  const Tensor x = random_gpu({tokens, kD}, DType::bf16, 48);
  const Tensor qr = random_gpu({tokens, rank}, DType::bf16, 49);
  Tensor cu = Tensor::empty({2}, DType::i64);
  cu.data<int64_t>()[0] = 0;
  cu.data<int64_t>()[1] = tokens;
  // Scoring FLOPs (causal half of the [T, T/P] products per head) in fp32.
  const double flop = 2.0 * double(tokens) * double(tokens / cfg.kpool) / 2 * ih * id;
  add("indexer fwd (fp32 scores)", "T" + std::to_string(tokens) + " IH32 ID128 P4 top2048",
      median_ms([&] { cuda::indexer_forward(cfg, p, x, qr, cu); }, 1, 5), flop);
}

void print_table() {
  std::printf("\n%-52s %-30s %10s %10s %10s\n", "op", "shape", "median ms", "TFLOP/s", "of dense");
  for (const Row& r : rows) {
    char rate[32] = "-", frac[16] = "-";
    if (r.tflops > 0) {
      std::snprintf(rate, sizeof rate, "%.1f", r.tflops);
      if (dense_tflops > 0)
        std::snprintf(frac, sizeof frac, "%.0f%%", 100.0 * r.tflops / dense_tflops);
    }
    std::printf("%-52s %-30s %10.3f %10s %10s\n", r.op.c_str(), r.shape.c_str(), r.ms, rate, frac);
  }
  std::printf("ceiling: dense bf16 %.0f TFLOP/s (8192^3 through cuBLASLt, this run)\n",
              dense_tflops);
}

}  // namespace

int main() {
  if (!glmtune::cuda_available()) {
    std::printf("bench_cuda_moe: no CUDA device visible, nothing to measure\n");
    return 0;
  }
  cudaDeviceProp prop{};
  GLMTUNE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  try {
    bench_dense();
    bench_grouped("gate_up", 910, 2 * kMoe, kD);
    bench_grouped("down", 910, kD, kMoe);
    bench_grouped("gate_up", 3641, 2 * kMoe, kD);
    bench_grouped("down", 3641, kD, kMoe);
    glmtune::cuda_allocator(0).release_cached();
    bench_moe_block(4096);
    glmtune::cuda_allocator(0).release_cached();
    bench_sparse_attention(4096, 64, 256, 2048);
    glmtune::cuda_allocator(0).release_cached();
    bench_indexer(8192);
  } catch (const std::exception& e) {
    print_table();
    std::fprintf(stderr, "bench_cuda_moe failed: %s\n", e.what());
    return 1;
  }
  print_table();
  return 0;
}

#else

int main() {
  std::printf("bench_cuda_moe: built without CUDA (configure with -DGLMTUNE_CUDA=ON)\n");
  return 0;
}

#endif
