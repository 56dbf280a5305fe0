// Expert parallelism on the GPU (expert_parallel.h): the token exchange on device buffers.
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/dist/expert_exchange.h"
#include "glmtune/ops/cuda/moe.h"

namespace glmtune::dist::detail {
namespace {

// The pairs this rank sends, from the MoE block's permutation (by expert, rows ascending), and
// how many travel each way.
struct DevicePlan {
  cuda::ExpertPermutation perm;
  PairCounts counts;
};

DevicePlan make_device_plan(Communicator& host, const ops::Routing& routing, int64_t n_experts,
                            int64_t per_rank) {
  DevicePlan p;
  p.perm = cuda::moe_permute(routing.indices, n_experts);
  std::vector<int64_t> per_expert(static_cast<size_t>(n_experts));
  const std::vector<int64_t>& offsets = p.perm.offsets();
  for (int64_t e = 0; e < n_experts; ++e)
    per_expert[size_t(e)] = offsets[size_t(e) + 1] - offsets[size_t(e)];
  p.counts = exchange_counts(host, per_expert, per_rank);
  return p;
}

// The experts run by this rank as a top-1 routing over its local experts.
ops::MoeConfig local_config(const ops::MoeConfig& cfg, int64_t per_rank) {
  ops::MoeConfig c = cfg;
  c.n_experts = per_rank;
  c.top_k = 1;
  c.n_group = 1;
  c.topk_group = 1;
  return c;
}

// The local expert of every received row ([N, 1] int32 on `device`): the receive buffer holds
// each sender's pairs by expert.
Tensor received_experts(const PairCounts& counts, int64_t per_rank, Device device) {
  std::vector<int32_t> ids;
  for (size_t i = 0; i < counts.recv_per_expert.size(); ++i)
    ids.insert(ids.end(), size_t(counts.recv_per_expert[i]), int32_t(int64_t(i) % per_rank));
  return Tensor::from_vector(ids, {int64_t(ids.size()), 1}).to(device);
}

// The local experts' weights with their FP8 mark (train.fp8). The GPU exchange applies no adapter
// (the CPU exchange does): trainer_setup refuses LoRA on several GPUs.
ops::Linear bare(const ops::Linear& fused) {
  GLMTUNE_ASSERT(!fused.lora.defined(),
                 "expert parallelism on the GPU got routed experts with adapters, which its "
                 "exchange does not apply");
  ops::Linear l(fused.weight);
  l.fp8 = fused.fp8;
  return l;
}

void check_device_inputs(const ops::MoeParams& params, const Tensor& x, const ops::Routing& routing,
                         int64_t per_rank) {
  GLMTUNE_ASSERT(x.dim() == 2 && x.is_contiguous() && routing.indices.defined() &&
                     routing.indices.device() == x.device() &&
                     routing.weights.device() == x.device() && routing.weights.is_contiguous(),
                 "expert parallelism on the GPU: input {} and its routing must be contiguous on "
                 "one device",
                 x.str());
  GLMTUNE_ASSERT(
      params.gate_up_proj.weight.defined() && params.gate_up_proj.weight.size(0) == per_rank &&
          params.down_proj.weight.defined() && params.down_proj.weight.size(0) == per_rank,
      "experts gate_up_proj / down_proj must hold this rank's {} experts "
      "(expert_shards.h)",
      per_rank);
}

}  // namespace

Tensor forward_on_device(Communicator& host, Communicator& device, int64_t n_experts,
                         int64_t per_rank, const ops::MoeConfig& cfg, const ops::MoeParams& params,
                         const Tensor& x, const ops::Routing& routing) {
  check_device_inputs(params, x, routing, per_rank);
  const int64_t dim = x.size(1), k = routing.indices.size(1);
  const DevicePlan plan = make_device_plan(host, routing, n_experts, per_rank);
  const PairCounts& c = plan.counts;
  const Tensor send = cuda::moe_gather_rows(x, plan.perm.sorted_slots, k);
  const Tensor recv = exchange_rows(device, send, dim, c.send_pairs, c.recv_pairs);
  // The owner returns each pair's expert output unweighted: the sender combines in fp32.
  ops::Routing local;
  local.indices = received_experts(c, per_rank, x.device());
  local.weights = Tensor::full({recv.size(0), 1}, 1.0, DType::f32, x.device());
  const Tensor y = cuda::moe_experts(local_config(cfg, per_rank), bare(params.gate_up_proj),
                                     bare(params.down_proj), recv, local);
  const Tensor back = exchange_rows(device, y, dim, c.recv_pairs, c.send_pairs);
  return cuda::moe_combine(back, routing.weights, plan.perm);
}

model::text::ExpertDispatch::Backward backward_on_device(
    Communicator& host, Communicator& device, int64_t n_experts, int64_t per_rank,
    const ops::MoeConfig& cfg, const ops::MoeParams& params, const Tensor& x,
    const ops::Routing& routing, const Tensor& dy, ops::MoeParams& grads) {
  check_device_inputs(params, x, routing, per_rank);
  GLMTUNE_ASSERT(dy.defined() && dy.shape() == x.shape() && dy.dtype() == x.dtype() &&
                     dy.device() == x.device() && dy.is_contiguous(),
                 "expert-parallel backward: dy {} must match the input {}",
                 dy.defined() ? dy.str() : std::string("undefined"), x.str());
  const int64_t rows = x.size(0), dim = x.size(1), k = routing.indices.size(1);
  const DevicePlan plan = make_device_plan(host, routing, n_experts, per_rank);
  const PairCounts& c = plan.counts;
  const Tensor& slots = plan.perm.sorted_slots;
  const Tensor x_recv =
      exchange_rows(device, cuda::moe_gather_rows(x, slots, k), dim, c.send_pairs, c.recv_pairs);
  const Tensor dy_recv =
      exchange_rows(device, cuda::moe_gather_rows(dy, slots, k), dim, c.send_pairs, c.recv_pairs);
  const Tensor w_send = cuda::moe_gather_rows(routing.weights.view({rows * k, 1}), slots, 1);
  ops::Routing local;
  local.indices = received_experts(c, per_rank, x.device());
  local.weights = exchange_rows(device, w_send, 1, c.send_pairs, c.recv_pairs);
  // The pair's dx carries its combine weight; d_weights is ⟨dy, y⟩.
  cuda::ExpertsBackward owner =
      cuda::moe_experts_backward(local_config(cfg, per_rank), bare(params.gate_up_proj),
                                 bare(params.down_proj), x_recv, local, dy_recv, grads);
  const Tensor dx_back = exchange_rows(device, owner.dx, dim, c.recv_pairs, c.send_pairs);
  const Tensor dw_back = exchange_rows(device, owner.d_weights, 1, c.recv_pairs, c.send_pairs);
  model::text::ExpertDispatch::Backward out;
  out.dx = cuda::moe_sum_slots(dx_back, plan.perm, k);
  out.d_weights = cuda::moe_gather_rows(dw_back, plan.perm.slot_position, 1).view({rows, k});
  return out;
}

}  // namespace glmtune::dist::detail
