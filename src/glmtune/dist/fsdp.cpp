#include "glmtune/dist/fsdp.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <string>

#include "glmtune/base/error.h"
#include "glmtune/dist/sharded_optimizer.h"
#include "glmtune/model/text/elementwise.h"
#include "glmtune/train/released.h"

namespace glmtune::dist {
namespace {

// Every tensor field of a decoder layer, in a fixed order (the flat layout). LayerWeights and
// LayerGrads have the same fields, so field i of the gradients is the gradient of field i of the
// weights. Undefined fields (the other mixer or MLP kind, a shared indexer, absent biases, frozen
// tensors' gradients) are skipped by the caller.
template <typename Layer>
std::vector<Tensor*> layer_fields(Layer& w) {
  std::vector<Tensor*> f = {&w.input_layernorm, &w.post_attention_layernorm,
                            &w.attn_hc.fn,      &w.attn_hc.base,
                            &w.attn_hc.scale,   &w.ffn_hc.fn,
                            &w.ffn_hc.base,     &w.ffn_hc.scale};
  auto& k = w.kda;
  for (Tensor* t :
       {&k.q_proj, &k.k_proj, &k.v_proj, &k.conv1d, &k.f_a_proj, &k.f_b_proj, &k.dt_bias, &k.A_log,
        &k.b_proj, &k.g_a_proj, &k.g_b_proj, &k.o_norm, &k.o_proj})
    f.push_back(t);
  ops::MlaParams& m = w.dsa.mla;
  for (Tensor* t :
       {&m.q_a_proj, &m.q_a_proj_bias, &m.q_a_layernorm, &m.q_b_proj, &m.kv_a_proj_with_mqa,
        &m.kv_a_proj_with_mqa_bias, &m.kv_a_layernorm, &m.kv_b_proj, &m.o_proj, &m.o_proj_bias})
    f.push_back(t);
  ops::IndexerParams& x = w.dsa.indexer;
  for (Tensor* t : {&x.wq_b, &x.wk, &x.k_norm_weight, &x.k_norm_bias, &x.weights_proj, &x.kpool_ape,
                    &x.kpool_gate})
    f.push_back(t);
  for (Tensor* t : {&w.dense.gate_proj, &w.dense.up_proj, &w.dense.down_proj}) f.push_back(t);
  ops::MoeParams& e = w.moe;
  for (Tensor* t : {&e.router_weight, &e.e_score_correction_bias, &e.gate_up_proj, &e.down_proj,
                    &e.shared.gate_proj, &e.shared.up_proj, &e.shared.down_proj})
    f.push_back(t);
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
                             Communicator& group, const LayerSource& source)
    : weights_(weights), grads_(grads), group_(group) {
  build(source);
}

void ShardedLayers::build(const LayerSource& source) {
  model::text::TextWeights& weights = weights_;
  model::text::TextGrads& grads = grads_;
  if (!weights.device.is_cpu())
    throw Error("fully sharded parameters run on the CPU only", "train.fsdp",
                "set train.fsdp = false for GPU training");
  if (grads.layers.size() != weights.layers.size())
    throw InternalError(fmt::format("gradient buffers for {} layers, the model has {}",
                                    grads.layers.size(), weights.layers.size()));
  const int64_t ranks = group_.size(), rank = group_.rank();
  const int64_t element = int64_t(dtype_size(weights.dtype));
  layers_.resize(weights.layers.size());
  for (size_t l = 0; l < weights.layers.size(); ++l) {
    Layer& L = layers_[l];
    const std::vector<Tensor*> fields = layer_fields(weights.layers[l]);
    const std::vector<Tensor*> grad_fields = layer_fields(grads.layers[l]);
    // Placeholders of the weights (and the gradient buffers built from them) stand for tensors of
    // the shape the source gives.
    std::vector<bool> deferred(fields.size(), false);
    std::vector<std::shared_ptr<Storage>> outside_grads;
    int64_t n = 0;
    for (size_t f = 0; f < fields.size(); ++f) {
      Tensor* t = fields[f];
      if (!t->defined()) continue;
      if (t->dtype() != weights.dtype)
        throw InternalError(fmt::format("layer {}: a {} tensor in a {} model", l,
                                        dtype_name(t->dtype()), dtype_name(weights.dtype)));
      Param p;
      p.field = t;
      p.shape = t->shape();
      p.offset = n;
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
      if (Tensor* g = grad_fields[f]; g->defined()) {
        const bool placeholder = deferred[L.params.size()];
        if (g->dtype() != weights.dtype || (!placeholder && g->shape() != p.shape))
          throw InternalError(fmt::format("gradient of '{}' is {}, the parameter {} {}",
                                          param_name(p), g->str(), dtype_name(weights.dtype),
                                          shape_str(p.shape)));
        p.grad = g;
        p.grad_named = sharing(grads.named, *g);
        full_gradient_bytes_ += shape_numel(p.shape) * element;
      }
      n += shape_numel(p.shape);
      full_bytes_ += shape_numel(p.shape) * element;
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
    L.padded = round_up(std::max<int64_t>(n, 1), ranks);
    const int64_t per = L.padded / ranks, begin = rank * per;
    // Each rank copies (or reads) the part of each tensor inside its own range, no communication.
    L.shard = Tensor::zeros({per}, weights.dtype);
    for (size_t i = 0; i < L.params.size(); ++i) {
      const Param& p = L.params[i];
      const int64_t numel = shape_numel(p.shape);
      const int64_t lo = std::max(p.offset, begin), hi = std::min(p.offset + numel, begin + per);
      if (lo >= hi) continue;
      const Tensor part = deferred[i] ? source.read(param_name(p), lo - p.offset, hi - lo)
                                      : p.field->reshape({-1}).narrow(0, lo - p.offset, hi - lo);
      L.shard.narrow(0, lo - begin, hi - lo).copy_(part);
    }
    L.grad_shard = Tensor::zeros({per}, weights.dtype);
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
  const Layer& L = layers_[l];
  const int64_t begin = slice_begin(int64_t(l)), size = L.shard.numel();
  const int64_t numel = shape_numel(p->shape);
  const int64_t lo = std::max(p->offset, begin), hi = std::min(p->offset + numel, begin + size);
  const int64_t length = std::max<int64_t>(hi - lo, 0);
  const Tensor piece = length > 0 ? L.shard.narrow(0, lo - begin, length).view({1, length})
                                  : Tensor::empty({1, 0}, weights_.dtype);
  const Tensor whole = gather_pieces(group_, piece, length > 0 ? lo - p->offset : 0, numel, root);
  if (!whole.defined()) return Tensor();
  return whole.to(weights_.dtype).view(p->shape);
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

const std::string& ShardedLayers::param_name(const Param& p) const {
  return weights_.named[p.named.front()].first;
}

Tensor ShardedLayers::all_gather_flat(const Layer& layer, const Tensor& local) {
  Tensor full = Tensor::empty({layer.padded}, local.dtype());
  group_.all_gather(local, full);
  return full;
}

void ShardedLayers::gather(int64_t layer) {
  Layer& L = layer_at(layer, "gather");
  Tensor full;
  if (L.prefetched) {
    L.prefetched->pending->wait();
    full = std::move(L.prefetched->buffer);
    L.prefetched.reset();
  } else {
    full = all_gather_flat(L, L.shard);
  }
  for (Param& p : L.params) {
    *p.field = full.slice(0, p.offset, p.offset + shape_numel(p.shape)).view(p.shape);
    for (size_t i : p.named) weights_.named[i].second = *p.field;
  }
  L.gathered = full.storage();
}

void ShardedLayers::prefetch(int64_t layer) {
  Layer& L = layer_at(layer, "prefetch");
  if (L.prefetched) return;
  Prefetch p;
  p.buffer = Tensor::empty({L.padded}, weights_.dtype);
  p.pending = group_.start_all_gather(L.shard, p.buffer);
  L.prefetched = std::move(p);
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
  GLMTUNE_ASSERT(!L.grad_full.defined(), "gradient buffers of layer {} allocated twice", layer);
  L.grad_full = Tensor::zeros({L.padded}, weights_.dtype);
  for (Param& p : L.params) {
    if (!p.grad) continue;
    *p.grad = L.grad_full.slice(0, p.offset, p.offset + shape_numel(p.shape)).view(p.shape);
    for (size_t i : p.grad_named) grads_.named[i].second = *p.grad;
  }
  L.grad_allocated = L.grad_full.storage();
}

void ShardedLayers::reduce_gradients(int64_t layer) {
  Layer& L = layer_at(layer, "reduce_gradients");
  GLMTUNE_ASSERT(L.grad_full.defined(), "reduce_gradients of layer {} without its buffers", layer);
  Tensor mine = Tensor::empty(L.grad_shard.shape(), weights_.dtype);
  group_.reduce_scatter(L.grad_full, mine);
  model::text::add_into(L.grad_shard, mine);
  for (Param& p : L.params) {
    if (!p.grad) continue;
    *p.grad = Tensor();
    for (size_t i : p.grad_named) grads_.named[i].second = Tensor();
  }
  L.grad_full = Tensor();
}

int64_t ShardedLayers::resident_bytes() const {
  int64_t bytes = 0;
  std::set<const Storage*> seen;
  for (const Layer& L : layers_) {
    bytes += int64_t(L.shard.nbytes());
    bytes += live_bytes(L.gathered, seen);
    if (L.prefetched) bytes += live_bytes(L.prefetched->buffer.storage(), seen);
  }
  return bytes;
}

int64_t ShardedLayers::gradient_bytes() const {
  int64_t bytes = 0;
  std::set<const Storage*> seen;
  for (const Layer& L : layers_)
    bytes += int64_t(L.grad_shard.nbytes()) + live_bytes(L.grad_allocated, seen);
  return bytes;
}

void ShardedLayers::zero_gradients() {
  for (Layer& L : layers_) L.grad_shard.zero_();
}

void ShardedLayers::all_reduce_gradients(Communicator& replicas) {
  if (replicas.size() == 1) return;
  for (Layer& L : layers_) replicas.all_reduce(L.grad_shard);
}

void ShardedLayers::gather_gradients(
    const std::function<void(const std::string& name, const Tensor& grad)>& visit) {
  for (Layer& L : layers_) {
    const Tensor full = all_gather_flat(L, L.grad_shard);
    for (const Param& p : L.params) {
      if (!p.grad) continue;
      const Tensor grad = full.slice(0, p.offset, p.offset + shape_numel(p.shape)).view(p.shape);
      for (size_t i : p.grad_named) visit(grads_.named[i].first, grad);
    }
  }
}

std::vector<std::string> ShardedLayers::nonfinite(bool gradients, size_t limit) {
  std::vector<int64_t> flags;
  std::vector<std::string> names;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    const Tensor& local = gradients ? L.grad_shard : L.shard;
    const int64_t begin = slice_begin(int64_t(l)), size = local.numel();
    for (const Param& p : L.params) {
      if (gradients && !p.grad) continue;
      const int64_t lo = std::max(p.offset, begin);
      const int64_t hi = std::min(p.offset + shape_numel(p.shape), begin + size);
      flags.push_back(lo < hi && !train::all_finite(local.slice(0, lo - begin, hi - begin)));
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
      const int64_t begin = slice_begin(int64_t(l)), size = L.shard.numel();
      const int64_t lo = std::max(p.offset, begin), hi = std::min(p.offset + n, begin + size);
      if (lo >= hi) return;
      const Tensor flat = value.contiguous().to(weights_.dtype).view({n});
      L.shard.slice(0, lo - begin, hi - begin).copy_(flat.slice(0, lo - p.offset, hi - p.offset));
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
    out.push_back({param_name(p), p.offset, shape_numel(p.shape), p.grad != nullptr});
  return out;
}

int64_t ShardedLayers::slice_begin(int64_t layer) const {
  return group_.rank() * layer_at(layer, "slice_begin").shard.numel();
}

// ---- ShardedLayerAdamW
// ---------------------------------------------------------------------------

ShardedLayerAdamW::ShardedLayerAdamW(ShardedLayers& layers, const PieceReader& read,
                                     train::AdamWConfig config)
    : layers_(layers), pieces_({}, config) {
  std::vector<train::NamedParam> piece_params;
  for (int64_t l = 0; l < layers.layers(); ++l) {
    const int64_t begin = layers.slice_begin(l), end = begin + layers.slice(l).numel();
    for (const ShardedLayers::Entry& e : layers.entries(l)) {
      if (!e.trained) continue;
      const int64_t lo = std::max(e.offset, begin), hi = std::min(e.offset + e.numel, end);
      if (lo >= hi) continue;
      Slot s{l, e.name, lo - e.offset, hi - lo, lo - begin};
      // The piece in the parameter's storage dtype: AdamW keeps an f32 one as its own master and
      // rounds a bf16 one from its master, as for the whole tensor.
      Tensor value = read(e.name, s.begin, s.length);
      if (!value.storage()->owns_memory() || !value.is_contiguous()) value = value.clone();
      piece_params.push_back({fmt::format("{}@{}", e.name, s.begin), value, true});
      grads_.push_back(layers.gradient_slice(l).narrow(0, s.slice_offset, s.length));
      slots_.push_back(std::move(s));
    }
  }
  pieces_ = train::AdamW(std::move(piece_params), config);
}

double ShardedLayerAdamW::grad_sq_norm() const { return pieces_.grad_sq_norm(grads_); }

train::StepReport ShardedLayerAdamW::step(double lr, double global_grad_norm) {
  const train::StepReport report = pieces_.step(grads_, lr, global_grad_norm);
  if (!report.skipped) refresh_slices();
  return report;
}

void ShardedLayerAdamW::refresh_slices() {
  for (size_t k = 0; k < slots_.size(); ++k) {
    const Slot& s = slots_[k];
    layers_.slice(s.layer).narrow(0, s.slice_offset, s.length).copy_(pieces_.params()[k].value);
  }
}

int64_t ShardedLayerAdamW::state_bytes() const { return pieces_.state_bytes(); }

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
  // One kind at a time, each sent straight from the pieces' state.
  std::array<Tensor, 3> whole;
  for (int kind = 0; kind < 3; ++kind) {
    const Tensor local = length > 0 ? (kind == 0   ? pieces_.master(piece)
                                       : kind == 1 ? pieces_.exp_avg(piece)
                                                   : pieces_.exp_avg_sq(piece))
                                          .view({1, length})
                                    : Tensor::empty({1, 0}, DType::f32);
    const Tensor gathered =
        gather_pieces(layers_.group(), local, length > 0 ? slots_[piece].begin : 0, numel, root);
    if (gathered.defined()) whole[size_t(kind)] = gathered.view({-1});
  }
  return whole;
}

void ShardedLayerAdamW::load(const train::SavedAdamWState& saved) {
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
