// The row ops of ops/elementwise.h on the CPU: gather_rows (a negative index gives a zero row) and
// scatter_rows_ (rows written in place, the others untouched), and their refusals.

#include <gtest/gtest.h>

#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/ops/elementwise.h"
#include "glmtune/tensor/tensor.h"

using namespace glmtune;

namespace {

Tensor rows_of(const std::vector<float>& values, int64_t width) {
  return Tensor::from_vector(values, {int64_t(values.size()) / width, width});
}

TEST(OpsElementwise, GatherRowsTakesRowsInOrderAndZerosForNegativeIndices) {
  const Tensor x = rows_of({1, 2, 3, 4, 5, 6}, 2);
  const Tensor g = ops::gather_rows(x, {2, -1, 0, 2});
  EXPECT_EQ(g.to_doubles(), (std::vector<double>{5, 6, 0, 0, 1, 2, 5, 6}));
  EXPECT_THROW(ops::gather_rows(x, {3}), InternalError);
}

TEST(OpsElementwise, ScatterRowsWritesTheNamedRowsOnly) {
  Tensor dst = rows_of({1, 2, 3, 4, 5, 6, 7, 8}, 2);
  ops::scatter_rows_(dst, {3, 0}, rows_of({-1, -2, -3, -4}, 2));
  EXPECT_EQ(dst.to_doubles(), (std::vector<double>{-3, -4, 3, 4, 5, 6, -1, -2}));
  ops::scatter_rows_(dst, {}, Tensor::empty({0, 2}, DType::f32));  // nothing to write
  EXPECT_EQ(dst.to_doubles(), (std::vector<double>{-3, -4, 3, 4, 5, 6, -1, -2}));
  // Wrong counts, widths and dtypes, and rows outside dst, are refused.
  EXPECT_THROW(ops::scatter_rows_(dst, {0}, rows_of({1, 2, 3, 4}, 2)), InternalError);
  EXPECT_THROW(ops::scatter_rows_(dst, {0}, rows_of({1, 2, 3}, 3)), InternalError);
  EXPECT_THROW(ops::scatter_rows_(dst, {0}, rows_of({1, 2}, 2).to(DType::f64)), InternalError);
  EXPECT_THROW(ops::scatter_rows_(dst, {4}, rows_of({1, 2}, 2)), InternalError);
  EXPECT_THROW(ops::scatter_rows_(dst, {-1}, rows_of({1, 2}, 2)), InternalError);
}

}  // namespace
