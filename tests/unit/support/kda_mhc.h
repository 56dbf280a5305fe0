#pragma once
// Inputs for the KDA and mHC tests: seeded parameters and delta-rule inputs of the released
// shapes, and the parameters stored in the fixtures of tools/golden/{ops,grads}_kda_mhc.py.

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "glmtune/io/safetensors.h"
#include "glmtune/ops/kda.h"
#include "glmtune/ops/norm.h"
#include "test_support.h"

namespace glmtune::test {

// The fields of two KdaParams side by side (ops::zip_kda_params), named as the fixtures store
// them: the released name under `self_attn.` without ".weight" ("q_proj", "conv1d", "A_log").
// Adapter fields are left out (test_lora covers them).
struct KdaField {
  std::string name;
  Tensor* a;
  Tensor* b;
};
inline std::vector<KdaField> kda_fields(ops::KdaParams& a, ops::KdaParams& b) {
  std::vector<KdaField> out;
  ops::zip_kda_params(a, b, [&](const std::string& name, Tensor& x, Tensor& y) {
    if (name.find(".lora_") != std::string::npos) return;
    const std::string n = name.ends_with(".weight") ? name.substr(0, name.size() - 7) : name;
    out.push_back({n, &x, &y});
  });
  return out;
}
inline std::vector<KdaField> kda_fields(ops::KdaParams& p) { return kda_fields(p, p); }

// The KDA parameters stored under `prefix` + name.
inline ops::KdaParams golden_kda_params(const io::SafetensorsFile& f, const std::string& prefix) {
  ops::KdaParams p;
  for (const KdaField& k : kda_fields(p)) *k.a = f.tensor(prefix + k.name);
  return p;
}

inline ops::KdaParams to_dtype(ops::KdaParams p, DType dt) {
  for (const KdaField& k : kda_fields(p)) *k.a = k.a->to(dt);
  return p;
}

// Seeded parameters of the released shapes, scaled for unit-size activations; decay mostly slow
// (dt_bias around −2.5) so that state crosses chunk boundaries with weight.
inline ops::KdaParams random_kda_params(int64_t d, int64_t nl, int64_t hl, int64_t kc, DType dt,
                                        uint64_t off) {
  const int64_t ql = nl * hl;
  const double sd = 1.0 / std::sqrt(double(d)), sh = 1.0 / std::sqrt(double(hl)),
               sq = 1.0 / std::sqrt(double(ql));
  ops::KdaParams p;
  p.q_proj.weight = random_normal({ql, d}, off + 1'000'000, dt, 0, sd);
  p.k_proj.weight = random_normal({ql, d}, off + 2'000'000, dt, 0, sd);
  p.v_proj.weight = random_normal({ql, d}, off + 3'000'000, dt, 0, sd);
  p.conv1d = random_normal({3 * ql, 1, kc}, off + 4'000'000, dt, 0, 0.6);
  p.f_a_proj.weight = random_normal({hl, d}, off + 5'000'000, dt, 0, sd);
  p.f_b_proj.weight = random_normal({ql, hl}, off + 6'000'000, dt, 0, sh);
  p.dt_bias = random_normal({ql}, off + 7'000'000, dt, -2.5, 1.0);
  p.A_log = random_uniform({nl}, off + 8'000'000, dt, -1.5, 1.0);
  p.b_proj.weight = random_normal({nl, d}, off + 9'000'000, dt, 0, sd);
  p.g_a_proj.weight = random_normal({hl, d}, off + 10'000'000, dt, 0, sd);
  p.g_b_proj.weight = random_normal({ql, hl}, off + 11'000'000, dt, 0, sh);
  p.o_norm = random_normal({hl}, off + 12'000'000, dt, 1.0, 0.4);
  p.o_proj.weight = random_normal({d, ql}, off + 13'000'000, dt, 0, sq);
  return p;
}

struct KdaCoreInputs {
  Tensor q, k, v, g, beta;
};

// Delta-rule inputs as the mixer produces them: unit q/k, log decay from the lower-bound gate.
inline KdaCoreInputs random_kda_core(int64_t t, int64_t nh, int64_t kd, int64_t vd, DType dt,
                                     uint64_t off) {
  KdaCoreInputs c;
  c.q = ops::l2_norm(random_normal({t, nh, kd}, off + 1'000'000, dt), 1e-6);
  c.k = ops::l2_norm(random_normal({t, nh, kd}, off + 2'000'000, dt), 1e-6);
  c.v = random_normal({t, nh, vd}, off + 3'000'000, dt);
  const Tensor graw = random_normal({t, nh * kd}, off + 4'000'000, dt, 0, 1.5);
  const Tensor dt_bias = random_normal({nh * kd}, off + 5'000'000, dt, -2.5, 1.0);
  const Tensor a_log = random_uniform({nh}, off + 6'000'000, dt, -1.5, 1.0);
  c.g = ops::kda_gate(graw, dt_bias, a_log, -5.0);
  c.beta = random_uniform({t, nh}, off + 7'000'000, dt, 0.05, 0.95);
  return c;
}

// The parameters of one mHC site (attention or FFN).
struct HcParams {
  Tensor fn, base, scale;
};

inline HcParams golden_hc_params(const io::SafetensorsFile& f, const std::string& prefix) {
  return {f.tensor(prefix + "fn"), f.tensor(prefix + "base"), f.tensor(prefix + "scale")};
}

}  // namespace glmtune::test
