#include "glmtune/dist/fsdp.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <string>

#include "glmtune/base/error.h"
#include "glmtune/model/text/elementwise.h"

namespace glmtune::dist {
namespace {

// Every tensor field of a decoder layer, in a fixed order (the flat layout). Undefined fields
// (the other mixer or MLP kind, a shared indexer, absent biases) are skipped by the caller.
std::vector<Tensor*> layer_fields(model::text::LayerWeights& w) {
  std::vector<Tensor*> f = {&w.input_layernorm, &w.post_attention_layernorm,
                            &w.attn_hc.fn,      &w.attn_hc.base,
                            &w.attn_hc.scale,   &w.ffn_hc.fn,
                            &w.ffn_hc.base,     &w.ffn_hc.scale};
  ops::KdaParams& k = w.kda;
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

}  // namespace

ShardedLayers::ShardedLayers(model::text::TextWeights& weights, model::text::TextGrads& grads,
                             Communicator& group)
    : weights_(weights), grads_(grads), group_(group) {
  if (!weights.device.is_cpu())
    throw Error("fully sharded parameters run on the CPU only", "train.fsdp",
                "set train.fsdp = false for GPU training");
  if (grads.layers.size() != weights.layers.size())
    throw InternalError(fmt::format("gradient buffers for {} layers, the model has {}",
                                    grads.layers.size(), weights.layers.size()));
  const int64_t ranks = group.size(), rank = group.rank();
  layers_.resize(weights.layers.size());
  for (size_t l = 0; l < weights.layers.size(); ++l) {
    Layer& L = layers_[l];
    int64_t n = 0;
    for (Tensor* t : layer_fields(weights.layers[l])) {
      if (!t->defined()) continue;
      if (t->dtype() != weights.dtype)
        throw InternalError(fmt::format("layer {}: a {} tensor in a {} model", l,
                                        dtype_name(t->dtype()), dtype_name(weights.dtype)));
      Param p;
      p.field = t;
      p.shape = t->shape();
      p.offset = n;
      for (size_t i = 0; i < weights.named.size(); ++i)
        if (weights.named[i].second.defined() && weights.named[i].second.storage() == t->storage())
          p.named.push_back(i);
      n += t->numel();
      L.params.push_back(std::move(p));
    }
    L.padded = round_up(std::max<int64_t>(n, 1), ranks);
    const int64_t per = L.padded / ranks;
    // Every rank holds the same full weights: each copies its own range, no communication.
    Tensor flat = Tensor::zeros({L.padded}, weights.dtype);
    for (const Param& p : L.params) {
      flat.slice(0, p.offset, p.offset + p.field->numel()).view(p.shape).copy_(*p.field);
      full_bytes_ += int64_t(p.field->nbytes());
    }
    L.shard = flat.slice(0, rank * per, (rank + 1) * per).clone();

    // Gradients: the layer's trainable buffers, under the layer's name prefix.
    const std::string prefix = model::text::layer_prefix(int64_t(l));
    int64_t g = 0;
    for (size_t i = 0; i < grads.named.size(); ++i) {
      const auto& [name, buffer] = grads.named[i];
      if (name.compare(0, prefix.size(), prefix) != 0) continue;
      if (buffer.dtype() != weights.dtype)
        throw InternalError(fmt::format("gradient '{}' in {}, the model computes in {}", name,
                                        dtype_name(buffer.dtype()), dtype_name(weights.dtype)));
      L.grads.push_back({i, g});
      g += buffer.numel();
    }
    L.grad_padded = round_up(std::max<int64_t>(g, 1), ranks);
    L.grad_shard = Tensor::zeros({L.grad_padded / ranks}, weights.dtype);
  }
  // Release last: the loops above read the full tensors.
  for (size_t l = 0; l < layers_.size(); ++l) release(int64_t(l));
}

ShardedLayers::Layer& ShardedLayers::layer_at(int64_t layer, const char* what) {
  if (layer < 0 || layer >= int64_t(layers_.size()))
    throw InternalError(
        fmt::format("{} of layer {}: the model has {} layers", what, layer, layers_.size()));
  return layers_[size_t(layer)];
}

void ShardedLayers::gather(int64_t layer) {
  Layer& L = layer_at(layer, "gather");
  Tensor full = Tensor::empty({L.padded}, weights_.dtype);
  group_.all_gather(L.shard, full);
  for (Param& p : L.params) {
    *p.field = full.slice(0, p.offset, p.offset + shape_numel(p.shape)).view(p.shape);
    for (size_t i : p.named) weights_.named[i].second = *p.field;
  }
  L.gathered = full.storage();
}

void ShardedLayers::release(int64_t layer) {
  Layer& L = layer_at(layer, "release");
  for (Param& p : L.params) {
    *p.field = Tensor();
    for (size_t i : p.named) weights_.named[i].second = Tensor();
  }
}

void ShardedLayers::reduce_gradients(int64_t layer) {
  Layer& L = layer_at(layer, "reduce_gradients");
  Tensor flat = Tensor::zeros({L.grad_padded}, weights_.dtype);
  for (const Grad& g : L.grads) {
    Tensor& buffer = grads_.named[g.named].second;
    flat.slice(0, g.offset, g.offset + buffer.numel()).view(buffer.shape()).copy_(buffer);
    buffer.zero_();
  }
  Tensor mine = Tensor::empty(L.grad_shard.shape(), weights_.dtype);
  group_.reduce_scatter(flat, mine);
  model::text::add_into(L.grad_shard, mine);
}

int64_t ShardedLayers::resident_bytes() const {
  int64_t bytes = 0;
  std::set<const Storage*> seen;
  for (const Layer& L : layers_) {
    bytes += int64_t(L.shard.nbytes());
    if (const std::shared_ptr<Storage> s = L.gathered.lock(); s && seen.insert(s.get()).second)
      bytes += int64_t(s->bytes());
  }
  return bytes;
}

void ShardedLayers::gather_gradients() {
  for (Layer& L : layers_) {
    Tensor full = Tensor::empty({L.grad_padded}, weights_.dtype);
    group_.all_gather(L.grad_shard, full);
    for (const Grad& g : L.grads) {
      Tensor& buffer = grads_.named[g.named].second;
      buffer.copy_(full.slice(0, g.offset, g.offset + buffer.numel()).view(buffer.shape()));
    }
  }
}

void ShardedLayers::export_gradients() {
  for (Layer& L : layers_) {
    const int64_t size = L.grad_shard.numel(), begin = group_.rank() * size;
    for (const Grad& g : L.grads) {
      Tensor& buffer = grads_.named[g.named].second;
      buffer.zero_();
      const int64_t n = buffer.numel();
      const int64_t lo = std::max(g.offset, begin), hi = std::min(g.offset + n, begin + size);
      if (lo >= hi) continue;
      Tensor flat = buffer.view({n});
      flat.slice(0, lo - g.offset, hi - g.offset)
          .copy_(L.grad_shard.slice(0, lo - begin, hi - begin));
    }
  }
}

void ShardedLayers::refresh(const std::function<Tensor(const std::string& name)>& source) {
  for (Layer& L : layers_) {
    const int64_t size = L.shard.numel(), begin = group_.rank() * size;
    for (const Param& p : L.params) {
      if (p.named.empty())
        throw InternalError("a decoder-layer tensor without a name cannot be refreshed");
      const int64_t n = shape_numel(p.shape);
      const int64_t lo = std::max(p.offset, begin), hi = std::min(p.offset + n, begin + size);
      if (lo >= hi) continue;
      const Tensor value = source(weights_.named[p.named.front()].first);
      if (value.numel() != n)
        throw InternalError(fmt::format("'{}' has {} elements, the layer slot {}",
                                        weights_.named[p.named.front()].first, value.numel(), n));
      const Tensor flat = value.contiguous().to(weights_.dtype).view({n});
      L.shard.slice(0, lo - begin, hi - begin).copy_(flat.slice(0, lo - p.offset, hi - p.offset));
    }
  }
}

void ShardedLayers::zero_gradients() {
  for (Layer& L : layers_) L.grad_shard.zero_();
}

}  // namespace glmtune::dist
