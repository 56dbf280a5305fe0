#include "glmtune/train/flops.h"

#include <algorithm>

namespace glmtune::train {
namespace {

// Σ over queries of the number of keys each attends (min(position + 1, topk) per document).
double attended_keys(const std::vector<int64_t>& doc_lengths, int64_t topk) {
  double sum = 0;
  for (int64_t len : doc_lengths)
    for (int64_t i = 0; i < len; ++i) sum += double(std::min(i + 1, topk));
  return sum;
}

}  // namespace

FlopCount count_flops(const model::TextConfig& c, const std::vector<int64_t>& doc_lengths,
                      bool mtp) {
  const double d = double(c.hidden_size);
  int64_t tokens = 0;
  for (int64_t len : doc_lengths) tokens += len;
  if (tokens == 0) return {};
  const double keys_per_query = attended_keys(doc_lengths, c.index_topk) / double(tokens);
  // Mean pools a query scores: half of the causal prefix, in pools.
  double pools = 0;
  for (int64_t len : doc_lengths)
    for (int64_t i = 0; i < len; ++i) pools += double(i / c.index_kpool + 1);
  pools /= double(tokens);

  const double ql = double(c.linear_width()), hl = double(c.linear_head_dim),
               nl = double(c.linear_num_heads);
  const double kda_proj = 3 * ql * d + hl * d + ql * hl + nl * d + hl * d + ql * hl + d * ql;
  // The chunked delta rule in chunks of 16: 2·(2·16·K + 3·K²) per token and head (K = V = HL).
  const double kda_core = nl * 2 * (2 * 16 * hl + 3 * hl * hl);
  const double nh = double(c.num_attention_heads), dn = double(c.qk_nope_head_dim),
               dv = double(c.v_head_dim), rq = double(c.q_lora_rank), rkv = double(c.kv_lora_rank);
  const double mla_proj = rq * d + nh * dn * rq + rkv * d + nh * (dn + dv) * rkv + d * nh * dv;
  const double mla_attn = nh * keys_per_query * (dn + dv);
  const double ih = double(c.index_n_heads), id = double(c.index_head_dim);
  const double indexer = ih * id * rq + id * d + ih * d + ih * id * pools;
  const double hc = 2 * double((2 + c.hc_mult) * c.hc_mult) * double(c.hc_mult) * d;
  const double dense = 3 * double(c.intermediate_size) * d;
  const double moe = double(c.n_routed_experts) * d +
                     3 * double(c.moe_intermediate_size * c.n_shared_experts) * d +
                     double(c.num_experts_per_tok) * 3 * double(c.moe_intermediate_size) * d;
  const double head = double(c.vocab_size) * d;

  FlopCount f;
  auto add_mac = [&](double macs) { f.trained += 2 * macs; };
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    add_mac(hc);
    if (c.layer_types[size_t(l)] == model::AttnKind::kda) {
      add_mac(kda_proj);
      f.trained += kda_core;
    } else {
      add_mac(mla_proj + mla_attn);
      f.forward_only += 2 * indexer * double(tokens);
    }
    add_mac(c.mlp_layer_types[size_t(l)] == model::MlpKind::dense ? dense : moe);
  }
  add_mac(head);
  if (mtp && c.has_mtp()) {
    add_mac(2 * d * d + mla_proj + mla_attn + moe + head);
    f.forward_only += 2 * indexer * double(tokens);
  }
  return f;
}

}  // namespace glmtune::train
