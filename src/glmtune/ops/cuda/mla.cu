// Sparse NoPE MLA attention on the GPU (ops/cuda/mla.h).

#include <climits>
#include <cub/device/device_radix_sort.cuh>
#include <map>
#include <mutex>
#include <type_traits>
#include <vector>

#include "glmtune/ops/cuda/common.cuh"
#include "glmtune/ops/cuda/mla.h"

namespace glmtune::cuda {
namespace {

using detail::bf16;

constexpr int kThreads = 256;
constexpr int kHeadsPerBlock = 4;  // one warp per head
constexpr int kMaxRowWidth = 8192;

// ---- key sets --------------------------------------------------------------------------------

// Keys a window of the key-set kernel's bitmap spans: 1,024 words of shared memory.
constexpr int kKeyWindow = 32768;

// Exclusive prefix sum of one int per thread over the block, and the block's total (blockDim.x a
// multiple of 32); `scratch` holds 33 ints of shared memory, reusable after the call.
__device__ int block_exclusive_scan(int v, int* scratch, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  int incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int up = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += up;
  }
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  if (threadIdx.x == 0) {
    int run = 0;
    for (int w = 0; w < warps; ++w) {
      const int n = scratch[w];
      scratch[w] = run;
      run += n;
    }
    scratch[32] = run;
  }
  __syncthreads();
  const int out = scratch[warp] + incl - v;
  total = scratch[32];
  __syncthreads();
  return out;
}

// One block per query row: its distinct keys in ascending order, then −1. Any entry outside the
// query's document [cu[d], cu[d+1]) other than −1 is flagged. The row's keys are marked in a
// bitmap of kKeyWindow keys at a time (one window for rows whose keys span less, as the
// indexer's do in documents up to that length), and each window's set bits are written in
// order: the cost is the row's width, not a sort of it.
__global__ void __launch_bounds__(kThreads)
    key_set_kernel(const int32_t* __restrict__ idx, int64_t width, const int64_t* __restrict__ cu,
                   int n_docs, int32_t* __restrict__ keys, int32_t* __restrict__ counts,
                   int* __restrict__ error) {
  constexpr int kWords = kKeyWindow / 32;
  __shared__ uint32_t bits[kWords];
  __shared__ int scratch[33];
  __shared__ int64_t doc_lo, doc_hi;
  __shared__ int row_min, row_max;
  const int64_t i = blockIdx.x;
  if (threadIdx.x == 0) {
    // The document holding token i: the last d with cu[d] ≤ i (empty documents skipped).
    int lo = 0, hi = n_docs;
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (cu[mid] <= i)
        lo = mid;
      else
        hi = mid;
    }
    doc_lo = cu[lo];
    doc_hi = cu[lo + 1];
    row_min = INT_MAX;
    row_max = -1;
  }
  __syncthreads();
  const int32_t* row = idx + i * width;
  auto in_doc = [&](int v) { return v >= doc_lo && v < doc_hi; };
  int lo_key = INT_MAX, hi_key = -1;
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
    const int v = row[c];
    if (v == -1) continue;
    if (!in_doc(v)) {
      *error = 1;
      continue;
    }
    lo_key = min(lo_key, v);
    hi_key = max(hi_key, v);
  }
  if (lo_key <= hi_key) {
    atomicMin(&row_min, lo_key);
    atomicMax(&row_max, hi_key);
  }
  __syncthreads();
  int32_t* out = keys + i * width;
  int written = 0;
  for (int64_t w0 = row_min; w0 <= row_max; w0 += kKeyWindow) {
    for (int w = threadIdx.x; w < kWords; w += blockDim.x) bits[w] = 0u;
    __syncthreads();
    for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
      const int v = row[c];
      if (v >= w0 && v < w0 + kKeyWindow && in_doc(v)) {
        const int off = int(v - w0);
        atomicOr(&bits[off >> 5], 1u << (off & 31));
      }
    }
    __syncthreads();
    // Thread t owns the consecutive words [t·per, (t + 1)·per): a scan of their counts places
    // each thread's keys after those of the threads before it.
    const int per = kWords / int(blockDim.x), w_begin = int(threadIdx.x) * per;
    int mine = 0;
    for (int w = w_begin; w < w_begin + per; ++w) mine += __popc(bits[w]);
    int total = 0;
    int pos = written + block_exclusive_scan(mine, scratch, total);
    for (int w = w_begin; w < w_begin + per; ++w)
      for (uint32_t m = bits[w]; m != 0u; m &= m - 1u)
        out[pos++] = int32_t(w0 + 32 * w + __ffs(int(m)) - 1);
    written += total;
    __syncthreads();  // the bitmap is cleared for the next window only after every read
  }
  if (threadIdx.x == 0) counts[i] = written;
  for (int64_t c = written + threadIdx.x; c < width; c += blockDim.x) out[c] = -1;
}

// (key, pair id) pairs in query-major order, so a stable sort by key keeps each key's queries
// ascending; the unused tail of each row gets key `tokens`, which
// sorts after every real key.
__global__ void pairs_kernel(const int32_t* __restrict__ keys, const int32_t* __restrict__ counts,
                             int64_t tokens, int64_t width, int32_t* __restrict__ pair_key,
                             int32_t* __restrict__ pair_id) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= tokens * width) return;
  const int64_t i = e / width, c = e % width;
  pair_key[e] = c < counts[i] ? keys[e] : int32_t(tokens);
  pair_id[e] = int32_t(e);
}

// Query ids of the key-major pair ids (id = i·W + slot).
__global__ void pair_query_kernel(const int32_t* __restrict__ pair_ids, int64_t n, int64_t width,
                                  int32_t* __restrict__ queries) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < n) queries[e] = int32_t(pair_ids[e] / width);
}

__global__ void key_offsets_kernel(const int32_t* __restrict__ sorted_keys, int64_t n,
                                   int64_t tokens, int32_t* __restrict__ offsets) {
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j > tokens) return;
  offsets[j] = int32_t(detail::lower_bound(sorted_keys, n, j));
}

// ---- attention -------------------------------------------------------------------------------

// The N consecutive elements a lane owns, as fp32 (16-byte loads of bf16 when N is a multiple of
// 8; element loads for f32 storage).
template <int N, typename T>
__device__ __forceinline__ void load_lane(const T* p, float (&out)[N]) {
  if constexpr (std::is_same_v<T, bf16> && N % 8 == 0) {
#pragma unroll
    for (int c = 0; c < N / 8; ++c) {
      float t[8];
      detail::load_bf16x8(p + 8 * c, t);
#pragma unroll
      for (int e = 0; e < 8; ++e) out[8 * c + e] = t[e];
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = detail::to_f(p[e]);
  }
}

template <int N, typename T>
__device__ __forceinline__ void store_lane(T* p, const float (&in)[N]) {
  if constexpr (std::is_same_v<T, bf16> && N % 8 == 0) {
#pragma unroll
    for (int c = 0; c < N / 8; ++c) {
      float t[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) t[e] = in[8 * c + e];
      detail::store_bf16x8(p + 8 * c, t);
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) p[e] = detail::from_f<T>(in[e]);
  }
}

template <int N>
__device__ __forceinline__ float lane_dot(const float (&a)[N], const float (&b)[N]) {
  float s = 0.0f;
#pragma unroll
  for (int e = 0; e < N; ++e) s += a[e] * b[e];
  return s;
}

// Keys (or queries) gathered per step of the attention loops: more loads in flight, bounded by
// the registers the lane's slices of them take.
template <int EQ, int EV>
constexpr int kUnroll = EQ + EV >= 24 ? 2 : 4;

// T: the storage of q, k, v and of every output (bf16, or f32 in the fp32 mode).
template <typename T>
struct AttentionArgs {
  const T* q;
  const T* k;
  const T* v;
  const int32_t* keys;
  const int32_t* counts;
  int64_t width;
  int heads;
  float scale;
};

// This lane's slices of k and v for the row's keys c .. c + U − 1 (key ids kr, n of them) at head
// h, all loads issued before any is used. Keys past the row's end repeat key c, so every load is in
// bounds; the callers give them weight 0. The forward and the dq pass load alike.
template <int EQ, int EV, int U, typename T>
__device__ __forceinline__ void load_key_block(const AttentionArgs<T>& a, const int32_t* kr, int c,
                                               int n, int h, int lane, float (&kv)[U][EQ],
                                               float (&vv)[U][EV]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t kh = int64_t(kr[c + u < n ? c + u : c]) * a.heads + h;
    load_lane<EQ>(a.k + kh * (EQ * 32) + lane * EQ, kv[u]);
    load_lane<EV>(a.v + kh * (EV * 32) + lane * EV, vv[u]);
  }
}

// The warp's work in the attention kernels: row blockIdx.x (a query, or a key in dkdv) at head
// kHeadsPerBlock·blockIdx.y + warp. The grid rounds the heads up, so the head may lie past the
// last: the caller returns then.
struct WarpRowHead {
  int lane;
  int64_t row;
  int h;
};
__device__ __forceinline__ WarpRowHead warp_row_head() {
  return {int(threadIdx.x & 31), blockIdx.x, int(blockIdx.y * kHeadsPerBlock + (threadIdx.x >> 5))};
}

// EQ = Dqk/32 and EV = Dv/32 elements per lane. One warp per (query, head).
template <int EQ, int EV, typename T>
__global__ void __launch_bounds__(kHeadsPerBlock * 32)
    sparse_forward_kernel(AttentionArgs<T> a, T* __restrict__ out, float* __restrict__ lse) {
  const auto [lane, i, h] = warp_row_head();
  if (h >= a.heads) return;
  const int64_t qh = i * a.heads + h;
  float q[EQ], acc[EV] = {};
  load_lane<EQ>(a.q + qh * (EQ * 32) + lane * EQ, q);
  float m = -INFINITY, l = 0.0f;
  const int n = a.counts[i];
  const int32_t* kr = a.keys + i * a.width;
  // kUnroll keys per step: their loads are all in flight before the first use. Keys past the
  // row's end repeat its first key and get score −∞ (weight 0), so the order of the updates, and
  // with it every rounding, depends on the row alone.
  constexpr int U = kUnroll<EQ, EV>;
  for (int c = 0; c < n; c += U) {
    float kv[U][EQ], vv[U][EV], s[U];
    load_key_block<EQ, EV>(a, kr, c, n, h, lane, kv, vv);
#pragma unroll
    for (int u = 0; u < U; ++u) s[u] = detail::warp_sum(lane_dot(q, kv[u])) * a.scale;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const float su = c + u < n ? s[u] : -INFINITY;
      const float m_new = fmaxf(m, su);
      const float corr = expf(m - m_new);
      const float p = expf(su - m_new);
      l = l * corr + p;
#pragma unroll
      for (int e = 0; e < EV; ++e) acc[e] = acc[e] * corr + p * vv[u][e];
      m = m_new;
    }
  }
  const float inv = n > 0 ? 1.0f / l : 0.0f;
#pragma unroll
  for (int e = 0; e < EV; ++e) acc[e] *= inv;
  store_lane<EV>(out + qh * (EV * 32) + lane * EV, acc);
  if (lane == 0) lse[qh] = n > 0 ? m + logf(l) : 0.0f;
}

template <typename T>
struct BackwardArgs {
  AttentionArgs<T> fwd;
  const T* out;
  const T* dout;
  const float* lse;
  float* delta;
};

// delta_i = dO_i·o_i, then dq_i = scale Σ_j p_ij (dO_i·v_j − delta_i) k_j over the row's keys.
template <int EQ, int EV, typename T>
__global__ void __launch_bounds__(kHeadsPerBlock * 32)
    sparse_dq_kernel(BackwardArgs<T> b, T* __restrict__ dq) {
  const AttentionArgs<T>& a = b.fwd;
  const auto [lane, i, h] = warp_row_head();
  if (h >= a.heads) return;
  const int64_t qh = i * a.heads + h;
  float q[EQ], go[EV], o[EV], acc[EQ] = {};
  load_lane<EQ>(a.q + qh * (EQ * 32) + lane * EQ, q);
  load_lane<EV>(b.dout + qh * (EV * 32) + lane * EV, go);
  load_lane<EV>(b.out + qh * (EV * 32) + lane * EV, o);
  const float delta = detail::warp_sum(lane_dot(go, o));
  if (lane == 0) b.delta[qh] = delta;
  const float row_lse = b.lse[qh];
  const int n = a.counts[i];
  const int32_t* kr = a.keys + i * a.width;
  constexpr int U = kUnroll<EQ, EV>;
  for (int c = 0; c < n; c += U) {
    float kv[U][EQ], vv[U][EV], s[U], dp[U];
    load_key_block<EQ, EV>(a, kr, c, n, h, lane, kv, vv);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      s[u] = detail::warp_sum(lane_dot(q, kv[u])) * a.scale;
      dp[u] = detail::warp_sum(lane_dot(go, vv[u]));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const float ds = c + u < n ? expf(s[u] - row_lse) * (dp[u] - delta) : 0.0f;
#pragma unroll
      for (int e = 0; e < EQ; ++e) acc[e] += ds * kv[u][e];
    }
  }
#pragma unroll
  for (int e = 0; e < EQ; ++e) acc[e] *= a.scale;
  store_lane<EQ>(dq + qh * (EQ * 32) + lane * EQ, acc);
}

// dk_j = scale Σ_i p_ij (dO_i·v_j − delta_i) q_i and dv_j = Σ_i p_ij dO_i over the queries that
// selected key j, in ascending query order. One warp per (key, head).
template <int EQ, int EV, typename T>
__global__ void __launch_bounds__(kHeadsPerBlock * 32)
    sparse_dkdv_kernel(BackwardArgs<T> b, const int32_t* __restrict__ key_offsets,
                       const int32_t* __restrict__ key_queries, T* __restrict__ dk,
                       T* __restrict__ dv) {
  const AttentionArgs<T>& a = b.fwd;
  const auto [lane, j, h] = warp_row_head();
  if (h >= a.heads) return;
  const int64_t kh = j * a.heads + h;
  float kv[EQ], vv[EV], dk_acc[EQ] = {}, dv_acc[EV] = {};
  load_lane<EQ>(a.k + kh * (EQ * 32) + lane * EQ, kv);
  load_lane<EV>(a.v + kh * (EV * 32) + lane * EV, vv);
  constexpr int U = kUnroll<EQ, EV>;
  const int c0 = key_offsets[j], c1 = key_offsets[j + 1];
  for (int c = c0; c < c1; c += U) {
    float q[U][EQ], go[U][EV], s[U], dp[U], row_lse[U], row_delta[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t qh = int64_t(key_queries[c + u < c1 ? c + u : c]) * a.heads + h;
      load_lane<EQ>(a.q + qh * (EQ * 32) + lane * EQ, q[u]);
      load_lane<EV>(b.dout + qh * (EV * 32) + lane * EV, go[u]);
      row_lse[u] = b.lse[qh];
      row_delta[u] = b.delta[qh];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      s[u] = detail::warp_sum(lane_dot(q[u], kv)) * a.scale;
      dp[u] = detail::warp_sum(lane_dot(go[u], vv));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const float p = c + u < c1 ? expf(s[u] - row_lse[u]) : 0.0f;
      const float ds = p * (dp[u] - row_delta[u]);
#pragma unroll
      for (int e = 0; e < EQ; ++e) dk_acc[e] += ds * q[u][e];
#pragma unroll
      for (int e = 0; e < EV; ++e) dv_acc[e] += p * go[u][e];
    }
  }
#pragma unroll
  for (int e = 0; e < EQ; ++e) dk_acc[e] *= a.scale;
  store_lane<EQ>(dk + kh * (EQ * 32) + lane * EQ, dk_acc);
  store_lane<EV>(dv + kh * (EV * 32) + lane * EV, dv_acc);
}

// Calls f(EQ, EV) as integral constants for the supported head dimensions.
template <typename F>
void dispatch_dims(int64_t dqk, int64_t dv, F&& f) {
  using std::integral_constant;
  if (dqk == 32 && dv == 32)
    f(integral_constant<int, 1>{}, integral_constant<int, 1>{});
  else if (dqk == 64 && dv == 64)
    f(integral_constant<int, 2>{}, integral_constant<int, 2>{});
  else if (dqk == 128 && dv == 128)
    f(integral_constant<int, 4>{}, integral_constant<int, 4>{});
  else if (dqk == 256 && dv == 256)
    f(integral_constant<int, 8>{}, integral_constant<int, 8>{});
  else if (dqk == 512 && dv == 512)
    f(integral_constant<int, 16>{}, integral_constant<int, 16>{});
  else if (dqk == 128 && dv == 64)
    f(integral_constant<int, 4>{}, integral_constant<int, 2>{});
  else
    GLMTUNE_CUDA_OP_REQUIRE(false, "cuda sparse attention: head dims (" + std::to_string(dqk) +
                                       ", " + std::to_string(dv) + ") are not supported");
}

void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(
      q.defined() && q.dim() == 3 && (q.dtype() == DType::bf16 || q.dtype() == DType::f32) &&
          q.is_contiguous() && q.device().is_cuda() && detail::aligned16(q.data_ptr()),
      std::string(op) + ": q must be contiguous bf16 or f32 [T, NH, Dqk] on the GPU, got " +
          detail::describe(q));
  GLMTUNE_CUDA_OP_REQUIRE(
      k.defined() && k.shape() == q.shape() && k.dtype() == q.dtype() && k.is_contiguous() &&
          k.device() == q.device() && detail::aligned16(k.data_ptr()),
      std::string(op) + ": k " + detail::describe(k) + " must match q " + q.str());
  GLMTUNE_CUDA_OP_REQUIRE(v.defined() && v.dim() == 3 && v.size(0) == q.size(0) &&
                              v.size(1) == q.size(1) && v.dtype() == q.dtype() &&
                              v.is_contiguous() && v.device() == q.device() &&
                              detail::aligned16(v.data_ptr()),
                          std::string(op) + ": v " + detail::describe(v) +
                              " must be contiguous [T, NH, Dv] of q's dtype and like q " + q.str());
}

void check_sets(const SparseKeySets& sets, int64_t tokens, bool key_major, const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(
      sets.keys.defined() && sets.keys.dim() == 2 && sets.keys.size(0) == tokens &&
          sets.counts.defined() && sets.counts.numel() == tokens,
      std::string(op) + ": key sets do not match " + std::to_string(tokens) + " queries");
  if (key_major)
    GLMTUNE_CUDA_OP_REQUIRE(sets.key_offsets.defined() && sets.key_queries.defined() &&
                                sets.key_offsets.numel() == tokens + 1,
                            std::string(op) + ": the key sets lack the key-major pairs");
}

template <typename T>
AttentionArgs<T> attention_args(const Tensor& q, const Tensor& k, const Tensor& v,
                                const SparseKeySets& sets, double scale) {
  return AttentionArgs<T>{static_cast<const T*>(q.data_ptr()),
                          static_cast<const T*>(k.data_ptr()),
                          static_cast<const T*>(v.data_ptr()),
                          sets.keys.data<int32_t>(),
                          sets.counts.data<int32_t>(),
                          sets.keys.size(1),
                          int(q.size(1)),
                          float(scale)};
}

// Calls f(T*) with a null pointer of the storage type of `dtype` (bf16 or f32).
template <typename F>
void dispatch_storage(DType dtype, F&& f) {
  if (dtype == DType::f32)
    f(static_cast<float*>(nullptr));
  else
    f(static_cast<bf16*>(nullptr));
}

unsigned blocks_for(int64_t n) { return unsigned((n + kThreads - 1) / kThreads); }

const char* const kIndexError =
    "cuda sparse attention: an index lies outside its query's document (or is negative and not "
    "−1)";

// A pinned host word and an event recorded after the copy into it, per device, kept for reuse:
// cudaHostAlloc may synchronise the device, so it runs only while the pool grows (once or twice).
struct FlagSlot {
  int* host = nullptr;
  cudaEvent_t copied = nullptr;
};
std::mutex g_flag_mu;
std::map<int, std::vector<FlagSlot>> g_free_flags;  // by device; never released

FlagSlot take_flag(int device) {
  {
    std::lock_guard<std::mutex> lock(g_flag_mu);
    std::vector<FlagSlot>& free = g_free_flags[device];
    if (!free.empty()) {
      const FlagSlot f = free.back();
      free.pop_back();
      return f;
    }
  }
  FlagSlot f;
  GLMTUNE_CUDA_CHECK(
      cudaHostAlloc(reinterpret_cast<void**>(&f.host), sizeof(int), cudaHostAllocDefault));
  GLMTUNE_CUDA_CHECK(cudaEventCreateWithFlags(&f.copied, cudaEventDisableTiming));
  return f;
}

}  // namespace

struct PendingIndexCheck {
  int device = 0;
  FlagSlot flag;
  Tensor error;  // the device flag, held until its copy has landed
  ~PendingIndexCheck() {
    // The copy may still be queued: the slot is reused only once it has landed.
    cudaEventSynchronize(flag.copied);
    std::lock_guard<std::mutex> lock(g_flag_mu);
    g_free_flags[device].push_back(flag);
  }
};

void require_valid_indices(const SparseKeySets& sets) {
  if (!sets.pending) return;
  GLMTUNE_CUDA_CHECK(cudaEventSynchronize(sets.pending->flag.copied));
  GLMTUNE_CUDA_OP_REQUIRE(*sets.pending->flag.host == 0, kIndexError);
}

SparseKeySets sparse_key_sets(const Tensor& indices, const Tensor& cu_seqlens, bool key_major,
                              cudaStream_t stream, IndexCheck check) {
  GLMTUNE_CUDA_OP_REQUIRE(indices.defined() && indices.dim() == 2 &&
                              indices.dtype() == DType::i32 && indices.is_contiguous() &&
                              indices.device().is_cuda(),
                          "cuda::sparse_key_sets: indices must be contiguous int32 [T, W] on the "
                          "GPU, got " +
                              detail::describe(indices));
  const Device dev = indices.device();
  const int64_t tokens = indices.size(0), width = indices.size(1);
  GLMTUNE_CUDA_OP_REQUIRE(width <= kMaxRowWidth && tokens * width < int64_t(INT32_MAX),
                          "cuda::sparse_key_sets: rows of " + std::to_string(width) +
                              " entries over " + std::to_string(tokens) + " tokens are too large");
  const std::vector<int64_t> bounds =
      ops::read_cu_seqlens(cu_seqlens, tokens, "cuda sparse attention");
  detail::DeviceGuard guard(dev.index);
  SparseKeySets s;
  s.keys = Tensor::empty({tokens, width}, DType::i32, dev);
  s.counts = Tensor::empty({tokens}, DType::i32, dev);
  if (key_major) s.key_offsets = Tensor::empty({tokens + 1}, DType::i32, dev);
  if (tokens == 0 || width == 0) {
    if (tokens > 0) GLMTUNE_CUDA_CHECK(cudaMemsetAsync(s.counts.data_ptr(), 0, 4 * tokens, stream));
    if (key_major) {
      GLMTUNE_CUDA_CHECK(cudaMemsetAsync(s.key_offsets.data_ptr(), 0, 4 * (tokens + 1), stream));
      s.key_queries = Tensor::empty({1}, DType::i32, dev);
      s.key_pairs = Tensor::empty({1}, DType::i32, dev);
    }
    return s;
  }
  Tensor cu = Tensor::empty({int64_t(bounds.size())}, DType::i64, dev);
  GLMTUNE_CUDA_CHECK(cudaMemcpyAsync(cu.data_ptr(), bounds.data(), bounds.size() * sizeof(int64_t),
                                     cudaMemcpyHostToDevice, stream));
  Tensor error = Tensor::zeros({1}, DType::i32, dev);
  key_set_kernel<<<unsigned(tokens), kThreads, 0, stream>>>(
      indices.data<int32_t>(), width, cu.data<int64_t>(), int(bounds.size()) - 1,
      s.keys.data<int32_t>(), s.counts.data<int32_t>(), error.data<int32_t>());
  GLMTUNE_CUDA_CHECK_LAUNCH();
  if (check == IndexCheck::deferred) {
    auto pending = std::make_shared<PendingIndexCheck>();
    pending->device = dev.index;
    pending->flag = take_flag(dev.index);
    pending->error = error;
    GLMTUNE_CUDA_CHECK(cudaMemcpyAsync(pending->flag.host, error.data_ptr(), sizeof(int),
                                       cudaMemcpyDeviceToHost, stream));
    GLMTUNE_CUDA_CHECK(cudaEventRecord(pending->flag.copied, stream));
    s.pending = std::move(pending);
  } else {
    int flag = 0;
    GLMTUNE_CUDA_CHECK(
        cudaMemcpyAsync(&flag, error.data_ptr(), sizeof(int), cudaMemcpyDeviceToHost, stream));
    GLMTUNE_CUDA_CHECK(cudaStreamSynchronize(stream));
    GLMTUNE_CUDA_OP_REQUIRE(flag == 0, kIndexError);
  }
  if (!key_major) return s;

  const int64_t n = tokens * width;
  Tensor pair_key = Tensor::empty({n}, DType::i32, dev);
  Tensor pair_id = Tensor::empty({n}, DType::i32, dev);
  Tensor sorted_key = Tensor::empty({n}, DType::i32, dev);
  s.key_queries = Tensor::empty({n}, DType::i32, dev);
  s.key_pairs = Tensor::empty({n}, DType::i32, dev);
  pairs_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
      s.keys.data<int32_t>(), s.counts.data<int32_t>(), tokens, width, pair_key.data<int32_t>(),
      pair_id.data<int32_t>());
  GLMTUNE_CUDA_CHECK_LAUNCH();
  int end_bit = 1;
  while ((int64_t(1) << end_bit) <= tokens) ++end_bit;
  size_t temp_bytes = 0;
  GLMTUNE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, temp_bytes, pair_key.data<int32_t>(), sorted_key.data<int32_t>(),
      pair_id.data<int32_t>(), s.key_pairs.data<int32_t>(), int(n), 0, end_bit, stream));
  Tensor temp = Tensor::empty({int64_t(temp_bytes / 8) + 1}, DType::i64, dev);
  GLMTUNE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      temp.data_ptr(), temp_bytes, pair_key.data<int32_t>(), sorted_key.data<int32_t>(),
      pair_id.data<int32_t>(), s.key_pairs.data<int32_t>(), int(n), 0, end_bit, stream));
  key_offsets_kernel<<<blocks_for(tokens + 1), kThreads, 0, stream>>>(
      sorted_key.data<int32_t>(), n, tokens, s.key_offsets.data<int32_t>());
  GLMTUNE_CUDA_CHECK_LAUNCH();
  pair_query_kernel<<<blocks_for(n), kThreads, 0, stream>>>(s.key_pairs.data<int32_t>(), n, width,
                                                            s.key_queries.data<int32_t>());
  GLMTUNE_CUDA_CHECK_LAUNCH();
  return s;
}

SparseAttentionOutput sparse_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                               const SparseKeySets& sets, double scale,
                                               cudaStream_t stream) {
  check_qkv(q, k, v, "cuda::sparse_attention_forward");
  const int64_t tokens = q.size(0), heads = q.size(1);
  check_sets(sets, tokens, false, "cuda::sparse_attention_forward");
  detail::DeviceGuard guard(q.device().index);
  SparseAttentionOutput r;
  r.out = Tensor::empty({tokens, heads, v.size(2)}, q.dtype(), q.device());
  r.lse = Tensor::empty({tokens, heads}, DType::f32, q.device());
  if (tokens == 0 || heads == 0) return r;
  const dim3 grid(unsigned(tokens), unsigned((heads + kHeadsPerBlock - 1) / kHeadsPerBlock));
  dispatch_storage(q.dtype(), [&]<typename T>(T*) {
    const AttentionArgs<T> a = attention_args<T>(q, k, v, sets, scale);
    dispatch_dims(q.size(2), v.size(2), [&](auto eq, auto ev) {
      sparse_forward_kernel<decltype(eq)::value, decltype(ev)::value, T>
          <<<grid, kHeadsPerBlock * 32, 0, stream>>>(a, static_cast<T*>(r.out.data_ptr()),
                                                     r.lse.data<float>());
    });
  });
  GLMTUNE_CUDA_CHECK_LAUNCH();
  return r;
}

ops::AttentionGrads sparse_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const Tensor& out, const Tensor& lse,
                                              const SparseKeySets& sets, double scale,
                                              const Tensor& dout, cudaStream_t stream) {
  const char* op = "cuda::sparse_attention_backward";
  check_qkv(q, k, v, op);
  const int64_t tokens = q.size(0), heads = q.size(1);
  check_sets(sets, tokens, true, op);
  const Shape out_shape{tokens, heads, v.size(2)};
  GLMTUNE_CUDA_OP_REQUIRE(out.defined() && out.shape() == out_shape && out.dtype() == q.dtype() &&
                              out.is_contiguous() && dout.defined() && dout.shape() == out_shape &&
                              dout.dtype() == q.dtype() && dout.is_contiguous() && lse.defined() &&
                              lse.dtype() == DType::f32 && lse.numel() == tokens * heads,
                          std::string(op) + ": out / dout must be " +
                              std::string(dtype_name(q.dtype())) + " " + shape_str(out_shape) +
                              " like q and lse f32 [T, NH]");
  detail::DeviceGuard guard(q.device().index);
  ops::AttentionGrads g;
  g.q = Tensor::empty(q.shape(), q.dtype(), q.device());
  g.k = Tensor::empty(k.shape(), q.dtype(), q.device());
  g.v = Tensor::empty(v.shape(), q.dtype(), q.device());
  if (tokens == 0 || heads == 0) return g;
  Tensor delta = Tensor::empty({tokens, heads}, DType::f32, q.device());
  const dim3 grid(unsigned(tokens), unsigned((heads + kHeadsPerBlock - 1) / kHeadsPerBlock));
  dispatch_storage(q.dtype(), [&]<typename T>(T*) {
    const BackwardArgs<T> b{
        attention_args<T>(q, k, v, sets, scale), static_cast<const T*>(out.data_ptr()),
        static_cast<const T*>(dout.data_ptr()), lse.data<float>(), delta.data<float>()};
    dispatch_dims(q.size(2), v.size(2), [&](auto eq, auto ev) {
      constexpr int EQ = decltype(eq)::value, EV = decltype(ev)::value;
      sparse_dq_kernel<EQ, EV, T>
          <<<grid, kHeadsPerBlock * 32, 0, stream>>>(b, static_cast<T*>(g.q.data_ptr()));
      GLMTUNE_CUDA_CHECK_LAUNCH();
      sparse_dkdv_kernel<EQ, EV, T><<<grid, kHeadsPerBlock * 32, 0, stream>>>(
          b, sets.key_offsets.data<int32_t>(), sets.key_queries.data<int32_t>(),
          static_cast<T*>(g.k.data_ptr()), static_cast<T*>(g.v.data_ptr()));
      GLMTUNE_CUDA_CHECK_LAUNCH();
    });
  });
  return g;
}

}  // namespace glmtune::cuda
