#include "glmtune/dist/sharded_optimizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "glmtune/base/error.h"
#include "glmtune/dist/sharded_optimizer_device.h"

namespace glmtune::dist {
namespace {

struct Layout {
  std::vector<int64_t> offsets;
  int64_t total = 0, shard = 0, begin = 0;
};

Layout flat_layout(const std::vector<train::NamedParam>& params, int ranks, int rank) {
  Layout l;
  l.offsets.assign(params.size(), -1);
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].trainable) continue;
    l.offsets[i] = l.total;
    l.total += params[i].value.numel();
  }
  l.shard = (l.total + ranks - 1) / ranks;
  l.begin = l.shard * rank;
  return l;
}

}  // namespace

Tensor gather_pieces(Communicator& group, const Tensor& piece, int64_t begin, int64_t n, int root) {
  GLMTUNE_ASSERT(piece.dim() == 2, "pieces are [rows, length], got {}", piece.str());
  const DType dtype = piece.dtype();
  const int ranks = group.size();
  const int64_t rows = piece.size(0), length = piece.size(1);
  GLMTUNE_ASSERT(begin >= 0 && begin + length <= n, "piece [{}, {}) of a vector of {}", begin,
                 begin + length, n);
  // Where each rank's piece goes.
  Tensor where = Tensor::from_vector<int64_t>({begin, length}, {2});
  Tensor all_where = Tensor::empty({ranks, 2}, DType::i64);
  group.all_gather(where, all_where);
  const int64_t* w = all_where.data<int64_t>();
  const bool here = group.rank() == root;
  std::vector<int64_t> send(size_t(ranks), 0), receive(size_t(ranks), 0);
  send[size_t(root)] = rows * length;
  int64_t received = 0;
  if (here)
    for (int r = 0; r < ranks; ++r) received += receive[size_t(r)] = rows * w[2 * r + 1];
  // One element at least: the buffers are passed to the transport even when nothing moves.
  Tensor in;
  if (length > 0 && piece.is_contiguous()) {
    in = piece.reshape({-1});
  } else {
    in = Tensor::empty({std::max<int64_t>(rows * length, 1)}, dtype);
    if (length > 0) in.narrow(0, 0, rows * length).view({rows, length}).copy_(piece);
  }
  Tensor out = Tensor::empty({std::max<int64_t>(received, 1)}, dtype);
  group.all_to_all(in, send, out, receive);
  if (!here) return Tensor();
  // Pieces of one row that follow each other in rank order and cover the vector arrive as the
  // whole vector already: no second copy.
  bool in_order = rows == 1 && received == n;
  for (int64_t r = 0, next = 0; r < ranks && in_order; ++r) {
    if (w[2 * r + 1] == 0) continue;
    in_order = w[2 * r] == next;
    next += w[2 * r + 1];
  }
  if (in_order && n > 0) return out.view({1, n});
  Tensor whole = Tensor::zeros({rows, n}, dtype);
  int64_t at = 0;
  for (int r = 0; r < ranks; ++r) {
    const int64_t b = w[2 * r], len = w[2 * r + 1];
    if (len == 0) continue;
    whole.narrow(1, b, len).copy_(out.narrow(0, at, rows * len).view({rows, len}));
    at += rows * len;
  }
  return whole;
}

std::vector<train::NamedParam> ShardedAdamW::piece_params(
    const std::vector<train::NamedParam>& params, const std::vector<Piece>& pieces) {
  std::vector<train::NamedParam> out;
  out.reserve(pieces.size());
  for (const Piece& p : pieces) {
    const train::NamedParam& full = params[p.param];
    out.push_back({fmt::format("{}@{}", full.name, p.begin),
                   full.value.reshape({-1}).narrow(0, p.begin, p.length).clone(), true});
  }
  return out;
}

ShardedAdamW::ShardedAdamW(std::vector<train::NamedParam> params, train::AdamWConfig config,
                           Communicator& group, Communicator* device_group)
    : params_(std::move(params)),
      config_(config),
      group_(group),
      device_group_(device_group),
      shard_({}, config) {
  GLMTUNE_ASSERT(device_group_ == nullptr || (device_group_->size() == group_.size() &&
                                              device_group_->rank() == group_.rank()),
                 "the device group '{}' must hold the ranks of '{}' in the same order",
                 device_group_ ? device_group_->name() : std::string(), group_.name());
  const Layout l = flat_layout(params_, group_.size(), group_.rank());
  offsets_ = l.offsets;
  total_ = l.total;
  shard_numel_ = l.shard;
  shard_begin_ = l.begin;
  const int64_t end = std::min(total_, shard_begin_ + shard_numel_);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].trainable) continue;
    const int64_t lo = std::max(offsets_[i], shard_begin_);
    const int64_t hi = std::min(offsets_[i] + params_[i].value.numel(), end);
    if (hi > lo) pieces_.push_back({i, lo - offsets_[i], hi - lo});
  }
  shard_ = train::AdamW(piece_params(params_, pieces_), config);
}

double ShardedAdamW::reduce_gradients(const std::vector<Tensor>& grads, double other_sq_norm) {
  return std::sqrt(group_.all_reduce_sum(reduce_shard(grads) + other_sq_norm));
}

double ShardedAdamW::reduce_shard(const std::vector<Tensor>& grads) {
  GLMTUNE_ASSERT(grads.size() == params_.size(), "{} gradients for {} parameters", grads.size(),
                 params_.size());
  const int ranks = group_.size();
  grad_device_ = Device::cpu();
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].trainable && grads[i].defined()) {
      grad_device_ = grads[i].device();
      break;
    }
  GLMTUNE_ASSERT(grad_device_.is_cpu() || device_group_ != nullptr,
                 "gradients on {} need a device group for '{}'", grad_device_.str(), group_.name());
  Tensor flat = Tensor::zeros({shard_numel_ * ranks}, DType::f32, grad_device_);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].trainable) continue;
    const Tensor& g = grads[i];
    GLMTUNE_ASSERT(
        g.defined() && g.numel() == params_[i].value.numel() && g.device() == grad_device_,
        "gradient of '{}' is {}, expected {} elements on {}", params_[i].name,
        g.defined() ? g.str() : std::string("undefined"), params_[i].value.numel(),
        grad_device_.str());
    Tensor dst = flat.narrow(0, offsets_[i], g.numel());
    dst.copy_(g.reshape({-1}));
  }
  Tensor shard_grad = Tensor::empty({shard_numel_}, DType::f32, grad_device_);
  if (grad_device_.is_cpu()) {
    group_.reduce_scatter(flat, shard_grad);
  } else {
    device_group_->reduce_scatter(flat, shard_grad);
    if (!on_device()) shard_grad = shard_grad.to(Device::cpu());
  }
  piece_grads_.clear();
  for (const Piece& p : pieces_)
    piece_grads_.push_back(
        shard_grad.narrow(0, offsets_[p.param] + p.begin - shard_begin_, p.length));
  if (!on_device()) return shard_.grad_sq_norm(piece_grads_);
  GLMTUNE_ASSERT(grad_device_.is_cuda(),
                 "the sharded optimizer's state is on a GPU, its gradients on {}",
                 grad_device_.str());
#ifdef GLMTUNE_WITH_CUDA
  return detail::device_sq_norm(piece_grads_);
#else
  throw InternalError("a sharded optimizer state on a GPU in a build without CUDA");
#endif
}

void ShardedAdamW::keep_on_device(std::vector<Tensor> compute, int64_t gather_chunk) {
  GLMTUNE_ASSERT(gather_chunk > 0, "keep_on_device with chunks of {} elements", gather_chunk);
  gather_chunk_ = gather_chunk;
  GLMTUNE_ASSERT(device_group_ != nullptr && compute.size() == params_.size(),
                 "keep_on_device needs a device group and a compute tensor per parameter ({} for "
                 "{})",
                 compute.size(), params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].trainable) continue;
    const Tensor& c = compute[i];
    GLMTUNE_ASSERT(c.defined() && c.device().is_cuda() && c.is_contiguous() &&
                       c.numel() == params_[i].value.numel() &&
                       (c.dtype() == DType::f32 || c.dtype() == DType::bf16),
                   "trained parameter '{}' has no contiguous f32/bf16 compute tensor of {} "
                   "elements on a GPU",
                   params_[i].name, params_[i].value.numel());
  }
  Device device = Device::cpu();
  for (const Tensor& c : compute)
    if (c.defined()) device = c.device();
  device_state_.clear();
  for (size_t k = 0; k < pieces_.size(); ++k)
    device_state_.push_back({shard_.master(k).to(device).contiguous(),
                             shard_.exp_avg(k).to(device).contiguous(),
                             shard_.exp_avg_sq(k).to(device).contiguous()});
  device_step_ = shard_.step_count();
  shard_ = train::AdamW({}, config_);
  compute_ = std::move(compute);
  on_device_ = true;
}

void ShardedAdamW::write_params() {
  if (!on_device()) return;
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].trainable) params_[i].value.copy_(compute_[i].view(params_[i].value.shape()));
}

train::StepReport detail::device_update(std::vector<std::array<Tensor, 3>>& state,
                                        const std::vector<Tensor>& grads,
                                        const train::AdamWConfig& config, double lr,
                                        double global_grad_norm, int64_t& step) {
  train::StepReport r;
  r.grad_norm = global_grad_norm;
  if (!std::isfinite(global_grad_norm)) {
    r.skipped = true;
    r.step = step;
    return r;
  }
  r.clip_coef = train::clip_coefficient(global_grad_norm, config.max_grad_norm);
  r.step = ++step;
#ifdef GLMTUNE_WITH_CUDA
  device_adamw(state, grads, config, lr, r.clip_coef, step);
#else
  (void)state, (void)grads, (void)lr;
  throw InternalError("an optimizer state on a GPU in a build without CUDA");
#endif
  return r;
}

train::StepReport ShardedAdamW::step_on_device(double lr, double global_grad_norm) {
  const train::StepReport r = detail::device_update(device_state_, piece_grads_, config_, lr,
                                                    global_grad_norm, device_step_);
  piece_grads_.clear();
  if (r.skipped) return r;
  Tensor shard = Tensor::zeros({shard_numel_}, DType::f32, grad_device_);
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const Piece& p = pieces_[k];
    Tensor dst = shard.narrow(0, offsets_[p.param] + p.begin - shard_begin_, p.length);
    dst.copy_(device_state_[k][0].view({p.length}));
  }
  // The masters travel in chunks of at most gather_chunk_ elements per rank: the transient f32
  // copy is P chunks, not the whole flat space (4 bytes a parameter). Chunk [c0, c1) of every
  // rank's shard holds flat elements [q·S + c0, q·S + c1) of rank q.
  const int64_t ranks = group_.size();
  for (int64_t c0 = 0; c0 < shard_numel_; c0 += gather_chunk_) {
    const int64_t length = std::min(gather_chunk_, shard_numel_ - c0);
    Tensor gathered = Tensor::empty({ranks * length}, DType::f32, grad_device_);
    device_group_->all_gather(shard.narrow(0, c0, length), gathered);
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!params_[i].trainable) continue;
      const int64_t begin = offsets_[i], end = begin + params_[i].value.numel();
      for (int64_t q = 0; q < ranks; ++q) {
        const int64_t from = q * shard_numel_ + c0;
        const int64_t lo = std::max(begin, from), hi = std::min(end, from + length);
        if (lo >= hi) continue;
        const Tensor values = gathered.narrow(0, q * length + lo - from, hi - lo);
        Tensor dst = compute_[i].view({-1}).narrow(0, lo - begin, hi - lo);
        // The forward sees the stored value: the master rounded to the storage dtype.
        if (params_[i].value.dtype() == DType::f32)
          dst.copy_(values);
        else
          dst.copy_(values.to(params_[i].value.dtype()));
      }
    }
  }
  return r;
}

train::StepReport ShardedAdamW::step(double lr, double global_grad_norm) {
  GLMTUNE_ASSERT(piece_grads_.size() == pieces_.size(),
                 "ShardedAdamW::step without reduce_gradients first");
  if (on_device()) return step_on_device(lr, global_grad_norm);
  const train::StepReport report = shard_.step(piece_grads_, lr, global_grad_norm);
  piece_grads_.clear();
  if (report.skipped) return report;
  gather_flat(
      shard_masters(),
      [&](size_t i, const Tensor& values) {
        Tensor dst = params_[i].value.view({-1});
        dst.copy_(values);
      },
      grad_device_.is_cuda());
  return report;
}

Tensor ShardedAdamW::shard_masters() const {
  Tensor out = Tensor::zeros({shard_numel_}, DType::f32);
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const Piece& p = pieces_[k];
    Tensor dst = out.narrow(0, offsets_[p.param] + p.begin - shard_begin_, p.length);
    dst.copy_(shard_.master(k));
  }
  return out;
}

template <typename Into>
void ShardedAdamW::gather_flat(const Tensor& shard, Into&& into, bool on_device) const {
  Tensor flat;
  if (on_device) {
    Tensor device_flat = Tensor::empty({shard_numel_ * group_.size()}, DType::f32, grad_device_);
    device_group_->all_gather(shard.to(grad_device_), device_flat);
    flat = device_flat.to(Device::cpu());
  } else {
    flat = Tensor::empty({shard_numel_ * group_.size()}, DType::f32);
    group_.all_gather(shard, flat);
  }
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].trainable) into(i, flat.narrow(0, offsets_[i], params_[i].value.numel()));
}

int64_t ShardedAdamW::state_bytes() const {
  if (!on_device()) return shard_.state_bytes();
  int64_t bytes = 0;
  for (const std::array<Tensor, 3>& s : device_state_)
    for (const Tensor& t : s) bytes += int64_t(t.nbytes());
  return bytes;
}

std::array<Tensor, 3> ShardedAdamW::gather_state(const std::string& name, int root) const {
  size_t param = params_.size();
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].name == name) param = i;
  GLMTUNE_ASSERT(param < params_.size() && params_[param].trainable,
                 "the sharded optimizer does not train '{}'", name);
  // The shard is contiguous, so this rank holds at most one piece of the parameter.
  int64_t begin = 0, length = 0;
  size_t piece = pieces_.size();
  for (size_t k = 0; k < pieces_.size(); ++k)
    if (pieces_[k].param == param) {
      piece = k;
      begin = pieces_[k].begin;
      length = pieces_[k].length;
    }
  // One kind at a time, each sent straight from the shard's state.
  std::array<Tensor, 3> whole;
  for (int kind = 0; kind < 3; ++kind) {
    const Tensor local =
        piece >= pieces_.size() ? Tensor::empty({1, 0}, DType::f32)
        : on_device() ? device_state_[piece][size_t(kind)].to(Device::cpu()).view({1, length})
                      : (kind == 0   ? shard_.master(piece)
                         : kind == 1 ? shard_.exp_avg(piece)
                                     : shard_.exp_avg_sq(piece))
                            .view({1, length});
    const Tensor gathered = gather_pieces(group_, local, begin, params_[param].value.numel(), root);
    if (gathered.defined()) whole[size_t(kind)] = gathered.view({-1});
  }
  return whole;
}

void ShardedAdamW::load(const train::SavedAdamWState& saved,
                        const std::function<int64_t(const train::NamedParam&)>& offset_in_saved) {
  GLMTUNE_ASSERT(!on_device(), "ShardedAdamW::load after keep_on_device");
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const Piece& p = pieces_[k];
    const train::NamedParam& param = params_[p.param];
    const int64_t at = (offset_in_saved ? offset_in_saved(param) : 0) + p.begin;
    shard_.set_state(k, saved.range(0, param.name, at, p.length),
                     saved.range(1, param.name, at, p.length),
                     saved.range(2, param.name, at, p.length));
  }
  shard_.set_step_count(saved.step_count());
  check_same_step(saved.step_count(), saved.dir().string());
}

void ShardedAdamW::check_same_step(int64_t step, const std::string& where) const {
  // Every rank read the same file; a rank that read another one would diverge silently.
  if (group_.all_reduce_max(step) != step || -group_.all_reduce_max(-step) != step)
    throw Error("the ranks restored optimizer states of different steps", where,
                "give every rank the same output directory (a shared file system)");
}

}  // namespace glmtune::dist
