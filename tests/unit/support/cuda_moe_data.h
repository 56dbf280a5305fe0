#pragma once
// The MoE blocks the CUDA MoE tests run (test_cuda_ops_moe, test_cuda_expert_parallel): two
// configurations (group-limited routing with an odd token count, and GLM-like top-8) and random
// parameters in the GPU's storage dtype with f32 copies of the same values for the CPU reference.
// CUDA builds only.

#ifdef GLMTUNE_WITH_CUDA
#include <cmath>
#include <string>
#include <vector>

#include "cuda_test_support.h"
#include "glmtune/ops/moe.h"

namespace glmtune::test {

struct MoeCase {
  ops::MoeConfig cfg;
  int64_t tokens, dim, inter, shared_inter;
};

struct MoeData {
  ops::MoeParams cpu, gpu;
  Tensor x;  // CPU, in the GPU's storage dtype
};

// Parameters and input in `storage` (bf16, or f32 for the fp32 mode) on the GPU, f32 on the CPU.
inline MoeData make_moe_data(const MoeCase& c, uint64_t stream, DType storage = DType::bf16) {
  MoeData d;
  const int64_t e = c.cfg.n_experts;
  auto both = [&](Tensor& cpu, Tensor& gpu, const Shape& shape, double std) {
    const Tensor t = random_cpu(shape, storage, stream++, std);
    cpu = f32(t);
    gpu = t.to(kGpu);
  };
  // Router logits of a few units, so that the sigmoid spreads the scores.
  both(d.cpu.router_weight, d.gpu.router_weight, {e, c.dim}, 2.0 / std::sqrt(double(c.dim)));
  d.cpu.e_score_correction_bias = random_cpu({e}, DType::f32, stream++, 0.05);
  d.gpu.e_score_correction_bias = d.cpu.e_score_correction_bias.to(kGpu);
  both(d.cpu.gate_up_proj.weight, d.gpu.gate_up_proj.weight, {e, 2 * c.inter, c.dim},
       3.0 / std::sqrt(double(c.dim)));
  both(d.cpu.down_proj.weight, d.gpu.down_proj.weight, {e, c.dim, c.inter},
       1.0 / std::sqrt(double(c.inter)));
  both(d.cpu.shared.gate_proj.weight, d.gpu.shared.gate_proj.weight, {c.shared_inter, c.dim},
       3.0 / std::sqrt(double(c.dim)));
  both(d.cpu.shared.up_proj.weight, d.gpu.shared.up_proj.weight, {c.shared_inter, c.dim},
       3.0 / std::sqrt(double(c.dim)));
  both(d.cpu.shared.down_proj.weight, d.gpu.shared.down_proj.weight, {c.dim, c.shared_inter},
       1.0 / std::sqrt(double(c.shared_inter)));
  d.x = random_cpu({c.tokens, c.dim}, storage, stream++);
  return d;
}

// Small configurations: group-limited routing with odd token counts, and GLM-like top-8.
inline std::vector<MoeCase> moe_cases() {
  MoeCase grouped;
  grouped.cfg.n_experts = 16;
  grouped.cfg.top_k = 4;
  grouped.cfg.n_group = 4;
  grouped.cfg.topk_group = 2;
  grouped.tokens = 203;
  grouped.dim = 256;
  grouped.inter = 128;
  grouped.shared_inter = 96;
  MoeCase glm;
  glm.cfg.n_experts = 36;
  glm.cfg.top_k = 8;
  glm.tokens = 301;
  glm.dim = 512;
  glm.inter = 256;
  glm.shared_inter = 256;
  return {grouped, glm};
}

inline std::string case_name(const MoeCase& c) {
  return "E" + std::to_string(c.cfg.n_experts) + " K" + std::to_string(c.cfg.top_k) + " G" +
         std::to_string(c.cfg.n_group) + "/" + std::to_string(c.cfg.topk_group) + " T" +
         std::to_string(c.tokens);
}

inline ops::Routing to_cpu(const ops::Routing& r) {
  ops::Routing c;
  c.logits = r.logits.to(Device::cpu());
  c.weights = r.weights.to(Device::cpu());
  c.indices = r.indices.to(Device::cpu());
  return c;
}

}  // namespace glmtune::test
#endif
