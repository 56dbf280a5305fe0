#include "glmtune/ops/mla.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "glmtune/ops/cpu/common.h"
#include "glmtune/ops/cpu/mla_common.h"
#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/norm.h"

namespace glmtune::ops {
using namespace cpu_detail;
namespace {

// Shapes and dtypes shared by both attention paths; returns the document bounds. Every index is
// validated here, outside any parallel region (an exception must not escape an OpenMP loop).
std::vector<int64_t> plan_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& indices, const Tensor& cu_seqlens) {
  check_attention_qkv(q, k, v);
  return checked_document_bounds(indices, cu_seqlens, q.size(0), "mla attention");
}

// What both kernels read and write: q, k [T, heads, dqk], v and the output [T, heads, dv]
// (contiguous), the indices [T, width].
template <typename T>
struct AttentionOperands {
  int64_t tokens, heads, dqk, dv, width;
  const T* q;
  const T* k;
  const T* v;
  const int32_t* idx;
  T* o;

  AttentionOperands(const Tensor& q_t, const Tensor& k_t, const Tensor& v_t, const Tensor& idx_t,
                    Tensor& out)
      : tokens(q_t.size(0)),
        heads(q_t.size(1)),
        dqk(q_t.size(2)),
        dv(v_t.size(2)),
        width(idx_t.size(1)),
        q(q_t.data<T>()),
        k(k_t.data<T>()),
        v(v_t.data<T>()),
        idx(idx_t.data<int32_t>()),
        o(out.data<T>()) {}
};

template <typename T>
void sparse_kernel(const AttentionOperands<T>& a, T scale) {
  const auto [tokens, heads, dqk, dv, width, q, k, v, idx, o] = a;
  // Threads only pay off past a few hundred thousand multiply-adds.
  const bool parallel = tokens * width * heads * (dqk + dv) > (int64_t(1) << 18);
#pragma omp parallel if (parallel)
  {
    std::vector<int64_t> keys;
    std::vector<T> prob;
#pragma omp for schedule(dynamic, 16)
    for (int64_t i = 0; i < tokens; ++i) {
      visible_keys(idx + i * width, width, keys);
      const size_t n = keys.size();
      prob.resize(n);
      for (int64_t h = 0; h < heads; ++h) {
        T* oh = o + (i * heads + h) * dv;
        std::fill_n(oh, dv, T(0));
        if (n == 0) continue;  // no visible key: the output row stays 0
        const T* qh = q + (i * heads + h) * dqk;
        const T sum = softmax_numerators(qh, k, keys.data(), n, heads, h, dqk, scale, prob.data());
        // Normalise first, then weight the values: the reference's softmax-then-matmul order.
        for (size_t j = 0; j < n; ++j) {
          const T pj = prob[j] / sum;
          const T* vj = v + (keys[j] * heads + h) * dv;
          for (int64_t c = 0; c < dv; ++c) oh[c] += pj * vj[c];
        }
      }
    }
  }
}

template <typename T>
void dense_kernel(const AttentionOperands<T>& a, const std::vector<int64_t>& bounds, T scale) {
  const auto [tokens, heads, dqk, dv, width, q, k, v, idx, o] = a;
  for (size_t d = 0; d + 1 < bounds.size(); ++d) {
    const int64_t begin = bounds[d], len = bounds[d + 1] - begin;
    if (len == 0) continue;
    std::vector<char> mask(size_t(len * len), 0);
    for (int64_t i = 0; i < len; ++i)
      for (int64_t w = 0; w < width; ++w) {
        const int64_t j = idx[(begin + i) * width + w];
        if (j >= 0) mask[size_t(i * len + (j - begin))] = 1;
      }
    std::vector<T> scores(size_t(len * len));
    for (int64_t h = 0; h < heads; ++h) {
      gemm<T>(false, true, len, len, dqk, scale, q + (begin * heads + h) * dqk, heads * dqk,
              k + (begin * heads + h) * dqk, heads * dqk, T(0), scores.data(), len);
      for (int64_t i = 0; i < len; ++i) {
        T* row = scores.data() + i * len;
        const char* m = mask.data() + i * len;
        T mx = -std::numeric_limits<T>::infinity();
        for (int64_t j = 0; j < len; ++j)
          if (m[j]) mx = std::max(mx, row[j]);
        T sum = T(0);
        for (int64_t j = 0; j < len; ++j) {
          row[j] = m[j] ? std::exp(row[j] - mx) : T(0);
          sum += row[j];
        }
        for (int64_t j = 0; j < len; ++j) row[j] = sum > T(0) ? row[j] / sum : T(0);
      }
      gemm<T>(false, false, len, dv, len, T(1), scores.data(), len, v + (begin * heads + h) * dv,
              heads * dv, T(0), o + (begin * heads + h) * dv, heads * dv);
    }
  }
}

Tensor attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, const Tensor& indices,
                 const Tensor& cu_seqlens, double scale, bool dense) {
  const std::vector<int64_t> bounds = plan_attention(q_in, k_in, v_in, indices, cu_seqlens);
  const Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const Tensor idx = indices.contiguous();
  Tensor out = Tensor::zeros({q.size(0), q.size(1), v.size(2)}, q.dtype());
  if (q.size(0) == 0) return out;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const AttentionOperands<T> a(q, k, v, idx, out);
    if (dense)
      dense_kernel(a, bounds, T(scale));
    else
      sparse_kernel(a, T(scale));
  };
  if (q.dtype() == DType::f32)
    run(float());
  else
    run(double());
  return out;
}

}  // namespace

Tensor sparse_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& indices,
                        const Tensor& cu_seqlens, double scale) {
  check_attention_args(q, k, v, indices, nullptr, "sparse_attention");
  GLMTUNE_DISPATCH_CUDA(q, cuda_path::sparse_attention(q, k, v, indices, cu_seqlens, scale));
  return attention(q, k, v, indices, cu_seqlens, scale, /*dense=*/false);
}

Tensor dense_masked_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& indices, const Tensor& cu_seqlens, double scale) {
  GLMTUNE_CPU_ONLY("dense_masked_attention", q);
  check_attention_args(q, k, v, indices, nullptr, "dense_masked_attention");
  return attention(q, k, v, indices, cu_seqlens, scale, /*dense=*/true);
}

}  // namespace glmtune::ops
