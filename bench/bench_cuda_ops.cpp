// Speed of the CUDA ops at GLM-5.3-Flash sizes (T = 16384 tokens of one pack, hidden 4096,
// vocabulary 154880, dense MLP width 12288, MoE width 2048 with top-8 routing), on the device the
// program runs on. A plain program that prints one table:
//
//   op, shape, median time, achieved rate, share of the ceiling
//
// Ceilings: the bf16 dense rate is the 790 TFLOP/s measured for an 8192³ product on this
// workplace's H200s (the run also times that product itself); the bandwidth ceiling is a
// device-to-device copy measured in the same run (bytes read + bytes written). Memory-bound ops
// count the fewest bytes they must move (each input read once, each output written once).
// Each time is the median of many runs timed with CUDA events after warm-up runs; inputs are
// random (never zeros, which run faster). For the GEMMs a plain cublasGemmEx call on the same
// operands is the peer of our cuBLASLt path.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#ifdef GLMTUNE_WITH_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <chrono>
#include <optional>
#include <random>

#include "cuda_bench.h"
#include "glmtune/ops/cuda/adamw.h"
#include "glmtune/ops/cuda/cross_entropy.h"
#include "glmtune/ops/cuda/cublas_check.h"
#include "glmtune/ops/cuda/embedding.h"
#include "glmtune/ops/cuda/gemm.h"
#include "glmtune/ops/cuda/norm.h"
#include "glmtune/ops/cuda/swiglu.h"
#include "glmtune/tensor/allocator.h"
#include "glmtune/tensor/cuda_check.h"
#include "glmtune/tensor/rng.h"
#include "glmtune/tensor/tensor.h"

namespace {

using namespace glmtune;

constexpr double kDenseBf16Tflops = 790.0;  // measured 8192³ bf16 product on the H200 (KINDS)
constexpr int64_t kT = 16384, kD = 4096, kVocab = 154880, kDense = 12288, kMoe = 2048, kTopK = 8;
using cudabench::kGpu;
using cudabench::median_ms;
using cudabench::random_gpu;

struct Row {
  std::string op, shape;
  double ms = 0;
  double rate = 0;  // TFLOP/s or GB/s
  bool flops = false;
  double ceiling = 0;
};

std::vector<Row> rows;
double copy_gbs = 0;

void add_flops(const std::string& op, const std::string& shape, double ms, double flop) {
  const double tflops = flop / (ms * 1e-3) / 1e12;
  rows.push_back({op, shape, ms, tflops, true, tflops / kDenseBf16Tflops});
  std::fprintf(stderr, "  %-34s %9.3f ms\n", op.c_str(), ms);
}

void add_bytes(const std::string& op, const std::string& shape, double ms, double bytes) {
  const double gbs = bytes / (ms * 1e-3) / 1e9;
  rows.push_back({op, shape, ms, gbs, false, copy_gbs > 0 ? gbs / copy_gbs : 0});
  std::fprintf(stderr, "  %-34s %9.3f ms\n", op.c_str(), ms);
}

std::string dims(std::initializer_list<int64_t> d) {
  std::string s;
  for (int64_t v : d) s += (s.empty() ? "" : "x") + std::to_string(v);
  return s;
}

void bench_copy() {
  const int64_t bytes = int64_t(4) << 30;
  Tensor a = random_gpu({bytes / 2}, DType::bf16, 1);
  Tensor b = Tensor::empty({bytes / 2}, DType::bf16, kGpu);
  const double ms = median_ms(
      [&] {
        GLMTUNE_CUDA_CHECK(
            cudaMemcpyAsync(b.data_ptr(), a.data_ptr(), size_t(bytes), cudaMemcpyDeviceToDevice));
      },
      3, 20);
  copy_gbs = 2.0 * double(bytes) / (ms * 1e-3) / 1e9;
  rows.push_back({"d2d copy (bandwidth ceiling)", "4 GiB", ms, copy_gbs, false, 1.0});
}

// Row-major C[m, n] = op(A) op(B) as GemmArgs spells it, through cuBLASLt (ours) and through a
// plain cublasGemmEx call on the same operands (the peer).
void bench_gemm(cublasHandle_t handle, const std::string& name, bool trans_a, bool trans_b,
                int64_t m, int64_t n, int64_t k, DType c_dtype, float beta) {
  const Tensor a = random_gpu(trans_a ? Shape{k, m} : Shape{m, k}, DType::bf16, 11);
  const Tensor b =
      random_gpu(trans_b ? Shape{n, k} : Shape{k, n}, DType::bf16, 12, 1.0 / std::sqrt(double(k)));
  Tensor c = random_gpu({m, n}, c_dtype, 13);
  cuda::GemmArgs g;
  g.trans_a = trans_a;
  g.trans_b = trans_b;
  g.m = m;
  g.n = n;
  g.k = k;
  g.a = a.data_ptr();
  g.lda = trans_a ? m : k;
  g.b = b.data_ptr();
  g.ldb = trans_b ? k : n;
  g.c = c.data_ptr();
  g.ldc = n;
  g.c_dtype = c_dtype;
  g.beta = beta;
  const double flop = 2.0 * double(m) * double(n) * double(k);
  const std::string shape =
      dims({m, n, k}) + (c_dtype == DType::f32 ? " ->f32" : " ->bf16") + (beta != 0 ? " +=" : "");
  add_flops(name + " cuBLASLt", shape, median_ms([&] { cuda::gemm(g); }, 3, 20), flop);
  const float alpha = 1.0f;
  const cudaDataType_t ct = c_dtype == DType::f32 ? CUDA_R_32F : CUDA_R_16BF;
  auto peer = [&] {
    GLMTUNE_CUBLAS_CHECK(cublasGemmEx(
        handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, int(n),
        int(m), int(k), &alpha, b.data_ptr(), CUDA_R_16BF, int(g.ldb), a.data_ptr(), CUDA_R_16BF,
        int(g.lda), &beta, c.data_ptr(), ct, int(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  add_flops(name + " cublasGemmEx (peer)", shape, median_ms(peer, 3, 20), flop);
}

void bench_gemms() {
  cublasHandle_t handle;
  GLMTUNE_CUBLAS_CHECK(cublasCreate(&handle));
  bench_gemm(handle, "gemm 8192^3", false, true, 8192, 8192, 8192, DType::bf16, 0.0f);
  bench_gemm(handle, "dense gate_up fwd", false, true, kT, 2 * kDense, kD, DType::bf16, 0.0f);
  bench_gemm(handle, "dense down fwd", false, true, kT, kD, kDense, DType::bf16, 0.0f);
  bench_gemm(handle, "dense gate_up dx", false, false, kT, kD, 2 * kDense, DType::bf16, 0.0f);
  bench_gemm(handle, "dense gate_up dW", true, false, 2 * kDense, kD, kT, DType::f32, 1.0f);
  bench_gemm(handle, "shared expert gate_up fwd", false, true, kT, 2 * kMoe, kD, DType::bf16, 0.0f);
  bench_gemm(handle, "shared expert down fwd", false, true, kT, kD, kMoe, DType::bf16, 0.0f);
  cublasDestroy(handle);
}

void bench_norm() {
  const Tensor x = random_gpu({kT, kD}, DType::bf16, 21);
  const Tensor w = random_gpu({kD}, DType::bf16, 22);
  const Tensor dy = random_gpu({kT, kD}, DType::bf16, 23);
  Tensor y = Tensor::empty({kT, kD}, DType::bf16, kGpu), dx = y.clone();
  Tensor rstd = Tensor::empty({kT}, DType::f32, kGpu);
  Tensor gw = Tensor::zeros({kD}, DType::f32, kGpu);
  const double act = double(kT) * kD * 2;
  add_bytes("rmsnorm fwd", dims({kT, kD}),
            median_ms([&] { cuda::rms_norm_out(y, &rstd, x, w, 1e-5); }, 5, 50), 2 * act);
  add_bytes("rmsnorm bwd (+dw)", dims({kT, kD}),
            median_ms([&] { cuda::rms_norm_backward_out(dx, dy, x, w, 1e-5, rstd, &gw); }, 5, 50),
            3 * act);
}

void bench_swiglu(int64_t rows_, int64_t width, const std::string& what) {
  const Tensor gu = random_gpu({rows_, 2 * width}, DType::bf16, 31, 4.0);
  const Tensor gate = gu.slice(1, 0, width), up = gu.slice(1, width, 2 * width);
  const Tensor dout = random_gpu({rows_, width}, DType::bf16, 32);
  Tensor out = Tensor::empty({rows_, width}, DType::bf16, kGpu);
  Tensor dgu = Tensor::empty({rows_, 2 * width}, DType::bf16, kGpu);
  Tensor dg = dgu.slice(1, 0, width), du = dgu.slice(1, width, 2 * width);
  const double e = double(rows_) * width * 2;
  add_bytes("swiglu fwd " + what, dims({rows_, width}),
            median_ms([&] { cuda::swiglu_clamped_out(out, gate, up, 10.0); }, 5, 50), 3 * e);
  add_bytes("swiglu bwd " + what, dims({rows_, width}),
            median_ms([&] { cuda::swiglu_clamped_backward(gate, up, dout, 10.0, dg, du); }, 5, 50),
            5 * e);
}

void bench_embedding() {
  const Tensor table = random_gpu({kVocab, kD}, DType::bf16, 41);
  // Token ids with a realistic skew: a few frequent ids, most spread over the vocabulary.
  std::mt19937_64 gen(7);
  std::vector<int32_t> ids(static_cast<size_t>(kT));
  for (auto& v : ids) v = gen() % 4 == 0 ? int32_t(gen() % 64) : int32_t(gen() % kVocab);
  Tensor ids_cpu = Tensor::empty({kT}, DType::i32);
  std::copy(ids.begin(), ids.end(), ids_cpu.data<int32_t>());
  const Tensor ids_gpu = ids_cpu.to(kGpu);
  Tensor out = Tensor::empty({kT, kD}, DType::bf16, kGpu);
  const double act = double(kT) * kD * 2;
  add_bytes("embedding fwd (+id check, sync)", dims({kT, kD}),
            median_ms([&] { cuda::embedding_forward_out(out, table, ids_gpu); }, 3, 30), 2 * act);
  const auto t0 = std::chrono::steady_clock::now();
  const cuda::EmbeddingGradPlan plan =
      cuda::make_embedding_grad_plan(ids_cpu, kVocab, std::nullopt, kGpu);
  const double plan_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const Tensor dout = random_gpu({kT, kD}, DType::bf16, 42);
  Tensor dtable = Tensor::zeros({kVocab, kD}, DType::f32, kGpu);
  const double touched = double(plan.rows.numel());
  // dout read once, each touched f32 row read and written once.
  add_bytes("embedding bwd f32 table", dims({kT, kD}) + " rows=" + std::to_string(int64_t(touched)),
            median_ms([&] { cuda::embedding_backward(plan, dout, dtable); }, 3, 30),
            act + touched * kD * 8);
  std::fprintf(stderr, "  embedding grad plan on the host: %.3f ms (not in the table)\n", plan_ms);
  rows.push_back({"embedding grad plan (host)", dims({kT}), plan_ms, 0, false, 0});
}

void bench_cross_entropy() {
  const Tensor hidden = random_gpu({kT, kD}, DType::bf16, 51);
  const Tensor weight = random_gpu({kVocab, kD}, DType::bf16, 52, 1.0 / 64.0);
  std::mt19937_64 gen(9);
  Tensor labels = Tensor::empty({kT}, DType::i32);
  for (int64_t i = 0; i < kT; ++i) labels.data<int32_t>()[i] = int32_t(gen() % kVocab);
  Tensor dh = Tensor::empty({kT, kD}, DType::bf16, kGpu);
  Tensor dw = Tensor::zeros({kVocab, kD}, DType::f32, kGpu);
  const double fwd_flop = 2.0 * double(kT) * kD * kVocab;
  for (int64_t chunk : {2048, 4096}) {
    ops::CrossEntropyOptions opts;
    opts.chunk_rows = chunk;
    const std::string shape = dims({kT, kD, kVocab}) + " chunk " + std::to_string(chunk);
    add_flops("lm_head+CE fwd", shape,
              median_ms([&] { cuda::lm_head_cross_entropy(hidden, weight, labels, opts); }, 1, 5),
              fwd_flop);
    add_flops(
        "lm_head+CE fwd+bwd (dh, dW f32)", shape,
        median_ms([&] { cuda::lm_head_cross_entropy(hidden, weight, labels, opts, &dh, &dw); }, 1,
                  5),
        3 * fwd_flop);
  }
}

void bench_adamw() {
  // 64 tensors of 4 Mi elements: 268 M parameters with bf16 gradients and bf16 storage.
  const int64_t per = int64_t(4) << 20, count = 64;
  std::vector<cuda::AdamWParam> params;
  std::vector<Tensor> grads;
  for (int64_t i = 0; i < count; ++i) {
    cuda::AdamWParam p;
    p.master = random_gpu({per}, DType::f32, 100 + uint64_t(i), 0.02);
    p.exp_avg = random_gpu({per}, DType::f32, 200 + uint64_t(i), 1e-3);
    p.exp_avg_sq = Tensor::full({per}, 1e-6, DType::f32, kGpu);
    p.grad = random_gpu({per}, DType::bf16, 300 + uint64_t(i), 1e-3);
    p.param = Tensor::empty({per}, DType::bf16, kGpu);
    grads.push_back(p.grad);
    params.push_back(p);
  }
  const double n = double(per) * count;
  cuda::GradNorm gn;
  add_bytes("grad norm + clip (bf16 grads)", dims({count, per}),
            median_ms([&] { gn = cuda::grad_norm(grads, 1.0); }, 3, 30), 2 * n);
  cuda::AdamWConfig cfg;
  cfg.lr = 1e-6;
  // master, m, v read and written (24 B), bf16 grad read (2 B), bf16 storage written (2 B).
  add_bytes("adamw step (f32 master, bf16 store)", dims({count, per}),
            median_ms([&] { cuda::adamw_step(params, cfg, gn.clip); }, 3, 30), 28 * n);
}

void print_table() {
  std::printf("\n%-40s %-34s %10s %14s %9s\n", "op", "shape", "median ms", "rate", "of ceiling");
  for (const Row& r : rows) {
    char rate[32] = "-", frac[16] = "-";
    if (r.rate > 0) {
      std::snprintf(rate, sizeof rate, "%.1f %s", r.rate, r.flops ? "TFLOP/s" : "GB/s");
      std::snprintf(frac, sizeof frac, "%.0f%%", 100.0 * r.ceiling);
    }
    std::printf("%-40s %-34s %10.3f %14s %9s\n", r.op.c_str(), r.shape.c_str(), r.ms, rate, frac);
  }
  std::printf(
      "ceilings: bf16 dense %.0f TFLOP/s (measured 8192^3 on this workplace's H200), "
      "bandwidth %.0f GB/s (d2d copy above)\n",
      kDenseBf16Tflops, copy_gbs);
}

}  // namespace

int main() {
  if (!glmtune::cuda_available()) {
    std::printf("bench_cuda_ops: no CUDA device visible, nothing to measure\n");
    return 0;
  }
  cudaDeviceProp prop{};
  GLMTUNE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, %.1f GiB, L2 %.0f MiB\n", prop.name, prop.multiProcessorCount,
              double(prop.totalGlobalMem) / double(1ull << 30),
              double(prop.l2CacheSize) / double(1 << 20));
  try {
    // Each group frees its buffers before the next; the cache keeps them for reuse.
    bench_copy();
    bench_gemms();
    bench_norm();
    bench_swiglu(kT, kDense, "dense");
    bench_swiglu(kT * kTopK, kMoe, "MoE rows");
    bench_embedding();
    glmtune::cuda_allocator(0).release_cached();
    bench_cross_entropy();
    glmtune::cuda_allocator(0).release_cached();
    bench_adamw();
  } catch (const std::exception& e) {
    print_table();
    std::fprintf(stderr, "bench_cuda_ops failed: %s\n", e.what());
    return 1;
  }
  print_table();
  return 0;
}

#else

int main() {
  std::printf("bench_cuda_ops: built without CUDA (configure with -DGLMTUNE_CUDA=ON)\n");
  return 0;
}

#endif
