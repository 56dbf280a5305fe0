// Token embedding gather and deterministic scatter-add kernels (ops/cuda/embedding.h).

#include <algorithm>
#include <climits>
#include <type_traits>
#include <utility>
#include <vector>

#include "glmtune/ops/cuda/common.cuh"
#include "glmtune/ops/cuda/embedding.h"

namespace glmtune::cuda {
namespace {

using detail::bf16;

constexpr int kGatherThreads = 128;
constexpr int kScatterWarps = 8;

// One block per token. A bad id zeroes its row (nothing is read out of bounds) and records the
// smallest bad position in *bad, which the host checks after the launch. With kCopy16 the row
// moves in 16-byte pieces of 16 / sizeof(T) elements.
template <typename Id, typename T, bool kCopy16>
__global__ void __launch_bounds__(kGatherThreads)
    embedding_fwd_kernel(const T* __restrict__ table, const Id* __restrict__ ids, int64_t vocab,
                         int dim, T* __restrict__ out, unsigned long long* __restrict__ bad) {
  const int64_t t = blockIdx.x;
  const int64_t id = int64_t(ids[t]);
  T* o = out + t * dim;
  if (id < 0 || id >= vocab) {
    for (int j = threadIdx.x; j < dim; j += blockDim.x) o[j] = detail::from_f<T>(0.0f);
    if (threadIdx.x == 0) atomicMin(bad, static_cast<unsigned long long>(t));
    return;
  }
  const T* src = table + id * dim;
  if constexpr (kCopy16) {
    constexpr int kPer = int(16 / sizeof(T));
    for (int j = threadIdx.x * kPer; j < dim; j += blockDim.x * kPer)
      *reinterpret_cast<uint4*>(o + j) = *reinterpret_cast<const uint4*>(src + j);
  } else {
    for (int j = threadIdx.x; j < dim; j += blockDim.x) o[j] = src[j];
  }
}

// One block per touched row (see the header for the fixed summation order). The row is walked in
// tiles of 32·VEC columns: lane l of every warp owns columns [l·VEC, l·VEC + VEC) of the tile.
template <typename G, typename D, int VEC>
__global__ void __launch_bounds__(kScatterWarps * 32)
    embedding_bwd_kernel(const int32_t* __restrict__ rows, const int32_t* __restrict__ offsets,
                         const int32_t* __restrict__ tokens, const D* __restrict__ dout, int dim,
                         G* __restrict__ dtable) {
  constexpr int kTile = 32 * VEC;
  __shared__ float part[kScatterWarps][kTile];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = rows[blockIdx.x];
  const int begin = offsets[blockIdx.x], end = offsets[blockIdx.x + 1];
  for (int c0 = 0; c0 < dim; c0 += kTile) {
    const int c = c0 + lane * VEC;
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = 0.0f;
    // dim is a multiple of VEC, so a group that starts inside the row ends inside it.
    if (c < dim) {
      for (int i = begin + warp; i < end; i += kScatterWarps) {
        float v[VEC];
        detail::load_vec<VEC>(dout + int64_t(tokens[i]) * dim + c, v);
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] += v[k];
      }
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) part[warp][lane * VEC + k] = acc[k];
    __syncthreads();
    for (int cc = threadIdx.x; cc < kTile; cc += blockDim.x) {
      const int col = c0 + cc;
      if (col < dim) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < kScatterWarps; ++w) s += part[w][cc];
        G* dst = dtable + row * dim + col;
        if constexpr (std::is_same_v<G, float>) {
          *dst += s;
        } else {
          *dst = __float2bfloat16_rn(__bfloat162float(*dst) + s);
        }
      }
    }
    __syncthreads();
  }
}

void check_table(const Tensor& table, const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(table.defined() && table.dim() == 2 && table.device().is_cuda() &&
                              (table.dtype() == DType::bf16 || table.dtype() == DType::f32) &&
                              table.is_contiguous(),
                          std::string(op) + ": table " + detail::describe(table) +
                              " must be a contiguous bf16 or f32 [V, D] CUDA tensor");
  GLMTUNE_CUDA_OP_REQUIRE(table.size(1) <= INT32_MAX, std::string(op) + ": rows too long");
}

[[noreturn]] void bad_id(int64_t id, int64_t position, int64_t vocab) {
  throw Error("token id " + std::to_string(id) + " at position " + std::to_string(position) +
                  " is outside the vocabulary [0, " + std::to_string(vocab) + ")",
              "embedding",
              "the data was tokenized for another vocabulary, or the model config's vocab_size "
              "is wrong");
}

// The ids as int64 on the host (copied from the device when needed).
std::vector<int64_t> host_ids(const Tensor& ids) {
  const Tensor h = ids.device().is_cpu() ? ids.contiguous() : ids.to(Device::cpu()).contiguous();
  std::vector<int64_t> out(size_t(h.numel()));
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = h.dtype() == DType::i32 ? int64_t(h.data<int32_t>()[i]) : h.data<int64_t>()[i];
  return out;
}

}  // namespace

void embedding_forward_out(Tensor& out, const Tensor& table, const Tensor& ids_in,
                           cudaStream_t stream) {
  const char* op = "cuda::embedding_forward";
  check_table(table, op);
  GLMTUNE_CUDA_OP_REQUIRE(
      ids_in.defined() && (ids_in.dtype() == DType::i32 || ids_in.dtype() == DType::i64),
      std::string(op) + ": ids " + detail::describe(ids_in) + " must be int32 or int64");
  const int64_t vocab = table.size(0), dim = table.size(1);
  Shape shape = ids_in.shape();
  shape.push_back(dim);
  GLMTUNE_CUDA_OP_REQUIRE(out.defined() && out.dtype() == table.dtype() && out.shape() == shape &&
                              out.is_contiguous() && out.device() == table.device(),
                          std::string(op) + ": out " + detail::describe(out) +
                              " must be a contiguous " + std::string(dtype_name(table.dtype())) +
                              " " + shape_str(shape) + " on " + table.device().str());
  const int64_t n = ids_in.numel();
  if (n == 0 || dim == 0) return;
  GLMTUNE_CUDA_OP_REQUIRE(n <= INT32_MAX, std::string(op) + ": too many ids");
  const Tensor ids = ids_in.to(table.device()).contiguous();
  detail::DeviceGuard guard(table.device().index);
  Tensor flag = Tensor::empty({1}, DType::i64, table.device());
  auto* bad = static_cast<unsigned long long*>(flag.data_ptr());
  GLMTUNE_CUDA_CHECK(cudaMemsetAsync(bad, 0xff, sizeof(unsigned long long), stream));
  const bool copy16 = (dim * int64_t(table.element_size())) % 16 == 0 &&
                      detail::aligned16(table.data_ptr()) && detail::aligned16(out.data_ptr());
  const unsigned blocks = unsigned(n);
  auto launch = [&]<typename T>(T*) {
    const auto* tp = static_cast<const T*>(table.data_ptr());
    auto* o = static_cast<T*>(out.data_ptr());
    auto run = [&]<typename Id>(const Id* ip) {
      if (copy16)
        embedding_fwd_kernel<Id, T, true>
            <<<blocks, kGatherThreads, 0, stream>>>(tp, ip, vocab, int(dim), o, bad);
      else
        embedding_fwd_kernel<Id, T, false>
            <<<blocks, kGatherThreads, 0, stream>>>(tp, ip, vocab, int(dim), o, bad);
    };
    if (ids.dtype() == DType::i32)
      run(ids.data<int32_t>());
    else
      run(ids.data<int64_t>());
  };
  if (table.dtype() == DType::f32)
    launch(static_cast<float*>(nullptr));
  else
    launch(static_cast<bf16*>(nullptr));
  GLMTUNE_CUDA_CHECK_LAUNCH();
  unsigned long long first_bad = 0;
  GLMTUNE_CUDA_CHECK(
      cudaMemcpyAsync(&first_bad, bad, sizeof(first_bad), cudaMemcpyDeviceToHost, stream));
  GLMTUNE_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (first_bad != ~0ull) {
    const int64_t pos = int64_t(first_bad);
    const Tensor one = ids.flatten().slice(0, pos, pos + 1).to(Device::cpu());
    bad_id(one.dtype() == DType::i32 ? int64_t(one.data<int32_t>()[0]) : one.data<int64_t>()[0],
           pos, vocab);
  }
}

Tensor embedding_forward(const Tensor& table, const Tensor& ids, cudaStream_t stream) {
  check_table(table, "cuda::embedding_forward");
  GLMTUNE_CUDA_OP_REQUIRE(ids.defined(), "cuda::embedding_forward: ids are undefined");
  Shape shape = ids.shape();
  shape.push_back(table.size(1));
  Tensor out = Tensor::empty(shape, table.dtype(), table.device());
  embedding_forward_out(out, table, ids, stream);
  return out;
}

EmbeddingGradPlan make_embedding_grad_plan(const Tensor& ids, int64_t vocab,
                                           std::optional<int64_t> padding_idx, Device device) {
  GLMTUNE_CUDA_OP_REQUIRE(
      ids.defined() && (ids.dtype() == DType::i32 || ids.dtype() == DType::i64),
      "make_embedding_grad_plan: ids " + detail::describe(ids) + " must be int32 or int64");
  GLMTUNE_CUDA_OP_REQUIRE(vocab > 0 && vocab <= INT32_MAX && device.is_cuda(),
                          "make_embedding_grad_plan: vocabulary of " + std::to_string(vocab) +
                              " rows on " + device.str());
  GLMTUNE_CUDA_OP_REQUIRE(!padding_idx || (*padding_idx >= 0 && *padding_idx < vocab),
                          "make_embedding_grad_plan: padding_idx " +
                              std::to_string(padding_idx.value_or(-1)) + " is not a table row");
  GLMTUNE_CUDA_OP_REQUIRE(ids.numel() <= INT32_MAX, "make_embedding_grad_plan: too many ids");
  const std::vector<int64_t> id = host_ids(ids);
  std::vector<std::pair<int32_t, int32_t>> order;  // (id, position)
  order.reserve(id.size());
  for (size_t t = 0; t < id.size(); ++t) {
    if (id[t] < 0 || id[t] >= vocab) bad_id(id[t], int64_t(t), vocab);
    if (padding_idx && id[t] == *padding_idx) continue;
    order.emplace_back(int32_t(id[t]), int32_t(t));
  }
  // Pairs sort by id, then by position: each row's tokens come out in increasing order.
  std::sort(order.begin(), order.end());
  std::vector<int32_t> rows, offsets, tokens;
  tokens.reserve(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    if (i == 0 || order[i].first != order[i - 1].first) {
      rows.push_back(order[i].first);
      offsets.push_back(int32_t(i));
    }
    tokens.push_back(order[i].second);
  }
  offsets.push_back(int32_t(order.size()));
  EmbeddingGradPlan plan;
  plan.vocab = vocab;
  plan.num_positions = int64_t(id.size());
  plan.rows = detail::device_i32(rows, device);
  plan.offsets = detail::device_i32(offsets, device);
  plan.tokens = detail::device_i32(tokens, device);
  return plan;
}

void embedding_backward(const EmbeddingGradPlan& plan, const Tensor& dout, Tensor& dtable,
                        cudaStream_t stream) {
  const char* op = "cuda::embedding_backward";
  GLMTUNE_CUDA_OP_REQUIRE(plan.rows.defined() && plan.offsets.defined() && plan.tokens.defined(),
                          std::string(op) + ": the plan is empty (make_embedding_grad_plan)");
  GLMTUNE_CUDA_OP_REQUIRE(dtable.defined() && dtable.dim() == 2 && dtable.is_contiguous() &&
                              dtable.device().is_cuda() && dtable.size(0) == plan.vocab &&
                              (dtable.dtype() == DType::f32 || dtable.dtype() == DType::bf16),
                          std::string(op) + ": dtable " + detail::describe(dtable) +
                              " must be a contiguous f32/bf16 [" + std::to_string(plan.vocab) +
                              ", D] CUDA tensor");
  const int64_t dim = dtable.size(1);
  GLMTUNE_CUDA_OP_REQUIRE(
      dout.defined() && (dout.dtype() == DType::bf16 || dout.dtype() == DType::f32) &&
          dout.is_contiguous() && dout.device() == dtable.device() && dout.dim() >= 1 &&
          dout.size(-1) == dim && dout.numel() == plan.num_positions * dim,
      std::string(op) + ": dout " + detail::describe(dout) +
          " must be contiguous bf16 or f32 with " + std::to_string(plan.num_positions) +
          " rows of " + std::to_string(dim));
  GLMTUNE_CUDA_OP_REQUIRE(plan.rows.device() == dtable.device(),
                          std::string(op) + ": the plan lives on " + plan.rows.device().str() +
                              ", the gradient on " + dtable.device().str());
  const int64_t touched = plan.rows.numel();
  if (touched == 0 || dim == 0) return;
  GLMTUNE_CUDA_OP_REQUIRE(dim <= INT32_MAX, std::string(op) + ": rows too long");
  detail::DeviceGuard guard(dtable.device().index);
  const int32_t* r = plan.rows.data<int32_t>();
  const int32_t* o = plan.offsets.data<int32_t>();
  const int32_t* t = plan.tokens.data<int32_t>();
  const unsigned blocks = unsigned(touched);
  const unsigned threads = kScatterWarps * 32;
  // 16-byte loads for bf16 dout only; f32 dout is read one element per lane.
  const bool vec =
      dout.dtype() == DType::bf16 && dim % 8 == 0 && detail::aligned16(dout.data_ptr());
  auto launch = [&]<typename G>(G* gp) {
    if (dout.dtype() == DType::f32)
      embedding_bwd_kernel<G, float, 1><<<blocks, threads, 0, stream>>>(
          r, o, t, static_cast<const float*>(dout.data_ptr()), int(dim), gp);
    else if (vec)
      embedding_bwd_kernel<G, bf16, 8><<<blocks, threads, 0, stream>>>(
          r, o, t, static_cast<const bf16*>(dout.data_ptr()), int(dim), gp);
    else
      embedding_bwd_kernel<G, bf16, 1><<<blocks, threads, 0, stream>>>(
          r, o, t, static_cast<const bf16*>(dout.data_ptr()), int(dim), gp);
  };
  if (dtable.dtype() == DType::f32)
    launch(dtable.data<float>());
  else
    launch(static_cast<bf16*>(dtable.data_ptr()));
  GLMTUNE_CUDA_CHECK_LAUNCH();
}

}  // namespace glmtune::cuda
