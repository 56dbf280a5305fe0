// Where the FP8 GEMMs' weight blocks come from (ops/fp8.h): pinned released codes, the open
// reuse scope's blocks, or a fresh quantisation.

#include <map>
#include <memory>
#include <mutex>

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

Fp8WeightCounts fp8_weight_counts() {
  Cache& c = cache();
  std::lock_guard lock(c.mu);
  c.pinned.sweep();
  c.reused.sweep();
  return Fp8WeightCounts{int64_t(c.pinned.map.size()), int64_t(c.reused.map.size())};
}

}  // namespace glmtune::ops
