// `glmtune eval`: the text model's loss, MTP loss and perplexity over packed data, on the CPU
// reference path (docs/model/text_model.md, "glmtune eval").

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <numeric>

#include "command.h"
#include "glmtune/base/error.h"
#include "glmtune/data/dataset.h"
#include "glmtune/data/packing.h"
#include "glmtune/data/tokenizer.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/model.h"

namespace {

using namespace glmtune;
namespace fs = std::filesystem;

struct EvalArgs {
  std::string model;
  std::vector<std::string> data;
  std::string text;
  int64_t pack_length = 4096;
  int64_t max_packs = 0;
  int64_t loss_chunk = 1024;
  bool no_mtp = false;
  bool json = false;
};

struct Totals {
  double lm_sum = 0;
  int64_t lm_count = 0;
  std::vector<double> mtp_sum;
  std::vector<int64_t> mtp_count;
  int64_t packs = 0;
  int64_t tokens = 0;  // non-padding tokens
  int64_t slots = 0;   // all pack positions
  double seconds = 0;  // forward time only
};

Tensor int32_tensor(const std::vector<int32_t>& v) {
  return Tensor::from_vector(v, {int64_t(v.size())});
}

void evaluate_pack(const model::text::TextModel& model, const data::Pack& pack,
                   const model::text::ForwardOptions& options, Totals& t) {
  model::text::PackInput in;
  in.input_ids = int32_tensor(pack.input_ids);
  in.cu_seqlens = int32_tensor(pack.cu_seqlens);
  in.labels = int32_tensor(pack.labels);
  in.padding_tokens = pack.num_padding;
  const auto start = std::chrono::steady_clock::now();
  const model::text::ForwardOutput out = model.forward(in, options);
  t.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  t.lm_sum += out.lm->sum;
  t.lm_count += out.lm->count;
  if (out.mtp) {
    t.mtp_sum.resize(out.mtp->ce.size(), 0.0);
    t.mtp_count.resize(out.mtp->ce.size(), 0);
    for (size_t k = 0; k < out.mtp->ce.size(); ++k) {
      t.mtp_sum[k] += out.mtp->ce[k].sum;
      t.mtp_count[k] += out.mtp->ce[k].count;
    }
  }
  ++t.packs;
  t.slots += int64_t(pack.input_ids.size());
  t.tokens += int64_t(pack.input_ids.size()) - pack.num_padding;
}

}  // namespace

GLMTUNE_COMMAND(
    eval, "eval", "Evaluate loss, MTP loss and perplexity of a checkpoint on text or JSONL data",
    [](CLI::App& app) {
      auto a = std::make_shared<EvalArgs>();
      app.add_option("--model", a->model, "Checkpoint directory (config.json, weights, tokenizer)")
          ->required();
      app.add_option("--data", a->data,
                     "JSONL file(s) of chat ({\"messages\": ...}) or text ({\"text\": ...}) lines");
      app.add_option("--text", a->text, "A text to evaluate, as one {\"text\": ...} sample");
      app.add_option("--pack-length", a->pack_length,
                     "Tokens per pack for --data (longer samples are truncated)")
          ->check(CLI::PositiveNumber);
      app.add_option("--max-packs", a->max_packs, "Stop after this many packs (0: all)")
          ->check(CLI::NonNegativeNumber);
      app.add_option("--loss-chunk", a->loss_chunk, "Rows per lm_head chunk of the loss")
          ->check(CLI::PositiveNumber);
      app.add_flag("--no-mtp", a->no_mtp, "Skip the MTP layer");
      app.add_flag("--json", a->json, "Print one JSON object instead of a summary");
      return [a] {
        if (a->data.empty() && a->text.empty())
          throw Error("nothing to evaluate", "glmtune eval", "give --data FILE.jsonl or --text");
        // Progress goes to stdout through the default logger; --json keeps stdout one object.
        if (a->json) spdlog::set_level(spdlog::level::warn);
        const fs::path dir(a->model);
        const fs::path tokenizer_file = dir / "tokenizer.json";
        if (!fs::exists(tokenizer_file))
          throw Error("the checkpoint has no tokenizer.json", tokenizer_file.string(),
                      "copy the model's tokenizer files next to its weights (glmtune init "
                      "--tokenizer DIR does this for random checkpoints)");
        const data::Tokenizer tokenizer = data::Tokenizer::from_file(tokenizer_file.string());
        const int32_t pad_id = tokenizer.require_id("<|endoftext|>");

        const auto load_start = std::chrono::steady_clock::now();
        const model::ModelConfig config =
            model::ModelConfig::from_file((dir / "config.json").string());
        const model::text::TextModel model = [&] {
          const io::CheckpointReader reader = io::CheckpointReader::open(dir);
          const model::ParamStore store = model::ParamStore::load(reader, config);
          return model::text::TextModel(store);
        }();
        if (tokenizer.vocab_size() > model.text().vocab_size)
          throw Error(fmt::format("the tokenizer has {} tokens but the model only {}",
                                  tokenizer.vocab_size(), model.text().vocab_size),
                      tokenizer_file.string(), "use the tokenizer that came with the checkpoint");
        spdlog::info(
            "loaded {} in {:.1f}s", a->model,
            std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count());

        model::text::ForwardOptions options;
        options.logits = false;
        options.loss_chunk_rows = a->loss_chunk;
        options.mtp = !a->no_mtp;
        Totals totals;
        auto done = [&] { return a->max_packs > 0 && totals.packs >= a->max_packs; };

        if (!a->text.empty()) {
          // The same sample a {"text": ...} line gives: the text, a final <|endoftext|>, all
          // tokens trained.
          data::TokenizedSample s;
          s.input_ids = tokenizer.encode(a->text);
          s.input_ids.push_back(pad_id);
          s.labels = s.input_ids;
          evaluate_pack(model, data::build_pack({s}, {0}, int64_t(s.input_ids.size()), pad_id),
                        options, totals);
        }
        if (!a->data.empty() && !done()) {
          data::DatasetConfig dc;
          dc.files = a->data;
          dc.max_length = a->pack_length;
          const data::JsonlDataset dataset = data::JsonlDataset::scan(dc, tokenizer);
          if (dataset.size() == 0)
            throw Error("no usable sample in the data", fmt::format("{}", fmt::join(a->data, ", ")),
                        "check the files' format (docs/data.md)");
          std::vector<int64_t> order(size_t(dataset.size()));
          std::iota(order.begin(), order.end(), 0);
          const auto plan = data::plan_packs(
              order, [&](int64_t i) { return dataset.length(i); }, a->pack_length, 100);
          auto last_log = std::chrono::steady_clock::now();
          for (const auto& indices : plan) {
            if (done()) break;
            const data::Pack pack =
                data::build_pack(dataset.load(indices), indices, a->pack_length, pad_id);
            evaluate_pack(model, pack, options, totals);
            const auto now = std::chrono::steady_clock::now();
            if (now - last_log > std::chrono::seconds(10)) {
              last_log = now;
              spdlog::info("pack {}/{}: loss {:.4f}", totals.packs, plan.size(),
                           totals.lm_sum / std::max<int64_t>(totals.lm_count, 1));
            }
          }
        }
        if (totals.lm_count == 0)
          throw Error("no token carries a loss", "glmtune eval",
                      "evaluate text with at least two tokens, or chat data with assistant turns");

        const double loss = totals.lm_sum / double(totals.lm_count);
        nlohmann::ordered_json j;
        j["packs"] = totals.packs;
        j["tokens"] = totals.tokens;
        j["slots"] = totals.slots;
        j["targets"] = totals.lm_count;
        j["loss"] = loss;
        j["perplexity"] = std::exp(loss);
        if (!totals.mtp_sum.empty()) {
          // The logged MTP loss is the training one: scale × mean over depths of each depth's
          // token-mean CE (here over every pack evaluated).
          double mean = 0;
          for (size_t k = 0; k < totals.mtp_sum.size(); ++k)
            mean += totals.mtp_count[k] > 0 ? totals.mtp_sum[k] / double(totals.mtp_count[k]) : 0;
          mean /= double(totals.mtp_sum.size());
          j["mtp_loss"] = options.mtp_loss_scale * mean;
          j["mtp_ce"] = mean;
          j["mtp_targets"] = totals.mtp_count[0];
        }
        j["seconds"] = totals.seconds;
        j["tokens_per_second"] = totals.tokens / std::max(totals.seconds, 1e-9);
        if (a->json) {
          std::printf("%s\n", j.dump().c_str());
        } else {
          std::printf("packs        %lld (%lld tokens, %lld slots, %lld targets)\n",
                      (long long)totals.packs, (long long)totals.tokens, (long long)totals.slots,
                      (long long)totals.lm_count);
          std::printf("loss         %.6f\n", loss);
          std::printf("perplexity   %.4f\n", std::exp(loss));
          if (j.contains("mtp_loss"))
            std::printf("mtp_loss     %.6f (%.2f x mtp CE %.6f over %lld targets)\n",
                        j["mtp_loss"].get<double>(), options.mtp_loss_scale,
                        j["mtp_ce"].get<double>(), (long long)j["mtp_targets"].get<int64_t>());
          std::printf("tokens/s     %.1f (%.2fs forward)\n", j["tokens_per_second"].get<double>(),
                      totals.seconds);
        }
        return 0;
      };
    });
