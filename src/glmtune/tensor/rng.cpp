#include "glmtune/tensor/rng.h"

#include <cmath>

#include "glmtune/tensor/convert.h"
#include "glmtune/tensor/tensor.h"
#ifdef GLMTUNE_WITH_CUDA
#include "glmtune/tensor/cuda_ops.h"
#endif

namespace glmtune {

double rng_detail::sqrt_rn(double a) { return std::sqrt(a); }

namespace {
template <typename Draw>
void fill_cpu(Tensor& t, Draw&& draw) {
  char* p = static_cast<char*>(t.data_ptr());
  const int64_t n = t.numel();
  const size_t es = t.element_size();
  const DType dt = t.dtype();
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) convert::store(p + i * es, dt, draw(uint64_t(i)));
}

void check_target(const Tensor& t, const char* what) {
  GLMTUNE_ASSERT(t.is_contiguous() && dtype_is_floating(t.dtype()),
                 "{} needs a contiguous floating tensor, got {}", what, t.str());
}
}  // namespace

void fill_uniform(Tensor& t, uint64_t seed, uint64_t offset, double low, double high) {
  check_target(t, "fill_uniform");
  if (t.device().is_cuda()) {
#ifdef GLMTUNE_WITH_CUDA
    cuda_impl::rng_uniform(t.device().index, t.data_ptr(), t.dtype(), t.numel(), seed, offset, low,
                           high);
    return;
#endif
  }
  const double span = high - low;
  fill_cpu(t, [&](uint64_t i) { return rng_affine(low, span, rng_uniform_at(seed, offset + i)); });
}

void fill_normal(Tensor& t, uint64_t seed, uint64_t offset, double mean, double std) {
  check_target(t, "fill_normal");
  if (t.device().is_cuda()) {
#ifdef GLMTUNE_WITH_CUDA
    cuda_impl::rng_normal(t.device().index, t.data_ptr(), t.dtype(), t.numel(), seed, offset, mean,
                          std);
    return;
#endif
  }
  fill_cpu(t, [&](uint64_t i) { return rng_affine(mean, std, rng_normal_at(seed, offset + i)); });
}

}  // namespace glmtune
