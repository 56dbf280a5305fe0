#pragma once
// The MoE block on the GPU: the CUDA side of ops/moe.h, with bf16 storage (or f32 storage in the
// fp32 mode: every activation, weight and dy then f32, and the router GEMMs take the logit
// gradient whole instead of as hi + lo) and fp32 arithmetic.
//
//   router   logits = f32(x) · f32(Wr)^T (a bf16 GEMM with fp32 output: the products of bf16
//            values are exact in fp32), p = σ(logits), c = p + bias (selection only), group limit,
//            top-k by c (ties towards the lower expert id, NaN first, as the CPU op), weights
//            w_k = rsf · p_k / (Σ p + 1e-20) (or rsf · p_k), one warp per token.
//   permute  the (row, k) slots sorted by expert with a stable radix sort (rows ascending inside
//            an expert, as the CPU op's buckets), the expert offsets, the inverse permutation and
//            the gather of the input rows. With the backend kWgmmaDeviceOffsets the offsets stay
//            on the device and nothing synchronises; the other backends (and FP8 or adapters on
//            the experts) read them on the host, the one synchronisation of the block.
//   experts  grouped gate_up GEMM → clamped SwiGLU → grouped down GEMM (ops/cuda/grouped_gemm.h;
//            the backend is a parameter, cuBLASLt per expert by default).
//   combine  y[t] = bf16(Σ_k w_k · y_e[t] + shared(x)[t]) in fp32, k in order: deterministic, no
//            atomics. The shared expert runs through the dense GEMMs with an fp32 down output.
//
// Backward (mirrors the CPU op): the expert activations are recomputed from x and the routing;
// dw_k = ⟨dy[t], y_e⟩ and d(y_e) = w_k · dy[t] per permuted row; the grouped dW and dX GEMMs;
// dx is summed back per token in k order. The combine-weight gradient goes through the
// normalisation and the sigmoid to the router logits (the correction bias gets none); the router
// GEMMs then run in (near) fp32 by splitting the fp32 logit gradient into two bf16 parts
// (hi + lo, relative error about 2^-17) and adding both bf16 GEMMs into fp32 results.
//
// Tensors: x [T, D] bf16; router weight bf16 [E, D]; correction bias f32 [E]; gate_up_proj bf16
// [E, 2Im, D]; down_proj bf16 [E, D, Im]; shared expert bf16 as MlpParams. The routed experts'
// per-expert adapters (A [E, r, in], B [E, out, r] in x's dtype, ops/linear.h) run as grouped
// GEMMs on the permuted rows beside each projection; the fused shared expert takes none. Gradients
// mirror the parameters (MoeParams); an undefined entry is created as f32 zeros, a defined one must
// be f32 or bf16 and is accumulated into. Everything runs on `stream`.

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "glmtune/ops/cuda/grouped_gemm.h"
#include "glmtune/ops/moe.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::cuda {

// logits f32 [T, E], weights f32 [T, K], indices int32 [T, K] (per row by descending biased
// score), all on the device.
ops::Routing moe_route(const ops::MoeConfig& cfg, const Tensor& router_weight,
                       const Tensor& e_score_correction_bias, const Tensor& x,
                       cudaStream_t stream = nullptr);

// The routing's slots grouped by expert.
struct ExpertPermutation {
  Tensor sorted_slots;    // int32 [T·K]: slot ids row·K + k, by expert, rows ascending
  Tensor slot_position;   // int32 [T·K]: the position of each slot in sorted_slots
  Tensor device_offsets;  // int32 [E + 1]: expert e owns positions offsets[e] .. [e+1] − 1

  // The offsets on the host: copied on the first call (which synchronises the permutation's
  // stream) and checked there. Throws when an index lay outside [0, E).
  const std::vector<int64_t>& offsets() const;

  struct HostOffsets;
  std::shared_ptr<HostOffsets> host;
};

// With `read_offsets` the offsets are read (and the indices checked) now, synchronising `stream`
// once; without, only when offsets() is first called: the device-offset GEMMs never call it, so
// a block that runs on them does not synchronise (its indices come from moe_route, always in
// range).
ExpertPermutation moe_permute(const Tensor& indices, int64_t n_experts,
                              cudaStream_t stream = nullptr, bool read_offsets = true);

// Routed experts only: Σ_k w_k · expert_{idx_k}(x) per row, bf16 [T, D].
Tensor moe_experts(const ops::MoeConfig& cfg, const ops::Linear& gate_up_proj,
                   const ops::Linear& down_proj, const Tensor& x, const ops::Routing& routing,
                   GroupedGemmBackend backend = GroupedGemmBackend::kLtPerGroup,
                   cudaStream_t stream = nullptr);

// Selections per expert over rows [0, rows) (rows < 0: all), int64 [E] on the device.
Tensor moe_expert_counts(const ops::Routing& routing, int64_t n_experts, int64_t rows = -1,
                         cudaStream_t stream = nullptr);

// The balancing loss of one router (model/balancing_loss.h) over rows [0, counted_rows): logits f32
// [T, E], bias f32 [E], loads int64 [E] the selection counts the loss weighs by, weight = α / the
// step's micro-packs. Adds the loss to loss_sum (f64 [1]) and returns d loss / d logits f32 [T, E]
// (zero on the rows from counted_rows on). Everything on one device, in f64 inside, with no host
// synchronisation.
Tensor moe_balancing_loss(const Tensor& logits, const Tensor& bias, const Tensor& loads,
                          int64_t counted_rows, int64_t top_k, double weight, Tensor& loss_sum,
                          cudaStream_t stream = nullptr);

// The routed experts' activations over the permuted rows: x_perm, h = x_perm · gate_upᵀ, act =
// swiglu(h), yp = act · downᵀ, and the adapters' u = scale · in Aᵀ (ops/linear.h).
struct ExpertActivations {
  Tensor x_perm, h, act, yp;
  Tensor u_gate_up, u_down;
};

struct MoeContext {
  Tensor x;
  ops::Routing routing;
  ExpertPermutation permutation;
  Tensor shared_gate_up;  // bf16 [T, 2·Is]: the shared expert's gate | up before the clamps
  // Kept by moe_forward with keep_activations (for a backward that follows at once): x_perm and h,
  // and act, yp, u_down only for an adapted or FP8 down projection (the backward that reads them);
  // undefined otherwise, and moe_backward runs the gate/up projection again. h (and u_gate_up)
  // alone: moe_backward gathers x_perm again (and recomputes act and yp for an adapted or FP8
  // down projection).
  ExpertActivations activations;
};

ops::MoeOutput moe_forward(const ops::MoeConfig& cfg, const ops::MoeParams& params, const Tensor& x,
                           int64_t counted_rows = -1, MoeContext* ctx = nullptr,
                           GroupedGemmBackend backend = GroupedGemmBackend::kLtPerGroup,
                           cudaStream_t stream = nullptr, bool keep_activations = false);

// d_weights f32 [T, K] -> d_logits f32 [T, E] (zero where a row did not select the expert).
Tensor moe_route_backward(const ops::MoeConfig& cfg, const ops::Routing& routing,
                          const Tensor& d_weights, cudaStream_t stream = nullptr);

// dy bf16 [T, D] -> dx bf16 [T, D]; parameter gradients accumulate into `grads`
// (grads.e_score_correction_bias is never touched). `d_router_logits` (optional, f32 [T, E])
// joins the combine weights' gradient before the router GEMMs.
Tensor moe_backward(const ops::MoeConfig& cfg, const ops::MoeParams& params, const MoeContext& ctx,
                    const Tensor& dy, ops::MoeParams& grads,
                    const Tensor& d_router_logits = Tensor(),
                    GroupedGemmBackend backend = GroupedGemmBackend::kLtPerGroup,
                    cudaStream_t stream = nullptr);

// ---- The pieces expert parallelism runs on either side of its token exchange
// (dist/expert_parallel.h)

struct ExpertsBackward {
  Tensor dx;         // [T, D] x's dtype: Σ_k w_k · (∂expert_{idx_k} / ∂x)ᵀ dy, k in order
  Tensor d_weights;  // f32 [T, K]: ⟨dy[t], expert_{idx_k}(x[t])⟩
};

// The backward of moe_experts alone (no router, no shared expert): the activations recomputed,
// the expert weight gradients accumulated into grads.gate_up_proj / grads.down_proj (created as f32
// zeros when undefined; the other entries are not touched).
ExpertsBackward moe_experts_backward(const ops::MoeConfig& cfg, const ops::Linear& gate_up_proj,
                                     const ops::Linear& down_proj, const Tensor& x,
                                     const ops::Routing& routing, const Tensor& dy,
                                     ops::MoeParams& grads,
                                     GroupedGemmBackend backend = GroupedGemmBackend::kLtPerGroup,
                                     cudaStream_t stream = nullptr);

// moe_backward when the routed experts were differentiated elsewhere: `routed_dx` (f32 [T, D]) and
// `routed_d_weights` (f32 [T, K]) are their input and combine-weight gradients; the router and
// the shared expert (its gate | up recomputed from x) are differentiated here, their gradients
// accumulate into `grads` (the expert entries are not touched). Returns dx in x's dtype, rounded
// once from the fp32 sum.
Tensor moe_backward_routed_elsewhere(const ops::MoeConfig& cfg, const ops::MoeParams& params,
                                     const Tensor& x, const ops::Routing& routing, const Tensor& dy,
                                     const Tensor& routed_dx, const Tensor& routed_d_weights,
                                     ops::MoeParams& grads,
                                     const Tensor& d_router_logits = Tensor(),
                                     cudaStream_t stream = nullptr);

// out[r] = src[index[r] / k]: [m, c] from src [n, c] (bf16 or f32) and int32 index [m].
Tensor moe_gather_rows(const Tensor& src, const Tensor& index, int64_t k,
                       cudaStream_t stream = nullptr);

// y[t] = Σ_k w[t, k] · yp[pos(t, k)] in fp32, rounded once: [T, D] in yp's dtype, from the expert
// outputs yp [T·K, D] in the order of `perm` (moe_permute of the same routing).
Tensor moe_combine(const Tensor& yp, const Tensor& weights, const ExpertPermutation& perm,
                   cudaStream_t stream = nullptr);

// dx[t] = Σ_k dxp[pos(t, k)] in fp32: f32 [T, D] from rows dxp [T·K, D] in the order of `perm`.
Tensor moe_sum_slots(const Tensor& dxp, const ExpertPermutation& perm, int64_t k,
                     cudaStream_t stream = nullptr);

}  // namespace glmtune::cuda
