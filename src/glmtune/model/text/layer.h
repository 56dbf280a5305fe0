#pragma once
// One decoder layer of the text model and the MTP layer, on a packed token stream
// (docs/model/text_model.md, "Forward" and "MTP"). Both are compositions of the CPU ops; what they
// save for a backward goes into a per-layer context when the caller asks for one.
//
// Decoder layer, streams X [T, H, D]:
//   (post, comb, c) = mhc_pre_attn(X);  y = mixer(input_layernorm(c))      KDA or DSA
//   X' = post ⊗ y + combᵀ X
//   (post', comb', c') = mhc_pre_ffn(X'); z = ffn(post_attention_layernorm(c'))  MLP or MoE
//   X'' = post' ⊗ z + comb'ᵀ X'
// MTP layer, input x [T, D] (already eh_proj-mixed), no mHC:
//   a = x + dsa(input_layernorm(x));  b = a + moe(post_attention_layernorm(a))

#include <cstdint>
#include <vector>

#include "glmtune/model/config.h"
#include "glmtune/model/row_exchange.h"
#include "glmtune/model/text/weights.h"
#include "glmtune/ops/indexer.h"
#include "glmtune/ops/kda.h"
#include "glmtune/ops/mhc.h"
#include "glmtune/ops/mla.h"
#include "glmtune/ops/moe.h"

namespace glmtune::model::text {

// Routed experts computed by someone else than this process alone: expert parallelism
// (dist/expert_parallel.h) sends each (token, expert) pair to the rank that holds the expert and
// brings the results back. Unset (the default), the MoE block runs every expert itself. With it,
// a layer's expert tensors (params.gate_up_proj / down_proj and their gradients) may hold only
// the experts of this rank: the dispatch defines their layout.
class ExpertDispatch {
 public:
  virtual ~ExpertDispatch() = default;
  // Σ_k w_k · expert_{idx_k}(x) per row, [T, D]: what ops::moe_experts computes over all experts.
  virtual Tensor forward(const ops::MoeConfig& cfg, const ops::MoeParams& params, const Tensor& x,
                         const ops::Routing& routing) const = 0;
  // In the dtypes ops::moe_backward_routed_elsewhere takes: x's on the CPU, f32 on the GPU.
  struct Backward {
    Tensor dx;         // [T, D] through the routed experts only
    Tensor d_weights;  // [T, K] gradient of the combine weights
  };
  // The routed experts' part of ops::moe_backward for dy [T, D]: adds the gradients of the experts
  // this rank holds into grads.gate_up_proj / grads.down_proj (created as zeros when undefined).
  virtual Backward backward(const ops::MoeConfig& cfg, const ops::MoeParams& params,
                            const Tensor& x, const ops::Routing& routing, const Tensor& dy,
                            ops::MoeParams& grads) const = 0;
};

// The pack split over several ranks by sequence parallelism (dist/sequence_parallel.h): this rank
// holds a contiguous shard of rows; per-token work runs on the shard alone, and the two mixers,
// which read other tokens, exchange what they need with the other ranks of the group. Unset (the
// default), the whole pack is here. Every call is collective over the group: all its ranks must
// run the same layers in the same order. As a RowExchange it also carries the vision tower's
// exchanges of a vision-language pack (model/compose.h).
class SequenceParallel : public RowExchange {
 public:
  virtual ~SequenceParallel() = default;
  // Rows [shard_begin, shard_begin + shard_rows) of a pack of `tokens` rows are held here.
  virtual int64_t shard_begin(int64_t tokens) const = 0;
  virtual int64_t shard_rows(int64_t tokens) const = 0;
  // Sums over the group (token counts, expert loads).
  virtual void sum(std::vector<int64_t>& values) const = 0;

  // ops::kda_forward / kda_backward of the whole pack, restricted to this rank's rows: x and dy
  // are the local [rows, D] shards, cu_seqlens the whole pack's. `saved` holds what this rank's
  // part of the mixer needs (its own layout; only kda_backward of the same object reads it).
  // Gradients add into the full-sized buffers of `grads` (partial sums: the group's sum is the
  // gradient).
  virtual Tensor kda_forward(const ops::KdaParams& params, const Tensor& x,
                             const Tensor& cu_seqlens, const ops::KdaOptions& options,
                             ops::KdaSaved* saved) const = 0;
  virtual Tensor kda_backward(const ops::KdaParams& params, const Tensor& x,
                              const Tensor& cu_seqlens, const ops::KdaOptions& options,
                              const ops::KdaSaved* saved, const Tensor& dy,
                              ops::KdaGrads& grads) const = 0;
  // The DSA mixer (indexer or `carried_indices`, sparse MLA, o_proj) on the local shard x.
  // `indices_out` receives the selection of the whole pack (int32 [T, W], the same on every rank).
  virtual Tensor dsa_forward(const ops::MlaConfig& mla, const ops::IndexerConfig& indexer,
                             const ops::DsaParams& params, const Tensor& x,
                             const Tensor& cu_seqlens, const Tensor& carried_indices,
                             Tensor* indices_out) const = 0;
  virtual Tensor dsa_backward(const ops::MlaConfig& mla, const ops::DsaParams& params,
                              const Tensor& x, const Tensor& indices, const Tensor& cu_seqlens,
                              const Tensor& dy, ops::DsaParams& grads) const = 0;
};

// Decoder-layer parameters held in shards over a data-parallel group (fully sharded data
// parallel, dist/fsdp.h): between uses, the tensors of TextWeights::layers[l] are undefined and
// each rank keeps only its slice. The layer loops (forward, recompute, backward) call gather
// right before a layer runs and release right after, and hint with prefetch which layer comes
// next, so that at most the running layer and the next one are whole at a time. The backward
// also holds each layer's gradient buffers only while that layer is differentiated:
// allocate_gradients right before, reduce_gradients once the layer's gradient is complete. Unset
// (the default), the weights and gradient buffers are always whole and nothing is called. Every
// call is collective over the group: all its ranks must run the same layers in the same order.
class LayerParamProvider {
 public:
  virtual ~LayerParamProvider() = default;
  // Fills TextWeights::layers[layer] with the full parameters.
  virtual void gather(int64_t layer) = 0;
  // `layer` is gathered next (after the layer gathered last is released): its transfer may start
  // now and overlap the running layer.
  virtual void prefetch(int64_t layer) = 0;
  // Drops them again (the slice stays).
  virtual void release(int64_t layer) = 0;
  // The layer's gradient buffers (TextGrads::layers[layer] and their TextGrads::named entries)
  // exist and are zero from here until reduce_gradients.
  virtual void allocate_gradients(int64_t layer) = 0;
  // The layer's gradient buffers hold this rank's complete contribution for the pack: they are
  // reduced over the group into this rank's slice and dropped.
  virtual void reduce_gradients(int64_t layer) = 0;
};

// The op configurations a TextConfig implies.
struct OpConfigs {
  ops::MhcOptions mhc;
  ops::KdaOptions kda;
  ops::MlaConfig mla;
  ops::IndexerConfig indexer;
  ops::MoeConfig moe;
  double rms_eps = 1e-5;
  double swiglu_limit = 10.0;
  // Routed experts elsewhere (expert parallelism); null: every expert in this process.
  const ExpertDispatch* expert_dispatch = nullptr;
  // The pack split over ranks (sequence parallelism); null: every row in this process.
  const SequenceParallel* sequence_parallel = nullptr;

  static OpConfigs from(const TextConfig& config);
};

// What one decoder layer's forward keeps for a backward ("keep everything" policy). Tensors a
// layer kind does not produce stay undefined.
struct LayerContext {
  Tensor streams_in;  // [T, H, D] X
  ops::MhcPreResult attn_hc;
  ops::MhcPreSaved attn_hc_saved;
  Tensor attn_in;       // [T, D] input_layernorm(c)
  Tensor attn_in_rstd;  // [T]
  ops::KdaSaved kda;    // KDA layers
  // DSA layers: the MLA block's context, so that the backward does not run the block again (its
  // x, indices and cu_seqlens are attn_in, `indices` and the pack's, left out here).
  ops::MlaContext mla;
  Tensor indices;      // DSA layers: int32 [T, W] the selection used (own or reused)
  Tensor attn_out;     // [T, D] y
  Tensor streams_mid;  // [T, H, D] X' (a kept or offloaded context drops it: the backward
                       // rebuilds it from streams_in and attn_out)
  ops::MhcPreResult ffn_hc;
  ops::MhcPreSaved ffn_hc_saved;
  Tensor ffn_in;         // [T, D]
  Tensor ffn_in_rstd;    // [T]
  ops::Routing routing;  // MoE layers
  Tensor ffn_out;        // [T, D] z
  // The dense MLP's, or the MoE's shared expert's, gate and up projections (x is ffn_in), and on
  // a GPU the routed experts' activations: all of them in a context made for a backward that
  // follows at once (a recomputed layer), in a kept one the routed experts' gate/up alone
  // (ops::gate_up_only; six hidden states' worth per dense layer at the released widths, one per
  // routed row). An offloaded context leaves them out, and its backward computes the two
  // projections and runs the experts again.
  ops::MlpContext ffn_mlp;
  ops::MoeRoutedActivations ffn_routed;
};

// Every tensor of `ctx` (undefined ones included): what moving a context to another device moves.
std::vector<Tensor*> context_tensors(LayerContext& ctx);

// Carried between consecutive layers: the selection a full-indexer DSA layer hands to a following
// "shared" layer (the reference's prev_topk_indices; undefined after any other layer).
struct IndexerCarry {
  Tensor indices;
};

struct MoeResult {
  Tensor y;
  ops::Routing routing;
  Tensor expert_counts;  // int64 [E] over the counted rows
};

// MoE block; `counted_rows` limits the expert counts to the leading rows (padding stays out).
// Works with and without a shared expert. `keep` (optional) receives the shared expert's context
// and the routed experts' activations, for a backward that follows at once.
MoeResult moe_block(const OpConfigs& cfg, const ops::MoeParams& params, const Tensor& x,
                    int64_t counted_rows, ops::MoeContext* keep = nullptr);

// DSA mixer on u [T, D]: projections, own indexer (or the carried selection), sparse attention,
// o_proj. `ctx` (optional) receives mla / attn_core / indices.
Tensor dsa_block(const OpConfigs& cfg, const ops::DsaParams& params, const Tensor& u,
                 const Tensor& cu_seqlens, const Tensor& carried_indices, Tensor* indices_out,
                 LayerContext* ctx);

// One decoder layer: streams [T, H, D] -> [T, H, D]. `carry` is read (shared indexer layers) and
// rewritten (what the next layer may reuse). `expert_counts` (MoE layers) receives the counts of
// the first `counted_rows` rows. With `ffn_projections`, ctx also receives ffn_mlp and ffn_routed
// (whole: a caller that holds the context across the step trims them).
Tensor decoder_layer_forward(const OpConfigs& cfg, const TextConfig& config, const LayerWeights& w,
                             const Tensor& streams, const Tensor& cu_seqlens, int64_t counted_rows,
                             IndexerCarry& carry, Tensor* expert_counts, LayerContext* ctx,
                             bool ffn_projections = false);

// What one MTP depth keeps for a backward.
struct MtpContext {
  Tensor future;         // [T, D] embeddings of the tokens one depth ahead (0 / id 0 at doc ends)
  Tensor future_normed;  // enorm(future)
  Tensor future_rstd;
  Tensor hidden_in;      // [T, D] h entering this depth
  Tensor hidden_normed;  // hnorm(h)
  Tensor hidden_rstd;
  Tensor mixed;        // [T, D] x = eh_proj([future_normed ; hidden_normed])
  LayerContext layer;  // attn_in/rstd, mla, attn_core, indices, attn_out, ffn_in/rstd, routing,
                       // ffn_out; streams_* hold the plain residual [T, D] values x and a
  Tensor out;          // [T, D] b = a + moe(...), before shared_head.norm
  Tensor out_normed;   // shared_head.norm(b)
  Tensor out_rstd;
};

struct MtpLayerResult {
  Tensor hidden;         // [T, D] shared_head.norm output (feeds the head, and the next depth)
  Tensor expert_counts;  // int64 [E]
};

// One MTP depth. future [T, D]: embeddings of the tokens one step ahead of this depth's input;
// hidden [T, D]: the main hidden state (depth 1) or the previous depth's output.
MtpLayerResult mtp_layer_forward(const OpConfigs& cfg, const MtpWeights& w, const Tensor& future,
                                 const Tensor& hidden, const Tensor& cu_seqlens,
                                 int64_t counted_rows, MtpContext* ctx,
                                 bool ffn_projections = false);

}  // namespace glmtune::model::text
