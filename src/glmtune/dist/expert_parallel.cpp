#include "glmtune/dist/expert_parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/dist/expert_exchange.h"
#include "glmtune/ops/cpu/moe_common.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/mlp.h"

namespace glmtune::dist {

detail::PairCounts detail::exchange_counts(Communicator& ep,
                                           std::span<const int64_t> send_per_expert,
                                           int64_t per_rank) {
  const int ranks = ep.size();
  const int64_t n_experts = int64_t(send_per_expert.size());
  GLMTUNE_ASSERT(n_experts == ranks * per_rank, "{} experts' pair counts for {} ranks of {}",
                 n_experts, ranks, per_rank);
  Tensor send_counts = Tensor::empty({n_experts}, DType::i64);
  std::copy(send_per_expert.begin(), send_per_expert.end(), send_counts.data<int64_t>());
  Tensor recv_counts = Tensor::empty({n_experts}, DType::i64);
  const std::vector<int64_t> block(size_t(ranks), per_rank);
  ep.all_to_all(send_counts, block, recv_counts, block);
  PairCounts c;
  c.send_pairs.assign(size_t(ranks), 0);
  c.recv_pairs.assign(size_t(ranks), 0);
  c.recv_per_expert.assign(recv_counts.data<int64_t>(), recv_counts.data<int64_t>() + n_experts);
  for (int q = 0; q < ranks; ++q)
    for (int64_t j = 0; j < per_rank; ++j) {
      c.send_pairs[size_t(q)] += send_per_expert[size_t(q * per_rank + j)];
      c.recv_pairs[size_t(q)] += c.recv_per_expert[size_t(q * per_rank + j)];
    }
  return c;
}

Tensor detail::exchange_rows(Communicator& group, const Tensor& rows, int64_t width,
                             const std::vector<int64_t>& send_pairs,
                             const std::vector<int64_t>& recv_pairs) {
  std::vector<int64_t> send_counts(send_pairs.size()), recv_counts(recv_pairs.size());
  for (size_t q = 0; q < send_pairs.size(); ++q) {
    send_counts[q] = send_pairs[q] * width;
    recv_counts[q] = recv_pairs[q] * width;
  }
  const int64_t total = std::accumulate(recv_pairs.begin(), recv_pairs.end(), int64_t(0));
  Tensor out = Tensor::empty({total, width}, rows.dtype(), rows.device());
  group.all_to_all(rows, send_counts, out, recv_counts);
  return out;
}

namespace {

// Who sends what to whom for one routing: the same on the forward and the backward of a layer.
struct Plan {
  // The (row·K + k) pairs in sending order: ascending expert (hence ascending owner rank), rows
  // ascending within an expert.
  std::vector<int64_t> slots;
  std::vector<int64_t> send_pairs;  // [ep] pairs to each rank
  std::vector<int64_t> recv_pairs;  // [ep] pairs from each rank
  // Received rows of each local expert as positions in the receive buffer, one block per sending
  // rank that has any (rank order), rows in the sender's order. Each block runs as its own GEMM:
  // a row's result then does not depend on which other ranks' rows share the call, and equals
  // the single-process value bit for bit (the same rows in the same order).
  std::vector<std::vector<std::vector<int64_t>>> local_rows;
};

Plan make_plan(Communicator& ep, const ops::Routing& routing, int64_t n_experts, int64_t per_rank) {
  const Tensor idx_t = routing.indices.contiguous();
  const int64_t pairs = idx_t.numel();
  const ops::cpu_detail::ExpertBuckets buckets =
      ops::cpu_detail::bucket_by_expert(idx_t.data<int32_t>(), pairs, n_experts);
  Plan p;
  p.slots = buckets.slot;
  std::vector<int64_t> per_expert(size_t(n_experts), 0);
  for (int64_t e = 0; e < n_experts; ++e)
    per_expert[size_t(e)] = buckets.start[size_t(e) + 1] - buckets.start[size_t(e)];
  detail::PairCounts counts = detail::exchange_counts(ep, per_expert, per_rank);
  p.send_pairs = std::move(counts.send_pairs);
  p.recv_pairs = std::move(counts.recv_pairs);
  p.local_rows.resize(size_t(per_rank));
  int64_t position = 0;
  for (int q = 0; q < ep.size(); ++q)
    for (int64_t j = 0; j < per_rank; ++j) {
      const int64_t n = counts.recv_per_expert[size_t(q * per_rank + j)];
      if (n == 0) continue;
      std::vector<int64_t>& block = p.local_rows[size_t(j)].emplace_back();
      for (int64_t r = 0; r < n; ++r) block.push_back(position++);
    }
  return p;
}

// Copies rows `which` of `src` (row length `width`, first `cols` elements) into a new [n, cols].
template <typename T>
Tensor gather_rows(const Tensor& src, const std::vector<int64_t>& which, int64_t col0,
                   int64_t cols) {
  const int64_t width = src.size(1);
  Tensor out = Tensor::empty({int64_t(which.size()), cols}, src.dtype());
  const T* s = src.data<T>();
  T* o = out.data<T>();
  for (size_t r = 0; r < which.size(); ++r)
    std::copy_n(s + which[r] * width + col0, cols, o + int64_t(r) * cols);
  return out;
}

// One expert's forward on stacked rows: h = x Wgu^T, a = swiglu(h), y = a Wd^T.
struct ExpertForward {
  Tensor h, act, y;
};

ExpertForward run_expert(const ops::MoeConfig& cfg, const ops::Linear& gate_up,
                         const ops::Linear& down, const Tensor& xe) {
  const int64_t inter = down.weight.size(1);
  ExpertForward f;
  f.h = ops::linear(xe, gate_up);
  f.act =
      ops::swiglu_clamped(f.h.narrow(1, 0, inter), f.h.narrow(1, inter, inter), cfg.swiglu_limit);
  f.y = ops::linear(f.act, down);
  return f;
}

template <typename T>
Tensor forward_impl(Communicator& ep, int64_t n_experts, int64_t per_rank,
                    const ops::MoeConfig& cfg, const ops::MoeParams& params, const Tensor& x_in,
                    const ops::Routing& routing) {
  const Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), dim = x.size(1), k = routing.indices.size(1);
  const Plan plan = make_plan(ep, routing, n_experts, per_rank);
  const int64_t pairs = int64_t(plan.slots.size());

  Tensor send = Tensor::empty({pairs, dim}, x.dtype());
  const T* xp = x.data<T>();
  for (int64_t i = 0; i < pairs; ++i)
    std::copy_n(xp + (plan.slots[size_t(i)] / k) * dim, dim, send.data<T>() + i * dim);
  const Tensor recv = detail::exchange_rows(ep, send, dim, plan.send_pairs, plan.recv_pairs);

  // The local experts on each sender's block of rows; results go back in place. Expert j's
  // projections are the single process's (ops::expert_projection): its weight slices, in FP8 where
  // the fused experts are marked (train.fp8), with its adapters where the experts have them. Each
  // sender's block runs as its own GEMM, so FP8 tiles never span two senders' rows, as in the
  // single process, whose tiles never span two packs' rows.
  Tensor reply = Tensor::empty(recv.shape(), x.dtype());
  for (int64_t j = 0; j < per_rank; ++j)
    for (const std::vector<int64_t>& which : plan.local_rows[size_t(j)]) {
      const ExpertForward f = run_expert(cfg, ops::expert_projection(params.gate_up_proj, j),
                                         ops::expert_projection(params.down_proj, j),
                                         gather_rows<T>(recv, which, 0, dim));
      const T* yp = f.y.data<T>();
      for (size_t r = 0; r < which.size(); ++r)
        std::copy_n(yp + int64_t(r) * dim, dim, reply.data<T>() + which[r] * dim);
    }
  const Tensor back = detail::exchange_rows(ep, reply, dim, plan.recv_pairs, plan.send_pairs);

  // Weighted combine in ascending expert order per row, as the single-process kernel sums.
  const Tensor w_t = routing.weights.contiguous();
  const T* w = w_t.data<T>();
  Tensor out = Tensor::zeros({rows, dim}, x.dtype());
  T* y = out.data<T>();
  const T* bp = back.data<T>();
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t slot = plan.slots[size_t(i)];
    const T wk = w[slot];
    T* yr = y + (slot / k) * dim;
    for (int64_t d = 0; d < dim; ++d) yr[d] += bp[i * dim + d] * wk;
  }
  return out;
}

template <typename T>
model::text::ExpertDispatch::Backward backward_impl(Communicator& ep, int64_t n_experts,
                                                    int64_t per_rank, const ops::MoeConfig& cfg,
                                                    const ops::MoeParams& params,
                                                    const Tensor& x_in, const ops::Routing& routing,
                                                    const Tensor& dy_in, ops::MoeParams& grads) {
  const Tensor x = x_in.contiguous();
  const Tensor dy = dy_in.contiguous();
  const int64_t rows = x.size(0), dim = x.size(1), k = routing.indices.size(1);
  // The local experts' gradient buffers, as the single-process backward keeps them: frozen
  // weights have none (the owners compute the input gradients and any adapter's only).
  ops::Linear gate_up = params.gate_up_proj, down = params.down_proj;
  const ops::Linear d_gate_up =
      ops::cpu_detail::fused_expert_grads(gate_up, grads.gate_up_proj, "experts.gate_up_proj");
  const ops::Linear d_down =
      ops::cpu_detail::fused_expert_grads(down, grads.down_proj, "experts.down_proj");
  const Plan plan = make_plan(ep, routing, n_experts, per_rank);
  const int64_t pairs = int64_t(plan.slots.size());
  const Tensor w_t = routing.weights.contiguous();
  const T* w = w_t.data<T>();

  // [x | dy | w] per pair.
  const int64_t width = 2 * dim + 1;
  Tensor send = Tensor::empty({pairs, width}, x.dtype());
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t slot = plan.slots[size_t(i)], row = slot / k;
    T* s = send.data<T>() + i * width;
    std::copy_n(x.data<T>() + row * dim, dim, s);
    std::copy_n(dy.data<T>() + row * dim, dim, s + dim);
    s[2 * dim] = w[slot];
  }
  const Tensor recv = detail::exchange_rows(ep, send, width, plan.send_pairs, plan.recv_pairs);

  // [dx | dw] per pair.
  const int64_t reply_width = dim + 1;
  Tensor reply = Tensor::empty({recv.size(0), reply_width}, x.dtype());
  const int64_t inter = down.weight.size(2);
  // An expert without tokens has no block and gets no gradient (as in the single process).
  for (int64_t j = 0; j < per_rank; ++j)
    for (const std::vector<int64_t>& which : plan.local_rows[size_t(j)]) {
      const int64_t n = int64_t(which.size());
      const ops::Linear wgu = ops::expert_projection(gate_up, j);
      const ops::Linear wd = ops::expert_projection(down, j);
      const Tensor xe = gather_rows<T>(recv, which, 0, dim);
      const Tensor dyr = gather_rows<T>(recv, which, dim, dim);
      const ExpertForward f = run_expert(cfg, wgu, wd, xe);
      // y_row += w · ye: dw = ⟨dy_row, ye⟩, dye = w · dy_row.
      Tensor dye = Tensor::empty({n, dim}, x.dtype());
      T* reply_p = reply.data<T>();
      for (int64_t r = 0; r < n; ++r) {
        const T wk = recv.data<T>()[which[size_t(r)] * width + 2 * dim];
        const T* dyp = dyr.data<T>() + r * dim;
        const T* yp = f.y.data<T>() + r * dim;
        T dot = T(0);
        for (int64_t d = 0; d < dim; ++d) {
          dot += dyp[d] * yp[d];
          dye.data<T>()[r * dim + d] = wk * dyp[d];
        }
        reply_p[which[size_t(r)] * reply_width + dim] = dot;
      }
      ops::Linear d_down_e = ops::cpu_detail::expert_grads(d_down, j);
      const Tensor d_act = ops::linear_backward(dye, f.act, wd, &d_down_e);
      Tensor dh = Tensor::empty({n, 2 * inter}, x.dtype());
      Tensor dhg = dh.narrow(1, 0, inter), dhu = dh.narrow(1, inter, inter);
      ops::swiglu_clamped_backward(f.h.narrow(1, 0, inter), f.h.narrow(1, inter, inter), d_act,
                                   cfg.swiglu_limit, dhg, dhu);
      ops::Linear d_gate_up_e = ops::cpu_detail::expert_grads(d_gate_up, j);
      const Tensor dxe = ops::linear_backward(dh, xe, wgu, &d_gate_up_e);
      for (int64_t r = 0; r < n; ++r)
        std::copy_n(dxe.data<T>() + r * dim, dim, reply_p + which[size_t(r)] * reply_width);
    }
  const Tensor back =
      detail::exchange_rows(ep, reply, reply_width, plan.recv_pairs, plan.send_pairs);

  model::text::ExpertDispatch::Backward out;
  out.dx = Tensor::zeros({rows, dim}, x.dtype());
  out.d_weights = Tensor::zeros({rows, k}, x.dtype());
  T* dx = out.dx.data<T>();
  T* dw = out.d_weights.data<T>();
  const T* bp = back.data<T>();
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t slot = plan.slots[size_t(i)];
    T* dxr = dx + (slot / k) * dim;
    for (int64_t d = 0; d < dim; ++d) dxr[d] += bp[i * reply_width + d];
    dw[slot] = bp[i * reply_width + dim];
  }
  return out;
}

void check_inputs(int64_t n_experts, int64_t per_rank, int64_t first, const ops::MoeConfig& cfg,
                  const ops::MoeParams& params, const Tensor& x, const ops::Routing& routing) {
  GLMTUNE_ASSERT(cfg.n_experts == n_experts,
                 "expert parallelism was set up for {} experts, the layer has {}", n_experts,
                 cfg.n_experts);
  GLMTUNE_ASSERT(x.defined() && x.dim() == 2 && x.device().is_cpu() &&
                     (x.dtype() == DType::f32 || x.dtype() == DType::f64),
                 "expert parallelism runs on CPU [T, D] inputs in f32 or f64, got {}",
                 x.defined() ? x.str() : std::string("undefined"));
  GLMTUNE_ASSERT(params.gate_up_proj.weight.defined() && params.down_proj.weight.defined() &&
                     params.gate_up_proj.weight.size(0) == per_rank &&
                     params.down_proj.weight.size(0) == per_rank &&
                     params.gate_up_proj.weight.dtype() == x.dtype() &&
                     params.down_proj.weight.dtype() == x.dtype(),
                 "experts gate_up_proj / down_proj must hold this rank's {} experts ({} onwards, "
                 "expert_shards.h) in {}",
                 per_rank, first, x.str());
  ops::check_expert_adapter(params.gate_up_proj, "gate_up_proj");
  ops::check_expert_adapter(params.down_proj, "down_proj");
  ops::cpu_detail::check_experts_routing(routing, x);
}

}  // namespace

ExpertParallel::ExpertParallel(Communicator& ep, int64_t n_experts, const std::string& where,
                               Communicator* device_group)
    : ep_(ep), device_group_(device_group), n_experts_(n_experts) {
  GLMTUNE_ASSERT(device_group == nullptr ||
                     (device_group->size() == ep.size() && device_group->rank() == ep.rank()),
                 "the device group '{}' must hold the ranks of '{}' in the same order",
                 device_group ? device_group->name() : std::string(), ep.name());
  if (n_experts <= 0 || n_experts % ep.size() != 0)
    throw Error(fmt::format("{} routed experts do not split over {} expert-parallel ranks",
                            n_experts, ep.size()),
                where, fmt::format("set train.ep_size to a divisor of {}", n_experts));
  per_rank_ = n_experts / ep.size();
  first_ = per_rank_ * ep.rank();
}

Communicator& ExpertParallel::device_group(const Tensor& x) const {
  GLMTUNE_ASSERT(
      device_group_ != nullptr,
      "expert parallelism on {} needs a device group over '{}' (ParallelContext::use_gpu)",
      x.device().str(), ep_.name());
  return *device_group_;
}

Tensor ExpertParallel::forward(const ops::MoeConfig& cfg, const ops::MoeParams& params,
                               const Tensor& x, const ops::Routing& routing) const {
#ifdef GLMTUNE_WITH_CUDA
  if (x.defined() && x.device().is_cuda())
    return detail::forward_on_device(ep_, device_group(x), n_experts_, per_rank_, cfg, params, x,
                                     routing);
#endif
  check_inputs(n_experts_, per_rank_, first_, cfg, params, x, routing);
  if (x.dtype() == DType::f32)
    return forward_impl<float>(ep_, n_experts_, per_rank_, cfg, params, x, routing);
  return forward_impl<double>(ep_, n_experts_, per_rank_, cfg, params, x, routing);
}

model::text::ExpertDispatch::Backward ExpertParallel::backward(
    const ops::MoeConfig& cfg, const ops::MoeParams& params, const Tensor& x,
    const ops::Routing& routing, const Tensor& dy, ops::MoeParams& grads) const {
#ifdef GLMTUNE_WITH_CUDA
  if (x.defined() && x.device().is_cuda())
    return detail::backward_on_device(ep_, device_group(x), n_experts_, per_rank_, cfg, params, x,
                                      routing, dy, grads);
#endif
  check_inputs(n_experts_, per_rank_, first_, cfg, params, x, routing);
  GLMTUNE_ASSERT(dy.defined() && dy.shape() == x.shape() && dy.dtype() == x.dtype(),
                 "expert-parallel backward: dy {} must match the input {}",
                 dy.defined() ? dy.str() : std::string("undefined"), x.str());
  if (x.dtype() == DType::f32)
    return backward_impl<float>(ep_, n_experts_, per_rank_, cfg, params, x, routing, dy, grads);
  return backward_impl<double>(ep_, n_experts_, per_rank_, cfg, params, x, routing, dy, grads);
}

}  // namespace glmtune::dist
