#pragma once
// Expert parallelism over the ep group (docs/distributed.md, "Expert parallel").
//
// The E routed experts of every MoE layer are split into ep contiguous slices: rank r of the ep
// group holds and computes experts [r·E/ep, (r+1)·E/ep). The layer's expert tensors are that
// slice only, [E/ep, ...] with local expert j = global expert first_expert() + j
// (expert_shards.h keeps them so in the parameter store). Each rank routes its own tokens (the
// router, the shared expert and everything else are replicated and data parallel as without ep);
// the (token, expert) pairs then travel to the rank owning the expert and the expert outputs come
// back, with two variable-count all-to-alls in the forward and two in the backward:
//
//   forward   send x[row] per pair, grouped by owner rank then expert (ascending) then row;
//             the owner stacks each local expert's rows from every source, runs the expert
//             (gate_up, clamped SwiGLU, down: the CPU expert code's ops) and returns the rows;
//             the sender adds w · y in ascending expert order, as ops::moe_experts does.
//   backward  send [x[row] | dy[row] | w] per pair; the owner recomputes the expert, adds its
//             weight gradients (and its adapters', lora.target_parameters) into its
//             (slice-sized) gradient buffers, and returns
//             [dx_pair | ⟨dy[row], y_pair⟩] (the latter is the combine weight's gradient).
//
// The expert loads and the balancing loss come from each rank's own routing, exactly as in data
// parallelism; an expert's weight gradient is complete once summed over the ranks holding its
// slice (the edp group: ExpertAdamW of expert_shards.h reduces over it).
//
// On the GPU (inputs on a CUDA device; expert_parallel_cuda.cpp) the same exchange runs on device
// buffers through `device_group` (NCCL over the ep ranks); only the pair counts travel through the
// host group. The sender orders its pairs with the MoE block's permutation (ops/cuda/moe.h: by
// expert, rows ascending), the owner runs its experts as one grouped GEMM over every sender's rows
// (cuda::moe_experts with the local expert of each row as a top-1 routing) and the sender combines
// the returned rows as the one-GPU block does, in fp32 with the combine weights, k in order. In
// the backward the owner gets [x | dy | w] per pair (three exchanges) and returns the pair's dx
// (w included) and ⟨dy, y⟩ (two); the sender sums each token's rows in fp32 and hands dx to
// ops::moe_backward_routed_elsewhere in f32, so it is rounded once. The GPU exchange applies no
// adapter: LoRA on several GPUs is refused at setup (train/trainer_setup.cpp), and the GPU path
// asserts that the experts it runs carry none.
#include <cstdint>

#include "glmtune/dist/comm.h"
#include "glmtune/model/text/layer.h"

namespace glmtune::dist {

class ExpertParallel final : public model::text::ExpertDispatch {
 public:
  // `n_experts` split over the ranks of `ep`; glmtune::Error naming `where` unless ep.size()
  // divides it. `device_group`: the same ranks in the same order for GPU tensors (NCCL), needed
  // when the MoE inputs live on a GPU.
  ExpertParallel(Communicator& ep, int64_t n_experts, const std::string& where,
                 Communicator* device_group = nullptr);

  Communicator& group() const { return ep_; }
  int64_t experts() const { return n_experts_; }
  int64_t first_expert() const { return first_; }
  int64_t local_experts() const { return per_rank_; }

  Tensor forward(const ops::MoeConfig& cfg, const ops::MoeParams& params, const Tensor& x,
                 const ops::Routing& routing) const override;
  Backward backward(const ops::MoeConfig& cfg, const ops::MoeParams& params, const Tensor& x,
                    const ops::Routing& routing, const Tensor& dy,
                    ops::MoeParams& grads) const override;

 private:
  Communicator& device_group(const Tensor& x) const;

  Communicator& ep_;
  Communicator* device_group_ = nullptr;
  int64_t n_experts_ = 0, per_rank_ = 0, first_ = 0;
};

}  // namespace glmtune::dist
