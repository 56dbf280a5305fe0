#pragma once
// `glmtune plan`: the device bytes one GPU of a training layout needs, by part, predicted from the
// model config alone (no weights read), before any GPU is rented. docs/plan.md writes the model
// out and checks it against the measured peaks of docs/PERF.md.
//
// Static parts are exact counts over the released layout (model/layout.h) under the trainer's
// storage rules: compute weights bf16 on the GPU except the fp32-kept parameters and the mHC
// mixing matrices (f32); an FP8 base keeps the frozen weights the release stores in FP8 as 1 byte
// a value plus f32 128x128 block scales; gradients f32 for every trained tensor (ops/grad.h);
// AdamW an f32 master for each bf16-stored trained tensor and two f32 moments
// (train/device_adamw.h), sharded over the data-parallel ranks when there are several
// (dist/sharded_optimizer.h). Activations are the per-token tensors each layer's context keeps
// (model/text/layer.h LayerContext, MtpContext), the inputs of recomputed layers, and the working
// set of the layer being differentiated.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "glmtune/model/config.h"
#include "glmtune/model/layout.h"

namespace glmtune::train {

// The base's storage: bf16 compute copies, or the release's FP8 values kept as they are for the
// frozen weights the release stores in FP8 (a LoRA run's base).
enum class PlanBase { bf16, fp8 };

struct PlanLora {
  int64_t rank = 16;
  // PEFT's target_modules (suffixes or "all-linear") or, when set, a regular expression over
  // whole module names (model/lora.h).
  std::vector<std::string> target_modules = {"all-linear"};
  std::string target_regex;
  // PEFT's target_parameters (model/lora.h): the routed experts' fused parameters
  // ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"), each with an adapter per expert
  // (A [E, r, in], B [E, out, r]); under expert parallelism each GPU holds its experts'.
  std::vector<std::string> target_parameters;
};

struct PlanOptions {
  int64_t gpus = 1;
  int64_t ep = 1;  // train.ep_size
  int64_t sp = 1;  // train.sp_size
  bool fsdp = false;
  double recompute = 1.0;  // train.recompute: the first floor(r · layers) layers recomputed
  double offload = 0.0;    // train.offload: the next floor(o · layers) offloaded to host memory
  int64_t pack = 16384;    // data.pack_max_length: tokens of one micro-pack
  bool mtp = true;
  int64_t loss_chunk_rows = 256;  // label rows per lm_head + cross-entropy chunk (the trainer's)
  std::optional<PlanLora> lora;
  PlanBase base = PlanBase::bf16;
  // train.fp8 = "tilewise": each FP8 projection's weight blocks are kept for the step (not under
  // fsdp), and a frozen FP8 weight the FP8 GEMMs read from its codes is never dequantised.
  bool fp8_tilewise = false;
  // train.freeze: regular expressions searched in the released names; the tensors they match get
  // no gradient or optimizer state, and with `base` fp8 (train.frozen_weights = "fp8") the frozen
  // tensors the release stores in FP8 are held as it stores them.
  std::vector<std::string> freeze;
  double device_gib = 139.0;
};

// One line of the plan: `part` (weights, adapters, gradients, optimizer, activations,
// communication, allocator) and what it counts.
struct PlanItem {
  std::string part;
  std::string item;
  double bytes = 0;
  std::string note;
};

struct MemoryPlan {
  PlanOptions options;
  int64_t dp = 1;           // data-parallel ranks (gpus / sp)
  int64_t kept_layers = 0;  // decoder layers whose whole context stays on the device
  int64_t recomputed_layers = 0;
  int64_t offloaded_layers = 0;
  // Exact element counts behind the static parts.
  int64_t base_params = 0;            // text + MTP parameters of the whole model
  int64_t trained_params = 0;         // of the whole model (adapters only, with LoRA)
  int64_t adapter_params = 0;         // LoRA A and B elements of the whole model
  int64_t adapted_modules = 0;        // projections with an adapter (target_modules)
  int64_t adapted_expert_params = 0;  // fused routed-expert parameters with adapters
  std::vector<PlanItem> items;
  double total = 0;
  double headroom = 0;  // device bytes left over (negative: short by that much)
  bool fits = false;
  // For a layout that does not fit: the changes that would make it fit, each checked.
  std::vector<std::string> suggestions;

  double part_bytes(const std::string& part) const;
};

// Validates `options` (glmtune::Error naming the flag and the fix) and predicts the per-GPU bytes.
MemoryPlan plan_memory(const model::ModelConfig& config, const PlanOptions& options);

// The projections (module names as model/lora.h names them, without ".weight") the targets adapt
// in this config, resolved by PEFT's rules over the layout alone: the same set
// model::resolve_lora_targets picks from a loaded model (tests/unit/test_plan.cpp holds them
// equal): the projections, then the targeted fused expert parameters layer by layer
// ("...layers.1.mlp.experts.gate_up_proj").
std::vector<std::string> plan_lora_modules(const model::ModelConfig& config, const PlanLora& lora);

// The device bytes of a model's weights (text, MTP and vision) under the two ways of holding a
// frozen base: every tensor as the GPU computes with it (bf16; the fp32-kept parameters and the mHC
// mixing matrices f32), or with the tensors `in_fp8` picks kept as FP8 codes and f32 128 × 128
// block scales, plus the largest layer's FP8 tensors dequantised while that layer runs
// (lora.base = "fp8", model/text/fp8_layers.h).
struct WeightBytes {
  double bf16 = 0;
  double fp8_values = 0, fp8_scales = 0, fp8_running_layer = 0, fp8_others = 0;
  double fp8() const { return fp8_values + fp8_scales + fp8_running_layer + fp8_others; }
};
WeightBytes device_weight_bytes(const model::ModelConfig& config,
                                const std::function<bool(const model::ParamSpec&)>& in_fp8);

}  // namespace glmtune::train
