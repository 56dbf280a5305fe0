#pragma once
// Rows of one tensor spread over the ranks of a sequence-parallel group: rank q holds counts[q]
// consecutive rows, in rank order. The vision tower (model/vision/tower.h) and the
// vision-language splice (model/compose.h) reach the group through this interface, which the text
// model's SequenceParallel hook extends (model/text/layer.h; dist/sequence_parallel.h implements
// both over a Communicator). Every call is collective over the group.
#include <cstdint>
#include <span>

#include "glmtune/tensor/tensor.h"

namespace glmtune::model {

class RowExchange {
 public:
  virtual ~RowExchange() = default;
  virtual int rank() const = 0;
  virtual int ranks() const = 0;
  // This rank's [counts[rank], C...] rows -> the [Σ counts, C...] rows of every rank, in rank
  // order, on every rank.
  virtual Tensor gather_rows(const Tensor& local, std::span<const int64_t> counts) const = 0;
  // [Σ counts, C...] partial values on every rank -> this rank's counts[rank] rows, summed over
  // the group in rank order (every run adds in the same order). f32 or f64.
  virtual Tensor sum_scatter_rows(const Tensor& full, std::span<const int64_t> counts) const = 0;
};

}  // namespace glmtune::model
