// Every leaf op of ops/*.h that has a CUDA body, called with CUDA tensors (ops/dispatch.h) against
// the same op on the CPU in f32, on the same values: one row per op, run once per device. Inputs
// are fresh random draws rounded to bf16 (seed printed; GLMTUNE_TEST_SEED reproduces a run); the
// parameters the GPU keeps in f32 (model::is_fp32_kept) and the gradient buffers are f32 on both
// sides. Gradient buffers start pre-filled, so a path that overwrites instead of adding fails.
// Each output is compared in relative L2 against its bar: bf16 storage of the GPU operands and
// results bounds a single rounding at 2^-9 ≈ 2e-3 per element; the bars of 1e-2 leave room for
// the few roundings of a chain, 1e-4 / 1e-5 for f32 accumulations of bf16 products, 0 for copies.
// Skipped (not failed) where no GPU is visible or CUDA is not built.

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "glmtune/ops/cross_entropy.h"
#include "glmtune/ops/elementwise.h"
#include "glmtune/ops/embedding.h"
#include "glmtune/ops/kda.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/mhc.h"
#include "glmtune/ops/mla.h"
#include "glmtune/ops/mlp.h"
#include "glmtune/ops/norm.h"
#include "glmtune/ops/vision.h"
#include "glmtune/tensor/tensor.h"
#include "support/cuda_test_support.h"

using namespace glmtune;
using namespace glmtune::test;

namespace {

// The device a row runs on, and its inputs there: the same values on both sides.
struct Side {
  bool gpu = false;

  Device device() const {
#ifdef GLMTUNE_WITH_CUDA
    if (gpu) return kGpu;
#endif
    return Device::cpu();
  }
  // An activation or bf16-stored weight: bf16 on the GPU, the same values in f32 on the CPU.
  Tensor value(const Shape& shape, uint64_t stream, double std = 1.0, double mean = 0.0) const {
    const Tensor b = random_cpu(shape, DType::bf16, stream, mean, std);
    return gpu ? b.to(device()) : b.to(DType::f32);
  }
  // An integer tensor built on the host (indices), where the op reads it.
  Tensor on(const Tensor& t) const { return t.to(device()); }
  // f32 on both sides: an fp32-kept parameter, or a gradient buffer already holding a value.
  Tensor f32(const Shape& shape, uint64_t stream, double std = 0.5) const {
    return random_cpu(shape, DType::f32, stream, std).to(device());
  }
};

struct Output {
  std::string name;
  Tensor value;
  double bar;
};

struct LeafRow {
  const char* op;
  std::function<std::vector<Output>(const Side&)> run;
};

Tensor offsets(const std::vector<int32_t>& cu) {
  return Tensor::from_vector(cu, {int64_t(cu.size())});
}

// Three packed documents, one of a single token.
const std::vector<int32_t> kDocs = {0, 1, 64, 129};

// Causal selections of `width` keys per query inside its document, with −1 entries and repeats
// (what the indexer's rows look like to the attention).
Tensor causal_indices(const std::vector<int32_t>& cu, int64_t width) {
  const int64_t tokens = cu.back();
  Tensor idx = Tensor::full({tokens, width}, -1.0, DType::i32);
  std::mt19937_64 eng = seeded_engine(77);
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int64_t i = cu[d]; i < cu[d + 1]; ++i)
      for (int64_t c = 0; c < width; ++c) {
        const uint64_t u = eng();
        if (u % 5 == 0) continue;
        idx.data<int32_t>()[i * width + c] =
            int32_t(cu[d] + int64_t((u >> 8) % uint64_t(i - cu[d] + 1)));
      }
  return idx;
}

Tensor scalar(double v) { return Tensor::from_vector(std::vector<double>{v}, {1}); }

std::vector<LeafRow> leaf_rows() {
  std::vector<LeafRow> rows;
  rows.push_back({"linear", [](const Side& s) -> std::vector<Output> {
                    const int64_t T = 37, D = 96, N = 80;
                    const Tensor x = s.value({T, D}, 1), w = s.value({N, D}, 2, 0.1),
                                 b = s.value({N}, 3), dy = s.value({T, N}, 4);
                    Tensor gw = s.f32({N, D}, 5), gb = s.f32({N}, 6);
                    const Tensor y = ops::linear(x, w, b);
                    const Tensor dx = ops::linear_backward(dy, x, w, &gw, &gb);
                    return {{"y", y, 1e-2}, {"dx", dx, 1e-2}, {"dW", gw, 1e-4}, {"db", gb, 1e-5}};
                  }});
  rows.push_back(
      {"linear_with_adapter", [](const Side& s) -> std::vector<Output> {
         // A LoRA projection (ops/linear.h): rank 8, scale alpha / r = 2, the base
         // frozen, its input also feeding another projection's dx sum.
         const int64_t T = 37, D = 96, N = 80, R = 8;
         ops::Linear l(s.value({N, D}, 30, 0.1), s.value({N}, 31));
         l.weight.set_frozen();
         l.lora.A = s.value({R, D}, 32, 0.1);
         l.lora.B = s.value({N, R}, 33, 0.3);
         l.lora.scale = 2.0;
         const Tensor x = s.value({T, D}, 34), dy = s.value({T, N}, 35);
         ops::Linear g;
         g.lora.A = s.f32({R, D}, 36);
         g.lora.B = s.f32({N, R}, 37);
         const Tensor y = ops::linear(x, l);
         const Tensor dx = ops::linear_backward(dy, x, l, &g);
         return {{"y", y, 1e-2}, {"dx", dx, 1e-2}, {"dA", g.lora.A, 1e-2}, {"dB", g.lora.B, 1e-2}};
       }});
  rows.push_back(
      {"linear_backward_add", [](const Side& s) -> std::vector<Output> {
         // dx of an input feeding two projections, summed before one rounding.
         const int64_t T = 33, D = 64, N1 = 48, N2 = 80;
         const Tensor x = s.value({T, D}, 10), w1 = s.value({N1, D}, 11, 0.1),
                      w2 = s.value({N2, D}, 12, 0.1), dy1 = s.value({T, N1}, 13),
                      dy2 = s.value({T, N2}, 14);
         Tensor g1 = s.f32({N1, D}, 15), g2 = s.f32({N2, D}, 16), gb2 = s.f32({N2}, 17);
         Tensor sum;
         ops::linear_backward_add(sum, dy1, x, w1, &g1);
         ops::linear_backward_add(sum, dy2, x, w2, &g2, &gb2);
         return {{"dx sum", sum, 1e-3}, {"dW1", g1, 1e-4}, {"dW2", g2, 1e-4}, {"db2", gb2, 1e-5}};
       }});
  rows.push_back(
      {"rms_norm", [](const Side& s) -> std::vector<Output> {
         const int64_t T = 29, D = 128;
         const Tensor x = s.value({T, D}, 20), w = s.value({D}, 21, 0.1, 1.0),
                      dy = s.value({T, D}, 22);
         Tensor rstd, gw = s.f32({D}, 23);
         const Tensor y = ops::rms_norm(x, w, 1e-5, &rstd);
         const Tensor dx = ops::rms_norm_backward(dy, x, w, 1e-5, rstd, &gw);
         return {{"y", y, 1e-2}, {"rstd", rstd, 1e-5}, {"dx", dx, 1e-2}, {"dw", gw, 1e-4}};
       }});
  rows.push_back(
      {"rms_norm_gated", [](const Side& s) -> std::vector<Output> {
         const int64_t T = 31, NL = 3, HL = 128;
         const Tensor x = s.value({T, NL, HL}, 30), gate = s.value({T, NL, HL}, 31),
                      w = s.f32({HL}, 32, 0.5), dy = s.value({T, NL, HL}, 33);
         Tensor rstd, gw = s.f32({HL}, 34);
         const Tensor y =
             ops::rms_norm_gated(x, w, gate, 1e-5, ops::GateActivation::sigmoid, &rstd);
         const ops::RmsNormGatedGrads g = ops::rms_norm_gated_backward(
             dy, x, w, gate, 1e-5, ops::GateActivation::sigmoid, rstd, &gw);
         return {{"y", y, 1e-2}, {"dx", g.dx, 1e-2}, {"dgate", g.dgate, 1e-2}, {"dw", gw, 1e-4}};
       }});
  rows.push_back({"layer_norm", [](const Side& s) -> std::vector<Output> {
                    // The vision tower's width with rows off zero mean, and a width that is no
                    // multiple of the block.
                    const int64_t T = 37;
                    std::vector<Output> out;
                    for (const int64_t D : {1024, 300}) {
                      const std::string d = " D=" + std::to_string(D);
                      const Tensor x = s.value({T, D}, 150 + uint64_t(D), 1.0, 0.5),
                                   w = s.value({D}, 151, 0.1, 1.0), b = s.value({D}, 152, 0.1),
                                   dy = s.value({T, D}, 153);
                      Tensor mean, rstd, gw = s.f32({D}, 154), gb = s.f32({D}, 155);
                      const Tensor y = ops::layer_norm(x, w, b, 1e-6, &mean, &rstd);
                      const Tensor dx =
                          ops::layer_norm_backward(dy, x, w, 1e-6, mean, rstd, &gw, &gb);
                      Tensor gw2 = s.f32({D}, 154), gb2 = s.f32({D}, 155);
                      const Tensor dx2 =
                          ops::layer_norm_backward(dy, x, w, 1e-6, Tensor(), Tensor(), &gw2, &gb2);
                      out.push_back({"y" + d, y, 1e-2});
                      out.push_back({"mean" + d, mean, 1e-5});
                      out.push_back({"rstd" + d, rstd, 1e-5});
                      out.push_back({"dx" + d, dx, 1e-2});
                      out.push_back({"dw" + d, gw, 1e-4});
                      out.push_back({"db" + d, gb, 1e-5});
                      out.push_back({"dx, statistics recomputed" + d, dx2, 1e-2});
                      out.push_back({"dw, statistics recomputed" + d, gw2, 1e-4});
                    }
                    return out;
                  }});
  rows.push_back({"l2_norm", [](const Side& s) -> std::vector<Output> {
                    const int64_t T = 27, NL = 2, K = 128;
                    const Tensor x = s.value({T, NL, K}, 40), dy = s.value({T, NL, K}, 41);
                    Tensor norm;
                    const Tensor y = ops::l2_norm(x, 1e-6, &norm);
                    const Tensor dx = ops::l2_norm_backward(dy, x, 1e-6, norm);
                    return {{"y", y, 1e-2}, {"norm", norm, 1e-5}, {"dx", dx, 1e-2}};
                  }});
  rows.push_back({"swiglu_clamped", [](const Side& s) -> std::vector<Output> {
                    // Far below the clamp limit: next to it, bf16 and f32 products may fall on
                    // opposite sides (the clamps are tested on identical values in
                    // test_cuda_ops_swiglu).
                    const int64_t T = 41, I = 96;
                    const Tensor g = s.value({T, I}, 50, 1.2), u = s.value({T, I}, 51, 1.2),
                                 d = s.value({T, I}, 52);
                    Tensor dg, du;
                    const Tensor y = ops::swiglu_clamped(g, u, 10.0);
                    ops::swiglu_clamped_backward(g, u, d, 10.0, dg, du);
                    return {{"y", y, 1e-2}, {"dgate", dg, 1e-2}, {"dup", du, 1e-2}};
                  }});
  rows.push_back({"causal_conv1d", [](const Side& s) -> std::vector<Output> {
                    const int64_t C = 256, Kc = 4, T = kDocs.back();
                    const Tensor x = s.value({T, C}, 60), w = s.value({C, Kc}, 61, 0.5),
                                 dy = s.value({T, C}, 62), cu = offsets(kDocs);
                    Tensor gw = s.f32({C, Kc}, 63);
                    const Tensor y = ops::causal_conv1d(x, w, cu, true);
                    const Tensor dx = ops::causal_conv1d_backward(x, w, cu, true, dy, &gw);
                    return {{"y", y, 1e-2}, {"dx", dx, 1e-2}, {"dw", gw, 1e-4}};
                  }});
  rows.push_back(
      {"kda_qk_conv", [](const Side& s) -> std::vector<Output> {
         // Two heads of 128 (the fused kernels). In bf16 the norm is taken of the conv
         // output rounded to bf16, which ν and the weight gradient carry.
         const int64_t C = 256, Kc = 4, T = kDocs.back();
         const Tensor x = s.value({T, C}, 64), w = s.value({C, Kc}, 65, 0.5),
                      dy = s.value({T, C / 128, 128}, 66), cu = offsets(kDocs);
         Tensor gw = s.f32({C, Kc}, 67), norm;
         const Tensor y = ops::kda_qk_conv(x, w, cu, 128, 1e-6, &norm);
         const Tensor dx = ops::kda_qk_conv_backward(x, w, cu, 128, 1e-6, norm, dy, &gw);
         return {{"y", y, 1e-2}, {"norm", norm, 1e-2}, {"dx", dx, 1e-2}, {"dw", gw, 5e-3}};
       }});
  rows.push_back(
      {"kda_gate", [](const Side& s) -> std::vector<Output> {
         const int64_t T = 35, NL = 2, HL = 128;
         const Tensor graw = s.value({T, NL * HL}, 70), dt = s.f32({NL * HL}, 71),
                      alog = s.f32({NL}, 72), dg = s.f32({T, NL, HL}, 73, 1.0);
         Tensor gdt = s.f32({NL * HL}, 74), gal = s.f32({NL}, 75);
         const Tensor g = ops::kda_gate(graw, dt, alog, -5.0);
         const Tensor dz = ops::kda_gate_backward(graw, dt, alog, -5.0, dg, &gdt, &gal);
         return {
             {"g", g, 1e-5}, {"dz", dz, 1e-2}, {"d dt_bias", gdt, 1e-4}, {"d A_log", gal, 1e-4}};
       }});
  rows.push_back(
      {"kda_beta", [](const Side& s) -> std::vector<Output> {
         const int64_t T = 35, NL = 4;
         const Tensor logits = s.value({T, NL}, 80), d_beta = s.f32({T, NL}, 81, 1.0);
         const Tensor beta = ops::kda_beta(logits);
         return {{"beta", beta, 1e-6}, {"d logits", ops::kda_beta_backward(beta, d_beta), 1e-6}};
       }});
  rows.push_back(
      {"kda_chunked", [](const Side& s) -> std::vector<Output> {
         // The core's operands as the mixer makes them: L2-normalised q and k, the
         // gate's log decay and β in (0, 1), over three packed documents.
         const int64_t NL = 2, K = 128, T = kDocs.back();
         const Tensor cu = offsets(kDocs);
         const Tensor q = ops::l2_norm(s.value({T, NL, K}, 90), 1e-6),
                      k = ops::l2_norm(s.value({T, NL, K}, 91), 1e-6), v = s.value({T, NL, K}, 92);
         const Tensor g =
             ops::kda_gate(s.value({T, NL * K}, 93), s.f32({NL * K}, 94), s.f32({NL}, 95), -5.0);
         const Tensor beta = ops::kda_beta(s.value({T, NL}, 96));
         const Tensor d_out = s.value({T, NL, K}, 97);
         const double scale = 1.0 / std::sqrt(double(K));
         const Tensor o = ops::kda_chunked(q, k, v, g, beta, cu, scale);
         const ops::KdaCoreGrads d = ops::kda_chunked_backward(q, k, v, g, beta, cu, scale, d_out);
         return {{"o", o, 1e-2},     {"dq", d.dq, 1e-2}, {"dk", d.dk, 1e-2},
                 {"dv", d.dv, 1e-2}, {"dg", d.dg, 1e-2}, {"dbeta", d.dbeta, 1e-2}};
       }});
  rows.push_back({"embedding", [](const Side& s) -> std::vector<Output> {
                    const int64_t V = 50, D = 32, T = 70;
                    const Tensor table = s.value({V, D}, 100), dout = s.value({T, D}, 101);
                    std::vector<int32_t> id_values(T);
                    for (int64_t t = 0; t < T; ++t)
                      id_values[size_t(t)] = int32_t((t * 7 + t / 5) % V);
                    const Tensor ids = Tensor::from_vector(id_values, {T});
                    Tensor grad = s.f32({V, D}, 102);
                    const Tensor y = ops::embedding_forward(table, ids);
                    ops::embedding_backward(table, ids, dout, 3, grad);
                    return {{"gather", y, 0.0}, {"d table (padding row 3 untouched)", grad, 1e-5}};
                  }});
  rows.push_back({"lm_head_cross_entropy", [](const Side& s) -> std::vector<Output> {
                    const int64_t T = 45, D = 64, V = 300;
                    const Tensor h = s.value({T, D}, 110), w = s.value({V, D}, 111, 0.2);
                    std::vector<int32_t> label_values(T);
                    for (int64_t t = 0; t < T; ++t)
                      label_values[size_t(t)] =
                          t % 6 == 0 ? int32_t(ops::kIgnoreIndex) : int32_t((t * 13) % V);
                    const Tensor labels = Tensor::from_vector(label_values, {T});
                    ops::CrossEntropyOptions opts;
                    opts.denominator = 50;
                    opts.grad_scale = 0.5;
                    opts.chunk_rows = 16;
                    Tensor dh, dw = s.f32({V, D}, 112);
                    const ops::CrossEntropyResult r =
                        ops::lm_head_cross_entropy(h, w, labels, opts, &dh, &dw);
                    return {{"loss", scalar(r.loss), 1e-3},
                            {"label tokens", scalar(double(r.n_tokens)), 0.0},
                            {"d hidden", dh, 1e-2},
                            {"d head", dw, 1e-3}};
                  }});
  rows.push_back({"mhc_streams", [](const Side& s) -> std::vector<Output> {
                    const int64_t T = 23, H = 4, D = 48;
                    const Tensor x = s.value({T, D}, 120), streams = s.value({T, H, D}, 121);
                    return {{"expand", ops::mhc_expand(x, H), 0.0},
                            {"head", ops::mhc_head(streams), 1e-2},
                            {"expand backward", ops::mhc_expand_backward(streams), 1e-2},
                            {"head backward", ops::mhc_head_backward(x, H), 1e-2}};
                  }});
  rows.push_back(
      {"sparse_attention", [](const Side& s) -> std::vector<Output> {
         // A head geometry the GPU kernels cover (check_gpu_geometry).
         const int64_t NH = 4, Dqk = 128, Dv = 64, T = kDocs.back();
         const Tensor q = s.value({T, NH, Dqk}, 130), k = s.value({T, NH, Dqk}, 131),
                      v = s.value({T, NH, Dv}, 132), dout = s.value({T, NH, Dv}, 133);
         const Tensor idx = s.on(causal_indices(kDocs, 24)), cu = offsets(kDocs);
         const double scale = 1.0 / std::sqrt(double(Dqk));
         const Tensor o = ops::sparse_attention(q, k, v, idx, cu, scale);
         const ops::AttentionGrads g =
             ops::sparse_attention_backward(q, k, v, idx, cu, scale, dout);
         return {{"o", o, 1e-2}, {"dq", g.q, 1e-2}, {"dk", g.k, 1e-2}, {"dv", g.v, 1e-2}};
       }});
  rows.push_back(
      {"mla_attention", [](const Side& s) -> std::vector<Output> {
         // The released latent width: the GPU takes the absorbed form, the CPU the
         // per-head one; the same function.
         ops::MlaConfig cfg;
         cfg.n_heads = 4;
         cfg.kv_lora_rank = 512;
         cfg.qk_nope_head_dim = 64;
         cfg.v_head_dim = 32;
         const int64_t T = kDocs.back(), NH = cfg.n_heads;
         const ops::Linear kvb(s.value({NH * (64 + 32), 512}, 140, 1.0 / std::sqrt(512.0)));
         ops::MlaContext ctx;
         ctx.proj.q = s.value({T, NH, 64}, 141);
         ctx.latent = s.value({T, 512}, 142);
         ctx.indices = s.on(causal_indices(kDocs, 24));
         ctx.cu_seqlens = offsets(kDocs);
         const Tensor attn = ops::mla_attention(cfg, kvb, ctx.indices, ctx.cu_seqlens, ctx);
         EXPECT_EQ(ctx.attn_latent.defined(), s.gpu) << "the absorbed form on the GPU";
         ops::Linear g_kvb(s.f32({NH * (64 + 32), 512}, 143));
         const ops::MlaAttentionGrads g =
             ops::mla_attention_backward(cfg, kvb, ctx, s.value({T, NH * 32}, 144), &g_kvb);
         return {{"attn", attn, 1e-2},
                 {"d q", g.q, 1e-2},
                 {"d latent", g.latent, 1e-2},
                 {"d kv_b_proj", g_kvb.weight, 1e-2}};
       }});
  rows.push_back({"gather_rows_and_scatter_rows_", [](const Side& s) -> std::vector<Output> {
                    const Tensor x = s.value({9, 40}, 168);
                    Tensor dst = s.value({12, 40}, 169);
                    const Tensor g = ops::gather_rows(x, {8, -1, 0, 3, 3});
                    ops::scatter_rows_(dst, {11, 2, 5}, x.narrow(0, 1, 3).contiguous());
                    return {{"gathered", g, 0}, {"scattered into", dst, 0}};
                  }});
  rows.push_back({"scale_into", [](const Side& s) -> std::vector<Output> {
                    Tensor x = s.value({9, 40}, 174);
                    ops::scale_into(x, 0.7071067811865476);  // an adapter's alpha / sqrt(r)
                    return {{"scaled", x, 1e-2}};
                  }});
  // The adapters' dropout: the same mask on both devices (counter-based draws), the kept values
  // scaled by 1 / (1 - p) (a single differing element of the 360 would be over the bar).
  rows.push_back({"dropout_into", [](const Side& s) -> std::vector<Output> {
                    Tensor x = s.value({9, 40}, 175);
                    ops::dropout_into(x, 0.3, 0x5eed);
                    return {{"dropped", x, 1e-2}};
                  }});
  // The vision tower's ops (ops/vision.h): rotary tables f32 on the GPU.
  rows.push_back({"rope_2d_", [](const Side& s) -> std::vector<Output> {
                    const int64_t N = 24, H = 3, hd = 16;
                    std::vector<int64_t> pos;
                    for (int64_t r = 0; r < N; ++r)
                      pos.insert(pos.end(), {r / 6, r % 6 + 3 * (r % 2)});
                    ops::RopeTables t = ops::rope_2d_tables(Tensor::from_vector(pos, {N, 2}), hd,
                                                            10000.0, DType::f32);
                    if (s.gpu) t = {t.cos.to(s.device()), t.sin.to(s.device())};
                    Tensor x = s.value({N * H, hd}, 170), dx = s.value({N * H, hd}, 171);
                    ops::rope_2d_(x, t);
                    ops::rope_2d_backward_(dx, t);
                    return {{"rotated x", x, 1e-2}, {"dx", dx, 1e-2}};
                  }});
  rows.push_back({"gelu_erf_", [](const Side& s) -> std::vector<Output> {
                    const Tensor x = s.value({37, 40}, 172, 2.0);
                    Tensor y = x.clone(), dy = s.value({37, 40}, 173);
                    ops::gelu_erf_(y);
                    ops::gelu_erf_backward_(x, dy);
                    return {{"y", y, 1e-2}, {"dx", dy, 1e-2}};
                  }});
  rows.push_back({"varlen_attention", [](const Side& s) -> std::vector<Output> {
                    // Segments of 1, 7, 70 and 130 rows (partial 64-row tiles), 2 heads of 64, v a
                    // view into a fused qkv; then a query range as vision sequence parallelism
                    // takes it.
                    const std::vector<int64_t> cu = {0, 1, 8, 78, 208};
                    const int64_t N = 208, H = 2, D = 128;
                    const Tensor qkv = s.value({N, 3 * D}, 174);
                    const Tensor q = qkv.slice(1, 0, D).contiguous(),
                                 k = qkv.slice(1, D, 2 * D).contiguous();
                    const Tensor v = qkv.slice(1, 2 * D, 3 * D), dout = s.value({N, D}, 175);
                    Tensor lse, lse_part;
                    const Tensor out = ops::varlen_attention(q, k, v, cu, H, 0.125, 0, &lse);
                    const ops::VarlenAttentionGrads g =
                        ops::varlen_attention_backward(q, k, v, out, dout, cu, H, 0.125, 0, lse);
                    const int64_t first = 5, rows = 95;
                    const Tensor q_part = q.slice(0, first, first + rows).contiguous();
                    const Tensor out_part =
                        ops::varlen_attention(q_part, k, v, cu, H, 0.125, first, &lse_part);
                    const ops::VarlenAttentionGrads gp = ops::varlen_attention_backward(
                        q_part, k, v, out_part, dout.slice(0, first, first + rows).contiguous(), cu,
                        H, 0.125, first, lse_part);
                    return {{"out", out, 1e-2},
                            {"lse", lse, 1e-5},
                            {"dq", g.dq, 2e-2},
                            {"dk", g.dk, 2e-2},
                            {"dv", g.dv, 2e-2},
                            {"out of rows 5..100", out_part, 1e-2},
                            {"dk of rows 5..100", gp.dk, 2e-2},
                            {"dv of rows 5..100", gp.dv, 2e-2}};
                  }});
  return rows;
}

// gtest prints a parameter that fails; the op's name says which row.
void PrintTo(const LeafRow& row, std::ostream* os) { *os << row.op; }

class CudaLeafOp : public ::testing::TestWithParam<LeafRow> {};

TEST_P(CudaLeafOp, MatchesTheCpuOp) {
  REQUIRE_GPU();
  const LeafRow& row = GetParam();
  const std::vector<Output> gpu = row.run(Side{true});
  const std::vector<Output> cpu = row.run(Side{false});
  ASSERT_EQ(gpu.size(), cpu.size());
  for (size_t i = 0; i < gpu.size(); ++i) {
    const std::string what = std::string(row.op) + ": " + gpu[i].name;
    ASSERT_TRUE(gpu[i].value.defined()) << what;
    EXPECT_CLOSE(gpu[i].value, cpu[i].value, gpu[i].bar, what);
  }
}

// A leaf op without a CUDA body refuses GPU tensors with a message instead of reading device
// memory on the host.
TEST(CudaLeafOps, CpuOnlyOpsRefuseGpuTensors) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  const Side gpu{true};
  const int64_t T = 8, NL = 1, K = 128;
  const Tensor q = gpu.value({T, NL, K}, 160), g = gpu.f32({T, NL, K}, 161),
               beta = gpu.f32({T, NL}, 162), cu = offsets({0, int32_t(T)});
  try {
    ops::kda_recurrent(q, q, q, g, beta, cu, 1.0);
    ADD_FAILURE() << "kda_recurrent took GPU tensors";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("kda_recurrent has no GPU implementation"),
              std::string::npos)
        << e.what();
  }
  const Tensor logits = gpu.value({T, 16}, 163);
  const Tensor labels = Tensor::from_vector(std::vector<int32_t>(size_t(T), 1), {T});
  EXPECT_THROW(ops::cross_entropy_forward(logits, labels), Error);
#endif
}

INSTANTIATE_TEST_SUITE_P(Ops, CudaLeafOp, ::testing::ValuesIn(leaf_rows()),
                         [](const ::testing::TestParamInfo<LeafRow>& info) {
                           return std::string(info.param.op);
                         });

}  // namespace
