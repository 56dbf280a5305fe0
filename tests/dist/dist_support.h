#pragma once
// Helpers shared by the distributed step tests (tests/dist/test_dist_*.cpp): random packs, the
// summed loss terms of a step's packs, the number of label tokens, and the relative difference of
// two gradients.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "glmtune/model/loss.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/model.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::dist_test {

// The loss sums and expert loads of the packs one process ran.
struct Step {
  double lm = 0, balancing = 0;
  std::vector<double> mtp;
  std::map<std::string, std::vector<int64_t>> loads;
};

// A pack of random documents (the same on every rank for the same index): labels are the next
// token of the same document, the last token of each document ignored, some spans ignored.
inline model::text::PackInput random_pack(int64_t index, int64_t vocab) {
  std::mt19937_64 rng(1234 + 77 * uint64_t(index));
  const std::vector<int32_t> cu = {0, int32_t(9 + index % 5), 28, 40};
  const int64_t t = cu.back();
  std::vector<int32_t> ids(static_cast<size_t>(t));
  std::vector<int32_t> labels(static_cast<size_t>(t), model::kIgnoreLabel);
  for (auto& v : ids) v = int32_t(rng() % uint64_t(vocab));
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int32_t i = cu[d]; i + 1 < cu[d + 1]; ++i)
      if (rng() % 5 != 0) labels[size_t(i)] = ids[size_t(i) + 1];
  model::text::PackInput in;
  in.input_ids = Tensor::from_vector(ids, {t});
  in.cu_seqlens = Tensor::from_vector(cu, {int64_t(cu.size())});
  in.labels = Tensor::from_vector(labels, {t});
  return in;
}

// Labelled rows of an int32 label vector.
inline int64_t count_targets(const Tensor& labels) {
  const int32_t* l = labels.data<int32_t>();
  return std::count_if(l, l + labels.numel(), [](int32_t v) { return v != model::kIgnoreLabel; });
}

// Forward + backward of `packs` into `grads` with the step's global options.
inline Step run_packs(const model::text::TextModel& m,
                      const std::vector<model::text::PackInput>& packs,
                      const model::text::TrainOptions& topt, model::text::TextGrads& grads) {
  Step s;
  s.mtp.assign(size_t(topt.mtp_depths), 0.0);
  for (const model::text::PackInput& in : packs) {
    const auto r = model::text::forward_backward(m, in, topt, grads);
    s.lm += r.backward.lm_loss_sum;
    s.balancing += r.backward.balancing_loss;
    for (size_t k = 0; k < s.mtp.size(); ++k) s.mtp[k] += r.backward.mtp_loss_sum[k];
    for (const auto& l : r.loads) {
      auto& acc = s.loads[l.bias_name];
      acc.resize(size_t(l.counts.numel()), 0);
      for (int64_t e = 0; e < l.counts.numel(); ++e) acc[size_t(e)] += l.counts.data<int64_t>()[e];
    }
  }
  return s;
}

// max |got − want| / max |want|.
// How far an f32 gradient that adds the same per-token terms in another grouping (per shard, per
// rank, per slice) may be from the float64 gradient of the same step, given the largest error of
// the single-process f32 run against float64 (`reference_error`): 3× that, and at least the 1e-4
// that run itself is held to. The small per-head and per-stream parameters (mHC base and scale,
// dt_bias, A_log: a few elements, each a sum over every token whose terms cancel) keep few correct
// digits in f32 whatever the grouping, and by rounding luck one grouping lands several times
// further from float64 than another: measured 6.2e-5 for an mHC scale against a single-process
// largest error of 1.2e-5 on one CPU, within 3× on another. A wrong exchange is off by O(1).
inline double regrouped_f32_bar(double reference_error) {
  return std::max(3 * reference_error, 1e-4);
}

inline double rel_diff(const Tensor& got, const Tensor& want) {
  const std::vector<double> g = got.to_doubles(), w = want.to_doubles();
  double diff = 0, scale = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    diff = std::max(diff, std::abs(g[i] - w[i]));
    scale = std::max(scale, std::abs(w[i]));
  }
  return diff / std::max(scale, 1e-30);
}

}  // namespace glmtune::dist_test
