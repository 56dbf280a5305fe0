#pragma once
// AdamW with fp32 master weights and fp32 moments (docs/training.md, "Optimizer"), on the CPU.
//
// Each trainable parameter keeps an f32 master copy, a first moment `exp_avg` and a second moment
// `exp_avg_sq`. A parameter stored in f32 is its own master (no second copy); a bf16 / f16
// parameter gets a separate f32 master, and after every update its storage is the master rounded
// to nearest-even. Frozen parameters (the indexer, buffers such as the router correction bias) are
// never touched and have no state.
//
// One update, for optimizer step t (1-based, counting applied updates), learning rate lr,
// gradient g already multiplied by the clip coefficient:
//
//   p ← p · (1 − lr · weight_decay)               decoupled decay, on every trainable parameter
//   m ← m + (1 − β1) · (g − m)                    = β1·m + (1 − β1)·g
//   v ← β2 · v + (1 − β2) · g²
//   p ← p − (lr / (1 − β1^t)) · m / (sqrt(v) / sqrt(1 − β2^t) + eps)
//
// which is PyTorch's AdamW (decay before the moment update, eps added after the bias-corrected
// square root). Scalars are computed in f64, the elementwise arithmetic in f32.
//
// Gradient clipping: the global L2 norm over all trainable gradients is accumulated in f64 in
// fixed blocks (the result does not depend on the thread count, so a resumed run reproduces it
// bit for bit); the gradients are scaled by min(1, max_norm / (norm + 1e-6)), the coefficient of
// torch.nn.utils.clip_grad_norm_ (default max_norm 1.0). A non-finite norm skips the update:
// parameters, moments and the step counter are left as they were and the report says so.
//
// State on disk: a sharded safetensors directory (CheckpointWriter) holding, per trainable
// parameter, `optimizer/master/<name>`, `optimizer/exp_avg/<name>`, `optimizer/exp_avg_sq/<name>`
// (all f32, the parameter's shape), plus `optimizer/step` (i64 [1]). Restoring it gives the exact
// bits the saving run had.

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "glmtune/io/checkpoint.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::model {
class ParamStore;
}

namespace glmtune::train {

struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.01;
  // Global-norm clipping threshold; 0 turns clipping off (the norm is still measured).
  double max_grad_norm = 1.0;
};

// The on-disk names of the saved state (see above), shared by AdamW::save and the writers that
// stream the same files from sharded optimizers (train/state.h). `kind`: 0 master, 1 exp_avg,
// 2 exp_avg_sq.
inline constexpr const char* kOptimizerFormat = "glmtune-adamw";
inline constexpr const char* kOptimizerStepName = "optimizer/step";
std::string optimizer_state_name(int kind, const std::string& param);

// A state saved by AdamW::save, opened for ranged reads: a sharded optimizer takes each of its
// pieces straight from the memory-mapped files, so no rank ever holds a whole saved state (or a
// whole tensor's) in memory; only the pages of its own elements are touched.
class SavedAdamWState {
 public:
  // Reads the headers and the step count. glmtune::Error naming the directory when it is not an
  // optimizer state (missing, another format, a malformed step count).
  static SavedAdamWState open(const std::filesystem::path& dir);

  const std::filesystem::path& dir() const { return reader_.dir(); }
  int64_t step_count() const { return step_; }
  // Checks that the state holds exactly the trained parameters `trained` (name and whole shape):
  // glmtune::Error naming the missing, unexpected and mis-shaped tensors otherwise.
  void check(const std::vector<std::pair<std::string, Shape>>& trained) const;
  // Elements [begin, begin + count) of state `kind` of parameter `name`, flattened: a read-only
  // view of the mapping. glmtune::Error naming the tensor when it is absent, not f32, or shorter.
  Tensor range(int kind, const std::string& name, int64_t begin, int64_t count) const;

 private:
  explicit SavedAdamWState(io::CheckpointReader reader) : reader_(std::move(reader)) {}
  io::CheckpointReader reader_;
  int64_t step_ = 0;
};

// A parameter as the optimizer sees it. `value` shares storage with the model's tensor, so
// updates are visible to the model without copying.
struct NamedParam {
  std::string name;
  Tensor value;
  bool trainable = true;
};

// The ParamStore's parameters in store order (the order gradients must be given in).
std::vector<NamedParam> named_params(const model::ParamStore& store);

// ParamStore::load leaves unfused parameters as views of the read-only checkpoint mapping. This
// copies into owned memory every parameter training writes: trainable parameters and the router
// correction biases. Call it once before building the optimizer.
void make_params_writable(model::ParamStore& store);

struct StepReport {
  double grad_norm = 0.0;  // global L2 norm before clipping (non-finite when skipped)
  double clip_coef = 1.0;  // factor the gradients were scaled by
  bool skipped = false;    // non-finite norm: nothing was changed
  int64_t step = 0;        // updates applied so far, this one included
};

class AdamW {
 public:
  // Checks every trainable parameter: a contiguous CPU tensor of dtype f32, bf16 or f16, owning
  // its memory (see make_params_writable), names unique. Throws InternalError otherwise.
  AdamW(std::vector<NamedParam> params, AdamWConfig config = {});

  const std::vector<NamedParam>& params() const { return params_; }
  const AdamWConfig& config() const { return config_; }
  // Updates applied so far (skipped steps do not count): the t of the bias correction.
  int64_t step_count() const { return step_; }

  // Sum of squared gradient elements over the trainable parameters, accumulated in f64 in fixed
  // blocks. `grads` is aligned with params(): grads[i] has params()[i]'s shape and any floating
  // dtype; entries of frozen parameters are ignored and may be undefined. Distributed training
  // sums this over the ranks that hold disjoint shards, then passes sqrt of the total to step().
  double grad_sq_norm(const std::vector<Tensor>& grads) const;

  // Clips by the global norm of `grads` and applies one AdamW update with learning rate `lr`.
  StepReport step(const std::vector<Tensor>& grads, double lr);
  // The same with the global norm computed by the caller (e.g. combined over ranks).
  StepReport step(const std::vector<Tensor>& grads, double lr, double global_grad_norm);

  // State of trainable parameter `i` of params() (undefined tensors for frozen ones). For an f32
  // parameter the master is the parameter itself.
  const Tensor& master(size_t i) const { return state_[i].master; }
  const Tensor& exp_avg(size_t i) const { return state_[i].exp_avg; }
  const Tensor& exp_avg_sq(size_t i) const { return state_[i].exp_avg_sq; }
  // Bytes of memory alive for the parameters and their state, measured: each distinct storage of
  // a value, master or moment counted once (an f32 parameter is its own master).
  int64_t state_bytes() const;

  // Replaces the state of trainable parameter `i` with f32 tensors of its element count, and
  // sets the parameter's storage to the master rounded to its dtype (the sharded optimizer
  // restores its slices of a saved state with it).
  void set_state(size_t i, const Tensor& master, const Tensor& exp_avg, const Tensor& exp_avg_sq);
  void set_step_count(int64_t step);
  // Writes the state into directory `dir` (replaced atomically by the checkpoint writer).
  void save(const std::filesystem::path& dir) const;
  // Restores a state saved by save(): the master weights, moments and step counter, and sets each
  // parameter's storage to its master rounded to the storage dtype. Throws glmtune::Error naming
  // the directory for a missing or extra tensor, a wrong shape or dtype, or a directory that is
  // not an optimizer state.
  void load(const std::filesystem::path& dir);

 private:
  struct State {
    Tensor master;  // f32; aliases the parameter when it is stored in f32
    Tensor exp_avg, exp_avg_sq;
  };
  void check_grads(const std::vector<Tensor>& grads) const;

  std::vector<NamedParam> params_;
  std::vector<State> state_;
  AdamWConfig config_;
  int64_t step_ = 0;
};

// The clip coefficient min(1, max_norm / (norm + 1e-6)); 1 when max_norm is 0 (clipping off).
double clip_coefficient(double grad_norm, double max_norm);

}  // namespace glmtune::train
