#include "glmtune/model/text/fp8_layers.h"

#include <fmt/format.h>

#include <optional>

#include "glmtune/base/error.h"
#include "glmtune/base/overloaded.h"
#include "glmtune/io/fp8.h"
#include "glmtune/ops/fp8.h"

namespace glmtune::model::text {
namespace {

// The decoder layer `name` belongs to (num_layers: the MTP layer), or -1.
int64_t layer_of(const std::string& name, int64_t num_layers) {
  const std::string root = "model.language_model.layers.";
  if (name.compare(0, root.size(), root) != 0) return -1;
  const size_t dot = name.find('.', root.size());
  if (dot == std::string::npos || dot == root.size()) return -1;
  int64_t layer = 0;
  for (size_t i = root.size(); i < dot; ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    layer = layer * 10 + (name[i] - '0');
  }
  return layer <= num_layers ? layer : -1;
}

// The released tensors of internal parameter `name`, in the order of its rows: itself, or for a
// fused expert tensor each expert's (gate_e, up_e for gate_up_proj; down_e for down_proj), of the
// experts in `range` when given (an expert-parallel rank's). Empty for a name that is no single
// weight (the fused short convolutions).
std::vector<std::string> row_pieces(const io::CheckpointReader& reader, const std::string& name,
                                    const std::optional<ExpertRange>& range = std::nullopt) {
  const auto experts = [&](const std::string& prefix, std::vector<std::string> parts) {
    std::vector<std::string> pieces;
    const int64_t begin = range ? range->first : 0;
    for (int64_t e = begin; !range || e < begin + range->count; ++e) {
      const std::string first = fmt::format("{}{}.{}.weight", prefix, e, parts.front());
      if (!reader.contains(first)) break;
      for (const std::string& part : parts)
        pieces.push_back(fmt::format("{}{}.{}.weight", prefix, e, part));
    }
    return pieces;
  };
  if (name.ends_with("mlp.experts.gate_up_proj"))
    return experts(name.substr(0, name.size() - std::string("gate_up_proj").size()),
                   {"gate_proj", "up_proj"});
  if (name.ends_with("mlp.experts.down_proj"))
    return experts(name.substr(0, name.size() - std::string("down_proj").size()), {"down_proj"});
  if (!name.ends_with(".weight") || name.ends_with("conv1d.weight")) return {};
  return {name};
}

// Whether the projection of `params` (a layer's or the MTP layer's weights) whose weight shares
// `weight`'s storage runs its GEMMs in FP8 (use_fp8_gemms).
template <typename Params, typename Zip>
bool marked_fp8(Params& params, Zip zip, const Tensor& weight) {
  const auto is_it = [&](const ops::Linear& l) {
    return l.weight.defined() && l.weight.storage() == weight.storage();
  };
  bool marked = false;
  zip(params, params,
      Overloaded{[](const std::string&, ParamGroup, Tensor&, Tensor&) {},
                 [&](const std::string&, ParamGroup, ops::Linear& l, ops::Linear&,
                     ops::WholeProjection) { marked = marked || (is_it(l) && l.fp8); }});
  for (const ops::Linear* l : {&params.moe.gate_up_proj, &params.moe.down_proj})
    marked = marked || (is_it(*l) && l->fp8);
  return marked;
}

}  // namespace

bool stored_in_fp8(const io::CheckpointReader& reader, const std::string& name,
                   int64_t num_layers) {
  if (layer_of(name, num_layers) < 0) return false;
  const std::vector<std::string> pieces = row_pieces(reader, name);
  if (pieces.empty()) return false;
  const Shape shape = reader.contains(pieces.front()) ? reader.info(pieces.front()).shape : Shape{};
  for (const std::string& piece : pieces) {
    if (!reader.contains(piece) || !reader.contains(io::fp8_scale_name(piece))) return false;
    const io::TensorInfo& info = reader.info(piece);
    const io::TensorInfo& scale = reader.info(io::fp8_scale_name(piece));
    if (info.dtype != DType::fp8e4m3 || info.shape != shape || shape.size() != 2 ||
        scale.shape != io::fp8_scale_shape(shape) ||
        (scale.dtype != DType::f32 && scale.dtype != DType::bf16))
      return false;
  }
  return true;
}

Fp8Layers::Fp8Layers(TextWeights& weights, const ParamStore& store,
                     const io::CheckpointReader& reader, bool feed_fp8_gemms)
    : weights_(weights) {
  const int64_t num_layers = int64_t(weights.layers.size());
  layers_.resize(weights.layers.size() + 1);
  for (const InternalParam& p : store.params()) {
    if (!p.deferred) continue;
    const int64_t layer = layer_of(p.name, num_layers);
    if (layer < 0 || !stored_in_fp8(reader, p.name, num_layers))
      throw InternalError(
          fmt::format("'{}' was deferred but is no decoder-layer FP8 weight", p.name));
    GLMTUNE_ASSERT(layer < num_layers || weights.mtp, "'{}' is in the MTP layer of a model without",
                   p.name);
    if (p.trainable)
      throw InternalError(fmt::format("'{}' is trained: its FP8 codes cannot be updated", p.name));
    // Under expert parallelism a fused expert tensor holds this rank's experts only.
    const bool local = store.expert_range() && is_fused_expert_tensor(p.name);
    Held h;
    h.shape = p.shape;
    if (local) h.shape[0] = store.expert_range()->count;
    // The model's placeholder: its field in the layer and its entries in the named list.
    Tensor placeholder;
    for (size_t i = 0; i < weights.named.size(); ++i)
      if (weights.named[i].first == p.name) {
        placeholder = weights.named[i].second;
        h.named.push_back(i);
      }
    GLMTUNE_ASSERT(placeholder.defined(), "'{}' is not among the model's tensors", p.name);
    const auto find_field = [&](const std::string&, Tensor& field) {
      if (field.defined() && field.storage() == placeholder.storage()) h.field = &field;
    };
    if (layer < num_layers)
      for_each_layer_param(weights.layers[size_t(layer)], find_field);
    else
      for_each_mtp_param(*weights.mtp, find_field);
    GLMTUNE_ASSERT(h.field != nullptr, "'{}' is not a field of layer {}", p.name, layer);
    h.dtype = placeholder.dtype();

    const std::vector<std::string> pieces =
        row_pieces(reader, p.name, local ? store.expert_range() : std::nullopt);
    const Shape piece = reader.info(pieces.front()).shape;
    h.piece_rows = piece[0];
    const Shape grid = io::fp8_scale_shape(piece);
    h.codes = Tensor::empty({int64_t(pieces.size()) * piece[0], piece[1]}, DType::fp8e4m3,
                            weights.device);
    h.scales =
        Tensor::empty({int64_t(pieces.size()), grid[0], grid[1]}, DType::f32, weights.device);
    for (size_t k = 0; k < pieces.size(); ++k) {
      h.codes.narrow(0, int64_t(k) * piece[0], piece[0]).copy_(reader.tensor(pieces[k]));
      h.scales.select(0, int64_t(k))
          .copy_(reader.tensor(io::fp8_scale_name(pieces[k])).to(DType::f32));
    }
    GLMTUNE_ASSERT(h.codes.numel() == shape_numel(h.shape), "'{}': pieces of {} for shape {}",
                   p.name, shape_str(piece), shape_str(h.shape));
    if (feed_fp8_gemms) fed_weights_ += fed_slices(h);
    // Read by the FP8 GEMMs alone, which take the pinned codes: no bf16 values are made.
    h.codes_only =
        !h.fed.empty() &&
        (layer < num_layers
             ? marked_fp8(
                   weights.layers[size_t(layer)],
                   [](auto& a, auto& b, auto&& f) { zip_layer_params(a, b, f); }, placeholder)
             : marked_fp8(
                   *weights.mtp, [](auto& a, auto& b, auto&& f) { zip_mtp_params(a, b, f); },
                   placeholder));
    codes_only_tensors_ += h.codes_only;
    ++tensors_;
    held_bytes_ += h.codes.numel() + h.scales.numel() * int64_t(sizeof(float));
    bf16_bytes_ += 2 * h.codes.numel();
    layers_[size_t(layer)].push_back(std::move(h));
  }
  // The placeholders go: between uses the fields are undefined, as with sharded layers.
  for (size_t l = 0; l < layers_.size(); ++l) release(int64_t(l));
}

int64_t Fp8Layers::fed_slices(Held& h) {
  // The field's [out, in] slices: the field itself, or each expert's of a fused [E, out, in].
  if (h.shape.size() != 2 && h.shape.size() != 3) return 0;
  const int64_t slices = h.shape.size() == 3 ? h.shape[0] : 1;
  const int64_t rows = h.shape[h.shape.size() - 2];
  // A slice's pieces share one block grid only when no block spans two of them.
  if (rows % h.piece_rows != 0 || (rows != h.piece_rows && h.piece_rows % 128 != 0)) return 0;
  const int64_t pieces = rows / h.piece_rows;
  for (int64_t i = 0; i < slices; ++i) {
    const Tensor scales = h.scales.narrow(0, i * pieces, pieces);
    h.fed.push_back(ops::fp8_weight_from_codes(
        h.codes.narrow(0, i * rows, rows),
        scales.reshape({pieces * scales.size(1), scales.size(2)}).contiguous()));
  }
  // Rows a multiple of 128 (so pieces of one too, or a single piece): the pieces' block rows,
  // in order, are the stack's.
  if (h.shape.size() == 3 && rows % 128 == 0)
    h.stack = ops::fp8_weight_from_codes(
        h.codes.reshape({slices * rows, h.shape[2]}),
        h.scales.reshape({h.scales.size(0) * h.scales.size(1), h.scales.size(2)}).contiguous());
  return slices;
}

void Fp8Layers::gather(int64_t layer) {
  GLMTUNE_ASSERT(layer >= 0 && layer < int64_t(layers_.size()), "gather of layer {} of {}", layer,
                 layers_.size());
  for (Held& h : layers_[size_t(layer)]) {
    // A codes-only field has the weight's shape and no memory: the FP8 GEMMs find its pinned
    // blocks by the view, and anything that read its values would fault rather than compute with
    // wrong ones.
    *h.field =
        h.codes_only
            ? Tensor::from_external(nullptr, h.shape, h.dtype, weights_.device, h.codes.storage())
            : ops::dequantize_fp8_pieces(h.codes, h.scales, h.piece_rows, h.shape, h.dtype);
    h.field->set_frozen(true);
    for (size_t i : h.named) weights_.named[i].second = *h.field;
    for (size_t i = 0; i < h.fed.size(); ++i)
      ops::pin_fp8_weight(
          h.fed.size() == 1 && h.shape.size() == 2 ? *h.field : h.field->select(0, int64_t(i)),
          h.fed[i]);
    if (h.stack.values.defined())
      ops::pin_fp8_weight(h.field->reshape({h.shape[0] * h.shape[1], h.shape[2]}), h.stack);
  }
}

void Fp8Layers::release(int64_t layer) {
  GLMTUNE_ASSERT(layer >= 0 && layer < int64_t(layers_.size()), "release of layer {} of {}", layer,
                 layers_.size());
  for (Held& h : layers_[size_t(layer)]) {
    *h.field = Tensor();
    for (size_t i : h.named) weights_.named[i].second = Tensor();
  }
}

}  // namespace glmtune::model::text
