#pragma once
// Collective communication between the ranks of a distributed run (docs/distributed.md).
//
// One interface, two backends:
//   - MPI (comm_mpi.cpp): CPU tensors, and the bootstrap of everything else (rank and size come
//     from the launcher, mpirun or Slurm srun);
//   - NCCL (comm_nccl_cuda.cpp, CUDA builds only): GPU tensors; its unique id travels over MPI.
// A group of one rank (a single-process run, or a group of size 1 inside a larger run) has its
// own backend that moves data locally.
//
// Every collective waits with a deadline: a rank that died or hangs turns into an error on every
// rank (MPI_Abort with a message naming the collective and the group) after `timeout_s`, never a
// silent stall. Collectives must be called by every rank of the group in the same order.
//
// Tensors must be contiguous; counts are in elements of the tensor's dtype. Reductions accept
// f32, f64, i32 and i64; the data movers (gather, all-to-all, broadcast) accept every dtype.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "glmtune/tensor/tensor.h"

namespace glmtune::dist {

enum class ReduceOp { sum, max, min };

// A collective started without waiting for it (Communicator::start_all_gather). It keeps its
// tensors alive until it completes; their contents must not be touched before wait() returns.
class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  // Returns once the result is complete, bounded by the communicator's deadline like the
  // blocking collectives. Idempotent.
  virtual void wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The group's name in messages ("world", "dp", "ep", "sp", ...).
  virtual const std::string& name() const = 0;
  // The backend in messages ("mpi", "nccl", "self").
  virtual const char* backend() const = 0;

  // In place: every rank ends with the reduction of every rank's `t`.
  virtual void all_reduce(Tensor& t, ReduceOp op = ReduceOp::sum) = 0;
  // `in` holds size() equal blocks of out.numel() elements; rank r receives the reduction of
  // block r over the ranks.
  virtual void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op = ReduceOp::sum) = 0;
  // `out` holds size() blocks of in.numel() elements, block r from rank r.
  virtual void all_gather(const Tensor& in, Tensor& out) = 0;
  // Variable counts: rank r sends send_counts[q] elements (consecutive in `in`, in rank order)
  // to rank q and receives recv_counts[q] elements from rank q (consecutive in `out`).
  virtual void all_to_all(const Tensor& in, std::span<const int64_t> send_counts, Tensor& out,
                          std::span<const int64_t> recv_counts) = 0;
  // In place: every rank ends with root's `t`.
  virtual void broadcast(Tensor& t, int root) = 0;
  virtual void barrier() = 0;

  // all_gather and reduce_scatter that return once started, so the exchange can overlap other
  // work. Every rank must start them at the same point of its sequence of collectives; others may
  // run before their wait(). MPI has an asynchronous all_gather, NCCL both (queued on its stream
  // behind the work the GPU already has); the other cases complete here.
  virtual std::unique_ptr<PendingCollective> start_all_gather(const Tensor& in, Tensor& out);
  virtual std::unique_ptr<PendingCollective> start_reduce_scatter(const Tensor& in, Tensor& out,
                                                                  ReduceOp op = ReduceOp::sum);

  // Seconds the GPU spent in this group's collectives since the last call, counting those complete
  // by now: each from the moment it could start (the work it waits for done) to its end, a late
  // peer's wait included. The host backends (MPI, self) report 0.
  virtual double take_busy_seconds() { return 0; }

  // Convenience over all_reduce for scalars and host vectors.
  double all_reduce_sum(double v);
  int64_t all_reduce_sum(int64_t v);
  int64_t all_reduce_max(int64_t v);
  double all_reduce_max(double v);
  void all_reduce_sum(std::vector<double>& v);
  void all_reduce_sum(std::vector<int64_t>& v);
};

// A group of one rank: every collective is a local copy (or nothing).
std::unique_ptr<Communicator> make_self_communicator(std::string name);

}  // namespace glmtune::dist
