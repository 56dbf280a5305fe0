// `glmtune eval`: the command line of eval/evaluate.h (the loss, MTP loss and perplexity of a
// checkpoint over data, on the CPU reference path or on a GPU).

#include <spdlog/spdlog.h>

#include <cstdio>
#include <memory>

#include "command.h"
#include "glmtune/base/error.h"
#include "glmtune/eval/evaluate.h"

namespace {

using namespace glmtune;

struct EvalArgs {
  eval::EvalOptions options;
  std::string device = "cpu";
  bool no_mtp = false;
  bool json = false;
};

void print_summary(const eval::EvalResult& r, const eval::EvalOptions& o) {
  std::printf("device       %s\n", r.device.str().c_str());
  std::printf("samples      %lld in %lld packs (%lld tokens, %lld slots, %lld targets)\n",
              (long long)r.samples, (long long)r.packs, (long long)r.input_tokens,
              (long long)r.slots, (long long)r.tokens);
  if (r.images + r.videos > 0)
    std::printf("media        %lld images, %lld videos\n", (long long)r.images,
                (long long)r.videos);
  std::printf("loss         %.6f\n", r.loss);
  std::printf("perplexity   %.4f\n", r.perplexity());
  if (r.mtp_loss)
    std::printf("mtp_loss     %.6f (%.2f x mtp CE %.6f over %lld targets)\n", *r.mtp_loss,
                r.mtp_loss_scale, *r.mtp_ce, (long long)r.mtp_targets);
  std::printf("tokens/s     %.1f (%.2fs forward)\n", r.tokens_per_second(), r.seconds);
  if (!o.dump_logits.empty()) std::printf("logits       %s\n", o.dump_logits.c_str());
  if (!o.dump_grads.empty()) std::printf("gradients    %s\n", o.dump_grads.c_str());
}

}  // namespace

GLMTUNE_COMMAND(
    eval, "eval",
    "Evaluate loss, MTP loss and perplexity of a checkpoint on text, JSONL or vision-language data",
    [](CLI::App& app) {
      auto a = std::make_shared<EvalArgs>();
      app.add_option("--model", a->options.model,
                     "Checkpoint directory (config.json, weights, tokenizer)")
          ->required();
      app.add_option("--data", a->options.data,
                     "JSONL file(s): pre-tokenised ({\"input_ids\": [...], \"labels\": [...]}), "
                     "chat ({\"messages\": ...}) or text ({\"text\": ...}) lines");
      app.add_option("--text", a->options.text,
                     "A text to evaluate, as one {\"text\": ...} sample");
      app.add_option("--media-root", a->options.media_root,
                     "Evaluate chat files as vision-language conversations: {\"type\": "
                     "\"image\", \"image\": PATH} / {\"type\": \"video\", \"video\": PATH} "
                     "content items, relative PATHs resolved against this folder (docs/vision.md)");
      app.add_option("--tokenizer", a->options.tokenizer,
                     "Folder with tokenizer.json and, for --media-root, processor_config.json "
                     "(default: the --model folder)");
      app.add_option("--adapter", a->options.adapter,
                     "A LoRA adapter folder (adapter_config.json, adapter_model.safetensors: "
                     "glmtune's <checkpoint>/adapter or PEFT's save_pretrained) applied to the "
                     "model; CPU only");
      app.add_option("--dump-logits", a->options.dump_logits,
                     "Write each sample's logits as float32 logits.<i> [len_i, vocab] to this "
                     "safetensors file");
      app.add_option(
          "--dump-grads", a->options.dump_grads,
          "Write the gradient of the reported loss (mean LM cross-entropy; no MTP, no "
          "balancing loss) for every trainable parameter, float32 under the released "
          "names, to this safetensors file (with images or videos in the data, the vision "
          "tower's and projector's model.visual.* too)");
      app.add_option("--pack-length", a->options.pack_length,
                     "Tokens per pack (chat / text samples longer than this are truncated; a "
                     "longer pre-tokenised or vision-language sample gets a pack of its own)")
          ->check(CLI::PositiveNumber);
      app.add_option("--max-packs", a->options.max_packs, "Stop after this many packs (0: all)")
          ->check(CLI::NonNegativeNumber);
      app.add_option("--loss-chunk", a->options.loss_chunk, "Rows per lm_head chunk of the loss")
          ->check(CLI::PositiveNumber);
      app.add_option("--device", a->device,
                     "cpu (the f32 reference path) or cuda[:N] (bf16 weights and compute on that "
                     "GPU; text data only, no --dump-grads)");
      app.add_flag("--no-mtp", a->no_mtp, "Skip the MTP layer");
      app.add_flag("--json", a->json, "Print one JSON object instead of a summary");
      return [a] {
        eval::EvalOptions o = a->options;
        o.device = Device::parse(a->device);
        o.mtp = !a->no_mtp;
        // Progress goes to stderr (a bar on a terminal, log lines otherwise); --json keeps stdout
        // one object and the log quiet.
        if (a->json) spdlog::set_level(spdlog::level::warn);
        o.progress = true;
        const eval::EvalResult result = eval::evaluate(o);
        if (a->json)
          std::printf("%s\n", result.to_json().dump().c_str());
        else
          print_summary(result, o);
        return 0;
      };
    });
