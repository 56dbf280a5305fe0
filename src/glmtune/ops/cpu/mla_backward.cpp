// Backward of the sparse NoPE MLA (ops/mla.h): o_proj, the sparse attention over each query's
// selected keys (gather for the forward quantities, scatter-add into the keys' and values'
// gradients), kv_b_proj, both RMSNorms and the a/b projections. The indexer is not differentiated.

#include <algorithm>
#include <vector>

#include "glmtune/ops/cpu/common.h"
#include "glmtune/ops/cpu/mla_common.h"
#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/mla.h"
#include "glmtune/ops/norm.h"

namespace glmtune::ops {
using namespace cpu_detail;
namespace {

// Per query, its visible keys as a sorted set (CSR): the forward's union semantics, so a repeated
// entry contributes once. Validates every entry against the query's document, outside any
// parallel region.
struct KeySets {
  std::vector<int64_t> start;
  std::vector<int64_t> keys;
};

KeySets key_sets(const Tensor& indices, const Tensor& cu_seqlens, int64_t tokens) {
  const std::vector<int64_t> bounds =
      checked_document_bounds(indices, cu_seqlens, tokens, "mla attention backward");
  const Tensor idx_t = indices.contiguous();
  const int32_t* idx = idx_t.data<int32_t>();
  const int64_t width = indices.size(1);
  KeySets s;
  s.start.assign(size_t(tokens) + 1, 0);
  s.keys.reserve(size_t(tokens * std::min<int64_t>(width, 64)));
  std::vector<int64_t> row;
  for (size_t d = 0; d + 1 < bounds.size(); ++d) {
    for (int64_t i = bounds[d]; i < bounds[d + 1]; ++i) {
      visible_keys(idx + i * width, width, row);
      s.keys.insert(s.keys.end(), row.begin(), row.end());
      s.start[size_t(i) + 1] = int64_t(s.keys.size());
    }
  }
  return s;
}

// For one head the backward of o_i = Σ_j p_ij v_j, p_i = softmax_j(scale · q_i·k_j):
//   dp_ij = dO_i·v_j,  ds_ij = p_ij (dp_ij − Σ_l p_il dp_il),
//   dq_i = scale Σ_j ds_ij k_j,  dk_j += scale ds_ij q_i,  dv_j += p_ij dO_i.
// Heads run in parallel: the rows a head writes in dk and dv belong to it alone, so the
// scatter-add over queries needs no synchronisation.
template <typename T>
void attention_backward_kernel(const Tensor& q_t, const Tensor& k_t, const Tensor& v_t,
                               const Tensor& do_t, const KeySets& sets, T scale,
                               AttentionGrads& g) {
  const int64_t tokens = q_t.size(0), heads = q_t.size(1), dqk = q_t.size(2), dv = v_t.size(2);
  const T* q = q_t.data<T>();
  const T* k = k_t.data<T>();
  const T* v = v_t.data<T>();
  const T* dout = do_t.data<T>();
  T* dq = g.q.data<T>();
  T* dk = g.k.data<T>();
  T* dvp = g.v.data<T>();
  const bool parallel =
      heads > 1 && int64_t(sets.keys.size()) * heads * (dqk + dv) > (int64_t(1) << 18);
#pragma omp parallel if (parallel)
  {
    std::vector<T> prob, dprob;
#pragma omp for schedule(static)
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < tokens; ++i) {
        const int64_t* keys = sets.keys.data() + sets.start[size_t(i)];
        const size_t n = size_t(sets.start[size_t(i) + 1] - sets.start[size_t(i)]);
        if (n == 0) continue;  // the forward wrote 0 here: no dependence on anything
        const T* qh = q + (i * heads + h) * dqk;
        const T* doh = dout + (i * heads + h) * dv;
        prob.resize(n);
        dprob.resize(n);
        const T sum = softmax_numerators(qh, k, keys, n, heads, h, dqk, scale, prob.data());
        T row_dot = T(0);
        for (size_t j = 0; j < n; ++j) {
          prob[j] /= sum;
          const T* vj = v + (keys[j] * heads + h) * dv;
          T dot = T(0);
          for (int64_t c = 0; c < dv; ++c) dot += doh[c] * vj[c];
          dprob[j] = dot;
          row_dot += prob[j] * dot;
        }
        T* dqh = dq + (i * heads + h) * dqk;
        for (size_t j = 0; j < n; ++j) {
          const T ds = prob[j] * (dprob[j] - row_dot) * scale;
          const T* kj = k + (keys[j] * heads + h) * dqk;
          T* dkj = dk + (keys[j] * heads + h) * dqk;
          for (int64_t c = 0; c < dqk; ++c) {
            dqh[c] += ds * kj[c];
            dkj[c] += ds * qh[c];
          }
          T* dvj = dvp + (keys[j] * heads + h) * dv;
          for (int64_t c = 0; c < dv; ++c) dvj[c] += prob[j] * doh[c];
        }
      }
    }
  }
}

}  // namespace

AttentionGrads sparse_attention_backward(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                         const Tensor& indices, const Tensor& cu_seqlens,
                                         double scale, const Tensor& dout) {
  check_attention_args(q_in, k_in, v_in, indices, &dout, "sparse_attention_backward");
  GLMTUNE_DISPATCH_CUDA(q_in, cuda_path::sparse_attention_backward(q_in, k_in, v_in, indices,
                                                                   cu_seqlens, scale, dout));
  check_attention_qkv(q_in, k_in, v_in);
  GLMTUNE_ASSERT(dout.dtype() == v_in.dtype(), "attention output gradient {} must match v {}",
                 dout.str(), v_in.str());
  const KeySets sets = key_sets(indices, cu_seqlens, q_in.size(0));
  const Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const Tensor d = dout.contiguous();
  AttentionGrads g{Tensor::zeros(q.shape(), q.dtype()), Tensor::zeros(k.shape(), k.dtype()),
                   Tensor::zeros(v.shape(), v.dtype())};
  if (q.size(0) == 0) return g;
  if (q.dtype() == DType::f32)
    attention_backward_kernel<float>(q, k, v, d, sets, float(scale), g);
  else
    attention_backward_kernel<double>(q, k, v, d, sets, scale, g);
  return g;
}

}  // namespace glmtune::ops
