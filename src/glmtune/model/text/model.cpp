#include "glmtune/model/text/model.h"

#include <fmt/format.h>

#include <cstring>

#include "glmtune/model/loss.h"
#include "glmtune/ops/cross_entropy.h"
#include "glmtune/ops/elementwise.h"
#include "glmtune/ops/embedding.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/mhc.h"
#include "glmtune/ops/norm.h"

namespace glmtune::model::text {
namespace {

std::vector<int64_t> token_ids(const Tensor& input_ids) {
  if (!input_ids.defined() || input_ids.dim() != 1 || !input_ids.device().is_cpu() ||
      (input_ids.dtype() != DType::i32 && input_ids.dtype() != DType::i64))
    throw Error(fmt::format("input_ids must be a CPU int32/int64 vector [T], got {}",
                            input_ids.defined() ? input_ids.str() : std::string("nothing")),
                "input_ids", "pass the pack's token ids");
  const Tensor c = input_ids.contiguous();
  std::vector<int64_t> ids(size_t(c.numel()));
  for (size_t i = 0; i < ids.size(); ++i)
    ids[i] = c.dtype() == DType::i32 ? int64_t(c.data<int32_t>()[i]) : c.data<int64_t>()[i];
  return ids;
}

LossStats stats_of(const ops::CrossEntropyResult& ce) { return {ce.loss_sum, ce.n_tokens}; }

// The token-mean CE of logits = hidden · head^T: from the logits when they exist, else in chunks
// of labelled rows so that no [T, V] matrix is formed.
LossStats lm_loss(const Tensor& logits, const Tensor& hidden, const ops::Linear& head,
                  const Tensor& labels, int64_t chunk_rows) {
  if (logits.defined()) return stats_of(ops::cross_entropy_forward(logits, labels));
  ops::CrossEntropyOptions opts;
  opts.chunk_rows = chunk_rows;
  return stats_of(ops::lm_head_cross_entropy(hidden, head, labels, opts));
}

}  // namespace

TextModel::TextModel(const ParamStore& store, TextModelOptions options)
    : TextModel(store.config(), load_text_weights(store, options.dtype, options.device)) {}

TextModel::TextModel(ModelConfig config, TextWeights weights)
    : config_(std::move(config)), weights_(std::move(weights)), ops_(OpConfigs::from(text())) {
  GLMTUNE_ASSERT(int64_t(weights_.layers.size()) == text().num_hidden_layers,
                 "{} layer weights for {} layers", weights_.layers.size(),
                 text().num_hidden_layers);
}

Tensor TextModel::embed(const Tensor& input_ids) const {
  token_ids(input_ids);  // the same message for a malformed id tensor as everywhere else
  return ops::embedding_forward(weights_.embed_tokens, input_ids);
}

Tensor TextModel::future_embeddings(const Tensor& input_ids, const Tensor& inputs_embeds,
                                    const std::vector<int64_t>& cu, int64_t depth) const {
  GLMTUNE_ASSERT(depth >= 1, "MTP depth starts at 1, got {}", depth);
  if (inputs_embeds.defined()) {
    // Supplied embeddings (the vision splice): rolled per document, zero rows past its end.
    const int64_t tokens = inputs_embeds.size(0);
    std::vector<int64_t> rows(size_t(tokens), -1);
    for (size_t d = 0; d + 1 < cu.size(); ++d)
      for (int64_t i = cu[d]; i + depth < cu[d + 1]; ++i) rows[i] = i + depth;
    return ops::gather_rows(inputs_embeds.to(dtype()).contiguous(), rows);
  }
  // Token path: ids rolled per document, token id 0 past its end (the reference trainer embeds id 0
  // there, so that row of the table, not a zero vector, enters enorm).
  const std::vector<int64_t> ids = token_ids(input_ids);
  std::vector<int64_t> future(ids.size(), 0);
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int64_t i = cu[d]; i + depth < cu[d + 1]; ++i) future[i] = ids[i + depth];
  return embed(Tensor::from_vector(future, {int64_t(future.size())}));
}

ForwardOutput TextModel::forward(const PackInput& in, const ForwardOptions& opt) const {
  const TextConfig& c = text();
  const int64_t dim = c.hidden_size;
  Tensor emb;
  if (in.inputs_embeds.defined()) {
    if (in.inputs_embeds.dim() != 2 || in.inputs_embeds.size(1) != dim ||
        !dtype_is_floating(in.inputs_embeds.dtype()) ||
        in.inputs_embeds.device() != weights_.embed_tokens.device())
      throw Error(fmt::format("inputs_embeds must be a float tensor [T, {}] on {}, got {}", dim,
                              weights_.embed_tokens.device().str(), in.inputs_embeds.str()),
                  "inputs_embeds", "pass one embedding row per token");
    emb = in.inputs_embeds.to(dtype()).contiguous();
    if (in.input_ids.defined() && in.input_ids.numel() != emb.size(0))
      throw Error(
          fmt::format("{} input ids for {} embedding rows", in.input_ids.numel(), emb.size(0)),
          "inputs_embeds", "give one id per embedding row");
  } else {
    emb = embed(in.input_ids);
  }
  const int64_t tokens = emb.size(0);
  if (tokens == 0) throw Error("the pack is empty", "input_ids", "pass at least one token");
  const std::vector<int64_t> cu = ops::read_cu_seqlens(in.cu_seqlens, tokens, "text model");
  if (in.padding_tokens < 0 || in.padding_tokens > tokens)
    throw Error(fmt::format("{} padding tokens in a pack of {}", in.padding_tokens, tokens),
                "padding_tokens", "count only the trailing padding document");
  const int64_t counted = tokens - in.padding_tokens;
  if (in.labels.defined() &&
      (in.labels.dim() != 1 || in.labels.size(0) != tokens || in.labels.dtype() != DType::i32))
    throw Error(fmt::format("labels must be int32 [{}], got {}", tokens, in.labels.str()), "labels",
                "pass one aligned label per token (next_token_labels)");

  ForwardOutput out;
  std::shared_ptr<ForwardContext> ctx;
  if (opt.save == SavePolicy::all) {
    ctx = std::make_shared<ForwardContext>();
    ctx->cu_seqlens = cu;
    ctx->counted_rows = counted;
    ctx->embeddings = emb;
    ctx->layers.resize(size_t(c.num_hidden_layers));
    ctx->labels = in.labels;
  }

  Tensor streams = ops::mhc_expand(emb, c.hc_mult);
  IndexerCarry carry;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    // Sharded parameters: whole only while the layer runs (its context keeps activations, never
    // the weights, so the release frees them); the next layer's transfer overlaps this one.
    if (opt.layer_params) {
      opt.layer_params->gather(l);
      if (l + 1 < c.num_hidden_layers) opt.layer_params->prefetch(l + 1);
    }
    const LayerWeights& w = weights_.layers[size_t(l)];
    Tensor counts;
    streams = decoder_layer_forward(ops_, c, w, streams, in.cu_seqlens, counted, carry, &counts,
                                    ctx ? &ctx->layers[size_t(l)] : nullptr);
    if (opt.layer_params) opt.layer_params->release(l);
    if (w.mlp == MlpKind::sparse) {
      out.expert_counts.push_back(std::move(counts));
      out.moe_layers.push_back(l);
    }
  }
  out.hidden = ops::mhc_head(streams);
  Tensor final_rstd;
  const Tensor normed =
      ops::rms_norm(out.hidden, weights_.final_norm, c.rms_norm_eps, ctx ? &final_rstd : nullptr);
  if (opt.logits) out.logits = ops::linear(normed, weights_.lm_head);
  if (in.labels.defined())
    out.lm = lm_loss(out.logits, normed, weights_.lm_head, in.labels, opt.loss_chunk_rows);
  if (ctx) {
    ctx->final_streams = streams;
    ctx->final_rstd = std::move(final_rstd);
    ctx->final_normed = normed;
  }

  if (has_mtp() && opt.mtp && opt.mtp_depths > 0) {
    MtpOutput m;
    Tensor hidden = out.hidden;
    double mean_sum = 0;
    if (ctx) ctx->mtp.resize(size_t(opt.mtp_depths));
    for (int64_t k = 1; k <= opt.mtp_depths; ++k) {
      const Tensor future =
          future_embeddings(in.input_ids, in.inputs_embeds.defined() ? emb : Tensor(), cu, k);
      MtpLayerResult r = mtp_layer_forward(ops_, *weights_.mtp, future, hidden, in.cu_seqlens,
                                           counted, ctx ? &ctx->mtp[size_t(k - 1)] : nullptr);
      Tensor logits;
      if (opt.mtp_logits) logits = ops::linear(r.hidden, weights_.lm_head);
      if (in.labels.defined()) {
        // The reference trainer rolls the already aligned labels once more per depth: depth k at
        // position i predicts t_{i+k+1} of the same document.
        const Tensor labels = shift_labels(in.labels, in.cu_seqlens, k);
        m.ce.push_back(lm_loss(logits, r.hidden, weights_.lm_head, labels, opt.loss_chunk_rows));
        mean_sum += m.ce.back().mean();
        if (ctx) ctx->mtp_labels.push_back(labels);
      }
      if (opt.mtp_logits) m.logits.push_back(std::move(logits));
      m.expert_counts.push_back(std::move(r.expert_counts));
      m.hidden.push_back(r.hidden);
      hidden = std::move(r.hidden);
    }
    if (in.labels.defined()) m.loss = opt.mtp_loss_scale * mean_sum / double(opt.mtp_depths);
    out.mtp = std::move(m);
  }
  out.context = std::move(ctx);
  return out;
}

}  // namespace glmtune::model::text
