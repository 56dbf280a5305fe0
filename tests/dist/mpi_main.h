#pragma once
// main() of the distributed GoogleTest binaries: every rank runs the same tests in the same
// order (they issue collectives), only rank 0 prints, and a failure on any rank fails the job.
#include <gtest/gtest.h>

#include <memory>

#include "glmtune/dist/parallel.h"

namespace glmtune::dist::testing {

// The world of this mpirun (ep_size = sp_size = 1).
inline ParallelContext*& world_context() {
  static ParallelContext* p = nullptr;
  return p;
}

inline int run_all_tests(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  ParallelOptions options;
  options.timeout_s = 300;
  const std::unique_ptr<ParallelContext> par = ParallelContext::create(options);
  world_context() = par.get();
  if (!par->is_root()) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  return int(par->world().all_reduce_max(int64_t(rc)));
}

}  // namespace glmtune::dist::testing
