// `glmtune train`: supervised fine-tuning of the text model from a TOML recipe, with checkpoints
// and exact resume (docs/training.md, "Running").

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "command.h"
#include "glmtune/base/fs.h"
#include "glmtune/dist/parallel.h"
#include "glmtune/train/recipe.h"
#include "glmtune/train/trainer.h"

namespace {

using namespace glmtune;

struct TrainArgs {
  std::string config;
  std::vector<std::string> sets;
  bool resume = false;
  double dist_timeout_s = 0;  // 0: the recipe's train.dist_timeout
};

// Every rank of a distributed run logs to OUT/logs/rank-N.log; only rank 0 also prints its
// progress, the others print warnings and errors.
void log_per_rank(const dist::ParallelContext& par, const std::filesystem::path& out_dir,
                  const std::string& key) {
  const std::filesystem::path file =
      out_dir / "logs" / ("rank-" + std::to_string(par.rank()) + ".log");
  create_output_directory(file.parent_path(), key);
  auto console = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  console->set_level(par.is_root() ? spdlog::get_level() : spdlog::level::warn);
  auto to_file = std::make_shared<spdlog::sinks::basic_file_sink_mt>(file.string());
  to_file->set_level(spdlog::level::debug);
  auto logger =
      std::make_shared<spdlog::logger>("glmtune", spdlog::sinks_init_list{console, to_file});
  logger->set_level(spdlog::get_level());
  logger->set_pattern(fmt::format("[%H:%M:%S] rank {} %^%l%$ %v", par.rank()));
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
}

// Set by SIGINT / SIGTERM; the trainer checks it after every step, saves and returns.
std::atomic<bool> g_stop{false};
volatile std::sig_atomic_t g_signal = 0;

extern "C" void on_stop_signal(int sig) {
  g_signal = sig;
  g_stop.store(true);
  // A second signal ends the process at once (the last complete checkpoint stays usable).
  std::signal(sig, SIG_DFL);
  static const char msg[] =
      "\nglmtune: stopping after the current step and saving a checkpoint "
      "(signal again to abort)\n";
  [[maybe_unused]] const ssize_t n = ::write(STDERR_FILENO, msg, sizeof(msg) - 1);
}

void print_summary(const train::TrainSummary& s) {
  const bool ran = !s.steps.empty();
  std::printf("\n");
  if (s.interrupted)
    std::printf("training stopped at step %lld of %lld (resume with --resume)\n",
                (long long)s.end_step, (long long)s.total_steps);
  else
    std::printf("training finished: %lld of %lld steps\n", (long long)s.end_step,
                (long long)s.total_steps);
  if (s.resumed) std::printf("  resumed at   step %lld\n", (long long)s.start_step);
  if (ran) {
    const train::StepMetrics& a = s.steps.front();
    const train::StepMetrics& b = s.steps.back();
    std::printf("  loss         %.4f (step %lld) -> %.4f (step %lld)\n", a.loss, (long long)a.step,
                b.loss, (long long)b.step);
    if (a.mtp_loss != 0 || b.mtp_loss != 0)
      std::printf("  mtp_loss     %.4f -> %.4f\n", a.mtp_loss, b.mtp_loss);
    std::printf("  tokens       %lld trained in %.1fs (%.0f tokens/s)\n", (long long)s.text_tokens,
                s.seconds, s.seconds > 0 ? double(s.text_tokens) / s.seconds : 0.0);
  } else {
    std::printf("  nothing to do: the run had already reached its last step\n");
  }
  if (s.skipped_steps > 0)
    std::printf("  skipped      %lld steps with a non-finite gradient norm\n",
                (long long)s.skipped_steps);
  if (!s.checkpoint.empty()) {
    std::printf("  checkpoint   %s\n", s.checkpoint.string().c_str());
    if (std::filesystem::exists(s.checkpoint / "model"))
      std::printf("  model        %s (released layout, with tokenizer)\n",
                  (s.checkpoint / "model").string().c_str());
    if (std::filesystem::exists(s.checkpoint / "adapter"))
      std::printf("  adapter      %s (PEFT LoRA; glmtune eval --adapter, glmtune merge)\n",
                  (s.checkpoint / "adapter").string().c_str());
  }
  std::printf("  metrics      %s\n", s.metrics.string().c_str());
}

}  // namespace

GLMTUNE_COMMAND(
    train, "train", "Fine-tune the text model (SFT) from a TOML recipe, with exact resume",
    [](CLI::App& app) {
      auto a = std::make_shared<TrainArgs>();
      app.add_option("--config", a->config, "Recipe TOML file (docs/training.md)")->required();
      app.add_option("--set", a->sets,
                     "Override a recipe key, e.g. --set optimizer.lr=1e-4 (repeatable)");
      app.add_flag("--resume", a->resume,
                   "Continue from the newest complete checkpoint of the output directory");
      app.add_option("--dist-timeout", a->dist_timeout_s,
                     "Seconds a collective may wait for the other ranks of a distributed run "
                     "(mpirun / srun) before every rank is ended with an error; overrides the "
                     "recipe's train.dist_timeout (600 by default)")
          ->check(CLI::PositiveNumber);
      return [a] {
        train::Recipe recipe = train::Recipe::load(a->config);
        recipe.apply_sets(a->sets);
        g_stop.store(false);
        std::signal(SIGINT, on_stop_signal);
        std::signal(SIGTERM, on_stop_signal);
        dist::ParallelOptions popt;
        // The flag wins over the recipe's train.dist_timeout.
        popt.timeout_s = a->dist_timeout_s > 0 ? a->dist_timeout_s : recipe.dist_timeout_s;
        popt.ep_size = recipe.ep_size;
        popt.sp_size = recipe.sp_size;
        popt.where = recipe.source() + ": train.ep_size / train.sp_size";
        const std::unique_ptr<dist::ParallelContext> par = dist::ParallelContext::create(popt);
        if (par->distributed())
          log_per_rank(*par, recipe.output_dir, recipe.source() + ": output.dir");
        train::TrainerOptions options;
        options.resume = a->resume;
        options.stop = &g_stop;
        options.parallel = par.get();
        train::TrainSummary summary;
        try {
          summary = train::run_training(recipe, options);
        } catch (const std::exception& e) {
          // One failing rank must not leave the others waiting for it: end them all now.
          if (par->distributed()) par->abort(std::string("error: ") + e.what());
          throw;
        }
        std::signal(SIGINT, SIG_DFL);
        std::signal(SIGTERM, SIG_DFL);
        if (par->is_root()) print_summary(summary);
        // The shell convention for "ended by signal N", although the state was saved cleanly.
        return summary.interrupted ? 128 + int(g_signal) : 0;
      };
    });
