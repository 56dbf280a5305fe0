// Speed of the sparse NoPE MLA attention on the GPU at GLM-5.3-Flash sizes (64 heads, Dn = Dv =
// 256, kv_lora_rank 512, index_topk 2048) over one document of T = 4096 tokens: the per-head
// kernel (cuda::sparse_attention_*, k and v gathered per head) against the absorbed-latent form
// (cuda::absorbed_attention_*, tensor cores over the shared latent rows), forward and backward,
// and the per-head absorb / expand GEMMs the MLA composite adds around the latter. A plain
// program that prints one table: op, median time, achieved rate against the dense bf16 tensor
// rate. The selection is causal: query i takes every key ≤ i while there are at most 2048 of
// them, else 2048 distinct random keys ≤ i (what the indexer's top-k gives, in count).
//
// Before timing, the absorbed form's output and gradients are checked against the per-head
// kernel on the same inputs (k = latent W_kbᵀ, v = latent W_vbᵀ): o, dq and d latent (the
// per-head dk, dv taken back through kv_b_proj), as relative L2 errors in the table's footer.
// Rates count 2 flops per multiply-add over the selected (query, key) pairs: the forward 2
// products of NH·512 per pair, the backward the 5 a fused kernel would need (the kernels run 7:
// the scores and dP are recomputed in both backward kernels). Times are medians of event-timed
// runs after warm-up, on random inputs (never zeros).

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#ifdef GLMTUNE_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda_bench.h"
#include "glmtune/ops/cuda/gemm.h"
#include "glmtune/ops/cuda/mla.h"
#include "glmtune/tensor/cuda_check.h"
#include "glmtune/tensor/rng.h"
#include "glmtune/tensor/tensor.h"

namespace {

using namespace glmtune;

constexpr double kTensorTflops = 989.0;  // H200 datasheet dense bf16 tensor rate
using cudabench::kGpu;
using cudabench::median_ms;
using cudabench::random_gpu;
constexpr int64_t kT = 4096, kNH = 64, kDn = 256, kDv = 256, kR = 512, kW = 2048;

struct Row {
  std::string op;
  double ms = 0, tflops = 0;
};
std::vector<Row> rows;
std::vector<std::string> notes;

void add(const std::string& op, double ms, double flops) {
  rows.push_back({op, ms, flops > 0 ? flops / (ms * 1e-3) / 1e12 : 0});
  std::fprintf(stderr, "  %-40s %9.3f ms\n", op.c_str(), ms);
}

// Relative L2 error of a against b (any dtypes, same numel).
double rel_l2(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to(Device::cpu()).to_doubles(),
                            y = b.to(Device::cpu()).to_doubles();
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
    if (!std::isfinite(x[i])) return INFINITY;
    num += (x[i] - y[i]) * (x[i] - y[i]);
    den += y[i] * y[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// Per-head products with kv_b_proj's factors (as the MLA composite runs them).
void per_head(bool trans_b, int64_t in_dim, int64_t out_dim, const Tensor& a, const Tensor& kvb,
              int64_t row_off, Tensor& c) {
  for (int64_t h = 0; h < kNH; ++h)
    cuda::gemm({0, false, trans_b, kT, out_dim, in_dim,
                static_cast<const char*>(a.data_ptr()) + h * in_dim * 2, kNH * in_dim,
                static_cast<const char*>(kvb.data_ptr()) + (h * (kDn + kDv) + row_off) * kR * 2, kR,
                static_cast<char*>(c.data_ptr()) + h * out_dim * 2, kNH * out_dim, DType::bf16});
}

void bench() {
  // The selection, and the number of (query, key) pairs it holds.
  Tensor idx_host = Tensor::full({kT, kW}, -1.0, DType::i32);
  std::mt19937_64 eng(20261129);
  std::vector<int32_t> pool(static_cast<size_t>(kT));
  int64_t pairs = 0;
  for (int64_t i = 0; i < kT; ++i) {
    int32_t* row = idx_host.data<int32_t>() + i * kW;
    const int64_t n = std::min<int64_t>(i + 1, kW);
    std::iota(pool.begin(), pool.begin() + i + 1, 0);
    for (int64_t c = 0; c < n; ++c) {
      const int64_t pick = c + int64_t(eng() % uint64_t(i + 1 - c));
      std::swap(pool[size_t(c)], pool[size_t(pick)]);
      row[c] = pool[size_t(c)];
    }
    pairs += n;
  }
  const Tensor idx = idx_host.to(kGpu);
  Tensor cu = Tensor::empty({2}, DType::i64);
  cu.data<int64_t>()[0] = 0;
  cu.data<int64_t>()[1] = kT;
  const double scale = 1.0 / std::sqrt(double(kDn));
  const double pair_flops = 2.0 * double(pairs) * double(kNH) * double(kR);

  const Tensor q = random_gpu({kT, kNH, kDn}, DType::bf16, 1);
  const Tensor latent = random_gpu({kT, kR}, DType::bf16, 2);
  const Tensor kvb = random_gpu({kNH * (kDn + kDv), kR}, DType::bf16, 3, 1.0 / std::sqrt(512.0));
  const Tensor dout = random_gpu({kT, kNH, kDv}, DType::bf16, 4);

  // Key sets (shared by both forms).
  cuda::SparseKeySets sets_f, sets_b;
  add("key sets (query-major)",
      median_ms([&] { sets_f = cuda::sparse_key_sets(idx, cu, false); }, 2, 10), 0);
  add("key sets (+ key-major pairs)",
      median_ms([&] { sets_b = cuda::sparse_key_sets(idx, cu, true); }, 2, 10), 0);

  // Absorbed form: q_abs = W_kbᵀ q, attention on the latent, o = W_vb o_lat.
  Tensor q_abs = Tensor::empty({kT, kNH, kR}, DType::bf16, kGpu);
  Tensor o = Tensor::empty({kT, kNH, kDv}, DType::bf16, kGpu);
  Tensor d_olat = Tensor::empty({kT, kNH, kR}, DType::bf16, kGpu);
  Tensor dq = Tensor::empty({kT, kNH, kDn}, DType::bf16, kGpu);
  add("absorb q (64 per-head GEMMs)",
      median_ms([&] { per_head(false, kDn, kR, q, kvb, 0, q_abs); }, 3, 20),
      2.0 * kT * kNH * kDn * kR);
  cuda::AbsorbedAttentionOutput fwd;
  add("absorbed attention fwd",
      median_ms([&] { fwd = cuda::absorbed_attention_forward(q_abs, latent, sets_f, scale); }, 2,
                10),
      2 * pair_flops);
  if (cuda::absorbed_wgmma_available(kGpu.index))
    add("absorbed attention fwd (wgmma kernel)",
        median_ms(
            [&] {
              cuda::absorbed_attention_forward(q_abs, latent, sets_f, scale, nullptr,
                                               cuda::AbsorbedKernel::wgmma);
            },
            2, 10),
        2 * pair_flops);
  add("expand o (64 per-head GEMMs)",
      median_ms([&] { per_head(true, kR, kDv, fwd.out, kvb, kDn, o); }, 3, 20),
      2.0 * kT * kNH * kDv * kR);
  per_head(false, kDv, kR, dout, kvb, kDn, d_olat);
  cuda::AbsorbedAttentionGrads g;
  add("absorbed attention bwd",
      median_ms(
          [&] {
            g = cuda::absorbed_attention_backward(q_abs, latent, fwd.out, fwd.lse2, sets_b, scale,
                                                  d_olat);
          },
          1, 5),
      5 * pair_flops);
  cuda::AbsorbedAttentionGrads gw;
  const bool wgmma = cuda::absorbed_wgmma_available(kGpu.index);
  if (wgmma)
    add("absorbed attention bwd (wgmma kernel)",
        median_ms(
            [&] {
              gw = cuda::absorbed_attention_backward(q_abs, latent, fwd.out, fwd.lse2, sets_b,
                                                     scale, d_olat, nullptr, int64_t(1) << 31,
                                                     cuda::AbsorbedKernel::wgmma);
            },
            1, 5),
        5 * pair_flops);
  per_head(true, kR, kDn, g.q_abs, kvb, 0, dq);

  // Per-head form on the same inputs: k, v = latent W_kbᵀ, latent W_vbᵀ.
  Tensor kv = Tensor::empty({kT, kNH * (kDn + kDv)}, DType::bf16, kGpu);
  cuda::gemm({0, false, true, kT, kNH * (kDn + kDv), kR, latent.data_ptr(), kR, kvb.data_ptr(), kR,
              kv.data_ptr(), kNH * (kDn + kDv), DType::bf16});
  const Tensor kv3 = kv.view({kT, kNH, kDn + kDv});
  const Tensor k = kv3.narrow(2, 0, kDn).contiguous(), v = kv3.narrow(2, kDn, kDv).contiguous();
  cuda::SparseAttentionOutput old;
  add("per-head attention fwd (old)",
      median_ms([&] { old = cuda::sparse_attention_forward(q, k, v, sets_f, scale); }, 1, 3),
      2 * pair_flops);
  ops::AttentionGrads og;
  add("per-head attention bwd (old)",
      median_ms(
          [&] {
            og = cuda::sparse_attention_backward(q, k, v, old.out, old.lse, sets_b, scale, dout);
          },
          1, 3),
      5 * pair_flops);

  // Agreement of the two forms (d latent: the per-head dk | dv through kv_b_proj).
  Tensor d_kv = Tensor::empty({kT, kNH, kDn + kDv}, DType::bf16, kGpu);
  d_kv.narrow(2, 0, kDn).copy_(og.k);
  d_kv.narrow(2, kDn, kDv).copy_(og.v);
  Tensor d_lat_old = Tensor::empty({kT, kR}, DType::f32, kGpu);
  cuda::gemm({0, false, false, kT, kR, kNH * (kDn + kDv), d_kv.data_ptr(), kNH * (kDn + kDv),
              kvb.data_ptr(), kR, d_lat_old.data_ptr(), kR, DType::f32});
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "absorbed vs per-head at this shape: o rel L2 %.2e, dq %.2e, d latent %.2e",
                rel_l2(o, old.out), rel_l2(dq, og.q), rel_l2(g.latent, d_lat_old));
  notes.push_back(buf);
  if (wgmma) {
    std::snprintf(buf, sizeof buf,
                  "wgmma vs mma.sync backward at this shape: d q_abs rel L2 %.2e, d latent %.2e",
                  rel_l2(gw.q_abs, g.q_abs), rel_l2(gw.latent, g.latent));
    notes.push_back(buf);
  }
  std::snprintf(buf, sizeof buf, "selected pairs %lld (%.1f per query)", (long long)pairs,
                double(pairs) / double(kT));
  notes.push_back(buf);
}

void print_table() {
  std::printf("\n%-40s %-26s %10s %14s %10s\n", "op", "shape", "median ms", "rate", "of ceiling");
  for (const Row& r : rows) {
    char rate[64] = "-", frac[32] = "-";
    if (r.tflops > 0) {
      std::snprintf(rate, sizeof rate, "%.1f TFLOP/s", r.tflops);
      std::snprintf(frac, sizeof frac, "%.0f%%", 100.0 * r.tflops / kTensorTflops);
    }
    std::printf("%-40s %-26s %10.3f %14s %10s\n", r.op.c_str(), "T4096 H64 D256 R512 k2048", r.ms,
                rate, frac);
  }
  for (const std::string& n : notes) std::printf("%s\n", n.c_str());
  std::printf("ceiling: dense bf16 tensor %.0f TFLOP/s (H200 datasheet)\n", kTensorTflops);
}

}  // namespace

int main() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("bench_cuda_mla: no CUDA device visible, nothing to measure\n");
    return 0;
  }
  try {
    cudaDeviceProp prop{};
    GLMTUNE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
    bench();
    print_table();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda_mla failed: %s\n", e.what());
    print_table();
    return 1;
  }
  return 0;
}

#else

int main() {
  std::printf("bench_cuda_mla: built without CUDA (configure with -DGLMTUNE_CUDA=ON)\n");
  return 0;
}

#endif
