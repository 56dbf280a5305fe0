// Fused, chunked LM head + cross-entropy (ops/cuda/cross_entropy.h).

#include <cooperative_groups.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>

#include "glmtune/ops/cuda/common.cuh"
#include "glmtune/ops/cuda/cross_entropy.h"
#include "glmtune/ops/cuda/gemm.h"
#include "glmtune/ops/cuda/sm90a.h"

namespace glmtune::cuda {
namespace {

using detail::bf16;

constexpr int kCeThreads = 512;
constexpr int kCopyThreads = 256;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Merges the log-sum-exp state (m, s), meaning Σ 2^(x − m) = s, with another one. The products
// and the sum are rounded explicitly (no FMA contraction), so both lanes of a butterfly step get
// the same bits whichever side they hold.
__device__ __forceinline__ void lse_merge(float& m, float& s, float om, float os) {
  const float mn = fmaxf(m, om);
  if (mn == -INFINITY) {
    m = mn;
    s = 0.0f;
    return;
  }
  s = __fadd_rn(__fmul_rn(s, exp2f(m - mn)), __fmul_rn(os, exp2f(om - mn)));
  m = mn;
}

// Merges the (m, s) states of a warp's lanes into every lane.
__device__ __forceinline__ void warp_lse(float& m, float& s) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float om = __shfl_xor_sync(0xffffffffu, m, offset);
    const float os = __shfl_xor_sync(0xffffffffu, s, offset);
    lse_merge(m, s, om, os);
  }
}

// The block's log-sum-exp state from each thread's (m, s): merged within each warp, then across
// the warps by warp 0. The result is valid in thread 0.
__device__ __forceinline__ void block_lse(float& m, float& s) {
  __shared__ float sm_m[32], sm_s[32];
  warp_lse(m, s);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (lane == 0) {
    sm_m[warp] = m;
    sm_s[warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
    m = lane < warps ? sm_m[lane] : -INFINITY;
    s = lane < warps ? sm_s[lane] : 0.0f;
    warp_lse(m, s);
  }
}

// Stores the gradient of four consecutive logits j .. j + 3 (out: coef · softmax, in fp32) in the
// operands' dtype G, the label's own term subtracted, as one 16-byte (f32) or 8-byte (bf16) store.
template <typename G>
__device__ __forceinline__ void store_grad4(G* g, int64_t j, float (&out)[4], int label,
                                            float coef) {
#pragma unroll
  for (int k = 0; k < 4; ++k)
    if (j + k == label) out[k] -= coef;
  if constexpr (std::is_same_v<G, float>) {
    *reinterpret_cast<float4*>(g + j) = make_float4(out[0], out[1], out[2], out[3]);
  } else {
    uint2 packed;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&packed);
    h[0] = __floats2bfloat162_rn(out[0], out[1]);
    h[1] = __floats2bfloat162_rn(out[2], out[3]);
    *reinterpret_cast<uint2*>(g + j) = packed;
  }
}

// One block per label row of the chunk. Pass 1 reads the fp32 logits once (online log-sum-exp in
// base 2); pass 2 re-reads them and writes the gradient, in the operands' dtype G, over the start
// of the same row (its first half for bf16, all of it for f32). In pass 2 the row is walked in
// tiles of blockDim·VEC elements with a barrier between a tile's loads and its stores: tile k
// stores G bytes [s·t0, s·(t0 + tile)) (s = sizeof(G) ≤ 4), which hold fp32 elements of tiles ≤ k
// only, all of which were loaded before that barrier; later tiles' fp32 bytes start at
// 4·(t0 + tile), past every store so far.
template <int VEC, typename G>
__global__ void __launch_bounds__(kCeThreads)
    ce_rows_kernel(float* __restrict__ logits, int64_t ld, int64_t vocab,
                   const int32_t* __restrict__ labels, float* __restrict__ loss_rows, float coef,
                   bool want_grad) {
  __shared__ float label_logit, lse2_shared;
  const int64_t row = blockIdx.x;
  float* z = logits + row * ld;
  const int label = labels[row];
  if (threadIdx.x == 0) label_logit = z[label];

  float m = -INFINITY, s = 0.0f;
  for (int64_t j = int64_t(threadIdx.x) * VEC; j < vocab; j += int64_t(blockDim.x) * VEC) {
    float x[VEC];
    if constexpr (VEC == 4) {
      const float4 v = *reinterpret_cast<const float4*>(z + j);
      x[0] = v.x * kLog2e;
      x[1] = v.y * kLog2e;
      x[2] = v.z * kLog2e;
      x[3] = v.w * kLog2e;
    } else {
      x[0] = z[j] * kLog2e;
    }
    float vm = x[0];
#pragma unroll
    for (int k = 1; k < VEC; ++k) vm = fmaxf(vm, x[k]);
    const float mn = fmaxf(m, vm);
    if (mn != -INFINITY) {
      s *= exp2f(m - mn);
#pragma unroll
      for (int k = 0; k < VEC; ++k) s += exp2f(x[k] - mn);
      m = mn;
    }
  }
  block_lse(m, s);
  if (threadIdx.x == 0) {
    const float lse2 = m + log2f(s);
    lse2_shared = lse2;
    loss_rows[row] = lse2 * kLn2 - label_logit;
  }
  __syncthreads();
  if (!want_grad) return;
  const float lse2 = lse2_shared;
  G* g = reinterpret_cast<G*>(z);
  const int64_t tile = int64_t(blockDim.x) * VEC;
  for (int64_t t0 = 0; t0 < vocab; t0 += tile) {
    const int64_t j = t0 + int64_t(threadIdx.x) * VEC;
    const bool active = j < vocab;
    float v[VEC];
    if (active) {
      if constexpr (VEC == 4) {
        const float4 q = *reinterpret_cast<const float4*>(z + j);
        v[0] = q.x;
        v[1] = q.y;
        v[2] = q.z;
        v[3] = q.w;
      } else {
        v[0] = z[j];
      }
    }
    __syncthreads();
    if (active) {
      float out[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) out[k] = coef * exp2f(v[k] * kLog2e - lse2);
      if constexpr (VEC == 4) {
        store_grad4(g, j, out, label, coef);
      } else {
        if (j == label) out[0] -= coef;
        g[j] = detail::from_f<G>(out[0]);
      }
    }
  }
}

// The same rows with each row's logits read once: a cluster of kCeCluster blocks shares a row, each
// thread holding up to 4·kCeRowVec4 of its values in registers (163,840 a row, the released
// vocabulary of 154,880 included). Each block reduces its slice to one log-sum-exp state, every
// block merges the cluster's states in rank order (the same bits in all of them), and then writes
// the gradient from its registers. Writing is safe in place: the gradient's bytes of element j
// overlap fp32 elements ≤ j, of this block or of lower ranks, and every block's loads completed
// before the first cluster barrier.
constexpr int kCeCluster = 8;
constexpr int kCeClusterThreads = 512;
constexpr int kCeRowVec4 = 10;
constexpr int64_t kCeClusterVocab = int64_t(4) * kCeCluster * kCeClusterThreads * kCeRowVec4;

template <typename G>
__global__ void __cluster_dims__(kCeCluster, 1, 1) __launch_bounds__(kCeClusterThreads, 2)
    ce_rows_cluster_kernel(float* __restrict__ logits, int64_t ld, int vocab,
                           const int32_t* __restrict__ labels, float* __restrict__ loss_rows,
                           float coef, bool want_grad) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  __shared__ float block_m, block_s;
  const int rank = int(cluster.block_rank());
  const int64_t row = blockIdx.x / kCeCluster;
  float* z = logits + row * ld;
  const int label = labels[row];
  // Slices of whole float4s, ranks in order.
  const int quads = (vocab / 4 + kCeCluster - 1) / kCeCluster;
  const int q0 = rank * quads, q1 = min(vocab / 4, q0 + quads);
  const int tid = threadIdx.x;
  float label_logit = 0.0f;
  if (rank == 0 && tid == 0) label_logit = z[label];
  float x[kCeRowVec4][4];
#pragma unroll
  for (int i = 0; i < kCeRowVec4; ++i) {
    const int q = q0 + i * kCeClusterThreads + tid;
    if (q < q1) {
      const float4 v = *reinterpret_cast<const float4*>(z + int64_t(4) * q);
      x[i][0] = v.x * kLog2e;
      x[i][1] = v.y * kLog2e;
      x[i][2] = v.z * kLog2e;
      x[i][3] = v.w * kLog2e;
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) x[i][k] = -INFINITY;
    }
  }
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kCeRowVec4; ++i)
#pragma unroll
    for (int k = 0; k < 4; ++k) m = fmaxf(m, x[i][k]);
  float s = 0.0f;
  if (m != -INFINITY)
#pragma unroll
    for (int i = 0; i < kCeRowVec4; ++i)
#pragma unroll
      for (int k = 0; k < 4; ++k) s += exp2f(x[i][k] - m);
  block_lse(m, s);
  if (tid == 0) {
    block_m = m;
    block_s = s;
  }
  cluster.sync();  // every block's state is in its shared memory; every load has completed
  __shared__ float lse2_shared;
  if (tid == 0) {
    float cm = -INFINITY, cs = 0.0f;
    for (int r = 0; r < kCeCluster; ++r)
      lse_merge(cm, cs, *cluster.map_shared_rank(&block_m, r),
                *cluster.map_shared_rank(&block_s, r));
    const float lse2 = cm + log2f(cs);
    lse2_shared = lse2;
    if (rank == 0) loss_rows[row] = lse2 * kLn2 - label_logit;
  }
  // No block leaves (its shared memory still read by the others) before all have merged.
  cluster.sync();
  if (!want_grad) return;
  const float lse2 = lse2_shared;
  G* g = reinterpret_cast<G*>(z);
#pragma unroll
  for (int i = 0; i < kCeRowVec4; ++i) {
    const int q = q0 + i * kCeClusterThreads + tid;
    if (q >= q1) continue;
    float out[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = coef * exp2f(x[i][k] - lse2);
    store_grad4(g, int64_t(4) * q, out, label, coef);
  }
#endif
}

// dst row (dst_rows ? dst_rows[i] : i) = src row (src_rows ? src_rows[i] : i), one block per row,
// copied in units of Unit (16 bytes when rows and pitches allow it).
template <typename Unit>
__global__ void __launch_bounds__(kCopyThreads)
    copy_rows_kernel(const char* __restrict__ src, int64_t src_pitch,
                     const int32_t* __restrict__ src_rows, char* __restrict__ dst,
                     int64_t dst_pitch, const int32_t* __restrict__ dst_rows, int64_t units) {
  const int64_t i = blockIdx.x;
  const int64_t sr = src_rows ? src_rows[i] : i, dr = dst_rows ? dst_rows[i] : i;
  const Unit* s = reinterpret_cast<const Unit*>(src + sr * src_pitch);
  Unit* d = reinterpret_cast<Unit*>(dst + dr * dst_pitch);
  for (int64_t j = threadIdx.x; j < units; j += blockDim.x) d[j] = s[j];
}

void copy_rows(const void* src, int64_t src_pitch, const int32_t* src_rows, void* dst,
               int64_t dst_pitch, const int32_t* dst_rows, int64_t rows, int64_t row_bytes,
               cudaStream_t stream) {
  if (rows == 0 || row_bytes == 0) return;
  const auto* s = static_cast<const char*>(src);
  auto* d = static_cast<char*>(dst);
  const bool wide = detail::aligned16(s) && detail::aligned16(d) && src_pitch % 16 == 0 &&
                    dst_pitch % 16 == 0 && row_bytes % 16 == 0;
  if (wide)
    copy_rows_kernel<uint4><<<unsigned(rows), kCopyThreads, 0, stream>>>(
        s, src_pitch, src_rows, d, dst_pitch, dst_rows, row_bytes / 16);
  else
    copy_rows_kernel<uint16_t><<<unsigned(rows), kCopyThreads, 0, stream>>>(
        s, src_pitch, src_rows, d, dst_pitch, dst_rows, row_bytes / 2);
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

std::vector<int64_t> host_labels(const Tensor& labels) {
  const Tensor h =
      labels.device().is_cpu() ? labels.contiguous() : labels.to(Device::cpu()).contiguous();
  std::vector<int64_t> out(size_t(h.numel()));
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = h.dtype() == DType::i32 ? int64_t(h.data<int32_t>()[i]) : h.data<int64_t>()[i];
  return out;
}

}  // namespace

ops::CrossEntropyResult lm_head_cross_entropy(const Tensor& hidden, const Tensor& weight,
                                              const Tensor& labels,
                                              const ops::CrossEntropyOptions& opts, Tensor* dhidden,
                                              Tensor* dweight, cudaStream_t stream) {
  const char* op = "cuda::lm_head_cross_entropy";
  GLMTUNE_CUDA_OP_REQUIRE(hidden.defined() && hidden.dim() == 2 && hidden.device().is_cuda() &&
                              (hidden.dtype() == DType::bf16 || hidden.dtype() == DType::f32) &&
                              detail::has_row_layout(hidden),
                          std::string(op) + ": hidden " + detail::describe(hidden) +
                              " must be a bf16 or f32 [T, D] CUDA tensor with unit inner stride");
  GLMTUNE_CUDA_OP_REQUIRE(weight.defined() && weight.dim() == 2 &&
                              weight.size(1) == hidden.size(1) &&
                              weight.dtype() == hidden.dtype() && weight.is_contiguous() &&
                              weight.device() == hidden.device(),
                          std::string(op) + ": weight " + detail::describe(weight) +
                              " must be a contiguous [V, " + std::to_string(hidden.size(1)) +
                              "] tensor of hidden's dtype on " + hidden.device().str());
  GLMTUNE_CUDA_OP_REQUIRE(opts.chunk_rows > 0, std::string(op) + ": chunk_rows must be positive");
  const int64_t rows = hidden.size(0), dim = hidden.size(1), vocab = weight.size(0);
  const int64_t col0 = opts.weight_grad_col0;
  GLMTUNE_CUDA_OP_REQUIRE(col0 >= 0 && col0 < dim, std::string(op) + ": weight_grad_col0 " +
                                                       std::to_string(col0) +
                                                       " must be a column of hidden");
  const Shape dweight_shape = {vocab, dim - col0};
  GLMTUNE_CUDA_OP_REQUIRE(labels.defined() && labels.dim() == 1 && labels.size(0) == rows &&
                              (labels.dtype() == DType::i32 || labels.dtype() == DType::i64),
                          std::string(op) + ": labels " + detail::describe(labels) +
                              " must be an int32/int64 vector of " + std::to_string(rows) +
                              " rows");
  GLMTUNE_CUDA_OP_REQUIRE(rows <= INT32_MAX && vocab <= INT32_MAX && dim > 0,
                          std::string(op) + ": sizes out of range");

  // Labels: checked exactly as the CPU op does, then compacted to the rows that carry a loss.
  const std::vector<int64_t> lab = host_labels(labels);
  std::vector<int32_t> label_rows, label_ids;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t v = lab[size_t(i)];
    if (v == ops::kIgnoreIndex) continue;
    if (v < 0 || v >= vocab)
      throw Error("label " + std::to_string(v) + " of row " + std::to_string(i) + " is neither " +
                      std::to_string(ops::kIgnoreIndex) + " nor a token id in [0, " +
                      std::to_string(vocab) + ")",
                  "cross-entropy labels",
                  "labels must be token ids of the model's vocabulary, or -100 for positions "
                  "without a loss");
    label_rows.push_back(int32_t(i));
    label_ids.push_back(int32_t(v));
  }
  const int64_t n = int64_t(label_rows.size());
  ops::CrossEntropyResult result;
  result.n_tokens = n;
  result.denominator = opts.denominator > 0 ? opts.denominator : double(n);
  const double coef = result.denominator > 0 ? opts.grad_scale / result.denominator : 0.0;

  const Device dev = hidden.device();
  detail::DeviceGuard guard(dev.index);
  if (dhidden) {
    if (!dhidden->defined()) *dhidden = Tensor::empty({rows, dim}, hidden.dtype(), dev);
    GLMTUNE_CUDA_OP_REQUIRE(dhidden->shape() == hidden.shape() && dhidden->is_contiguous() &&
                                dhidden->device() == dev &&
                                (dhidden->dtype() == DType::bf16 || dhidden->dtype() == DType::f32),
                            std::string(op) + ": dhidden " + dhidden->str() +
                                " must be a contiguous bf16/f32 tensor like hidden " +
                                hidden.str());
    // Ignored rows never reach a chunk: their gradient is 0.
    GLMTUNE_CUDA_CHECK(cudaMemsetAsync(dhidden->data_ptr(), 0, dhidden->nbytes(), stream));
  }
  if (dweight) {
    if (!dweight->defined()) *dweight = Tensor::zeros(dweight_shape, DType::f32, dev);
    GLMTUNE_CUDA_OP_REQUIRE(dweight->shape() == dweight_shape && dweight->is_contiguous() &&
                                dweight->device() == dev &&
                                (dweight->dtype() == DType::f32 || dweight->dtype() == DType::bf16),
                            std::string(op) + ": dweight " + dweight->str() +
                                " must be a contiguous f32/bf16 tensor like the weight " +
                                weight.str() + " from column " + std::to_string(col0));
  }
  if (n == 0) return result;

  const bool want_grad = dhidden || dweight;
  const int64_t chunk = std::min(opts.chunk_rows, n);
  const Tensor rows_dev = detail::device_i32(label_rows, dev);
  const Tensor ids_dev = detail::device_i32(label_ids, dev);
  Tensor logits = Tensor::empty({chunk, vocab}, DType::f32, dev);
  Tensor loss_rows = Tensor::empty({n}, DType::f32, dev);
  Tensor gathered, dh_buffer;  // only for chunks whose rows are not one contiguous run
  const detail::RowsView hv = detail::rows_view(hidden);
  const auto* hp = static_cast<const char*>(hv.data);
  const DType ab = hidden.dtype();
  const int64_t h_size = int64_t(dtype_size(ab));
  float* zp = logits.data<float>();
  const bool vec = vocab % 4 == 0 && detail::aligned16(zp);
  const size_t dh_size = dhidden ? dtype_size(dhidden->dtype()) : 0;
  const bool cluster_rows =
      vec && vocab <= kCeClusterVocab && detail::sm90a_kernels_available(dev.index);
  auto ce_rows = [&]<typename G>(G*, int64_t m, int64_t c0) {
    const int32_t* ids = ids_dev.data<int32_t>() + c0;
    float* losses = loss_rows.data<float>() + c0;
    if (cluster_rows)
      ce_rows_cluster_kernel<G><<<unsigned(m * kCeCluster), kCeClusterThreads, 0, stream>>>(
          zp, vocab, int(vocab), ids, losses, float(coef), want_grad);
    else if (vec)
      ce_rows_kernel<4, G><<<unsigned(m), kCeThreads, 0, stream>>>(zp, vocab, vocab, ids, losses,
                                                                   float(coef), want_grad);
    else
      ce_rows_kernel<1, G><<<unsigned(m), kCeThreads, 0, stream>>>(zp, vocab, vocab, ids, losses,
                                                                   float(coef), want_grad);
  };

  // A chunk's m rows `a` times the head weight W [V, dim] (row-major, as stored): a·Wᵀ, the
  // logits of hidden rows, or without `transpose` a·W, the hidden gradient of the logits' one.
  auto times_weight = [&](int64_t m, const void* a, int64_t lda, bool transpose, void* c,
                          DType c_dtype) {
    const int64_t cols = transpose ? vocab : dim;
    gemm({.device = dev.index,
          .trans_b = transpose,
          .m = m,
          .n = cols,
          .k = transpose ? dim : vocab,
          .a = a,
          .lda = lda,
          .b = weight.data_ptr(),
          .ldb = dim,
          .c = c,
          .ldc = cols,
          .c_dtype = c_dtype,
          .ab_dtype = ab},
         stream);
  };

  for (int64_t c0 = 0; c0 < n; c0 += chunk) {
    const int64_t m = std::min(chunk, n - c0);
    const int32_t* chunk_rows = rows_dev.data<int32_t>() + c0;
    // Label rows are increasing, so first and last m − 1 apart means one contiguous run, which
    // the GEMMs read and write in place.
    const bool run = label_rows[size_t(c0 + m - 1)] - label_rows[size_t(c0)] == m - 1;
    const void* h_chunk;
    int64_t ldh;
    if (run) {
      h_chunk = hp + int64_t(label_rows[size_t(c0)]) * hv.ld * h_size;
      ldh = hv.ld;
    } else {
      if (!gathered.defined()) gathered = Tensor::empty({chunk, dim}, ab, dev);
      copy_rows(hp, hv.ld * h_size, chunk_rows, gathered.data_ptr(), dim * h_size, nullptr, m,
                dim * h_size, stream);
      h_chunk = gathered.data_ptr();
      ldh = dim;
    }

    times_weight(m, h_chunk, ldh, /*transpose=*/true, zp, DType::f32);

    if (ab == DType::f32)
      ce_rows(static_cast<float*>(nullptr), m, c0);
    else
      ce_rows(static_cast<bf16*>(nullptr), m, c0);
    GLMTUNE_CUDA_CHECK_LAUNCH();
    if (!want_grad) continue;

    // The gradient of row i starts where its fp32 logits started: a row stride of 4·V bytes, 2·V
    // bf16 or V f32 elements.
    const void* dz = zp;
    const int64_t ldz = 4 * vocab / h_size;
    if (dhidden) {
      char* dh_base = static_cast<char*>(dhidden->data_ptr());
      if (run) {
        times_weight(m, dz, ldz, /*transpose=*/false,
                     dh_base + int64_t(label_rows[size_t(c0)]) * dim * int64_t(dh_size),
                     dhidden->dtype());
      } else {
        if (!dh_buffer.defined()) dh_buffer = Tensor::empty({chunk, dim}, dhidden->dtype(), dev);
        times_weight(m, dz, ldz, /*transpose=*/false, dh_buffer.data_ptr(), dhidden->dtype());
        copy_rows(dh_buffer.data_ptr(), dim * int64_t(dh_size), nullptr, dh_base,
                  dim * int64_t(dh_size), chunk_rows, m, dim * int64_t(dh_size), stream);
      }
    }
    if (dweight) {
      // Columns [col0, dim) only: the chunk's hidden read from column col0 on.
      gemm({.device = dev.index,
            .trans_a = true,
            .m = vocab,
            .n = dim - col0,
            .k = m,
            .a = dz,
            .lda = ldz,
            .b = static_cast<const char*>(h_chunk) + col0 * h_size,
            .ldb = ldh,
            .c = dweight->data_ptr(),
            .ldc = dim - col0,
            .c_dtype = dweight->dtype(),
            .beta = 1.0f,
            .ab_dtype = ab},
           stream);
    }
  }

  std::vector<float> losses(static_cast<size_t>(n));
  GLMTUNE_CUDA_CHECK(cudaMemcpyAsync(losses.data(), loss_rows.data_ptr(), size_t(n) * sizeof(float),
                                     cudaMemcpyDeviceToHost, stream));
  GLMTUNE_CUDA_CHECK(cudaStreamSynchronize(stream));
  double total = 0;
  for (float v : losses) total += double(v);
  result.loss_sum = total;
  result.loss = result.denominator > 0 ? total / result.denominator : 0.0;
  return result;
}

}  // namespace glmtune::cuda
