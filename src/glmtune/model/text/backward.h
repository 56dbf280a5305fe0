#pragma once
// The backward of the whole text model on the CPU, over packed sequences: from the losses (LM
// cross-entropy, the MTP cross-entropy, the balancing loss) back through the lm_head, the final
// norm and the stream mean, every decoder layer in reverse, the MTP layer and the embedding, into
// a gradient for every trainable parameter (TextGrads, named as the ParamStore / TextWeights
// name them) and for the input embeddings. docs/training.md ("The model backward") writes the
// chain out.
//
// Two steps, so that the caller decides what the forward keeps:
//
//   TrainForward f = training_forward(model, input, options);   // per-layer activation policy
//   BackwardResult r = backward(model, input, *f.context, options, grads);
//
// `backward` also accepts the context of TextModel::forward with SavePolicy::all (every layer
// kept). Per decoder layer (and for the MTP layer) the context either holds everything the layer
// saved (keep), only the layer's input (recompute: the backward re-runs that layer's forward from
// its input before differentiating it), or everything in pinned host memory (offload, GPU only:
// the backward brings the context of the next offloaded layer back while it differentiates the
// current one). The forward is deterministic and the copies move bytes, so the three policies
// give bit-identical gradients.
//
// The losses are computed inside the backward, fused with their gradient (the lm_head and the
// cross-entropy run over chunks of label rows, so [T, V] logits never exist whole):
//
//   objective = Σ_rows CE_lm / lm_denominator
//             + mtp_scale / K · Σ_k Σ_rows CE_k / mtp_denominator_k          (K MTP depths)
//             + α / M · Σ_routers balancing_loss(router) (model/balancing_loss.h)
//
// The denominators are those of the optimizer step (the label count over every micro-pack of the
// step, and over every rank), so the gradients of a step's micro-packs simply add up.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "glmtune/model/text/model.h"
#include "glmtune/ops/mhc.h"

namespace glmtune::model::text {

// Gradients of one decoder layer: the fields of LayerWeights that are trained. The indexer's
// parameters and the router correction bias never get a gradient and stay undefined.
struct LayerGrads {
  Tensor input_layernorm;
  Tensor post_attention_layernorm;
  ops::MhcGrads attn_hc, ffn_hc;
  ops::KdaGrads kda;
  ops::DsaParams dsa;
  ops::MlpParams dense;
  ops::MoeParams moe;
};

struct MtpGrads {
  ops::Linear eh_proj;
  Tensor enorm, hnorm;
  Tensor input_layernorm, post_attention_layernorm, shared_head_norm;
  ops::DsaParams dsa;
  ops::MoeParams moe;
};

// Gradient buffers mirroring TextWeights, in the model's compute dtype. Backward passes add into
// them, so one set accumulates the micro-packs of an optimizer step.
struct TextGrads {
  Tensor embed_tokens, final_norm;
  ops::Linear lm_head;  // its weight is embed_tokens itself when tied
  std::vector<LayerGrads> layers;
  std::optional<MtpGrads> mtp;
  // Every buffer under its parameter's internal name, in TextWeights::named order (a tied head
  // appears once, as the embedding).
  std::vector<std::pair<std::string, Tensor>> named;

  // Zero buffers for every trainable tensor of `weights`.
  static TextGrads zeros_like(const TextWeights& weights);
  // Sets every buffer to 0 (for the next optimizer step).
  void zero();
  // The buffer of parameter `name`, or nullptr when it has none (frozen or unknown).
  const Tensor* find(const std::string& name) const;
};

// Whether a tensor of `weights` is trained by gradients: not the DSA indexer (frozen, run without
// gradient) and not the router correction bias (a buffer moved by the load-balancing rule).
bool is_trainable_param(const std::string& name);

struct TrainOptions {
  // Per decoder layer, what the forward keeps for the backward (model.h, ActivationPolicy). Empty:
  // keep every layer.
  std::vector<ActivationPolicy> activations;
  // The MTP layer is kept or recomputed, never offloaded: its backward comes first, right after
  // its forward, so a copy to the host would have nothing to overlap with.
  bool recompute_mtp = false;

  bool mtp = true;  // run (and train) the MTP layer when the model has one
  int64_t mtp_depths = 1;
  double mtp_loss_scale = 0.1;

  // Divisor of the LM cross-entropy sum: the label tokens of the whole optimizer step. ≤ 0: this
  // pack's own count.
  double lm_denominator = 0;
  // Per MTP depth, the same for the MTP targets. Empty (or ≤ 0 entries): this pack's counts.
  std::vector<double> mtp_denominators;

  // Balancing loss α (0: off) and the number of micro-packs of the step it is averaged over.
  double balancing_alpha = 0;
  int64_t num_micro_packs = 1;

  int64_t loss_chunk_rows = 256;  // label rows per lm_head chunk

  // Expert parallelism: where the routed experts run (layer.h); null: in this process. Every
  // rank of its group must then run the same layers in the same order (its calls are collective).
  const ExpertDispatch* expert_dispatch = nullptr;

  // Sequence parallelism (layer.h): the pack is split over the ranks of a group and this process
  // computes its shard of rows. Every rank of the group passes the whole pack (ids, labels,
  // cu_seqlens: the labels and MTP targets are built on it, since MTP's future tokens cross shard
  // boundaries); losses, loads and gradients are then this shard's part, and their sums over the
  // group are the single-process values. Denominators ≤ 0 mean the whole pack's counts. Input
  // embeddings (vision-language packs) are not supported with it.
  const SequenceParallel* sequence_parallel = nullptr;

  // Fully sharded data parallel (layer.h): decoder-layer parameters are gathered before each
  // layer runs (forward and recompute) and released after, and each layer's gradient buffers
  // are provided right before its backward and reduced into this rank's slice right after. The
  // buffers of TextGrads for decoder layers exist only in between; the provider holds the
  // reduced slices. Null: the weights are whole and the gradients stay in TextGrads.
  LayerParamProvider* layer_params = nullptr;
  // The MTP layer's parameters held the same way (gather / release with the layer index
  // num_hidden_layers, around its depths in the forward and in the backward); null: whole.
  LayerParamProvider* mtp_params = nullptr;
};

// The per-layer policy of `layers` decoder layers from the recipe's two fractions: the first
// R = floor(recompute · layers) layers are recomputed (the reference trainer's recompute_ratio),
// the next O = floor(offload · layers) are offloaded, the rest are kept. Recompute goes first
// because the first layers' backward comes last, when nothing is left to overlap a copy with; the
// last layers are kept because their backward comes first. recompute + offload must not exceed 1.
std::vector<ActivationPolicy> activation_policy(int64_t layers, double recompute,
                                                double offload = 0);

// Expert loads of one router in one pack (padding rows excluded).
struct RouterLoads {
  std::string bias_name;  // the router's e_score_correction_bias parameter
  Tensor counts;          // int64 [E]
};

struct TrainForward {
  std::shared_ptr<ForwardContext> context;
  // Main MoE layers in layer order, then each MTP depth (all MTP depths under the MTP router's
  // name).
  std::vector<RouterLoads> loads;
};

// The forward of a training step. Saves, per layer, what `options.activations` asks for; computes
// no loss (the backward does, fused with its gradient). `input.labels` must be defined. On a GPU
// an offloaded layer's context starts its copy to pinned host memory right after the layer's
// forward, on a side stream, and its device memory is released once the next layer is queued; on
// the CPU offload keeps the layer.
TrainForward training_forward(const TextModel& model, const PackInput& input,
                              const TrainOptions& options);

struct BackwardResult {
  double lm_loss_sum = 0;  // Σ CE over the pack's label rows
  int64_t lm_tokens = 0;
  double lm_loss = 0;  // lm_loss_sum / lm denominator (this pack's share of the step's loss)
  std::vector<double> mtp_loss_sum;  // per depth
  std::vector<int64_t> mtp_tokens;   // per depth
  double mtp_loss = 0;        // mtp_scale / K · Σ_k sum_k / denominator_k (this pack's share)
  double balancing_loss = 0;  // α / M · Σ_routers (this pack's share)
  Tensor d_embeddings;        // [T, D] gradient of the objective w.r.t. the input embeddings

  double objective() const { return lm_loss + mtp_loss + balancing_loss; }
};

// Differentiates the objective above for one pack, adding every parameter gradient into `grads`
// (built by TextGrads::zeros_like for this model). The gradient of embed_tokens includes the MTP
// future-token lookups; the padding row (pad_token_id) gets none, as in the reference's
// nn.Embedding(padding_idx). With `input.inputs_embeds` the token lookup is not differentiated
// (only d_embeddings is returned) and MTP's future rows add into d_embeddings. Under sequence
// parallelism with `inputs_embeds` (the whole pack's, on every rank), d_embeddings covers the whole
// pack too: this rank's partial gradient (its shard's rows and the MTP future rows its shard
// read, zero elsewhere), whose sum over the group is the gradient.
BackwardResult backward(const TextModel& model, const PackInput& input,
                        const ForwardContext& context, const TrainOptions& options,
                        TextGrads& grads);

// training_forward then backward.
struct StepPackResult {
  BackwardResult backward;
  std::vector<RouterLoads> loads;
};
StepPackResult forward_backward(const TextModel& model, const PackInput& input,
                                const TrainOptions& options, TextGrads& grads);

}  // namespace glmtune::model::text
