// `glmtune bench step`: the throughput of one training step (forward + backward, and the GPU
// optimizer step) on one GPU, with the model FLOP rate, the MFU, peak memory and a per-op time
// breakdown; text packs, or with --vl packs holding images and a video (the vision tower and the
// splice in the step). The FLOP formula is written out in docs/PERF.md ("Step benchmark: the FLOP
// count").

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cmd_bench_ops.h"
#include "command.h"
#include "config_options.h"
#include "glmtune/base/error.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/model/compose.h"
#include "glmtune/model/init.h"
#include "glmtune/model/lora.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/fp8_layers.h"
#include "glmtune/model/text/model.h"
#include "glmtune/tensor/allocator.h"
#include "glmtune/tensor/device.h"
#include "glmtune/tensor/host_offload.h"
#include "glmtune/tensor/rng.h"
#include "glmtune/train/flops.h"
#include "glmtune/train/freeze.h"
#ifdef GLMTUNE_WITH_CUDA
#include <cuda_runtime.h>

#include "glmtune/ops/cuda/adamw.h"
#include "glmtune/ops/cuda/dispatch.h"
#include "glmtune/ops/fp8.h"
#endif

namespace {

using namespace glmtune;
namespace fs = std::filesystem;

struct BenchArgs {
  cli::ConfigOptions config;
  std::string model_dir;
  std::string cache_dir;
  std::string device = "cuda:0";
  int64_t pack = 16384;
  int64_t docs = 4;
  int64_t steps = 3;
  int64_t warmup = 1;
  double recompute = 0;
  double offload = 0;
  bool mtp = true;
  bool optimizer = true;
  uint64_t seed = 1;
  bool json = false;
  bool op_detail = false;           // time the ops inside composites too (exclusive times by path)
  bool op_sync = false;             // wait for the device before each timed op
  std::vector<std::string> freeze;  // train.freeze patterns
  // --lora-rank: adapters of this rank (0: none) on --lora-targets, the base frozen, as a [lora]
  // recipe trains them.
  int64_t lora_rank = 0;
  std::vector<std::string> lora_targets = {"all-linear"};
  bool lora_experts = false;  // lora.target_parameters: every routed expert's gate_up and down
  // --base fp8: a preset written in the FP8 release's layout and its FP8 weights held in FP8 on the
  // device (lora.base = "fp8"), dequantised per layer around each use.
  std::string base = "bf16";
  // --fp8: train.fp8 = "tilewise", the experts', MLPs' and attention projections' GEMMs in
  // block-scaled FP8.
  bool fp8 = false;
  // --fp8: each weight quantised once per step (as the trainer does), or at every use.
  bool fp8_weight_reuse = true;
  // --vl: the pack carries `images` images and one video of `video_frames` frames (0: none), all
  // of image_size × image_size pixels.
  bool vl = false;
  bool recompute_vision = false;  // --vl: the tower's blocks rerun in the backward
  int64_t images = 8;
  int64_t video_frames = 16;
  int64_t image_size = 448;
};

#ifdef GLMTUNE_WITH_CUDA
using train::count_flops;
using train::FlopCount;
constexpr double kPeakTflops = train::kH200Bf16PeakTflops;

fs::path prepare_model(const BenchArgs& a, model::ModelConfig& config) {
  if (!a.model_dir.empty()) {
    config = model::ModelConfig::from_file((fs::path(a.model_dir) / "config.json").string());
    a.config.apply(config);
    return a.model_dir;
  }
  config = model::ModelConfig::preset(a.config.preset);
  a.config.apply(config);
  // A random checkpoint of this exact config, written once and reused by later runs.
  const size_t key =
      std::hash<std::string>{}(config.to_json_with_schedules().dump() + std::to_string(a.seed));
  const fs::path base = a.cache_dir.empty() ? fs::temp_directory_path() : fs::path(a.cache_dir);
  const fs::path dir = base / fmt::format("glmtune-bench-{}{}-{:016x}", a.config.preset,
                                          a.base == "fp8" ? "-fp8" : "", key);
  if (!fs::exists(dir / "config.json")) {
    std::fprintf(stderr, "writing a random %s checkpoint to %s\n", a.config.preset.c_str(),
                 dir.string().c_str());
    model::InitOptions init;
    init.seed = a.seed;
    init.fp8 = a.base == "fp8";
    // The GPU draws the same normal values far faster than the host.
    init.draw = Device::parse(a.device);
    model::write_random_checkpoint(config, dir, init);
  }
  return dir;
}

void check_step_args(const BenchArgs& a, const Device& device) {
  if (!device.is_cuda())
    throw Error(fmt::format("bench step measures a GPU, got device {}", a.device), "--device",
                "pass --device cuda or cuda:N");
  if (!cuda_available())
    throw Error("no CUDA device is visible", "glmtune bench step",
                "run it on a machine with a GPU (glmtune env lists them)");
  if (a.pack < 2 || a.docs < 1 || a.docs > a.pack)
    throw Error(fmt::format("--pack {} with --docs {}", a.pack, a.docs), "--pack / --docs",
                "give at least one document and at least one token per document");
}

// One pack of `docs` documents of random tokens (random text is what the timing needs: the
// routing spreads over the experts) with next-token labels inside each document.
struct BenchPack {
  std::vector<int64_t> lengths;  // of the documents
  model::text::PackInput in;
};

BenchPack random_pack(const BenchArgs& a, const model::TextConfig& c) {
  BenchPack b;
  b.lengths.assign(size_t(a.docs), a.pack / a.docs);
  b.lengths.back() += a.pack % a.docs;
  std::mt19937_64 rng(a.seed);
  std::uniform_int_distribution<int32_t> token(
      0, int32_t(std::min<int64_t>(c.vocab_size, 150000)) - 1);
  std::vector<int32_t> ids(size_t(a.pack)), labels(size_t(a.pack), -100), cu = {0};
  for (int32_t& id : ids) id = token(rng);
  for (int64_t len : b.lengths) {
    const int32_t start = cu.back();
    for (int32_t i = start; i + 1 < start + int32_t(len); ++i)
      labels[size_t(i)] = ids[size_t(i + 1)];
    cu.push_back(start + int32_t(len));
  }
  b.in.input_ids = Tensor::from_vector(ids, {a.pack});
  b.in.cu_seqlens = Tensor::from_vector(cu, {int64_t(cu.size())});
  b.in.labels = Tensor::from_vector(labels, {a.pack});
  return b;
}

// The media of a --vl pack: the images go round-robin over the documents, the video into the last
// one; each document's placeholders follow its first token, its other tokens stay random text.
// Labels are masked on the placeholders and on the token before each run, as the processor's
// chat samples have them.
struct BenchMedia {
  model::PackMedia media;
  int64_t patches = 0;
  std::vector<int64_t> segments;  // attention segments of the tower: one per image, per tubelet
  int64_t media_tokens = 0;
};

BenchMedia random_media(const BenchArgs& a, const model::ModelConfig& config, BenchPack& pack) {
  const model::VisionConfig& v = *config.vision();
  const int64_t merge = v.spatial_merge_size, side = a.image_size / v.patch_size;
  if (a.image_size % (v.patch_size * merge) != 0)
    throw Error(fmt::format("--image-size {} is not a multiple of {} (patch {} × merge {})",
                            a.image_size, v.patch_size * merge, v.patch_size, merge),
                "--image-size", fmt::format("use e.g. {}", 16 * v.patch_size * merge));
  if (a.video_frames % v.temporal_patch_size != 0)
    throw Error(fmt::format("--video-frames {} is not a multiple of the temporal patch {}",
                            a.video_frames, v.temporal_patch_size),
                "--video-frames", "give an even frame count (or 0 for no video)");
  BenchMedia m;
  const int64_t ndoc = int64_t(pack.lengths.size());
  const int64_t per_image = side * side / (merge * merge);
  const int64_t tubelets = a.video_frames / v.temporal_patch_size;
  std::vector<int64_t> used(size_t(ndoc), 0);
  for (int64_t i = 0; i < a.images; ++i) {
    m.media.image_grid.push_back({1, side, side});
    m.media.image_documents.push_back(i % ndoc);
    used[size_t(i % ndoc)] += per_image;
    m.segments.push_back(side * side);
  }
  if (tubelets > 0) {
    m.media.video_grid.push_back({tubelets, side, side});
    m.media.video_documents.push_back(ndoc - 1);
    used[size_t(ndoc - 1)] += tubelets * per_image;
    for (int64_t t = 0; t < tubelets; ++t) m.segments.push_back(side * side);
  }
  for (int64_t d = 0; d < ndoc; ++d)
    if (used[size_t(d)] + 2 > pack.lengths[size_t(d)])
      throw Error(fmt::format("document {} of {} tokens cannot hold its {} media tokens and text",
                              d, pack.lengths[size_t(d)], used[size_t(d)]),
                  "--pack / --images / --video-frames",
                  "give a longer --pack, fewer --docs, fewer --images or fewer --video-frames");
  // Placeholders, in order of appearance: each document's images, then its video.
  std::vector<int32_t> ids(size_t(pack.in.input_ids.numel())), labels = ids;
  std::memcpy(ids.data(), pack.in.input_ids.data_ptr(), ids.size() * sizeof(int32_t));
  std::memcpy(labels.data(), pack.in.labels.data_ptr(), labels.size() * sizeof(int32_t));
  std::vector<int32_t> types(ids.size(), model::kTextToken);
  const int32_t image_token = int32_t(config.media().image_token_id);
  int64_t start = 0;
  for (int64_t d = 0; d < ndoc; ++d) {
    labels[size_t(start)] = -100;
    for (int64_t t = 0; t < used[size_t(d)]; ++t) {
      ids[size_t(start + 1 + t)] = image_token;
      labels[size_t(start + 1 + t)] = -100;
    }
    int64_t placed = 0;  // the images' rows come first, then the video's
    for (size_t i = 0; i < m.media.image_documents.size(); ++i)
      if (m.media.image_documents[i] == d)
        for (int64_t t = 0; t < per_image; ++t)
          types[size_t(start + 1 + placed++)] = model::kImageToken;
    for (size_t i = 0; i < m.media.video_documents.size(); ++i)
      if (m.media.video_documents[i] == d)
        for (int64_t t = 0; t < tubelets * per_image; ++t)
          types[size_t(start + 1 + placed++)] = model::kVideoToken;
    m.media_tokens += used[size_t(d)];
    start += pack.lengths[size_t(d)];
  }
  const int64_t t = int64_t(ids.size());
  pack.in.input_ids = Tensor::from_vector(ids, {t});
  pack.in.labels = Tensor::from_vector(labels, {t});
  m.media.mm_token_type_ids = Tensor::from_vector(types, {t});
  const int64_t row = v.in_channels * v.temporal_patch_size * v.patch_size * v.patch_size;
  auto pixels = [&](int64_t rows, uint64_t stream) {
    Tensor p = Tensor::empty({rows, row}, DType::f32);
    fill_normal(p, a.seed, stream << 40);
    return p;
  };
  if (a.images > 0) m.media.image_pixels = pixels(a.images * side * side, 1);
  if (tubelets > 0) m.media.video_pixels = pixels(tubelets * side * side, 2);
  m.patches = (a.images + tubelets) * side * side;
  return m;
}

// Forward FLOPs of the tower and projector over `m`'s patches (each GEMM 2·rows·in·out, the
// attention 4·L²·D per segment); the step counts 3× (backward: input and weight gradients).
double vision_forward_flops(const model::VisionConfig& v, const BenchMedia& m) {
  const double d = double(v.hidden_size), i = double(v.intermediate_size),
               o = double(v.out_hidden_size), p = double(v.projection_intermediate_size);
  const double row = double(v.in_channels * v.temporal_patch_size * v.patch_size * v.patch_size);
  const double n = double(m.patches);
  const double merged = n / double(v.spatial_merge_size * v.spatial_merge_size);
  double attention = 0;
  for (int64_t len : m.segments) attention += 4.0 * double(len) * double(len) * d;
  const double blocks = double(v.depth) * (2 * n * (4 * d * d + 3 * d * i) + attention);
  return 2 * n * row * d + blocks + 2 * merged * (4 * d * o + o * o + 3 * o * p);
}

model::text::TrainOptions step_options(const BenchArgs& a, const model::text::TextModel& model) {
  const model::TextConfig& c = model.text();
  model::text::TrainOptions opt;
  opt.mtp = a.mtp && model.has_mtp();
  opt.mtp_depths = opt.mtp ? c.num_nextn_predict_layers : 0;
  opt.balancing_alpha = 0.001;
  opt.activations = model::text::activation_policy(c.num_hidden_layers, a.recompute, a.offload);
  opt.recompute_mtp = a.recompute > 0;
  opt.loss_chunk_rows = 4096;
  opt.lm_denominator = double(a.pack - a.docs);
  opt.mtp_denominators.assign(size_t(opt.mtp_depths), double(a.pack - 2 * a.docs));
  return opt;
}

// The optimizer state of a GPU run: f32 masters and moments for every trained tensor.
struct BenchAdamW {
  std::vector<cuda::AdamWParam> params;
  std::vector<Tensor> grads;
};

BenchAdamW bench_adamw(model::text::TextModel& model, model::text::TextGrads& grads,
                       const Device& device) {
  BenchAdamW adam;
  for (auto& [name, g] : grads.named) {
    Tensor* w = nullptr;
    for (auto& [n, t] : model.weights().named)
      if (n == name) w = &t;
    cuda::AdamWParam p;
    p.master = w->to(DType::f32).contiguous();
    if (p.master.data_ptr() == w->data_ptr()) p.master = w->clone();
    p.exp_avg = Tensor::zeros(g.shape(), DType::f32, device);
    p.exp_avg_sq = Tensor::zeros(g.shape(), DType::f32, device);
    p.grad = g;
    p.param = w->dtype() == DType::bf16 ? *w : Tensor();
    adam.params.push_back(std::move(p));
    adam.grads.push_back(g);
  }
  return adam;
}

// The tower's and projector's masters and moments, beside the text model's.
void add_vision_adamw(BenchAdamW& adam, const model::VisionLanguageModel& model,
                      model::vision::VisionGrads& grads, const Device& device) {
  const auto weights = model::vision::released_views(model.vision_config(), model.vision());
  const auto grad_views = model::vision::released_views(model.vision_config(), grads.params);
  for (size_t k = 0; k < weights.size(); ++k) {
    const Tensor& w = weights[k].second;
    cuda::AdamWParam p;
    p.master = w.to(DType::f32).contiguous();
    p.exp_avg = Tensor::zeros(w.shape(), DType::f32, device);
    p.exp_avg_sq = Tensor::zeros(w.shape(), DType::f32, device);
    p.grad = grad_views[k].second;
    p.param = w;
    adam.params.push_back(std::move(p));
    adam.grads.push_back(grad_views[k].second);
  }
}

// The timed steps' wall times (seconds) and GPU time per op (ms per step), and the last loss.
struct BenchTimes {
  std::vector<double> step_s, fb_s, opt_s;
  std::map<std::string, double> op_ms, op_calls;  // per step
  double loss = 0;
  // Device allocations that reached cudaMalloc during the timed steps: a steady step makes none,
  // and each one it makes stalls the host where the device may be waiting for work.
  uint64_t system_allocs = 0;
};

// `run_pack` runs one pack's forward and backward into gradients `zero` clears.
BenchTimes time_steps(const BenchArgs& a,
                      const std::function<model::text::StepPackResult()>& run_pack,
                      const std::function<void()>& zero, BenchAdamW& adam, Allocator& alloc,
                      Allocator& pinned) {
  BenchTimes bt;
  uint64_t system_allocs_before = 0;
  for (int64_t s = 0; s < a.warmup + a.steps; ++s) {
    const bool timed = s >= a.warmup;
    if (timed && s == a.warmup) {
      alloc.reset_peak();
      pinned.reset_peak();
      system_allocs_before = alloc.stats().num_system_allocs;
    }
    ops::cuda_path::enable_op_timing(timed, a.op_detail, a.op_sync);
    zero();
    cudaDeviceSynchronize();
    const auto t0 = std::chrono::steady_clock::now();
    const model::text::StepPackResult r = run_pack();
    cudaDeviceSynchronize();
    const auto t1 = std::chrono::steady_clock::now();
    if (a.optimizer) {
      const cuda::GradNorm norm = cuda::grad_norm(adam.grads, 1.0);
      cuda::AdamWConfig cfg;
      cfg.lr = 1e-6;
      cfg.step = s + 1;
      cuda::adamw_step(adam.params, cfg, norm.clip);
    }
    cudaDeviceSynchronize();
    const auto t2 = std::chrono::steady_clock::now();
    ops::cuda_path::enable_op_timing(false);
    const std::map<std::string, ops::cuda_path::OpTime> times = ops::cuda_path::take_op_times();
    bt.loss = r.backward.lm_loss;
    if (!timed) continue;
    for (const auto& [name, t] : times) {
      bt.op_ms[name] += t.ms / double(a.steps);
      bt.op_calls[name] += double(t.calls) / double(a.steps);
    }
    bt.fb_s.push_back(std::chrono::duration<double>(t1 - t0).count());
    bt.opt_s.push_back(std::chrono::duration<double>(t2 - t1).count());
    bt.step_s.push_back(std::chrono::duration<double>(t2 - t0).count());
  }
  bt.system_allocs = alloc.stats().num_system_allocs - system_allocs_before;
  return bt;
}

// What bench step reports.
struct BenchStepReport {
  fs::path dir;
  double load_s = 0;
  bool mtp = false;
  double step = 0, fb = 0, optim = 0;  // medians, seconds
  FlopCount flops;
  double tflops = 0;
  MemoryStats mem;
  uint64_t system_allocs = 0;  // in the timed steps
  double pinned_gib = 0;
  double loss = 0;
  train::FreezePlan frozen;
  // --lora-rank: adapted projections, adapter elements, and the FLOPs the step executes (the
  // frozen weights' gradients left out, the adapters' products in).
  int64_t lora_modules = 0, lora_elements = 0;
  double executed_flops = 0;
  // --base fp8: tensors held in FP8, their device bytes, and what their bf16 values would take.
  int64_t fp8_tensors = 0;
  double fp8_gib = 0, fp8_as_bf16_gib = 0;
  int64_t fp8_projections = 0;  // --fp8: projections whose GEMMs run in FP8
  int64_t fp8_fed = 0;          // --fp8 --base fp8: frozen weights whose codes the GEMMs read
  int64_t fp8_codes_only = 0;   // held tensors that only those GEMMs read: never dequantised
  std::map<std::string, double> op_ms, op_calls;
  // --vl
  int64_t patches = 0, media_tokens = 0;
  double vision_flops = 0;  // of the step, in the FLOP/step total too
  double tower_ms = 0;      // the tower's and projector's forward + backward GPU time per step
};

void print_step_json(const BenchArgs& a, const BenchStepReport& r) {
  nlohmann::json out = {{"model", r.dir.string()},
                        {"pack", a.pack},
                        {"docs", a.docs},
                        {"steps", a.steps},
                        {"tokens_per_s", double(a.pack) / r.step},
                        {"step_s", r.step},
                        {"forward_backward_s", r.fb},
                        {"optimizer_s", r.optim},
                        {"model_tflops", r.tflops},
                        {"mfu", r.tflops / kPeakTflops},
                        {"flop_per_step", r.flops.step(a.pack) + r.vision_flops},
                        {"peak_allocated_gib", double(r.mem.peak_allocated) / (1 << 30)},
                        {"peak_reserved_gib", double(r.mem.peak_reserved) / (1 << 30)},
                        {"device_system_allocs", r.system_allocs},
                        {"recompute", a.recompute},
                        {"recompute_vision", a.recompute_vision},
                        {"offload", a.offload},
                        {"peak_pinned_host_gib", r.pinned_gib},
                        {"loss", r.loss},
                        {"frozen_tensors", r.frozen.frozen.size()},
                        {"frozen_parameters", r.frozen.frozen_elements},
                        {"lora_rank", a.lora_rank},
                        {"lora_modules", r.lora_modules},
                        {"lora_parameters", r.lora_elements},
                        {"executed_flop_per_step", r.executed_flops},
                        {"executed_tflops", r.executed_flops / r.step / 1e12},
                        {"base", a.base},
                        {"fp8_base_tensors", r.fp8_tensors},
                        {"fp8_base_gib", r.fp8_gib},
                        {"fp8_base_as_bf16_gib", r.fp8_as_bf16_gib},
                        {"fp8_tilewise_projections", r.fp8_projections},
                        {"fp8_codes_fed_weights", r.fp8_fed},
                        {"fp8_codes_only_tensors", r.fp8_codes_only},
                        {"op_ms", r.op_ms},
                        {"op_calls", r.op_calls},
                        {"op_sync", a.op_sync}};
  if (a.vl)
    out["vl"] = {{"images", a.images},
                 {"video_frames", a.video_frames},
                 {"image_size", a.image_size},
                 {"patches", r.patches},
                 {"media_tokens", r.media_tokens},
                 {"vision_flop_per_step", r.vision_flops},
                 {"tower_ms", r.tower_ms},
                 {"tower_share", r.tower_ms / (r.fb * 1e3)}};
  std::puts(out.dump(2).c_str());
}

void print_step_text(const BenchArgs& a, const model::TextConfig& c, const BenchStepReport& r) {
  std::printf("model %s (loaded in %.1f s): %ld layers, hidden %ld, %ld routed experts\n",
              r.dir.string().c_str(), r.load_s, c.num_hidden_layers, c.hidden_size,
              c.n_routed_experts);
  std::printf(
      "pack %ld tokens in %ld documents, MTP %s, recompute %.2f, offload %.2f; median of %ld "
      "steps\n",
      a.pack, a.docs, r.mtp ? "on" : "off", a.recompute, a.offload, a.steps);
  std::printf("step %.3f s (forward+backward %.3f s, optimizer %.3f s): %.0f tokens/s%s\n", r.step,
              r.fb, r.optim, double(a.pack) / r.step,
              a.op_sync ? " (--op-sync: the device waited for before every op; not the benchmark's "
                          "tokens/s)"
                        : "");
  if (a.vl)
    std::printf(
        "media: %ld images and a %ld-frame video of %ldx%ld: %ld patches, %ld of the pack's "
        "tokens; tower + projector %.1f ms per step (%.1f%% of forward+backward), %.3e FLOP%s\n",
        long(a.images), long(a.video_frames), long(a.image_size), long(a.image_size),
        long(r.patches), long(r.media_tokens), r.tower_ms, 100 * r.tower_ms / (r.fb * 1e3),
        r.vision_flops, a.recompute_vision ? "; its blocks recomputed" : "");
  std::printf("model FLOP/step %.3e: %.1f TFLOP/s, MFU %.1f%% of %.1f TFLOP/s bf16\n",
              r.flops.step(a.pack) + r.vision_flops, r.tflops, 100 * r.tflops / kPeakTflops,
              kPeakTflops);
  if (a.lora_rank > 0)
    std::printf(
        "lora: rank %ld on %ld projections, %ld trained parameters, the base frozen; executed "
        "%.3e FLOP/step (no weight gradients for the base): %.1f TFLOP/s, %.1f%% of peak\n",
        long(a.lora_rank), long(r.lora_modules), long(r.lora_elements), r.executed_flops,
        r.executed_flops / r.step / 1e12, 100 * r.executed_flops / r.step / 1e12 / kPeakTflops);
  if (r.fp8_tensors > 0)
    std::printf(
        "fp8 base: %ld tensors held in FP8 on the device, %.2f GiB (%.2f GiB in bf16), "
        "dequantised per layer around each use unless only FP8 GEMMs read them (below)\n",
        long(r.fp8_tensors), r.fp8_gib, r.fp8_as_bf16_gib);
  if (r.fp8_projections > 0)
    std::printf(
        "fp8 tilewise: %ld projections run their GEMMs in block-scaled FP8 (the FLOP counts above "
        "are the same products)\n",
        long(r.fp8_projections));
  if (r.fp8_fed > 0)
    std::printf(
        "fp8 tilewise on the fp8 base: the FP8 GEMMs read the released codes of %ld frozen "
        "weights (an expert's slice counted as one); %ld held tensors are read by them alone and "
        "never dequantised\n",
        long(r.fp8_fed), long(r.fp8_codes_only));
  if (!r.frozen.frozen.empty())
    std::printf(
        "frozen: %zu tensors, %ld parameters (no weight gradients or optimizer state for them; "
        "the FLOP count above still includes their weight gradients)\n",
        r.frozen.frozen.size(), long(r.frozen.frozen_elements));
  std::printf(
      "peak memory: %.1f GiB allocated, %.1f GiB reserved, %.1f GiB pinned host (offload); loss "
      "%.4f\n",
      double(r.mem.peak_allocated) / (1 << 30), double(r.mem.peak_reserved) / (1 << 30),
      r.pinned_gib, r.loss);
  std::printf("device allocations that reached cudaMalloc in the timed steps: %llu\n",
              static_cast<unsigned long long>(r.system_allocs));
  double op_total = 0;
  for (const auto& [name, ms] : r.op_ms) op_total += ms;
  std::vector<std::pair<double, std::string>> rows;
  for (const auto& [name, ms] : r.op_ms) rows.emplace_back(ms, name);
  std::sort(rows.rbegin(), rows.rend());
  int width = 28;
  for (const auto& [ms, name] : rows) width = std::max(width, int(name.size()));
  std::printf("%-*s %10s %7s %7s\n", width,
              a.op_detail ? "op, exclusive (GPU time per step)" : "op (GPU time per step)", "ms",
              "share", "calls");
  for (const auto& [ms, name] : rows) {
    const auto calls = r.op_calls.find(name);
    std::printf("%-*s %10.2f %6.1f%% %7.0f\n", width, name.c_str(), ms, 100 * ms / (r.fb * 1e3),
                calls == r.op_calls.end() ? 0.0 : calls->second);
  }
  std::printf("%-*s %10.2f %6.1f%%\n", width, "(timed ops together)", op_total,
              100 * op_total / (r.fb * 1e3));
}

// --lora-rank: adapters on --lora-targets from --seed (PEFT's initialisation: B zero, so the
// step computes the base model's loss) and every base tensor frozen.
void attach_bench_lora(const BenchArgs& a, model::ParamStore& store, BenchStepReport& r) {
  model::LoraConfig c;
  c.rank = a.lora_rank;
  c.alpha = double(a.lora_rank);
  c.target_modules = a.lora_targets;
  if (a.lora_experts) c.target_parameters = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"};
  c.validate("--lora-rank / --lora-targets");
  const std::vector<std::string> modules = model::resolve_lora_targets(store, c, "--lora-targets");
  model::add_lora_adapters(store, c, modules, a.seed);
  for (const model::InternalParam& p : store.params()) {
    if (p.adapter) {
      r.lora_elements += p.value.numel();
      continue;
    }
    store.set_trainable(p.name, false);
  }
  r.lora_modules = int64_t(modules.size());
}

// FLOPs a LoRA step executes beyond count_flops' full fine-tuning count: minus the weight
// gradient (2 FLOPs a weight element a token that reaches it) of every frozen matrix, plus the
// adapters' forward and backward (6 FLOPs an adapter element a token). The indexer runs without
// gradient in both counts, and a routed expert's matrix sees top_k / n_routed of the tokens.
double lora_flop_change(const model::text::TextModel& model, const model::ParamStore& store,
                        int64_t tokens) {
  const model::TextConfig& c = model.text();
  const double expert_share = double(c.num_experts_per_tok) / double(c.n_routed_experts);
  double change = 0;
  for (const auto& [name, t] : model.weights().named) {
    // The store's whole shape: a tensor held in FP8 is a placeholder in the model between uses.
    const Shape shape = store.contains(name) ? store.param(name).shape : t.shape();
    if (shape.size() < 2 || name.find("embed_tokens") != std::string::npos ||
        name.find(".indexer.") != std::string::npos)
      continue;
    const double share = name.find("mlp.experts.") != std::string::npos ? expert_share : 1.0;
    const double numel = double(shape_numel(shape));
    if (name.find(".lora_") != std::string::npos)
      change += 6 * numel * double(tokens);
    else if (!store.contains(name) || !store.param(name).trainable)
      change -= 2 * numel * double(tokens) * share;
  }
  return change;
}

int run_bench_step(const BenchArgs& a) {
  if (a.recompute + a.offload > 1 + 1e-9)
    throw Error(fmt::format("--recompute {} with --offload {}", a.recompute, a.offload),
                "--recompute / --offload",
                "the two fractions share the decoder layers (recompute the first, offload the "
                "next): give fractions whose sum is at most 1");
  const Device device = Device::parse(a.device);
  check_step_args(a, device);
  model::ModelConfig config = model::ModelConfig::preset("tiny");
  BenchStepReport r;
  r.dir = prepare_model(a, config);
  const auto load_start = std::chrono::steady_clock::now();
  const bool fp8_base = a.base == "fp8";
  if (fp8_base && a.lora_rank == 0 && a.freeze.empty())
    throw Error("--base fp8 without --lora-rank or --freeze", "--base",
                "FP8 tensors are held in FP8 only when frozen: add --lora-rank R (the whole base "
                "frozen) or --freeze PATTERN (those tensors, as train.frozen_weights = \"fp8\"), "
                "or measure --base bf16");
  const io::CheckpointReader reader = io::CheckpointReader::open(r.dir);
  const int64_t num_layers = config.text().num_hidden_layers;
  model::ParamStore store = model::ParamStore::load(
      reader, config, std::nullopt,
      fp8_base ? std::function<bool(const std::string&)>([&](const std::string& name) {
        return model::text::stored_in_fp8(reader, name, num_layers);
      })
               : nullptr);
  r.frozen = train::apply_freeze(store, a.freeze, "--freeze");
  if (a.lora_rank > 0) attach_bench_lora(a, store, r);
  // Full fine-tuning with --freeze: only the frozen FP8 tensors stay deferred.
  if (fp8_base && a.lora_rank == 0)
    for (const model::InternalParam& p : store.params())
      if (p.deferred && p.trainable) store.load_deferred(reader, p.name);
  if (a.vl && !config.vision())
    throw Error("--vl needs a model with a vision tower", r.dir.string() + "/config.json",
                "use a vision-language checkpoint or preset (crop25b and full have the tower)");
  std::optional<model::VisionLanguageModel> vlm;
  std::optional<model::text::TextModel> text_model;
  if (a.vl)
    vlm.emplace(store, model::text::TextModelOptions{DType::bf16, device});
  else
    text_model.emplace(store, model::text::TextModelOptions{DType::bf16, device});
  model::text::TextModel& model = vlm ? vlm->text() : *text_model;
  if (a.fp8) r.fp8_projections = model::text::use_fp8_gemms(model.weights(), 16);
  r.load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();
  const model::TextConfig& c = model.text();
  BenchPack pack = random_pack(a, c);
  std::optional<BenchMedia> media;
  if (a.vl) {
    config.require_media_tokens("--vl");
    media.emplace(random_media(a, config, pack));
  }
  model::text::TrainOptions opt = step_options(a, model);
  model::text::TextGrads grads = model::text::TextGrads::zeros_like(model.weights());
  // Held after the gradient buffers are made (the frozen FP8 tensors have none).
  std::optional<model::text::Fp8Layers> fp8_layers;
  if (fp8_base) {
    fp8_layers.emplace(model.weights(), store, reader, a.fp8);
    opt.layer_params = opt.mtp_params = &*fp8_layers;
    r.fp8_tensors = fp8_layers->tensors();
    r.fp8_gib = double(fp8_layers->held_bytes()) / (1 << 30);
    r.fp8_as_bf16_gib = double(fp8_layers->bf16_bytes()) / (1 << 30);
    r.fp8_fed = fp8_layers->fed_weights();
    r.fp8_codes_only = fp8_layers->codes_only_tensors();
  }
  std::optional<model::vision::VisionGrads> vision_grads;
  if (vlm) vision_grads.emplace(model::vision::VisionGrads::zeros_like(vlm->vision()));
  BenchAdamW adam = a.optimizer ? bench_adamw(model, grads, device) : BenchAdamW{};
  if (a.optimizer && vlm) add_vision_adamw(adam, *vlm, *vision_grads, device);
  const std::function<model::text::StepPackResult()> run_pack = [&] {
    // --fp8: each weight quantised once per step, as the trainer does (the optimizer runs after).
    std::optional<ops::Fp8WeightReuse> fp8_reuse;
    if (a.fp8 && a.fp8_weight_reuse) fp8_reuse.emplace();
    if (vlm)
      return model::compose_forward_backward(
          *vlm, pack.in, media->media, opt,
          model::ComposeOptions{.recompute_tower = a.recompute_vision}, grads, *vision_grads);
    return model::text::forward_backward(model, pack.in, opt, grads);
  };
  const std::function<void()> zero = [&] {
    grads.zero();
    if (vision_grads) vision_grads->zero();
  };

  Allocator& alloc = allocator_for(device);
  Allocator& pinned = HostOffload::of(device).pinned_memory();
  BenchTimes times = time_steps(a, run_pack, zero, adam, alloc, pinned);
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  r.mtp = opt.mtp;
  r.step = median(times.step_s);
  r.fb = median(times.fb_s);
  r.optim = median(times.opt_s);
  r.flops = count_flops(c, pack.lengths, opt.mtp);
  if (media) {
    r.patches = media->patches;
    r.media_tokens = media->media_tokens;
    r.vision_flops = 3 * vision_forward_flops(*config.vision(), *media);
    for (const char* op : {"vision_tower", "vision_tower_backward"})
      if (auto it = times.op_ms.find(op); it != times.op_ms.end()) r.tower_ms += it->second;
  }
  r.tflops = (r.flops.step(a.pack) + r.vision_flops) / r.step / 1e12;
  r.executed_flops = r.flops.step(a.pack) + r.vision_flops;
  if (a.lora_rank > 0) r.executed_flops += lora_flop_change(model, store, a.pack);
  r.mem = alloc.stats();
  r.system_allocs = times.system_allocs;
  r.pinned_gib = double(pinned.stats().peak_allocated) / (1 << 30);
  r.loss = times.loss;
  r.op_ms = std::move(times.op_ms);
  r.op_calls = std::move(times.op_calls);
  if (a.json)
    print_step_json(a, r);
  else
    print_step_text(a, c, r);
  return 0;
}
#endif

}  // namespace

GLMTUNE_COMMAND(
    bench, "bench",
    "Measure the GPU: the training step (glmtune bench step) and each hot op against its peer "
    "(glmtune bench ops)",
    [](CLI::App& app) {
      app.require_subcommand(1);
      auto a = std::make_shared<BenchArgs>();
      CLI::App* step = app.add_subcommand(
          "step",
          "Time forward + backward + optimizer of one pack on one GPU, with a per-op "
          "breakdown, the model TFLOP/s and the MFU");
      auto* model_opt =
          step->add_option("--model", a->model_dir, "A checkpoint directory to measure");
      auto* preset =
          step->add_option("--model-preset", a->config.preset,
                           "A preset to measure with random weights (written once to a cache)")
              ->check(CLI::IsMember(model::ModelConfig::preset_names()));
      model_opt->excludes(preset);
      a->config.add_set_option(*step);
      step->add_option("--cache-dir", a->cache_dir,
                       "Where random preset checkpoints are kept (default: the temp folder)");
      step->add_option("--device", a->device, "The GPU (cuda or cuda:N)");
      step->add_option("--pack", a->pack, "Tokens in the pack")->check(CLI::PositiveNumber);
      step->add_option("--docs", a->docs, "Documents in the pack")->check(CLI::PositiveNumber);
      step->add_option("--steps", a->steps, "Timed steps")->check(CLI::PositiveNumber);
      step->add_option("--warmup", a->warmup, "Untimed steps first")->check(CLI::NonNegativeNumber);
      step->add_option("--recompute", a->recompute, "Fraction of layers recomputed")
          ->check(CLI::Range(0.0, 1.0));
      step->add_option("--offload", a->offload,
                       "Fraction of layers, after the recomputed ones, whose activations wait in "
                       "pinned host memory")
          ->check(CLI::Range(0.0, 1.0));
      step->add_option("--seed", a->seed, "Seed of the random weights and tokens");
      step->add_flag("!--no-mtp", a->mtp, "Leave the MTP layer out");
      step->add_flag("!--no-optimizer", a->optimizer, "Time forward + backward only");
      step->add_flag("--json", a->json, "Print one JSON object");
      step->add_flag("--vl", a->vl,
                     "Put images and a video in the pack: the vision tower, the projector and "
                     "the splice join the step (needs a model with a vision tower)");
      step->add_flag("--recompute-vision", a->recompute_vision,
                     "--vl: the tower's blocks keep their inputs only and rerun in the backward "
                     "(train.recompute_vision)");
      step->add_option("--images", a->images, "--vl: images in the pack")
          ->check(CLI::NonNegativeNumber);
      step->add_option("--video-frames", a->video_frames,
                       "--vl: frames of the pack's video (0: no video)")
          ->check(CLI::NonNegativeNumber);
      step->add_option("--image-size", a->image_size, "--vl: image and frame side, pixels")
          ->check(CLI::PositiveNumber);
      step->add_option("--freeze", a->freeze,
                       "Freeze the parameters whose released names match this regular "
                       "expression, as train.freeze does (repeatable)");
      step->add_option("--lora-rank", a->lora_rank,
                       "Train LoRA adapters of this rank on a frozen base, as a [lora] recipe "
                       "does (0: full fine-tuning)")
          ->check(CLI::NonNegativeNumber);
      step->add_option("--lora-targets", a->lora_targets,
                       "With --lora-rank: lora.target_modules (PEFT suffixes, or all-linear)");
      step->add_flag("--lora-experts", a->lora_experts,
                     "With --lora-rank: adapters on every routed expert too "
                     "(lora.target_parameters)");
      step->add_option("--base", a->base,
                       "With --lora-rank or --freeze: bf16, or fp8: the preset written in the FP8 "
                       "release's layout and its frozen FP8 weights kept in FP8 on the GPU "
                       "(lora.base = \"fp8\", train.frozen_weights = \"fp8\")")
          ->check(CLI::IsMember({"bf16", "fp8"}));
      step->add_flag("--op-detail", a->op_detail,
                     "Time the ops inside the composites too: each op's exclusive GPU time (its "
                     "own less the ops it calls) under its path, \"kda_forward > kda_chunked\"");
      step->add_flag("--op-sync", a->op_sync,
                     "Wait for the device before each timed op, so that an op's time is its own "
                     "GPU work with no wait for the host in it; compared with a run without, it "
                     "shows where the GPU idles. The step runs slower: its tokens/s are not the "
                     "benchmark's");
      step->add_flag("--fp8", a->fp8,
                     "The experts', MLPs' and attention projections' GEMMs in block-scaled FP8, "
                     "as train.fp8 = \"tilewise\" runs them");
      step->add_flag("!--fp8-requantise", a->fp8_weight_reuse,
                     "--fp8: quantise each weight at every use (forward, recompute, backward) "
                     "instead of once per step, to measure what the reuse saves");
      const cli::BenchSubcommand ops = cli::add_bench_ops(app);
      return [a, ops]() -> int {
        if (ops.app->parsed()) return ops.run();
        if (a->model_dir.empty() && a->config.preset.empty())
          throw Error("nothing to measure", "glmtune bench step",
                      "give --model DIR or --model-preset tiny|crop25b|full");
#ifdef GLMTUNE_WITH_CUDA
        return run_bench_step(*a);
#else
        throw Error("glmtune bench step measures a GPU, and this glmtune was built without CUDA",
                    "glmtune bench step", "build with -DGLMTUNE_CUDA=ON on a machine with CUDA");
#endif
      };
    });
