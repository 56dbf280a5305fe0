#pragma once
// The CUDA bodies of the leaf ops in ops/*.h (see ops/dispatch.h): the same signatures and
// semantics as the ops of the same names, for tensors on a CUDA device, with the GPU storage
// policy:
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

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "glmtune/ops/cross_entropy.h"
#include "glmtune/ops/cuda/mla.h"
#include "glmtune/ops/embedding.h"
#include "glmtune/ops/fp8.h"
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

namespace glmtune::ops::cuda_path {

// Per-op GPU time, for the step benchmark's breakdown. While enabled, every outermost op on the
// device (a leaf op below, or a composite through GLMTUNE_TIME_OP) records a pair of CUDA events
// on the default stream (ops called from inside another op count towards the outer one);
// take_op_times waits for the device and returns the milliseconds and calls per op name since
// the last call. With `nested`, every op is timed, inner ones too, and take_op_times returns each
// op's exclusive time (its own less that of the ops it called: for a composite, the work it does
// outside timed ops) under its path, "outer > inner". Off by default: it costs two event
// records per op. With `sync`, the host waits for the device before each timed op starts, so an
// op's time is its own GPU work (and its first launch's latency), with no wait for the host in it:
// against a run without, it shows where the GPU idles while the host catches up.
void enable_op_timing(bool on, bool nested = false, bool sync = false);
struct OpTime {
  double ms = 0;
  int64_t calls = 0;
};
std::map<std::string, OpTime> take_op_times();

// Times its scope under `name` (when on_device and timing is on, and it is the outermost op or
// nested timing is on).
class OpTimer {
 public:
  explicit OpTimer(const char* name, bool on_device = true);
  ~OpTimer();
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

 private:
  bool counted_ = false;
  int64_t index_ = -1;  // into the timed ops of this period, when this op is timed
};

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias);
void linear_out(Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias,
                bool accumulate);
Tensor linear_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, Tensor* grad_weight,
                       Tensor* grad_bias, bool need_input_grad);
void linear_backward_add(Tensor& dx_sum, const Tensor& dy, const Tensor& x, const Tensor& weight,
                         Tensor* grad_weight, Tensor* grad_bias);

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps, Tensor* rstd);
Tensor rms_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, double eps,
                         const Tensor& rstd, Tensor* grad_weight);

// The gated norm keeps no statistic (*rstd stays undefined: the backward recomputes it); the
// sigmoid gate only.
Tensor rms_norm_gated(const Tensor& x, const Tensor& weight, const Tensor& gate, double eps,
                      GateActivation activation, Tensor* rstd);
RmsNormGatedGrads rms_norm_gated_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                          const Tensor& gate, double eps, GateActivation activation,
                                          const Tensor& rstd, Tensor* grad_weight);
// LayerNorm in fp32 on bf16 / f32 storage (weight and bias in any float dtype: used in x's).
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                  Tensor* mean, Tensor* rstd);
Tensor layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, double eps,
                           const Tensor& mean, const Tensor& rstd, Tensor* grad_weight,
                           Tensor* grad_bias);
Tensor l2_norm(const Tensor& x, double eps, Tensor* norm);
Tensor l2_norm_backward(const Tensor& dy, const Tensor& x, double eps, const Tensor& norm);

Tensor swiglu_clamped(const Tensor& gate, const Tensor& up, double limit);
void swiglu_clamped_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, double limit,
                             Tensor& dgate, Tensor& dup);
void add_into(Tensor& a, const Tensor& b);
void scale_into(Tensor& a, double s);
void dropout_into(Tensor& a, double p, uint64_t key);
Tensor gather_rows(const Tensor& x, const std::vector<int64_t>& rows);
void scatter_rows_(Tensor& dst, const std::vector<int64_t>& rows, const Tensor& src);

// Block-scaled FP8 quantisation (ops/fp8.h) in the GEMM layout of ops/cuda/fp8.h.
Fp8Blocks quantize_fp8_blocks(const Tensor& x, int64_t block_rows, int64_t block_cols);
Tensor dequantize_fp8_pieces(const Tensor& codes, const Tensor& scales, int64_t piece_rows,
                             const Shape& shape, DType out);
Fp8Blocks fp8_weight_from_codes(const Tensor& codes, const Tensor& scales);
Tensor linear_fp8(const Tensor& x, const Tensor& weight);
Tensor linear_fp8_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                           Tensor* grad_weight);
void linear_fp8_backward_add(Tensor* dx_sum, const Tensor& dy, const Tensor& x,
                             const Tensor& weight, Tensor* grad_weight);

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
                        MhcGrads& grads, const Tensor& residual);
Tensor mhc_post(const Tensor& streams, const Tensor& y, const Tensor& post, const Tensor& comb);
MhcPostGrads mhc_post_backward(const Tensor& streams, const Tensor& y, const Tensor& post,
                               const Tensor& comb, const Tensor& d_out);
Tensor mhc_expand(const Tensor& x, int64_t hc_mult);
Tensor mhc_head(const Tensor& streams);
Tensor mhc_expand_backward(const Tensor& d_streams);
Tensor mhc_head_backward(const Tensor& d_out, int64_t hc_mult);

// The KDA leaves. The conv keeps no pre-activation; the chunked core runs chunks of 64 and
// returns no final state; g, β and the q/k norms are f32.
Tensor causal_conv1d(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens, bool silu,
                     Tensor* pre_activation);
Tensor causal_conv1d_backward(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                              bool silu, const Tensor& dy, Tensor* grad_weight,
                              const Tensor& pre_activation);
Tensor kda_qk_conv(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                   int64_t head_dim, double eps, Tensor* norm);
Tensor kda_qk_conv_backward(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                            int64_t head_dim, double eps, const Tensor& norm, const Tensor& dy,
                            Tensor* grad_weight);
Tensor kda_gate(const Tensor& graw, const Tensor& dt_bias, const Tensor& A_log,
                std::optional<double> lower_bound);
Tensor kda_gate_backward(const Tensor& graw, const Tensor& dt_bias, const Tensor& A_log,
                         std::optional<double> lower_bound, const Tensor& dg, Tensor* grad_dt_bias,
                         Tensor* grad_A_log);
Tensor kda_beta(const Tensor& logits);
Tensor kda_beta_backward(const Tensor& beta, const Tensor& d_beta);
Tensor kda_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                   const Tensor& beta, const Tensor& cu_seqlens, double scale, int64_t chunk_size,
                   Tensor* final_state);
KdaCoreGrads kda_chunked_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& g, const Tensor& beta, const Tensor& cu_seqlens,
                                  double scale, const Tensor& d_out, int64_t chunk_size);

Tensor indexer_forward(const IndexerConfig& cfg, const IndexerParams& params, const Tensor& x,
                       const Tensor& q_resid, const Tensor& cu_seqlens);

// Sparse attention over per-head keys. The backward recomputes the attention's log-sum-exp (one
// forward pass over the selected keys) instead of keeping it.
Tensor sparse_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& indices,
                        const Tensor& cu_seqlens, double scale);
AttentionGrads sparse_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const Tensor& indices, const Tensor& cu_seqlens,
                                         double scale, const Tensor& dout);

// mla_attention's absorbed-latent form (ops/mla.h), which it chooses where
// absorbed_attention_fits: bf16, Rkv = 512, at most 64 heads.
bool absorbed_attention_fits(const MlaConfig& cfg, DType dtype);
// The absorbed kernels the model runs on `device` in each direction: Hopper's wgmma ones where
// this build and the device have them, unless GLMTUNE_MLA_KERNEL (mma_sync, or wgmma_forward for
// the backward alone) keeps a direction on mma.sync.
cuda::AbsorbedKernel absorbed_kernel(int device, bool backward);
Tensor mla_attention_absorbed(const MlaConfig& cfg, const Tensor& kv_b_proj, const Tensor& indices,
                              const Tensor& cu_seqlens, MlaContext& ctx);
MlaAttentionGrads mla_attention_absorbed_backward(const MlaConfig& cfg, const Tensor& kv_b_proj,
                                                  const MlaContext& ctx, const Tensor& d_attn,
                                                  Tensor* grad_kv_b_proj);

// The MoE block. Routing tensors stay on the device (logits and weights f32, indices int32);
// expert counts are returned on the host, where the load-balancing update reads them.
Routing moe_route(const MoeConfig& cfg, const Tensor& router_weight,
                  const Tensor& e_score_correction_bias, const Tensor& x);
Tensor moe_experts(const MoeConfig& cfg, const Linear& gate_up_proj, const Linear& down_proj,
                   const Tensor& x, const Routing& routing);
Tensor moe_expert_counts(const Routing& routing, int64_t n_experts, int64_t rows);
Tensor moe_balancing_loss(const Tensor& logits, const Tensor& bias, const Tensor& loads,
                          int64_t counted_rows, int64_t top_k, double weight, Tensor& loss_sum);
MoeOutput moe_forward(const MoeConfig& cfg, const MoeParams& params, const Tensor& x,
                      int64_t counted_rows, MoeContext* ctx, bool keep_routed = false);
Tensor moe_route_backward(const MoeConfig& cfg, const Routing& routing, const Tensor& d_weights);
Tensor moe_backward(const MoeConfig& cfg, const MoeParams& params, const MoeContext& ctx,
                    const Tensor& dy, MoeParams& grads, const Tensor& d_router_logits);
Tensor moe_backward_routed_elsewhere(const MoeConfig& cfg, const MoeParams& params, const Tensor& x,
                                     const Routing& routing, const Tensor& dy,
                                     const Tensor& routed_dx, const Tensor& routed_d_weights,
                                     MoeParams& grads, const Tensor& d_router_logits);

// The vision tower's ops (ops/vision.h): bf16 activations, f32 rotary tables and log-sum-exp.
// rope_2d_, and with `transpose` rope_2d_backward_ (on the gradient): one kernel does both.
void rope_2d_(Tensor& x, const RopeTables& tables, bool transpose);
void gelu_erf_(Tensor& x);
void gelu_erf_backward_(const Tensor& x, Tensor& dy);
Tensor varlen_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                        const std::vector<int64_t>& cu_seqlens, int64_t heads, double scale,
                        int64_t q_begin, Tensor* lse);
// `lse` by value: a missing one is recomputed into it (one forward pass).
VarlenAttentionGrads varlen_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                               const Tensor& out, const Tensor& dout,
                                               const std::vector<int64_t>& cu_seqlens,
                                               int64_t heads, double scale, int64_t q_begin,
                                               Tensor lse);

}  // namespace glmtune::ops::cuda_path
