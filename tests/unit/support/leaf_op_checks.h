#pragma once
// Calls of leaf ops with arguments that do not fit together, each of which the op refuses before
// it dispatches (ops/checks.h), with an InternalError that names the op: the same table runs on
// the CPU (test_leaf_op_checks) and on a GPU (test_cuda_dispatch).

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/ops/cross_entropy.h"
#include "glmtune/ops/elementwise.h"
#include "glmtune/ops/embedding.h"
#include "glmtune/ops/indexer.h"
#include "glmtune/ops/kda.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/mhc.h"
#include "glmtune/ops/mla.h"
#include "glmtune/ops/mlp.h"
#include "glmtune/ops/moe.h"
#include "glmtune/ops/norm.h"
#include "glmtune/ops/vision.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::test {

struct BadLeafCall {
  std::string op;  // named in the error
  std::string what;
  std::function<void()> call;
};

// On `device`, in its compute dtype `dtype`; `other` is another dtype of that device.
inline std::vector<BadLeafCall> bad_leaf_calls(Device device, DType dtype, DType other) {
  const auto t = [device](const Shape& s, DType d) { return Tensor::zeros(s, d, device); };
  const Tensor x = t({3, 8}, dtype), w = t({8}, dtype), stat = t({3}, DType::f32);
  const Tensor cu = Tensor::from_vector(std::vector<int32_t>{0, 3}, {2});  // one document
  const Tensor i32 = Tensor::zeros({3, 2}, DType::i32, device);  // a top-2 routing of 3 rows
  // The KDA core: q, k, g [3, 2, 4], v [3, 2, 4], beta [3, 2]; attention q, k, v [3, 2, 4].
  const Tensor qk = t({3, 2, 4}, dtype), beta = t({3, 2}, DType::f32);
  ops::MoeConfig moe;
  moe.n_experts = 4;
  moe.top_k = 2;
  ops::MoeParams experts;  // 4 experts of width 8 and intermediate 2
  experts.router_weight = t({4, 8}, dtype);
  experts.e_score_correction_bias = t({4}, DType::f32);
  experts.gate_up_proj = ops::Linear(t({4, 4, 8}, dtype));
  experts.down_proj = ops::Linear(t({4, 8, 2}, dtype));
  ops::Routing routing{t({3, 4}, DType::f32), t({3, 2}, DType::f32), i32};
  ops::IndexerConfig ic;
  ic.n_heads = 2;
  ic.head_dim = 4;
  ic.kpool = 2;
  ic.topk = 4;
  ops::IndexerParams ip;  // for x [3, 8] and q_resid [3, 6]
  ip.wq_b = ops::Linear(t({8, 6}, dtype));
  ip.wk = ops::Linear(t({4, 8}, dtype));
  ip.k_norm_weight = t({4}, DType::f32);
  ip.k_norm_bias = t({4}, DType::f32);
  ip.weights_proj = ops::Linear(t({2, 8}, dtype));
  ip.kpool_ape = t({2, 4}, DType::f32);
  ip.kpool_gate = t({4, 8}, dtype);
  const ops::RopeTables tables{t({3, 4}, DType::f32), t({3, 4}, DType::f32)};
  return {
      {"rms_norm", "a weight of another width", [=] { ops::rms_norm(x, t({7}, dtype), 1e-6); }},
      {"rms_norm", "a weight of two dimensions",
       [=] {
         ops::rms_norm(x, t({8, 1}, dtype), 1e-6);
       }},
      {"rms_norm", "no input", [=] { ops::rms_norm(Tensor(), w, 1e-6); }},
      {"rms_norm_gated", "a gate of another shape",
       [=] {
         ops::rms_norm_gated(x, w, t({3, 7}, dtype), 1e-6);
       }},
      {"rms_norm_gated", "no gate", [=] { ops::rms_norm_gated(x, w, Tensor(), 1e-6); }},
      {"layer_norm", "a bias of another width",
       [=] { ops::layer_norm(x, w, t({9}, dtype), 1e-6); }},
      {"l2_norm", "a scalar input", [=] { ops::l2_norm(t({}, dtype), 1e-6); }},
      {"rms_norm_backward", "dy of another shape",
       [=] {
         ops::rms_norm_backward(t({3, 7}, dtype), x, w, 1e-6);
       }},
      {"rms_norm_backward", "a weight gradient without a weight",
       [=] {
         Tensor g;
         ops::rms_norm_backward(x, x, Tensor(), 1e-6, Tensor(), &g);
       }},
      {"rms_norm_gated_backward", "a gate of another dtype",
       [=] {
         ops::rms_norm_gated_backward(x, x, w, t({3, 8}, other), 1e-6);
       }},
      {"layer_norm_backward", "dy of another dtype",
       [=] {
         ops::layer_norm_backward(t({3, 8}, other), x, w, 1e-6, Tensor(), stat);
       }},
      {"l2_norm_backward", "no dy", [=] { ops::l2_norm_backward(Tensor(), x, 1e-6, stat); }},
      {"swiglu_clamped", "up of another shape",
       [=] {
         ops::swiglu_clamped(x, t({3, 4}, dtype), 7.0);
       }},
      {"swiglu_clamped", "a limit of 0", [=] { ops::swiglu_clamped(x, x, 0.0); }},
      {"swiglu_clamped_backward", "dout of another dtype",
       [=] {
         Tensor dg, du;
         ops::swiglu_clamped_backward(x, x, t({3, 8}, other), 7.0, dg, du);
       }},
      {"causal_conv1d", "a weight for other channels",
       [=] {
         ops::causal_conv1d(x, t({7, 4}, dtype), cu, true);
       }},
      {"causal_conv1d", "a three-dimensional x",
       [=] {
         ops::causal_conv1d(t({3, 8, 1}, dtype), t({8, 4}, dtype), cu, true);
       }},
      {"causal_conv1d_backward", "dy of another shape",
       [=] {
         ops::causal_conv1d_backward(x, t({8, 4}, dtype), cu, true, t({3, 7}, dtype), nullptr);
       }},
      {"kda_qk_conv", "heads that do not divide the channels",
       [=] {
         ops::kda_qk_conv(x, t({8, 4}, dtype), cu, 3, 1e-6);
       }},
      {"kda_qk_conv_backward", "dy of another size",
       [=] {
         ops::kda_qk_conv_backward(x, t({8, 4}, dtype), cu, 4, 1e-6, t({3, 2}, DType::f32),
                                   t({3, 7}, dtype), nullptr);
       }},
      {"kda_gate", "a dt_bias of another width",
       [=] { ops::kda_gate(x, t({7}, DType::f32), t({2}, DType::f32), std::nullopt); }},
      {"kda_gate", "heads that do not divide the width",
       [=] { ops::kda_gate(x, t({8}, DType::f32), t({3}, DType::f32), std::nullopt); }},
      {"kda_gate_backward", "dg of another token count",
       [=] {
         ops::kda_gate_backward(x, t({8}, DType::f32), t({2}, DType::f32), std::nullopt,
                                t({4, 8}, dtype), nullptr, nullptr);
       }},
      {"kda_beta", "no logits", [=] { ops::kda_beta(Tensor()); }},
      {"mhc_pre", "fn of another width",
       [=] {
         ops::mhc_pre(t({3, 4, 8}, dtype), t({24, 31}, DType::f32), t({24}, DType::f32),
                      t({3}, DType::f32), ops::MhcOptions{});
       }},
      {"mhc_pre", "a scale of two",
       [=] {
         ops::mhc_pre(t({3, 4, 8}, dtype), t({24, 32}, DType::f32), t({24}, DType::f32),
                      t({2}, DType::f32), ops::MhcOptions{});
       }},
      {"mhc_post", "comb of another shape",
       [=] {
         ops::mhc_post(t({3, 4, 8}, dtype), x, t({3, 4}, DType::f32), t({3, 4, 3}, DType::f32));
       }},
      {"mhc_post_backward", "d_out of another shape",
       [=] {
         ops::mhc_post_backward(t({3, 4, 8}, dtype), x, t({3, 4}, DType::f32),
                                t({3, 4, 4}, DType::f32), t({3, 4, 7}, dtype));
       }},
      {"embedding_forward", "a table of one dimension",
       [=] { ops::embedding_forward(t({8}, dtype), Tensor::zeros({3}, DType::i64)); }},
      {"embedding_forward", "ids that are not integers", [=] { ops::embedding_forward(x, x); }},
      {"embedding_backward", "dout of another shape",
       [=] {
         Tensor d;
         ops::embedding_backward(x, Tensor::zeros({2}, DType::i64), t({3, 8}, dtype), std::nullopt,
                                 d);
       }},
      {"embedding_backward", "a padding row outside the table",
       [=] {
         Tensor d;
         ops::embedding_backward(x, Tensor::zeros({2}, DType::i64), t({2, 8}, dtype), 3, d);
       }},
      {"kda_beta_backward", "d_beta of another shape",
       [=] {
         ops::kda_beta_backward(x, t({3, 7}, dtype));
       }},
      {"gather_rows", "a row past the end",
       [=] {
         ops::gather_rows(x, {0, 3});
       }},
      {"scatter_rows_", "a negative row",
       [=] {
         Tensor dst = x.clone();
         ops::scatter_rows_(dst, {-1}, t({1, 8}, dtype));
       }},
      {"linear", "a weight of another width",
       [=] {
         ops::linear(x, t({5, 7}, dtype));
       }},
      {"linear", "a bias of another width",
       [=] {
         ops::linear(x, t({5, 8}, dtype), t({4}, dtype));
       }},
      {"linear_out", "an output of another width",
       [=] {
         Tensor out = t({3, 4}, dtype);
         ops::linear_out(out, x, t({5, 8}, dtype));
       }},
      {"linear_backward", "dy of other rows",
       [=] {
         ops::linear_backward(t({2, 5}, dtype), x, t({5, 8}, dtype), nullptr, nullptr);
       }},
      {"linear_backward_add", "a running gradient of another shape",
       [=] {
         Tensor sum = t({3, 7}, dtype);
         ops::linear_backward_add(sum, t({3, 5}, dtype), x, t({5, 8}, dtype), nullptr, nullptr);
       }},
      {"lm_head_cross_entropy", "labels of another length",
       [=] {
         ops::lm_head_cross_entropy(x, t({11, 8}, dtype), Tensor::zeros({2}, DType::i64),
                                    ops::CrossEntropyOptions{});
       }},
      {"kda_chunked", "beta of another shape",
       [=] {
         ops::kda_chunked(qk, qk, qk, t({3, 2, 4}, DType::f32), t({3, 3}, DType::f32), cu, 0.5);
       }},
      {"kda_chunked", "a chunk size of 0",
       [=] {
         ops::kda_chunked(qk, qk, qk, t({3, 2, 4}, DType::f32), beta, cu, 0.5, 0);
       }},
      {"kda_chunked_backward", "d_out of another shape",
       [=] {
         ops::kda_chunked_backward(qk, qk, qk, t({3, 2, 4}, DType::f32), beta, cu, 0.5,
                                   t({3, 2, 5}, dtype));
       }},
      {"mhc_pre_backward", "d_post of another shape",
       [=] {
         ops::MhcGrads grads;
         ops::mhc_pre_backward(t({3, 4, 8}, dtype), t({24, 32}, DType::f32), t({24}, DType::f32),
                               t({3}, DType::f32), ops::MhcOptions{}, nullptr, t({3, 3}, dtype),
                               Tensor(), Tensor(), grads);
       }},
      {"mhc_expand", "no streams", [=] { ops::mhc_expand(x, 0); }},
      {"mhc_head", "streams of one dimension", [=] { ops::mhc_head(t({8}, dtype)); }},
      {"mhc_expand_backward", "no gradient", [=] { ops::mhc_expand_backward(Tensor()); }},
      {"mhc_head_backward", "no streams", [=] { ops::mhc_head_backward(x, 0); }},
      {"sparse_attention", "indices of other rows",
       [=] {
         ops::sparse_attention(qk, qk, qk, Tensor::zeros({2, 2}, DType::i32, device), cu, 0.5);
       }},
      {"sparse_attention_backward", "dout of another shape",
       [=] {
         ops::sparse_attention_backward(qk, qk, qk, Tensor::zeros({3, 2}, DType::i32, device), cu,
                                        0.5, t({3, 2, 5}, dtype));
       }},
      {"indexer_forward", "q_resid of other rows",
       [=] {
         ops::indexer_forward(ic, ip, x, t({2, 6}, dtype), cu);
       }},
      {"indexer_forward", "a key projection of another width",
       [=] {
         ops::IndexerParams bad = ip;
         bad.wk = ops::Linear(t({4, 7}, dtype));
         ops::indexer_forward(ic, bad, x, t({3, 6}, dtype), cu);
       }},
      {"moe_route", "a router for other experts",
       [=] {
         ops::moe_route(moe, t({5, 8}, dtype), experts.e_score_correction_bias, x);
       }},
      {"moe_experts", "a down projection of another width",
       [=] {
         ops::moe_experts(moe, experts.gate_up_proj, ops::Linear(t({4, 7, 2}, dtype)), x, routing);
       }},
      {"moe_experts", "a routing of other rows",
       [=] {
         const ops::Routing two_rows{Tensor(), t({2, 2}, DType::f32),
                                     Tensor::zeros({2, 2}, DType::i32, device)};
         ops::moe_experts(moe, experts.gate_up_proj, experts.down_proj, x, two_rows);
       }},
      {"moe_expert_counts", "more rows than the routing",
       [=] { ops::moe_expert_counts(routing, 4, 4); }},
      {"moe_forward", "a correction bias of another size",
       [=] {
         ops::MoeParams bad = experts;
         bad.e_score_correction_bias = t({3}, DType::f32);
         ops::moe_forward(moe, bad, x);
       }},
      {"moe_route_backward", "a weight gradient of another shape",
       [=] {
         ops::moe_route_backward(moe, routing, t({3, 3}, DType::f32));
       }},
      {"moe_backward", "dy of another shape",
       [=] {
         ops::MoeContext ctx;
         ctx.x = x;
         ctx.routing = routing;
         ops::MoeParams grads;
         ops::moe_backward(moe, experts, ctx, t({3, 7}, dtype), grads);
       }},
      {"rope_2d_", "rows of another head dim",
       [=] {
         Tensor rows = t({6, 8}, dtype);
         ops::rope_2d_(rows, tables);
       }},
      {"rope_2d_backward_", "rows that are not a multiple of the positions",
       [=] {
         Tensor rows = t({4, 4}, dtype);
         ops::rope_2d_backward_(rows, tables);
       }},
      {"gelu_erf_backward_", "dy of another shape",
       [=] {
         Tensor dy = t({3, 7}, dtype);
         ops::gelu_erf_backward_(x, dy);
       }},
      {"varlen_attention", "heads that do not divide the width",
       [=] {
         ops::varlen_attention(x, x, x, {0, 3}, 3, 0.5);
       }},
      {"varlen_attention", "segments that do not cover the keys",
       [=] {
         ops::varlen_attention(x, x, x, {0, 2}, 2, 0.5);
       }},
      {"varlen_attention_backward", "dout of another shape",
       [=] {
         ops::varlen_attention_backward(x, x, x, x, t({3, 7}, dtype), {0, 3}, 2, 0.5, 0,
                                        t({3, 2}, DType::f32));
       }},
  };
}

// Each call refused with an InternalError whose message names its op.
inline void expect_refused(const std::vector<BadLeafCall>& calls) {
  for (const BadLeafCall& c : calls) {
    SCOPED_TRACE(c.op + ": " + c.what);
    try {
      c.call();
      ADD_FAILURE() << "accepted";
    } catch (const InternalError& e) {
      EXPECT_NE(std::string(e.what()).find(c.op), std::string::npos) << e.what();
    }
  }
}

}  // namespace glmtune::test
