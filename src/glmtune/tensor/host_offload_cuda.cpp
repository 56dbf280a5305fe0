#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "glmtune/tensor/caching_allocator.h"
#include "glmtune/tensor/cuda_check.h"
#include "glmtune/tensor/host_offload.h"

namespace glmtune {
namespace {

// Spans copied start at this boundary, the alignment the device allocator gives every block, so
// a view keeps the alignment its kernels may assume.
constexpr size_t kSpanAlign = 512;
// Pinned blocks are rounded to pages.
constexpr size_t kPinnedRound = 4096;

class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    GLMTUNE_CUDA_CHECK(cudaGetDevice(&previous_));
    GLMTUNE_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceScope() { cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

class PinnedCache final : public CachingAllocator {
 public:
  explicit PinnedCache(cudaStream_t stream) : CachingAllocator(kPinnedRound), stream_(stream) {}

 private:
  void* system_alloc(size_t size) override {
    void* ptr = nullptr;
    if (cudaHostAlloc(&ptr, size, cudaHostAllocDefault) != cudaSuccess) {
      cudaGetLastError();
      throw Error(
          fmt::format("cannot pin {:.2f} GiB of host memory for activation offload ({:.2f} "
                      "GiB pinned already)",
                      double(size) / (1 << 30), double(stats_locked().reserved) / (1 << 30)),
          "train.offload",
          "offload fewer layers (train.offload, --offload) and recompute them instead "
          "(train.recompute), or free host memory");
    }
    return ptr;
  }

  void system_free(void* ptr) override { GLMTUNE_CUDA_CHECK(cudaFreeHost(ptr)); }

  // A cached block may still be the source or target of a copy queued on the side stream.
  void before_release() override { GLMTUNE_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

  cudaStream_t stream_;
};

class CudaTransfer final : public Transfer::State {
 public:
  CudaTransfer(int device, cudaEvent_t done, std::vector<std::shared_ptr<Storage>> sources)
      : device_(device), done_(done), sources_(std::move(sources)) {}
  ~CudaTransfer() override {
    if (!done_) return;
    // Unwinding: the order must still hold. A failure here means the CUDA context is lost, and
    // the next checked call reports it.
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    cudaStreamWaitEvent(nullptr, done_, 0);
    cudaEventDestroy(done_);
    cudaSetDevice(previous);
  }
  void finish() override {
    DeviceScope scope(device_);
    GLMTUNE_CUDA_CHECK(cudaStreamWaitEvent(nullptr, done_, 0));
    GLMTUNE_CUDA_CHECK(cudaEventDestroy(done_));
    done_ = nullptr;
    sources_.clear();
  }

 private:
  int device_;
  cudaEvent_t done_;
  std::vector<std::shared_ptr<Storage>> sources_;
};

// The views of one storage among the tensors of a batch, and the byte span they cover.
struct Span {
  std::shared_ptr<Storage> storage;
  size_t begin = 0, end = 0;
  std::vector<Tensor*> views;
};

size_t view_begin(const Tensor& t) { return size_t(t.storage_offset()) * t.element_size(); }
size_t view_end(const Tensor& t) {
  int64_t last = t.storage_offset();
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return size_t(last + 1) * t.element_size();
}

class CudaHostOffload final : public HostOffload {
 public:
  explicit CudaHostOffload(int device) : device_(device) {
    DeviceScope scope(device_);
    // Non-blocking: a stream created plainly would wait for the legacy default stream and let
    // nothing overlap.
    GLMTUNE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    pinned_ = std::make_unique<PinnedCache>(stream_);
  }

  Transfer to_host(const std::vector<Tensor*>& tensors) override {
    return copy_batch(tensors, Device::cpu(), cudaMemcpyDeviceToHost);
  }
  Transfer to_device(const std::vector<Tensor*>& tensors) override {
    return copy_batch(tensors, Device::cuda(device_), cudaMemcpyHostToDevice);
  }
  Allocator& pinned_memory() override { return *pinned_; }

 private:
  std::shared_ptr<Storage> host_storage(size_t bytes) {
    void* ptr = pinned_->allocate(bytes);
    PinnedCache* cache = pinned_.get();
    std::shared_ptr<const void> owner(
        ptr, [cache, bytes](const void* p) { cache->deallocate(const_cast<void*>(p), bytes); });
    return std::make_shared<Storage>(ptr, bytes, Device::cpu(), std::move(owner));
  }

  Transfer copy_batch(const std::vector<Tensor*>& tensors, Device to, cudaMemcpyKind kind) {
    const Device from = to.is_cpu() ? Device::cuda(device_) : Device::cpu();
    std::vector<Span> spans;
    std::unordered_map<const Storage*, size_t> span_of;
    for (Tensor* t : tensors) {
      if (!t->defined()) continue;
      if (t->device() != from)
        throw InternalError(
            fmt::format("offload copy of {} expected a tensor on {}", t->str(), from.str()));
      if (t->numel() == 0) {
        *t = Tensor::empty(t->shape(), t->dtype(), to);
        continue;
      }
      const auto [it, added] = span_of.try_emplace(t->storage().get(), spans.size());
      if (added) spans.push_back({t->storage(), view_begin(*t), view_end(*t), {}});
      Span& s = spans[it->second];
      s.begin = std::min(s.begin, view_begin(*t));
      s.end = std::max(s.end, view_end(*t));
      s.views.push_back(t);
    }

    DeviceScope scope(device_);
    // Fresh device blocks may have served compute queued before this call; host blocks come back
    // to the cache only after their copies on this stream. Waiting for the compute covers both
    // directions: to_host must also read what the compute has written.
    cudaEvent_t ready = nullptr, done = nullptr;
    GLMTUNE_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    GLMTUNE_CUDA_CHECK(cudaEventRecord(ready, nullptr));
    GLMTUNE_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready, 0));
    GLMTUNE_CUDA_CHECK(cudaEventDestroy(ready));

    std::vector<std::shared_ptr<Storage>> sources;
    for (Span& s : spans) {
      s.begin = s.begin / kSpanAlign * kSpanAlign;
      const size_t bytes = s.end - s.begin;
      std::shared_ptr<Storage> target =
          to.is_cpu() ? host_storage(bytes) : std::make_shared<Storage>(bytes, to);
      GLMTUNE_CUDA_CHECK(cudaMemcpyAsync(target->data(),
                                         static_cast<const char*>(s.storage->data()) + s.begin,
                                         bytes, kind, stream_));
      for (Tensor* t : s.views)
        *t = Tensor::from_storage(target, int64_t((view_begin(*t) - s.begin) / t->element_size()),
                                  t->shape(), t->strides(), t->dtype());
      sources.push_back(std::move(s.storage));
    }
    GLMTUNE_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    GLMTUNE_CUDA_CHECK(cudaEventRecord(done, stream_));
    return Transfer(std::make_unique<CudaTransfer>(device_, done, std::move(sources)));
  }

  int device_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<PinnedCache> pinned_;
};

}  // namespace

HostOffload& HostOffload::of(Device device) {
  if (!device.is_cuda())
    throw InternalError(fmt::format("activation offload asked for on {}", device.str()));
  static std::mutex mu;
  // Never destroyed: pinned tensors may outlive main.
  static auto* instances = new std::map<int, std::unique_ptr<CudaHostOffload>>();
  std::lock_guard lock(mu);
  const int count = cuda_device_count();
  if (device.index >= count)
    throw Error(fmt::format("CUDA device {} does not exist ({} visible)", device.index, count),
                "device",
                "pick a device index below the number of visible GPUs (CUDA_VISIBLE_DEVICES)");
  auto& slot = (*instances)[device.index];
  if (!slot) slot = std::make_unique<CudaHostOffload>(device.index);
  return *slot;
}

}  // namespace glmtune
