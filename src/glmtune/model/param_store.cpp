#include "glmtune/model/param_store.h"

#include <fmt/format.h>

#include <regex>
#include <set>

#include "glmtune/base/error.h"
#include "glmtune/io/fp8.h"

namespace glmtune::model {
namespace {

const std::regex kExpertRe(R"(^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$)");
const std::regex kConvRe(R"(^(.*\.self_attn\.)(q|k|v)_conv1d\.weight$)");

bool is_scale_companion(const std::string& name) { return name.ends_with(".weight_scale_inv"); }

std::string base_of_companion(const std::string& name) {
  return name.substr(0, name.size() - std::string(".weight_scale_inv").size()) + ".weight";
}

Shape block_scale_shape(const Shape& weight) { return io::fp8_scale_shape(weight); }

}  // namespace

std::string CheckpointReport::describe(size_t limit) const {
  std::string out;
  auto list = [&](const char* title, const std::vector<std::string>& names) {
    if (names.empty()) return;
    out += fmt::format("{} {}:\n", names.size(), title);
    for (size_t i = 0; i < names.size() && i < limit; ++i) out += "  " + names[i] + "\n";
    if (names.size() > limit) out += fmt::format("  ... and {} more\n", names.size() - limit);
  };
  list("missing tensors", missing);
  list("unexpected tensors", unexpected);
  if (!misshaped.empty()) {
    out += fmt::format("{} tensors with the wrong shape:\n", misshaped.size());
    for (size_t i = 0; i < misshaped.size() && i < limit; ++i)
      out += fmt::format("  {}: expected {}, found {}\n", misshaped[i].name,
                         shape_str(misshaped[i].expected), shape_str(misshaped[i].found));
    if (misshaped.size() > limit)
      out += fmt::format("  ... and {} more\n", misshaped.size() - limit);
  }
  return out;
}

bool is_fused_expert_tensor(const std::string& name) {
  return name.ends_with(".mlp.experts.gate_up_proj") || name.ends_with(".mlp.experts.down_proj");
}

bool is_expert_adapter(const std::string& name) {
  for (const char* suffix : {".lora_A.weight", ".lora_B.weight"})
    if (name.ends_with(suffix))
      return is_fused_expert_tensor(name.substr(0, name.size() - std::string(suffix).size()));
  return false;
}

bool is_expert_sliced(const std::string& name) {
  return is_fused_expert_tensor(name) || is_expert_adapter(name);
}

CheckpointReport check_checkpoint(const io::CheckpointReader& reader, const ModelConfig& config) {
  CheckpointReport report;
  const auto layout = released_layout(config);
  std::map<std::string, const ParamSpec*> expected;
  for (const auto& p : layout) expected[p.name] = &p;
  std::set<std::string> seen;
  for (const auto& name : reader.names()) {
    const io::TensorInfo& info = reader.info(name);
    report.tensors++;
    report.bytes += int64_t(info.nbytes());
    report.dtype_tensors[std::string(dtype_name(info.dtype))]++;
    report.dtype_bytes[std::string(dtype_name(info.dtype))] += int64_t(info.nbytes());
    if (is_scale_companion(name)) {
      const std::string base = base_of_companion(name);
      if (!reader.contains(base) || reader.info(base).dtype != DType::fp8e4m3) {
        report.unexpected.push_back(name);
      } else if (info.shape != block_scale_shape(reader.info(base).shape)) {
        report.misshaped.push_back({name, block_scale_shape(reader.info(base).shape), info.shape});
      }
      continue;
    }
    auto it = expected.find(name);
    if (it == expected.end()) {
      report.unexpected.push_back(name);
      continue;
    }
    seen.insert(name);
    if (info.shape != it->second->shape)
      report.misshaped.push_back({name, it->second->shape, info.shape});
    if (info.dtype == DType::f32 && it->second->dtype == DType::bf16)
      report.f32_not_bf16.push_back(name);
    if (info.dtype == DType::fp8e4m3) {
      if (info.shape.size() != 2 || !reader.contains(io::fp8_scale_name(name)))
        report.missing.push_back(io::fp8_scale_name(name));
      else
        report.fp8_weights.push_back(name);
    }
  }
  for (const auto& p : layout)
    if (!seen.count(p.name)) report.missing.push_back(p.name);
  return report;
}

namespace {

// Reads one released tensor as stored (zero-copy view of the mapping), or dequantised to bf16
// when it is an FP8 weight with a block-scale companion.
Tensor read_released(const io::CheckpointReader& reader, const std::string& name) {
  Tensor t = reader.tensor(name);
  if (t.dtype() != DType::fp8e4m3) return t;
  return io::dequantize_fp8_block(t, reader.tensor(io::fp8_scale_name(name)), io::kFp8BlockSize,
                                  io::kFp8BlockSize, name);
}

// Elements [begin, begin + count) of released tensor `name`, flattened: a view of the mapping, or
// for an FP8 weight only the 128-row blocks holding them dequantised (a rank reading its slice of
// every tensor would otherwise dequantise every whole tensor).
Tensor read_released_range(const io::CheckpointReader& reader, const std::string& name,
                           int64_t begin, int64_t count) {
  Tensor t = reader.tensor(name);
  if (t.dtype() != DType::fp8e4m3) return t.reshape({-1}).narrow(0, begin, count);
  constexpr int64_t kBlock = io::kFp8BlockSize;
  const int64_t rows = t.size(0), cols = t.size(1);
  const int64_t r0 = begin / cols / kBlock * kBlock;
  const int64_t r1 = std::min(rows, (begin + count + cols - 1) / cols);
  const Tensor scale = reader.tensor(io::fp8_scale_name(name));
  const Tensor block = io::dequantize_fp8_block(
      t.narrow(0, r0, r1 - r0), scale.narrow(0, r0 / kBlock, (r1 - r0 + kBlock - 1) / kBlock),
      kBlock, kBlock, name);
  return block.reshape({-1}).narrow(0, begin - r0 * cols, count);
}

}  // namespace

ParamStore ParamStore::load(const io::CheckpointReader& reader, const ModelConfig& config,
                            std::optional<ExpertRange> experts,
                            const std::function<bool(const std::string& name)>& defer) {
  if (experts) {
    const int64_t n = config.text().n_routed_experts;
    const auto [first, count] = *experts;
    if (count <= 0 || first < 0 || first + count > n || n % count != 0 || first % count != 0)
      throw Error(fmt::format("experts [{}, {}) are not one of the equal slices of the {} routed "
                              "experts of this model",
                              first, first + count, n),
                  reader.dir().string() + ": expert range of the load",
                  fmt::format("load the slice of one expert-parallel rank: count = {} / ep_size "
                              "for an ep_size dividing {}, first = rank · count",
                              n, n));
  }
  CheckpointReport report = check_checkpoint(reader, config);
  const auto layout = released_layout(config);
  if (report.missing.size() == layout.size())
    throw Error(
        fmt::format("no GLM-5.3-Flash tensor found among the checkpoint's {} tensors (e.g. '{}')",
                    report.tensors,
                    reader.names().empty() ? std::string("<none>") : reader.names().front()),
        reader.dir().string(),
        "point glmtune at a GLM-5.3-Flash checkpoint in the released layout "
        "(model.language_model.*, "
        "lm_head.weight, model.visual.*)");
  if (!report.ok())
    throw Error("the checkpoint does not match its config:\n" + report.describe(),
                reader.dir().string(),
                "use the config.json that came with these weights, or re-create the checkpoint "
                "(glmtune init / crop)");

  ParamStore store;
  store.config_ = config;
  store.expert_range_ = experts;
  struct Fused {
    std::vector<std::string> gate, up, down;  // per-expert names, expert order
    std::vector<std::string> conv;            // q, k, v
    bool trainable = true;
  };
  std::map<std::string, Fused> fused_experts, convs;
  const auto deferred = [&](const std::string& name) { return defer && defer(name); };
  // One element of the storage dtype in memory of its own: the placeholder of a deferred tensor.
  const auto placeholder = [](DType dtype) { return Tensor::zeros({1}, dtype); };
  std::smatch m;
  for (const auto& spec : layout) {
    if (std::regex_match(spec.name, m, kExpertRe)) {
      Fused& f = fused_experts[m[1].str()];
      const size_t e = std::stoul(m[2].str());
      auto& list = m[3] == "gate_proj" ? f.gate : m[3] == "up_proj" ? f.up : f.down;
      if (list.size() <= e) list.resize(e + 1);
      list[e] = spec.name;
      continue;
    }
    if (std::regex_match(spec.name, m, kConvRe)) {
      convs[m[1].str()].conv.push_back(spec.name);
      continue;
    }
    const io::TensorInfo& info = reader.info(spec.name);
    if (deferred(spec.name)) {
      const DType dtype = info.dtype == DType::fp8e4m3 ? DType::bf16 : info.dtype;
      store.params_.push_back(
          {spec.name, placeholder(dtype), spec.trainable, {spec.name}, info.shape, true});
      continue;
    }
    store.params_.push_back(
        {spec.name, read_released(reader, spec.name), spec.trainable, {spec.name}, info.shape});
  }
  // Experts: [E, 2Im, D] with gate rows first, and [E, D, Im], E the experts loaded. The released
  // tensors are views of the checkpoint mapping, so an expert outside the range is never read.
  // The fused tensors are bf16, the released dtype, unless the file holds an expert in f32: then
  // f32, so that they keep the file's values as every unfused tensor does (bf16 and FP8-dequantised
  // values are exact in f32; rounding them to bf16 would silently change the model).
  const auto fused_dtype = [&](const std::vector<std::string>& names) {
    for (const std::string& n : names)
      if (reader.info(n).dtype == DType::f32) return DType::f32;
    return DType::bf16;
  };
  for (auto& [prefix, f] : fused_experts) {
    const ExpertRange range = experts.value_or(ExpertRange{0, int64_t(f.gate.size())});
    const Shape& gate_shape = reader.info(f.gate[0]).shape;
    const int64_t E = range.count, Im = gate_shape[0], D = gate_shape[1];
    const int64_t all = int64_t(f.gate.size());
    std::vector<std::string> gu_sources = f.gate;
    gu_sources.insert(gu_sources.end(), f.up.begin(), f.up.end());
    const DType gu_dtype = fused_dtype(gu_sources), down_dtype = fused_dtype(f.down);
    if (deferred(prefix + "gate_up_proj")) {
      store.params_.push_back({prefix + "gate_up_proj", placeholder(gu_dtype), true, gu_sources,
                               Shape{all, 2 * Im, D}, true});
      store.params_.push_back(
          {prefix + "down_proj", placeholder(down_dtype), true, f.down, Shape{all, D, Im}, true});
      continue;
    }
    Tensor gate_up = Tensor::empty({E, 2 * Im, D}, gu_dtype);
    Tensor down = Tensor::empty({E, D, Im}, down_dtype);
    for (int64_t j = 0; j < E; ++j) {
      const size_t e = size_t(range.first + j);
      gate_up.select(0, j).slice(0, 0, Im).copy_(read_released(reader, f.gate[e]));
      gate_up.select(0, j).slice(0, Im, 2 * Im).copy_(read_released(reader, f.up[e]));
      down.select(0, j).copy_(read_released(reader, f.down[e]));
    }
    store.params_.push_back(
        {prefix + "gate_up_proj", gate_up, true, gu_sources, Shape{all, 2 * Im, D}});
    store.params_.push_back({prefix + "down_proj", down, true, f.down, Shape{all, D, Im}});
  }
  // Short convolutions: q, k, v concatenated along the channel dimension, kept in fp32.
  for (auto& [prefix, f] : convs) {
    std::sort(f.conv.begin(), f.conv.end(), [](const std::string& a, const std::string& b) {
      auto rank = [](const std::string& n) {
        return n.find(".q_conv1d") != std::string::npos   ? 0
               : n.find(".k_conv1d") != std::string::npos ? 1
                                                          : 2;
      };
      return rank(a) < rank(b);
    });
    const Shape& q = reader.info(f.conv[0]).shape;
    const int64_t QL = q[0], K = q[2];
    if (deferred(prefix + "conv1d.weight")) {
      store.params_.push_back({prefix + "conv1d.weight", placeholder(DType::f32), true, f.conv,
                               Shape{3 * QL, 1, K}, true});
      continue;
    }
    Tensor conv = Tensor::empty({3 * QL, 1, K}, DType::f32);
    for (int64_t i = 0; i < 3; ++i)
      conv.slice(0, i * QL, (i + 1) * QL).copy_(read_released(reader, f.conv[i]));
    store.params_.push_back({prefix + "conv1d.weight", conv, true, f.conv, Shape{3 * QL, 1, K}});
  }
  for (size_t i = 0; i < store.params_.size(); ++i) store.index_[store.params_[i].name] = i;
  return store;
}

const Tensor& ParamStore::get(const std::string& name) const {
  auto it = index_.find(name);
  GLMTUNE_ASSERT(it != index_.end(), "no parameter named '{}'", name);
  return params_[it->second].value;
}

Tensor& ParamStore::get(const std::string& name) {
  auto it = index_.find(name);
  GLMTUNE_ASSERT(it != index_.end(), "no parameter named '{}'", name);
  return params_[it->second].value;
}

const InternalParam& ParamStore::param(const std::string& name) const {
  auto it = index_.find(name);
  GLMTUNE_ASSERT(it != index_.end(), "no parameter named '{}'", name);
  return params_[it->second];
}

void ParamStore::set_trainable(const std::string& name, bool trainable) {
  auto it = index_.find(name);
  GLMTUNE_ASSERT(it != index_.end(), "no parameter named '{}'", name);
  params_[it->second].trainable = trainable;
}

void ParamStore::load_deferred(const io::CheckpointReader& reader, const std::string& name) {
  auto it = index_.find(name);
  GLMTUNE_ASSERT(it != index_.end(), "no parameter named '{}'", name);
  InternalParam& p = params_[it->second];
  GLMTUNE_ASSERT(p.deferred, "'{}' is not a deferred tensor", name);
  // Under an expert range a fused expert tensor takes the range's experts, a contiguous run of
  // its [E, rows, cols] elements; every other tensor is whole.
  Shape shape = p.shape;
  int64_t begin = 0;
  if (expert_range_ && is_fused_expert_tensor(name)) {
    const int64_t per_expert = shape_numel(shape) / shape[0];
    begin = expert_range_->first * per_expert;
    shape[0] = expert_range_->count;
  }
  // Owned memory: read_elements may return a view of the read-only mapping.
  p.value = read_elements(reader, name, begin, shape_numel(shape)).view(shape).clone();
  p.deferred = false;
}

void ParamStore::add_adapter(const std::string& name, Tensor value) {
  GLMTUNE_ASSERT(!index_.count(name), "adapter '{}' added twice", name);
  index_[name] = params_.size();
  InternalParam p;
  p.name = name;
  p.shape = value.shape();
  if (expert_range_ && is_expert_adapter(name)) {
    GLMTUNE_ASSERT(value.dim() == 3 && value.size(0) == expert_range_->count,
                   "expert adapter '{}' is {}, the store holds {} experts", name, value.str(),
                   expert_range_->count);
    p.shape[0] = config_.text().n_routed_experts;
  }
  p.value = std::move(value);
  p.sources = {name};
  p.adapter = true;
  params_.push_back(std::move(p));
}

void ParamStore::remove_adapters() {
  std::erase_if(params_, [](const InternalParam& p) { return p.adapter; });
  index_.clear();
  for (size_t i = 0; i < params_.size(); ++i) index_[params_[i].name] = i;
  adapter_scale_.reset();
}

double ParamStore::adapter_scale() const {
  GLMTUNE_ASSERT(adapter_scale_.has_value(), "the store holds no adapters");
  return *adapter_scale_;
}

namespace {

// The released tensors of internal parameter `p` in the order they are written and laid out in its
// flattened whole value: a fused expert tensor interleaves each expert's gate and up blocks.
std::vector<std::string> released_parts(const InternalParam& p) {
  if (p.sources.size() == 1 && p.sources[0] == p.name) return p.sources;
  if (p.name.ends_with("gate_up_proj")) {
    const size_t E = p.sources.size() / 2;
    std::vector<std::string> out;
    for (size_t e = 0; e < E; ++e) {
      out.push_back(p.sources[e]);
      out.push_back(p.sources[E + e]);
    }
    return out;
  }
  return p.sources;  // down_proj: per expert; conv1d: q, k, v
}

// Calls `emit` with each released tensor of `p` as a view of `whole`, its whole value.
void for_each_released(const InternalParam& p, const Tensor& whole,
                       const std::function<void(const std::string&, const Tensor&)>& emit) {
  GLMTUNE_ASSERT(whole.defined() && whole.shape() == p.shape,
                 "'{}' is {}, its whole tensor {}: gather the whole tensor before saving", p.name,
                 whole.defined() ? whole.str() : std::string("undefined"), shape_str(p.shape));
  if (p.sources.size() == 1 && p.sources[0] == p.name) {
    emit(p.name, whole);
  } else if (p.name.ends_with("gate_up_proj")) {
    const int64_t E = whole.size(0), Im = whole.size(1) / 2;
    for (int64_t e = 0; e < E; ++e) {
      emit(p.sources[size_t(e)], whole.select(0, e).slice(0, 0, Im));
      emit(p.sources[size_t(E + e)], whole.select(0, e).slice(0, Im, 2 * Im));
    }
  } else if (p.name.ends_with("down_proj")) {
    for (int64_t e = 0; e < whole.size(0); ++e) emit(p.sources[size_t(e)], whole.select(0, e));
  } else {
    const int64_t QL = whole.size(0) / 3;
    for (int64_t i = 0; i < 3; ++i)
      emit(p.sources[size_t(i)], whole.slice(0, i * QL, (i + 1) * QL));
  }
}

}  // namespace

Tensor ParamStore::read_elements(const io::CheckpointReader& reader, const std::string& name,
                                 int64_t begin, int64_t count) const {
  const InternalParam& p = param(name);
  const int64_t numel = shape_numel(p.shape);
  if (begin < 0 || count < 0 || begin + count > numel)
    throw Error(fmt::format("elements [{}, {}) asked of '{}', which has {} ({})", begin,
                            begin + count, name, numel, shape_str(p.shape)),
                reader.dir().string(), "read a range inside the tensor");
  Tensor out = Tensor::empty({count}, p.value.dtype());
  int64_t at = 0;  // first flat element of the current released part
  for (const std::string& part : released_parts(p)) {
    const int64_t n = shape_numel(reader.info(part).shape);
    const int64_t lo = std::max(begin, at), hi = std::min(begin + count, at + n);
    if (lo < hi)
      out.narrow(0, lo - begin, hi - lo).copy_(read_released_range(reader, part, lo - at, hi - lo));
    at += n;
    if (at >= begin + count) break;
  }
  if (at < begin + count)
    throw Error(fmt::format("the released tensors of '{}' hold {} elements, its shape {} needs {}",
                            name, at, shape_str(p.shape), numel),
                reader.dir().string(),
                "use the config.json that came with these weights, or re-create the checkpoint");
  return out;
}

void ParamStore::save(const std::filesystem::path& dir, uint64_t max_shard_bytes) const {
  save(
      dir, [](const InternalParam& p) { return p.value; }, max_shard_bytes);
}

void ParamStore::save(const std::filesystem::path& dir, const WholeValue& whole,
                      uint64_t max_shard_bytes) const {
  io::CheckpointWriterOptions options;
  options.max_shard_bytes = max_shard_bytes;
  io::CheckpointWriter writer(dir, options);
  std::map<std::string, const ParamSpec*> released;
  const std::vector<ParamSpec> layout = released_layout(config_);
  for (const auto& spec : layout) released[spec.name] = &spec;
  // The whole sequence up front, so that each tensor is written as soon as it exists.
  std::vector<io::TensorSpec> specs;
  for (const auto& p : params_)
    for (const std::string& name : p.adapter ? std::vector<std::string>() : released_parts(p)) {
      const ParamSpec& spec = *released.at(name);
      specs.push_back({name, spec.dtype, spec.shape});
    }
  writer.plan_in_order(std::move(specs));
  for (const auto& p : params_) {
    if (p.adapter) continue;
    const Tensor value = whole(p);
    for_each_released(p, value, [&](const std::string& name, const Tensor& t) {
      writer.put(name, t.to(released.at(name)->dtype).contiguous());
    });
  }
  writer.add_file("config.json", config_.document().dump(2) + "\n");
  writer.finish();
}

void ParamStore::visit_for_save(const WholeValue& whole) const {
  for (const auto& p : params_)
    if (!p.adapter) whole(p);
}

}  // namespace glmtune::model
