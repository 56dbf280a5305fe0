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
    if (info.dtype == DType::fp8e4m3) {
      if (info.shape.size() != 2 ||
          !reader.contains(name.substr(0, name.size() - 7) + ".weight_scale_inv"))
        report.missing.push_back(name.substr(0, name.size() - 7) + ".weight_scale_inv");
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
  const std::string scale = name.substr(0, name.size() - 7) + ".weight_scale_inv";
  return io::dequantize_fp8_block(t, reader.tensor(scale), io::kFp8BlockSize, io::kFp8BlockSize,
                                  name);
}

}  // namespace

ParamStore ParamStore::load(const io::CheckpointReader& reader, const ModelConfig& config,
                            std::optional<ExpertRange> experts) {
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
    store.params_.push_back(
        {spec.name, read_released(reader, spec.name), spec.trainable, {spec.name}});
  }
  // Experts: [E, 2Im, D] with gate rows first, and [E, D, Im], E the experts loaded. The released
  // tensors are views of the checkpoint mapping, so an expert outside the range is never read.
  for (auto& [prefix, f] : fused_experts) {
    const ExpertRange range = experts.value_or(ExpertRange{0, int64_t(f.gate.size())});
    const Shape& gate_shape = reader.info(f.gate[0]).shape;
    const int64_t E = range.count, Im = gate_shape[0], D = gate_shape[1];
    Tensor gate_up = Tensor::empty({E, 2 * Im, D}, DType::bf16);
    Tensor down = Tensor::empty({E, D, Im}, DType::bf16);
    for (int64_t j = 0; j < E; ++j) {
      const size_t e = size_t(range.first + j);
      gate_up.select(0, j).slice(0, 0, Im).copy_(read_released(reader, f.gate[e]));
      gate_up.select(0, j).slice(0, Im, 2 * Im).copy_(read_released(reader, f.up[e]));
      down.select(0, j).copy_(read_released(reader, f.down[e]));
    }
    std::vector<std::string> gu_sources = f.gate;
    gu_sources.insert(gu_sources.end(), f.up.begin(), f.up.end());
    store.params_.push_back({prefix + "gate_up_proj", gate_up, true, gu_sources});
    store.params_.push_back({prefix + "down_proj", down, true, f.down});
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
    Tensor q = reader.tensor(f.conv[0]);
    const int64_t QL = q.size(0), K = q.size(2);
    Tensor conv = Tensor::empty({3 * QL, 1, K}, DType::f32);
    for (int64_t i = 0; i < 3; ++i)
      conv.slice(0, i * QL, (i + 1) * QL).copy_(read_released(reader, f.conv[i]));
    store.params_.push_back({prefix + "conv1d.weight", conv, true, f.conv});
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

void ParamStore::save(const std::filesystem::path& dir, uint64_t max_shard_bytes) const {
  io::CheckpointWriterOptions options;
  options.max_shard_bytes = max_shard_bytes;
  io::CheckpointWriter writer(dir, options);
  std::map<std::string, DType> stored;
  for (const auto& spec : released_layout(config_)) stored[spec.name] = spec.dtype;
  auto emit = [&](const std::string& name, const Tensor& t) {
    writer.add(name, t.to(stored.at(name)).contiguous());
  };
  // A fused expert tensor names every expert of its layer, parts_per_expert released tensors each.
  auto check_whole = [](const InternalParam& p, size_t parts_per_expert) {
    GLMTUNE_ASSERT(p.sources.size() == parts_per_expert * size_t(p.value.size(0)),
                   "'{}' holds {} of the {} experts; gather the whole tensor before saving", p.name,
                   p.value.size(0), p.sources.size() / parts_per_expert);
  };
  for (const auto& p : params_) {
    if (p.sources.size() == 1 && p.sources[0] == p.name) {
      emit(p.name, p.value);
    } else if (p.name.ends_with("gate_up_proj")) {
      check_whole(p, 2);
      const int64_t E = p.value.size(0), Im = p.value.size(1) / 2;
      for (int64_t e = 0; e < E; ++e) {
        emit(p.sources[size_t(e)], p.value.select(0, e).slice(0, 0, Im));
        emit(p.sources[size_t(E + e)], p.value.select(0, e).slice(0, Im, 2 * Im));
      }
    } else if (p.name.ends_with("down_proj")) {
      check_whole(p, 1);
      for (int64_t e = 0; e < p.value.size(0); ++e)
        emit(p.sources[size_t(e)], p.value.select(0, e));
    } else {
      const int64_t QL = p.value.size(0) / 3;
      for (int64_t i = 0; i < 3; ++i)
        emit(p.sources[size_t(i)], p.value.slice(0, i * QL, (i + 1) * QL));
    }
  }
  writer.add_file("config.json", config_.document().dump(2) + "\n");
  writer.finish();
}

}  // namespace glmtune::model
