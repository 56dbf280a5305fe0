// The KPool DSA indexer on the GPU (ops/cuda/indexer.h).

#include <algorithm>
#include <cmath>

#include "glmtune/ops/cuda/common.cuh"
#include "glmtune/ops/cuda/gemm.h"
#include "glmtune/ops/cuda/grouped_gemm.h"
#include "glmtune/ops/cuda/indexer.h"

namespace glmtune::cuda {
namespace {

using detail::bf16;

constexpr int kThreads = 256;
constexpr int kSelectThreads = 512;
// The reference's LayerNorm for the indexer keys hard-codes this eps (not rms_norm_eps).
constexpr float kKeyNormEps = 1e-6f;
constexpr int64_t kMaxPools = 16384;
// Bound on one block's [queries · heads, candidates] fp32 product buffer (elements).
constexpr int64_t kProductBudget = int64_t(1) << 26;

// In-place LayerNorm of fp32 rows of length n (one warp per row), affine with weight and bias in
// the parameters' storage P (bf16, or f32 in the fp32 mode).
template <typename P>
__global__ void layer_norm_f32_kernel(float* __restrict__ x, int64_t rows, int n,
                                      const P* __restrict__ w, const P* __restrict__ b, float eps) {
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  float* xr = x + row * n;
  float sum = 0.0f;
  for (int j = lane; j < n; j += 32) sum += xr[j];
  const float mean = detail::warp_sum(sum) / float(n);
  float sq = 0.0f;
  for (int j = lane; j < n; j += 32) sq += (xr[j] - mean) * (xr[j] - mean);
  const float rstd = 1.0f / sqrtf(detail::warp_sum(sq) / float(n) + eps);
  for (int j = lane; j < n; j += 32)
    xr[j] = (xr[j] - mean) * rstd * detail::to_f(w[j]) + detail::to_f(b[j]);
}

// K̄[gp, d] = Σ_j softmax_j(g[first + j, d] + ape[j, d]) · k[first + j, d]: one thread per
// (pool, channel), in the CPU op's order (max, sum of exponentials, weighted sum).
template <typename P>
__global__ void pool_kernel(const float* __restrict__ g, const float* __restrict__ k,
                            const P* __restrict__ ape, const int32_t* __restrict__ pool_first,
                            int64_t n_pools, int pool, int dim, float* __restrict__ pooled) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_pools * dim) return;
  const int64_t gp = i / dim;
  const int d = int(i % dim);
  const int64_t first = pool_first[gp];
  float mx = -INFINITY;
  for (int j = 0; j < pool; ++j)
    mx = fmaxf(mx, g[(first + j) * dim + d] + detail::to_f(ape[j * dim + d]));
  float sum = 0.0f;
  for (int j = 0; j < pool; ++j)
    sum += expf(g[(first + j) * dim + d] + detail::to_f(ape[j * dim + d]) - mx);
  float acc = 0.0f;
  for (int j = 0; j < pool; ++j) {
    const float rho = expf(g[(first + j) * dim + d] + detail::to_f(ape[j * dim + d]) - mx) / sum;
    acc += rho * k[(first + j) * dim + d];
  }
  pooled[i] = acc;
}

// scores[r, p] = Σ_h (w[s, h] · head_scale) · relu(products[r·IH + h, p]), heads in order.
__global__ void head_sum_kernel(const float* __restrict__ products, const float* __restrict__ hw,
                                int64_t rows, int heads, int64_t n_cand, float head_scale,
                                float* __restrict__ scores) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * n_cand) return;
  const int64_t r = i / n_cand, p = i % n_cand;
  float acc = 0.0f;
  for (int h = 0; h < heads; ++h) {
    const float wh = hw[r * heads + h] * head_scale;
    acc += wh * fmaxf(products[(r * heads + h) * n_cand + p], 0.0f);
  }
  scores[i] = acc;
}

// The scoring GEMM's fp32 operands as TF32 parts side by side along k: a row of A (queries)
// becomes [hi | hi | lo], a row of B (pools) [hi | lo | hi], so one TF32 GEMM over 3k sums
// hi·hi + hi·lo + lo·hi of every product. hi is the value rounded to TF32 (11 significant bits),
// lo the exact rest, which the tensor cores round to TF32 in turn: with the lo·lo term left out,
// each product is within about 2^-20 of its fp32 value, the size of the rounding of a differently
// ordered fp32 sum over k = 128, at the tensor cores' rate.
__global__ void tf32_parts_kernel(const float* __restrict__ in, int64_t rows, int k, bool a_side,
                                  float* __restrict__ out) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= rows * k) return;
  const int64_t r = i / k;
  const int c = int(i - r * k);
  const float x = in[i];
  uint32_t bits;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bits) : "f"(x));
  const float hi = __uint_as_float(bits), lo = x - hi;
  float* o = out + r * 3 * k + c;
  o[0] = hi;
  o[k] = a_side ? hi : lo;
  o[2 * k] = a_side ? lo : hi;
}

// A key whose ascending order is the CPU op's ranking: NaN first, larger scores next, equal
// scores by ascending pool (±0 are one value, as `==` says).
__device__ __forceinline__ unsigned long long rank_key(float v, int64_t pool) {
  uint32_t desc = 0;
  if (!isnan(v)) {
    if (v == 0.0f) v = 0.0f;
    const uint32_t bits = __float_as_uint(v);
    const uint32_t asc = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    desc = ~asc;
  }
  return (static_cast<unsigned long long>(desc) << 32) | static_cast<unsigned long long>(pool);
}

struct SelectArgs {
  const float* scores;  // [rows, n_cand] of this block
  int64_t n_cand;
  int64_t s0;     // document-local position of the block's first query
  int64_t begin;  // document start in the pack
  int pool, select_k, width, n2;
  bool tail;
  int32_t* out;  // rows of the block's first query
};

// One block per query: bitonic sort of its candidates' keys in shared memory, then its row.
__global__ void __launch_bounds__(kSelectThreads) select_kernel(SelectArgs a) {
  extern __shared__ unsigned long long keys[];
  const int64_t r = blockIdx.x, s = a.s0 + r;
  const int64_t cand = (s + 1) / a.pool;
  const float* sr = a.scores + r * a.n_cand;
  for (int i = threadIdx.x; i < a.n2; i += blockDim.x)
    keys[i] = i < cand ? rank_key(sr[i], i) : ~0ull;
  __syncthreads();
  for (int size = 2; size <= a.n2; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < a.n2; i += blockDim.x) {
        const int partner = i ^ stride;
        if (partner > i) {
          const bool ascending = (i & size) == 0;
          const unsigned long long ki = keys[i], kp = keys[partner];
          if ((ki > kp) == ascending) {
            keys[i] = kp;
            keys[partner] = ki;
          }
        }
      }
      __syncthreads();
    }
  }
  int32_t* row = a.out + r * a.width;
  const int64_t chosen = cand < a.select_k ? cand : a.select_k;
  for (int64_t i = threadIdx.x; i < chosen * a.pool; i += blockDim.x) {
    const int64_t pool_id = int64_t(keys[i / a.pool] & 0xffffffffull);
    row[i] = int32_t(a.begin + pool_id * a.pool + i % a.pool);
  }
  if (a.tail) {
    // The query's own unfinished pool, the query included; empty when s closes its pool.
    const int64_t visible = s + 1, in_tail = visible % a.pool;
    for (int64_t t = threadIdx.x; t < in_tail; t += blockDim.x)
      row[int64_t(a.select_k) * a.pool + t] = int32_t(a.begin + visible - in_tail + t);
  }
}

unsigned blocks_for(int64_t n, int threads = kThreads) {
  return unsigned((n + threads - 1) / threads);
}

// Every parameter shares x's dtype.
void check_param(const Tensor& t, const Shape& shape, const Tensor& x, const char* name) {
  GLMTUNE_CUDA_OP_REQUIRE(t.defined() && t.dtype() == x.dtype() && t.is_contiguous() &&
                              t.device() == x.device() && t.shape() == shape,
                          std::string("cuda::indexer_forward: parameter ") + name + " " +
                              detail::describe(t) + " must be contiguous " +
                              std::string(dtype_name(x.dtype())) + " (x's dtype) of shape " +
                              shape_str(shape) + " on " + x.device().str());
}

int next_pow2(int64_t n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

}  // namespace

Tensor indexer_forward(const ops::IndexerConfig& cfg, const ops::IndexerParams& params,
                       const Tensor& x, const Tensor& q_resid, const Tensor& cu_seqlens,
                       cudaStream_t stream) {
  GLMTUNE_CUDA_OP_REQUIRE(cfg.n_heads > 0 && cfg.head_dim > 0 && cfg.kpool > 0 && cfg.topk > 0 &&
                              cfg.topk % cfg.kpool == 0,
                          "cuda::indexer_forward: topk must be a positive multiple of the pool");
  GLMTUNE_CUDA_OP_REQUIRE(
      x.defined() && x.dim() == 2 && (x.dtype() == DType::bf16 || x.dtype() == DType::f32) &&
          x.is_contiguous() && x.device().is_cuda(),
      "cuda::indexer_forward: x must be contiguous bf16 or f32 [T, D] on the GPU, got " +
          detail::describe(x));
  const Device dev = x.device();
  const int64_t tokens = x.size(0), dim = x.size(1);
  GLMTUNE_CUDA_OP_REQUIRE(q_resid.defined() && q_resid.dim() == 2 && q_resid.size(0) == tokens &&
                              q_resid.dtype() == x.dtype() && q_resid.is_contiguous() &&
                              q_resid.device() == dev,
                          "cuda::indexer_forward: q_resid " + detail::describe(q_resid) +
                              " must be contiguous [T, Rq] of x's dtype");
  const int64_t ih = cfg.n_heads, id = cfg.head_dim, pool = cfg.kpool;
  check_param(params.wq_b.weight, {ih * id, q_resid.size(1)}, x, "wq_b.weight");
  check_param(params.wk.weight, {id, dim}, x, "wk.weight");
  check_param(params.k_norm_weight, {id}, x, "k_norm.weight");
  check_param(params.k_norm_bias, {id}, x, "k_norm.bias");
  check_param(params.weights_proj.weight, {ih, dim}, x, "weights_proj.weight");
  check_param(params.kpool_ape, {pool, id}, x, "index_kpool_compress_ape");
  check_param(params.kpool_gate, {id, dim}, x, "index_kpool_compress_gate");
  const std::vector<int64_t> bounds = ops::read_cu_seqlens(cu_seqlens, tokens, "cuda indexer");
  GLMTUNE_CUDA_OP_REQUIRE(tokens < int64_t(INT32_MAX), "cuda::indexer_forward: pack too long");
  detail::DeviceGuard guard(dev.index);

  const int64_t width = ops::indexer_width(cfg);
  Tensor out = Tensor::empty({tokens, width}, DType::i32, dev);
  if (tokens == 0) return out;
  // Every byte 0xFF: −1 in every slot the selection does not write.
  GLMTUNE_CUDA_CHECK(cudaMemsetAsync(out.data_ptr(), 0xFF, size_t(out.nbytes()), stream));
  const bool tail = cfg.always_select_tail && pool > 1;

  // Per-token projections in fp32 over the whole pack.
  const Tensor q = linear(q_resid, params.wq_b.weight, Tensor(), DType::f32, stream);  // [T, IH·ID]
  Tensor k = linear(x, params.wk.weight, Tensor(), DType::f32, stream);                // [T, ID]
  const bool f32_params = x.dtype() == DType::f32;
  if (f32_params)
    layer_norm_f32_kernel<<<blocks_for(tokens * 32), kThreads, 0, stream>>>(
        k.data<float>(), tokens, int(id), params.k_norm_weight.data<float>(),
        params.k_norm_bias.data<float>(), kKeyNormEps);
  else
    layer_norm_f32_kernel<<<blocks_for(tokens * 32), kThreads, 0, stream>>>(
        k.data<float>(), tokens, int(id), static_cast<const bf16*>(params.k_norm_weight.data_ptr()),
        static_cast<const bf16*>(params.k_norm_bias.data_ptr()), kKeyNormEps);
  GLMTUNE_CUDA_CHECK_LAUNCH();
  const Tensor g = linear(x, params.kpool_gate, Tensor(), DType::f32, stream);            // [T, ID]
  const Tensor hw = linear(x, params.weights_proj.weight, Tensor(), DType::f32, stream);  // [T, IH]

  // Complete pools of every document, numbered across the pack.
  std::vector<int32_t> pool_first;
  std::vector<int64_t> pool_base(bounds.size(), 0);
  for (size_t doc = 0; doc + 1 < bounds.size(); ++doc) {
    pool_base[doc] = int64_t(pool_first.size());
    const int64_t n_pools = (bounds[doc + 1] - bounds[doc]) / pool;
    GLMTUNE_CUDA_OP_REQUIRE(n_pools <= kMaxPools,
                            "cuda::indexer_forward: a document of " +
                                std::to_string(bounds[doc + 1] - bounds[doc]) +
                                " tokens has more than " + std::to_string(kMaxPools) + " pools");
    for (int64_t p = 0; p < n_pools; ++p) pool_first.push_back(int32_t(bounds[doc] + p * pool));
  }
  const int64_t total_pools = int64_t(pool_first.size());
  Tensor pooled = Tensor::empty({std::max<int64_t>(total_pools, 1), id}, DType::f32, dev);
  if (total_pools > 0) {
    const Tensor first = detail::device_i32(pool_first, dev);
    if (f32_params)
      pool_kernel<<<blocks_for(total_pools * id), kThreads, 0, stream>>>(
          g.data<float>(), k.data<float>(), params.kpool_ape.data<float>(), first.data<int32_t>(),
          total_pools, int(pool), int(id), pooled.data<float>());
    else
      pool_kernel<<<blocks_for(total_pools * id), kThreads, 0, stream>>>(
          g.data<float>(), k.data<float>(), static_cast<const bf16*>(params.kpool_ape.data_ptr()),
          first.data<int32_t>(), total_pools, int(pool), int(id), pooled.data<float>());
    GLMTUNE_CUDA_CHECK_LAUNCH();
    // `first` is freed here; the kernel is ordered before any reuse of its memory on `stream`.
  }
  // The pools' TF32 parts [pools, 3·ID] for the scoring GEMMs (tf32_parts_kernel).
  Tensor pooled_parts = Tensor::empty({std::max<int64_t>(total_pools, 1), 3 * id}, DType::f32, dev);
  if (total_pools > 0) {
    tf32_parts_kernel<<<blocks_for(total_pools * id), kThreads, 0, stream>>>(
        pooled.data<float>(), total_pools, int(id), /*a_side=*/false, pooled_parts.data<float>());
    GLMTUNE_CUDA_CHECK_LAUNCH();
  }

  const float score_scale = 1.0f / std::sqrt(float(id));
  const float head_scale = 1.0f / std::sqrt(float(ih));
  for (size_t doc = 0; doc + 1 < bounds.size(); ++doc) {
    const int64_t begin = bounds[doc], len = bounds[doc + 1] - begin;
    if (len == 0) continue;
    const int64_t n_pools = len / pool;
    const int64_t select_k = std::min(cfg.topk / pool, n_pools);
    const int64_t block =
        std::clamp<int64_t>(kProductBudget / (ih * std::max<int64_t>(n_pools, 1)), 64, 4096);
    for (int64_t s0 = 0; s0 < len; s0 += block) {
      const int64_t rows = std::min(block, len - s0);
      const int64_t n_cand = (s0 + rows) / pool;
      Tensor scores = Tensor::empty({rows, std::max<int64_t>(n_cand, 1)}, DType::f32, dev);
      if (n_cand > 0) {
        Tensor q_parts = Tensor::empty({rows * ih, 3 * id}, DType::f32, dev);
        tf32_parts_kernel<<<blocks_for(rows * ih * id), kThreads, 0, stream>>>(
            q.data<float>() + (begin + s0) * ih * id, rows * ih, int(id), /*a_side=*/true,
            q_parts.data<float>());
        GLMTUNE_CUDA_CHECK_LAUNCH();
        Tensor products = Tensor::empty({rows * ih, n_cand}, DType::f32, dev);
        gemm_f32_nt(dev.index, rows * ih, n_cand, 3 * id, score_scale, q_parts.data<float>(),
                    3 * id, pooled_parts.data<float>() + pool_base[doc] * 3 * id, 3 * id,
                    products.data<float>(), n_cand, stream, /*tf32_operands=*/true);
        head_sum_kernel<<<blocks_for(rows * n_cand), kThreads, 0, stream>>>(
            products.data<float>(), hw.data<float>() + (begin + s0) * ih, rows, int(ih), n_cand,
            head_scale, scores.data<float>());
        GLMTUNE_CUDA_CHECK_LAUNCH();
      }
      SelectArgs a;
      a.scores = scores.data<float>();
      a.n_cand = std::max<int64_t>(n_cand, 1);
      a.s0 = s0;
      a.begin = begin;
      a.pool = int(pool);
      a.select_k = int(select_k);
      a.width = int(width);
      a.n2 = next_pow2(std::max<int64_t>(n_cand, 1));
      a.tail = tail;
      a.out = out.data<int32_t>() + (begin + s0) * width;
      const size_t smem = size_t(a.n2) * sizeof(unsigned long long);
      if (smem > 48 * 1024)
        GLMTUNE_CUDA_CHECK(cudaFuncSetAttribute(
            select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      select_kernel<<<unsigned(rows), kSelectThreads, smem, stream>>>(a);
      GLMTUNE_CUDA_CHECK_LAUNCH();
    }
  }
  return out;
}

}  // namespace glmtune::cuda
