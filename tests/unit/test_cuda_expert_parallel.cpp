// Expert parallelism on the GPU (dist/expert_parallel.h, expert_parallel_cuda.cpp) on one GPU: a
// group of one rank, its rows exchanged through NCCL, holds every expert, so the whole GPU path
// runs (the permutation, the row gathers, the owner's top-1 grouped GEMMs, the combine, the
// backward's five exchanges and ops::moe_backward_routed_elsewhere) and must give what the
// one-GPU MoE block gives: the output, dx and every parameter gradient, bf16 and fp32 storage.
// The routed-experts-only backward (cuda::moe_experts_backward) is also checked against the CPU
// path of the same dispatch. Two and more ranks run on two GPUs in tests/gpu/dist_check.sh and on
// the CPU over MPI in tests/dist/. Skipped where no GPU is visible.

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>

#include "glmtune/dist/comm.h"
#include "glmtune/dist/expert_parallel.h"
#include "glmtune/ops/moe.h"
#include "glmtune/tensor/tensor.h"
#include "support/cuda_moe_data.h"
#include "support/cuda_test_support.h"
#ifdef GLMTUNE_WITH_CUDA
#include "glmtune/dist/comm_nccl.h"
#include "glmtune/ops/cuda/moe.h"
#endif

using namespace glmtune;
using namespace glmtune::test;

namespace {

#ifdef GLMTUNE_WITH_CUDA
// Parameters and input as test_cuda_ops_moe makes them (on the GPU and as f32 CPU copies), and
// a dy.
struct Data {
  ops::MoeParams gpu, cpu;
  Tensor x, dy;  // on the GPU, in the storage dtype
};

Data make_data(const MoeCase& c, uint64_t seed, DType storage) {
  MoeData m = make_moe_data(c, seed, storage);
  return {m.gpu, m.cpu, m.x.to(kGpu), random_cpu({c.tokens, c.dim}, storage, seed + 11).to(kGpu)};
}

// a + b in f32 on the host.
Tensor sum_f32(const Tensor& a, const Tensor& b) {
  Tensor out = f32(a).clone();
  const Tensor bf = f32(b);
  for (int64_t i = 0; i < out.numel(); ++i) out.data<float>()[i] += bf.data<float>()[i];
  return out;
}

// A one-rank ep group: MPI-free host group for the counts, NCCL for the rows.
struct OneRankGroup {
  std::unique_ptr<dist::Communicator> host = dist::make_self_communicator("ep");
  std::unique_ptr<dist::Communicator> device = dist::make_nccl_communicator(*host, 0, 60.0);
};
#endif

}  // namespace

// The dispatch's MoE (routing, experts through the exchange, shared expert added; backward through
// the exchange and ops::moe_backward_routed_elsewhere) against the one-GPU block on the same
// routing, and both against the CPU block in f32 on the same values.
TEST(CudaExpertParallel, OneRankGroupMatchesTheBlock) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  OneRankGroup group;
  uint64_t seed = 40;
  for (const DType storage : {DType::bf16, DType::f32}) {
    const double tol = storage == DType::f32 ? 1e-5 : 1e-2;
    for (const MoeCase& c : moe_cases()) {
      const std::string what = case_name(c) + " " + std::string(dtype_name(storage));
      const Data d = make_data(c, seed += 20, storage);
      const dist::ExpertParallel ep(*group.host, c.cfg.n_experts, "test", group.device.get());
      ASSERT_EQ(ep.local_experts(), c.cfg.n_experts);

      // The one-GPU block.
      ops::MoeContext block_ctx;
      const ops::MoeOutput block = ops::moe_forward(c.cfg, d.gpu, d.x, -1, block_ctx);
      ops::MoeParams block_grads;
      const Tensor block_dx = ops::moe_backward(c.cfg, d.gpu, block_ctx, d.dy, block_grads);

      // The dispatch on the block's routing.
      const ops::Routing& routing = block.routing;
      const Tensor routed_y = ep.forward(c.cfg, d.gpu, d.x, routing);
      EXPECT_EQ(routed_y.dtype(), storage) << what;
      const Tensor y = sum_f32(routed_y, ops::mlp_forward(d.gpu.shared, d.x, c.cfg.swiglu_limit));
      EXPECT_CLOSE(y, block.y, tol, "forward against the block " + what);

      ops::MoeParams grads;
      const model::text::ExpertDispatch::Backward routed =
          ep.backward(c.cfg, d.gpu, d.x, routing, d.dy, grads);
      EXPECT_EQ(routed.dx.dtype(), DType::f32) << what;
      EXPECT_EQ(routed.d_weights.dtype(), DType::f32) << what;
      const Tensor dx = ops::moe_backward_routed_elsewhere(c.cfg, d.gpu, d.x, routing, d.dy,
                                                           routed.dx, routed.d_weights, grads);
      EXPECT_EQ(dx.dtype(), storage) << what;
      EXPECT_CLOSE(dx, block_dx, tol, "dx against the block " + what);
      EXPECT_CLOSE(grads.router_weight, block_grads.router_weight, tol, "d router " + what);
      EXPECT_CLOSE(grads.gate_up_proj.weight, block_grads.gate_up_proj.weight, tol,
                   "d gate_up " + what);
      EXPECT_CLOSE(grads.down_proj.weight, block_grads.down_proj.weight, tol, "d down " + what);
      EXPECT_CLOSE(grads.shared.gate_proj.weight, block_grads.shared.gate_proj.weight, tol,
                   "d sh gate " + what);
      EXPECT_CLOSE(grads.shared.up_proj.weight, block_grads.shared.up_proj.weight, tol,
                   "d sh up " + what);
      EXPECT_CLOSE(grads.shared.down_proj.weight, block_grads.shared.down_proj.weight, tol,
                   "d sh down " + what);
      EXPECT_FALSE(grads.e_score_correction_bias.defined()) << what;

      // The CPU block on the same routing and values. In bf16 the backward's roundings (the
      // expert activations, dh through the clamped SwiGLU) put dx and the gate_up gradient up to
      // 1.04e-2 from the f32 CPU op at these scales over 17 seeds (H200, 2026-11-30), the routed
      // part alone (next test) up to 1.43e-2; the bar is 2e-2.
      const double cpu_tol = storage == DType::f32 ? 1e-5 : 2e-2;
      ops::MoeContext cctx;
      cctx.x = f32(d.x);
      cctx.routing = to_cpu(routing);
      ops::mlp_forward(d.cpu.shared, cctx.x, c.cfg.swiglu_limit, cctx.shared);
      const Tensor y_cpu = sum_f32(ops::moe_experts(c.cfg, d.cpu.gate_up_proj.weight,
                                                    d.cpu.down_proj.weight, cctx.x, cctx.routing),
                                   ops::mlp_forward(d.cpu.shared, cctx.x, c.cfg.swiglu_limit));
      EXPECT_CLOSE(y, y_cpu, cpu_tol, "forward against the CPU " + what);
      ops::MoeParams cgrads;
      const Tensor dx_cpu = ops::moe_backward(c.cfg, d.cpu, cctx, f32(d.dy), cgrads);
      EXPECT_CLOSE(dx, dx_cpu, cpu_tol, "dx against the CPU " + what);
      EXPECT_CLOSE(grads.gate_up_proj.weight, cgrads.gate_up_proj.weight, cpu_tol,
                   "d gate_up vs CPU " + what);
      EXPECT_CLOSE(grads.down_proj.weight, cgrads.down_proj.weight, cpu_tol,
                   "d down vs CPU " + what);
      EXPECT_CLOSE(grads.router_weight, cgrads.router_weight, cpu_tol, "d router vs CPU " + what);
    }
  }
#endif
}

// The routed experts' backward alone against the CPU path of the same dispatch (dx through the
// experts, the combine weights' gradient, the expert weight gradients), in bf16: within 2e-2 (as
// above).
TEST(CudaExpertParallel, ExpertsBackwardMatchesCpu) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  std::unique_ptr<dist::Communicator> self = dist::make_self_communicator("ep");
  uint64_t seed = 400;
  for (const MoeCase& c : moe_cases()) {
    const Data d = make_data(c, seed += 20, DType::bf16);
    const ops::Routing routing =
        ops::moe_route(c.cfg, d.gpu.router_weight, d.gpu.e_score_correction_bias, d.x);
    ops::MoeParams ggrads;
    const cuda::ExpertsBackward got = cuda::moe_experts_backward(
        c.cfg, d.gpu.gate_up_proj, d.gpu.down_proj, d.x, routing, d.dy, ggrads);
    const dist::ExpertParallel cpu_ep(*self, c.cfg.n_experts, "test");
    ops::MoeParams cgrads;
    const model::text::ExpertDispatch::Backward ref =
        cpu_ep.backward(c.cfg, d.cpu, f32(d.x), to_cpu(routing), f32(d.dy), cgrads);
    EXPECT_CLOSE(got.dx, ref.dx, 2e-2, "routed dx " + case_name(c));
    EXPECT_CLOSE(got.d_weights, ref.d_weights, 2e-2, "combine-weight gradient " + case_name(c));
    EXPECT_CLOSE(ggrads.gate_up_proj.weight, cgrads.gate_up_proj.weight, 2e-2,
                 "d gate_up " + case_name(c));
    EXPECT_CLOSE(ggrads.down_proj.weight, cgrads.down_proj.weight, 2e-2, "d down " + case_name(c));
    EXPECT_FALSE(ggrads.router_weight.defined()) << "the router got a gradient";
  }
#endif
}
