#pragma once
// The implementations behind train/trainer_optimizer.h and what they share; the trainer's own
// header, not an API.

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "glmtune/train/optimizer.h"
#include "glmtune/train/state.h"
#include "glmtune/train/trainer_optimizer.h"

namespace glmtune::train {

// Name and whole shape of each trained tensor of a saved optimizer state, in the unsharded
// optimizer's order: what a resume checks and a save writes.
using TrainedShapes = std::vector<std::pair<std::string, Shape>>;

// The optimizer trains the text model's trainable tensors; the vision tower (kept in the store so
// that checkpoints stay complete) has no gradient in text SFT and is left untouched.
std::vector<NamedParam> trainable_params(const model::ParamStore& store);

// Whether `name` is a tensor of one of the first `layers` decoder layers (not the MTP layer).
bool in_decoder_layer(const std::string& name, int64_t layers);

// The trained tensors of `params` with their whole shapes: with fsdp or expert slices the store
// holds placeholders or slices, whose whole shapes it keeps.
TrainedShapes whole_trained(const std::vector<NamedParam>& params, const model::ParamStore& store);

// The gradients in the order of `params` (frozen ones undefined): the vision buffers where
// `vision_grads` (aligned with `params`, or empty) has one, else the model's buffer of that name.
std::vector<Tensor> gradient_list(const std::vector<NamedParam>& params,
                                  const std::vector<Tensor>& vision_grads,
                                  model::text::TextGrads& grads);

// The released names of the first `limit` trained tensors whose gradient is not finite, the
// gradient of a parameter being `optimizer_grad`'s when it has one, else the model's buffer
// (GPU gradients are scanned from host copies made here); names `skip` says yes to are left out.
std::vector<std::string> nonfinite_gradient_names(
    const model::ParamStore& store, const std::map<std::string, Tensor*>& optimizer_grad,
    const model::text::TextGrads& grads, const std::function<bool(const std::string&)>& skip,
    size_t limit);

// Every weight the store holds, under its released name; names `skip` says yes to are left out.
std::vector<std::string> nonfinite_stored_weights(
    const model::ParamStore& store, const std::function<bool(const std::string&)>& skip,
    size_t limit);

std::unique_ptr<Optimizer> make_sharded_optimizer(const OptimizerSetup& setup);
#ifdef GLMTUNE_WITH_CUDA
// `params`: the trained tensors (store values on the host); `saved`: the checked state to resume;
// `vl`: the vision side of a vision-language run (its tower's tensors are updated too), or null.
std::unique_ptr<Optimizer> make_device_optimizer(std::vector<NamedParam> params,
                                                 TrainedShapes trained,
                                                 std::optional<SavedAdamWState> saved,
                                                 const AdamWConfig& config, Device device,
                                                 VlTraining* vl);
#endif

}  // namespace glmtune::train
