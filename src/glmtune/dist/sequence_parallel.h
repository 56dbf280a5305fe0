#pragma once
// Sequence parallelism over the sp group (docs/distributed.md, "Sequence parallel").
//
// Rank s of a group of S holds rows [s·T/S, (s+1)·T/S) of every pack (integer division: the
// shards differ by at most one row; document boundaries fall anywhere). Everything per token
// (embedding, mHC, norms, MLP / MoE, the heads and losses) runs on the shard; the two mixers read
// other tokens and split their heads over the group instead, in the manner of Ulysses:
//
//   KDA   the layer input is all-gathered ([T/S, D] -> [T, D]); rank s computes heads
//         [s·NL/S, (s+1)·NL/S) over the whole pack (projections, short conv over the whole
//         sequence with the pack's cu_seqlens, delta rule, gated norm: ops::kda_forward on the
//         heads' slices of the parameters); an all-to-all brings the heads' outputs back to the
//         token shards ([T, NL/S·HL] -> [T/S, NL·HL]) and o_proj runs on the shard.
//   DSA   the same for the MLA heads: the input is all-gathered, the latent (q_resid, the
//         compressed kv) and the indexer's keys and pools are built on the whole pack, so every
//         query keeps its global position and selection; each rank attends with its heads and an
//         all-to-all returns the outputs to the token shards before o_proj.
//   backward   d y is all-gathered, each rank differentiates its heads over the whole pack
//         (ops::kda_backward / dsa_backward on the slices), and the input gradients, which every
//         head contributes to, are summed back to their owners (a variable-count reduce-scatter).
//
// Exchanging the layer input rather than the projected q/k/v keeps the ops untouched: the
// projections of NL/S heads over T tokens cost what those of NL heads over T/S tokens cost. The
// parts shared by every head (KDA's f_a/g_a, MLA's q_a/kv_a latents, the indexer) run on the
// whole pack on every rank.
//
// Parameter gradients are partial on each rank (its heads, its tokens) and full-sized; their sum
// over the sp group is the gradient (the trainer all-reduces them before the dp reduction).
//
// As a model::RowExchange the same object carries the vision tower's exchanges of a
// vision-language pack (model/compose.h): its patches are split over the group too, and the
// gathers and sums below move the tower's keys and values and the merged features.
//
// GPU tensors travel through `device_sp` (NCCL over the same ranks), host tensors and the scalar
// sums through `sp` (MPI); the block copies and sums run on the tensors' device.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "glmtune/dist/comm.h"
#include "glmtune/model/text/layer.h"

namespace glmtune::dist {

class UlyssesParallel final : public model::text::SequenceParallel {
 public:
  // Heads of every mixer split over the ranks of `sp`; glmtune::Error naming `where` unless the
  // group size divides the KDA heads (`kda_heads`) and the MLA heads (`mla_heads`).
  UlyssesParallel(Communicator& sp, int64_t kda_heads, int64_t mla_heads, const std::string& where,
                  Communicator* device_sp = nullptr);

  int64_t shard_begin(int64_t tokens) const override;
  int64_t shard_rows(int64_t tokens) const override;
  void sum(std::vector<int64_t>& values) const override;

  int rank() const override { return sp_.rank(); }
  int ranks() const override { return sp_.size(); }
  Tensor gather_rows(const Tensor& local, std::span<const int64_t> counts) const override;
  Tensor sum_scatter_rows(const Tensor& full, std::span<const int64_t> counts) const override;

  Tensor kda_forward(const ops::KdaParams& params, const Tensor& x, const Tensor& cu_seqlens,
                     const ops::KdaOptions& options, ops::KdaSaved* saved) const override;
  Tensor kda_backward(const ops::KdaParams& params, const Tensor& x, const Tensor& cu_seqlens,
                      const ops::KdaOptions& options, const ops::KdaSaved* saved, const Tensor& dy,
                      ops::KdaGrads& grads) const override;
  Tensor dsa_forward(const ops::MlaConfig& mla, const ops::IndexerConfig& indexer,
                     const ops::DsaParams& params, const Tensor& x, const Tensor& cu_seqlens,
                     const Tensor& carried_indices, Tensor* indices_out) const override;
  Tensor dsa_backward(const ops::MlaConfig& mla, const ops::DsaParams& params, const Tensor& x,
                      const Tensor& indices, const Tensor& cu_seqlens, const Tensor& dy,
                      ops::DsaParams& grads) const override;

  // [rows, C] shard -> [T, C] on every rank (rank order = row order).
  Tensor all_gather_rows(const Tensor& shard, int64_t tokens) const;
  // [T, C] partial values on every rank -> this rank's [rows, C] rows summed over the group (in
  // rank order, so every run adds in the same order).
  Tensor reduce_scatter_rows(const Tensor& full) const;

 private:
  // [T, W] of this rank's columns (heads) -> [rows, S·W] of every rank's columns for its rows.
  Tensor columns_to_rows(const Tensor& full) const;
  // Rows of each rank's shard of a pack of `tokens` rows.
  std::vector<int64_t> shard_counts(int64_t tokens) const;

  // The group that moves `t`: the device group for a GPU tensor.
  Communicator& movers(const Tensor& t) const;

  Communicator& sp_;
  Communicator* device_sp_ = nullptr;
  int64_t kda_heads_ = 0, mla_heads_ = 0;
};

// train.fp8 under sequence parallelism: each rank's slice of a head-split FP8 projection (KDA's
// q, k, v, f_b and g_b rows and o_proj columns, MLA's q_b rows and o_proj columns) must span a
// multiple of 128 rows or columns, so that its 128 × 128 weight blocks and 1 × 128 activation
// tiles are those of the whole projection and the ranks compute what one process computes. The
// released model's slices are (KDA heads of 128, MLA heads of 256, 64 of each). glmtune::Error
// naming `where` otherwise.
void check_fp8_head_slices(const model::TextConfig& c, int64_t sp_size, const std::string& where);

}  // namespace glmtune::dist
