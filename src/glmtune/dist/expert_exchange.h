#pragma once
// The token exchange of expert parallelism (expert_parallel.h), shared by its CPU path
// (expert_parallel.cpp) and its GPU path (expert_parallel_cuda.cpp).
#include <cstdint>
#include <span>
#include <vector>

#include "glmtune/dist/comm.h"
#include "glmtune/model/text/layer.h"

namespace glmtune::dist::detail {

// Who sends how many (token, expert) pairs to whom for one routing.
struct PairCounts {
  std::vector<int64_t> send_pairs;  // [ep] pairs to each rank
  std::vector<int64_t> recv_pairs;  // [ep] pairs from each rank
  // [ep · per_rank]: pairs from rank q for local expert j at q · per_rank + j. The receive buffer
  // holds them in this order: sender by sender, each sender's pairs by expert.
  std::vector<int64_t> recv_per_expert;
};

// Collective over `ep`: `send_per_expert` [n_experts] are this rank's pairs per expert, experts
// [q · per_rank, (q + 1) · per_rank) being rank q's.
PairCounts exchange_counts(Communicator& ep, std::span<const int64_t> send_per_expert,
                           int64_t per_rank);

// Collective over `group`: variable-count exchange of rows of `width` elements, `send_pairs[q]`
// rows to rank q and `recv_pairs[q]` from it; the result lives where `rows` does.
Tensor exchange_rows(Communicator& group, const Tensor& rows, int64_t width,
                     const std::vector<int64_t>& send_pairs,
                     const std::vector<int64_t>& recv_pairs);

#ifdef GLMTUNE_WITH_CUDA
// The GPU path: `host` carries the counts, `device` the rows (expert_parallel.h).
Tensor forward_on_device(Communicator& host, Communicator& device, int64_t n_experts,
                         int64_t per_rank, const ops::MoeConfig& cfg, const ops::MoeParams& params,
                         const Tensor& x, const ops::Routing& routing);
model::text::ExpertDispatch::Backward backward_on_device(
    Communicator& host, Communicator& device, int64_t n_experts, int64_t per_rank,
    const ops::MoeConfig& cfg, const ops::MoeParams& params, const Tensor& x,
    const ops::Routing& routing, const Tensor& dy, ops::MoeParams& grads);
#endif

}  // namespace glmtune::dist::detail
