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
#include "glmtune/ops/embedding.h"
#include "glmtune/ops/kda.h"
#include "glmtune/ops/mhc.h"
#include "glmtune/ops/mlp.h"
#include "glmtune/ops/norm.h"
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
