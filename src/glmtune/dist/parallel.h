#pragma once
// The ranks of a distributed run and their process groups (docs/distributed.md).
//
// Layout of `world` ranks with sequence-parallel size S and expert-parallel size E:
//   rank = d · S + s          s: position in the sp group (contiguous ranks share a sequence),
//                             d: data-parallel index, 0 .. dp − 1 with dp = world / S
//   sp group   ranks with the same d (S ranks, consecutive)
//   dp group   ranks with the same s (dp ranks): they see different packs and hold replicas of
//              every parameter but the routed experts; the sharded optimizer
//              (sharded_optimizer.h) shards over it
//   ep group   E consecutive data indices with the same s: d = f · E + e, the group is the e's
//              of one f; routed experts are split over it
//   edp group  ranks with the same s and the same e (dp / E ranks): replicas of one expert slice,
//              over which its optimizer is sharded (expert_shards.h)
// world must be a multiple of S, and dp of E; the recipe keys train.ep_size and train.sp_size
// set E and S.
//
// A process started by a launcher (mpirun, or Slurm srun with PMI/PMIx) initialises MPI and
// takes its rank and size from it; any other process is a single-rank world and never touches
// MPI, so a plain `glmtune train` behaves exactly as it did without distributed support.
#include <memory>
#include <string>

#include "glmtune/dist/comm.h"

namespace glmtune::dist {

struct ParallelSizes {
  int world = 1, dp = 1, ep = 1, sp = 1;
};

// Checks that `world` ranks split into sp groups of `sp_size` and ep groups of `ep_size`;
// glmtune::Error naming `where` (the recipe keys) otherwise.
ParallelSizes parallel_sizes(int world, int64_t ep_size, int64_t sp_size, const std::string& where);

struct ParallelOptions {
  int64_t ep_size = 1;
  int64_t sp_size = 1;
  // Bound on every collective (seconds): past it, every rank is ended with a message.
  double timeout_s = 600;
  // Where ep_size / sp_size came from, for error messages.
  std::string where = "train.ep_size / train.sp_size";
};

// Whether this process was started by an MPI launcher (mpirun / mpiexec, or srun with PMI).
bool launched_by_mpi();

class ParallelContext {
 public:
  // A single-rank world: every group is the rank itself.
  static std::unique_ptr<ParallelContext> single();
  // The world of the launcher when launched_by_mpi(), else single(). MPI is initialised once.
  static std::unique_ptr<ParallelContext> create(const ParallelOptions& options);

  int rank() const { return world_->rank(); }
  bool is_root() const { return rank() == 0; }
  const ParallelSizes& sizes() const { return sizes_; }
  bool distributed() const { return sizes_.world > 1; }
  double timeout_s() const { return timeout_s_; }

  Communicator& world() const { return *world_; }
  Communicator& dp() const { return *dp_; }
  Communicator& ep() const { return *ep_; }
  Communicator& sp() const { return *sp_; }
  Communicator& edp() const { return *edp_; }
  // This rank's index among the ranks of its node, and their number (1 and 0 in a single-rank
  // world): a GPU run gives each rank of a node its own GPU, the node-local rank's.
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }

  // GPU runs: NCCL communicators over the same ranks as dp() (the gradient reduce-scatter and the
  // parameter all-gather, on device tensors), created by use_gpu(); null before, and in a CPU run.
  // MPI stays the bootstrap and carries the small host-side sums (losses, loads, norms).
  Communicator* dp_gpu() const { return dp_gpu_.get(); }
  // With expert parallelism (ep > 1), the same for the ep and edp groups: the token exchange and
  // the expert slices' gradient reduce-scatter and parameter all-gather.
  Communicator* ep_gpu() const { return ep_gpu_.get(); }
  Communicator* edp_gpu() const { return edp_gpu_.get(); }
  // With sequence parallelism (sp > 1), the same for the sp group: the mixers' row and head
  // exchanges and the sum of the shards' partial gradients.
  Communicator* sp_gpu() const { return sp_gpu_.get(); }
  // Collective. Makes `device` this process's current GPU and creates the NCCL groups on it.
  void use_gpu(int device);
  // Seconds this rank's GPU spent in the NCCL groups' collectives since the last call
  // (Communicator::take_busy_seconds, summed over the groups; collectives of different groups
  // that ran at once count each). 0 before use_gpu.
  double take_gpu_busy_seconds() const;

  // Ends every rank of the job with `message` (MPI_Abort), or throws it as an Error in a
  // single-rank world.
  [[noreturn]] void abort(const std::string& message) const;

 private:
  ParallelContext() = default;
  ParallelSizes sizes_;
  double timeout_s_ = 600;
  int local_rank_ = 0, local_size_ = 1;
  std::unique_ptr<Communicator> world_, dp_, ep_, sp_, edp_;
  std::unique_ptr<Communicator> dp_gpu_, ep_gpu_, edp_gpu_, sp_gpu_;
};

}  // namespace glmtune::dist
