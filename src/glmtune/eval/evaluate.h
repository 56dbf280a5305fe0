#pragma once
// Evaluation of a checkpoint: the text model's loss, MTP loss and perplexity over data, on the CPU
// reference path (f32) or on a GPU (bf16 weights and compute, fp32 accumulation, the training
// step's kernels). `glmtune eval` is a thin command line over `evaluate`.
//
// Data comes from a text, from chat / text JSONL (tokenized with the checkpoint's tokenizer and
// packed into fixed-length packs, as training does) and from pre-tokenised JSONL, one
// {"input_ids": [...], "labels": [...]} document per line (labels in the Hugging Face convention:
// unshifted, -100 ignored). Several documents share one forward for speed; the forward computes
// every document as if alone, and the per-document losses and logits are taken from that
// document's rows only, so packing changes no number.
//
// With a media root, chat files go through the vision-language pipeline training uses
// (train/vl_batch.h); a VL sample is never cut (its media placeholders would lose their features):
// one longer than the pack length gets a pack of its own. The vision tower runs on the CPU only,
// so data with media is evaluated on the CPU.
//
// Gradients (`dump_grads`): the training forward and backward instead of the plain forward, and
// the gradient of the reported loss (the mean LM cross-entropy over every label token; no MTP, no
// balancing loss) for every trainable parameter under the released names. CPU only: they are the
// f32 reference gradients.

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "glmtune/tensor/device.h"

namespace glmtune::eval {

struct EvalOptions {
  std::string model;    // checkpoint folder (config.json, weights)
  std::string adapter;  // a PEFT LoRA adapter folder applied to the model (model/lora.h)
  std::vector<std::string> data;
  std::string text;
  std::string tokenizer;   // folder with tokenizer.json (default: the model folder)
  std::string media_root;  // evaluate chat files as vision-language conversations
  std::string dump_logits;
  std::string dump_grads;
  int64_t pack_length = 4096;
  int64_t max_packs = 0;  // 0: all
  int64_t loss_chunk = 1024;
  bool mtp = true;
  Device device = Device::cpu();
  // A progress bar over the evaluated tokens on stderr (a log line every few seconds when stderr
  // is not a terminal).
  bool progress = false;
};

struct SampleLoss {
  std::optional<double> loss;  // none for a sample without label tokens
  int64_t tokens = 0;          // label tokens
  int64_t length = 0;
  std::string source;  // "file:line", "--text" or "dataset sample N"
};

struct EvalResult {
  double loss = 0;     // mean over every label token of every sample (not a mean of means)
  int64_t tokens = 0;  // label tokens: the loss's denominator
  std::vector<SampleLoss> per_sample;
  // The training MTP loss: scale × mean over depths of each depth's token-mean CE.
  std::optional<double> mtp_loss, mtp_ce;
  int64_t mtp_targets = 0;
  double mtp_loss_scale = 0;
  int64_t samples = 0, images = 0, videos = 0, packs = 0;
  int64_t input_tokens = 0;  // non-padding tokens
  int64_t slots = 0;         // all pack positions
  double seconds = 0;        // forward time only
  Device device = Device::cpu();

  double perplexity() const;
  double tokens_per_second() const;
  // The object `glmtune eval --json` prints.
  nlohmann::ordered_json to_json() const;
};

// Throws glmtune::Error naming the file (and line), flag or key and the fix for bad input.
EvalResult evaluate(const EvalOptions& options);

}  // namespace glmtune::eval
