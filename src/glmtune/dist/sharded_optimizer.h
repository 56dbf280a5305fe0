#pragma once
// AdamW sharded over a data-parallel group (ZeRO): fp32 master weights, both moments and the
// reduced gradients exist only for this rank's shard (docs/distributed.md, "Sharded data
// parallel").
//
// The trainable parameters, in order, form one flat index space of N elements, padded to a
// multiple of the group size P; rank r owns the contiguous range [r·N'/P, (r+1)·N'/P). A
// parameter may straddle two ranks: each rank keeps the piece inside its range.
//
// One step:
//   1. reduce_gradients: every rank's local gradient sums (full size, from its packs) are
//      reduce-scattered (SUM): rank r receives the group's summed gradient of its range; the
//      global gradient norm is the group sum of the shards' squared norms;
//   2. step: train::AdamW runs on the shard's pieces (same formula, clipping and skipping);
//      the updated masters are all-gathered and every rank's full parameter tensors are set to
//      them (rounded to the storage dtype exactly as AdamW rounds), so the forward of the next
//      step sees the same weights on every rank.
// With equal gradients the updates equal the unsharded optimizer's bit for bit; the gradient sum
// and the norm are reduced in another order, so a run matches a single-process run to fp32
// rounding.
//
// GPU runs: the gradients live on the device. Given `device_group` (a communicator over the same
// ranks, in the same order, for device tensors: NCCL), reduce_gradients packs them into a device
// buffer and reduce-scatters there, and step all-gathers the updated masters there too. After
// keep_on_device() the shard's fp32 masters and moments live on the GPU as well (the update runs
// there with the multi-tensor AdamW kernel of ops/cuda/adamw.h) and step() writes the gathered
// weights straight into the model's compute tensors: no gradient or weight crosses to the host in
// a step, and params()' host values are brought up to date by write_params() when a checkpoint
// needs them; the masters cross NCCL in f32, in chunks (keep_on_device). Without it only this
// rank's shard crosses to the host, where its state lives. The host group then carries scalars
// alone (the norm, checkpoint gathers).
//
// Checkpoints are independent of the sharding: gather_state() assembles one parameter's whole state
// at a time for a streamed save (train/state.h, save_optimizer_state: the unsharded optimizer's
// on-disk format, optimizer.h), and load() reads each rank's pieces straight from a saved state
// (memory-mapped, ranged), so a run saved with P ranks resumes with any other number and no rank
// holds more than its own pieces and one parameter's state.
#include <array>
#include <functional>
#include <string>
#include <vector>

#include "glmtune/dist/comm.h"
#include "glmtune/train/optimizer.h"

namespace glmtune::dist {

// Collective over `group`: the whole [rows, n] of vectors whose elements the ranks hold in
// disjoint pieces, this rank's `piece` [rows, length] being elements [begin, begin + length)
// (length 0 for none; any dtype), on group rank `root` (undefined elsewhere); elements no rank
// holds are zero. The pieces travel to `root` only, so its memory is about twice the whole [rows,
// n] and the other ranks' nothing beyond their piece, whatever the group size.
Tensor gather_pieces(Communicator& group, const Tensor& piece, int64_t begin, int64_t n, int root);

class ShardedAdamW {
 public:
  // `params` are the full parameters (train::named_params order; frozen ones are carried but not
  // trained); every rank of `group` passes the same list.
  ShardedAdamW(std::vector<train::NamedParam> params, train::AdamWConfig config,
               Communicator& group, Communicator* device_group = nullptr);

  const std::vector<train::NamedParam>& params() const { return params_; }
  int64_t step_count() const { return on_device() ? device_step_ : shard_.step_count(); }

  // GPU runs (a device group given): moves the shard's state to the GPU of `compute`, the model's
  // compute tensors aligned with params() (undefined for the frozen ones), which every later
  // step() then sets to the updated weights (the masters rounded to the storage dtype, widened
  // again where the compute tensor is f32). Call after load(). The updated masters are
  // all-gathered `gather_chunk` elements of each rank's shard at a time (the transient copy: 4
  // bytes × ranks × gather_chunk; the default, 2^25, is 128 MiB per rank).
  void keep_on_device(std::vector<Tensor> compute, int64_t gather_chunk = int64_t(1) << 25);
  // After keep_on_device: copies the compute tensors into params()' host values (storage dtype),
  // for a checkpoint. A no-op otherwise.
  void write_params();
  // Elements of the flat space this rank owns (including padding at the end of the last rank).
  int64_t shard_numel() const { return shard_numel_; }

  // Collective. `grads` as for train::AdamW::step: this rank's local sums, aligned with params(),
  // on the host or (with a device group) all on one GPU. Keeps this rank's reduced shard for
  // step() and returns the global L2 norm. `other_sq_norm`: the squared norm of reduced gradients
  // this rank holds outside this optimizer (ShardedLayers' slices), summed over the group with
  // the shards'.
  double reduce_gradients(const std::vector<Tensor>& grads, double other_sq_norm = 0);
  // Collective. The reduce-scatter of reduce_gradients without the norm's sum: returns the squared
  // norm of this rank's reduced shard only, for a caller that sums it over a larger group (the
  // routed experts' optimizer, whose group holds one expert slice: expert_shards.h).
  double reduce_shard(const std::vector<Tensor>& grads);
  // Collective. Updates the shard from the last reduced gradients (a non-finite norm skips, as in
  // train::AdamW) and all-gathers the parameters.
  train::StepReport step(double lr, double global_grad_norm);

  // Bytes of optimizer state on this rank, measured: masters, moments and the pieces' values.
  int64_t state_bytes() const;

  // Collective. The whole state {master, exp_avg, exp_avg_sq} ([numel] f32 each) of the trained
  // parameter `name` of params(), assembled from the ranks' pieces; meaningful on group rank
  // `root`, undefined elsewhere. Every rank asks for the same names in the same order.
  std::array<Tensor, 3> gather_state(const std::string& name, int root) const;
  // Collective. Restores this rank's shard from a state saved by train::AdamW::save (any
  // sharding), reading only its pieces' elements from the mapping; SavedAdamWState::check
  // beforehand names every missing or extra tensor, where a read here stops at the first. The full
  // parameters keep their values: a checkpoint's model holds the masters rounded to the storage
  // dtype, as the saving run held them. `offset_in_saved` (default 0) gives, per parameter, where
  // its flattened elements start in the saved tensor of that name (a slice of a larger saved
  // tensor: the routed experts of one expert-parallel rank). Before keep_on_device only.
  void load(const train::SavedAdamWState& saved,
            const std::function<int64_t(const train::NamedParam&)>& offset_in_saved = {});

 private:
  struct Piece {
    size_t param = 0;   // index in params_
    int64_t begin = 0;  // first element of the parameter in this shard
    int64_t length = 0;
  };
  static std::vector<train::NamedParam> piece_params(const std::vector<train::NamedParam>& params,
                                                     const std::vector<Piece>& pieces);
  // Every rank must have read the same step count.
  void check_same_step(int64_t step, const std::string& where) const;
  // The shard's f32 masters in the flat layout (zero where it holds no piece).
  Tensor shard_masters() const;
  // All-gathers a shard-sized f32 buffer into the flat space and scatters it into per-parameter
  // tensors through `into(param_index, flat_slice)`.
  // `on_device`: through the device group (the shard travels to the GPU of the gradients).
  template <typename Into>
  void gather_flat(const Tensor& shard, Into&& into, bool on_device = false) const;

  bool on_device() const { return on_device_; }
  train::StepReport step_on_device(double lr, double global_grad_norm);

  std::vector<train::NamedParam> params_;
  train::AdamWConfig config_;
  Communicator& group_;
  Communicator* device_group_ = nullptr;
  Device grad_device_;            // where the last reduced gradients came from
  std::vector<int64_t> offsets_;  // flat offset of each parameter (trainable ones)
  int64_t total_ = 0, shard_numel_ = 0, shard_begin_ = 0;
  std::vector<Piece> pieces_;
  train::AdamW shard_;
  std::vector<Tensor> piece_grads_;  // views of the last reduced shard gradient
  // After keep_on_device: the pieces' {master, exp_avg, exp_avg_sq} on the GPU (shard_ is then
  // empty), the update count, and the compute tensors step() writes (aligned with params_).
  bool on_device_ = false;
  std::vector<std::array<Tensor, 3>> device_state_;
  int64_t device_step_ = 0;
  std::vector<Tensor> compute_;
  int64_t gather_chunk_ = int64_t(1) << 25;
};

}  // namespace glmtune::dist
