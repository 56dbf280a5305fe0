// Leaf ops refuse arguments that do not fit together before they dispatch (ops/checks.h): each
// bad call of support/leaf_op_checks.h throws an InternalError naming its op. test_cuda_dispatch
// runs the same table on a GPU.

#include <gtest/gtest.h>

#include <string>

#include "glmtune/base/error.h"
#include "support/leaf_op_checks.h"

using namespace glmtune;

namespace {

TEST(LeafOpChecks, BadArgumentsAreRefusedNamingTheOp) {
  for (const test::BadLeafCall& c : test::bad_leaf_calls(Device::cpu(), DType::f32, DType::f64)) {
    SCOPED_TRACE(c.op + ": " + c.what);
    try {
      c.call();
      ADD_FAILURE() << "accepted";
    } catch (const InternalError& e) {
      EXPECT_NE(std::string(e.what()).find(c.op), std::string::npos) << e.what();
    }
  }
}

}  // namespace
