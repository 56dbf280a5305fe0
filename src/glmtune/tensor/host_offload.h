#pragma once
// Tensors moved between a CUDA device and pinned host memory while the device computes. Every op
// runs on the device's default stream ("the compute"); these copies run on a side stream of their
// own, ordered against the compute by events, so that a copy overlaps the kernels queued after it
// and the host never waits:
//
//   HostOffload& h = HostOffload::of(device);
//   Transfer out = h.to_host(tensors);    // device -> host, once the compute queued so far is done
//   ...                                    // compute queued here runs during the copy
//   out.finish();                          // the device memory the copy read is free from here on
//   Transfer in = h.to_device(tensors);    // host -> device, into fresh device memory
//   ...                                    // compute queued here runs during the copy
//   in.finish();                           // compute queued from here on sees the data
//
// Both calls rewrite the given tensors in place into views of the same shape, strides and dtype
// over the new memory; views of one storage keep sharing one storage (only the span they cover is
// copied, starting at a 512-byte boundary so that every view keeps its alignment).
//
// Why the memory is safe to reuse without host waits: device blocks the copies read are handed
// back to the caching allocator only by finish(), after the compute stream was told to wait for
// the copy, so later compute that reuses them runs after it; fresh device blocks a copy writes
// may have been used by compute queued earlier, so the side stream first waits for that compute.
// Host memory comes from a cache of pinned blocks kept for the life of the process (pinning is
// slow); every copy of a device runs on its one side stream, so a block handed back to the cache
// is never written before the copy that used it is done.

#include <memory>
#include <vector>

#include "glmtune/tensor/allocator.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune {

// One batch of copies in flight. finish() (or destroying it) makes the compute queued from then
// on wait for the copies, and drops the memory they read.
class Transfer {
 public:
  class State {
   public:
    virtual ~State() = default;  // finishes when finish() was not called
    virtual void finish() = 0;
  };

  Transfer() = default;
  explicit Transfer(std::unique_ptr<State> state) : state_(std::move(state)) {}
  Transfer(Transfer&&) noexcept = default;
  Transfer& operator=(Transfer&&) noexcept = default;

  void finish() {
    if (const std::unique_ptr<State> s = std::move(state_)) s->finish();
  }
  bool pending() const { return state_ != nullptr; }

 private:
  std::unique_ptr<State> state_;
};

class HostOffload {
 public:
  // The instance of CUDA device `device`, made on first use and kept for the life of the process.
  // A glmtune::Error for a CPU device and in a build without CUDA.
  static HostOffload& of(Device device);

  virtual ~HostOffload() = default;
  // Device tensors (undefined ones are skipped) -> pinned host memory.
  virtual Transfer to_host(const std::vector<Tensor*>& tensors) = 0;
  // Host tensors (from to_host; undefined ones are skipped) -> fresh memory of this device.
  virtual Transfer to_device(const std::vector<Tensor*>& tensors) = 0;
  // The pinned host memory behind to_host: `allocated` is held by tensors, `reserved` is pinned
  // (cache included). For its statistics and release_cached(); blocks come from to_host alone.
  virtual Allocator& pinned_memory() = 0;
};

}  // namespace glmtune
