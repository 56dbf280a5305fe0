#pragma once
// Decoder-layer parameters sharded over a data-parallel group (fully sharded data parallel,
// ZeRO-3; docs/distributed.md, "Fully sharded parameters").
//
// Each decoder layer's tensors (every defined tensor of TextWeights::layers[l], trained or not),
// in a fixed order, form one flat vector of N elements in the compute dtype, padded to a multiple
// of the group size P; rank r keeps elements [r·N'/P, (r+1)·N'/P) and the layer's tensors are
// left undefined. The layer loops (model::text::LayerParamProvider) then:
//   gather(l)            all-gather the slices into one full buffer; the layer's tensors (and
//                        their TextWeights::named entries) become views of it;
//   release(l)           drop those views: the buffer is freed as soon as nothing else holds it;
//   reduce_gradients(l)  the layer's trainable gradient buffers, flattened the same way, are
//                        reduce-scattered (SUM) into this rank's gradient slice (added to it, so a
//                        step's micro-packs accumulate) and zeroed.
// Embeddings, the final norm, the head and the MTP layer stay replicated.
//
// Collective: every rank of the group must run the same layers in the same order. CPU weights
// only: the flat vector has one dtype, and the GPU path keeps some tensors in f32 beside bf16.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "glmtune/dist/comm.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/layer.h"
#include "glmtune/model/text/weights.h"

namespace glmtune::dist {

class ShardedLayers final : public model::text::LayerParamProvider {
 public:
  // Takes the full decoder-layer tensors of `weights` (the same on every rank), keeps this rank's
  // slices and releases the tensors. `grads` are the buffers the backward adds into
  // (TextGrads::zeros_like of the full weights, built before this).
  ShardedLayers(model::text::TextWeights& weights, model::text::TextGrads& grads,
                Communicator& group);
  ~ShardedLayers() override = default;

  void gather(int64_t layer) override;
  void release(int64_t layer) override;
  void reduce_gradients(int64_t layer) override;

  // Bytes of decoder-layer parameter memory alive on this rank now, measured: the slices plus
  // every gathered buffer that something still references (a released layer whose buffer
  // outlived its release counts in full).
  int64_t resident_bytes() const;
  // Bytes of the full decoder-layer parameters (what every rank holds without sharding).
  int64_t full_bytes() const { return full_bytes_; }

  // Collective. Writes each layer's reduced gradient (the group's sum) into the full buffers of
  // `grads`, for checks and for code that needs whole gradients.
  void gather_gradients();
  // Writes this rank's gradient slice into the full buffers of `grads` at its positions, zeros
  // elsewhere: a sum over the group (ShardedAdamW::reduce_gradients) then yields the reduced
  // gradient exactly, every element having a single non-zero term. Local, no communication.
  void export_gradients();
  // Zeroes the gradient slices (the start of an optimizer step).
  void zero_gradients();
  // Sets the slices from full parameter values (after an optimizer step): `source(name)` returns
  // the tensor of a TextWeights::named name, in any float dtype. Local, no communication.
  void refresh(const std::function<Tensor(const std::string& name)>& source);

 private:
  struct Param {
    Tensor* field = nullptr;    // in TextWeights::layers[l]
    std::vector<size_t> named;  // entries of TextWeights::named sharing its storage
    Shape shape;
    int64_t offset = 0;
  };
  struct Grad {
    size_t named = 0;  // index in TextGrads::named
    int64_t offset = 0;
  };
  struct Layer {
    std::vector<Param> params;
    int64_t padded = 0;  // flat elements, a multiple of the group size
    Tensor shard;        // [padded / P]
    std::weak_ptr<Storage> gathered;
    std::vector<Grad> grads;
    int64_t grad_padded = 0;
    Tensor grad_shard;  // [grad_padded / P]
  };
  Layer& layer_at(int64_t layer, const char* what);

  model::text::TextWeights& weights_;
  model::text::TextGrads& grads_;
  Communicator& group_;
  std::vector<Layer> layers_;
  int64_t full_bytes_ = 0;
};

}  // namespace glmtune::dist
