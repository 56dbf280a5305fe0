#pragma once
// Internal tensors seen under the released checkpoint names. The ParamStore fuses some released
// tensors (experts into [E, 2I, D] / [E, D, I], the q / k / v short convolutions into one); a
// gradient or a weight reported to a user, or written for other tools, must be split back into the
// per-expert / per-projection tensors the user knows.

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "glmtune/model/param_store.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::train {

// For every released tensor whose internal parameter `lookup` maps to a tensor of the parameter's
// shape (nullptr: left out), that tensor's part under the released name, as a view, in the
// released layout's order, then the store's LoRA adapters under their own names. With `lookup`
// returning a gradient buffer this yields the gradients under released names; with the store's own
// tensors, the weights.
using InternalLookup = std::function<const Tensor*(const model::InternalParam&)>;
std::vector<std::pair<std::string, Tensor>> released_views(const model::ParamStore& store,
                                                           const InternalLookup& lookup);

// Whether every element of a floating tensor is finite.
bool all_finite(const Tensor& t);

// The released names, in layout order, of the first `limit` views holding a non-finite value.
std::vector<std::string> first_nonfinite(const std::vector<std::pair<std::string, Tensor>>& views,
                                         size_t limit);

}  // namespace glmtune::train
