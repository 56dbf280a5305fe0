#include "glmtune/ops/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <vector>

#include "glmtune/ops/checks.h"
#include "glmtune/ops/cpu/common.h"
#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/linear.h"

namespace glmtune::ops {
using namespace cpu_detail;
namespace {

// Labels widened to int64 and checked: −100 or a vocabulary row. A bad label comes from the data
// (or a vocabulary mismatch), so it is a glmtune::Error.
std::vector<int64_t> read_labels(const Tensor& labels, int64_t rows, int64_t vocab) {
  GLMTUNE_ASSERT(labels.defined() && labels.dim() == 1 && labels.size(0) == rows &&
                     labels.device().is_cpu() &&
                     (labels.dtype() == DType::i32 || labels.dtype() == DType::i64),
                 "cross-entropy labels must be a CPU int32/int64 vector of {} rows, got {}", rows,
                 describe(labels));
  const Tensor c = labels.contiguous();
  std::vector<int64_t> out(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t v =
        c.dtype() == DType::i32 ? int64_t(c.data<int32_t>()[i]) : c.data<int64_t>()[i];
    if (v != kIgnoreIndex && (v < 0 || v >= vocab))
      throw Error(fmt::format("label {} of row {} is neither {} nor a token id in [0, {})", v, i,
                              kIgnoreIndex, vocab),
                  "cross-entropy labels",
                  "labels must be token ids of the model's vocabulary, or -100 for positions "
                  "without a loss");
    out[size_t(i)] = v;
  }
  return out;
}

int64_t count_labels(const std::vector<int64_t>& labels) {
  return int64_t(
      std::count_if(labels.begin(), labels.end(), [](int64_t v) { return v != kIgnoreIndex; }));
}

CrossEntropyResult make_result(const CrossEntropyOptions& opts, int64_t n_tokens) {
  CrossEntropyResult r;
  r.n_tokens = n_tokens;
  r.denominator = opts.denominator > 0 ? opts.denominator : double(n_tokens);
  return r;
}

// The rows' losses added in row order. An OpenMP reduction combines the threads' partial sums in
// the order the threads finish, so with three or more threads the logged loss could change in its
// last bits from run to run; resume and layout comparisons need it to be a function of the data.
double sum_in_order(std::span<const double> values) {
  double total = 0;
  for (double v : values) total += v;
  return total;
}

// One row: returns −log softmax(z)[label]; when `grad` is given, writes
// coef · (softmax(z) − onehot(label)) into it (it may alias z: each entry is read before it is
// written). The log-sum-exp accumulates in double: V is up to ~155k terms.
template <typename T>
double row_loss(const T* z, int64_t vocab, int64_t label, double coef, T* grad) {
  T mx = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < vocab; ++j) mx = std::max(mx, z[j]);
  double sum = 0;
  for (int64_t j = 0; j < vocab; ++j) sum += std::exp(double(z[j]) - double(mx));
  const double lse = double(mx) + std::log(sum);
  const double loss = lse - double(z[label]);
  if (grad) {
    for (int64_t j = 0; j < vocab; ++j) grad[j] = T(coef * std::exp(double(z[j]) - lse));
    grad[label] -= T(coef);
  }
  return loss;
}

template <typename T>
double logits_pass(const Tensor& logits, const std::vector<int64_t>& labels, double coef,
                   Tensor* dlogits) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const T* z = logits.data<T>();
  T* g = dlogits ? dlogits->data<T>() : nullptr;
  std::vector<double> row(size_t(rows), 0.0);
#pragma omp parallel for schedule(static) if (rows * vocab > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t label = labels[size_t(r)];
    if (label == kIgnoreIndex) {
      if (g) std::fill_n(g + r * vocab, vocab, T(0));
      continue;
    }
    row[size_t(r)] = row_loss<T>(z + r * vocab, vocab, label, coef, g ? g + r * vocab : nullptr);
  }
  return sum_in_order(row);
}

template <typename T>
double fused_pass(const Tensor& hidden, const Tensor& weight, const std::vector<int64_t>& labels,
                  int64_t chunk_rows, double coef, Tensor* dhidden, Tensor* dweight, int64_t col0) {
  const int64_t dim = hidden.size(1), vocab = weight.size(0);
  const T* h = hidden.data<T>();
  const T* w = weight.data<T>();
  std::vector<int64_t> rows;
  for (size_t i = 0; i < labels.size(); ++i)
    if (labels[i] != kIgnoreIndex) rows.push_back(int64_t(i));
  const int64_t n = int64_t(rows.size());
  const int64_t chunk = std::max<int64_t>(1, std::min(chunk_rows, n));
  const bool want_grad = dhidden || dweight;
  std::vector<T> hc(size_t(chunk * dim)), z(size_t(chunk * vocab));
  std::vector<T> dh(dhidden ? size_t(chunk * dim) : 0);
  std::vector<double> row(size_t(chunk), 0.0);
  double total = 0;
  for (int64_t c0 = 0; c0 < n; c0 += chunk) {
    const int64_t m = std::min(chunk, n - c0);
    for (int64_t r = 0; r < m; ++r)
      std::copy_n(h + rows[size_t(c0 + r)] * dim, dim, hc.data() + r * dim);
    // z = h_c · W^T, then turned into its own gradient in place.
    gemm<T>(false, true, m, vocab, dim, T(1), hc.data(), dim, w, dim, T(0), z.data(), vocab);
#pragma omp parallel for schedule(static) if (m * vocab > 65536)
    for (int64_t r = 0; r < m; ++r)
      row[size_t(r)] =
          row_loss<T>(z.data() + r * vocab, vocab, labels[size_t(rows[size_t(c0 + r)])], coef,
                      want_grad ? z.data() + r * vocab : nullptr);
    total += sum_in_order(std::span<const double>(row.data(), size_t(m)));
    if (dhidden) {
      gemm<T>(false, false, m, dim, vocab, T(1), z.data(), vocab, w, dim, T(0), dh.data(), dim);
      T* out = dhidden->data<T>();
      for (int64_t r = 0; r < m; ++r)
        std::copy_n(dh.data() + r * dim, dim, out + rows[size_t(c0 + r)] * dim);
    }
    // Columns [col0, dim) only: the chunk's hidden read from column col0 on.
    if (dweight)
      gemm<T>(true, false, vocab, dim - col0, m, T(1), z.data(), vocab, hc.data() + col0, dim, T(1),
              dweight->data<T>(), dim - col0);
  }
  return total;
}

// The logits (a CPU [T, V] tensor in f32 or f64) checked and the labels read against them: the
// entry checks of cross_entropy_forward and cross_entropy_backward.
std::vector<int64_t> read_logits_labels(const Tensor& logits, const Tensor& labels) {
  GLMTUNE_ASSERT(logits.defined() && logits.dim() == 2 && logits.device().is_cpu() &&
                     is_compute_dtype(logits.dtype()),
                 "cross-entropy logits must be a CPU [T, V] tensor in f32 or f64, got {}",
                 describe(logits));
  return read_labels(labels, logits.size(0), logits.size(1));
}

}  // namespace

CrossEntropyResult cross_entropy_forward(const Tensor& logits, const Tensor& labels,
                                         const CrossEntropyOptions& opts) {
  GLMTUNE_CPU_ONLY("cross_entropy_forward", logits);
  const std::vector<int64_t> lab = read_logits_labels(logits, labels);
  CrossEntropyResult r = make_result(opts, count_labels(lab));
  const Tensor z = logits.contiguous();
  r.loss_sum = z.dtype() == DType::f32 ? logits_pass<float>(z, lab, 0, nullptr)
                                       : logits_pass<double>(z, lab, 0, nullptr);
  r.loss = r.denominator > 0 ? r.loss_sum / r.denominator : 0.0;
  return r;
}

Tensor cross_entropy_backward(const Tensor& logits, const Tensor& labels,
                              const CrossEntropyOptions& opts) {
  GLMTUNE_CPU_ONLY("cross_entropy_backward", logits);
  const std::vector<int64_t> lab = read_logits_labels(logits, labels);
  const CrossEntropyResult r = make_result(opts, count_labels(lab));
  const double coef = r.denominator > 0 ? opts.grad_scale / r.denominator : 0.0;
  const Tensor z = logits.contiguous();
  Tensor grad = Tensor::empty(z.shape(), z.dtype());
  if (z.dtype() == DType::f32)
    logits_pass<float>(z, lab, coef, &grad);
  else
    logits_pass<double>(z, lab, coef, &grad);
  return grad;
}

CrossEntropyResult lm_head_cross_entropy(const Tensor& hidden_in, const Tensor& weight_in,
                                         const Tensor& labels, const CrossEntropyOptions& opts,
                                         Tensor* dhidden, Tensor* dweight) {
  const char* op = "lm_head_cross_entropy";
  GLMTUNE_ASSERT(hidden_in.defined() && hidden_in.dim() == 2, "{}: hidden {} must be [T, D]", op,
                 describe(hidden_in));
  checks::linear_args(hidden_in, weight_in, Tensor(), op);
  GLMTUNE_ASSERT(labels.defined() && labels.dim() == 1 && labels.size(0) == hidden_in.size(0),
                 "{}: labels {} must be a vector of hidden {}'s {} rows", op, describe(labels),
                 hidden_in.str(), hidden_in.size(0));
  GLMTUNE_ASSERT(opts.chunk_rows > 0, "{}: chunk_rows must be positive, got {}", op,
                 opts.chunk_rows);
  const int64_t col0 = opts.weight_grad_col0;
  GLMTUNE_ASSERT(col0 >= 0 && col0 < hidden_in.size(1),
                 "{}: weight_grad_col0 {} must be a column of hidden {}", op, col0,
                 hidden_in.str());
  if (dhidden && dhidden->defined())
    checks::same_shape(*dhidden, hidden_in, "dhidden", "hidden", op);
  dweight = grad_if_trained(dweight, weight_in);
  const Shape dweight_shape = {weight_in.size(0), weight_in.size(1) - col0};
  if (dweight && dweight->defined())
    GLMTUNE_ASSERT(dweight->shape() == dweight_shape,
                   "{}: dweight {} must be {} (the head weight {} from column {})", op,
                   dweight->str(), shape_str(dweight_shape), weight_in.str(), col0);
  GLMTUNE_DISPATCH_CUDA(hidden_in, cuda_path::lm_head_cross_entropy(hidden_in, weight_in, labels,
                                                                    opts, dhidden, dweight));
  GLMTUNE_ASSERT(is_compute_dtype(hidden_in.dtype()) && weight_in.dtype() == hidden_in.dtype(),
                 "{}: the CPU takes hidden {} and weight {} in one of f32 and f64", op,
                 hidden_in.str(), weight_in.str());
  const int64_t rows = hidden_in.size(0), dim = hidden_in.size(1), vocab = weight_in.size(0);
  const std::vector<int64_t> lab = read_labels(labels, rows, vocab);
  CrossEntropyResult r = make_result(opts, count_labels(lab));
  const double coef = r.denominator > 0 ? opts.grad_scale / r.denominator : 0.0;
  if (dhidden) {
    // Ignored rows never reach the chunks; their gradient is 0.
    if (!dhidden->defined()) *dhidden = Tensor::empty({rows, dim}, hidden_in.dtype());
    GLMTUNE_ASSERT(dhidden->shape() == hidden_in.shape() && dhidden->dtype() == hidden_in.dtype() &&
                       dhidden->is_contiguous() && dhidden->device().is_cpu(),
                   "dhidden {} must be a contiguous CPU tensor like hidden {}", dhidden->str(),
                   hidden_in.str());
    dhidden->zero_();
  }
  if (dweight) {
    if (!dweight->defined()) *dweight = Tensor::zeros(dweight_shape, weight_in.dtype());
    GLMTUNE_ASSERT(dweight->shape() == dweight_shape && dweight->dtype() == weight_in.dtype() &&
                       dweight->is_contiguous() && dweight->device().is_cpu(),
                   "dweight {} must be a contiguous CPU tensor like the weight {}", dweight->str(),
                   weight_in.str());
  }
  const Tensor hidden = hidden_in.contiguous(), weight = weight_in.contiguous();
  r.loss_sum =
      hidden.dtype() == DType::f32
          ? fused_pass<float>(hidden, weight, lab, opts.chunk_rows, coef, dhidden, dweight, col0)
          : fused_pass<double>(hidden, weight, lab, opts.chunk_rows, coef, dhidden, dweight, col0);
  r.loss = r.denominator > 0 ? r.loss_sum / r.denominator : 0.0;
  return r;
}

}  // namespace glmtune::ops
