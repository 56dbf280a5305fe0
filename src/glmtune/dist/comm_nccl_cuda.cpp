#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/dist/comm_backend.h"
#include "glmtune/dist/comm_nccl.h"
#include "glmtune/tensor/cuda_check.h"
#if GLMTUNE_WITH_MPI
#include "glmtune/dist/comm_mpi.h"
#endif

namespace glmtune::dist {
namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void fail(const std::string& message) {
#if GLMTUNE_WITH_MPI
  mpi::abort_job(message, 3);
#else
  throw Error(message);
#endif
}

void check_nccl(ncclResult_t rc, const char* what) {
  if (rc == ncclSuccess || rc == ncclInProgress) return;
  throw Error(fmt::format("NCCL call {} failed: {}", what, ncclGetErrorString(rc)),
              "the distributed run", "check the other ranks' logs and NCCL_DEBUG=WARN output");
}

ncclDataType_t reduce_type(DType dt, const std::string& group) {
  switch (dt) {
    case DType::f32:
      return ncclFloat32;
    case DType::f64:
      return ncclFloat64;
    case DType::bf16:
      return ncclBfloat16;
    case DType::f16:
      return ncclFloat16;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    default:
      GLMTUNE_ASSERT(false, "reduction of {} on group '{}' (nccl)", dtype_name(dt), group);
  }
  return ncclFloat32;
}

// NCCL has no 16-bit integer type; a float16 is only copied, never computed with.
ncclDataType_t move_type(DType dt) {
  return backend::move_type(dt, ncclUint8, ncclFloat16, ncclUint32, ncclUint64);
}

ncclRedOp_t nccl_op(ReduceOp op) { return backend::reduce_op(op, ncclSum, ncclMax, ncclMin); }

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Communicator& bootstrap, int device, double timeout_s)
      : name_(bootstrap.name()), timeout_s_(timeout_s), device_(device) {
    rank_ = bootstrap.rank();
    size_ = bootstrap.size();
    Tensor id = Tensor::zeros({int64_t(sizeof(ncclUniqueId))}, DType::boolean);
    if (rank_ == 0) {
      ncclUniqueId u;
      check_nccl(ncclGetUniqueId(&u), "ncclGetUniqueId");
      std::memcpy(id.data_ptr(), &u, sizeof(u));
    }
    bootstrap.broadcast(id, 0);
    ncclUniqueId u;
    std::memcpy(&u, id.data_ptr(), sizeof(u));
    GLMTUNE_CUDA_CHECK(cudaSetDevice(device_));
    GLMTUNE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    GLMTUNE_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    GLMTUNE_CUDA_CHECK(cudaEventCreateWithFlags(&finished_, cudaEventDisableTiming));
    // Non-blocking initialisation, so that a rank that never joins is caught by the deadline.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    check_nccl(ncclCommInitRankConfig(&comm_, size_, u, rank_, &config), "ncclCommInitRankConfig");
    wait_comm("init");
  }
  ~NcclCommunicator() override {
    if (comm_) ncclCommDestroy(comm_);
    if (ready_) cudaEventDestroy(ready_);
    if (finished_) cudaEventDestroy(finished_);
    for (const Timed& t : timed_) {
      cudaEventDestroy(t.start);
      cudaEventDestroy(t.end);
    }
    if (stream_) cudaStreamDestroy(stream_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  const char* backend() const override { return "nccl"; }

  void all_reduce(Tensor& t, ReduceOp op) override {
    check(t, "all_reduce");
    begin();
    check_nccl(ncclAllReduce(t.data_ptr(), t.data_ptr(), size_t(t.numel()),
                             reduce_type(t.dtype(), name_), nccl_op(op), comm_, stream_),
               "ncclAllReduce");
    finish("all_reduce");
  }

  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override {
    enqueue_reduce_scatter(in, out, op);
    finish("reduce_scatter");
  }

  std::unique_ptr<PendingCollective> start_reduce_scatter(const Tensor& in, Tensor& out,
                                                          ReduceOp op) override {
    enqueue_reduce_scatter(in, out, op);
    return pending("reduce_scatter", in, out);
  }

  void all_gather(const Tensor& in, Tensor& out) override {
    enqueue_all_gather(in, out);
    finish("all_gather");
  }

  std::unique_ptr<PendingCollective> start_all_gather(const Tensor& in, Tensor& out) override {
    enqueue_all_gather(in, out);
    return pending("all_gather", in, out);
  }

  // Waits for a collective queued by start_* (its event recorded behind it on the stream),
  // against the deadline like the blocking ones.
  void wait_event(cudaEvent_t done, const char* op) {
    const auto end = deadline();
    for (int64_t polls = 0;; ++polls) {
      const cudaError_t q = cudaEventQuery(done);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) GLMTUNE_CUDA_CHECK(q);
      ncclResult_t state = ncclSuccess;
      check_nccl(ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError");
      check_nccl(state, op);
      if (Clock::now() > end) timed_out(op);
      pause(polls);
    }
  }

  void all_to_all(const Tensor& in, std::span<const int64_t> send_counts, Tensor& out,
                  std::span<const int64_t> recv_counts) override {
    check(in, "all_to_all");
    check(out, "all_to_all");
    backend::check_all_to_all(in, send_counts, out, recv_counts, name_, size_);
    const size_t es = in.element_size();
    const auto* src = static_cast<const char*>(in.data_ptr());
    auto* dst = static_cast<char*>(out.data_ptr());
    const ncclDataType_t type = move_type(in.dtype());
    begin();
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    int64_t soff = 0, roff = 0;
    for (int q = 0; q < size_; ++q) {
      const int64_t sc = send_counts[size_t(q)], rc = recv_counts[size_t(q)];
      if (sc > 0)
        check_nccl(ncclSend(src + size_t(soff) * es, size_t(sc), type, q, comm_, stream_),
                   "ncclSend");
      if (rc > 0)
        check_nccl(ncclRecv(dst + size_t(roff) * es, size_t(rc), type, q, comm_, stream_),
                   "ncclRecv");
      soff += sc;
      roff += rc;
    }
    GLMTUNE_ASSERT(soff <= in.numel() && roff <= out.numel(),
                   "all_to_all on group '{}': counts exceed the tensors", name_);
    check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    finish("all_to_all");
  }

  void broadcast(Tensor& t, int root) override {
    check(t, "broadcast");
    begin();
    check_nccl(ncclBroadcast(t.data_ptr(), t.data_ptr(), size_t(t.numel()), move_type(t.dtype()),
                             root, comm_, stream_),
               "ncclBroadcast");
    finish("broadcast");
  }

  void barrier() override {
    Tensor one = Tensor::zeros({1}, DType::f32, Device::cuda(device_));
    all_reduce(one, ReduceOp::sum);
  }

  double take_busy_seconds() override {
    collect_timing();
    const double seconds = busy_ms_ / 1e3;
    busy_ms_ = 0;
    return seconds;
  }

 private:
  void enqueue_reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) {
    check(in, "reduce_scatter");
    check(out, "reduce_scatter");
    backend::check_reduce_scatter(in, out, name_, size_);
    begin();
    check_nccl(ncclReduceScatter(in.data_ptr(), out.data_ptr(), size_t(out.numel()),
                                 reduce_type(in.dtype(), name_), nccl_op(op), comm_, stream_),
               "ncclReduceScatter");
  }

  void enqueue_all_gather(const Tensor& in, Tensor& out) {
    check(in, "all_gather");
    check(out, "all_gather");
    backend::check_all_gather(in, out, name_, size_);
    begin();
    check_nccl(ncclAllGather(in.data_ptr(), out.data_ptr(), size_t(in.numel()),
                             move_type(in.dtype()), comm_, stream_),
               "ncclAllGather");
  }

  std::unique_ptr<PendingCollective> pending(const char* op, const Tensor& in, const Tensor& out);

  void check(const Tensor& t, const char* op) const {
    GLMTUNE_ASSERT(t.defined() && t.is_contiguous() && t.device().is_cuda(),
                   "{} on group '{}' (nccl): tensors must be contiguous GPU tensors, got {}", op,
                   name_, t.defined() ? t.str() : std::string("an undefined tensor"));
  }

  // The collective reads what the default stream produced: order it after that work. Its busy
  // time starts there.
  void begin() {
    GLMTUNE_CUDA_CHECK(cudaSetDevice(device_));
    GLMTUNE_CUDA_CHECK(cudaEventRecord(ready_, cudaStreamLegacy));
    GLMTUNE_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
    Timed t;
    GLMTUNE_CUDA_CHECK(cudaEventCreate(&t.start));
    GLMTUNE_CUDA_CHECK(cudaEventCreate(&t.end));
    GLMTUNE_CUDA_CHECK(cudaEventRecord(t.start, stream_));
    timed_.push_back(t);
  }

  // Marks the end of the collective just enqueued (finish and pending call it).
  void end_timing() {
    GLMTUNE_CUDA_CHECK(cudaEventRecord(timed_.back().end, stream_));
    // A caller that never takes the busy time must not pile up events.
    if (timed_.size() > 1024) collect_timing();
  }

  // Adds the finished collectives' times to busy_ms_ and frees their events.
  void collect_timing() {
    std::vector<Timed> open;
    for (const Timed& t : timed_) {
      if (cudaEventQuery(t.end) != cudaSuccess) {
        open.push_back(t);
        continue;
      }
      // A collective whose enqueue failed never recorded its end: it counts nothing.
      float elapsed = 0;
      if (cudaEventElapsedTime(&elapsed, t.start, t.end) == cudaSuccess)
        busy_ms_ += elapsed;
      else
        cudaGetLastError();
      cudaEventDestroy(t.start);
      cudaEventDestroy(t.end);
    }
    timed_ = std::move(open);
  }

  Clock::time_point deadline() const { return backend::deadline_after(timeout_s_); }

  [[noreturn]] void timed_out(const char* op) {
    ncclCommAbort(comm_);
    comm_ = nullptr;
    fail(
        fmt::format("collective {} on group '{}' ({} ranks, rank {} here, nccl) did not complete "
                    "within {} s: another rank died, hangs, or called a different collective. "
                    "Aborting every rank (raise glmtune train --dist-timeout for slow steps)",
                    op, name_, size_, rank_, timeout_s_));
  }

  static void pause(int64_t polls) {
    backend::pause_between_polls(polls, std::chrono::microseconds(100));
  }

  void wait_comm(const char* op) {
    const auto end = deadline();
    for (int64_t polls = 0;; ++polls) {
      ncclResult_t state = ncclSuccess;
      check_nccl(ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError");
      if (state == ncclSuccess) return;
      check_nccl(state, op);
      if (Clock::now() > end) timed_out(op);
      pause(polls);
    }
  }

  void finish(const char* op) {
    wait_comm(op);  // a non-blocking communicator may still be enqueueing
    end_timing();
    GLMTUNE_CUDA_CHECK(cudaEventRecord(finished_, stream_));
    wait_event(finished_, op);
  }

  std::string name_;
  double timeout_s_;
  int device_ = 0;
  int rank_ = 0, size_ = 1;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  cudaEvent_t finished_ = nullptr;  // recorded behind a blocking collective, waited for
  // The collectives not yet counted by take_busy_seconds: events around each on the stream.
  struct Timed {
    cudaEvent_t start = nullptr, end = nullptr;
  };
  std::vector<Timed> timed_;
  double busy_ms_ = 0;  // of collectives collected but not yet taken
};

// A collective queued on the communicator's stream and not yet waited for: it keeps its tensors
// alive, and the event recorded behind it tells when it is done. An abandoned one is waited for
// first, so NCCL never writes into freed memory.
class NcclPending final : public PendingCollective {
 public:
  NcclPending(NcclCommunicator& comm, const char* op, Tensor in, Tensor out, cudaEvent_t done)
      : comm_(comm), op_(op), in_(std::move(in)), out_(std::move(out)), done_(done) {}
  ~NcclPending() override {
    wait();
    cudaEventDestroy(done_);
  }
  void wait() override {
    if (waited_) return;
    comm_.wait_event(done_, op_);
    waited_ = true;
  }

 private:
  NcclCommunicator& comm_;
  const char* op_;
  Tensor in_, out_;
  cudaEvent_t done_;
  bool waited_ = false;
};

std::unique_ptr<PendingCollective> NcclCommunicator::pending(const char* op, const Tensor& in,
                                                             const Tensor& out) {
  wait_comm(op);  // a non-blocking communicator may still be enqueueing
  end_timing();
  cudaEvent_t done = nullptr;
  GLMTUNE_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  GLMTUNE_CUDA_CHECK(cudaEventRecord(done, stream_));
  return std::make_unique<NcclPending>(*this, op, in, out, done);
}

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap, int device,
                                                     double timeout_s) {
  return std::make_unique<NcclCommunicator>(bootstrap, device, timeout_s);
}

}  // namespace glmtune::dist
