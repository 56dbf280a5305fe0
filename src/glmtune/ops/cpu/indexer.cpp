#include "glmtune/ops/indexer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <tuple>
#include <vector>

#include "glmtune/ops/cpu/common.h"
#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/norm.h"

namespace glmtune::ops {
using namespace cpu_detail;
namespace {

// The reference's LayerNorm for the indexer keys hard-codes this eps (not rms_norm_eps).
constexpr double kKeyNormEps = 1e-6;
// Queries scored per block: bounds the [block, pools] score buffer for long documents while
// keeping the per-head products large enough for BLAS.
constexpr int64_t kQueryBlock = 256;

// The indexer's parameters, their shapes for the config and the input width, named as released.
std::vector<std::tuple<const Tensor*, Shape, const char*>> indexer_param_shapes(
    const IndexerConfig& cfg, const IndexerParams& params, int64_t dim, int64_t rank) {
  const int64_t id = cfg.head_dim, ih = cfg.n_heads;
  return {{&params.wq_b.weight, {ih * id, rank}, "wq_b.weight"},
          {&params.wk.weight, {id, dim}, "wk.weight"},
          {&params.k_norm_weight, {id}, "k_norm.weight"},
          {&params.k_norm_bias, {id}, "k_norm.bias"},
          {&params.weights_proj.weight, {ih, dim}, "weights_proj.weight"},
          {&params.kpool_ape, {cfg.kpool, id}, "index_kpool_compress_ape"},
          {&params.kpool_gate, {id, dim}, "index_kpool_compress_gate"}};
}

// Before dispatch (ops/checks.h): the config, x [T, D], q_resid [T, Rq] and every parameter's
// shape, on x's device. The dtypes and the document offsets are the bodies'.
void check_indexer_args(const IndexerConfig& cfg, const IndexerParams& params, const Tensor& x,
                        const Tensor& q_resid) {
  const char* op = "indexer_forward";
  GLMTUNE_ASSERT(cfg.n_heads > 0 && cfg.head_dim > 0 && cfg.kpool > 0 && cfg.topk > 0 &&
                     cfg.topk % cfg.kpool == 0,
                 "indexer config: heads {}, head dim {}, pool {}, topk {} (topk must be a "
                 "positive multiple of the pool)",
                 cfg.n_heads, cfg.head_dim, cfg.kpool, cfg.topk);
  GLMTUNE_ASSERT(x.defined() && x.dim() == 2, "{}: input {} must be [T, D]", op, describe(x));
  GLMTUNE_ASSERT(x.size(0) < int64_t(std::numeric_limits<int32_t>::max()),
                 "{}: a pack of {} tokens does not fit int32 indices", op, x.size(0));
  GLMTUNE_ASSERT(q_resid.defined() && q_resid.dim() == 2 && q_resid.size(0) == x.size(0) &&
                     q_resid.device() == x.device(),
                 "{}: q_resid {} does not match input {}", op, describe(q_resid), x.str());
  for (const auto& [t, shape, name] : indexer_param_shapes(cfg, params, x.size(1), q_resid.size(1)))
    GLMTUNE_ASSERT(t->defined() && t->shape() == shape && t->device() == x.device(),
                   "{}: parameter {} must be {} on the device of x {}, got {}", op, name,
                   shape_str(shape), x.str(), describe(*t));
}

template <typename T>
void indexer_kernel(const IndexerConfig& cfg, const IndexerParams& params, const Tensor& x,
                    const Tensor& q_resid, const std::vector<int64_t>& bounds, Tensor& out) {
  const int64_t n_heads = cfg.n_heads, head_dim = cfg.head_dim, pool = cfg.kpool;
  const int64_t width = out.size(1);
  const bool tail = cfg.always_select_tail && pool > 1;

  // Projections over the whole pack: they are per-token, so documents do not interact here.
  const Tensor q_t = linear(q_resid, params.wq_b.weight);  // [T, IH·ID]
  const Tensor k_t =
      layer_norm(linear(x, params.wk.weight), params.k_norm_weight, params.k_norm_bias,
                 kKeyNormEps);                               // [T, ID]
  const Tensor g_t = linear(x, params.kpool_gate);           // [T, ID]
  const Tensor w_t = linear(x, params.weights_proj.weight);  // [T, IH]
  const Tensor ape_t = params.kpool_ape.contiguous();
  const T* q = q_t.data<T>();
  const T* k = k_t.data<T>();
  const T* g = g_t.data<T>();
  const T* hw = w_t.data<T>();
  const T* ape = ape_t.data<T>();
  int32_t* o = out.data<int32_t>();

  const T score_scale = T(1) / std::sqrt(T(head_dim));
  const T head_scale = T(1) / std::sqrt(T(n_heads));
  const int64_t q_stride = n_heads * head_dim;

  for (size_t doc = 0; doc + 1 < bounds.size(); ++doc) {
    const int64_t begin = bounds[doc], len = bounds[doc + 1] - begin;
    if (len == 0) continue;
    // Only complete pools exist for a document alone: the reference drops pools that are invalid
    // in every batch row, and with no padding those are exactly the pools running past the end.
    const int64_t n_pools = len / pool;
    const int64_t select_k = std::min(cfg.topk / pool, n_pools);

    // Pooled keys K̄ [n_pools, ID]: a softmax over the P slots per channel (fp32 in the
    // reference, here the compute dtype), then the weighted sum of the slot keys.
    std::vector<T> pooled(size_t(n_pools * head_dim));
#pragma omp parallel for schedule(static) if (n_pools * pool * head_dim > 65536)
    for (int64_t p = 0; p < n_pools; ++p) {
      const int64_t first = begin + p * pool;
      for (int64_t d = 0; d < head_dim; ++d) {
        T mx = -std::numeric_limits<T>::infinity();
        for (int64_t j = 0; j < pool; ++j)
          mx = std::max(mx, g[(first + j) * head_dim + d] + ape[j * head_dim + d]);
        T sum = T(0);
        for (int64_t j = 0; j < pool; ++j)
          sum += std::exp(g[(first + j) * head_dim + d] + ape[j * head_dim + d] - mx);
        T acc = T(0);
        for (int64_t j = 0; j < pool; ++j) {
          const T rho = std::exp(g[(first + j) * head_dim + d] + ape[j * head_dim + d] - mx) / sum;
          acc += rho * k[(first + j) * head_dim + d];
        }
        pooled[size_t(p * head_dim + d)] = acc;
      }
    }

    std::vector<T> scores, head_scores;
    for (int64_t s0 = 0; s0 < len; s0 += kQueryBlock) {
      const int64_t rows = std::min(kQueryBlock, len - s0);
      // Pools any query of the block can select: those ending at or before its last query.
      const int64_t n_cand = (s0 + rows) / pool;
      if (n_cand > 0) {
        scores.assign(size_t(rows * n_cand), T(0));
        head_scores.resize(size_t(rows * n_cand));
        for (int64_t h = 0; h < n_heads; ++h) {
          // (q_h · K̄_p) · ID^-1/2 for the whole block, then relu and the per-token head weight.
          gemm<T>(false, true, rows, n_cand, head_dim, score_scale,
                  q + (begin + s0) * q_stride + h * head_dim, q_stride, pooled.data(), head_dim,
                  T(0), head_scores.data(), n_cand);
#pragma omp parallel for schedule(static) if (rows * n_cand > 65536)
          for (int64_t r = 0; r < rows; ++r) {
            const T wh = hw[(begin + s0 + r) * n_heads + h] * head_scale;
            T* sr = scores.data() + r * n_cand;
            const T* hr = head_scores.data() + r * n_cand;
            for (int64_t p = 0; p < n_cand; ++p) sr[p] += wh * std::max(hr[p], T(0));
          }
        }
      }
#pragma omp parallel if (rows * (n_cand + pool) > 16384)
      {
        std::vector<int64_t> order;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t s = s0 + r;
          int32_t* row = o + (begin + s) * width;
          // A pool is a candidate once its last token is visible: complete and fully past.
          const int64_t cand = (s + 1) / pool;
          const int64_t chosen = std::min(select_k, cand);
          if (chosen > 0) {
            const T* sr = scores.data() + r * n_cand;
            order.resize(size_t(cand));
            std::iota(order.begin(), order.end(), int64_t(0));
            std::partial_sort(
                order.begin(), order.begin() + chosen, order.end(),
                [&](int64_t a, int64_t b) { return ranks_before(sr[a], a, sr[b], b); });
            for (int64_t i = 0; i < chosen; ++i)
              for (int64_t j = 0; j < pool; ++j)
                row[i * pool + j] = int32_t(begin + order[size_t(i)] * pool + j);
          }
          if (tail) {
            // Tokens of the query's own unfinished pool, the query included; empty when s closes
            // its pool (that pool is then a candidate like any other).
            const int64_t visible = s + 1, in_tail = visible % pool;
            for (int64_t t = 0; t < in_tail; ++t)
              row[select_k * pool + t] = int32_t(begin + visible - in_tail + t);
          }
        }
      }
    }
  }
}

}  // namespace

int64_t indexer_width(const IndexerConfig& cfg) {
  return cfg.topk + (cfg.always_select_tail ? cfg.kpool - 1 : 0);
}

std::vector<int64_t> read_cu_seqlens(const Tensor& cu_seqlens, int64_t tokens, const char* op) {
  // A malformed table would make documents overlap or read past the pack: reject it, naming the
  // op and the offending entry (the same contract as the KDA ops, so one table serves all).
  if (!cu_seqlens.defined() || cu_seqlens.dim() != 1 || cu_seqlens.size(0) < 2 ||
      (cu_seqlens.dtype() != DType::i32 && cu_seqlens.dtype() != DType::i64) ||
      !cu_seqlens.device().is_cpu())
    throw Error(fmt::format("cu_seqlens must be a CPU int32/int64 vector [ndoc + 1], got {}",
                            describe(cu_seqlens)),
                op, "pass the pack's document offsets: [0, end of doc 0, ..., T]");
  const Tensor c = cu_seqlens.contiguous();
  std::vector<int64_t> bounds(size_t(c.size(0)));
  for (size_t i = 0; i < bounds.size(); ++i)
    bounds[i] = c.dtype() == DType::i32 ? int64_t(c.data<int32_t>()[i]) : c.data<int64_t>()[i];
  if (bounds.front() != 0 || bounds.back() != tokens)
    throw Error(fmt::format("cu_seqlens runs from {} to {} but the pack has {} tokens",
                            bounds.front(), bounds.back(), tokens),
                op, "cu_seqlens must start at 0 and end at the number of tokens");
  for (size_t i = 1; i < bounds.size(); ++i)
    if (bounds[i] < bounds[i - 1])
      throw Error(fmt::format("cu_seqlens decreases at entry {} ({} after {})", i, bounds[i],
                              bounds[i - 1]),
                  op, "document offsets must be non-decreasing");
  return bounds;
}

Tensor indexer_forward(const IndexerConfig& cfg, const IndexerParams& params, const Tensor& x,
                       const Tensor& q_resid, const Tensor& cu_seqlens) {
  check_indexer_args(cfg, params, x, q_resid);
  GLMTUNE_DISPATCH_CUDA(x, cuda_path::indexer_forward(cfg, params, x, q_resid, cu_seqlens));
  const DType dt = x.dtype();
  GLMTUNE_ASSERT(dt == DType::f32 || dt == DType::f64,
                 "the CPU indexer computes in f32 or f64, got input {}", x.str());
  GLMTUNE_ASSERT(q_resid.dtype() == dt, "indexer q_resid {} must have the dtype of input {}",
                 q_resid.str(), x.str());
  for (const auto& [t, shape, name] : indexer_param_shapes(cfg, params, x.size(1), q_resid.size(1)))
    GLMTUNE_ASSERT(t->dtype() == dt, "indexer parameter {} must have the dtype of input {}, got {}",
                   name, x.str(), t->str());
  const std::vector<int64_t> bounds = read_cu_seqlens(cu_seqlens, x.size(0), "indexer");

  Tensor out = Tensor::full({x.size(0), indexer_width(cfg)}, -1.0, DType::i32);
  if (x.size(0) == 0) return out;
  if (dt == DType::f32)
    indexer_kernel<float>(cfg, params, x, q_resid, bounds, out);
  else
    indexer_kernel<double>(cfg, params, x, q_resid, bounds, out);
  return out;
}

}  // namespace glmtune::ops
