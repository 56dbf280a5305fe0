#pragma once
// Decoder layers sharded over a data-parallel group (fully sharded data parallel, ZeRO-3;
// docs/distributed.md, "Fully sharded parameters"): parameters, gradients and optimizer state.
//
// Each decoder layer's tensors (every defined tensor of TextWeights::layers[l], trained or not),
// in a fixed order, form one flat vector per dtype (a "flat": one on the CPU, where every tensor
// has the compute dtype; on a GPU a bf16 one and an f32 one for the fp32-kept tensors) of N
// elements, padded to a multiple of the group size P; rank r keeps elements [r·N'/P, (r+1)·N'/P)
// of each flat and the layer's tensors are left undefined. On a GPU every tensor starts at a
// multiple of 128 elements, so the views the kernels read are aligned as whole tensors are. The
// same layout holds the layer's gradient (in the gradients' dtype: f32 on a GPU; zero at the
// frozen tensors and the padding), so a rank's gradient slice, compute slice and optimizer state
// cover the same elements and an update needs no communication. The layer loops
// (model::text::LayerParamProvider) call:
//   gather(l)              the slices are all-gathered into one full buffer per flat (or the
//                          prefetched ones are waited for); the layer's tensors (and their
//                          TextWeights::named entries) become views of them;
//   prefetch(l)            the all-gathers of the layer that runs next start without waiting;
//   release(l)             those views are dropped: a buffer is freed once nothing holds it;
//   allocate_gradients(l)  one zero buffer per flat; the layer's TextGrads buffers
//                          (TextGrads::layers[l] and their named entries) become views of them;
//   reduce_gradients(l)    those buffers are reduce-scattered (SUM) and added to this rank's
//                          gradient slices (a step's micro-packs accumulate), then dropped. Where
//                          the backend runs it asynchronously (NCCL) the reduction completes
//                          while the next layer's backward runs, and finish_reductions() (which
//                          every reader of the gradient slices calls) waits for the last one.
// Between layers a rank therefore holds its slices only, and while a layer runs that layer's
// buffers plus the next layer's in flight. Embeddings, the final norm, the head and the MTP layer
// stay replicated (ShardedAdamW trains them), and so do the tensors LayerSource::outside names
// (routed-expert slices, which expert_shards.h trains).
//
// ShardedLayerAdamW trains the slices: AdamW (train::AdamW, the same arithmetic) on this rank's
// pieces of each trainable tensor, with fp32 masters and moments of those pieces only; after an
// update the pieces, rounded to their storage dtype, are written into the compute slice. On a GPU
// (keep_on_device) that state lives on the device and the update is the multi-tensor AdamW kernel.
//
// Start-up and checkpoints never hold a whole layer either: built from a LayerSource, each rank
// reads only its slices' elements from the checkpoint (the model holds placeholders for the
// deferred tensors, model::ParamStore::load), and a checkpoint gathers one tensor, then its
// optimizer state, at a time (gather_tensor, ShardedLayerAdamW::gather_state) for rank 0 to write
// in the released layout; a resume reads each piece's state from the saved files
// (ShardedLayerAdamW::load of a train::SavedAdamWState).
//
// Collective: every rank of the group must run the same layers in the same order.
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "glmtune/dist/comm.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/layer.h"
#include "glmtune/model/text/weights.h"
#include "glmtune/train/optimizer.h"

namespace glmtune::dist {

// Where the decoder-layer tensors come from when the model holds only placeholders for them
// (model::ParamStore::load with the decoder layers deferred): each rank reads only its elements.
struct LayerSource {
  // The whole shape of a tensor the model holds as a placeholder; nullopt for one it holds whole
  // (the router correction biases, which the parameter store keeps), whose slice is copied from the
  // model's tensor.
  std::function<std::optional<Shape>(const std::string& name)> deferred_shape;
  // Elements [begin, begin + count) of such a tensor, flattened, in any float dtype.
  std::function<Tensor(const std::string& name, int64_t begin, int64_t count)> read;
  // Decoder-layer tensors left out of the layout (null: none): their values differ between the
  // ranks of the group (the routed-expert slices of expert parallelism, each rank its ep slice), so
  // a slice of them would mix different parameters. They stay whole in the model, with their own
  // gradient buffers, and another optimizer trains them.
  std::function<bool(const std::string& name)> outside;
};

class ShardedLayers final : public model::text::LayerParamProvider {
 public:
  // Keeps this rank's slices of the decoder-layer tensors of `weights` (the same on every rank)
  // and releases the tensors; drops the decoder-layer buffers of `grads` (TextGrads::zeros_like of
  // `weights`, built before this), which exist from then on only between allocate_gradients and
  // reduce_gradients. For the placeholders that `source` names, the layout comes from the whole
  // shapes it gives and this rank's slice is read from it piece by piece, so no rank ever holds a
  // whole decoder layer at start-up. GPU weights: `device_group` (the same ranks in the same order,
  // for device tensors: NCCL) moves the layers; `group` then carries the host side (checkpoint
  // gathers, flags). Without it `group` does both (MPI on the CPU, or a group of one).
  ShardedLayers(model::text::TextWeights& weights, model::text::TextGrads& grads,
                Communicator& group, const LayerSource& source,
                Communicator* device_group = nullptr);
  ~ShardedLayers() override = default;

  void gather(int64_t layer) override;
  void prefetch(int64_t layer) override;
  void release(int64_t layer) override;
  void allocate_gradients(int64_t layer) override;
  void reduce_gradients(int64_t layer) override;

  int64_t layers() const { return int64_t(layers_.size()); }
  Communicator& group() const { return group_; }
  const Device& device() const { return weights_.device; }

  // Waits for the gradient reductions still in flight and adds them into the slices.
  void finish_reductions();

  // Bytes of decoder-layer parameter memory alive on this rank now, measured: the slices plus
  // every gathered or prefetched buffer that something still references (a released layer whose
  // buffer outlived its release counts in full).
  int64_t resident_bytes() const;
  // Bytes of the full decoder-layer parameters (what every rank holds without sharding).
  int64_t full_bytes() const { return full_bytes_; }
  // Bytes of decoder-layer gradient memory alive on this rank now, measured the same way: the
  // gradient slices plus any layer gradient buffer still referenced.
  int64_t gradient_bytes() const;
  // Bytes of the full decoder-layer gradient buffers (TextGrads without sharding).
  int64_t full_gradient_bytes() const { return full_gradient_bytes_; }

  // Zeroes the gradient slices (the start of an optimizer step).
  void zero_gradients();
  // Collective over `replicas`: sums the gradient slices over ranks that hold the same slices (the
  // same rank of an equal-sized group) and differentiated parts of the same packs: the ranks of an
  // sp group, whose reduce-scatters over their own dp groups each summed only their rows' and
  // heads' share. Once per step, after the last backward; 1/P of the layers' elements.
  void all_reduce_gradients(Communicator& replicas);
  // Collective, one layer at a time: calls `visit` with every trained tensor's TextGrads::named
  // name and its reduced gradient (the group's sum of this step's contributions).
  void gather_gradients(
      const std::function<void(const std::string& name, const Tensor& grad)>& visit);
  // Collective: the whole value of one decoder-layer tensor (a TextWeights::named name) in the
  // compute dtype and its shape, assembled from the ranks' slices; meaningful on group rank `root`,
  // undefined elsewhere. Every rank asks for the same names in the same order. Memory: that tensor,
  // not its layer.
  Tensor gather_tensor(const std::string& name, int root);
  // Collective: the decoder-layer tensors (internal names, layer order, at most `limit`) whose
  // parameters (`gradients` false) or reduced gradients hold a non-finite element on any rank.
  std::vector<std::string> nonfinite(bool gradients, size_t limit);
  // Sets this rank's part of the tensor `name` (a TextWeights::named name of a decoder layer)
  // from its full value `value`, in any float dtype. Local, no communication.
  void set_parameter(const std::string& name, const Tensor& value);
  // Whether `name` is a decoder-layer tensor held here.
  bool holds(const std::string& name) const;

  // The tensors of one decoder layer in the flat layout: the tensor's elements (flattened) are
  // elements [offset, offset + numel) of the layer's flat number `flat`; `trained`: it has a
  // gradient. This rank's slices hold elements [slice_begin(l, f), slice_begin(l, f) +
  // slice(l, f).numel()) of flat f.
  struct Entry {
    std::string name;
    size_t flat = 0;
    int64_t offset = 0, numel = 0;
    bool trained = false;
  };
  std::vector<Entry> entries(int64_t layer) const;
  size_t flats(int64_t layer) const { return layer_at(layer, "flats").flats.size(); }
  int64_t slice_begin(int64_t layer, size_t flat) const;
  // The layer's compute slice ([N'/P], the flat's dtype) and gradient slice ([N'/P], the
  // gradients' dtype) of one flat; they live as long as this object, so views of them stay valid.
  Tensor& slice(int64_t layer, size_t flat) { return flat_at(layer, flat).shard; }
  Tensor& gradient_slice(int64_t layer, size_t flat) { return flat_at(layer, flat).grad_shard; }

 private:
  struct Param {
    Tensor* field = nullptr;         // in TextWeights::layers[l]
    std::vector<size_t> named;       // entries of TextWeights::named sharing its storage
    Tensor* grad = nullptr;          // in TextGrads::layers[l]; null for a frozen tensor
    std::vector<size_t> grad_named;  // entries of TextGrads::named sharing its storage
    Shape shape;
    size_t flat = 0;
    int64_t offset = 0;
    bool frozen = false;  // the model's tensor is frozen: so is every gathered view of it
  };
  struct Prefetch {
    Tensor buffer;
    std::unique_ptr<PendingCollective> pending;
  };
  // A reduce-scatter in flight: the full gradient buffer it reads, the part it writes for this
  // rank, and the slice that part is added into once it is done.
  struct Reduction {
    Tensor full, mine;
    Tensor* slice = nullptr;
    std::unique_ptr<PendingCollective> pending;
  };
  // The tensors of one dtype of a layer.
  struct Flat {
    DType dtype = DType::f32, grad_dtype = DType::f32;
    // Whether its tensors are trained. Frozen tensors (and the indexer's) have flats of their own,
    // which have no gradient buffers and take part in no reduction.
    bool trained = true;
    int64_t padded = 0;  // elements, a multiple of the group size
    Tensor shard;        // [padded / P]
    std::weak_ptr<Storage> gathered;
    std::optional<Prefetch> prefetched;
    Tensor grad_shard;  // [padded / P]
    Tensor grad_full;   // [padded] between allocate_gradients and reduce_gradients
    std::weak_ptr<Storage> grad_allocated;
  };
  struct Layer {
    std::vector<Param> params;
    std::vector<Flat> flats;
  };
  void build(const LayerSource& source);
  // The layer and parameter holding the tensor `name`; InternalError when none does.
  std::pair<size_t, const Param*> find(const std::string& name) const;
  Layer& layer_at(int64_t layer, const char* what);
  const Layer& layer_at(int64_t layer, const char* what) const;
  Flat& flat_at(int64_t layer, size_t flat);
  // A flat's full vector from one slice of it, all-gathered.
  Tensor all_gather_flat(const Flat& flat, const Tensor& local);
  const std::string& param_name(const Param& p) const;
  // The communicator of the layers' tensors.
  Communicator& movers() const { return device_group_ ? *device_group_ : group_; }

  model::text::TextWeights& weights_;
  model::text::TextGrads& grads_;
  Communicator& group_;
  Communicator* device_group_ = nullptr;
  std::vector<Layer> layers_;
  std::vector<Reduction> reductions_;  // in flight, oldest first
  int64_t full_bytes_ = 0, full_gradient_bytes_ = 0;
};

// AdamW over this rank's pieces of the decoder layers' trained tensors (a piece: the part of a
// tensor inside this rank's range of the ShardedLayers layout): fp32 masters and both moments
// exist for those pieces only. Frozen tensors (the indexer, the
// router correction bias) have no state and are never written. Each piece keeps its value in the
// parameter's storage dtype (an f32 tensor is its own master, a bf16 one is the master rounded,
// exactly as train::AdamW does), and the compute slice holds that value converted.
class ShardedLayerAdamW {
 public:
  // `read(name, begin, count)` gives elements [begin, begin + count) of the trained tensor `name`,
  // flattened, in its storage dtype (ParamStore::read_elements on the checkpoint of a store that
  // deferred the decoder layers). A view of a mapped checkpoint is copied; any other tensor it
  // returns becomes the piece's value, updated in place, so it must not share memory with a tensor
  // that lives on.
  using PieceReader = std::function<Tensor(const std::string& name, int64_t begin, int64_t count)>;
  ShardedLayerAdamW(ShardedLayers& layers, const PieceReader& read, train::AdamWConfig config);

  // GPU layers: moves the pieces' masters and moments to the slices' device, where every later
  // step updates them with the multi-tensor AdamW kernel and writes the compute slices. Call after
  // load().
  void keep_on_device();

  int64_t step_count() const { return on_device_ ? device_step_ : pieces_.step_count(); }
  // Sum of squared elements of this rank's gradient pieces (the group sum is the decoder layers'
  // part of the global norm). Local, once the layers' reductions are finished (it finishes them).
  double grad_sq_norm() const;
  // Updates the pieces from the gradient slices with the global norm (clipping; a non-finite norm
  // skips, as in train::AdamW) and refreshes the compute slices from them. Local.
  train::StepReport step(double lr, double global_grad_norm);
  // Bytes of optimizer state on this rank, measured: masters, moments and the pieces' values.
  int64_t state_bytes() const;

  // Collective: the whole state {master, exp_avg, exp_avg_sq} ([numel] f32 each) of the trained
  // decoder-layer tensor `name`, assembled from the ranks' pieces; meaningful on group rank `root`,
  // undefined elsewhere (a streamed save, train/state.h).
  std::array<Tensor, 3> gather_state(const std::string& name, int root) const;
  // Restores this rank's pieces from a state saved by train::AdamW::save (any sharding), reading
  // only their elements from the mapping, and refreshes the compute slices. Collective (the ranks
  // check that they read the same step). Before keep_on_device only.
  void load(const train::SavedAdamWState& saved);

 private:
  // One piece: elements [begin, begin + length) of tensor `name` (flattened), at
  // [slice_offset, slice_offset + length) of its layer's slices.
  struct Slot {
    int64_t layer = 0;
    size_t flat = 0;
    std::string name;
    int64_t begin = 0, length = 0, slice_offset = 0;
    DType storage = DType::f32;  // the stored tensor's dtype: the forward sees the master rounded
  };
  void refresh_slices();
  Tensor compute_piece(size_t k) {
    const Slot& s = slots_[k];
    return layers_.slice(s.layer, s.flat).narrow(0, s.slice_offset, s.length);
  }

  ShardedLayers& layers_;
  std::vector<Slot> slots_;  // aligned with pieces_.params()
  train::AdamW pieces_;
  std::vector<Tensor> grads_;  // views of the gradient slices, aligned with slots_
  // After keep_on_device: each piece's {master, exp_avg, exp_avg_sq} (f32) on the device
  // (pieces_ is then empty) and the update count.
  bool on_device_ = false;
  std::vector<std::array<Tensor, 3>> device_state_;
  int64_t device_step_ = 0;
  train::AdamWConfig config_;
};

}  // namespace glmtune::dist
