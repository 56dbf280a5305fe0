#pragma once
// A frozen base kept in FP8: the decoder-layer weights that the checkpoint stores as FP8 e4m3 with
// 128 × 128 block scales (io/fp8.h) stay in that form on the model's device, about half the bytes
// of their bf16 values, and each layer's are dequantised into its tensors right before the layer
// runs (forward, recompute, backward) and dropped after, through the LayerParamProvider protocol
// of layer.h that fully sharded layers use. The values the layer computes with are exactly those
// of the bf16 load (the same single rounding of the exact product), so a run with the base in FP8
// follows the run with the base dequantised at load bit for bit; it only holds less.
//
// With train.fp8 = "tilewise" as well (`feed_fp8_gemms`), the FP8 GEMMs read these weights'
// released codes and scales themselves (ops/fp8.h pin_fp8_weight): no second rounding, no
// quantisation per use, and a weight that only FP8 GEMMs read is not dequantised at all. A fused
// tensor whose pieces cannot make one 128 × 128 grid per expert (pieces of rows that are no
// multiple of 128) is quantised from its values instead.
//
// Only frozen tensors qualify (nothing updates the codes): the base under [lora] (lora.base =
// "fp8"), or the tensors train.freeze keeps fixed (train.frozen_weights = "fp8"). The MTP layer's
// tensors are held the same way, under the layer index num_hidden_layers (TrainOptions::
// mtp_params).

#include <cstdint>
#include <string>
#include <vector>

#include "glmtune/io/checkpoint.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/layer.h"
#include "glmtune/model/text/weights.h"
#include "glmtune/ops/fp8.h"

namespace glmtune::model::text {

// Whether internal parameter `name` (a decoder layer's or the MTP layer's, of a model with
// `num_layers` decoder layers) is
// assembled only from FP8 weights with block-scale companions in `reader`: the test of which
// tensors a load may defer (ParamStore::load's `defer`) to hold them in FP8.
bool stored_in_fp8(const io::CheckpointReader& reader, const std::string& name, int64_t num_layers);

class Fp8Layers final : public LayerParamProvider {
 public:
  // Takes every deferred decoder- or MTP-layer tensor of `store` (loaded with stored_in_fp8 as its
  // defer test; each must be frozen) from `reader` onto `weights.device` as codes and scales, and
  // releases their placeholders in `weights`. InternalError for a deferred tensor that is trained
  // or not in FP8.
  Fp8Layers(TextWeights& weights, const ParamStore& store, const io::CheckpointReader& reader,
            bool feed_fp8_gemms = false);

  void gather(int64_t layer) override;
  void prefetch(int64_t) override {}
  void release(int64_t layer) override;
  // The frozen tensors have no gradient; the layers' other buffers stay as the model made them.
  void allocate_gradients(int64_t) override {}
  void reduce_gradients(int64_t) override {}

  // Tensors held and the device bytes of their codes and scales; the bytes their bf16 values
  // would take.
  int64_t tensors() const { return tensors_; }
  int64_t held_bytes() const { return held_bytes_; }
  int64_t bf16_bytes() const { return bf16_bytes_; }
  // Weights (an expert's slice counting as one) whose FP8 GEMMs read the released codes.
  int64_t fed_weights() const { return fed_weights_; }
  // Held tensors that only FP8 GEMMs read (every slice fed, the projection marked by
  // use_fp8_gemms): gathered without dequantising, so their bf16 values never exist.
  int64_t codes_only_tensors() const { return codes_only_tensors_; }

 private:
  struct Held {
    Tensor* field = nullptr;    // in TextWeights::layers[l]
    std::vector<size_t> named;  // its entries in TextWeights::named
    Shape shape;
    DType dtype = DType::bf16;  // the field's (the model's compute dtype for it)
    Tensor codes;               // fp8e4m3 [pieces · piece_rows, cols]
    Tensor scales;              // f32 [pieces, ceil(piece_rows / 128), ceil(cols / 128)]
    int64_t piece_rows = 0;
    // feed_fp8_gemms: the blocks of each [out, in] slice of the field (one for a 2-D field, one
    // per expert for the fused experts), pinned to it at each gather.
    std::vector<ops::Fp8Blocks> fed;
    // With the fused experts' slices fed and their rows a multiple of 128: the blocks of every
    // expert's slice as one [E · out, in] stack (the codes shared with `fed`), pinned to the field
    // viewed so, which the grouped FP8 kernel reads (ops/cuda/fp8.h).
    ops::Fp8Blocks stack;
    bool codes_only = false;  // codes_only_tensors()
  };

  // Fills h.fed; the number of slices fed, 0 when the pieces allow none.
  static int64_t fed_slices(Held& h);

  TextWeights& weights_;
  std::vector<std::vector<Held>> layers_;
  int64_t tensors_ = 0, held_bytes_ = 0, bf16_bytes_ = 0, fed_weights_ = 0, codes_only_tensors_ = 0;
};

}  // namespace glmtune::model::text
