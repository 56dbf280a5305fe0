// The NCCL collectives of a distributed GPU run, one process per GPU (docs/distributed.md):
//
//   mpirun -np 2 bench/bench_cuda_nccl            (or srun; one rank per GPU of a node)
//
// 1. Expert-parallel dispatch: the all-to-all that sends each token's routed rows to the rank
//    holding its expert (hidden 4096, bf16, top-8 of 288 experts spread evenly over the ranks,
//    seeded random routing, so the counts are uneven as in training), at 4096 and 16384 tokens
//    per rank; the reverse (combine) is the same exchange transposed.
// 2. FSDP overlap: a decoder layer's bf16 weights all-gathered, and its f32 gradients
//    reduce-scattered, over every rank, alone and while the compute stream runs bf16 GEMMs of the
//    step's shape (16384 × 4096 × 4096): the overlap is the share of the shorter of the two that
//    disappears when both run at once.
// 3. The all-reduce bus bandwidth of the same ranks, as the links' ceiling for 1 and 2.
// Rank 0 prints the table. A single rank prints why there is nothing to measure and exits 0.

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "cuda_bench.h"
#include "glmtune/dist/parallel.h"
#include "glmtune/ops/cuda/gemm.h"
#include "glmtune/tensor/cuda_check.h"

using namespace glmtune;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Median wall time of `iters` runs of a collective (each call returns once it completed) after
// one warm-up, with every rank starting together.
double median_collective_ms(dist::Communicator& host, const std::function<void()>& fn, int iters) {
  fn();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    host.barrier();
    const auto t0 = Clock::now();
    fn();
    ms.push_back(seconds_since(t0) * 1e3);
  }
  std::sort(ms.begin(), ms.end());
  return host.all_reduce_max(ms[ms.size() / 2]);
}

struct Overlap {
  double comm_ms = 0, compute_ms = 0, both_ms = 0;
  double overlap() const {
    return (comm_ms + compute_ms - both_ms) / std::min(comm_ms, compute_ms);
  }
};

// The collective from a thread of its own while this thread queues `gemms` products on a
// non-blocking compute stream (so the collective, ordered after the legacy stream's work, never
// waits for them), then waits for both.
Overlap measure_overlap(dist::Communicator& host, const std::function<void()>& collective,
                        const Tensor& x, const Tensor& w, int gemms, int iters) {
  cudaStream_t compute;
  GLMTUNE_CUDA_CHECK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  Tensor y = Tensor::empty({x.size(0), w.size(0)}, DType::bf16, x.device());
  const auto run_gemms = [&] {
    for (int g = 0; g < gemms; ++g) cuda::linear_out(y, x, w, Tensor(), false, compute);
    GLMTUNE_CUDA_CHECK(cudaStreamSynchronize(compute));
  };
  Overlap o;
  o.comm_ms = median_collective_ms(host, collective, iters);
  o.compute_ms = median_collective_ms(host, run_gemms, iters);
  o.both_ms = median_collective_ms(
      host,
      [&] {
        std::thread comm(collective);
        run_gemms();
        comm.join();
      },
      iters);
  GLMTUNE_CUDA_CHECK(cudaStreamDestroy(compute));
  return o;
}

}  // namespace

int main() {
  std::unique_ptr<dist::ParallelContext> par = dist::ParallelContext::create({});
  const int ranks = par->sizes().world;
  if (ranks < 2) {
    std::printf(
        "bench_cuda_nccl: one rank, nothing to exchange; launch one rank per GPU, e.g. mpirun "
        "-np 2 %s\n",
        "bench/bench_cuda_nccl");
    return 0;
  }
  par->use_gpu(par->local_rank());
  const Device gpu = Device::cuda(par->local_rank());
  dist::Communicator& host = par->world();
  dist::Communicator& nccl = *par->dp_gpu();
  const bool root = par->is_root();
  if (root) {
    cudaDeviceProp prop{};
    GLMTUNE_CUDA_CHECK(cudaGetDeviceProperties(&prop, gpu.index));
    std::printf("bench_cuda_nccl: %d ranks (%d on this node), %s\n", ranks, par->local_size(),
                prop.name);
  }

  // 3 first: the links' ceiling. Bus bandwidth of an all-reduce: 2(P−1)/P · bytes / time.
  {
    const int64_t n = int64_t(256) << 20;  // 1 GiB of f32
    Tensor t = Tensor::zeros({n}, DType::f32, gpu);
    const double ms = median_collective_ms(
        host, [&] { nccl.all_reduce(t); }, 5);
    const double bus = 2.0 * (ranks - 1) / ranks * double(n) * 4 / (ms * 1e-3) / 1e9;
    if (root) std::printf("all_reduce 1 GiB f32: %.3f ms, bus bandwidth %.1f GB/s\n", ms, bus);
  }

  // 1. Dispatch all-to-all.
  const int64_t hidden = 4096, top_k = 8, experts = 288;
  for (int64_t tokens : {int64_t(4096), int64_t(16384)}) {
    std::mt19937_64 rng(20261129 + uint64_t(par->rank()));
    std::uniform_int_distribution<int64_t> pick(0, experts - 1);
    std::vector<int64_t> send(size_t(ranks), 0);
    for (int64_t r = 0; r < tokens * top_k; ++r) {
      const int64_t e = pick(rng);
      ++send[size_t(e * ranks / experts)];
    }
    Tensor send_t = Tensor::empty({ranks}, DType::i64);
    std::copy(send.begin(), send.end(), send_t.data<int64_t>());
    Tensor recv_t = Tensor::empty({ranks}, DType::i64);
    const std::vector<int64_t> ones(size_t(ranks), 1);
    host.all_to_all(send_t, ones, recv_t, ones);
    std::vector<int64_t> recv(recv_t.data<int64_t>(), recv_t.data<int64_t>() + ranks);
    std::vector<int64_t> send_el(send), recv_el(recv);
    for (auto& v : send_el) v *= hidden;
    for (auto& v : recv_el) v *= hidden;
    const int64_t rows_in = std::accumulate(recv.begin(), recv.end(), int64_t(0));
    Tensor rows = cudabench::random_gpu({tokens * top_k, hidden}, DType::bf16, 1, 1.0, 0.0, gpu);
    Tensor out = Tensor::empty({rows_in, hidden}, DType::bf16, gpu);
    const double ms = median_collective_ms(
        host, [&] { nccl.all_to_all(rows, send_el, out, recv_el); }, 10);
    // Bytes that leave this rank (its own rows stay) and the busiest rank's.
    const double leaving = double(tokens * top_k - send[size_t(par->rank())]) * hidden * 2;
    const double max_leaving = host.all_reduce_max(leaving);
    if (root)
      std::printf(
          "dispatch all_to_all, %ld tokens/rank × top-%ld × %ld bf16: %.3f ms, %.2f GB leave the "
          "busiest rank: %.1f GB/s\n",
          tokens, top_k, hidden, ms, max_leaving / 1e9, max_leaving / (ms * 1e-3) / 1e9);
  }

  // 2. FSDP: one decoder layer of 512 Mi parameters (about a crop25b MoE layer with 36 experts
  // and its attention), sharded over the ranks.
  {
    const int64_t layer = int64_t(512) << 20;
    const int64_t shard = layer / ranks;
    Tensor w_shard = cudabench::random_gpu({shard}, DType::bf16, 2, 1.0, 0.0, gpu);
    Tensor w_full = Tensor::empty({shard * ranks}, DType::bf16, gpu);
    Tensor g_full = cudabench::random_gpu({shard * ranks}, DType::f32, 3, 1.0, 0.0, gpu);
    Tensor g_shard = Tensor::empty({shard}, DType::f32, gpu);
    Tensor x = cudabench::random_gpu({16384, 4096}, DType::bf16, 4, 1.0, 0.0, gpu);
    Tensor w = cudabench::random_gpu({4096, 4096}, DType::bf16, 5, 0.02, 0.0, gpu);
    const int gemms = 8;
    const Overlap ag = measure_overlap(
        host, [&] { nccl.all_gather(w_shard, w_full); }, x, w, gemms, 5);
    const Overlap rs = measure_overlap(
        host, [&] { nccl.reduce_scatter(g_full, g_shard); }, x, w, gemms, 5);
    const double gemm_tflops = 2.0 * 16384 * 4096 * 4096 * gemms / (ag.compute_ms * 1e-3) / 1e12;
    if (root) {
      std::printf(
          "fsdp layer %ld Mi params over %d ranks; compute: %d GEMMs 16384x4096x4096 bf16 "
          "(%.0f TFLOP/s alone)\n",
          layer >> 20, ranks, gemms, gemm_tflops);
      std::printf("%-34s %10s %10s %10s %8s\n", "collective", "comm ms", "compute ms", "both ms",
                  "overlap");
      const auto row = [](const char* name, const Overlap& o) {
        std::printf("%-34s %10.3f %10.3f %10.3f %7.0f%%\n", name, o.comm_ms, o.compute_ms,
                    o.both_ms, 100 * o.overlap());
      };
      row("all_gather weights (bf16, 1 GiB)", ag);
      row("reduce_scatter grads (f32, 2 GiB)", rs);
    }
  }
  host.barrier();
  return 0;
}
