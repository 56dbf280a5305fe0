#pragma once
// The NCCL backend of Communicator (GPU tensors), built with the CUDA backend only.
//
// Each group gets its own NCCL communicator: rank 0 of `bootstrap` (an MPI group with the same
// ranks) creates the unique id and broadcasts it. Collectives run on a dedicated stream that
// first waits for the work already queued on the default stream, and each call returns once its
// result is complete, polled against the timeout like the MPI backend (the NCCL communicator is
// aborted, then the job). start_all_gather and start_reduce_scatter return once queued; their
// wait() polls an event recorded behind them against the same timeout, so the GPU runs them beside
// the work queued afterwards (fsdp's prefetch and its gradient reductions).
#include <memory>
#include <string>

#include "glmtune/dist/comm.h"

namespace glmtune::dist {

// `device` is the CUDA device this rank uses (the local rank's GPU).
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap, int device,
                                                     double timeout_s);

}  // namespace glmtune::dist
