// Where the FP8 GEMMs' weight blocks come from (ops/fp8.h): pinned released codes, the open
// reuse scope's blocks, or a fresh quantisation; and the inputs several FP8 GEMMs share.

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/ops/fp8.h"

namespace glmtune::ops {
namespace {

// A weight view: its storage (weakly), where the view starts and how it is laid out.
struct ViewKey {
  const Storage* storage = nullptr;
  int64_t offset = 0;
  Shape shape, strides;
  DType dtype = DType::f32;

  auto operator<=>(const ViewKey&) const = default;
};

ViewKey key_of(const Tensor& w) {
  return ViewKey{w.storage().get(), w.storage_offset(), w.shape(), w.strides(), w.dtype()};
}

struct Entry {
  // The storage the key's pointer named when the entry was made: a storage freed and another
  // allocated at the same address must not find the old blocks.
  std::weak_ptr<Storage> storage;
  Fp8Blocks blocks;
};

struct Entries {
  std::map<ViewKey, Entry> map;
  size_t after_sweep = 0;  // entries left by the last sweep

  // The entries of freed weights go once there are as many again as live ones (a weight gathered
  // per use, as a frozen layer's, is a new storage each time: its blocks must not pile up).
  void insert(const ViewKey& key, Entry e) {
    if (map.size() >= 2 * after_sweep + 64) sweep();
    map.insert_or_assign(key, std::move(e));
  }
  void sweep() {
    std::erase_if(map, [](const auto& kv) { return kv.second.storage.expired(); });
    after_sweep = map.size();
  }
  const Fp8Blocks* find(const ViewKey& key, const Tensor& w) {
    auto it = map.find(key);
    if (it == map.end()) return nullptr;
    const std::shared_ptr<Storage> s = it->second.storage.lock();
    if (s && s == w.storage()) return &it->second.blocks;
    map.erase(it);
    return nullptr;
  }
};

struct Cache {
  std::mutex mu;
  Entries pinned, reused;
  int scopes = 0;
};

Cache& cache() {
  static Cache* c = new Cache;  // never destroyed: tensors may be released after static teardown
  return *c;
}

void check_weight(const Tensor& w, const char* op) {
  GLMTUNE_ASSERT(w.defined() && w.dim() == 2 && w.storage() != nullptr,
                 "{}: the weight must be a [out, in] tensor, got {}", op,
                 w.defined() ? w.str() : "undefined");
}

}  // namespace

Fp8WeightReuse::Fp8WeightReuse() {
  Cache& c = cache();
  std::lock_guard lock(c.mu);
  ++c.scopes;
}

Fp8WeightReuse::~Fp8WeightReuse() {
  Cache& c = cache();
  Entries dropped;
  {
    std::lock_guard lock(c.mu);
    if (--c.scopes == 0) std::swap(dropped, c.reused);
  }
  // `dropped` frees its blocks here, outside the lock.
}

void pin_fp8_weight(const Tensor& weight, Fp8Blocks blocks) {
  const char* op = "pin_fp8_weight";
  check_weight(weight, op);
  GLMTUNE_ASSERT(
      blocks.block_rows == 128 && blocks.block_cols == 128 && blocks.values.defined() &&
          blocks.values.shape() == weight.shape() && blocks.values.device() == weight.device() &&
          blocks.scales.device() == weight.device(),
      "{}: blocks of {} x {}, values {}, for weight {}", op, blocks.block_rows, blocks.block_cols,
      blocks.values.defined() ? blocks.values.str() : "undefined", weight.str());
  Cache& c = cache();
  std::lock_guard lock(c.mu);
  c.pinned.insert(key_of(weight), Entry{weight.storage(), std::move(blocks)});
}

Fp8Blocks fp8_weight_blocks(const Tensor& weight) {
  check_weight(weight, "fp8_weight_blocks");
  Cache& c = cache();
  const ViewKey key = key_of(weight);
  {
    std::lock_guard lock(c.mu);
    if (const Fp8Blocks* b = c.pinned.find(key, weight)) return *b;
    if (c.scopes > 0)
      if (const Fp8Blocks* b = c.reused.find(key, weight)) return *b;
  }
  Fp8Blocks made = quantize_fp8_weight(weight);
  std::lock_guard lock(c.mu);
  if (c.scopes > 0) c.reused.insert(key, Entry{weight.storage(), made});
  return made;
}

namespace {

// An open Fp8InputShare: its input (held, so the view cannot be freed and its address reused
// while the scope is open) and the tiles made so far.
struct SharedInput {
  Tensor x;
  std::optional<Fp8Blocks> rows, columns;  // 1 × 128, 128 × 1
};

// Per thread: a composite and the GEMMs it calls run on one thread.
thread_local std::vector<SharedInput> t_shared_inputs;

bool same_view(const Tensor& a, const Tensor& b) {
  return a.storage() == b.storage() && a.storage_offset() == b.storage_offset() &&
         a.shape() == b.shape() && a.strides() == b.strides() && a.dtype() == b.dtype();
}

}  // namespace

Fp8InputShare::Fp8InputShare(const Tensor& x) {
  GLMTUNE_ASSERT(x.defined() && x.dim() >= 1 && x.storage() != nullptr,
                 "Fp8InputShare: the input must be a tensor with storage, got {}",
                 x.defined() ? x.str() : "undefined");
  t_shared_inputs.push_back(SharedInput{x, std::nullopt, std::nullopt});
}

Fp8InputShare::~Fp8InputShare() { t_shared_inputs.pop_back(); }

Fp8Blocks fp8_input_tiles(const Tensor& x, int64_t block_rows, int64_t block_cols) {
  GLMTUNE_ASSERT((block_rows == 1 && block_cols == 128) || (block_rows == 128 && block_cols == 1),
                 "fp8_input_tiles: an input is quantised in 1 x 128 or 128 x 1 tiles, not {} x {}",
                 block_rows, block_cols);
  GLMTUNE_ASSERT(x.defined() && x.dim() >= 1,
                 "fp8_input_tiles: x must be a tensor [..., n], got {}",
                 x.defined() ? x.str() : "undefined");
  const auto make = [&] {
    return quantize_fp8_blocks(x.reshape({x.numel() / x.size(-1), x.size(-1)}), block_rows,
                               block_cols);
  };
  for (auto it = t_shared_inputs.rbegin(); it != t_shared_inputs.rend(); ++it) {
    if (!same_view(it->x, x)) continue;
    std::optional<Fp8Blocks>& slot = block_rows == 1 ? it->rows : it->columns;
    if (!slot) slot = make();
    return *slot;
  }
  return make();
}

Fp8WeightCounts fp8_weight_counts() {
  Cache& c = cache();
  std::lock_guard lock(c.mu);
  c.pinned.sweep();
  c.reused.sweep();
  return Fp8WeightCounts{int64_t(c.pinned.map.size()), int64_t(c.reused.map.size())};
}

}  // namespace glmtune::ops
