// The communicators and the process groups under mpirun: every collective of the interface on
// every group of every layout the world size allows, against values computed locally.
#include <gtest/gtest.h>

#include <numeric>
#include <set>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/dist/comm.h"
#include "glmtune/dist/parallel.h"
#include "mpi_main.h"

namespace glmtune::dist {
namespace {

// Value held by world rank r at element i: distinct per rank and element, exact in f32.
double value(int r, int64_t i) { return 1000.0 * (r + 1) + double(i) * 0.5; }

// World ranks of the members of `group`, in group-rank order.
std::vector<int64_t> members(Communicator& group, int world_rank) {
  Tensor in = Tensor::from_vector<int64_t>({world_rank}, {1});
  Tensor out = Tensor::empty({group.size()}, DType::i64);
  group.all_gather(in, out);
  const int64_t* p = out.data<int64_t>();
  return {p, p + group.size()};
}

void check_collectives(Communicator& g, const std::vector<int64_t>& world_ranks) {
  const int n = g.size(), me = g.rank();
  SCOPED_TRACE("group " + g.name() + " rank " + std::to_string(me));
  // all_reduce sum and max, f32 and i64.
  const int64_t len = 5;
  Tensor t = Tensor::empty({len}, DType::f32);
  for (int64_t i = 0; i < len; ++i) t.data<float>()[i] = float(value(int(world_ranks[me]), i));
  g.all_reduce(t, ReduceOp::sum);
  for (int64_t i = 0; i < len; ++i) {
    double want = 0;
    for (int q = 0; q < n; ++q) want += value(int(world_ranks[q]), i);
    EXPECT_EQ(t.data<float>()[i], float(want)) << i;
  }
  EXPECT_EQ(g.all_reduce_max(int64_t(world_ranks[me])),
            *std::max_element(world_ranks.begin(), world_ranks.end()));
  // reduce_scatter: block r of the sum.
  Tensor in = Tensor::empty({3 * n}, DType::f64);
  for (int64_t i = 0; i < 3 * n; ++i) in.data<double>()[i] = value(int(world_ranks[me]), i);
  Tensor out = Tensor::empty({3}, DType::f64);
  g.reduce_scatter(in, out);
  for (int64_t i = 0; i < 3; ++i) {
    double want = 0;
    for (int q = 0; q < n; ++q) want += value(int(world_ranks[q]), 3 * me + i);
    EXPECT_EQ(out.data<double>()[i], want);
  }
  // all_to_all with variable counts: rank a sends (a + b + 1) elements to rank b, valued
  // 8·a + b + j/2 (exact in bf16), in bf16 to exercise a non-reducible dtype.
  std::vector<int64_t> sc(static_cast<size_t>(n)), rc(static_cast<size_t>(n));
  std::vector<float> send;
  for (int b = 0; b < n; ++b) {
    sc[size_t(b)] = me + b + 1;
    rc[size_t(b)] = b + me + 1;
    for (int64_t j = 0; j < sc[size_t(b)]; ++j) send.push_back(float(8 * me + b) + 0.5f * float(j));
  }
  const int64_t nrecv = std::accumulate(rc.begin(), rc.end(), int64_t(0));
  Tensor s = Tensor::from_vector(send, {int64_t(send.size())}).to(DType::bf16);
  Tensor r = Tensor::zeros({nrecv + 2}, DType::bf16);
  g.all_to_all(s, sc, r, rc);
  const Tensor r32 = r.to(DType::f32);
  int64_t k = 0;
  for (int a = 0; a < n; ++a)
    for (int64_t j = 0; j < rc[size_t(a)]; ++j, ++k)
      EXPECT_EQ(r32.data<float>()[k], float(8 * a + me) + 0.5f * float(j)) << "from " << a;
  // broadcast from the last rank.
  Tensor b = Tensor::from_vector<int32_t>({me, 7 * me}, {2});
  g.broadcast(b, n - 1);
  EXPECT_EQ(b.data<int32_t>()[0], n - 1);
  EXPECT_EQ(b.data<int32_t>()[1], 7 * (n - 1));
  g.barrier();
}

TEST(DistComm, EveryCollectiveOnEveryGroupOfEveryLayout) {
  const int world = testing::world_context()->sizes().world;
  ASSERT_GT(world, 1) << "run under mpirun with 2 or 4 ranks";
  for (int sp = 1; sp <= world; sp *= 2)
    for (int ep = 1; sp * ep <= world; ep *= 2) {
      if (world % (sp * ep) != 0) continue;
      SCOPED_TRACE("ep " + std::to_string(ep) + " sp " + std::to_string(sp));
      ParallelOptions o;
      o.ep_size = ep;
      o.sp_size = sp;
      o.timeout_s = 60;
      const auto par = ParallelContext::create(o);
      const int me = par->rank();
      const int d = me / sp, s = me % sp, f = d / ep, e = d % ep;
      // Group membership follows parallel.h's layout.
      std::vector<int64_t> want_sp, want_dp, want_ep, want_edp;
      for (int q = 0; q < world; ++q) {
        const int qd = q / sp, qs = q % sp;
        if (qd == d) want_sp.push_back(q);
        if (qs == s) want_dp.push_back(q);
        if (qs == s && qd / ep == f) want_ep.push_back(q);
        if (qs == s && qd % ep == e) want_edp.push_back(q);
      }
      EXPECT_EQ(members(par->sp(), me), want_sp);
      EXPECT_EQ(members(par->dp(), me), want_dp);
      EXPECT_EQ(members(par->ep(), me), want_ep);
      EXPECT_EQ(members(par->edp(), me), want_edp);
      EXPECT_EQ(par->sizes().dp, world / sp);
      for (Communicator* g : {&par->world(), &par->dp(), &par->ep(), &par->sp(), &par->edp()})
        check_collectives(*g, members(*g, me));
    }
}

TEST(DistComm, LayoutsThatDoNotDivideAreRefusedWithTheKeysNamed) {
  EXPECT_NO_THROW(parallel_sizes(4, 2, 2, "recipe"));
  try {
    parallel_sizes(4, 1, 3, "r.toml: train.sp_size");
    FAIL() << "sp_size 3 of 4 ranks was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sequence-parallel groups of 3"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("train.sp_size"), std::string::npos);
  }
  try {
    parallel_sizes(6, 4, 1, "r.toml: train.ep_size");
    FAIL() << "ep_size 4 of 6 ranks was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expert-parallel groups of 4"), std::string::npos);
  }
  EXPECT_THROW(parallel_sizes(2, 0, 1, "r"), Error);
}

TEST(DistComm, SingleRankGroupsMoveDataLocally) {
  const auto self = make_self_communicator("solo");
  Tensor in = Tensor::from_vector<float>({1, 2, 3}, {3});
  Tensor out = Tensor::zeros({3}, DType::f32);
  self->all_gather(in, out);
  EXPECT_EQ(out.to_doubles(), (std::vector<double>{1, 2, 3}));
  Tensor a2a = Tensor::zeros({4}, DType::f32);
  const std::vector<int64_t> counts = {2};
  self->all_to_all(in, counts, a2a, counts);
  EXPECT_EQ(a2a.to_doubles(), (std::vector<double>{1, 2, 0, 0}));
  EXPECT_EQ(self->all_reduce_sum(2.5), 2.5);
}

}  // namespace
}  // namespace glmtune::dist

int main(int argc, char** argv) { return glmtune::dist::testing::run_all_tests(argc, argv); }
