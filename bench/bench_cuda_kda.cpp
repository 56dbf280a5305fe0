// Speed of the KDA delta-rule core and of mHC on the GPU at GLM-5.3-Flash sizes (64 KDA heads of
// 128, hidden 4096, 4 residual streams), on the device the program runs on. A plain program that
// prints one table: op, shape, median time, achieved rate, share of the ceiling.
//
// KDA: forward, forward+backward and backward alone (it replays the forward) of
// cuda::kda_chunked at T = 16384 as 4 documents of 4096 (varlen) and at T = 16384 as one document,
// the latter with each value slicing of the walks (automatic, then 1, 2 and 4 slices forced);
// fwd+bwd also with the forward's chunk tiles kept for the backward (cuda::KdaChunkCache). The
// rate counts the arithmetic of the chunk-16 form
// (per token and head 2·C·K + 3·K² multiply-adds forward; the backward counted as twice that), set
// against the dense bf16 tensor-core rate: the state products run as mma.sync with every fp32
// operand split into bf16 hi and lo parts, three products for each one counted here, and so do
// the chunk-local 16×16 products (on the factorised decay; chunks whose gate range is too wide
// for it fall back to fp32 sums). FLA's chunk_kda on the same shapes is timed by
// bench/kda_vs_fla.py in the same GPU run.
// mHC: pre and post, forward and backward, at T = 16384, D = 4096: the rate counts the fewest
// bytes each must move, against a device-to-device copy measured in the same run.
// Times are medians of event-timed runs after warm-up, on random inputs (never zeros).
// Usage: bench_cuda_kda [--only REGEX] (the KDA cases whose shape and slicing label match, and
// mHC if "mhc" matches; for profiling one case, e.g. --only 'varlen').

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#ifdef GLMTUNE_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda_bench.h"
#include "glmtune/ops/cuda/kda.h"
#include "glmtune/ops/cuda/mhc.h"
#include "glmtune/tensor/cuda_check.h"
#include "glmtune/tensor/rng.h"
#include "glmtune/tensor/tensor.h"

namespace {

using namespace glmtune;

constexpr double kTensorTflops = 989.0;  // H200 datasheet dense bf16 tensor rate
using cudabench::kGpu;
using cudabench::median_ms;
using cudabench::random_gpu;

struct Row {
  std::string op, shape;
  double ms = 0, rate = 0;
  bool flops = false;
  double ceiling = 0;
};
std::vector<Row> rows;
double copy_gbs = 0;
std::optional<std::regex> only;  // --only: the KDA cases whose label matches, and mHC if it matches

bool selected(const std::string& label) { return !only || std::regex_search(label, *only); }

void add_bytes(const std::string& op, const std::string& shape, double ms, double bytes) {
  const double gbs = bytes / (ms * 1e-3) / 1e9;
  rows.push_back({op, shape, ms, gbs, false, copy_gbs > 0 ? gbs / copy_gbs : 0});
  std::fprintf(stderr, "  %-44s %9.3f ms\n", op.c_str(), ms);
}
void add_flops(const std::string& op, const std::string& shape, double ms, double flops) {
  const double tf = flops / (ms * 1e-3) / 1e12;
  rows.push_back({op, shape, ms, tf, true, tf / kTensorTflops});
  std::fprintf(stderr, "  %-44s %9.3f ms\n", op.c_str(), ms);
}

void bench_copy() {
  const int64_t bytes = int64_t(4) << 30;
  Tensor a = Tensor::empty({bytes / 4}, DType::i32, kGpu),
         b = Tensor::empty({bytes / 4}, DType::i32, kGpu);
  GLMTUNE_CUDA_CHECK(cudaMemset(a.data_ptr(), 1, size_t(bytes)));
  const double ms = median_ms(
      [&] {
        GLMTUNE_CUDA_CHECK(
            cudaMemcpyAsync(b.data_ptr(), a.data_ptr(), size_t(bytes), cudaMemcpyDeviceToDevice));
      },
      3, 20);
  copy_gbs = 2.0 * double(bytes) / (ms * 1e-3) / 1e9;
  rows.push_back({"d2d copy (bandwidth ceiling)", "4 GiB", ms, copy_gbs, false, 1.0});
}

// value_slices as cuda::kda_chunked takes it (0: automatic).
void bench_kda(const std::vector<int32_t>& cu_host, const std::string& shape,
               int value_slices = 0) {
  const std::string sl = value_slices == 0 ? "" : ", " + std::to_string(value_slices) + " slices";
  if (!selected(shape + sl)) return;
  const int64_t t = cu_host.back(), nh = 64, kd = 128;
  Tensor cu = Tensor::empty({int64_t(cu_host.size())}, DType::i32, kGpu);
  GLMTUNE_CUDA_CHECK(cudaMemcpy(cu.data_ptr(), cu_host.data(), cu_host.size() * sizeof(int32_t),
                                cudaMemcpyHostToDevice));
  const Tensor q = cuda::l2_norm(random_gpu({t, nh, kd}, DType::bf16, 1), 1e-6);
  const Tensor k = cuda::l2_norm(random_gpu({t, nh, kd}, DType::bf16, 2), 1e-6);
  const Tensor v = random_gpu({t, nh, kd}, DType::bf16, 3);
  const Tensor graw = random_gpu({t, nh * kd}, DType::bf16, 4);
  const Tensor dt_bias = random_gpu({nh * kd}, DType::f32, 5, 0.5);
  const Tensor a_log = random_gpu({nh}, DType::f32, 6, 0.5);
  const Tensor g = cuda::kda_gate(graw, dt_bias, a_log, -5.0);
  const Tensor beta = cuda::kda_beta(random_gpu({t, nh}, DType::bf16, 7));
  const Tensor dout = random_gpu({t, nh, kd}, DType::bf16, 8);
  const double scale = 1.0 / std::sqrt(double(kd));
  const double fwd_flops = 2.0 * double(t * nh) * (2.0 * 16 * kd + 3.0 * kd * kd);
  const int vs = value_slices;
  const double f =
      median_ms([&] { cuda::kda_chunked(q, k, v, g, beta, cu, scale, nullptr, vs); }, 3, 10);
  add_flops("kda core fwd" + sl, shape, f, fwd_flops);
  const double fb = median_ms(
      [&] {
        cuda::kda_chunked(q, k, v, g, beta, cu, scale, nullptr, vs);
        cuda::kda_chunked_backward(q, k, v, g, beta, cu, scale, dout, nullptr, vs);
      },
      2, 6);
  add_flops("kda core fwd+bwd" + sl, shape, fb, 3.0 * fwd_flops);
  cuda::KdaChunkCache cache;
  const double fk = median_ms(
      [&] {
        cuda::kda_chunked(q, k, v, g, beta, cu, scale, nullptr, vs, &cache);
        cuda::kda_chunked_backward(q, k, v, g, beta, cu, scale, dout, nullptr, vs, &cache);
      },
      2, 6);
  add_flops("kda core fwd+bwd, chunk tiles kept" + sl, shape, fk, 3.0 * fwd_flops);
  const double b = median_ms(
      [&] { cuda::kda_chunked_backward(q, k, v, g, beta, cu, scale, dout, nullptr, vs); }, 2, 6);
  add_flops("kda core bwd (replays the fwd)" + sl, shape, b, 2.0 * fwd_flops);
}

void bench_mhc() {
  if (!selected("mhc")) return;
  const int64_t t = 16384, d = 4096, h = 4, m = 24;
  const std::string shape = "T16384 H4 D4096";
  const Tensor x = random_gpu({t, h, d}, DType::bf16, 11, 1.0);
  const Tensor fn = random_gpu({m, h * d}, DType::f32, 12, 0.01);
  const Tensor base = random_gpu({m}, DType::f32, 13, 0.5);
  const Tensor scale = random_gpu({3}, DType::f32, 14, 0.2, 1.0);
  const Tensor y = random_gpu({t, d}, DType::bf16, 15);
  ops::MhcOptions opt;
  ops::MhcPreSaved saved;
  const ops::MhcPreResult pre = cuda::mhc_pre(x, fn, base, scale, opt, &saved);
  const double xb = double(t * h * d) * 2, yb = double(t * d) * 2;
  add_bytes("mhc pre fwd", shape,
            median_ms([&] { cuda::mhc_pre(x, fn, base, scale, opt, &saved); }, 3, 20), xb + yb);
  const Tensor d_post = random_gpu({t, h}, DType::f32, 16);
  const Tensor d_comb = random_gpu({t, h, h}, DType::f32, 17);
  const Tensor d_coll = random_gpu({t, d}, DType::bf16, 18);
  ops::MhcGrads grads;
  add_bytes("mhc pre bwd", shape,
            median_ms(
                [&] {
                  cuda::mhc_pre_backward(x, fn, base, scale, opt, &saved, d_post, d_comb, d_coll,
                                         grads);
                },
                3, 20),
            2 * xb + yb);
  add_bytes("mhc post fwd", shape,
            median_ms([&] { cuda::mhc_post(x, y, pre.post, pre.comb); }, 3, 20), 2 * xb + yb);
  const Tensor dout = random_gpu({t, h, d}, DType::bf16, 19);
  add_bytes("mhc post bwd", shape,
            median_ms([&] { cuda::mhc_post_backward(x, y, pre.post, pre.comb, dout); }, 3, 20),
            3 * xb + 2 * yb);
}

void print_table() {
  std::printf("\n%-44s %-22s %10s %14s %10s\n", "op", "shape", "median ms", "rate", "of ceiling");
  for (const Row& r : rows) {
    char rate[64], frac[32];
    std::snprintf(rate, sizeof rate, "%.1f %s", r.rate, r.flops ? "TFLOP/s" : "GB/s");
    std::snprintf(frac, sizeof frac, "%.0f%%", 100.0 * r.ceiling);
    std::printf("%-44s %-22s %10.3f %14s %10s\n", r.op.c_str(), r.shape.c_str(), r.ms, rate, frac);
  }
  std::printf(
      "ceilings: dense bf16 tensor %.0f TFLOP/s (H200 datasheet; KDA counts one product where "
      "the kernels run three), bandwidth %.0f GB/s (d2d copy above)\n",
      kTensorTflops, copy_gbs);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--only") {
    only.emplace(argv[2]);
  } else if (argc != 1) {
    std::fprintf(stderr,
                 "usage: bench_cuda_kda [--only REGEX]  (REGEX picks KDA cases by their shape and "
                 "slicing label, e.g. 'varlen' or '1 doc H64 D128$', and mHC by 'mhc')\n");
    return 2;
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("bench_cuda_kda: no CUDA device visible, nothing to measure\n");
    return 0;
  }
  try {
    cudaDeviceProp prop{};
    GLMTUNE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
    bench_copy();
    bench_kda({0, 4096, 8192, 12288, 16384}, "varlen 4x4096 H64 D128");
    for (int slices : {0, 1, 2, 4}) bench_kda({0, 16384}, "T16384 1 doc H64 D128", slices);
    bench_mhc();
    print_table();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda_kda failed: %s\n", e.what());
    print_table();
    return 1;
  }
  return 0;
}

#else

int main() {
  std::printf("bench_cuda_kda: built without CUDA (configure with -DGLMTUNE_CUDA=ON)\n");
  return 0;
}

#endif
