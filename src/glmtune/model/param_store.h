#pragma once
// The model's parameters under glmtune's internal names. Most internal tensors are the released
// tensors themselves (memory-mapped, not copied); two families are fused for fast kernels:
//   <layer>.mlp.experts.gate_up_proj [E, 2*Im, D]  <- experts.{e}.gate_proj / up_proj (gate first)
//   <layer>.mlp.experts.down_proj    [E, D, Im]    <- experts.{e}.down_proj
//   <layer>.self_attn.conv1d.weight  [3*QL, 1, K]  <- q_conv1d / k_conv1d / v_conv1d
// Saving splits them back, so what glmtune writes is always the released layout. With expert
// parallelism a rank loads only its range of the routed experts: the fused expert tensors are then
// [count, ...] and the other experts' released tensors are never read. With fully sharded layers a
// rank defers the decoder-layer tensors: the store holds a placeholder for each and the rank reads
// only the elements it keeps, straight from the mapped checkpoint (read_elements).

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "glmtune/io/checkpoint.h"
#include "glmtune/model/config.h"
#include "glmtune/model/layout.h"

namespace glmtune::model {

// How a checkpoint on disk compares with the layout its config implies.
struct CheckpointReport {
  struct Mismatch {
    std::string name;
    Shape expected, found;
  };
  std::vector<std::string> missing;
  std::vector<std::string> unexpected;
  std::vector<Mismatch> misshaped;
  std::vector<std::string> fp8_weights;  // weights stored as FP8 with a weight_scale_inv companion
  // Tensors stored in f32 that the released layout stores in bf16 (an export in float32). glmtune
  // loads and computes with their f32 values; a checkpoint it writes (ParamStore::save) stores
  // them in bf16, the released dtype, so saving rounds them.
  std::vector<std::string> f32_not_bf16;
  std::map<std::string, int64_t> dtype_tensors;  // dtype name -> tensor count
  std::map<std::string, int64_t> dtype_bytes;
  int64_t tensors = 0;
  int64_t bytes = 0;

  bool ok() const { return missing.empty() && unexpected.empty() && misshaped.empty(); }
  // A multi-line summary naming up to `limit` keys per category.
  std::string describe(size_t limit = 10) const;
};

// Reads headers only. FP8 weights with a `weight_scale_inv` companion of the right block shape
// count as present; the companions are not unexpected.
CheckpointReport check_checkpoint(const io::CheckpointReader& reader, const ModelConfig& config);

// Whether `name` is a fused routed-expert tensor (a MoE layer's experts.gate_up_proj or
// experts.down_proj above).
bool is_fused_expert_tensor(const std::string& name);
// Whether `name` is a LoRA A or B of a fused routed-expert tensor (model/lora.h), [E, r, in] or
// [E, out, r]: one adapter per expert, held by expert range like the tensor it adapts.
bool is_expert_adapter(const std::string& name);
// The tensors a store loaded with an expert range holds as [count, ...] slices: the fused
// routed-expert tensors and their adapters.
bool is_expert_sliced(const std::string& name);

// Routed experts [first, first + count) of every MoE layer: one rank's slice under expert
// parallelism (docs/distributed.md, "How expert parallelism works").
struct ExpertRange {
  int64_t first = 0;
  int64_t count = 0;
  bool operator==(const ExpertRange&) const = default;
};

struct InternalParam {
  std::string name;
  Tensor value;
  bool trainable = true;
  // Released names it was assembled from (itself when unfused). A fused expert tensor names every
  // expert even when the store holds a range of them: the whole tensor, gathered back from the
  // ranks, saves under these names.
  std::vector<std::string> sources;
  // The whole tensor's shape (what save writes), also when `value` holds a range of the experts
  // or is the placeholder of a deferred tensor.
  Shape shape;
  // Loaded as a placeholder: `value` is one element of the storage dtype (a distinct storage, so
  // that code keying tensors by storage still tells them apart), not the tensor's data.
  bool deferred = false;
  // A low-rank adapter's A or B (model/lora.h): not part of the released layout, so save() skips
  // it; model/lora.h saves adapters as their own directory.
  bool adapter = false;
};

class ParamStore {
 public:
  // Loads every parameter. Throws glmtune::Error listing missing, unexpected and mis-shaped keys by
  // name, or refusing a checkpoint that is not GLM-5.3-shaped at all. With `experts`, the fused
  // routed-expert tensors hold those experts only ([count, ...]); the other experts' tensors are
  // still checked (names, shapes, dtypes) but their data is never read. The range must be one of
  // the equal slices of the routed experts (count divides their number, first is a multiple of
  // count); glmtune::Error otherwise.
  //
  // `defer` (given an internal name) picks tensors whose data is not read at all: they are checked
  // like the others, then held as placeholders (InternalParam::deferred); read_elements reads any
  // range of them later from the same checkpoint. Fully sharded layers defer the decoder layers.
  static ParamStore load(const io::CheckpointReader& reader, const ModelConfig& config,
                         std::optional<ExpertRange> experts = std::nullopt,
                         const std::function<bool(const std::string& name)>& defer = {});

  const ModelConfig& config() const { return config_; }
  // The routed experts the fused expert tensors were loaded with; nullopt when all of them.
  const std::optional<ExpertRange>& expert_range() const { return expert_range_; }
  bool contains(const std::string& name) const { return index_.count(name) > 0; }
  // Throws InternalError naming the parameter when absent.
  const Tensor& get(const std::string& name) const;
  Tensor& get(const std::string& name);
  const std::vector<InternalParam>& params() const { return params_; }
  // Throws InternalError naming the parameter when absent.
  const InternalParam& param(const std::string& name) const;
  // Whether the optimizer trains parameter `name` (train.freeze turns it off).
  void set_trainable(const std::string& name, bool trainable);
  // Reads deferred parameter `name` from `reader` (the checkpoint the store was loaded from) and
  // holds it like a parameter loaded at once: whole, or for a fused expert tensor of a store
  // loaded with an expert range, that range's experts. What a load that deferred more than it
  // keeps deferred (a trained tensor among the FP8 ones a frozen base holds) catches up on.
  void load_deferred(const io::CheckpointReader& reader, const std::string& name);

  // Low-rank adapters (model/lora.h): parameters named like the projection they adapt, outside the
  // released layout. add_adapter appends a trainable one (InternalError for a name taken); under
  // an expert range a routed-expert adapter's value holds the range's experts [count, ...] and
  // its InternalParam::shape is the whole adapter's, as for the tensor it adapts (InternalError
  // for a value of another expert count). remove_adapters drops them all. adapter_scale is their
  // alpha / r, set while any exist.
  void add_adapter(const std::string& name, Tensor value);
  void remove_adapters();
  bool has_adapters() const { return adapter_scale_.has_value(); }
  double adapter_scale() const;
  void set_adapter_scale(double scale) { adapter_scale_ = scale; }

  // Elements [begin, begin + count) of internal parameter `name` (the whole tensor, flattened),
  // read from `reader`, the checkpoint this store was loaded from: a [count] tensor in the storage
  // dtype. Only the mapped pages of those elements are touched (of an FP8 weight, the 128-row
  // blocks that hold them are dequantised). glmtune::Error naming the tensor for a range outside
  // it.
  Tensor read_elements(const io::CheckpointReader& reader, const std::string& name, int64_t begin,
                       int64_t count) const;

  // Writes the released layout (fused tensors split, stored dtypes per the fp32-kept policy). The
  // fused expert tensors must hold every expert (gathered back when loaded with a range).
  void save(const std::filesystem::path& dir, uint64_t max_shard_bytes = 5'000'000'000) const;

  // The whole value of a parameter in its storage dtype, produced right before it is written (a
  // tensor gathered from the ranks holding its parts); may be undefined on a rank that writes
  // nothing.
  using WholeValue = std::function<Tensor(const InternalParam& param)>;
  // The same files as save(dir), with each parameter taken from `whole` one at a time, in store
  // order, and written before the next is asked for: memory holds one whole tensor, never the
  // model. `whole` is called for every parameter, also those the store holds whole.
  void save(const std::filesystem::path& dir, const WholeValue& whole,
            uint64_t max_shard_bytes = 5'000'000'000) const;
  // Calls `whole` exactly as save(dir, whole) does, writing nothing: what the other ranks run
  // while one rank saves, when `whole` is collective.
  void visit_for_save(const WholeValue& whole) const;

 private:
  ModelConfig config_;
  std::optional<ExpertRange> expert_range_;
  std::optional<double> adapter_scale_;
  std::vector<InternalParam> params_;
  std::map<std::string, size_t> index_;
};

}  // namespace glmtune::model
