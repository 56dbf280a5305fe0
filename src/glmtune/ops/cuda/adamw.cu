// Global gradient norm and multi-tensor AdamW (ops/cuda/adamw.h).

#include <cmath>
#include <vector>

#include "glmtune/ops/cuda/adamw.h"
#include "glmtune/ops/cuda/common.cuh"

namespace glmtune::cuda {
namespace {

using detail::bf16;

constexpr int64_t kChunk = 65536;  // elements per work item, for both kernels
constexpr int kThreads = 256;
constexpr int kFinishThreads = 1024;

struct NormTensor {
  const void* data;
  int64_t numel;
  int32_t is_bf16;
  int32_t vec;  // 4-element vector loads are aligned
};

struct AdamWTensor {
  float* master;
  float* exp_avg;
  float* exp_avg_sq;
  const void* grad;
  bf16* param;  // null: no bf16 storage
  int64_t numel;
  int32_t grad_is_bf16;
  int32_t vec;
};

struct Chunk {
  int32_t tensor;
  int32_t index;  // the chunk covers [index · kChunk, min(numel, (index + 1) · kChunk))
};

struct AdamWScalars {
  float decay;         // 1 − lr·wd
  float beta1, beta2;  // moment decay
  float one_minus_beta1, one_minus_beta2;
  float step_size;  // lr / (1 − β1^t)
  float bc2_sqrt;   // sqrt(1 − β2^t)
  float eps;
};

__device__ __forceinline__ float load_grad(const void* g, int64_t i, bool is_bf16) {
  return is_bf16 ? __bfloat162float(static_cast<const bf16*>(g)[i])
                 : static_cast<const float*>(g)[i];
}

// Pass 1: one block per chunk, its sum of squares in fp64 (squares of fp32 values are exact in
// fp64, so only the additions round).
__global__ void __launch_bounds__(kThreads)
    sum_squares_kernel(const NormTensor* __restrict__ tensors, const Chunk* __restrict__ chunks,
                       double* __restrict__ partial) {
  __shared__ double scratch[32];
  const Chunk c = chunks[blockIdx.x];
  const NormTensor t = tensors[c.tensor];
  const int64_t begin = int64_t(c.index) * kChunk;
  const int64_t end = begin + kChunk < t.numel ? begin + kChunk : t.numel;
  double acc = 0.0;
  if (t.vec) {
    const int64_t end4 = begin + (end - begin) / 4 * 4;
    for (int64_t i = begin + int64_t(threadIdx.x) * 4; i < end4; i += int64_t(blockDim.x) * 4) {
      float v[4];
      if (t.is_bf16) {
        const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const bf16*>(t.data) + i);
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
        const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
        v[0] = a.x;
        v[1] = a.y;
        v[2] = b.x;
        v[3] = b.y;
      } else {
        const float4 q = *reinterpret_cast<const float4*>(static_cast<const float*>(t.data) + i);
        v[0] = q.x;
        v[1] = q.y;
        v[2] = q.z;
        v[3] = q.w;
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) acc += double(v[k]) * double(v[k]);
    }
    for (int64_t i = end4 + threadIdx.x; i < end; i += blockDim.x) {
      const double g = load_grad(t.data, i, t.is_bf16);
      acc += g * g;
    }
  } else {
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const double g = load_grad(t.data, i, t.is_bf16);
      acc += g * g;
    }
  }
  acc = detail::block_sum(acc, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// Pass 2: a single block adds the chunk partials (thread i: chunks i, i + 1024, ... in order,
// then a fixed tree), takes the square root and the clipping coefficient.
__global__ void __launch_bounds__(kFinishThreads)
    finish_norm_kernel(const double* __restrict__ partial, int64_t chunks, double max_norm,
                       double* __restrict__ norm_out, float* __restrict__ clip_out) {
  __shared__ double scratch[32];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) acc += partial[i];
  acc = detail::block_sum(acc, scratch);
  if (threadIdx.x == 0) {
    const double norm = sqrt(acc);
    *norm_out = norm;
    float clip;
    if (!isfinite(norm))
      clip = __int_as_float(0x7fc00000);  // quiet NaN: the step is skipped
    else if (max_norm > 0)
      clip = float(fmin(1.0, max_norm / (norm + 1e-6)));
    else
      clip = 1.0f;
    *clip_out = clip;
  }
}

__device__ __forceinline__ void adamw_update(float& p, float& m, float& v, float g,
                                             const AdamWScalars& s) {
  p *= s.decay;
  m = s.beta1 * m + s.one_minus_beta1 * g;
  v = s.beta2 * v + s.one_minus_beta2 * g * g;
  const float denom = sqrtf(v) / s.bc2_sqrt + s.eps;
  p -= s.step_size * (m / denom);
}

// One block per chunk. Every thread reads the clipping coefficient first: non-finite means the
// whole step is skipped, so no block writes anything.
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(const AdamWTensor* __restrict__ tensors, const Chunk* __restrict__ chunks,
                 AdamWScalars s, const float* __restrict__ clip) {
  const float scale = clip ? *clip : 1.0f;
  if (!isfinite(scale)) return;
  const Chunk c = chunks[blockIdx.x];
  const AdamWTensor t = tensors[c.tensor];
  const int64_t begin = int64_t(c.index) * kChunk;
  const int64_t end = begin + kChunk < t.numel ? begin + kChunk : t.numel;
  int64_t scalar_from = begin;
  if (t.vec) {
    const int64_t end4 = begin + (end - begin) / 4 * 4;
    for (int64_t i = begin + int64_t(threadIdx.x) * 4; i < end4; i += int64_t(blockDim.x) * 4) {
      float4 p = *reinterpret_cast<const float4*>(t.master + i);
      float4 m = *reinterpret_cast<const float4*>(t.exp_avg + i);
      float4 v = *reinterpret_cast<const float4*>(t.exp_avg_sq + i);
      float g[4];
      if (t.grad_is_bf16) {
        const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const bf16*>(t.grad) + i);
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
        const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
        g[0] = a.x;
        g[1] = a.y;
        g[2] = b.x;
        g[3] = b.y;
      } else {
        const float4 q = *reinterpret_cast<const float4*>(static_cast<const float*>(t.grad) + i);
        g[0] = q.x;
        g[1] = q.y;
        g[2] = q.z;
        g[3] = q.w;
      }
      adamw_update(p.x, m.x, v.x, g[0] * scale, s);
      adamw_update(p.y, m.y, v.y, g[1] * scale, s);
      adamw_update(p.z, m.z, v.z, g[2] * scale, s);
      adamw_update(p.w, m.w, v.w, g[3] * scale, s);
      *reinterpret_cast<float4*>(t.master + i) = p;
      *reinterpret_cast<float4*>(t.exp_avg + i) = m;
      *reinterpret_cast<float4*>(t.exp_avg_sq + i) = v;
      if (t.param) {
        uint2 packed;
        __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&packed);
        h[0] = __floats2bfloat162_rn(p.x, p.y);
        h[1] = __floats2bfloat162_rn(p.z, p.w);
        *reinterpret_cast<uint2*>(t.param + i) = packed;
      }
    }
    scalar_from = end4;
  }
  for (int64_t i = scalar_from + threadIdx.x; i < end; i += blockDim.x) {
    float p = t.master[i], m = t.exp_avg[i], v = t.exp_avg_sq[i];
    adamw_update(p, m, v, load_grad(t.grad, i, t.grad_is_bf16) * scale, s);
    t.master[i] = p;
    t.exp_avg[i] = m;
    t.exp_avg_sq[i] = v;
    if (t.param) t.param[i] = __float2bfloat16_rn(p);
  }
}

bool aligned_to(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

// Copies a host table to a fresh device buffer (from the caching allocator) on `stream`. The
// host copy is consumed before cudaMemcpyAsync returns (pageable memory is staged), so the
// vector may go out of scope right after.
template <typename T>
Tensor upload(const std::vector<T>& table, Device dev, cudaStream_t stream) {
  const size_t bytes = table.size() * sizeof(T);
  Tensor buf = Tensor::empty({int64_t((bytes + 7) / 8)}, DType::i64, dev);
  GLMTUNE_CUDA_CHECK(
      cudaMemcpyAsync(buf.data_ptr(), table.data(), bytes, cudaMemcpyHostToDevice, stream));
  return buf;
}

void add_chunks(std::vector<Chunk>& chunks, int32_t tensor, int64_t numel) {
  const int64_t n = (numel + kChunk - 1) / kChunk;
  GLMTUNE_CUDA_OP_REQUIRE(n <= INT32_MAX, "optimizer tensor too large");
  for (int64_t i = 0; i < n; ++i) chunks.push_back({tensor, int32_t(i)});
}

}  // namespace

GradNorm grad_norm(const std::vector<Tensor>& grads, double max_norm, cudaStream_t stream) {
  const char* op = "cuda::grad_norm";
  GLMTUNE_CUDA_OP_REQUIRE(!grads.empty(), std::string(op) + ": no gradients");
  const Device dev = grads.front().device();
  GLMTUNE_CUDA_OP_REQUIRE(dev.is_cuda(), std::string(op) + ": gradients must be on a CUDA device");
  std::vector<NormTensor> tensors;
  std::vector<Chunk> chunks;
  for (const Tensor& g : grads) {
    GLMTUNE_CUDA_OP_REQUIRE(g.defined() && g.device() == dev && g.is_contiguous() &&
                                (g.dtype() == DType::f32 || g.dtype() == DType::bf16),
                            std::string(op) + ": gradient " + detail::describe(g) +
                                " must be a contiguous f32/bf16 tensor on " + dev.str());
    if (g.numel() == 0) continue;
    GLMTUNE_CUDA_OP_REQUIRE(tensors.size() < size_t(INT32_MAX), std::string(op) + ": too many");
    const bool is_bf16 = g.dtype() == DType::bf16;
    tensors.push_back({g.data_ptr(), g.numel(), is_bf16 ? 1 : 0,
                       aligned_to(g.data_ptr(), is_bf16 ? 8 : 16) ? 1 : 0});
    add_chunks(chunks, int32_t(tensors.size() - 1), g.numel());
  }
  detail::DeviceGuard guard(dev.index);
  GradNorm out;
  out.norm = Tensor::empty({1}, DType::f64, dev);
  out.clip = Tensor::empty({1}, DType::f32, dev);
  const int64_t n_chunks = int64_t(chunks.size());
  Tensor partial = Tensor::empty({std::max<int64_t>(n_chunks, 1)}, DType::f64, dev);
  if (n_chunks > 0) {
    const Tensor t_dev = upload(tensors, dev, stream), c_dev = upload(chunks, dev, stream);
    sum_squares_kernel<<<unsigned(n_chunks), kThreads, 0, stream>>>(
        static_cast<const NormTensor*>(t_dev.data_ptr()),
        static_cast<const Chunk*>(c_dev.data_ptr()), partial.data<double>());
    GLMTUNE_CUDA_CHECK_LAUNCH();
  }
  finish_norm_kernel<<<1, kFinishThreads, 0, stream>>>(
      partial.data<double>(), n_chunks, max_norm, out.norm.data<double>(), out.clip.data<float>());
  GLMTUNE_CUDA_CHECK_LAUNCH();
  return out;
}

void adamw_step(const std::vector<AdamWParam>& params, const AdamWConfig& config,
                const Tensor& clip, cudaStream_t stream) {
  const char* op = "cuda::adamw_step";
  if (params.empty()) return;
  GLMTUNE_CUDA_OP_REQUIRE(config.step >= 1, std::string(op) + ": step counts from 1");
  const Device dev = params.front().master.defined() ? params.front().master.device() : Device();
  GLMTUNE_CUDA_OP_REQUIRE(dev.is_cuda(), std::string(op) + ": parameters must be on a CUDA device");
  if (clip.defined())
    GLMTUNE_CUDA_OP_REQUIRE(
        clip.dtype() == DType::f32 && clip.numel() == 1 && clip.device() == dev,
        std::string(op) + ": clip " + clip.str() + " must be f32 [1] on " + dev.str());
  std::vector<AdamWTensor> tensors;
  std::vector<Chunk> chunks;
  for (const AdamWParam& p : params) {
    auto f32_like = [&](const Tensor& t, const char* what) {
      GLMTUNE_CUDA_OP_REQUIRE(t.defined() && t.dtype() == DType::f32 && t.is_contiguous() &&
                                  t.device() == dev && t.numel() == p.master.numel(),
                              std::string(op) + ": " + what + " " + detail::describe(t) +
                                  " must be a contiguous f32 tensor of " +
                                  std::to_string(p.master.defined() ? p.master.numel() : 0) +
                                  " elements on " + dev.str());
    };
    f32_like(p.master, "master");
    f32_like(p.exp_avg, "exp_avg");
    f32_like(p.exp_avg_sq, "exp_avg_sq");
    GLMTUNE_CUDA_OP_REQUIRE(p.grad.defined() && p.grad.is_contiguous() && p.grad.device() == dev &&
                                p.grad.numel() == p.master.numel() &&
                                (p.grad.dtype() == DType::f32 || p.grad.dtype() == DType::bf16),
                            std::string(op) + ": grad " + detail::describe(p.grad) +
                                " must be a contiguous f32/bf16 tensor like master " +
                                p.master.str());
    if (p.param.defined())
      GLMTUNE_CUDA_OP_REQUIRE(p.param.dtype() == DType::bf16 && p.param.is_contiguous() &&
                                  p.param.device() == dev && p.param.numel() == p.master.numel(),
                              std::string(op) + ": param " + p.param.str() +
                                  " must be a contiguous bf16 tensor like master " +
                                  p.master.str());
    if (p.master.numel() == 0) continue;
    AdamWTensor t{};
    t.master = p.master.data<float>();
    t.exp_avg = p.exp_avg.data<float>();
    t.exp_avg_sq = p.exp_avg_sq.data<float>();
    t.grad = p.grad.data_ptr();
    t.param = p.param.defined() ? reinterpret_cast<bf16*>(p.param.data_ptr()) : nullptr;
    t.numel = p.master.numel();
    t.grad_is_bf16 = p.grad.dtype() == DType::bf16 ? 1 : 0;
    t.vec = aligned_to(t.master, 16) && aligned_to(t.exp_avg, 16) && aligned_to(t.exp_avg_sq, 16) &&
            aligned_to(t.grad, t.grad_is_bf16 ? 8 : 16) && (!t.param || aligned_to(t.param, 8));
    tensors.push_back(t);
    add_chunks(chunks, int32_t(tensors.size() - 1), t.numel);
  }
  if (chunks.empty()) return;
  // Step-dependent factors in double on the host, rounded once to float.
  const double bc1 = 1.0 - std::pow(config.beta1, double(config.step));
  const double bc2 = 1.0 - std::pow(config.beta2, double(config.step));
  AdamWScalars s;
  s.decay = float(1.0 - config.lr * config.weight_decay);
  s.beta1 = float(config.beta1);
  s.beta2 = float(config.beta2);
  s.one_minus_beta1 = float(1.0 - config.beta1);
  s.one_minus_beta2 = float(1.0 - config.beta2);
  s.step_size = float(config.lr / bc1);
  s.bc2_sqrt = float(std::sqrt(bc2));
  s.eps = float(config.eps);
  detail::DeviceGuard guard(dev.index);
  const Tensor t_dev = upload(tensors, dev, stream), c_dev = upload(chunks, dev, stream);
  adamw_kernel<<<unsigned(chunks.size()), kThreads, 0, stream>>>(
      static_cast<const AdamWTensor*>(t_dev.data_ptr()),
      static_cast<const Chunk*>(c_dev.data_ptr()), s,
      clip.defined() ? clip.data<float>() : nullptr);
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

}  // namespace glmtune::cuda
