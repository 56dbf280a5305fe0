#pragma once
// The CUDA paths of the ops in ops/*.h (see ops/dispatch.h): the same signatures and semantics as
// the ops of the same names, for tensors on a CUDA device, with the GPU storage policy:
//
//   - activations and weights bf16; the fp32-kept parameters (model::is_fp32_kept) stay f32;
//   - per-row statistics (rstd) f32;
//   - parameter gradients accumulate into f32 buffers (an undefined one is created as f32 zeros on
//     the device; a defined bf16 one is accepted where the kernel supports it);
//   - everything runs on the current device's legacy default stream, so ops issued one after the
//     other need no synchronisation; results are bit-identical across reruns.
//
// Each function checks what it needs and throws glmtune::Error (via the kernels) for tensors the
// GPU path cannot take, naming the op and the tensor.

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "glmtune/ops/cross_entropy.h"
#include "glmtune/ops/embedding.h"
#include "glmtune/ops/indexer.h"
#include "glmtune/ops/kda.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/mhc.h"
#include "glmtune/ops/mla.h"
#include "glmtune/ops/mlp.h"
#include "glmtune/ops/moe.h"
#include "glmtune/ops/norm.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::ops::cuda_path {

// Per-op GPU time, for the step benchmark's breakdown. While enabled, every outermost call of a
// function below records a pair of CUDA events on the default stream (ops called from inside
// another op count towards the outer one); take_op_times waits for the device and returns the
// milliseconds per op name since the last call. Off by default: it costs two event records per op.
void enable_op_timing(bool on);
std::map<std::string, double> take_op_times();

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias);
void linear_out(Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias,
                bool accumulate);
Tensor linear_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, Tensor* grad_weight,
                       Tensor* grad_bias, bool need_input_grad);

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps, Tensor* rstd);
Tensor rms_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, double eps,
                         const Tensor& rstd, Tensor* grad_weight);

Tensor swiglu_clamped(const Tensor& gate, const Tensor& up, double limit);
void swiglu_clamped_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, double limit,
                             Tensor& dgate, Tensor& dup);
Tensor mlp_forward(const MlpParams& params, const Tensor& x, double swiglu_limit, MlpContext* ctx);
Tensor mlp_backward(const MlpParams& params, const MlpContext& ctx, const Tensor& dy,
                    double swiglu_limit, MlpParams& grads);

Tensor embedding_forward(const Tensor& table, const Tensor& ids);
void embedding_backward(const Tensor& table, const Tensor& ids, const Tensor& dout,
                        std::optional<int64_t> padding_idx, Tensor& dtable);

CrossEntropyResult lm_head_cross_entropy(const Tensor& hidden, const Tensor& weight,
                                         const Tensor& labels, const CrossEntropyOptions& opts,
                                         Tensor* dhidden, Tensor* dweight);

MhcPreResult mhc_pre(const Tensor& streams, const Tensor& fn, const Tensor& base,
                     const Tensor& scale, const MhcOptions& options, MhcPreSaved* saved);
Tensor mhc_pre_backward(const Tensor& streams, const Tensor& fn, const Tensor& base,
                        const Tensor& scale, const MhcOptions& options, const MhcPreSaved* saved,
                        const Tensor& d_post, const Tensor& d_comb, const Tensor& d_collapsed,
                        MhcGrads& grads);
Tensor mhc_post(const Tensor& streams, const Tensor& y, const Tensor& post, const Tensor& comb);
MhcPostGrads mhc_post_backward(const Tensor& streams, const Tensor& y, const Tensor& post,
                               const Tensor& comb, const Tensor& d_out);
Tensor mhc_expand(const Tensor& x, int64_t hc_mult);
Tensor mhc_head(const Tensor& streams);
Tensor mhc_expand_backward(const Tensor& d_streams);
Tensor mhc_head_backward(const Tensor& d_out, int64_t hc_mult);

// The whole KDA mixer, composed from cuBLASLt projections and the KDA kernels. On the GPU the
// saved o_rstd stays undefined (the gated norm's backward recomputes it) and g, beta, q_norm,
// k_norm are f32.
Tensor kda_forward(const KdaParams& params, const Tensor& x, const Tensor& cu_seqlens,
                   const KdaOptions& options, KdaSaved* saved);
Tensor kda_backward(const KdaParams& params, const Tensor& x, const Tensor& cu_seqlens,
                    const KdaOptions& options, const KdaSaved* saved, const Tensor& dy,
                    KdaGrads& grads);

Tensor indexer_forward(const IndexerConfig& cfg, const IndexerParams& params, const Tensor& x,
                       const Tensor& q_resid, const Tensor& cu_seqlens);

// Sparse attention and the MLA block. The backward recomputes the attention's log-sum-exp (one
// forward pass over the selected keys) instead of keeping it in the context.
MlaProjections mla_project(const MlaConfig& cfg, const MlaParams& params, const Tensor& x);
Tensor sparse_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& indices,
                        const Tensor& cu_seqlens, double scale);
AttentionGrads sparse_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const Tensor& indices, const Tensor& cu_seqlens,
                                         double scale, const Tensor& dout);
MlaOutput mla_forward(const MlaConfig& cfg, const MlaParams& params, const Tensor& x,
                      const Tensor& indices, const Tensor& cu_seqlens, MlaContext* ctx);
Tensor mla_backward(const MlaConfig& cfg, const MlaParams& params, const MlaContext& ctx,
                    const Tensor& dy, MlaParams& grads);

// The MoE block. Routing tensors stay on the device (logits and weights f32, indices int32);
// expert counts are returned on the host, where the load-balancing update reads them.
Routing moe_route(const MoeConfig& cfg, const Tensor& router_weight,
                  const Tensor& e_score_correction_bias, const Tensor& x);
Tensor moe_experts(const MoeConfig& cfg, const Tensor& gate_up_proj, const Tensor& down_proj,
                   const Tensor& x, const Routing& routing);
Tensor moe_expert_counts(const Routing& routing, int64_t n_experts, int64_t rows);
MoeOutput moe_forward(const MoeConfig& cfg, const MoeParams& params, const Tensor& x,
                      int64_t counted_rows, MoeContext* ctx);
Tensor moe_route_backward(const MoeConfig& cfg, const Routing& routing, const Tensor& d_weights);
Tensor moe_backward(const MoeConfig& cfg, const MoeParams& params, const MoeContext& ctx,
                    const Tensor& dy, MoeParams& grads, const Tensor& d_router_logits);
Tensor moe_backward_routed_elsewhere(const MoeConfig& cfg, const MoeParams& params, const Tensor& x,
                                     const Routing& routing, const Tensor& dy,
                                     const Tensor& routed_dx, const Tensor& routed_d_weights,
                                     MoeParams& grads, const Tensor& d_router_logits);

}  // namespace glmtune::ops::cuda_path
