#include "glmtune/train/optimizer.h"

#include <fmt/format.h>

#include <cmath>
#include <set>

#include "glmtune/base/error.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/model/param_store.h"

namespace glmtune::train {
namespace {

// The gradient norm is summed per block of this many elements and the block sums are added in a
// fixed order: the result is the same whatever the thread count, which bit-exact resume needs.
constexpr int64_t kNormBlock = int64_t(1) << 15;
// Below this many elements the update runs on one thread (thread start-up would dominate).
constexpr int64_t kParallelMin = int64_t(1) << 14;

constexpr const char* kFormat = kOptimizerFormat;
constexpr const char* kStepName = kOptimizerStepName;

std::string master_name(const std::string& p) { return optimizer_state_name(0, p); }
std::string exp_avg_name(const std::string& p) { return optimizer_state_name(1, p); }
std::string exp_avg_sq_name(const std::string& p) { return optimizer_state_name(2, p); }

const std::string kResumeFix =
    "resume from a checkpoint written by this model's training run with the same train.freeze "
    "patterns, or start without resuming";

// A gradient as contiguous f32: the tensor itself when it already is, else a converted copy.
Tensor as_f32(const Tensor& g) {
  if (g.dtype() == DType::f32 && g.is_contiguous()) return g;
  return g.to(DType::f32).contiguous();
}

// Writes the master (f32) into a narrower storage, rounding to nearest-even.
void round_into(const float* master, const Tensor& storage) {
  const int64_t n = storage.numel();
  if (storage.dtype() == DType::bf16) {
    auto* out = static_cast<uint16_t*>(storage.data_ptr());
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (int64_t j = 0; j < n; ++j) out[j] = f32_to_bf16(master[j]);
  } else {
    auto* out = static_cast<uint16_t*>(storage.data_ptr());
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (int64_t j = 0; j < n; ++j) out[j] = f32_to_f16(master[j]);
  }
}

}  // namespace

std::string optimizer_state_name(int kind, const std::string& param) {
  GLMTUNE_ASSERT(kind >= 0 && kind < 3, "optimizer state kind {}", kind);
  static const char* const prefixes[] = {"optimizer/master/", "optimizer/exp_avg/",
                                         "optimizer/exp_avg_sq/"};
  return prefixes[kind] + param;
}

SavedAdamWState SavedAdamWState::open(const std::filesystem::path& dir) {
  const std::string where = dir.string();
  SavedAdamWState saved(io::CheckpointReader::open(dir));
  const io::CheckpointReader& reader = saved.reader_;
  for (const auto& file : reader.shard_files()) {
    const auto& meta = reader.shard(file).metadata();
    auto it = meta.find("format");
    if (it == meta.end() || it->second != kFormat)
      throw Error(fmt::format("'{}' is not an optimizer state (its format is '{}', expected '{}')",
                              file, it == meta.end() ? "" : it->second, kFormat),
                  where, kResumeFix);
  }
  if (!reader.contains(kStepName))
    throw Error(fmt::format("the optimizer state has no '{}'", kStepName), where, kResumeFix);
  const io::TensorInfo& step_info = reader.info(kStepName);
  if (step_info.dtype != DType::i64 || step_info.shape != Shape{1})
    throw Error(fmt::format("'{}' must be i64 [1]", kStepName), where, kResumeFix);
  saved.step_ = int64_t(reader.tensor(kStepName).item({0}));
  if (saved.step_ < 0)
    throw Error(fmt::format("negative step count {}", saved.step_), where, kResumeFix);
  return saved;
}

void SavedAdamWState::check(const std::vector<std::pair<std::string, Shape>>& trained) const {
  const std::string where = dir().string();
  std::set<std::string> expected = {kStepName};
  for (const auto& [name, shape] : trained)
    for (int kind = 0; kind < 3; ++kind) expected.insert(optimizer_state_name(kind, name));
  std::vector<std::string> missing, unexpected;
  for (const auto& n : expected)
    if (!reader_.contains(n)) missing.push_back(n);
  for (const auto& n : reader_.names())
    if (!expected.count(n)) unexpected.push_back(n);
  if (!missing.empty() || !unexpected.empty()) {
    auto head = [](const std::vector<std::string>& v) {
      std::string s;
      for (size_t i = 0; i < v.size() && i < 5; ++i) s += (i ? ", " : "") + v[i];
      if (v.size() > 5) s += fmt::format(" and {} more", v.size() - 5);
      return s;
    };
    std::string what = "the optimizer state does not match the model's trainable parameters:";
    if (!missing.empty()) what += fmt::format(" {} missing ({})", missing.size(), head(missing));
    if (!unexpected.empty())
      what += fmt::format("{} {} unexpected ({})", missing.empty() ? "" : ";", unexpected.size(),
                          head(unexpected));
    throw Error(what, where, kResumeFix);
  }
  for (const auto& [name, shape] : trained)
    for (int kind = 0; kind < 3; ++kind) {
      const std::string n = optimizer_state_name(kind, name);
      const io::TensorInfo& info = reader_.info(n);
      if (info.dtype != DType::f32 || info.shape != shape)
        throw Error(fmt::format("'{}' is {} {}, expected f32 {}", n, dtype_name(info.dtype),
                                shape_str(info.shape), shape_str(shape)),
                    where, kResumeFix);
    }
}

Tensor SavedAdamWState::range(int kind, const std::string& name, int64_t begin,
                              int64_t count) const {
  const std::string n = optimizer_state_name(kind, name);
  if (!reader_.contains(n))
    throw Error(fmt::format("the optimizer state has no '{}'", n), dir().string(), kResumeFix);
  const io::TensorInfo& info = reader_.info(n);
  if (info.dtype != DType::f32 || begin < 0 || count < 0 || begin + count > info.numel())
    throw Error(fmt::format("'{}' is {} {}; elements [{}, {}) of an f32 tensor were expected", n,
                            dtype_name(info.dtype), shape_str(info.shape), begin, begin + count),
                dir().string(), kResumeFix);
  return reader_.tensor(n).reshape({-1}).narrow(0, begin, count);
}

std::vector<NamedParam> named_params(const model::ParamStore& store) {
  std::vector<NamedParam> out;
  out.reserve(store.params().size());
  for (const auto& p : store.params()) out.push_back({p.name, p.value, p.trainable});
  return out;
}

void make_params_writable(model::ParamStore& store) {
  for (const auto& p : store.params()) {
    const bool written = p.trainable || p.name.ends_with("e_score_correction_bias");
    if (written && !p.value.storage()->owns_memory()) store.get(p.name) = p.value.clone();
  }
}

double clip_coefficient(double grad_norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  return std::min(1.0, max_norm / (grad_norm + 1e-6));
}

AdamW::AdamW(std::vector<NamedParam> params, AdamWConfig config)
    : params_(std::move(params)), config_(config) {
  GLMTUNE_ASSERT(
      config_.beta1 >= 0 && config_.beta1 < 1 && config_.beta2 >= 0 && config_.beta2 < 1 &&
          config_.eps > 0 && config_.weight_decay >= 0 && config_.max_grad_norm >= 0,
      "AdamW hyper-parameters out of range (betas {} {}, eps {}, wd {}, clip {})", config_.beta1,
      config_.beta2, config_.eps, config_.weight_decay, config_.max_grad_norm);
  std::set<std::string> names;
  state_.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const NamedParam& p = params_[i];
    GLMTUNE_ASSERT(names.insert(p.name).second, "parameter '{}' listed twice", p.name);
    if (!p.trainable) continue;
    const Tensor& v = p.value;
    GLMTUNE_ASSERT(v.defined() && v.device().is_cpu() && v.is_contiguous(),
                   "parameter '{}' must be a defined, contiguous CPU tensor", p.name);
    GLMTUNE_ASSERT(v.dtype() == DType::f32 || v.dtype() == DType::bf16 || v.dtype() == DType::f16,
                   "parameter '{}' is {}; the optimizer keeps f32, bf16 or f16 parameters", p.name,
                   dtype_name(v.dtype()));
    GLMTUNE_ASSERT(v.storage()->owns_memory(),
                   "parameter '{}' views memory owned elsewhere (a read-only checkpoint "
                   "mapping?); call make_params_writable first",
                   p.name);
    State& s = state_[i];
    s.master = v.dtype() == DType::f32 ? v : v.to(DType::f32).contiguous();
    s.exp_avg = Tensor::zeros(v.shape(), DType::f32);
    s.exp_avg_sq = Tensor::zeros(v.shape(), DType::f32);
  }
}

void AdamW::check_grads(const std::vector<Tensor>& grads) const {
  GLMTUNE_ASSERT(grads.size() == params_.size(), "{} gradients for {} parameters", grads.size(),
                 params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].trainable) continue;
    const Tensor& g = grads[i];
    GLMTUNE_ASSERT(g.defined(), "no gradient for trainable parameter '{}'", params_[i].name);
    GLMTUNE_ASSERT(g.shape() == params_[i].value.shape() && dtype_is_floating(g.dtype()) &&
                       g.device().is_cpu(),
                   "gradient of '{}' is {}, expected a floating CPU tensor of shape {}",
                   params_[i].name, g.str(), shape_str(params_[i].value.shape()));
  }
}

double AdamW::grad_sq_norm(const std::vector<Tensor>& grads) const {
  check_grads(grads);
  // Block sums in parameter order, then block order: a fixed summation tree. Parameters are
  // converted one at a time, so a bf16 gradient set is never copied whole.
  std::vector<double> partial;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].trainable) continue;
    const Tensor g32 = as_f32(grads[i]);
    const float* g = g32.data<float>();
    const int64_t n = g32.numel();
    const int64_t nb = (n + kNormBlock - 1) / kNormBlock;
    const size_t first = partial.size();
    partial.resize(first + size_t(nb), 0.0);
#pragma omp parallel for schedule(static) if (nb > 1)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t end = std::min(n, (b + 1) * kNormBlock);
      double s = 0.0;
      for (int64_t j = b * kNormBlock; j < end; ++j) s += double(g[j]) * g[j];
      partial[first + size_t(b)] = s;
    }
  }
  double total = 0.0;
  for (double s : partial) total += s;
  return total;
}

StepReport AdamW::step(const std::vector<Tensor>& grads, double lr) {
  return step(grads, lr, std::sqrt(grad_sq_norm(grads)));
}

StepReport AdamW::step(const std::vector<Tensor>& grads, double lr, double global_grad_norm) {
  check_grads(grads);
  GLMTUNE_ASSERT(std::isfinite(lr) && lr >= 0, "learning rate {} is not a finite number >= 0", lr);
  StepReport report;
  report.grad_norm = global_grad_norm;
  if (!std::isfinite(global_grad_norm)) {
    // One bad micro-pack must not poison the master weights or the moments: leave everything as
    // it was, including the bias-correction step count.
    report.skipped = true;
    report.step = step_;
    return report;
  }
  report.clip_coef = clip_coefficient(global_grad_norm, config_.max_grad_norm);
  ++step_;
  report.step = step_;

  const double bc1 = 1.0 - std::pow(config_.beta1, double(step_));
  const double bc2 = 1.0 - std::pow(config_.beta2, double(step_));
  const float clip = float(report.clip_coef);
  const float decay = float(1.0 - lr * config_.weight_decay);
  const float step_size = float(lr / bc1);
  const float bc2_sqrt = float(std::sqrt(bc2));
  const float b1c = float(1.0 - config_.beta1);
  const float b2 = float(config_.beta2), b2c = float(1.0 - config_.beta2);
  const float eps = float(config_.eps);

  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].trainable) continue;
    State& s = state_[i];
    const Tensor g32 = as_f32(grads[i]);
    const float* g = g32.data<float>();
    float* p = s.master.data<float>();
    float* m = s.exp_avg.data<float>();
    float* v = s.exp_avg_sq.data<float>();
    const int64_t n = s.master.numel();
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (int64_t j = 0; j < n; ++j) {
      const float gj = g[j] * clip;
      const float mj = m[j] + b1c * (gj - m[j]);
      const float vj = b2 * v[j] + b2c * (gj * gj);
      const float denom = std::sqrt(vj) / bc2_sqrt + eps;
      m[j] = mj;
      v[j] = vj;
      p[j] = p[j] * decay - step_size * (mj / denom);
    }
    if (params_[i].value.dtype() != DType::f32) round_into(p, params_[i].value);
  }
  return report;
}

void AdamW::set_state(size_t i, const Tensor& master, const Tensor& exp_avg,
                      const Tensor& exp_avg_sq) {
  GLMTUNE_ASSERT(i < params_.size() && params_[i].trainable, "no trainable parameter {}", i);
  State& s = state_[i];
  for (const Tensor* t : {&master, &exp_avg, &exp_avg_sq})
    GLMTUNE_ASSERT(t->dtype() == DType::f32 && t->numel() == s.master.numel(),
                   "state of '{}' must be f32 with {} elements, got {}", params_[i].name,
                   s.master.numel(), t->str());
  s.master.view({-1}).copy_(master.reshape({-1}));
  s.exp_avg.view({-1}).copy_(exp_avg.reshape({-1}));
  s.exp_avg_sq.view({-1}).copy_(exp_avg_sq.reshape({-1}));
  if (params_[i].value.dtype() != DType::f32) round_into(s.master.data<float>(), params_[i].value);
}

void AdamW::set_step_count(int64_t step) {
  GLMTUNE_ASSERT(step >= 0, "negative optimizer step count {}", step);
  step_ = step;
}

void AdamW::save(const std::filesystem::path& dir) const {
  io::CheckpointWriterOptions options;
  options.shard_metadata = {{"format", kFormat}};
  io::CheckpointWriter writer(dir, options);
  writer.add(kStepName, Tensor::from_vector<int64_t>({step_}, {1}));
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].trainable) continue;
    writer.add(master_name(params_[i].name), state_[i].master);
    writer.add(exp_avg_name(params_[i].name), state_[i].exp_avg);
    writer.add(exp_avg_sq_name(params_[i].name), state_[i].exp_avg_sq);
  }
  writer.finish();
}

void AdamW::load(const std::filesystem::path& dir) {
  const SavedAdamWState saved = SavedAdamWState::open(dir);
  std::vector<std::pair<std::string, Shape>> trained;
  for (const NamedParam& p : params_)
    if (p.trainable) trained.emplace_back(p.name, p.value.shape());
  // Validate everything before changing anything, so a bad directory leaves the state intact.
  saved.check(trained);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].trainable) continue;
    State& s = state_[i];
    const int64_t n = s.master.numel();
    s.master.view({-1}).copy_(saved.range(0, params_[i].name, 0, n));
    s.exp_avg.view({-1}).copy_(saved.range(1, params_[i].name, 0, n));
    s.exp_avg_sq.view({-1}).copy_(saved.range(2, params_[i].name, 0, n));
    if (params_[i].value.dtype() != DType::f32)
      round_into(s.master.data<float>(), params_[i].value);
  }
  step_ = saved.step_count();
}

int64_t AdamW::state_bytes() const {
  int64_t bytes = 0;
  std::set<const Storage*> seen;
  const auto count = [&](const Tensor& t) {
    if (t.defined() && seen.insert(t.storage().get()).second)
      bytes += int64_t(t.storage()->bytes());
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    count(params_[i].value);
    count(master(i));
    count(exp_avg(i));
    count(exp_avg_sq(i));
  }
  return bytes;
}

}  // namespace glmtune::train
