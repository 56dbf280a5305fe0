#include "glmtune/train/released.h"

#include <cmath>
#include <map>

#include "glmtune/base/error.h"
#include "glmtune/model/layout.h"

namespace glmtune::train {

std::vector<std::pair<std::string, Tensor>> released_views(const model::ParamStore& store,
                                                           const InternalLookup& lookup) {
  std::map<std::string, Tensor> by_name;
  for (const model::InternalParam& p : store.params()) {
    const Tensor* t = lookup(p);
    if (!t) continue;
    GLMTUNE_ASSERT(t->shape() == p.value.shape(), "tensor for '{}' is {}, the parameter {}", p.name,
                   shape_str(t->shape()), shape_str(p.value.shape()));
    if (p.sources.size() == 1 && p.sources[0] == p.name) {
      by_name.emplace(p.name, *t);
    } else if (p.name.ends_with("gate_up_proj")) {
      // [E, 2I, D], gate rows first; sources list every gate, then every up.
      const int64_t E = t->size(0), I = t->size(1) / 2;
      for (int64_t e = 0; e < E; ++e) {
        by_name.emplace(p.sources[size_t(e)], t->select(0, e).slice(0, 0, I));
        by_name.emplace(p.sources[size_t(E + e)], t->select(0, e).slice(0, I, 2 * I));
      }
    } else if (p.name.ends_with("down_proj")) {
      for (int64_t e = 0; e < t->size(0); ++e)
        by_name.emplace(p.sources[size_t(e)], t->select(0, e));
    } else {
      // q, k, v convolutions stacked along the channel dimension.
      const int64_t n = int64_t(p.sources.size()), rows = t->size(0) / n;
      for (int64_t i = 0; i < n; ++i)
        by_name.emplace(p.sources[size_t(i)], t->slice(0, i * rows, (i + 1) * rows));
    }
  }
  std::vector<std::pair<std::string, Tensor>> out;
  out.reserve(by_name.size());
  for (const model::ParamSpec& spec : model::released_layout(store.config())) {
    auto it = by_name.find(spec.name);
    if (it == by_name.end()) continue;
    GLMTUNE_ASSERT(it->second.shape() == spec.shape, "'{}' splits to {}, released as {}", spec.name,
                   shape_str(it->second.shape()), shape_str(spec.shape));
    out.emplace_back(spec.name, std::move(it->second));
  }
  // LoRA adapters (outside the released layout) follow, under their own names, in store order.
  for (const model::InternalParam& p : store.params())
    if (auto it = by_name.find(p.name); p.adapter && it != by_name.end())
      out.emplace_back(p.name, std::move(it->second));
  return out;
}

bool all_finite(const Tensor& t) {
  const Tensor f = t.to(Device::cpu()).to(DType::f32).contiguous();
  const float* v = f.data<float>();
  const int64_t n = f.numel();
  bool finite = true;
#pragma omp parallel for reduction(&& : finite) schedule(static) if (n >= (int64_t(1) << 16))
  for (int64_t i = 0; i < n; ++i) finite = finite && std::isfinite(v[i]);
  return finite;
}

std::vector<std::string> first_nonfinite(const std::vector<std::pair<std::string, Tensor>>& views,
                                         size_t limit) {
  std::vector<std::string> names;
  for (const auto& [name, t] : views) {
    if (names.size() >= limit) break;
    if (!all_finite(t)) names.push_back(name);
  }
  return names;
}

}  // namespace glmtune::train
