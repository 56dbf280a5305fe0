// `glmtune bench ops`: each hot op of the text step timed with glmtune's CUDA kernels next to its
// best public peer timed in the same run (bench/ops_peers.py, a child process started first so
// that FLA's Triton compilation overlaps our timings; it times only after ours are done), with
// ours / peer and each op's share of the bf16 matrix rate or copy bandwidth measured in the run.
// What each row compares and the FLOP / byte formulas are in docs/PERF.md ("glmtune bench ops").

#include "cmd_bench_ops.h"

#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/tensor/device.h"
#include "ops_common.h"
#ifdef GLMTUNE_WITH_CUDA
#include <cuda_runtime.h>

#include <cmath>

#include "cuda_bench.h"
#include "glmtune/ops/cuda/cross_entropy.h"
#include "glmtune/ops/cuda/dispatch.h"
#include "glmtune/ops/cuda/fp8.h"
#include "glmtune/ops/cuda/gemm.h"
#include "glmtune/ops/cuda/grouped_gemm.h"
#include "glmtune/ops/cuda/kda.h"
#include "glmtune/ops/cuda/mhc.h"
#include "glmtune/ops/cuda/mla.h"
#include "glmtune/ops/cuda/norm.h"
#include "glmtune/ops/cuda/swiglu.h"
#include "glmtune/ops/vision.h"
#include "glmtune/tensor/allocator.h"
#include "glmtune/tensor/cuda_check.h"
#endif

namespace {

using namespace glmtune;
using benchops::Family;
using benchops::OpSpec;

struct OpsArgs {
  std::string json_path;
  std::string only;
  std::string python = "python3";
  std::string peers_script;
  bool peers = true;
  double peer_timeout = 480;
  int fla_max_configs = 1;
};

#ifdef GLMTUNE_WITH_CUDA
using cudabench::kGpu;
using cudabench::median_ms;
using cudabench::random_gpu;

double time_matmul(int64_t n) {
  const Tensor a = random_gpu({n, n}, DType::bf16, 1);
  const Tensor b = random_gpu({n, n}, DType::bf16, 2, 1.0 / std::sqrt(double(n)));
  Tensor c = Tensor::empty({n, n}, DType::bf16, kGpu);
  cuda::GemmArgs g;
  g.trans_b = true;
  g.m = g.n = g.k = n;
  g.a = a.data_ptr(), g.lda = n, g.b = b.data_ptr(), g.ldb = n, g.c = c.data_ptr(), g.ldc = n;
  return median_ms([&] { cuda::gemm(g); }, 3, 20);
}

double time_copy(int64_t bytes) {
  const Tensor a = random_gpu({bytes / 2}, DType::bf16, 1);
  Tensor b = Tensor::empty({bytes / 2}, DType::bf16, kGpu);
  return median_ms(
      [&] {
        GLMTUNE_CUDA_CHECK(
            cudaMemcpyAsync(b.data_ptr(), a.data_ptr(), size_t(bytes), cudaMemcpyDeviceToDevice));
      },
      3, 20);
}

// The whole KDA core from the raw inputs FLA's chunk_kda takes (its gate, q/k L2 norm and beta
// sigmoid run inside its kernels): the norms, the gate and beta, the delta rule, and for the
// backward every one of their gradients. "fwd+bwd kept" hands the forward's chunk tiles to the
// backward (cuda::KdaChunkCache, 2.3 GB at T16384 H64) instead of forming them again.
double time_kda(const std::vector<int64_t>& lengths, const std::string& variant) {
  std::vector<int32_t> cu_host = {0};
  for (int64_t len : lengths) cu_host.push_back(cu_host.back() + int32_t(len));
  const int64_t t = cu_host.back(), nh = 64, kd = 128;
  const double eps = 1e-6, lower_bound = -5.0, scale = 1.0 / std::sqrt(double(kd));
  const Tensor cu = Tensor::from_vector(cu_host, {int64_t(cu_host.size())}).to(kGpu);
  const Tensor q = random_gpu({t, nh, kd}, DType::bf16, 1);
  const Tensor k = random_gpu({t, nh, kd}, DType::bf16, 2);
  const Tensor v = random_gpu({t, nh, kd}, DType::bf16, 3);
  const Tensor graw = random_gpu({t, nh * kd}, DType::bf16, 4);
  const Tensor dt_bias = random_gpu({nh * kd}, DType::f32, 5, 0.5);
  const Tensor a_log = random_gpu({nh}, DType::f32, 6, 0.5);
  const Tensor beta_logits = random_gpu({t, nh}, DType::bf16, 7);
  const Tensor dout = random_gpu({t, nh, kd}, DType::bf16, 8);
  Tensor qn, kn, g, beta;
  const bool kept = variant == "fwd+bwd kept";
  cuda::KdaChunkCache cache;
  auto forward = [&] {
    qn = cuda::l2_norm(q, eps);
    kn = cuda::l2_norm(k, eps);
    g = cuda::kda_gate(graw, dt_bias, a_log, lower_bound);
    beta = cuda::kda_beta(beta_logits);
    return cuda::kda_chunked(qn, kn, v, g, beta, cu, scale, nullptr, 0, kept ? &cache : nullptr);
  };
  if (variant == "fwd") return median_ms([&] { forward(); }, 3, 20);
  Tensor d_dt_bias = Tensor::zeros({nh * kd}, DType::f32, kGpu);
  Tensor d_a_log = Tensor::zeros({nh}, DType::f32, kGpu);
  return median_ms(
      [&] {
        forward();
        const ops::KdaCoreGrads d = cuda::kda_chunked_backward(qn, kn, v, g, beta, cu, scale, dout,
                                                               nullptr, 0, kept ? &cache : nullptr);
        cuda::l2_norm_backward(d.dq, q, eps);
        cuda::l2_norm_backward(d.dk, k, eps);
        cuda::kda_gate_backward(graw, dt_bias, a_log, lower_bound, d.dg, &d_dt_bias, &d_a_log);
        cuda::kda_beta_backward(beta, d.dbeta);
      },
      3, 10);
}

// One expert GEMM of the MoE block through the default backend (cuBLASLt per expert); dW
// accumulates into a bf16 gradient, the output type torch._grouped_mm gives. Variants ending in
// " device" run the device-offset kernels instead, dW into f32 as the training step does.
double time_grouped(int64_t per_group, int64_t n, int64_t k, const std::string& variant) {
  const int64_t experts = 36, total = per_group * experts;
  std::vector<int64_t> offsets(size_t(experts) + 1);
  for (int64_t e = 0; e <= experts; ++e) offsets[size_t(e)] = e * per_group;
  const Tensor x = random_gpu({total, k}, DType::bf16, 11);
  const Tensor w = random_gpu({experts, n, k}, DType::bf16, 12, 1.0 / std::sqrt(double(k)));
  const Tensor dy = random_gpu({total, n}, DType::bf16, 13);
  Tensor y = Tensor::empty({total, n}, DType::bf16, kGpu);
  Tensor dx = Tensor::empty({total, k}, DType::bf16, kGpu);
  const std::string device_suffix = " device";
  const bool on_device = variant.ends_with(device_suffix);
  const std::string which =
      on_device ? variant.substr(0, variant.size() - device_suffix.size()) : variant;
  Tensor dw = Tensor::zeros({experts, n, k}, on_device ? DType::f32 : DType::bf16, kGpu);
  if (on_device) {
    Tensor dev = Tensor::empty({experts + 1}, DType::i32);
    std::copy(offsets.begin(), offsets.end(), dev.data<int32_t>());
    dev = dev.to(kGpu);
    if (!cuda::grouped_gemm_device_offsets_fit(x, w, y, experts))
      throw Error(
          "the device-offset grouped GEMMs need a Hopper GPU (compute capability 9.x) "
          "and a build for sm_90a",
          "glmtune bench ops",
          "leave their rows out with --only, e.g. --only '^moe \\w+ (fwd|dX|dW) 36'");
    if (which == "fwd") return median_ms([&] { cuda::grouped_linear(y, x, w, dev); }, 3, 20);
    if (which == "dX")
      return median_ms([&] { cuda::grouped_linear_backward_input(dx, dy, w, dev); }, 3, 20);
    return median_ms([&] { cuda::grouped_linear_backward_weight(dw, dy, x, dev); }, 3, 20);
  }
  if (which == "fwd") return median_ms([&] { cuda::grouped_linear(y, x, w, offsets); }, 3, 20);
  if (which == "dX")
    return median_ms([&] { cuda::grouped_linear_backward_input(dx, dy, w, offsets); }, 3, 20);
  return median_ms([&] { cuda::grouped_linear_backward_weight(dw, dy, x, offsets); }, 3, 20);
}

// c[:, h] = a[:, h] · W_h per head, W_h the rows of kv_b_proj [NH·(Dn + Dv), R] that belong to
// head h at `row_off` (the MLA composite's q-absorb, o-expand and their gradients).
void per_head_gemm(bool trans_b, int64_t in_dim, int64_t out_dim, const Tensor& a,
                   const Tensor& kv_b, int64_t row_off, Tensor& c) {
  const int64_t t = a.shape()[0], nh = a.shape()[1], r = kv_b.shape()[1];
  const int64_t rows_per_head = kv_b.shape()[0] / nh;
  for (int64_t h = 0; h < nh; ++h)
    cuda::gemm({0, false, trans_b, t, out_dim, in_dim,
                static_cast<const char*>(a.data_ptr()) + h * in_dim * 2, nh * in_dim,
                static_cast<const char*>(kv_b.data_ptr()) + (h * rows_per_head + row_off) * r * 2,
                r, static_cast<char*>(c.data_ptr()) + h * out_dim * 2, nh * out_dim, DType::bf16});
}

// The absorbed attention kernel alone (no per-head GEMMs) at the model's sparse shape: one
// document of t tokens, each query the keys ≤ it when there are at most `top` of them, otherwise
// `top` keys in pools of 4 spread evenly over [0, i] (the indexer's selection has that form;
// which pools it picks does not change the FLOPs). Variant fwd times the forward, bwd the
// backward after one forward outside the timing.
double time_absorbed_sparse(int64_t t, int64_t nh, int64_t top, const std::string& variant) {
  const int64_t r = 512, pools = top / 4;
  Tensor idx_host = Tensor::full({t, top}, -1.0, DType::i32);
  for (int64_t i = 0; i < t; ++i) {
    int32_t* row = idx_host.data<int32_t>() + i * top;
    if (i < top) {
      for (int64_t j = 0; j <= i; ++j) row[j] = int32_t(j);
      continue;
    }
    const int64_t available = (i + 1) / 4;  // whole pools at or before i
    for (int64_t p = 0; p < pools; ++p)
      for (int64_t e = 0; e < 4; ++e) row[4 * p + e] = int32_t(4 * (p * available / pools) + e);
  }
  Tensor cu = Tensor::empty({2}, DType::i64);
  cu.data<int64_t>()[0] = 0;
  cu.data<int64_t>()[1] = t;
  const Tensor idx = idx_host.to(kGpu);
  const double scale = 1.0 / std::sqrt(256.0);
  const Tensor q_abs = random_gpu({t, nh, r}, DType::bf16, 41);
  const Tensor latent = random_gpu({t, r}, DType::bf16, 42, 0.5);
  const cuda::SparseKeySets query_sets = cuda::sparse_key_sets(idx, cu, /*key_major=*/false);
  const cuda::AbsorbedKernel fwd_kernel = ops::cuda_path::absorbed_kernel(0, false);
  if (variant == "fwd")
    return median_ms(
        [&] {
          cuda::absorbed_attention_forward(q_abs, latent, query_sets, scale, nullptr, fwd_kernel);
        },
        2, 5);
  const cuda::SparseKeySets key_sets = cuda::sparse_key_sets(idx, cu, /*key_major=*/true);
  const cuda::AbsorbedAttentionOutput out =
      cuda::absorbed_attention_forward(q_abs, latent, query_sets, scale, nullptr, fwd_kernel);
  const Tensor d_out = random_gpu({t, nh, r}, DType::bf16, 43);
  const cuda::AbsorbedKernel bwd_kernel = ops::cuda_path::absorbed_kernel(0, true);
  return median_ms(
      [&] {
        cuda::absorbed_attention_backward(q_abs, latent, out.out, out.lse2, key_sets, scale, d_out,
                                          nullptr, int64_t(1) << 31, bwd_kernel);
      },
      1, 3);
}

// Dense causal attention of one document as the sparse MLA kernels run it with every key ≤ i
// selected: the per-head kernel on q, k, v (SDPA's exact function), or the absorbed-latent form
// the model runs, with its q-absorb and o-expand GEMMs (the same function of q and the latent).
// The key sets are built once, outside the timing.
double time_attention(int64_t t, int64_t nh, int64_t d, const std::string& variant) {
  const int64_t r = 512;
  Tensor idx_host = Tensor::full({t, t}, -1.0, DType::i32);
  for (int64_t i = 0; i < t; ++i)
    for (int64_t j = 0; j <= i; ++j) idx_host.data<int32_t>()[i * t + j] = int32_t(j);
  Tensor cu = Tensor::empty({2}, DType::i64);
  cu.data<int64_t>()[0] = 0;
  cu.data<int64_t>()[1] = t;
  const cuda::SparseKeySets sets = cuda::sparse_key_sets(idx_host.to(kGpu), cu, true);
  const double scale = 1.0 / std::sqrt(double(d));
  const Tensor q = random_gpu({t, nh, d}, DType::bf16, 31);
  const Tensor dout = random_gpu({t, nh, d}, DType::bf16, 34);
  if (variant.rfind("per-head", 0) == 0) {
    const Tensor k = random_gpu({t, nh, d}, DType::bf16, 32);
    const Tensor v = random_gpu({t, nh, d}, DType::bf16, 33);
    if (variant == "per-head fwd")
      return median_ms([&] { cuda::sparse_attention_forward(q, k, v, sets, scale); }, 1, 3);
    return median_ms(
        [&] {
          const cuda::SparseAttentionOutput o =
              cuda::sparse_attention_forward(q, k, v, sets, scale);
          cuda::sparse_attention_backward(q, k, v, o.out, o.lse, sets, scale, dout);
        },
        1, 3);
  }
  // The absorbed kernels the model would run here (ops/cuda/dispatch.h): wgmma on Hopper.
  const cuda::AbsorbedKernel fwd_kernel = ops::cuda_path::absorbed_kernel(0, false);
  const cuda::AbsorbedKernel bwd_kernel = ops::cuda_path::absorbed_kernel(0, true);
  const Tensor latent = random_gpu({t, r}, DType::bf16, 35);
  const Tensor kv_b = random_gpu({nh * 2 * d, r}, DType::bf16, 36, 1.0 / std::sqrt(double(r)));
  Tensor q_abs = Tensor::empty({t, nh, r}, DType::bf16, kGpu);
  Tensor o = Tensor::empty({t, nh, d}, DType::bf16, kGpu);
  Tensor d_olat = Tensor::empty({t, nh, r}, DType::bf16, kGpu);
  Tensor dq = Tensor::empty({t, nh, d}, DType::bf16, kGpu);
  auto forward = [&] {
    per_head_gemm(false, d, r, q, kv_b, 0, q_abs);
    cuda::AbsorbedAttentionOutput out =
        cuda::absorbed_attention_forward(q_abs, latent, sets, scale, nullptr, fwd_kernel);
    per_head_gemm(true, r, d, out.out, kv_b, d, o);
    return out;
  };
  if (variant == "absorbed fwd") return median_ms([&] { forward(); }, 2, 5);
  return median_ms(
      [&] {
        const cuda::AbsorbedAttentionOutput out = forward();
        per_head_gemm(false, d, r, dout, kv_b, d, d_olat);
        const cuda::AbsorbedAttentionGrads g =
            cuda::absorbed_attention_backward(q_abs, latent, out.out, out.lse2, sets, scale, d_olat,
                                              nullptr, int64_t(1) << 31, bwd_kernel);
        per_head_gemm(true, r, d, g.q_abs, kv_b, 0, dq);
      },
      1, 3);
}

// Row-major C[m, n] = op(A) op(B) through our cuBLASLt wrapper; layout NT: B stored [n, k], NN: B
// stored [k, n], TN: A stored [k, m].
double time_gemm(int64_t m, int64_t n, int64_t k, const std::string& layout) {
  const bool trans_a = layout == "TN", trans_b = layout == "NT";
  const Tensor a = random_gpu(trans_a ? Shape{k, m} : Shape{m, k}, DType::bf16, 11);
  const Tensor b =
      random_gpu(trans_b ? Shape{n, k} : Shape{k, n}, DType::bf16, 12, 1.0 / std::sqrt(double(k)));
  Tensor c = Tensor::empty({m, n}, DType::bf16, kGpu);
  cuda::GemmArgs g;
  g.trans_a = trans_a;
  g.trans_b = trans_b;
  g.m = m, g.n = n, g.k = k;
  g.a = a.data_ptr(), g.lda = trans_a ? m : k;
  g.b = b.data_ptr(), g.ldb = trans_b ? k : n;
  g.c = c.data_ptr(), g.ldc = n;
  return median_ms([&] { cuda::gemm(g); }, 3, 20);
}

// Block-scaled FP8 GEMMs, operands quantised outside the timing. C[m, n] reduces over k: fwd
// y = x wᵀ (x [m, k] in 1x128 tiles, w [n, k] in 128x128 blocks); dX the same product with the
// transposed weight's blocks (w_t [n, k]); dW = dyᵀ x over k tokens, both in 128x1 tiles, into a
// bf16 gradient (the bf16 TN row's output type).
double time_fp8_gemm(int64_t m, int64_t n, int64_t k, const std::string& variant) {
  if (variant == "dW") {
    const ops::Fp8Blocks dy =
        cuda::quantize_fp8_blocks(random_gpu({k, m}, DType::bf16, 11), 128, 1);
    const ops::Fp8Blocks x = cuda::quantize_fp8_blocks(random_gpu({k, n}, DType::bf16, 12), 128, 1);
    Tensor dw = Tensor::empty({m, n}, DType::bf16, kGpu);
    return median_ms([&] { cuda::fp8_linear_backward_weight(dw, dy, x, false); }, 3, 20);
  }
  const ops::Fp8Blocks a = cuda::quantize_fp8_blocks(random_gpu({m, k}, DType::bf16, 11), 1, 128);
  const ops::Fp8Blocks b = cuda::quantize_fp8_blocks(
      random_gpu({n, k}, DType::bf16, 12, 1.0 / std::sqrt(double(k))), 128, 128);
  Tensor c = Tensor::empty({m, n}, DType::bf16, kGpu);
  if (variant == "dX")
    return median_ms([&] { cuda::fp8_linear_backward_input_out(c, a, b); }, 3, 20);
  return median_ms([&] { cuda::fp8_linear_out(c, a, b); }, 3, 20);
}

// The expert GEMMs in FP8 (one dense FP8 GEMM per expert, or the grouped kernel with the offsets
// on the device: "one launch"), the shapes of time_grouped.
double time_fp8_grouped(int64_t per_group, int64_t n, int64_t k, const std::string& variant) {
  const int64_t experts = 36, total = per_group * experts;
  std::vector<int64_t> offsets(size_t(experts) + 1);
  for (int64_t e = 0; e <= experts; ++e) offsets[size_t(e)] = e * per_group;
  const Tensor x = random_gpu({total, k}, DType::bf16, 11);
  const Tensor dy = random_gpu({total, n}, DType::bf16, 13);
  const Tensor w = random_gpu({experts, n, k}, DType::bf16, 12, 1.0 / std::sqrt(double(k)));
  if (variant.ends_with("one launch")) {
    std::vector<int32_t> offsets32(offsets.begin(), offsets.end());
    const Tensor dev_offsets = Tensor::from_vector(offsets32, {experts + 1}).to(kGpu);
    if (variant == "dW one launch") {
      const cuda::Fp8TokenTiles dyq = cuda::quantize_fp8_token_tiles(dy, dev_offsets);
      const cuda::Fp8TokenTiles xq = cuda::quantize_fp8_token_tiles(x, dev_offsets);
      Tensor dw = Tensor::zeros({experts, n, k}, DType::bf16, kGpu);
      return median_ms([&] { cuda::fp8_grouped_linear_backward_weight(dw, dyq, xq, dev_offsets); },
                       3, 20);
    }
    const ops::Fp8Blocks w_stack = cuda::quantize_fp8_blocks(w.reshape({experts * n, k}), 128, 128);
    if (variant == "fwd one launch") {
      const ops::Fp8Blocks xq = cuda::quantize_fp8_blocks(x, 1, 128);
      Tensor y = Tensor::empty({total, n}, DType::bf16, kGpu);
      return median_ms([&] { cuda::fp8_grouped_linear(y, xq, w_stack, dev_offsets); }, 3, 20);
    }
    const ops::Fp8Blocks dyq = cuda::quantize_fp8_blocks(dy, 1, 128);
    Tensor dx = Tensor::empty({total, k}, DType::bf16, kGpu);
    return median_ms(
        [&] { cuda::fp8_grouped_linear_backward_input(dx, dyq, w_stack, dev_offsets); }, 3, 20);
  }
  const std::vector<ops::Fp8Blocks> wq = cuda::quantize_fp8_weight_grouped(w);
  if (variant == "fwd") {
    const std::vector<ops::Fp8Blocks> xq = cuda::quantize_fp8_grouped(x, offsets, 1, 128);
    Tensor y = Tensor::empty({total, n}, DType::bf16, kGpu);
    return median_ms([&] { cuda::fp8_grouped_linear(y, xq, wq, offsets); }, 3, 20);
  }
  if (variant == "dX") {  // the forward's blocks: each expert's transpose is part of the op
    const std::vector<ops::Fp8Blocks> dyq = cuda::quantize_fp8_grouped(dy, offsets, 1, 128);
    Tensor dx = Tensor::empty({total, k}, DType::bf16, kGpu);
    return median_ms([&] { cuda::fp8_grouped_linear_backward_input(dx, dyq, wq, offsets); }, 3, 20);
  }
  const std::vector<ops::Fp8Blocks> dyq = cuda::quantize_fp8_grouped(dy, offsets, 128, 1);
  const std::vector<ops::Fp8Blocks> xq = cuda::quantize_fp8_grouped(x, offsets, 128, 1);
  Tensor dw = Tensor::zeros({experts, n, k}, DType::bf16, kGpu);
  return median_ms([&] { cuda::fp8_grouped_linear_backward_weight(dw, dyq, xq, offsets); }, 3, 20);
}

double time_fp8_quantize(int64_t rows, int64_t cols, const std::string& variant) {
  const Tensor x = random_gpu({rows, cols}, DType::bf16, 41);
  if (variant == "transpose") {
    const ops::Fp8Blocks w = cuda::quantize_fp8_blocks(x, 128, 128);
    return median_ms([&] { cuda::transpose_fp8_weight(w); }, 3, 20);
  }
  const int64_t br = variant == "1x128" ? 1 : 128, bc = variant == "128x1" ? 1 : 128;
  return median_ms([&] { cuda::quantize_fp8_blocks(x, br, bc); }, 3, 20);
}

double time_mhc(int64_t t, int64_t h, int64_t d, const std::string& variant) {
  const int64_t m = (2 + h) * h;
  const Tensor x = random_gpu({t, h, d}, DType::bf16, 11);
  const Tensor fn = random_gpu({m, h * d}, DType::f32, 12, 0.01);
  const Tensor base = random_gpu({m}, DType::f32, 13, 0.5);
  const Tensor scale = random_gpu({3}, DType::f32, 14, 0.2, 1.0);
  const Tensor y = random_gpu({t, d}, DType::bf16, 15);
  ops::MhcOptions opt;
  opt.hc_mult = h;
  ops::MhcPreSaved saved;
  const ops::MhcPreResult pre = cuda::mhc_pre(x, fn, base, scale, opt, &saved);
  if (variant == "pre fwd")
    return median_ms([&] { cuda::mhc_pre(x, fn, base, scale, opt, &saved); }, 3, 20);
  if (variant == "pre bwd") {
    const Tensor d_post = random_gpu({t, h}, DType::f32, 16);
    const Tensor d_comb = random_gpu({t, h, h}, DType::f32, 17);
    const Tensor d_collapsed = random_gpu({t, d}, DType::bf16, 18);
    ops::MhcGrads grads;
    return median_ms(
        [&] {
          cuda::mhc_pre_backward(x, fn, base, scale, opt, &saved, d_post, d_comb, d_collapsed,
                                 grads);
        },
        3, 20);
  }
  if (variant == "post fwd")
    return median_ms([&] { cuda::mhc_post(x, y, pre.post, pre.comb); }, 3, 20);
  const Tensor dout = random_gpu({t, h, d}, DType::bf16, 19);
  return median_ms([&] { cuda::mhc_post_backward(x, y, pre.post, pre.comb, dout); }, 3, 20);
}

double time_rmsnorm(int64_t rows, int64_t width, const std::string& variant) {
  const Tensor x = random_gpu({rows, width}, DType::bf16, 21);
  const Tensor w = random_gpu({width}, DType::bf16, 22);
  const Tensor dy = random_gpu({rows, width}, DType::bf16, 23);
  Tensor y = Tensor::empty({rows, width}, DType::bf16, kGpu), dx = y.clone();
  Tensor rstd = Tensor::empty({rows}, DType::f32, kGpu);
  Tensor dw = Tensor::zeros({width}, DType::f32, kGpu);
  cuda::rms_norm_out(y, &rstd, x, w, 1e-5);
  if (variant == "fwd") return median_ms([&] { cuda::rms_norm_out(y, &rstd, x, w, 1e-5); }, 5, 50);
  return median_ms([&] { cuda::rms_norm_backward_out(dx, dy, x, w, 1e-5, rstd, &dw); }, 5, 50);
}

// KDA's conv on [t, c] in 4 equal documents (alone or with the q/k L2 norm over heads of 128),
// and its gated norm on rows of 128 of the same elements.
double time_kda_small(int64_t t, int64_t c, int64_t taps, const std::string& variant) {
  const Tensor x = random_gpu({t, c}, DType::bf16, 41), dy = random_gpu({t, c}, DType::bf16, 42);
  if (variant.find("conv") != std::string::npos) {
    const Tensor w = random_gpu({c, taps}, DType::bf16, 43, 0.5);
    const Tensor cu = Tensor::from_vector<int32_t>(
        {0, int32_t(t / 4), int32_t(t / 2), int32_t(3 * t / 4), int32_t(t)}, {5});
    const Tensor cug = cu.to(kGpu);
    Tensor dw = Tensor::zeros({c, taps}, DType::f32, kGpu), norm;
    if (variant == "conv fwd")
      return median_ms([&] { cuda::causal_conv1d(x, w, cug, true); }, 5, 50);
    if (variant == "conv bwd")
      return median_ms([&] { cuda::causal_conv1d_backward(x, w, cug, true, dy, &dw); }, 5, 50);
    if (variant == "qk conv fwd")
      return median_ms([&] { cuda::kda_qk_conv(x, w, cug, 128, 1e-6, &norm); }, 5, 50);
    cuda::kda_qk_conv(x, w, cug, 128, 1e-6, &norm);
    return median_ms([&] { cuda::kda_qk_conv_backward(x, w, cug, 128, 1e-6, norm, dy, &dw); }, 5,
                     50);
  }
  if (variant == "l2 fwd")
    return median_ms([&] { cuda::l2_norm(x.view({t, c / 128, 128}), 1e-6); }, 5, 50);
  if (variant == "l2 bwd")
    return median_ms(
        [&] {
          cuda::l2_norm_backward(dy.view({t, c / 128, 128}), x.view({t, c / 128, 128}), 1e-6);
        },
        5, 50);
  const Tensor rows = x.view({t * c / 128, 128}),
               z = random_gpu({t * c / 128, 128}, DType::bf16, 44);
  const Tensor w = random_gpu({128}, DType::f32, 45);
  if (variant == "o_norm fwd")
    return median_ms([&] { cuda::rms_norm_gated(rows, w, z, 1e-5); }, 5, 50);
  Tensor dw = Tensor::zeros({128}, DType::f32, kGpu);
  return median_ms(
      [&] {
        cuda::rms_norm_gated_backward(dy.view({t * c / 128, 128}), rows, w, z, 1e-5, &dw);
      },
      5, 50);
}

double time_swiglu(int64_t rows, int64_t width, const std::string& variant) {
  const Tensor gate_up = random_gpu({rows, 2 * width}, DType::bf16, 31, 4.0);
  const Tensor gate = gate_up.slice(1, 0, width), up = gate_up.slice(1, width, 2 * width);
  const Tensor dout = random_gpu({rows, width}, DType::bf16, 32);
  Tensor out = Tensor::empty({rows, width}, DType::bf16, kGpu);
  Tensor d_gate_up = Tensor::empty({rows, 2 * width}, DType::bf16, kGpu);
  Tensor dg = d_gate_up.slice(1, 0, width), du = d_gate_up.slice(1, width, 2 * width);
  if (variant == "fwd")
    return median_ms([&] { cuda::swiglu_clamped_out(out, gate, up, 10.0); }, 5, 50);
  return median_ms([&] { cuda::swiglu_clamped_backward(gate, up, dout, 10.0, dg, du); }, 5, 50);
}

double time_lm_head_ce(int64_t t, int64_t d, int64_t vocab, int64_t chunk) {
  const Tensor hidden = random_gpu({t, d}, DType::bf16, 51);
  const Tensor weight = random_gpu({vocab, d}, DType::bf16, 52, 1.0 / 64.0);
  Tensor labels = Tensor::empty({t}, DType::i32);
  for (int64_t i = 0; i < t; ++i) labels.data<int32_t>()[i] = int32_t((i * 7919) % vocab);
  Tensor dh = Tensor::empty({t, d}, DType::bf16, kGpu);
  Tensor dw = Tensor::zeros({vocab, d}, DType::f32, kGpu);
  ops::CrossEntropyOptions opts;
  opts.chunk_rows = chunk;
  return median_ms([&] { cuda::lm_head_cross_entropy(hidden, weight, labels, opts, &dh, &dw); }, 1,
                   5);
}

// The vision tower's attention over `segments` equal segments (ops::varlen_attention on the GPU),
// q, k, v of [segments · rows, heads · d] bf16; fwd+bwd runs the forward and the backward.
double time_vision_attention(int64_t segments, int64_t rows, int64_t heads, int64_t d,
                             const std::string& variant) {
  const int64_t n = segments * rows;
  std::vector<int64_t> cu{0};
  for (int64_t s = 0; s < segments; ++s) cu.push_back(cu.back() + rows);
  const Tensor q = random_gpu({n, heads * d}, DType::bf16, 61);
  const Tensor k = random_gpu({n, heads * d}, DType::bf16, 62);
  const Tensor v = random_gpu({n, heads * d}, DType::bf16, 63);
  const Tensor dout = random_gpu({n, heads * d}, DType::bf16, 64);
  const double scale = 1.0 / std::sqrt(double(d));
  if (variant == "fwd")
    return median_ms([&] { ops::varlen_attention(q, k, v, cu, heads, scale); }, 3, 10);
  return median_ms(
      [&] {
        Tensor lse;
        const Tensor out = ops::varlen_attention(q, k, v, cu, heads, scale, 0, &lse);
        ops::varlen_attention_backward(q, k, v, out, dout, cu, heads, scale, 0, lse);
      },
      3, 10);
}

double time_spec(const OpSpec& s) {
  const std::vector<int64_t>& d = s.dims;
  switch (s.family) {
    case Family::matmul_ceiling:
      return time_matmul(d[0]);
    case Family::copy_ceiling:
      return time_copy(d[0]);
    case Family::kda:
      return time_kda(d, s.variant);
    case Family::grouped_gemm:
      return time_grouped(d[0], d[1], d[2], s.variant);
    case Family::attention:
      return time_attention(d[0], d[1], d[2], s.variant);
    case Family::absorbed_sparse:
      return time_absorbed_sparse(d[0], d[1], d[2], s.variant);
    case Family::gemm:
      return time_gemm(d[0], d[1], d[2], s.variant);
    case Family::mhc:
      return time_mhc(d[0], d[1], d[2], s.variant);
    case Family::rmsnorm:
      return time_rmsnorm(d[0], d[1], s.variant);
    case Family::kda_small:
      return time_kda_small(d[0], d[1], d[2], s.variant);
    case Family::swiglu:
      return time_swiglu(d[0], d[1], s.variant);
    case Family::lm_head_ce:
      return time_lm_head_ce(d[0], d[1], d[2], d[3]);
    case Family::vision_attention:
      return time_vision_attention(d[0], d[1], d[2], d[3], s.variant);
    case Family::fp8_gemm:
      return time_fp8_gemm(d[0], d[1], d[2], s.variant);
    case Family::fp8_grouped_gemm:
      return time_fp8_grouped(d[0], d[1], d[2], s.variant);
    case Family::fp8_quantize:
      return time_fp8_quantize(d[0], d[1], s.variant);
  }
  throw InternalError("bench ops: an op family without timing code");
}

int run_bench_ops(const OpsArgs& a) {
  if (!cuda_available())
    throw Error("no CUDA device is visible", "glmtune bench ops",
                "run it on a machine with a GPU (glmtune bench ops times CUDA kernels)");
  const std::vector<OpSpec> specs = benchops::select_specs(benchops::op_specs(), a.only);
  cudaDeviceProp prop{};
  GLMTUNE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const std::string device = fmt::format("{}, {} SMs", prop.name, prop.multiProcessorCount);
  std::fprintf(stderr, "bench ops: %s\n", device.c_str());

  // The peer starts first: it prepares (and FLA compiles) while we time, and waits for the GPU
  // lock before it times anything itself.
  benchops::PeerReport no_peers;
  std::unique_ptr<benchops::PeerProcess> peer;
  if (!a.peers) {
    no_peers.error = "peers not run (--no-peers)";
  } else {
    benchops::PeerOptions po;
    po.python = a.python;
    po.script = benchops::find_peer_script(a.peers_script);
    po.fla_max_configs = a.fla_max_configs;
    po.timeout_s = a.peer_timeout;
    std::set<std::string> keys;
    for (const OpSpec& s : specs)
      if (!s.peer_key.empty()) keys.insert(s.peer_key);
    po.keys.assign(keys.begin(), keys.end());
    if (po.script.empty())
      no_peers.error =
          "bench/ops_peers.py not found: pass --peers-script PATH, set GLMTUNE_SOURCE_DIR or run "
          "from the repository root";
    else if (!po.keys.empty())
      peer = std::make_unique<benchops::PeerProcess>(po);
  }

  std::vector<benchops::OpResult> results;
  for (const OpSpec& s : specs) {
    benchops::OpResult r;
    r.spec = s;
    r.ms = time_spec(s);
    std::fprintf(stderr, "  %-52s %-30s %10.3f ms\n", s.op.c_str(), s.shape.c_str(), r.ms);
    results.push_back(std::move(r));
    cuda_allocator(0).release_cached();
  }
  if (peer) std::fprintf(stderr, "bench ops: our timings done; waiting for the peers\n");
  const benchops::PeerReport report = peer ? peer->finish() : no_peers;
  benchops::attach_peers(results, report);
  const benchops::Ceilings ceilings = benchops::measured_ceilings(results);
  std::printf("device: %s\n%s", device.c_str(),
              benchops::format_table(results, ceilings, report).c_str());
  if (!a.json_path.empty()) {
    std::ofstream out(a.json_path);
    out << benchops::report_json(results, ceilings, report, device).dump(1) << "\n";
    if (!out)
      throw Error("cannot write the JSON report", a.json_path, "pass a writable --json path");
  }
  return 0;
}
#endif

}  // namespace

namespace glmtune::cli {

BenchSubcommand add_bench_ops(CLI::App& bench) {
  auto a = std::make_shared<OpsArgs>();
  CLI::App* ops = bench.add_subcommand(
      "ops",
      "Time each hot op of the text step with glmtune's CUDA kernels next to its peer (FLA, "
      "torch) in the same run: ours / peer, and the share of the measured bf16 matrix rate or "
      "copy bandwidth");
  ops->add_option("--json", a->json_path, "Also write the table as JSON to this file");
  ops->add_option("--only", a->only,
                  "Time only the ops whose 'op shape' matches this regular expression (the two "
                  "ceilings always run)");
  ops->add_option("--python", a->python, "The Python interpreter of the peers (torch, fla)");
  ops->add_option("--peers-script", a->peers_script,
                  "bench/ops_peers.py (default: found under GLMTUNE_SOURCE_DIR or the current "
                  "folder)");
  ops->add_flag("!--no-peers", a->peers, "Time our kernels alone");
  ops->add_option("--peer-timeout", a->peer_timeout,
                  "Seconds from the start after which the peers stop preparing (compiling) and "
                  "time what is ready")
      ->check(CLI::PositiveNumber);
  ops->add_option("--fla-max-configs", a->fla_max_configs,
                  "Autotune configs kept per FLA kernel (0 = all: minutes per shape)")
      ->check(CLI::NonNegativeNumber);
  return {ops, [a]() -> int {
#ifdef GLMTUNE_WITH_CUDA
            return run_bench_ops(*a);
#else
            throw Error("glmtune bench ops measures a GPU, and this glmtune was built without CUDA",
                        "glmtune bench ops", "build with -DGLMTUNE_CUDA=ON on a machine with CUDA");
#endif
          }};
}

}  // namespace glmtune::cli
