#pragma once
// Private helpers shared by the MoE forward (moe.cpp) and backward (moe_backward.cpp) kernels.

#include <cstdint>
#include <numeric>
#include <vector>

#include "glmtune/ops/cpu/common.h"
#include "glmtune/ops/moe.h"

namespace glmtune::ops::cpu_detail {

// The routing's (row, k) slots grouped by expert, rows ascending within an expert (a counting
// sort): expert e's slots are slot[start[e]] .. slot[start[e + 1] − 1], each the flat index
// row·K + k. The backward regroups exactly as the forward did, so each expert sees its rows in
// the same order and its GEMMs sum in the same order.
struct ExpertBuckets {
  std::vector<int64_t> start;  // [n_experts + 1]
  std::vector<int64_t> slot;   // [n_slots]
};

inline ExpertBuckets bucket_by_expert(const int32_t* idx, int64_t n_slots, int64_t n_experts) {
  ExpertBuckets b;
  b.start.assign(size_t(n_experts) + 1, 0);
  for (int64_t i = 0; i < n_slots; ++i) {
    GLMTUNE_ASSERT(idx[i] >= 0 && idx[i] < n_experts, "routed expert id {} out of [0, {})", idx[i],
                   n_experts);
    ++b.start[size_t(idx[i]) + 1];
  }
  std::partial_sum(b.start.begin(), b.start.end(), b.start.begin());
  b.slot.resize(size_t(n_slots));
  std::vector<int64_t> fill(b.start.begin(), b.start.end() - 1);
  for (int64_t i = 0; i < n_slots; ++i) b.slot[size_t(fill[size_t(idx[i])]++)] = i;
  return b;
}

// The routing of the expert MLPs over x [T, D]: int32 [T, K] indices and weights of that shape
// in x's dtype. The local and the expert-parallel experts accept the same routings.
inline void check_experts_routing(const Routing& routing, const Tensor& x) {
  GLMTUNE_ASSERT(routing.indices.defined() && routing.indices.dtype() == DType::i32 &&
                     routing.indices.dim() == 2 && routing.indices.size(0) == x.size(0) &&
                     routing.weights.defined() &&
                     routing.weights.shape() == routing.indices.shape() &&
                     routing.weights.dtype() == x.dtype(),
                 "routing does not match input {}", x.str());
}

}  // namespace glmtune::ops::cpu_detail
