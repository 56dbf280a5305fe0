#include "glmtune/dist/expert_shards.h"

#include <fmt/format.h>

#include "glmtune/base/error.h"
#include "glmtune/train/released.h"

namespace glmtune::dist {
namespace {

// Released tensors per expert: gate_up_proj splits into a gate and an up tensor (its sources list
// every expert's gate, then every expert's up), down_proj into one.
int64_t parts_per_expert(const std::string& name) { return name.ends_with("gate_up_proj") ? 2 : 1; }

// The released names a slice's tensor has: one per expert and part, or for an adapter (outside the
// released layout) its own name.
int64_t source_count(const std::string& name, int64_t experts) {
  return model::is_expert_adapter(name) ? 1 : parts_per_expert(name) * experts;
}

}  // namespace

model::ExpertRange local_range(const ExpertParallel& experts) {
  return {experts.first_expert(), experts.local_experts()};
}

LocalExperts::LocalExperts(model::ParamStore& store, const ExpertParallel& experts)
    : experts_(experts) {
  const int64_t n = experts.experts(), local = experts.local_experts();
  const model::ExpertRange loaded = store.expert_range().value_or(model::ExpertRange{0, n});
  GLMTUNE_ASSERT(loaded == local_range(experts),
                 "the parameter store holds experts [{}, {}), this rank's slice is [{}, {}): load "
                 "it with local_range",
                 loaded.first, loaded.first + loaded.count, experts.first_expert(),
                 experts.first_expert() + local);
  bool held_in_fp8 = false;
  for (const model::InternalParam& p : store.params()) {
    if (!model::is_expert_sliced(p.name)) continue;
    // A frozen base's experts held in FP8 (model/text/fp8_layers.h) are not among the values: the
    // FP8 holder takes this rank's experts from the file, and nothing trains or saves them here.
    if (p.deferred) {
      GLMTUNE_ASSERT(!p.trainable, "routed-expert tensor '{}' is deferred and trained", p.name);
      held_in_fp8 = true;
      continue;
    }
    GLMTUNE_ASSERT(p.value.defined() && p.value.dim() == 3 && p.value.size(0) == local &&
                       int64_t(p.sources.size()) == source_count(p.name, n),
                   "routed-expert tensor '{}' is {}, expected {} of the {} experts", p.name,
                   p.value.defined() ? p.value.str() : std::string("undefined"), local, n);
    full_bytes_ += int64_t(p.value.nbytes()) / local * n;
    entries_.push_back({p.name, p.value, p.sources, p.trainable});
  }
  if (entries_.empty() && !held_in_fp8)
    throw Error("expert parallelism asked for, but the model has no routed experts",
                "train.ep_size", "set train.ep_size = 1 for a model without MoE layers");
}

std::vector<train::NamedParam> LocalExperts::params() const {
  std::vector<train::NamedParam> out;
  for (const Entry& e : entries_) out.push_back({e.name, e.local, e.trainable});
  return out;
}

bool LocalExperts::holds(const std::string& name) const {
  for (const Entry& e : entries_)
    if (e.name == name) return true;
  return false;
}

int64_t LocalExperts::local_bytes() const {
  int64_t bytes = 0;
  for (const Entry& e : entries_) bytes += int64_t(e.local.storage()->bytes());
  return bytes;
}

Tensor LocalExperts::gather_one(const std::string& name) const {
  for (const Entry& e : entries_) {
    if (e.name != name) continue;
    // Rank r's block is experts [r·n/E, (r+1)·n/E): the blocks in rank order are the full tensor.
    Shape shape = e.local.shape();
    shape[0] = experts_.experts();
    Tensor full = Tensor::empty(shape, e.local.dtype());
    experts_.group().all_gather(e.local, full);
    return full;
  }
  throw InternalError(fmt::format("'{}' is not a routed-expert tensor of this rank", name));
}

std::vector<std::string> LocalExperts::nonfinite(
    const std::function<const Tensor*(const std::string&)>& local, Communicator& everyone,
    size_t limit) const {
  const int64_t n = experts_.experts(), first = experts_.first_expert();
  // One flag per released tensor: entry, then part (gate / up, or down), then expert; one per
  // adapter.
  std::vector<int64_t> flags;
  std::vector<std::string> names;
  for (const Entry& e : entries_) {
    const Tensor* t = local(e.name);
    if (model::is_expert_adapter(e.name)) {
      flags.push_back(t != nullptr && !train::all_finite(*t) ? 1 : 0);
      names.push_back(e.name);
      continue;
    }
    const int64_t parts = parts_per_expert(e.name);
    for (int64_t part = 0; part < parts; ++part)
      for (int64_t x = 0; x < n; ++x) {
        const int64_t j = x - first;
        bool bad = false;
        if (t != nullptr && j >= 0 && j < experts_.local_experts()) {
          const Tensor expert = t->select(0, j);
          const int64_t rows = expert.size(0) / parts;
          bad = !train::all_finite(expert.slice(0, part * rows, (part + 1) * rows));
        }
        flags.push_back(bad ? 1 : 0);
        names.push_back(e.sources[size_t(part * n + x)]);
      }
  }
  everyone.all_reduce_sum(flags);
  std::vector<std::string> out;
  for (size_t i = 0; i < flags.size() && out.size() < limit; ++i)
    if (flags[i] > 0) out.push_back(names[i]);
  return out;
}

// ---- ExpertAdamW

ExpertAdamW::ExpertAdamW(const LocalExperts& experts, train::AdamWConfig config, Communicator& edp,
                         Communicator* edp_device)
    : experts_(experts), edp_(edp), shards_(experts.params(), config, edp, edp_device) {}

double ExpertAdamW::reduce_gradients(const std::vector<Tensor>& grads) {
  return shards_.reduce_shard(grads);
}

train::StepReport ExpertAdamW::step(double lr, double global_grad_norm) {
  return shards_.step(lr, global_grad_norm);
}

std::array<Tensor, 3> ExpertAdamW::gather_state(const std::string& name) const {
  Communicator& ep = experts_.experts().group();
  const std::array<Tensor, 3> slice = shards_.gather_state(name, 0);
  if (edp_.rank() != 0) return {};
  const int64_t numel = slice[0].numel();
  Tensor local = Tensor::empty({3, numel}, DType::f32);
  for (int64_t kind = 0; kind < 3; ++kind) local.select(0, kind).copy_(slice[size_t(kind)]);
  Tensor gathered = Tensor::empty({ep.size(), 3, numel}, DType::f32);
  ep.all_gather(local, gathered);
  if (ep.rank() != 0) return {};
  // [rank, kind, element] -> per kind, the experts in rank order: the full tensor.
  const Tensor by_kind = gathered.transpose(0, 1).contiguous().view({3, ep.size() * numel});
  return {by_kind.select(0, 0), by_kind.select(0, 1), by_kind.select(0, 2)};
}

void ExpertAdamW::load(const train::SavedAdamWState& saved) {
  // The slice is experts [first, first + local) of the saved tensor: its flattened elements start
  // `first` experts in.
  const int64_t first = experts_.experts().first_expert(),
                local = experts_.experts().local_experts();
  shards_.load(saved,
               [&](const train::NamedParam& p) { return first * (p.value.numel() / local); });
}

}  // namespace glmtune::dist
