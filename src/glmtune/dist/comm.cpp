#include "glmtune/dist/comm.h"

#include <sched.h>

#include <cstring>
#include <thread>

#include "glmtune/base/error.h"
#include "glmtune/dist/comm_backend.h"

namespace glmtune::dist {

double Communicator::all_reduce_sum(double v) {
  Tensor t = Tensor::from_vector<double>({v}, {1});
  all_reduce(t, ReduceOp::sum);
  return t.data<double>()[0];
}

int64_t Communicator::all_reduce_sum(int64_t v) {
  Tensor t = Tensor::from_vector<int64_t>({v}, {1});
  all_reduce(t, ReduceOp::sum);
  return t.data<int64_t>()[0];
}

int64_t Communicator::all_reduce_max(int64_t v) {
  Tensor t = Tensor::from_vector<int64_t>({v}, {1});
  all_reduce(t, ReduceOp::max);
  return t.data<int64_t>()[0];
}

double Communicator::all_reduce_max(double v) {
  Tensor t = Tensor::from_vector<double>({v}, {1});
  all_reduce(t, ReduceOp::max);
  return t.data<double>()[0];
}

void Communicator::all_reduce_sum(std::vector<double>& v) {
  if (v.empty()) return;
  Tensor t = Tensor::from_vector(v, {int64_t(v.size())});
  all_reduce(t, ReduceOp::sum);
  std::memcpy(v.data(), t.data_ptr(), v.size() * sizeof(double));
}

void Communicator::all_reduce_sum(std::vector<int64_t>& v) {
  if (v.empty()) return;
  Tensor t = Tensor::from_vector(v, {int64_t(v.size())});
  all_reduce(t, ReduceOp::sum);
  std::memcpy(v.data(), t.data_ptr(), v.size() * sizeof(int64_t));
}

namespace {

// What start_all_gather returns when the exchange already happened.
class CompletedCollective final : public PendingCollective {
 public:
  void wait() override {}
};

}  // namespace

std::unique_ptr<PendingCollective> Communicator::start_all_gather(const Tensor& in, Tensor& out) {
  all_gather(in, out);
  return std::make_unique<CompletedCollective>();
}

std::unique_ptr<PendingCollective> Communicator::start_reduce_scatter(const Tensor& in, Tensor& out,
                                                                      ReduceOp op) {
  reduce_scatter(in, out, op);
  return std::make_unique<CompletedCollective>();
}

namespace {

class SelfCommunicator final : public Communicator {
 public:
  explicit SelfCommunicator(std::string name) : name_(std::move(name)) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const std::string& name() const override { return name_; }
  const char* backend() const override { return "self"; }

  void all_reduce(Tensor& t, ReduceOp) override { check(t, "all_reduce"); }
  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp) override {
    move(in, out, "reduce_scatter");
  }
  void all_gather(const Tensor& in, Tensor& out) override { move(in, out, "all_gather"); }
  void all_to_all(const Tensor& in, std::span<const int64_t> send_counts, Tensor& out,
                  std::span<const int64_t> recv_counts) override {
    GLMTUNE_ASSERT(send_counts.size() == 1 && recv_counts.size() == 1 &&
                       send_counts[0] == recv_counts[0] && send_counts[0] <= in.numel() &&
                       recv_counts[0] <= out.numel(),
                   "all_to_all on group '{}' of one rank: counts do not match", name_);
    check(in, "all_to_all");
    check(out, "all_to_all");
    if (send_counts[0] > 0 && in.data_ptr() != out.data_ptr()) {
      Tensor dst = out.flatten().narrow(0, 0, send_counts[0]);
      dst.copy_(in.flatten().narrow(0, 0, send_counts[0]));
    }
  }
  void broadcast(Tensor& t, int root) override {
    GLMTUNE_ASSERT(root == 0, "broadcast from rank {} on group '{}' of one rank", root, name_);
    check(t, "broadcast");
  }
  void barrier() override {}

 private:
  void check(const Tensor& t, const char* op) const {
    GLMTUNE_ASSERT(t.defined() && t.is_contiguous(), "{} on group '{}': tensor must be contiguous",
                   op, name_);
  }
  void move(const Tensor& in, Tensor& out, const char* op) {
    check(in, op);
    check(out, op);
    GLMTUNE_ASSERT(in.numel() == out.numel() && in.dtype() == out.dtype(),
                   "{} on group '{}' of one rank: {} into {}", op, name_, in.str(), out.str());
    if (in.data_ptr() == out.data_ptr()) return;
    Tensor dst = out.flatten();
    dst.copy_(in.flatten());
  }
  std::string name_;
};

}  // namespace

std::unique_ptr<Communicator> make_self_communicator(std::string name) {
  return std::make_unique<SelfCommunicator>(std::move(name));
}

namespace backend {

void check_reduce_scatter(const Tensor& in, const Tensor& out, const std::string& group,
                          int ranks) {
  GLMTUNE_ASSERT(in.dtype() == out.dtype() && in.numel() == out.numel() * ranks,
                 "reduce_scatter on group '{}': {} into {} over {} ranks", group, in.str(),
                 out.str(), ranks);
}

void check_all_gather(const Tensor& in, const Tensor& out, const std::string& group, int ranks) {
  GLMTUNE_ASSERT(in.dtype() == out.dtype() && out.numel() == in.numel() * ranks,
                 "all_gather on group '{}': {} into {} over {} ranks", group, in.str(), out.str(),
                 ranks);
}

void check_all_to_all(const Tensor& in, std::span<const int64_t> send_counts, const Tensor& out,
                      std::span<const int64_t> recv_counts, const std::string& group, int ranks) {
  GLMTUNE_ASSERT(in.dtype() == out.dtype() && int(send_counts.size()) == ranks &&
                     int(recv_counts.size()) == ranks,
                 "all_to_all on group '{}': {} counts for {} ranks", group, send_counts.size(),
                 ranks);
}

std::chrono::steady_clock::time_point deadline_after(double timeout_s) {
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(
             std::chrono::duration<double>(timeout_s));
}

void pause_between_polls(int64_t polls, std::chrono::microseconds nap) {
  if (polls < 1000)
    sched_yield();
  else
    std::this_thread::sleep_for(nap);
}

}  // namespace backend

}  // namespace glmtune::dist
