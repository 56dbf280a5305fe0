#include "glmtune/ops/elementwise.h"

#include <cstring>

#include "glmtune/base/error.h"
#include "glmtune/ops/dispatch.h"
#include "glmtune/tensor/rng.h"

namespace glmtune::ops {
namespace {

template <typename T>
void add_kernel(T* a, const T* b, int64_t n) {
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) a[i] += b[i];
}

}  // namespace

void add_into(Tensor& a, const Tensor& b) {
  GLMTUNE_ASSERT(a.shape() == b.shape() && a.device() == b.device() && a.is_contiguous(),
                 "add: {} and {} differ", a.str(), b.str());
  GLMTUNE_DISPATCH_CUDA(a, cuda_path::add_into(a, b));
  GLMTUNE_ASSERT(a.dtype() == b.dtype() && (a.dtype() == DType::f32 || a.dtype() == DType::f64),
                 "add on the CPU: {} and {} must share f32 or f64", a.str(), b.str());
  const Tensor bc = b.contiguous();
  if (a.dtype() == DType::f32)
    add_kernel(a.data<float>(), bc.data<float>(), a.numel());
  else
    add_kernel(a.data<double>(), bc.data<double>(), a.numel());
}

void scale_into(Tensor& a, double s) {
  GLMTUNE_ASSERT(a.is_contiguous(), "scale_into: {} must be contiguous", a.str());
  GLMTUNE_DISPATCH_CUDA(a, cuda_path::scale_into(a, s));
  GLMTUNE_ASSERT(a.dtype() == DType::f32 || a.dtype() == DType::f64,
                 "scale_into on the CPU: {} must be f32 or f64", a.str());
  const int64_t n = a.numel();
  if (a.dtype() == DType::f32) {
    float* p = a.data<float>();
    for (int64_t i = 0; i < n; ++i) p[i] = float(p[i] * s);
  } else {
    double* p = a.data<double>();
    for (int64_t i = 0; i < n; ++i) p[i] *= s;
  }
}

void dropout_into(Tensor& a, double p, uint64_t key, const DropoutBlock& block) {
  GLMTUNE_ASSERT(a.is_contiguous(), "dropout_into: {} must be contiguous", a.str());
  GLMTUNE_ASSERT(p >= 0 && p < 1, "dropout_into: p = {} must be in [0, 1)", p);
  const int64_t n = a.numel(), cols = a.dim() > 0 ? a.size(-1) : 1;
  const int64_t width = block.width > 0 ? block.width : cols;
  GLMTUNE_ASSERT(block.row0 >= 0 && block.col0 >= 0 && block.col0 + cols <= width,
                 "dropout_into: {} at row {} and column {} does not fit rows of {}", a.str(),
                 block.row0, block.col0, width);
  GLMTUNE_ASSERT(block.whole() || a.device().is_cpu(),
                 "dropout_into: a block of a larger input ({}) is drawn on the CPU only", a.str());
  GLMTUNE_DISPATCH_CUDA(a, cuda_path::dropout_into(a, p, key));
  GLMTUNE_ASSERT(a.dtype() == DType::f32 || a.dtype() == DType::f64,
                 "dropout_into on the CPU: {} must be f32 or f64", a.str());
  const double inv = 1.0 / (1.0 - p);
  const auto apply = [&](auto* v) {
#pragma omp parallel for schedule(static) if (n > (1 << 16))
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t at = uint64_t((block.row0 + i / cols) * width + block.col0 + i % cols);
      v[i] = rng_uniform_at(key, at) >= p ? decltype(v[i] + 0)(double(v[i]) * inv) : 0;
    }
  };
  if (a.dtype() == DType::f32)
    apply(a.data<float>());
  else
    apply(a.data<double>());
}

Tensor add(const Tensor& a, const Tensor& b) {
  Tensor out = a.contiguous().clone();
  add_into(out, b);
  return out;
}

Tensor concat_columns(const Tensor& a, const Tensor& b) {
  GLMTUNE_ASSERT(a.dim() == 2 && b.dim() == 2 && a.size(0) == b.size(0),
                 "concat_columns: {} and {} must be [T, *]", a.str(), b.str());
  const int64_t rows = a.size(0), da = a.size(1), db = b.size(1);
  Tensor out = Tensor::empty({rows, da + db}, a.dtype(), a.device());
  out.narrow(1, 0, da).copy_(a);
  out.narrow(1, da, db).copy_(b);
  return out;
}

Tensor gather_rows(const Tensor& x_in, const std::vector<int64_t>& rows) {
  GLMTUNE_ASSERT(x_in.dim() == 2, "gather_rows: x {} must be [N, D]", x_in.str());
  for (const int64_t r : rows)
    GLMTUNE_ASSERT(r < x_in.size(0), "gather_rows: row {} of {}", r, x_in.str());
  const Tensor x = x_in.contiguous();
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::gather_rows(x, rows));
  const int64_t dim = x.size(1), n = int64_t(rows.size());
  Tensor out = Tensor::empty({n, dim}, x.dtype());
  const size_t row_bytes = size_t(dim) * x.element_size();
  const auto* src = static_cast<const char*>(x.data_ptr());
  auto* dst = static_cast<char*>(out.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    if (rows[size_t(i)] < 0)
      std::memset(dst + i * row_bytes, 0, row_bytes);
    else
      std::memcpy(dst + i * row_bytes, src + rows[size_t(i)] * row_bytes, row_bytes);
  }
  return out;
}

void scatter_rows_(Tensor& dst, const std::vector<int64_t>& rows, const Tensor& src_in) {
  GLMTUNE_ASSERT(dst.dim() == 2 && dst.is_contiguous() && src_in.dim() == 2 &&
                     src_in.size(0) == int64_t(rows.size()) && src_in.size(1) == dst.size(1) &&
                     src_in.dtype() == dst.dtype(),
                 "scatter_rows_: src {} must hold one row of dst {} per index", src_in.str(),
                 dst.str());
  for (const int64_t r : rows)
    GLMTUNE_ASSERT(r >= 0 && r < dst.size(0), "scatter_rows_: row {} of {}", r, dst.str());
  const Tensor src = src_in.contiguous();
  GLMTUNE_DISPATCH_CUDA(dst, cuda_path::scatter_rows_(dst, rows, src));
  const size_t row_bytes = size_t(dst.size(1)) * dst.element_size();
  const auto* from = static_cast<const char*>(src.data_ptr());
  auto* to = static_cast<char*>(dst.data_ptr());
  for (size_t i = 0; i < rows.size(); ++i)
    std::memcpy(to + rows[i] * row_bytes, from + i * row_bytes, row_bytes);
}

}  // namespace glmtune::ops
