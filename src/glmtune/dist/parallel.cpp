#include "glmtune/dist/parallel.h"

#include <fmt/format.h>

#include <cstdlib>

#include "glmtune/base/error.h"
#include "glmtune/tensor/device.h"
#ifdef GLMTUNE_WITH_CUDA
#include "glmtune/dist/comm_nccl.h"
#endif
#if GLMTUNE_WITH_MPI
#include "glmtune/dist/comm_mpi.h"
#endif

namespace glmtune::dist {

ParallelSizes parallel_sizes(int world, int64_t ep_size, int64_t sp_size,
                             const std::string& where) {
  if (sp_size < 1 || ep_size < 1)
    throw Error(fmt::format("ep_size {} and sp_size {} must be at least 1", ep_size, sp_size),
                where, "set train.ep_size and train.sp_size to 1 or more");
  if (world % sp_size != 0)
    throw Error(
        fmt::format("{} ranks do not split into sequence-parallel groups of {}", world, sp_size),
        where,
        fmt::format("launch a multiple of {} ranks, or set train.sp_size to a divisor "
                    "of {}",
                    sp_size, world));
  const int64_t dp = world / sp_size;
  if (dp % ep_size != 0)
    throw Error(fmt::format("the {} data-parallel ranks (world {} / sp_size {}) do not split into "
                            "expert-parallel groups of {}",
                            dp, world, sp_size, ep_size),
                where,
                fmt::format("launch a multiple of {} ranks, or set train.ep_size to a divisor "
                            "of {}",
                            ep_size * sp_size, dp));
  return {world, int(dp), int(ep_size), int(sp_size)};
}

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(v) != nullptr) return true;
  // srun starts the ranks itself; MPI then bootstraps over PMI/PMIx.
  if (const char* n = std::getenv("SLURM_NTASKS"); n && std::getenv("SLURM_PROCID"))
    return std::atoi(n) > 1 && std::getenv("SLURM_STEP_ID") != nullptr;
  return false;
}

std::unique_ptr<ParallelContext> ParallelContext::single() {
  std::unique_ptr<ParallelContext> c(new ParallelContext());
  c->world_ = make_self_communicator("world");
  c->dp_ = make_self_communicator("dp");
  c->ep_ = make_self_communicator("ep");
  c->sp_ = make_self_communicator("sp");
  c->edp_ = make_self_communicator("edp");
  return c;
}

std::unique_ptr<ParallelContext> ParallelContext::create(const ParallelOptions& options) {
  if (!launched_by_mpi()) {
    parallel_sizes(1, options.ep_size, options.sp_size, options.where);
    auto c = single();
    c->timeout_s_ = options.timeout_s;
    return c;
  }
#if GLMTUNE_WITH_MPI
  mpi::init();
  std::unique_ptr<ParallelContext> c(new ParallelContext());
  c->timeout_s_ = options.timeout_s;
  c->world_ = mpi::world(options.timeout_s);
  const int world = c->world_->size();
  const int rank = c->world_->rank();
  // Every rank validates the same sizes, so a bad layout fails on all of them alike.
  c->sizes_ = parallel_sizes(world, options.ep_size, options.sp_size, options.where);
  const int S = c->sizes_.sp, E = c->sizes_.ep;
  const int d = rank / S, s = rank % S;
  const int f = d / E, e = d % E;
  Communicator& w = *c->world_;
  c->sp_ = mpi::split(w, d, s, "sp");
  c->dp_ = mpi::split(w, s, d, "dp");
  c->ep_ = mpi::split(w, s * (world / E) + f, e, "ep");
  c->edp_ = mpi::split(w, s * E + e, f, "edp");
  const mpi::NodeLocal local = mpi::node_local(w);
  c->local_rank_ = local.rank;
  c->local_size_ = local.size;
  return c;
#else
  throw Error("this glmtune was built without MPI but was started by an MPI launcher",
              "the glmtune build", "install libopenmpi-dev (scripts/install-deps.sh) and rebuild");
#endif
}

void ParallelContext::use_gpu(int device) {
#ifdef GLMTUNE_WITH_CUDA
  use_cuda_device(device);
  if (!dp_gpu_) dp_gpu_ = make_nccl_communicator(*dp_, device, timeout_s_);
  if (sizes_.ep > 1 && !ep_gpu_) {
    ep_gpu_ = make_nccl_communicator(*ep_, device, timeout_s_);
    edp_gpu_ = make_nccl_communicator(*edp_, device, timeout_s_);
  }
  if (sizes_.sp > 1 && !sp_gpu_) sp_gpu_ = make_nccl_communicator(*sp_, device, timeout_s_);
#else
  throw Error(fmt::format("GPU {} asked for, but this glmtune was built without CUDA", device),
              "the glmtune build", "build with -DGLMTUNE_CUDA=ON, or train on the CPU");
#endif
}

double ParallelContext::take_gpu_busy_seconds() const {
  double seconds = 0;
  for (const auto* group : {&dp_gpu_, &ep_gpu_, &edp_gpu_, &sp_gpu_})
    if (*group) seconds += (*group)->take_busy_seconds();
  return seconds;
}

void ParallelContext::abort(const std::string& message) const {
#if GLMTUNE_WITH_MPI
  if (distributed()) mpi::abort_job(message, 2);
#endif
  throw Error(message);
}

}  // namespace glmtune::dist
