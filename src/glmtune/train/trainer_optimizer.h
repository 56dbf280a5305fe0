#pragma once
// The optimizer of `glmtune train`, whichever AdamW does the work, behind one interface:
//
//   host     train::AdamW on the CPU, one process (optimizer.h)
//   device   train::DeviceAdamW on one GPU (device_adamw.h; CUDA builds only)
//   sharded  dist::ShardedAdamW over the data-parallel group (ZeRO) for the replicated tensors
//            (dist/sharded_optimizer.h), with beside it, when the run shards them:
//              fully sharded  dist::ShardedLayerAdamW on this rank's decoder-layer slices (fsdp,
//                             dist/fsdp.h)
//              expert-sharded dist::ExpertAdamW on this rank's routed-expert slices (ep,
//                             dist/expert_shards.h)
//            These two never run alone (the embeddings, norms and head stay replicated): they add
//            their part to the sharded optimizer's global norm, update with it, and stream their
//            tensors into its checkpoint. One Optimizer holds all three, so the step loop sees
//            one norm, one step and one checkpoint writer.
//
// Who owns the weights. The optimizer owns the current value of every trained tensor, and says
// where it lives (weights_home()):
//   WeightsHome::store  the ParamStore's tensors are the weights: the host AdamW updates them in
//                       place and the sharded optimizer on the CPU all-gathers into them; the
//                       model's compute tensors are copies, refreshed from the store after every
//                       step.
//   WeightsHome::model  the model's compute tensors on the GPU are the weights (DeviceAdamW's
//                       masters rounded; the sharded optimizers after keep_on_device write the
//                       gathered weights there); the store's values go stale and write_weights()
//                       brings them up to date for a checkpoint.
// Whatever the home, the decoder layers of a fully sharded run live in this rank's slices
// (dist::ShardedLayers) and the store drops them (shard_layers); a checkpoint gathers them back
// one tensor at a time (weights_for_save). The router correction biases are not trained: the bias
// rule updates them in the store every step, and the model (and the layer slices) copy them from
// there. Saving a checkpoint therefore reads the store, after write_weights(), through
// weights_for_save().
//
// A resumed run builds its optimizer from the checkpoint's masters and moments (make_optimizer);
// a checkpoint's optimizer/ directory is written by write_state() in AdamW::save's format, so it
// resumes in any of the variants.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "glmtune/model/param_store.h"
#include "glmtune/tensor/tensor.h"
#include "glmtune/train/optimizer.h"

namespace glmtune::dist {
class Communicator;
class LocalExperts;
class ParallelContext;
class ShardedLayers;
}  // namespace glmtune::dist

namespace glmtune::model::text {
class TextModel;
struct TextGrads;
}  // namespace glmtune::model::text

namespace glmtune::train {

class VlTraining;
struct Recipe;
struct ResumePoint;

// How many offending tensors a non-finite step or checkpoint names.
inline constexpr size_t kNonFiniteNamed = 4;

enum class WeightsHome { store, model };

// Elements [begin, begin + count) of a trained tensor, flattened, in its storage dtype
// (dist::ShardedLayerAdamW::PieceReader).
using PieceReader = std::function<Tensor(const std::string& name, int64_t begin, int64_t count)>;

class Optimizer {
 public:
  virtual ~Optimizer() = default;

  // Once the model and its gradient buffers exist, before parallelize: takes the gradients the
  // optimizer reads and, on a GPU, moves its state beside the model (DeviceAdamW is built here).
  virtual void attach(model::text::TextModel& model, model::text::TextGrads& grads) = 0;
  // Fully sharded runs, after parallelize: AdamW on this rank's pieces of `layers`, read with
  // `read`; the store then drops the decoder-layer tensors it no longer owns (all but the router
  // biases). InternalError for a variant that has no sharded layers.
  virtual void shard_layers(dist::ShardedLayers& layers, const PieceReader& read);
  // Logs what this rank holds of the sharded tensors, once start-up is done.
  virtual void log_memory(const model::text::TextModel& model,
                          const model::text::TextGrads& grads) const;

  // Gradient buffers it reads besides the model's (the vision tower's and projector's in a
  // vision-language run), aligned with its parameters; undefined for the others.
  virtual const std::vector<Tensor>& outside_gradients() const = 0;
  // Collective where sharded: the global L2 norm of the step's gradients, before clipping.
  virtual double grad_norm() = 0;
  // One update at `lr`, clipped by `grad_norm` (from grad_norm()); `skip` (or a non-finite norm)
  // changes nothing, the step count included.
  virtual StepReport step(double lr, double grad_norm, bool skip) = 0;
  // Updates applied so far (the t of the bias correction).
  virtual int64_t step_count() const = 0;
  // Collective where sharded: the released names (at most `limit` per part) of the trained
  // tensors whose gradient holds a non-finite value.
  virtual std::vector<std::string> nonfinite_gradients(const model::ParamStore& store,
                                                       const model::text::TextGrads& grads,
                                                       size_t limit) = 0;

  // See the header comment.
  virtual WeightsHome weights_home() const = 0;
  // Brings the store's values of the tensors it owns up to date (a checkpoint).
  virtual void write_weights(model::ParamStore& store) = 0;
  // Collective where sharded: the released names of weights holding a non-finite value.
  virtual std::vector<std::string> nonfinite_weights(const model::ParamStore& store,
                                                     size_t limit) = 0;
  // The whole value of each parameter for ParamStore::save(dir, whole), gathering the sharded
  // ones; empty when the store holds every weight itself (ParamStore::save(dir)).
  virtual model::ParamStore::WholeValue weights_for_save() = 0;
  // Writes the optimizer state (AdamW::save's files) into `dir`; collective where sharded.
  virtual void write_state(const std::filesystem::path& dir) = 0;
  // The collectives of write_state without writing: what the other ranks run while one saves.
  virtual void visit_state() = 0;
};

// What the optimizer is made from.
struct OptimizerSetup {
  const Recipe* recipe = nullptr;
  model::ParamStore* store = nullptr;  // loaded, frozen, writable
  VlTraining* vl = nullptr;            // a vision-language run
  Device device;                       // where the model computes
  // Sharded runs: the data-parallel group (a group of one for fsdp without a launcher) and the
  // same ranks for device tensors (GPU runs). Null: the host or device optimizer.
  dist::Communicator* dp_group = nullptr;
  dist::Communicator* device_dp_group = nullptr;
  dist::ParallelContext* parallel = nullptr;    // null single-process
  dist::LocalExperts* local_experts = nullptr;  // ep: this rank's routed-expert slices
  bool fsdp = false;
  int64_t num_layers = 0;               // decoder layers (fsdp shards them)
  const ResumePoint* resume = nullptr;  // null: a fresh start
};

// The optimizer of the run `setup` describes, its state restored from `setup.resume` (all of it
// for the host and sharded optimizers; the device optimizer and the fully sharded layers take
// theirs in attach / shard_layers). Throws glmtune::Error when the saved state does not hold the
// run's trained tensors.
std::unique_ptr<Optimizer> make_optimizer(const OptimizerSetup& setup);

}  // namespace glmtune::train
