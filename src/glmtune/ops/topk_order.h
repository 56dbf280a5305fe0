#pragma once
// The order of the top-k choices (the MoE routing, the indexer's selection), one definition for
// the CPU and the CUDA kernels so that both choose the same experts and keys.

#include <cmath>

#include "glmtune/tensor/dtype.h"

namespace glmtune::ops {

// Strict weak order "a ranks before b" for a descending top-k: larger value first, NaN above
// everything (torch.topk's convention), equal values by ascending index so that the choice is
// deterministic.
template <typename T, typename I>
GLMTUNE_HD bool ranks_before(T va, I ia, T vb, I ib) {
  const bool na = std::isnan(va), nb = std::isnan(vb);
  if (na != nb) return na;
  if (!na && va != vb) return va > vb;
  return ia < ib;
}

// The sum of the two values of v[0, n) (n ≥ 2) that rank first: an expert group's score in the
// group-limited routing.
template <typename T, typename I>
GLMTUNE_HD T top2_sum(const T* v, I n) {
  I best = 0;
  for (I j = 1; j < n; ++j)
    if (ranks_before(v[j], j, v[best], best)) best = j;
  I second = best == 0 ? 1 : 0;
  for (I j = 0; j < n; ++j)
    if (j != best && ranks_before(v[j], j, v[second], second)) second = j;
  return v[best] + v[second];
}

}  // namespace glmtune::ops
