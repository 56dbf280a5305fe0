#include "glmtune/dist/comm_mpi.h"

#include <fmt/format.h>
#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/dist/comm_backend.h"

namespace glmtune::dist::mpi {
namespace {

using Clock = std::chrono::steady_clock;

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(fmt::format("MPI call {} failed: {}", what, std::string(text, size_t(len))),
              "the distributed run", "check the other ranks' logs and the launcher's output");
}

MPI_Datatype reduce_type(DType dt, const std::string& group) {
  switch (dt) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::f64:
      return MPI_DOUBLE;
    case DType::i32:
      return MPI_INT32_T;
    case DType::i64:
      return MPI_INT64_T;
    default:
      GLMTUNE_ASSERT(false, "reduction of {} on group '{}': only f32, f64, i32, i64 reduce",
                     dtype_name(dt), group);
  }
  return MPI_DATATYPE_NULL;
}

MPI_Datatype move_type(DType dt) {
  return backend::move_type(dt, MPI_UINT8_T, MPI_UINT16_T, MPI_UINT32_T, MPI_UINT64_T);
}

MPI_Op mpi_op(ReduceOp op) { return backend::reduce_op(op, MPI_SUM, MPI_MAX, MPI_MIN); }

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

// Non-blocking collective polled against the deadline: MPI_Test drives the progress, and a short
// sleep after the first spins keeps oversubscribed ranks from starving each other.
void wait_for(MPI_Request& req, const char* op, const std::string& group, int rank, int size,
              double timeout_s) {
  const auto deadline = backend::deadline_after(timeout_s);
  for (int64_t polls = 0;; ++polls) {
    int done = 0;
    check_mpi(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test");
    if (done) return;
    if (Clock::now() > deadline)
      abort_job(fmt::format("collective {} on group '{}' ({} ranks, rank {} here) did not "
                            "complete within {} s: another rank died, hangs, or called a "
                            "different collective. Aborting every rank; check the other ranks' "
                            "logs (raise glmtune train --dist-timeout for slow steps)",
                            op, group, size, rank, timeout_s),
                3);
    backend::pause_between_polls(polls, std::chrono::microseconds(200));
  }
}

// A started all-gather: holds its buffers until MPI is done with them.
class MpiPendingGather final : public PendingCollective {
 public:
  MpiPendingGather(MPI_Request req, Tensor in, Tensor out, std::string group, int rank, int size,
                   double timeout_s)
      : req_(req),
        in_(std::move(in)),
        out_(std::move(out)),
        group_(std::move(group)),
        rank_(rank),
        size_(size),
        timeout_s_(timeout_s) {}
  // MPI may still write into the buffers: an abandoned request is completed first.
  ~MpiPendingGather() override { wait(); }
  void wait() override {
    if (req_ == MPI_REQUEST_NULL) return;
    wait_for(req_, "all_gather", group_, rank_, size_, timeout_s_);
    req_ = MPI_REQUEST_NULL;
  }

 private:
  MPI_Request req_;
  Tensor in_, out_;
  std::string group_;
  int rank_, size_;
  double timeout_s_;
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::string name, double timeout_s)
      : comm_(comm), name_(std::move(name)), timeout_s_(timeout_s) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && comm_ != MPI_COMM_WORLD) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  const char* backend() const override { return "mpi"; }
  MPI_Comm comm() const { return comm_; }
  double timeout_s() const { return timeout_s_; }

  void all_reduce(Tensor& t, ReduceOp op) override {
    check(t, "all_reduce");
    MPI_Request req;
    check_mpi(MPI_Iallreduce(MPI_IN_PLACE, t.data_ptr(), count(t.numel(), "all_reduce"),
                             reduce_type(t.dtype(), name_), mpi_op(op), comm_, &req),
              "MPI_Iallreduce");
    wait(req, "all_reduce");
  }

  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override {
    check(in, "reduce_scatter");
    check(out, "reduce_scatter");
    backend::check_reduce_scatter(in, out, name_, size_);
    MPI_Request req;
    check_mpi(MPI_Ireduce_scatter_block(in.data_ptr(), out.data_ptr(),
                                        count(out.numel(), "reduce_scatter"),
                                        reduce_type(in.dtype(), name_), mpi_op(op), comm_, &req),
              "MPI_Ireduce_scatter_block");
    wait(req, "reduce_scatter");
  }

  void all_gather(const Tensor& in, Tensor& out) override { start_all_gather(in, out)->wait(); }

  std::unique_ptr<PendingCollective> start_all_gather(const Tensor& in, Tensor& out) override {
    check(in, "all_gather");
    check(out, "all_gather");
    backend::check_all_gather(in, out, name_, size_);
    const int n = count(in.numel(), "all_gather");
    MPI_Request req;
    check_mpi(MPI_Iallgather(in.data_ptr(), n, move_type(in.dtype()), out.data_ptr(), n,
                             move_type(in.dtype()), comm_, &req),
              "MPI_Iallgather");
    return std::make_unique<MpiPendingGather>(req, in, out, name_, rank_, size_, timeout_s_);
  }

  void all_to_all(const Tensor& in, std::span<const int64_t> send_counts, Tensor& out,
                  std::span<const int64_t> recv_counts) override {
    check(in, "all_to_all");
    check(out, "all_to_all");
    backend::check_all_to_all(in, send_counts, out, recv_counts, name_, size_);
    const size_t ranks = size_t(size_);
    std::vector<int> sc(ranks), sd(ranks), rc(ranks), rd(ranks);
    int64_t soff = 0, roff = 0;
    for (int q = 0; q < size_; ++q) {
      sc[size_t(q)] = count(send_counts[size_t(q)], "all_to_all");
      rc[size_t(q)] = count(recv_counts[size_t(q)], "all_to_all");
      sd[size_t(q)] = count(soff, "all_to_all");
      rd[size_t(q)] = count(roff, "all_to_all");
      soff += send_counts[size_t(q)];
      roff += recv_counts[size_t(q)];
    }
    GLMTUNE_ASSERT(soff <= in.numel() && roff <= out.numel(),
                   "all_to_all on group '{}': counts ({} sent, {} received) exceed {} / {}", name_,
                   soff, roff, in.str(), out.str());
    const MPI_Datatype type = move_type(in.dtype());
    MPI_Request req;
    check_mpi(MPI_Ialltoallv(in.data_ptr(), sc.data(), sd.data(), type, out.data_ptr(), rc.data(),
                             rd.data(), type, comm_, &req),
              "MPI_Ialltoallv");
    wait(req, "all_to_all");
  }

  void broadcast(Tensor& t, int root) override {
    check(t, "broadcast");
    MPI_Request req;
    check_mpi(MPI_Ibcast(t.data_ptr(), count(t.numel(), "broadcast"), move_type(t.dtype()), root,
                         comm_, &req),
              "MPI_Ibcast");
    wait(req, "broadcast");
  }

  void barrier() override {
    MPI_Request req;
    check_mpi(MPI_Ibarrier(comm_, &req), "MPI_Ibarrier");
    wait(req, "barrier");
  }

 private:
  void check(const Tensor& t, const char* op) const {
    GLMTUNE_ASSERT(t.defined() && t.is_contiguous() && t.device().is_cpu(),
                   "{} on group '{}' (mpi): tensors must be contiguous CPU tensors, got {}", op,
                   name_, t.defined() ? t.str() : std::string("an undefined tensor"));
  }

  void wait(MPI_Request& req, const char* op) const {
    wait_for(req, op, name_, rank_, size_, timeout_s_);
  }

  int count(int64_t n, const char* op) const {
    GLMTUNE_ASSERT(n >= 0 && n <= INT_MAX,
                   "{} on group '{}': {} elements exceed what one MPI call moves (2^31 - 1)", op,
                   name_, n);
    return int(n);
  }

  MPI_Comm comm_;
  std::string name_;
  double timeout_s_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

void init() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) return;
  int provided = 0;
  check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
  // Errors come back as return codes (turned into glmtune::Error) rather than aborting silently.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  std::atexit(finalize_at_exit);
}

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

std::unique_ptr<Communicator> world(double timeout_s) {
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, "world", timeout_s);
}

std::unique_ptr<Communicator> split(Communicator& parent, int color, int key, std::string name) {
  auto* p = dynamic_cast<MpiCommunicator*>(&parent);
  GLMTUNE_ASSERT(p != nullptr, "group '{}' must be split from an MPI communicator", name);
  MPI_Comm comm;
  check_mpi(MPI_Comm_split(p->comm(), color, key, &comm), "MPI_Comm_split");
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  return std::make_unique<MpiCommunicator>(comm, std::move(name), p->timeout_s());
}

NodeLocal node_local(Communicator& parent) {
  auto* p = dynamic_cast<MpiCommunicator*>(&parent);
  GLMTUNE_ASSERT(p != nullptr, "node_local needs an MPI communicator");
  MPI_Comm node;
  check_mpi(MPI_Comm_split_type(p->comm(), MPI_COMM_TYPE_SHARED, p->rank(), MPI_INFO_NULL, &node),
            "MPI_Comm_split_type");
  NodeLocal out;
  MPI_Comm_rank(node, &out.rank);
  MPI_Comm_size(node, &out.size);
  MPI_Comm_free(&node);
  return out;
}

void abort_job(const std::string& message, int code) {
  std::fprintf(stderr, "glmtune: rank %d: %s\n", world_rank(), message.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

}  // namespace glmtune::dist::mpi
