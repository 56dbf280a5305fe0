#pragma once
// Token embedding, the model's first step (nn.Embedding with padding_idx = pad_token_id).
//
//   forward   out[t, :] = table[ids[t], :]
//   backward  dtable[v, :] += Σ_{t : ids[t] = v} dout[t, :]   for every v except the padding row
//
// As in torch, padding_idx changes only the backward: the forward returns whatever the pad row
// holds (the reference initialises it to 0, a trained or loaded table may differ), and the pad row
// never receives a gradient, however often the pad token occurs. CPU tensors in f32 (reference
// path) or f64 (finite-difference tests); ids are int32 or int64.

#include <cstdint>
#include <optional>

#include "glmtune/tensor/tensor.h"

namespace glmtune::ops {

// table [V, D], ids [...] -> [..., D]. An id outside [0, V) is an error naming it.
Tensor embedding_forward(const Tensor& table, const Tensor& ids);

// Adds the gradient of embedding_forward into `dtable` ([V, D] like `table`, which gives only
// the shape and dtype; created as zeros when undefined). dout has shape [..., D] matching ids.
// `padding_idx` (in [0, V); none when empty) is the row that gets no gradient. Unlike torch, a
// negative padding_idx is not counted from the end: pass the row itself.
void embedding_backward(const Tensor& table, const Tensor& ids, const Tensor& dout,
                        std::optional<int64_t> padding_idx, Tensor& dtable);

}  // namespace glmtune::ops
