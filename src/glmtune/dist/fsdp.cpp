#include "glmtune/dist/fsdp.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>

#include "glmtune/base/error.h"
#include "glmtune/dist/sharded_optimizer.h"
#include "glmtune/dist/sharded_optimizer_device.h"
#include "glmtune/ops/elementwise.h"
#include "glmtune/train/released.h"

namespace glmtune::dist {
namespace {

// Every tensor field of a decoder layer, in the order of the parameter list (model/text/weights.h),
// which is the flat layout. LayerWeights and LayerGrads have the same fields, so field i of the
// gradients is the gradient of field i of the weights. Undefined fields (the other mixer or MLP
// kind, a shared indexer, absent biases, frozen tensors' gradients) are skipped by the caller.
template <typename Layer>
std::vector<Tensor*> layer_fields(Layer& w) {
  std::vector<Tensor*> f;
  model::text::for_each_layer_param(w, [&](const std::string&, Tensor& t) { f.push_back(&t); });
  return f;
}

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// The entries of `named` whose tensor shares the storage of `t`.
std::vector<size_t> sharing(const std::vector<std::pair<std::string, Tensor>>& named,
                            const Tensor& t) {
  std::vector<size_t> out;
  for (size_t i = 0; i < named.size(); ++i)
    if (named[i].second.defined() && named[i].second.storage() == t.storage()) out.push_back(i);
  return out;
}

int64_t live_bytes(const std::weak_ptr<Storage>& s, std::set<const Storage*>& seen) {
  const std::shared_ptr<Storage> alive = s.lock();
  return alive && seen.insert(alive.get()).second ? int64_t(alive->bytes()) : 0;
}

}  // namespace

ShardedLayers::ShardedLayers(model::text::TextWeights& weights, model::text::TextGrads& grads,
                             Communicator& group, const LayerSource& source,
                             Communicator* device_group)
    : weights_(weights), grads_(grads), group_(group), device_group_(device_group) {
  build(source);
}

void ShardedLayers::build(const LayerSource& source) {
  model::text::TextWeights& weights = weights_;
  model::text::TextGrads& grads = grads_;
  const bool on_gpu = weights.device.is_cuda();
  if (grads.layers.size() != weights.layers.size())
    throw InternalError(fmt::format("gradient buffers for {} layers, the model has {}",
                                    grads.layers.size(), weights.layers.size()));
  const int64_t ranks = group_.size(), rank = group_.rank();
  if (device_group_ && (device_group_->size() != ranks || device_group_->rank() != rank))
    throw InternalError(fmt::format("device group '{}' is rank {} of {}, the group rank {} of {}",
                                    device_group_->name(), device_group_->rank(),
                                    device_group_->size(), rank, ranks));
  // Kernels read a view as they read a whole tensor: on a GPU each starts 128 elements apart
  // (256 bytes of bf16), the alignment the vectorised and TMA loads expect of a tensor's start.
  const int64_t align = on_gpu ? 128 : 1;
  layers_.resize(weights.layers.size());
  for (size_t l = 0; l < weights.layers.size(); ++l) {
    Layer& L = layers_[l];
    const std::vector<Tensor*> fields = layer_fields(weights.layers[l]);
    const std::vector<Tensor*> grad_fields = layer_fields(grads.layers[l]);
    // Placeholders of the weights (and the gradient buffers built from them) stand for tensors of
    // the shape the source gives.
    std::vector<bool> deferred(fields.size(), false);
    std::vector<std::shared_ptr<Storage>> outside_grads;
    std::vector<int64_t> used;  // elements per flat so far
    for (size_t f = 0; f < fields.size(); ++f) {
      Tensor* t = fields[f];
      if (!t->defined()) continue;
      // The CPU model holds every tensor in its compute dtype; the GPU one keeps some in f32.
      if (t->dtype() != weights.dtype && !(on_gpu && t->dtype() == DType::f32))
        throw InternalError(fmt::format("layer {}: a {} tensor in a {} model", l,
                                        dtype_name(t->dtype()), dtype_name(weights.dtype)));
      Param p;
      p.field = t;
      p.frozen = t->frozen();
      p.shape = t->shape();
      p.named = sharing(weights.named, *t);
      if (p.named.empty())
        throw InternalError(
            fmt::format("layer {}: a tensor of shape {} without a name", l, shape_str(p.shape)));
      if (source.outside && source.outside(param_name(p))) {
        // Held whole by this rank, with its own gradient buffer: the checks below must not ask
        // for it in the layout either.
        if (Tensor* g = grad_fields[f]; g->defined()) outside_grads.push_back(g->storage());
        continue;
      }
      if (const std::optional<Shape> whole = source.deferred_shape(param_name(p))) {
        p.shape = *whole;
        deferred[L.params.size()] = true;
      }
      // Gradients accumulate in the compute dtype on the CPU, in f32 on a GPU.
      const DType grad_dtype = on_gpu ? DType::f32 : t->dtype();
      const bool trained = grad_fields[f]->defined();
      p.flat = L.flats.size();
      for (size_t k = 0; k < L.flats.size(); ++k)
        if (L.flats[k].dtype == t->dtype() && L.flats[k].trained == trained) p.flat = k;
      if (p.flat == L.flats.size()) {
        Flat fl;
        fl.dtype = t->dtype();
        fl.grad_dtype = grad_dtype;
        fl.trained = trained;
        L.flats.push_back(std::move(fl));
        used.push_back(0);
      }
      if (Tensor* g = grad_fields[f]; g->defined()) {
        const bool placeholder = deferred[L.params.size()];
        if (g->dtype() != grad_dtype || (!placeholder && g->shape() != p.shape))
          throw InternalError(fmt::format("gradient of '{}' is {}, the parameter {} {}",
                                          param_name(p), g->str(), dtype_name(t->dtype()),
                                          shape_str(p.shape)));
        p.grad = g;
        p.grad_named = sharing(grads.named, *g);
        full_gradient_bytes_ += shape_numel(p.shape) * int64_t(dtype_size(grad_dtype));
      }
      p.offset = round_up(used[p.flat], align);
      used[p.flat] = p.offset + shape_numel(p.shape);
      full_bytes_ += shape_numel(p.shape) * int64_t(dtype_size(t->dtype()));
      L.params.push_back(std::move(p));
    }
    // Every trained buffer of the layer must have found its parameter: a gradient left out of the
    // layout would silently never reach the optimizer.
    const std::string prefix = model::text::layer_prefix(int64_t(l));
    for (const auto& [name, buffer] : grads.named)
      if (name.compare(0, prefix.size(), prefix) == 0 && buffer.defined() &&
          std::find(outside_grads.begin(), outside_grads.end(), buffer.storage()) ==
              outside_grads.end() &&
          std::none_of(L.params.begin(), L.params.end(), [&](const Param& p) {
            return p.grad && p.grad->storage() == buffer.storage();
          }))
        throw InternalError(
            fmt::format("gradient buffer '{}' matches no tensor of layer {}", name, l));
    for (size_t k = 0; k < L.flats.size(); ++k) {
      Flat& fl = L.flats[k];
      fl.padded = round_up(std::max<int64_t>(used[k], 1), ranks * align);
      fl.shard = Tensor::zeros({fl.padded / ranks}, fl.dtype, weights.device);
      if (fl.trained)
        fl.grad_shard = Tensor::zeros({fl.padded / ranks}, fl.grad_dtype, weights.device);
    }
    // Each rank copies (or reads) the part of each tensor inside its own range, no communication.
    for (size_t i = 0; i < L.params.size(); ++i) {
      const Param& p = L.params[i];
      Flat& fl = L.flats[p.flat];
      const int64_t per = fl.shard.numel(), begin = rank * per;
      const int64_t numel = shape_numel(p.shape);
      const int64_t lo = std::max(p.offset, begin), hi = std::min(p.offset + numel, begin + per);
      if (lo >= hi) continue;
      const Tensor part = deferred[i] ? source.read(param_name(p), lo - p.offset, hi - lo)
                                      : p.field->reshape({-1}).narrow(0, lo - p.offset, hi - lo);
      fl.shard.narrow(0, lo - begin, hi - lo).copy_(part);
    }
  }
  // Release last: the loops above read the full tensors and buffers.
  for (size_t l = 0; l < layers_.size(); ++l) {
    release(int64_t(l));
    for (Param& p : layers_[l].params)
      if (p.grad) {
        *p.grad = Tensor();
        for (size_t i : p.grad_named) grads_.named[i].second = Tensor();
      }
  }
}

std::pair<size_t, const ShardedLayers::Param*> ShardedLayers::find(const std::string& name) const {
  for (size_t l = 0; l < layers_.size(); ++l)
    for (const Param& p : layers_[l].params)
      for (size_t i : p.named)
        if (weights_.named[i].first == name) return {l, &p};
  throw InternalError(fmt::format("'{}' is not a decoder-layer tensor held in slices", name));
}

Tensor ShardedLayers::gather_tensor(const std::string& name, int root) {
  const auto [l, p] = find(name);
  const Flat& fl = layers_[l].flats[p->flat];
  const int64_t begin = slice_begin(int64_t(l), p->flat), size = fl.shard.numel();
  const int64_t numel = shape_numel(p->shape);
  const int64_t lo = std::max(p->offset, begin), hi = std::min(p->offset + numel, begin + size);
  const int64_t length = std::max<int64_t>(hi - lo, 0);
  // The pieces travel over the host group.
  const Tensor piece =
      length > 0 ? fl.shard.narrow(0, lo - begin, length).to(Device::cpu()).view({1, length})
                 : Tensor::empty({1, 0}, fl.dtype);
  const Tensor whole = gather_pieces(group_, piece, length > 0 ? lo - p->offset : 0, numel, root);
  if (!whole.defined()) return Tensor();
  return whole.to(fl.dtype).view(p->shape);
}

ShardedLayers::Layer& ShardedLayers::layer_at(int64_t layer, const char* what) {
  if (layer < 0 || layer >= int64_t(layers_.size()))
    throw InternalError(
        fmt::format("{} of layer {}: the model has {} layers", what, layer, layers_.size()));
  return layers_[size_t(layer)];
}

const ShardedLayers::Layer& ShardedLayers::layer_at(int64_t layer, const char* what) const {
  return const_cast<ShardedLayers*>(this)->layer_at(layer, what);
}

ShardedLayers::Flat& ShardedLayers::flat_at(int64_t layer, size_t flat) {
  Layer& L = layer_at(layer, "flat");
  GLMTUNE_ASSERT(flat < L.flats.size(), "layer {} has {} flats, not {}", layer, L.flats.size(),
                 flat + 1);
  return L.flats[flat];
}

const std::string& ShardedLayers::param_name(const Param& p) const {
  return weights_.named[p.named.front()].first;
}

Tensor ShardedLayers::all_gather_flat(const Flat& flat, const Tensor& local) {
  Tensor full = Tensor::empty({flat.padded}, local.dtype(), local.device());
  movers().all_gather(local, full);
  return full;
}

void ShardedLayers::gather(int64_t layer) {
  Layer& L = layer_at(layer, "gather");
  std::vector<Tensor> full;
  for (Flat& fl : L.flats) {
    if (fl.prefetched) {
      fl.prefetched->pending->wait();
      full.push_back(std::move(fl.prefetched->buffer));
      fl.prefetched.reset();
    } else {
      full.push_back(all_gather_flat(fl, fl.shard));
    }
    fl.gathered = full.back().storage();
  }
  for (Param& p : L.params) {
    *p.field = full[p.flat].slice(0, p.offset, p.offset + shape_numel(p.shape)).view(p.shape);
    p.field->set_frozen(p.frozen);
    for (size_t i : p.named) weights_.named[i].second = *p.field;
  }
}

void ShardedLayers::prefetch(int64_t layer) {
  for (Flat& fl : layer_at(layer, "prefetch").flats) {
    if (fl.prefetched) continue;
    Prefetch p;
    p.buffer = Tensor::empty({fl.padded}, fl.dtype, weights_.device);
    p.pending = movers().start_all_gather(fl.shard, p.buffer);
    fl.prefetched = std::move(p);
  }
}

void ShardedLayers::release(int64_t layer) {
  Layer& L = layer_at(layer, "release");
  for (Param& p : L.params) {
    *p.field = Tensor();
    for (size_t i : p.named) weights_.named[i].second = Tensor();
  }
}

void ShardedLayers::allocate_gradients(int64_t layer) {
  Layer& L = layer_at(layer, "allocate_gradients");
  for (Flat& fl : L.flats) {
    if (!fl.trained) continue;
    GLMTUNE_ASSERT(!fl.grad_full.defined(), "gradient buffers of layer {} allocated twice", layer);
    fl.grad_full = Tensor::zeros({fl.padded}, fl.grad_dtype, weights_.device);
    fl.grad_allocated = fl.grad_full.storage();
  }
  for (Param& p : L.params) {
    if (!p.grad) continue;
    *p.grad =
        L.flats[p.flat].grad_full.slice(0, p.offset, p.offset + shape_numel(p.shape)).view(p.shape);
    for (size_t i : p.grad_named) grads_.named[i].second = *p.grad;
  }
}

void ShardedLayers::reduce_gradients(int64_t layer) {
  Layer& L = layer_at(layer, "reduce_gradients");
  for (Param& p : L.params) {
    if (!p.grad) continue;
    *p.grad = Tensor();
    for (size_t i : p.grad_named) grads_.named[i].second = Tensor();
  }
  // One layer's reductions in flight at a time: the previous layer's complete before this one's
  // start, so at most two layers' full gradient buffers exist.
  finish_reductions();
  for (Flat& fl : L.flats) {
    if (!fl.trained) continue;
    GLMTUNE_ASSERT(fl.grad_full.defined(), "reduce_gradients of layer {} without its buffers",
                   layer);
    Reduction r;
    r.full = std::move(fl.grad_full);
    r.mine = Tensor::empty(fl.grad_shard.shape(), fl.grad_dtype, weights_.device);
    r.slice = &fl.grad_shard;
    r.pending = movers().start_reduce_scatter(r.full, r.mine);
    reductions_.push_back(std::move(r));
  }
  // Only a GPU's reduction runs beside the next layer (on NCCL's stream); on the CPU it is done
  // already, and the full buffers go now.
  if (!weights_.device.is_cuda()) finish_reductions();
}

void ShardedLayers::finish_reductions() {
  for (Reduction& r : reductions_) {
    r.pending->wait();
    ops::add_into(*r.slice, r.mine);
  }
  reductions_.clear();
}

int64_t ShardedLayers::resident_bytes() const {
  int64_t bytes = 0;
  std::set<const Storage*> seen;
  for (const Layer& L : layers_)
    for (const Flat& fl : L.flats) {
      bytes += int64_t(fl.shard.nbytes());
      bytes += live_bytes(fl.gathered, seen);
      if (fl.prefetched) bytes += live_bytes(fl.prefetched->buffer.storage(), seen);
    }
  return bytes;
}

int64_t ShardedLayers::gradient_bytes() const {
  int64_t bytes = 0;
  std::set<const Storage*> seen;
  for (const Layer& L : layers_)
    for (const Flat& fl : L.flats)
      if (fl.trained)
        bytes += int64_t(fl.grad_shard.nbytes()) + live_bytes(fl.grad_allocated, seen);
  for (const Reduction& r : reductions_) bytes += live_bytes(r.full.storage(), seen);
  return bytes;
}

void ShardedLayers::zero_gradients() {
  finish_reductions();
  for (Layer& L : layers_)
    for (Flat& fl : L.flats)
      if (fl.trained) fl.grad_shard.zero_();
}

void ShardedLayers::all_reduce_gradients(Communicator& replicas) {
  finish_reductions();
  if (replicas.size() == 1) return;
  for (Layer& L : layers_)
    for (Flat& fl : L.flats)
      if (fl.trained) replicas.all_reduce(fl.grad_shard);
}

void ShardedLayers::gather_gradients(
    const std::function<void(const std::string& name, const Tensor& grad)>& visit) {
  finish_reductions();
  for (Layer& L : layers_) {
    std::vector<Tensor> full;
    for (const Flat& fl : L.flats)
      full.push_back(fl.trained ? all_gather_flat(fl, fl.grad_shard) : Tensor());
    for (const Param& p : L.params) {
      if (!p.grad) continue;
      const Tensor grad =
          full[p.flat].slice(0, p.offset, p.offset + shape_numel(p.shape)).view(p.shape);
      for (size_t i : p.grad_named) visit(grads_.named[i].first, grad);
    }
  }
}

std::vector<std::string> ShardedLayers::nonfinite(bool gradients, size_t limit) {
  if (gradients) finish_reductions();
  std::vector<int64_t> flags;
  std::vector<std::string> names;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    for (const Param& p : L.params) {
      if (gradients && !p.grad) continue;
      const Flat& fl = L.flats[p.flat];
      const Tensor& local = gradients ? fl.grad_shard : fl.shard;
      const int64_t begin = slice_begin(int64_t(l), p.flat), size = local.numel();
      const int64_t lo = std::max(p.offset, begin);
      const int64_t hi = std::min(p.offset + shape_numel(p.shape), begin + size);
      // Scanned on the host (a GPU slice is copied): this runs only after a non-finite norm or
      // before a checkpoint.
      flags.push_back(lo < hi &&
                      !train::all_finite(local.slice(0, lo - begin, hi - begin).to(Device::cpu())));
      names.push_back(param_name(p));
    }
  }
  group_.all_reduce_sum(flags);
  std::vector<std::string> out;
  for (size_t i = 0; i < flags.size() && out.size() < limit; ++i)
    if (flags[i] > 0) out.push_back(names[i]);
  return out;
}

void ShardedLayers::set_parameter(const std::string& name, const Tensor& value) {
  for (size_t l = 0; l < layers_.size(); ++l) {
    Layer& L = layers_[l];
    for (const Param& p : L.params) {
      if (std::none_of(p.named.begin(), p.named.end(),
                       [&](size_t i) { return weights_.named[i].first == name; }))
        continue;
      const int64_t n = shape_numel(p.shape);
      if (value.numel() != n)
        throw InternalError(
            fmt::format("'{}' has {} elements, the layer slot {}", name, value.numel(), n));
      Flat& fl = L.flats[p.flat];
      const int64_t begin = slice_begin(int64_t(l), p.flat), size = fl.shard.numel();
      const int64_t lo = std::max(p.offset, begin), hi = std::min(p.offset + n, begin + size);
      if (lo >= hi) return;
      const Tensor flat = value.contiguous().to(fl.dtype).view({n});
      fl.shard.slice(0, lo - begin, hi - begin).copy_(flat.slice(0, lo - p.offset, hi - p.offset));
      return;
    }
  }
  throw InternalError(fmt::format("'{}' is not a decoder-layer tensor held in slices", name));
}

bool ShardedLayers::holds(const std::string& name) const {
  for (const Layer& L : layers_)
    for (const Param& p : L.params)
      for (size_t i : p.named)
        if (weights_.named[i].first == name) return true;
  return false;
}

std::vector<ShardedLayers::Entry> ShardedLayers::entries(int64_t layer) const {
  std::vector<Entry> out;
  for (const Param& p : layer_at(layer, "entries").params)
    out.push_back({param_name(p), p.flat, p.offset, shape_numel(p.shape), p.grad != nullptr});
  return out;
}

int64_t ShardedLayers::slice_begin(int64_t layer, size_t flat) const {
  return group_.rank() * const_cast<ShardedLayers*>(this)->flat_at(layer, flat).shard.numel();
}

// ---- ShardedLayerAdamW
// ---------------------------------------------------------------------------

ShardedLayerAdamW::ShardedLayerAdamW(ShardedLayers& layers, const PieceReader& read,
                                     train::AdamWConfig config)
    : layers_(layers), pieces_({}, config), config_(config) {
  std::vector<train::NamedParam> piece_params;
  for (int64_t l = 0; l < layers.layers(); ++l)
    for (const ShardedLayers::Entry& e : layers.entries(l)) {
      if (!e.trained) continue;
      const int64_t begin = layers.slice_begin(l, e.flat);
      const int64_t end = begin + layers.slice(l, e.flat).numel();
      const int64_t lo = std::max(e.offset, begin), hi = std::min(e.offset + e.numel, end);
      if (lo >= hi) continue;
      // The piece in the parameter's storage dtype: AdamW keeps an f32 one as its own master and
      // rounds a bf16 one from its master, as for the whole tensor.
      Tensor value = read(e.name, lo - e.offset, hi - lo);
      if (!value.storage()->owns_memory() || !value.is_contiguous()) value = value.clone();
      Slot s{l, e.flat, e.name, lo - e.offset, hi - lo, lo - begin, value.dtype()};
      piece_params.push_back({fmt::format("{}@{}", e.name, s.begin), value, true});
      grads_.push_back(layers.gradient_slice(l, e.flat).narrow(0, s.slice_offset, s.length));
      slots_.push_back(std::move(s));
    }
  pieces_ = train::AdamW(std::move(piece_params), config);
}

void ShardedLayerAdamW::keep_on_device() {
  const Device device = layers_.device();
  GLMTUNE_ASSERT(device.is_cuda(), "keep_on_device of decoder-layer slices on {}", device.str());
  device_state_.clear();
  for (size_t k = 0; k < slots_.size(); ++k)
    device_state_.push_back({pieces_.master(k).to(device).contiguous(),
                             pieces_.exp_avg(k).to(device).contiguous(),
                             pieces_.exp_avg_sq(k).to(device).contiguous()});
  device_step_ = pieces_.step_count();
  pieces_ = train::AdamW({}, config_);
  on_device_ = true;
}

double ShardedLayerAdamW::grad_sq_norm() const {
  layers_.finish_reductions();
  if (!on_device_) return pieces_.grad_sq_norm(grads_);
#ifdef GLMTUNE_WITH_CUDA
  return detail::device_sq_norm(grads_);
#else
  throw InternalError("decoder-layer optimizer state on a GPU in a build without CUDA");
#endif
}

train::StepReport ShardedLayerAdamW::step(double lr, double global_grad_norm) {
  layers_.finish_reductions();
  if (!on_device_) {
    const train::StepReport report = pieces_.step(grads_, lr, global_grad_norm);
    if (!report.skipped) refresh_slices();
    return report;
  }
  const train::StepReport r =
      detail::device_update(device_state_, grads_, config_, lr, global_grad_norm, device_step_);
  if (!r.skipped) refresh_slices();
  return r;
}

void ShardedLayerAdamW::refresh_slices() {
  for (size_t k = 0; k < slots_.size(); ++k) {
    Tensor dst = compute_piece(k);
    if (!on_device_) {
      dst.copy_(pieces_.params()[k].value);
      continue;
    }
    // The forward sees the stored value: the master rounded to the storage dtype (widened again
    // where the compute slice is f32).
    const Tensor& master = device_state_[k][0];
    dst.copy_(slots_[k].storage == DType::f32 ? master : master.to(slots_[k].storage));
  }
}

int64_t ShardedLayerAdamW::state_bytes() const {
  if (!on_device_) return pieces_.state_bytes();
  int64_t bytes = 0;
  for (const auto& state : device_state_)
    for (const Tensor& t : state) bytes += int64_t(t.nbytes());
  return bytes;
}

std::array<Tensor, 3> ShardedLayerAdamW::gather_state(const std::string& name, int root) const {
  // A tensor lies in one layer, and this rank's part of it is at most one piece.
  int64_t numel = -1;
  for (int64_t l = 0; l < layers_.layers() && numel < 0; ++l)
    for (const ShardedLayers::Entry& e : layers_.entries(l))
      if (e.name == name && e.trained) numel = e.numel;
  GLMTUNE_ASSERT(numel >= 0, "no trained decoder-layer tensor '{}'", name);
  size_t piece = slots_.size();
  for (size_t k = 0; k < slots_.size(); ++k)
    if (slots_[k].name == name) piece = k;
  const int64_t length = piece < slots_.size() ? slots_[piece].length : 0;
  // One kind at a time, each sent from the pieces' state (over the host group: a device state is
  // copied first).
  std::array<Tensor, 3> whole;
  for (int kind = 0; kind < 3; ++kind) {
    Tensor local = Tensor::empty({1, 0}, DType::f32);
    if (length > 0)
      local = (on_device_  ? device_state_[piece][size_t(kind)].to(Device::cpu())
               : kind == 0 ? pieces_.master(piece)
               : kind == 1 ? pieces_.exp_avg(piece)
                           : pieces_.exp_avg_sq(piece))
                  .view({1, length});
    const Tensor gathered =
        gather_pieces(layers_.group(), local, length > 0 ? slots_[piece].begin : 0, numel, root);
    if (gathered.defined()) whole[size_t(kind)] = gathered.view({-1});
  }
  return whole;
}

void ShardedLayerAdamW::load(const train::SavedAdamWState& saved) {
  GLMTUNE_ASSERT(!on_device_, "ShardedLayerAdamW::load after keep_on_device");
  for (size_t k = 0; k < slots_.size(); ++k) {
    const Slot& s = slots_[k];
    pieces_.set_state(k, saved.range(0, s.name, s.begin, s.length),
                      saved.range(1, s.name, s.begin, s.length),
                      saved.range(2, s.name, s.begin, s.length));
  }
  pieces_.set_step_count(saved.step_count());
  refresh_slices();
  Communicator& group = layers_.group();
  const int64_t step = saved.step_count();
  if (group.all_reduce_max(step) != step || -group.all_reduce_max(-step) != step)
    throw Error("the ranks restored optimizer states of different steps", saved.dir().string(),
                "give every rank the same output directory (a shared file system)");
}

}  // namespace glmtune::dist
