#pragma once
// The MPI backend of Communicator (CPU tensors) and the process bootstrap. Only built when MPI
// was found (GLMTUNE_WITH_MPI); parallel.h is the public entry point.
#include <memory>
#include <string>

#include "glmtune/dist/comm.h"

namespace glmtune::dist::mpi {

// Initialises MPI once per process (thread level FUNNELED: OpenMP workers never call MPI) and
// registers its finalisation at exit.
void init();
int world_rank();
int world_size();
// The world communicator; `timeout_s` bounds every collective (see comm.h).
std::unique_ptr<Communicator> world(double timeout_s);
// Splits `parent` (an MPI communicator) into groups of equal `color`, ranked by `key`.
std::unique_ptr<Communicator> split(Communicator& parent, int color, int key, std::string name);
// This rank's position among the ranks of its node (the processes sharing its memory), and their
// number: the rank's GPU is the node-local rank's.
struct NodeLocal {
  int rank = 0;
  int size = 1;
};
NodeLocal node_local(Communicator& parent);
// Prints `message` on this rank's stderr and ends every rank of the job with exit code `code`.
[[noreturn]] void abort_job(const std::string& message, int code);

}  // namespace glmtune::dist::mpi
