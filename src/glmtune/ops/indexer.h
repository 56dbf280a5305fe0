#pragma once
// KPool DSA indexer (docs/model/dsa_moe.md, "Indexer"): chooses, for every query token, which
// keys the sparse MLA attention may see. It runs without gradient and its parameters are frozen.
//
// Packed layout: x [T, D] and q_resid [T, Rq] hold the documents of a pack back to back, split by
// cu_seqlens (int32 or int64 [ndoc + 1]). Each document is computed as the reference computes it
// alone (batch of one, no padding): positions below are document-local (s, τ in [0, S)), pools
// start at the document's first token, and nothing crosses a boundary.
//
//   q    = q_resid Wq_b^T                      [S, IH, ID]
//   k    = LayerNorm_{eps 1e-6}(x Wk^T)         [S, ID] (affine weight and bias)
//   g    = x Wgate^T                            [S, ID] pool gate logits
//   pool p (complete pools only, p < ⌊S/P⌋) covers tokens pP .. pP+P−1:
//     ρ[j, d] = softmax_j(g[pP+j, d] + ape[j, d])     (channel-wise, over the P slots)
//     K̄[p, d] = Σ_j ρ[j, d] · k[pP+j, d]
//   score(s, p) = Σ_h w[s, h] · relu((q[s, h] · K̄[p]) · ID^−1/2),  w = (x Wproj^T) · IH^−1/2
//   candidates of query s: the pools whose last token is ≤ s, i.e. p < ⌊(s+1)/P⌋
//   ks = min(TK/P, ⌊S/P⌋) pools per query; the min(ks, #candidates) best candidates are kept
//   tail: tokens ⌊(s+1)/P⌋·P .. s of the unfinished pool holding s (when always_select_tail and
//   P > 1); without it a query that does not close a pool cannot see itself
//
// Output row s (int32, width W = TK + P − 1 with the tail, TK without), laid out as the reference:
//   [ks·P tokens of the chosen pools, best pool first, −1 for the ranks that had no candidate]
//   [P−1 tail slots, −1 where unused] [−1 padding up to W]
// Entries are GLOBAL token indices into the pack (document start + local position) or −1, so the
// attention op gathers keys directly; every non-negative entry lies in the query's document.
// Exact score ties are broken towards the lower pool index (the reference leaves the order
// unspecified).

#include <cstdint>
#include <vector>

#include "glmtune/ops/linear.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::ops {

struct IndexerConfig {
  int64_t n_heads = 32;            // index_n_heads (IH)
  int64_t head_dim = 128;          // index_head_dim (ID)
  int64_t kpool = 16;              // index_kpool (P)
  int64_t topk = 2048;             // index_topk (TK), a multiple of P
  bool always_select_tail = true;  // index_kpool_always_select_tail
};

// Released names under `self_attn.indexer.`.
struct IndexerParams {
  Linear wq_b;           // wq_b [IH·ID, Rq]
  Linear wk;             // wk [ID, D]
  Tensor k_norm_weight;  // k_norm.weight [ID]
  Tensor k_norm_bias;    // k_norm.bias [ID]
  Linear weights_proj;   // weights_proj [IH, D]
  Tensor kpool_ape;      // index_kpool_compress_ape [P, ID]
  Tensor kpool_gate;     // index_kpool_compress_gate [ID, D]

  bool defined() const { return wq_b.defined(); }
};

// The list of IndexerParams' fields (ops/linear.h), named as under `self_attn.indexer.`.
template <typename A, typename B, typename F>
void zip_indexer_params(A& a, B& b, F&& f) {
  zip_linear("wq_b", a.wq_b, b.wq_b, f);
  zip_linear("wk", a.wk, b.wk, f);
  f("k_norm.weight", a.k_norm_weight, b.k_norm_weight);
  f("k_norm.bias", a.k_norm_bias, b.k_norm_bias);
  zip_linear("weights_proj", a.weights_proj, b.weights_proj, f);
  f("index_kpool_compress_ape", a.kpool_ape, b.kpool_ape);
  f("index_kpool_compress_gate", a.kpool_gate, b.kpool_gate);
}

// Width of the indexer's output rows.
int64_t indexer_width(const IndexerConfig& cfg);

// Document bounds of a pack: checks that cu_seqlens is an int32 or int64 vector starting at 0,
// non-decreasing and ending at `tokens`, and returns it widened; a bad table is a glmtune::Error
// naming `op`. Empty documents are allowed.
std::vector<int64_t> read_cu_seqlens(const Tensor& cu_seqlens, int64_t tokens, const char* op);

// x [T, D], q_resid [T, Rq] (f32 or f64, same dtype as the parameters) -> int32 [T, W].
Tensor indexer_forward(const IndexerConfig& cfg, const IndexerParams& params, const Tensor& x,
                       const Tensor& q_resid, const Tensor& cu_seqlens);

}  // namespace glmtune::ops
