#pragma once
// Elementwise leaf ops the model and the parallel layers use between the other ops: residual and
// gradient sums, the MTP input concatenation, and row gathers. CPU tensors in f32 / f64; on a CUDA
// device (ops/dispatch.h) bf16 / f32.

#include <cstdint>
#include <vector>

#include "glmtune/tensor/tensor.h"

namespace glmtune::ops {

// a += b (one shape; a contiguous). On the CPU both share a dtype; on the GPU b may be bf16 or
// f32 and the sum is rounded once into a's dtype.
void add_into(Tensor& a, const Tensor& b);
// a *= s (a contiguous; the adapters' scale): the product in double, rounded once into a's dtype.
void scale_into(Tensor& a, double s);
// Dropout in place (the adapters' lora_dropout): element i of a (flat, a contiguous) is kept with
// probability 1 − p, as rng_uniform_at(key, i) ≥ p (tensor/rng.h: the same draws on every
// device), and multiplied by 1 / (1 − p) (the product in double, rounded into a's dtype), else
// set to 0. The same (p, key) on a tensor of the same shape applies the same mask: the backward
// masks the input gradient with it. p in [0, 1).
//
// `block`: where `a` (seen as [rows, cols], cols its last dimension) sits in a larger input that a
// parallel layout split (sequence parallelism: a shard of the pack's rows, or one rank's slice of
// the heads' columns): element (r, c) is drawn at index (row0 + r) · width + col0 + c of the whole,
// so the ranks together draw the mask one process draws. The default is `a` itself. On the CPU
// only (the GPU takes the default).
struct DropoutBlock {
  int64_t row0 = 0, col0 = 0;
  int64_t width = 0;  // the whole input's row length; 0: a's own
  bool whole() const { return row0 == 0 && col0 == 0 && width == 0; }
};
void dropout_into(Tensor& a, double p, uint64_t key, const DropoutBlock& block = {});
// a + b as a new tensor with a's dtype.
Tensor add(const Tensor& a, const Tensor& b);
// [a | b] along the last dimension: [T, Da] and [T, Db] -> [T, Da + Db], on a's device.
Tensor concat_columns(const Tensor& a, const Tensor& b);
// out[i] = x[rows[i]] for x [N, D]; a negative index gives a zero row.
Tensor gather_rows(const Tensor& x, const std::vector<int64_t>& rows);
// dst[rows[i]] = src[i] in place for dst [N, D] (contiguous) and src [rows.size(), D] of dst's
// dtype; the rows are distinct and inside dst.
void scatter_rows_(Tensor& dst, const std::vector<int64_t>& rows, const Tensor& src);

}  // namespace glmtune::ops
