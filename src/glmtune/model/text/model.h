#pragma once
// The GLM-5.3-Flash text model forward on the CPU, over packed sequences
// (docs/model/text_model.md), equal per document to transformers 5.17.0
// `Glm5NextForConditionalGeneration` run on that document alone in fp32; MTP, which transformers
// does not run, follows the reference trainer.
//
//   e = embed_tokens[input_ids]              (or caller-supplied embeddings, for the vision splice)
//   X = H copies of e                         [T, H, D]
//   X = layer_l(X) for l = 0 .. L−1           mHC + KDA | DSA + mHC + MLP | MoE  (layer.h)
//   h = mean over the H streams               [T, D]  (returned: the MTP input)
//   logits = lm_head(norm(h))                 [T, V]  (or only the loss, in chunks)
//   MTP depth k: x = eh_proj([enorm(E[t_{i+k}]) ; hnorm(h_in)]), one pre-norm DSA + MoE layer,
//                shared_head.norm, lm_head; target t_{i+k+1} of the same document
//
// A pack is input_ids [T] plus cu_seqlens [ndoc + 1]: every document is computed as if alone (the
// ops restart KDA state, conv, indexer pools and attention at each boundary). A padding document,
// when there is one, is the last document; its rows are excluded from the expert counts and should
// carry ignored labels.

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "glmtune/model/config.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/layer.h"
#include "glmtune/model/text/weights.h"

namespace glmtune::model::text {

// What the forward keeps for a backward. `none` keeps nothing beyond the outputs (evaluation);
// `all` keeps every intermediate of every layer (see LayerContext / MtpContext).
enum class SavePolicy { none, all };

// What a training forward keeps of one decoder layer for the backward (TrainOptions::activations):
// keep: the whole layer context on the model's device; recompute: only the layer's input, the
// backward reruns the layer's forward first; offload: the whole context, moved to pinned host
// memory while the next layers compute and brought back while the backward of the layer after it
// runs (GPU only: on the CPU the context already is in host memory, so offload keeps it).
enum class ActivationPolicy { keep, recompute, offload };

struct TextModelOptions {
  // Compute dtype: f32 (the reference path) or f64 (tests) on the CPU; bf16 on a CUDA device, or
  // f32 there (the fp32 mode of the parity tests).
  DType dtype = DType::f32;
  Device device = Device::cpu();
};

struct PackInput {
  // int32 or int64 [T]. Required for the token embedding lookup and for MTP's token path.
  Tensor input_ids;
  Tensor cu_seqlens;  // int32 or int64 [ndoc + 1], 0 .. T
  // Optional [T, D] embeddings replacing the lookup (any float dtype; converted). When given, MTP
  // reads its future embeddings from these rows too, with zero vectors past a document's end (the
  // reference trainer's supplied-embedding path).
  Tensor inputs_embeds;
  // Optional int32 [T] aligned labels (next_token_labels): enables the LM and MTP losses.
  Tensor labels;
  // Rows [T − padding_tokens, T) are padding: left out of every expert count.
  int64_t padding_tokens = 0;
};

struct ForwardOptions {
  bool logits = true;              // materialise logits [T, V]; else the loss runs in chunks
  int64_t loss_chunk_rows = 1024;  // rows per lm_head chunk when logits are not kept
  bool mtp = true;                 // run the MTP layer when the checkpoint has one
  int64_t mtp_depths = 1;          // logical MTP depths (one physical layer, shared weights)
  double mtp_loss_scale = 0.1;     // mtp_loss = scale × mean over depths of the token-mean CE
  bool mtp_logits = false;         // materialise each depth's logits
  SavePolicy save = SavePolicy::none;
  // Sharded decoder-layer parameters (layer.h): gathered before each layer and released after.
  LayerParamProvider* layer_params = nullptr;
};

struct LossStats {
  double sum = 0;     // Σ CE over labelled rows
  int64_t count = 0;  // labelled rows
  double mean() const { return count > 0 ? sum / double(count) : 0.0; }
};

struct MtpOutput {
  std::vector<Tensor> hidden;         // per depth [T, D] after shared_head.norm
  std::vector<Tensor> logits;         // per depth [T, V] with ForwardOptions::mtp_logits
  std::vector<LossStats> ce;          // per depth, when labels are given
  std::vector<Tensor> expert_counts;  // per depth int64 [E], padding excluded
  double loss = 0;                    // scale × mean over depths of ce[k].mean()
};

// Everything a backward of the whole model needs (SavePolicy::all).
struct ForwardContext {
  std::vector<int64_t> cu_seqlens;
  int64_t counted_rows = 0;
  // Sequence parallel (TrainOptions::sequence_parallel): the first pack row held here; T below is
  // then the shard's row count, while cu_seqlens stays the whole pack's.
  int64_t row_begin = 0;
  Tensor embeddings;                 // [T, D]
  std::vector<LayerContext> layers;  // one per decoder layer
  // Per decoder layer, what its context holds (empty: every layer kept). An offloaded layer's
  // context holds tensors in pinned host memory (tensor/host_offload.h).
  std::vector<ActivationPolicy> policies;
  Tensor final_streams;            // [T, H, D] the last layer's output
  Tensor final_rstd;               // [T] of the final norm
  Tensor final_normed;             // [T, D] norm(h), the lm_head input
  Tensor labels;                   // int32 [T] (undefined without labels)
  std::vector<MtpContext> mtp;     // one per MTP depth
  std::vector<Tensor> mtp_labels;  // per depth int32 [T]
};

struct ForwardOutput {
  Tensor hidden;                // [T, D] mean over streams, before the final norm
  Tensor logits;                // [T, V] with ForwardOptions::logits
  std::optional<LossStats> lm;  // when labels are given
  // Per MoE decoder layer, in layer order: int64 [E] tokens routed to each expert (padding
  // excluded), and the layer index of each entry.
  std::vector<Tensor> expert_counts;
  std::vector<int64_t> moe_layers;
  std::optional<MtpOutput> mtp;             // when the model has MTP and it ran
  std::shared_ptr<ForwardContext> context;  // with SavePolicy::all

  double loss() const { return lm ? lm->mean() : 0.0; }
};

class TextModel {
 public:
  // Copies and converts the text weights (once); the store may be released afterwards. Layer
  // schedules the reference cannot run (a "shared" indexer layer that does not directly follow a
  // DSA layer with its own indexer) are already refused by ModelConfig.
  explicit TextModel(const ParamStore& store, TextModelOptions options = {});
  // From weights built elsewhere (they must match `config`).
  TextModel(ModelConfig config, TextWeights weights);

  const ModelConfig& config() const { return config_; }
  const TextConfig& text() const { return config_.text(); }
  DType dtype() const { return weights_.dtype; }
  Device device() const { return weights_.device; }
  bool has_mtp() const { return weights_.mtp.has_value(); }
  const OpConfigs& op_configs() const { return ops_; }
  const TextWeights& weights() const { return weights_; }
  TextWeights& weights() { return weights_; }

  ForwardOutput forward(const PackInput& input, const ForwardOptions& options = {}) const;

  // embed_tokens rows of `input_ids` [T] -> [T, D]. An id outside the vocabulary is a
  // glmtune::Error naming its position.
  Tensor embed(const Tensor& input_ids) const;

  // The embeddings MTP depth `depth` (≥ 1) mixes in at position i: those of token i + depth of the
  // same document; past the document's end, the embedding of token id 0 (token path) or a zero
  // vector (supplied-embedding path, `inputs_embeds` defined).
  Tensor future_embeddings(const Tensor& input_ids, const Tensor& inputs_embeds,
                           const std::vector<int64_t>& cu_seqlens, int64_t depth) const;

 private:
  ModelConfig config_;
  TextWeights weights_;
  OpConfigs ops_;
};

}  // namespace glmtune::model::text
