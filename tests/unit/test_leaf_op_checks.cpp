// Leaf ops refuse arguments that do not fit together before they dispatch (ops/checks.h): each
// bad call of support/leaf_op_checks.h throws an InternalError naming its op. test_cuda_dispatch
// runs the same table on a GPU.

#include <gtest/gtest.h>

#include "support/leaf_op_checks.h"

using namespace glmtune;

namespace {

TEST(LeafOpChecks, BadArgumentsAreRefusedNamingTheOp) {
  test::expect_refused(test::bad_leaf_calls(Device::cpu(), DType::f32, DType::f64));
}

}  // namespace
