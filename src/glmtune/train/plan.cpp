#include "glmtune/train/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <regex>
#include <set>

#include "glmtune/base/error.h"
#include "glmtune/base/overloaded.h"
#include "glmtune/dist/parallel.h"
#include "glmtune/model/init.h"
#include "glmtune/model/layout.h"
#include "glmtune/model/lora.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/weights.h"

namespace glmtune::train {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// The KDA core's backward workspace per (token, head): 6.0 GB at T = 16384, 64 heads, bf16
// (ops/cuda/kda_core.cu, the workspace note at its top).
constexpr double kKdaBackwardPerTokenHead = 6.0e9 / (16384.0 * 64.0);
// What the caching allocator reserves beyond what it hands out, as a share of the bytes that
// come and go during a step: docs/PERF.md ("The caching allocator") measured 1.9 GiB over 18 GiB
// of activations at --recompute 1 and 3.6 over 35 at --recompute 0.
constexpr double kAllocatorShare = 0.10;

bool is_routed_expert(const std::string& name) {
  return name.find(".mlp.experts.") != std::string::npos;
}

// The mHC mixing matrices: bf16 in the checkpoint, f32 on a GPU (model/text/weights.h).
bool is_hc_mixing(const std::string& name) {
  return name.find(".hc_") != std::string::npos && name.ends_with("_fn");
}

bool lora_matches(const PlanLora& lora, const std::optional<std::regex>& re,
                  const std::string& internal) {
  const std::string module = model::peft_module(internal);
  if (re) return std::regex_match(module, *re);
  for (const std::string& key : lora.target_modules)
    if ((key == "all-linear" && module != "lm_head") || module == key ||
        module.ends_with("." + key))
      return true;
  return false;
}

// The projection names of one decoder layer, from the parameter list the loader reads.
std::vector<std::string> layer_projection_names() {
  model::text::LayerWeights lw;
  std::vector<std::string> out;
  model::text::zip_layer_params(
      lw, lw,
      Overloaded{[](const std::string&, model::text::ParamGroup, Tensor&, Tensor&) {},
                 [&](const std::string& name, model::text::ParamGroup, ops::Linear&, ops::Linear&,
                     ops::WholeProjection) { out.push_back(name); }});
  return out;
}

std::string gib(double bytes) { return fmt::format("{:.2f}", bytes / kGiB); }

}  // namespace

double MemoryPlan::part_bytes(const std::string& part) const {
  double sum = 0;
  for (const PlanItem& i : items)
    if (i.part == part) sum += i.bytes;
  return sum;
}

WeightBytes device_weight_bytes(const model::ModelConfig& config,
                                const std::function<bool(const model::ParamSpec&)>& in_fp8) {
  WeightBytes w;
  std::map<int64_t, double> layer_fp8;
  for (const model::ParamSpec& s : model::released_layout(config)) {
    const double n = double(s.numel());
    const double held = (model::is_fp32_kept(s.name) || is_hc_mixing(s.name) ? 4 : 2) * n;
    w.bf16 += held;
    if (in_fp8 && s.shape.size() == 2 && in_fp8(s)) {
      w.fp8_values += n;
      w.fp8_scales += 4.0 * double(((s.shape[0] + 127) / 128) * ((s.shape[1] + 127) / 128));
      layer_fp8[s.layer] += n;
    } else {
      w.fp8_others += held;
    }
  }
  for (const auto& [layer, n] : layer_fp8)
    w.fp8_running_layer = std::max(w.fp8_running_layer, 2 * n);
  return w;
}

std::vector<std::string> plan_lora_modules(const model::ModelConfig& config, const PlanLora& lora) {
  std::optional<std::regex> re;
  if (!lora.target_regex.empty()) try {
      re.emplace(lora.target_regex);
    } catch (const std::regex_error& e) {
      throw Error(fmt::format("'{}' is not a regular expression: {}", lora.target_regex, e.what()),
                  "--lora-targets", "write a valid ECMAScript regular expression");
    }
  std::set<std::string> weights;
  for (const model::ParamSpec& s : model::released_layout(config)) weights.insert(s.name);
  const model::TextConfig& c = config.text();
  std::vector<std::string> out;
  std::set<std::string> seen;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    for (const std::string& name : layer_projection_names()) {
      const std::string module = model::text::layer_prefix(l) + name;
      // Like model/lora.h: released projections only (the fused experts are not), never the
      // indexer (it runs without gradient); the MTP layer is refused there too.
      if (!weights.count(module + ".weight") || name.find(".indexer.") != std::string::npos ||
          !seen.insert(module).second)
        continue;
      if (lora_matches(lora, re, module)) out.push_back(module);
    }
  // The head, when named (all-linear leaves it out, as PEFT's does).
  if (lora_matches(lora, re, "lm_head")) out.push_back("lm_head");
  // The decoder layers' fused expert parameters (the MTP layer's are not adaptable), matched by
  // PEFT's target_parameters rule as model/lora.h matches them.
  std::vector<std::string> experts;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    if (c.mlp_layer_types[size_t(l)] == model::MlpKind::sparse)
      for (const char* p : {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"})
        experts.push_back(model::text::layer_prefix(l) + p);
  for (const std::string& key : lora.target_parameters)
    if (std::none_of(experts.begin(), experts.end(),
                     [&](const std::string& e) { return model::parameter_targeted(e, {key}); }))
      throw Error(fmt::format("target parameter '{}' matches none of the routed experts' fused "
                              "parameters (named like "
                              "model.language_model.layers.1.mlp.experts.gate_up_proj)",
                              key),
                  "--lora-experts / lora.target_parameters",
                  "target mlp.experts.gate_up_proj and mlp.experts.down_proj, on a model with "
                  "routed experts");
  for (const std::string& e : experts)
    if (model::parameter_targeted(e, lora.target_parameters)) out.push_back(e);
  if (out.empty())
    throw Error("the LoRA targets match no projection of this model", "--lora-targets",
                "use \"all-linear\", projection suffixes such as q_proj,o_proj,mlp.down_proj, "
                "or a regular expression over names like "
                "model.language_model.layers.0.self_attn.q_proj");
  return out;
}

namespace {

void check_options(const PlanOptions& o) {
  if (o.gpus < 1)
    throw Error(fmt::format("--gpus {} is not a GPU count", o.gpus), "--gpus",
                "give the number of GPUs, 1 or more");
  if (!(o.recompute >= 0 && o.recompute <= 1))
    throw Error(fmt::format("--recompute {} is not a fraction", o.recompute), "--recompute",
                "give a fraction of the decoder layers between 0 and 1");
  if (!(o.offload >= 0 && o.offload <= 1) || o.recompute + o.offload > 1 + 1e-9)
    throw Error(fmt::format("--offload {} with --recompute {}", o.offload, o.recompute),
                "--offload",
                "give a fraction between 0 and 1 whose sum with --recompute is at most 1");
  if (o.pack < 1)
    throw Error(fmt::format("--pack {} tokens", o.pack), "--pack",
                "give the pack length in tokens (data.pack_max_length), e.g. 16384");
  if (o.loss_chunk_rows < 1)
    throw Error(fmt::format("--loss-chunk-rows {}", o.loss_chunk_rows), "--loss-chunk-rows",
                "give at least 1 row (the trainer uses 256)");
  if (!(o.device_gib > 0) || !std::isfinite(o.device_gib))
    throw Error(fmt::format("--device-memory {} GiB", o.device_gib), "--device-memory",
                "give the GPU's usable memory in GiB, e.g. 139 for an H200");
  if (o.lora && o.lora->rank < 1)
    throw Error(fmt::format("--lora-rank {} must be at least 1", o.lora->rank), "--lora-rank",
                "give the adapters' rank, e.g. 16");
  if (o.pack % o.sp != 0 && o.sp > 1)
    throw Error(fmt::format("--pack {} does not split over --sp {}", o.pack, o.sp), "--pack",
                "give a pack length that is a multiple of the sequence-parallel size");
}

// The per-token bytes of the tensors one layer's context keeps (model/text/layer.h LayerContext)
// in bf16 compute with the GPU ops' f32 side tensors.
struct TokenBytes {
  double streams = 0;  // one [H, D] stream tensor
  double kept_common = 0;
  double kda = 0, dsa = 0, dense = 0, moe = 0, moe_routing = 0;
  double kda_ws = 0, dsa_ws = 0, dense_ws = 0, moe_ws = 0, moe_exchange = 0;
  double mtp_extra = 0;
};

TokenBytes token_bytes(const model::TextConfig& c, int64_t ep) {
  const double D = double(c.hidden_size), H = double(c.hc_mult), QL = double(c.linear_width()),
               NL = double(c.linear_num_heads), NH = double(c.num_attention_heads),
               Dqk = double(c.qk_head_dim()), Dv = double(c.v_head_dim), Rq = double(c.q_lora_rank),
               Rkv = double(c.kv_lora_rank), W = double(c.index_topk),
               K = double(c.num_experts_per_tok), E = double(c.n_routed_experts),
               I = double(c.intermediate_size), Im = double(c.moe_intermediate_size),
               Is = double(c.moe_intermediate_size * c.n_shared_experts);
  TokenBytes b;
  b.streams = H * D * 2;
  // An mHC site keeps collapsed [D] in bf16, post [H], comb [H, H] and the saved rstd, mix
  // [(2+H)·H], pre [H], comb_init [H, H] in f32.
  const double site = D * 2 + 4 * (H + H * H + 1 + (2 + H) * H + H + H * H);
  // streams_in and streams_mid, two sites, the two norms' outputs and rstd, attn_out, ffn_out.
  b.kept_common = 2 * b.streams + 2 * site + 2 * (D * 2 + 4) + 2 * D * 2;
  // KdaSaved: conv inputs and conv outputs q, k, v (bf16), g (f32), the q/k norms and beta
  // (f32 per head), core, gate and normed (bf16).
  b.kda = 6 * QL * 2 + QL * 4 + 3 * NL * 4 + 3 * QL * 2;
  // The MLA context (bf16): q_a and q_resid, kv_a and the latent, q, the attention core, and in
  // the absorbed form on a GPU the latent-space output with its log-sum-exp (f32 per head; no
  // per-head keys or values); the two norms' rstd (f32) and the selection (int32 [W]).
  b.dsa =
      2 * Rq * 2 + 2 * Rkv * 2 + NH * Dqk * 2 + NH * Dv * 2 + NH * Rkv * 2 + NH * 4 + 2 * 4 + W * 4;
  // A kept layer's feed-forward projections (its backward reruns none of them, but an adapted or
  // FP8 routed down projection's forward, whose output the combine weights' gradient reads): the
  // dense MLP's gate and up; the MoE's routing (logits, combine weights, expert ids), the shared
  // expert's gate and up, and each routed row's gate/up product (not under expert parallelism,
  // whose experts run on other ranks and keep nothing). An offloaded layer keeps the routing alone.
  b.dense = 2 * I * 2;
  b.moe_routing = E * 4 + K * 4 + K * 4;
  b.moe = b.moe_routing + 2 * Is * 2 + (ep > 1 ? 0 : K * 2 * Im * 2);
  // Backward working sets (the layer being differentiated; its gradients of the inputs):
  // KDA: the core's workspace, dq dk dv and the conv inputs' gradients (bf16), dg (f32), the
  // core's and gate's gradients.
  b.kda_ws = NL * kKdaBackwardPerTokenHead + QL * (3 * 2 + 4 + 3 * 2 + 2 * 2);
  // DSA: gradients of q and of the attention core, the recomputed latent side.
  b.dsa_ws = 2 * NH * Dqk * 2 + NH * Dv * 2 + 2 * Rq * 2;
  // Dense MLP: gate/up rows and their gradient (bf16), the activation.
  b.dense_ws = 2 * I * 2 * 2 + I * 2;
  // MoE: per routed row (K per token) the permuted input, dy and input gradient, the gate/up
  // output and its gradient, the down projection's input gradient and the weighted activation
  // (bf16); per token the f32 input gradient; the shared expert as a dense MLP.
  b.moe_ws = K * (3 * D * 2 + 2 * 2 * Im * 2 + 2 * Im * 2) + D * 4 + 2 * Is * 2 * 2 + Is * 2;
  // Expert parallel: the rows sent and received, each way (bf16).
  if (ep > 1) b.moe_exchange = 2 * K * D * 2;
  // MTP context beyond a layer: future, future_normed, hidden_in, hidden_normed, mixed, out,
  // out_normed (bf16 [D] each), three rstd, the labels.
  b.mtp_extra = 7 * D * 2 + 3 * 4 + 4;
  return b;
}

// One plan, built part by part: the static parts are exact sums over the released layout, the
// activations a model of the step's peak (token_bytes), the rest the buffers of the layout.
class PlanBuilder {
 public:
  PlanBuilder(const model::ModelConfig& config, const PlanOptions& o)
      : config_(config), c_(config.text()), o_(o), L_(c_.num_hidden_layers) {
    check_options(o);
    sizes_ = dist::parallel_sizes(int(o.gpus), o.ep, o.sp, "--gpus / --ep / --sp");
    if (o.ep > 1 && c_.n_routed_experts % o.ep != 0)
      throw Error(
          fmt::format("{} routed experts do not split over --ep {}", c_.n_routed_experts, o.ep),
          "--ep", "give an expert-parallel size that divides the routed experts");
    plan_.options = o;
    plan_.dp = sizes_.dp;
    dp_ = double(sizes_.dp);
    ep_ = double(o.ep);
    mtp_ = o.mtp && c_.has_mtp();
    lora_ = o.lora.has_value();
    for (const std::string& pattern : o.freeze) try {
        freeze_.emplace_back(pattern, std::regex::ECMAScript);
      } catch (const std::regex_error& e) {
        throw Error(fmt::format("'{}' is not a regular expression ({})", pattern, e.what()),
                    "--freeze", "write an ECMAScript regular expression, e.g. 'mlp\\.experts\\.'");
      }
  }

  MemoryPlan build(bool suggest) {
    tally_parameters();
    add_weights();
    if (lora_) add_adapters();
    add_gradients_and_optimizer();
    add_activations();
    add_communication();
    const double dynamic = plan_.part_bytes("activations") + plan_.part_bytes("communication");
    add("allocator", "caching-allocator reserve beyond allocation", dynamic * kAllocatorShare,
        "10% of what comes and goes in a step (docs/PERF.md)");
    for (const PlanItem& i : plan_.items) plan_.total += i.bytes;
    plan_.headroom = o_.device_gib * kGiB - plan_.total;
    plan_.fits = plan_.headroom >= 0;
    if (!plan_.fits && suggest) add_suggestions();
    return std::move(plan_);
  }

 private:
  void add(const std::string& part, const std::string& item, double bytes,
           const std::string& note = "") {
    if (bytes != 0) plan_.items.push_back({part, item, bytes, note});
  }

  // Weights by how they are held, and the gradients and optimizer state of the trained ones.
  void tally_parameters() {
    layer_weight_.assign(size_t(L_ + 1), 0);
    layer_grad_.assign(size_t(L_ + 1), 0);
    layer_fp8_.assign(size_t(L_ + 1), 0);
    for (const model::ParamSpec& s : model::released_layout(config_)) {
      if (s.component == model::Component::vision) continue;
      if (!mtp_ && s.component == model::Component::mtp) continue;
      plan_.base_params += s.numel();
      const bool expert = is_routed_expert(s.name);
      const double local = double(s.numel()) / (expert ? ep_ : 1.0);
      const bool trained = !lora_ && s.trainable && !frozen(s.name);
      if (trained) plan_.trained_params += s.numel();
      const int64_t layer = s.layer;
      const bool in_layer = layer >= 0 && layer < L_;
      // fsdp shards the decoder layers over dp; ep's expert slices stay out of it.
      const bool sharded = o_.fsdp && in_layer && !(expert && o_.ep > 1);
      double bytes;
      const bool fp8_gemm = o_.fp8_tilewise && model::text::released_weight_runs_in_fp8(s.name);
      const int64_t blocks =
          s.shape.size() == 2 ? ((s.shape[0] + 127) / 128) * ((s.shape[1] + 127) / 128) : 0;
      const bool held_fp8 =
          o_.base == PlanBase::fp8 && !trained && model::released_in_fp8(config_, s);
      if (held_fp8) {
        const double scales = double(blocks) * 4 / (expert ? ep_ : 1.0);
        w_fp8_ += local;
        w_scales_ += scales;
        // Dequantised while its layer runs, unless only FP8 GEMMs read it from its codes.
        if (layer >= 0 && layer <= L_ && !(fp8_gemm && codes_feed_fp8_gemms(s)))
          layer_fp8_[size_t(layer)] += local;
        bytes = local + scales;
      } else if (model::is_fp32_kept(s.name) || is_hc_mixing(s.name)) {
        bytes = local * 4;
        w_f32_ += bytes;
      } else {
        bytes = local * 2;
        (trained ? w_bf16_ : w_frozen_bf16_) += bytes;
      }
      if (sharded) {
        layer_weight_[size_t(layer)] += bytes;
        fsdp_weight_slices_ += bytes / dp_;
      }
      // The step keeps the blocks a weight's first FP8 GEMM makes (not under fsdp, whose layers
      // come and go); held FP8 codes are used as they are.
      if (fp8_gemm && !o_.fsdp && !held_fp8)
        w_fp8_blocks_ += local + double(blocks) * 4 / (expert ? ep_ : 1.0);
      if (!trained) continue;
      const bool f32_stored = model::is_fp32_kept(s.name);
      // The sharded optimizer splits every trained tensor over dp; an expert slice over the dp /
      // ep ranks holding it, which is the whole expert count over dp again.
      const double shard = dp_ > 1 ? (expert ? double(s.numel()) / dp_ : local / dp_) : local;
      opt_master_ += f32_stored ? 0 : shard * 4;
      opt_moments_ += shard * 8;
      if (sharded) {
        layer_grad_[size_t(layer)] += local * 4;
        fsdp_grad_slices_ += local * 4 / dp_;
      } else {
        g_f32_ += local * 4;
      }
    }
  }

  // Whether the FP8 holder can hand this FP8-stored weight's codes to the FP8 GEMMs (one 128 x 128
  // grid per [out, in] slice: a fused gate_up_proj's gate and up pieces must each be whole blocks).
  bool codes_feed_fp8_gemms(const model::ParamSpec& s) const {
    const bool gate_or_up =
        s.name.find(".mlp.experts.") != std::string::npos &&
        (s.name.ends_with(".gate_proj.weight") || s.name.ends_with(".up_proj.weight"));
    return !gate_or_up || c_.moe_intermediate_size % 128 == 0;
  }

  void add_weights() {
    const double weight_total = w_bf16_ + w_f32_ + w_fp8_ + w_scales_ + w_frozen_bf16_;
    if (o_.fsdp) {
      const double whole_layers = std::accumulate(layer_weight_.begin(), layer_weight_.end(), 0.0);
      add("weights", "replicated (embeddings, head, MTP, norms) and expert slices",
          weight_total - whole_layers);
      add("weights", "decoder-layer slices (fsdp, 1/dp)", fsdp_weight_slices_);
      return;
    }
    add("weights", "bf16 compute copies (trained)", w_bf16_);
    add("weights", "bf16 compute copies (frozen)", w_frozen_bf16_,
        "the indexer, what --freeze matches, the whole base under LoRA");
    add("weights", "fp8 values (frozen, FP8 in the release)", w_fp8_, "1 byte a value");
    add("weights", "fp8 block scales (f32, 128x128)", w_scales_);
    // Each layer's FP8 tensors are dequantised to bf16 right before it runs and dropped after.
    add("weights", "fp8 base: the running layer dequantised (bf16)",
        2 * *std::max_element(layer_fp8_.begin(), layer_fp8_.end()),
        "one layer at a time, forward and backward");
    add("weights", "f32 (A_log, dt_bias, conv, router bias, mHC)", w_f32_);
    add("weights", "fp8 GEMMs: each weight's blocks, kept for the step", w_fp8_blocks_,
        "train.fp8 = \"tilewise\": 1 byte a value");
  }

  void add_adapters() {
    const std::vector<std::string> modules = plan_lora_modules(config_, *o_.lora);
    std::map<std::string, Shape> shapes;
    for (const model::ParamSpec& s : model::released_layout(config_)) shapes[s.name] = s.shape;
    const double r = double(o_.lora->rank), E = double(c_.n_routed_experts),
                 D = double(c_.hidden_size), Im = double(c_.moe_intermediate_size);
    double dense_elems = 0, expert_elems = 0;
    for (const std::string& m : modules) {
      if (is_routed_expert(m)) {
        // One adapter per expert on the fused parameter: A [E, r, in], B [E, out, r].
        const bool gate_up = m.ends_with("gate_up_proj");
        expert_elems += E * r * (gate_up ? D + 2 * Im : Im + D);
        ++plan_.adapted_expert_params;
        continue;
      }
      // A tied head multiplies by the embedding matrix.
      const Shape& w = m == "lm_head" && !shapes.count("lm_head.weight")
                           ? shapes.at("model.language_model.embed_tokens.weight")
                           : shapes.at(m + ".weight");
      dense_elems += r * double(w[0] + w[1]);
      if (m == "lm_head") head_rank_ = r;
      ++plan_.adapted_modules;
    }
    plan_.adapter_params = int64_t(dense_elems + expert_elems);
    plan_.trained_params = plan_.adapter_params;
    const double local = dense_elems + expert_elems / ep_;
    add("adapters", "LoRA A and B (f32, trained)", local * 4,
        expert_elems > 0 ? "includes the routed experts' adapters" : "");
    g_f32_ += local * 4;
    const double shard = dp_ > 1 ? (dense_elems + expert_elems) / dp_ : local;
    opt_moments_ += shard * 8;  // f32-stored: each adapter is its own master
  }

  void add_gradients_and_optimizer() {
    if (o_.fsdp) {
      add("gradients", "f32, replicated tensors", g_f32_);
      add("gradients", "f32, decoder-layer slices (fsdp, 1/dp)", fsdp_grad_slices_);
    } else {
      add("gradients", "f32, every trained tensor", g_f32_);
    }
    add("optimizer", "f32 masters of bf16-stored trained tensors", opt_master_,
        dp_ > 1 ? "sharded over the data-parallel ranks" : "");
    add("optimizer", "f32 exp_avg and exp_avg_sq", opt_moments_,
        dp_ > 1 ? "sharded over the data-parallel ranks" : "");
  }

  // The held contexts of the layers by policy, and the largest transient set over the
  // backward's order.
  void add_activations() {
    const double T = double(o_.pack) / double(o_.sp);
    const TokenBytes b = token_bytes(c_, o_.ep);
    // A layer's context as the forward makes it (a recomputed layer's, rebuilt in the backward),
    // as a kept layer holds it (X' dropped, the feed-forward projections kept) and as an
    // offloaded one does (X' and the projections dropped).
    auto ctx_bytes = [&](int64_t l, model::text::ActivationPolicy policy) {
      const bool dsa = c_.layer_types[size_t(l)] == model::AttnKind::dsa;
      const bool moe = c_.mlp_layer_types[size_t(l)] == model::MlpKind::sparse;
      const double attn = b.kept_common + (dsa ? b.dsa : b.kda);
      switch (policy) {
        case model::text::ActivationPolicy::keep:
          return T * (attn - b.streams + (moe ? b.moe : b.dense));
        case model::text::ActivationPolicy::offload:
          return T * (attn - b.streams + (moe ? b.moe_routing : 0));
        case model::text::ActivationPolicy::recompute:
          break;
      }
      return T * (attn + (moe ? b.moe_routing : 0));
    };
    auto ws_bytes = [&](int64_t l) {
      const bool dsa = c_.layer_types[size_t(l)] == model::AttnKind::dsa;
      const bool moe = c_.mlp_layer_types[size_t(l)] == model::MlpKind::sparse;
      // The attention and the MLP are differentiated one after the other; the streams' gradient
      // (in and out, bf16) lives through both.
      const double ffn = moe ? b.moe_ws + b.moe_exchange : b.dense_ws;
      return T * (std::max(dsa ? b.dsa_ws : b.kda_ws, ffn) + 2 * b.streams);
    };
    const auto policies = model::text::activation_policy(L_, o_.recompute, o_.offload);
    std::vector<double> held(size_t(L_), 0), extra(size_t(L_), 0);
    double kept = 0, inputs = 0;
    for (int64_t l = 0; l < L_; ++l) {
      switch (policies[size_t(l)]) {
        case model::text::ActivationPolicy::keep:
          held[size_t(l)] = ctx_bytes(l, model::text::ActivationPolicy::keep);
          kept += held[size_t(l)];
          ++plan_.kept_layers;
          break;
        case model::text::ActivationPolicy::recompute:
          held[size_t(l)] = T * b.streams;
          inputs += held[size_t(l)];
          extra[size_t(l)] = ctx_bytes(l, model::text::ActivationPolicy::recompute) - T * b.streams;
          ++plan_.recomputed_layers;
          break;
        case model::text::ActivationPolicy::offload:
          // On the host between forward and backward; on the device while differentiated, with
          // the next offloaded layer's context on its way back.
          extra[size_t(l)] = 2 * ctx_bytes(l, model::text::ActivationPolicy::offload);
          ++plan_.offloaded_layers;
          break;
      }
    }
    // Outside the layers: the embeddings, the last streams and the final norm's output.
    const double D = double(c_.hidden_size), V = double(c_.vocab_size);
    const double outside = T * (D * 2 + b.streams + D * 2 + 4 + 4);
    // The MTP layer (DSA + MoE without mHC) keeps its context, with its experts' gate/up, unless
    // recomputed.
    const bool recompute_mtp = o_.recompute > 0;
    const double mtp_ctx = mtp_ ? T * (b.mtp_extra + 6 * D * 2 + 2 * 4 + b.dsa +
                                       (recompute_mtp ? b.moe_routing : b.moe) + 4)
                                : 0;
    // The lm_head + cross-entropy chunks: bf16 logits and their f32 gradient per row, the f32
    // gradient of the hidden rows.
    const double rows = std::min<double>(double(o_.loss_chunk_rows), T);
    // An adapter on the head runs it on [h | u] and [W | B]: the concatenated bf16 weight and
    // rows, and the f32 gradient of the wider rows.
    const double head_ws =
        rows * V * (2 + 4) + T * D * 4 +
        (head_rank_ > 0 ? V * (D + head_rank_) * 2 + T * (D + head_rank_) * 2 + T * head_rank_ * 4
                        : 0);
    const double mtp_ws =
        mtp_ ? std::max(T * std::max(b.dsa_ws, b.moe_ws + b.moe_exchange), head_ws) : 0;
    // The step's peak: every held context plus the largest of the transient sets, over the
    // backward's order (MTP and the head first, then the layers from the last).
    double above = 0;  // held bytes of the layers already differentiated (freed)
    double transient = std::max(head_ws, mtp_ws + (recompute_mtp ? mtp_ctx : 0));
    for (int64_t l = L_ - 1; l >= 0; --l) {
      const double here = extra[size_t(l)] + ws_bytes(l) - above;
      transient = std::max(transient, here);
      above += held[size_t(l)];
    }
    add("activations", fmt::format("kept layer contexts ({} layers)", plan_.kept_layers), kept);
    add("activations",
        fmt::format("recomputed layers' inputs ({} layers)", plan_.recomputed_layers), inputs);
    add("activations", "embeddings, last streams, final norm", outside);
    if (mtp_ && !recompute_mtp) add("activations", "MTP context (kept)", mtp_ctx);
    add("activations", "backward working set at the peak", transient,
        "a recomputed or offloaded layer's context, the KDA / MoE / head workspaces");
  }

  void add_communication() {
    if (o_.fsdp) {
      const double max_w = *std::max_element(layer_weight_.begin(), layer_weight_.end());
      const double max_g = *std::max_element(layer_grad_.begin(), layer_grad_.end());
      add("communication", "fsdp: running + prefetched layer, whole", 2 * max_w);
      add("communication", "fsdp: one layer's whole f32 gradients", max_g);
    }
    if (o_.sp > 1) {
      // Ulysses: the KDA and DSA inputs re-split from rows to heads and back (bf16, both ways).
      const double T = double(o_.pack) / double(o_.sp), QL = double(c_.linear_width());
      add("communication", "sp all-to-all buffers", 2 * T * 3 * QL * 2);
    }
    if (o_.ep > 1) add("communication", "ep exchange (counted in the MoE working set)", 0.0);
    if (dp_ > 1 && !o_.fsdp)
      add("communication", "sharded optimizer: one gathered chunk (f32, 2^25 values)",
          double(int64_t(1) << 25) * 4 * 2);
  }

  // The first change of each kind that makes the layout fit: more recompute, offload, a wider
  // ep, fsdp, LoRA or an FP8 base, more GPUs.
  void add_suggestions() {
    auto try_with = [&](PlanOptions alt, const std::string& text) {
      try {
        MemoryPlan p = PlanBuilder(config_, alt).build(false);
        if (p.fits)
          plan_.suggestions.push_back(
              fmt::format("{} ({} GiB, {} GiB to spare)", text, gib(p.total), gib(p.headroom)));
        return p.fits;
      } catch (const Error&) {
        return false;
      }
    };
    if (o_.recompute < 1) {
      for (double r = std::ceil(o_.recompute * 10) / 10; r <= 1.0 + 1e-9; r += 0.1) {
        PlanOptions alt = o_;
        alt.recompute = std::min(1.0, r);
        alt.offload = std::min(alt.offload, 1.0 - alt.recompute);
        if (try_with(alt, fmt::format("--recompute {:.1f}", alt.recompute))) break;
      }
    }
    if (o_.offload + o_.recompute < 1) {
      PlanOptions alt = o_;
      alt.offload = 1.0 - o_.recompute;
      try_with(alt, fmt::format("--offload {:.2f}", alt.offload));
    }
    for (int64_t e = o_.ep * 2; e <= sizes_.dp; e *= 2) {
      PlanOptions alt = o_;
      alt.ep = e;
      if (try_with(alt, fmt::format("--ep {}", e))) break;
    }
    if (!o_.fsdp && sizes_.dp > 1) {
      PlanOptions alt = o_;
      alt.fsdp = true;
      try_with(alt, "--fsdp");
    }
    if (!lora_) {
      PlanOptions alt = o_;
      alt.lora = PlanLora{};
      try_with(alt, "LoRA (--lora-rank 16 --lora-targets all-linear)");
      alt.base = PlanBase::fp8;
      try_with(alt, "LoRA on an FP8 base (--lora-rank 16 --base fp8)");
    } else if (o_.base == PlanBase::bf16) {
      PlanOptions alt = o_;
      alt.base = PlanBase::fp8;
      try_with(alt, "--base fp8");
    }
    for (int64_t g = o_.gpus * 2; g <= o_.gpus * 16; g *= 2) {
      PlanOptions alt = o_;
      alt.gpus = g;
      alt.ep = std::min<int64_t>(g / o_.sp, c_.n_routed_experts);
      while (alt.ep > 1 && (c_.n_routed_experts % alt.ep != 0 || (g / o_.sp) % alt.ep != 0))
        --alt.ep;
      if (try_with(alt, fmt::format("--gpus {} --ep {}", g, alt.ep))) break;
    }
    if (plan_.suggestions.empty())
      plan_.suggestions.push_back("nothing tried fits: shorten --pack or use more GPUs");
  }

  bool frozen(const std::string& name) const {
    return std::any_of(freeze_.begin(), freeze_.end(),
                       [&](const std::regex& re) { return std::regex_search(name, re); });
  }

  const model::ModelConfig& config_;
  const model::TextConfig& c_;
  const PlanOptions& o_;
  const int64_t L_;
  dist::ParallelSizes sizes_;
  double dp_ = 1, ep_ = 1;
  bool mtp_ = false, lora_ = false;
  double head_rank_ = 0;  // the rank of an adapter on the LM head (0: none)
  std::vector<std::regex> freeze_;
  MemoryPlan plan_;
  // Bytes on one GPU: weights by storage, trained tensors' f32 gradients, optimizer state.
  double w_bf16_ = 0, w_f32_ = 0, w_fp8_ = 0, w_scales_ = 0, w_frozen_bf16_ = 0, w_fp8_blocks_ = 0;
  double g_f32_ = 0, opt_master_ = 0, opt_moments_ = 0;
  // Per decoder layer (the MTP layer last): fsdp-sharded weight and gradient bytes, FP8-held
  // elements.
  std::vector<double> layer_weight_, layer_grad_, layer_fp8_;
  double fsdp_weight_slices_ = 0, fsdp_grad_slices_ = 0;
};

}  // namespace

MemoryPlan plan_memory(const model::ModelConfig& config, const PlanOptions& options) {
  return PlanBuilder(config, options).build(true);
}

}  // namespace glmtune::train
