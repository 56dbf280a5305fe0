#pragma once
// What the MPI and NCCL communicators share: the mapping of element widths and reduce ops onto a
// library's own constants, the argument checks every backend makes before a collective, and the
// way a rank waits between polls. Backends only.
#include <chrono>
#include <cstdint>
#include <span>
#include <string>

#include "glmtune/dist/comm.h"

namespace glmtune::dist::backend {

// Data movers only copy bits: one library type per element width (1, 2, 4 or 8 bytes) is enough.
template <typename Type>
Type move_type(DType dt, Type w1, Type w2, Type w4, Type w8) {
  switch (dtype_size(dt)) {
    case 1:
      return w1;
    case 2:
      return w2;
    case 4:
      return w4;
    default:
      return w8;
  }
}

template <typename Op>
Op reduce_op(ReduceOp op, Op sum, Op max, Op min) {
  switch (op) {
    case ReduceOp::sum:
      return sum;
    case ReduceOp::max:
      return max;
    case ReduceOp::min:
      return min;
  }
  return sum;
}

// `in` must hold `ranks` blocks of out.numel() elements, in out's dtype.
void check_reduce_scatter(const Tensor& in, const Tensor& out, const std::string& group, int ranks);
// `out` must hold `ranks` blocks of in.numel() elements, in in's dtype.
void check_all_gather(const Tensor& in, const Tensor& out, const std::string& group, int ranks);
// One send and one receive count per rank, and one dtype on both sides.
void check_all_to_all(const Tensor& in, std::span<const int64_t> send_counts, const Tensor& out,
                      std::span<const int64_t> recv_counts, const std::string& group, int ranks);

// The moment a collective started now has to be complete by.
std::chrono::steady_clock::time_point deadline_after(double timeout_s);

// A poll loop's wait: the first 1000 polls only yield, so a collective that is about to complete
// is seen at once; later ones sleep `nap`, so that oversubscribed ranks do not starve each other.
void pause_between_polls(int64_t polls, std::chrono::microseconds nap);

}  // namespace glmtune::dist::backend
