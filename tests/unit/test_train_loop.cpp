// The training loop end to end on the tiny model and the bundled chat data: the loss goes down,
// an interrupted run resumed from its checkpoint repeats the uninterrupted one bit for bit, a
// process killed in the middle of a checkpoint save resumes from the last complete one, SIGTERM
// saves before exiting, and the checkpoints load in `glmtune eval` and `glmtune inspect`.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "glmtune/io/safetensors.h"
#include "glmtune/model/config.h"
#include "glmtune/model/init.h"
#include "glmtune/train/recipe.h"
#include "glmtune/train/state.h"
#include "glmtune/train/trainer.h"

extern char** environ;

using namespace glmtune;
namespace fs = std::filesystem;

namespace {

const fs::path kSource = GLMTUNE_SOURCE_DIR;
const fs::path kBinary = GLMTUNE_BINARY;

// The data order's seed: fresh every run, printed on failure; GLMTUNE_TEST_SEED reproduces a run.
uint64_t test_seed() {
  static const uint64_t seed = [] {
    const char* env = std::getenv("GLMTUNE_TEST_SEED");
    return env ? std::strtoull(env, nullptr, 10) : uint64_t(std::random_device{}() % 1000);
  }();
  return seed;
}

class TempDir {
 public:
  explicit TempDir(const std::string& tag)
      : path_(fs::temp_directory_path() /
              ("glmtune_train_" + tag + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// One tiny model for the whole binary (init is deterministic for a seed).
const fs::path& tiny_model() {
  static TempDir dir("model");
  static const fs::path path = [] {
    const fs::path p = dir.path() / "tiny";
    model::InitOptions options;
    options.seed = 11;
    model::write_random_checkpoint(model::ModelConfig::preset("tiny"), p, options);
    return p;
  }();
  return path;
}

// A recipe over the bundled data with small packs, so that a step takes a fraction of a second.
std::string recipe_text(const fs::path& out, int64_t steps, int64_t save_every, uint64_t seed) {
  std::ostringstream s;
  s << "[model]\npath = \"" << tiny_model().string() << "\"\n"
    << "tokenizer = \"" << (kSource / "examples/tiny/tokenizer").string() << "\"\n"
    << "[data]\nfiles = [\"" << (kSource / "examples/tiny/data/chat.jsonl").string() << "\"]\n"
    << "format = \"chat\"\nmax_length = 192\npack_max_length = 192\n"
    << "[train]\ntotal_steps = " << steps << "\nmicro_packs = 2\nseed = " << seed
    << "\nrecompute = 0.4\n"
    << "[optimizer]\nlr = 3e-3\nlr_min = 3e-4\nwarmup_steps = 1\n"
    << "[loss]\nmtp_scale = 0.1\nbalancing_alpha = 0.001\nrouter_bias_update_rate = 0.001\n"
    << "[output]\ndir = \"" << out.string() << "\"\nsave_every = " << save_every
    << "\nkeep_last = 0\nlog_every = 1\n";
  return s.str();
}

train::Recipe make_recipe(const fs::path& out, int64_t steps, int64_t save_every) {
  return train::Recipe::parse(recipe_text(out, steps, save_every, test_seed()), "test recipe");
}

std::vector<nlohmann::json> read_metrics(const fs::path& out) {
  std::vector<nlohmann::json> lines;
  std::ifstream in(out / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The glmtune binary as a child process, stdout and stderr into `log`, with extra environment
// variables. Returns its pid.
pid_t spawn(const std::vector<std::string>& args, const fs::path& log,
            const std::vector<std::string>& extra_env = {}) {
  std::vector<std::string> all = {kBinary.string()};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_strings(extra_env);
  for (char** e = environ; *e; ++e) env_strings.emplace_back(*e);
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  const std::string log_path = log.string();
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    ::execve(argv[0], argv.data(), envp.data());
    ::_exit(127);
  }
  return pid;
}

// Exit code, or 128 + signal for a child ended by a signal.
int wait_for(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int run_binary(const std::vector<std::string>& args, const fs::path& log) {
  return wait_for(spawn(args, log));
}

template <typename Pred>
bool wait_until(Pred pred, double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return pred();
}

// The reference trajectory: 6 steps, uninterrupted, run once per binary.
const train::TrainSummary& reference_run() {
  static TempDir dir("reference");
  static const train::TrainSummary summary = [] {
    train::TrainerOptions options;
    options.print_steps = false;
    return train::run_training(make_recipe(dir.path() / "out", 6, 2), options);
  }();
  return summary;
}

uint64_t bits(double v) {
  uint64_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

}  // namespace

TEST(TrainLoop, LossGoesDown) {
  SCOPED_TRACE("data seed " + std::to_string(test_seed()));
  TempDir dir("down");
  train::Recipe recipe = make_recipe(dir.path() / "out", 12, 0);
  train::TrainerOptions options;
  options.print_steps = false;
  const train::TrainSummary s = train::run_training(recipe, options);
  ASSERT_EQ(s.steps.size(), 12u);
  EXPECT_EQ(s.end_step, 12);
  EXPECT_FALSE(s.interrupted);
  EXPECT_EQ(s.skipped_steps, 0);
  double first = 0, last = 0;
  for (int i = 0; i < 3; ++i) first += s.steps[size_t(i)].loss / 3;
  for (int i = 9; i < 12; ++i) last += s.steps[size_t(i)].loss / 3;
  EXPECT_LT(last, first - 0.5) << "first steps " << first << ", last steps " << last;
  for (const auto& m : s.steps) {
    EXPECT_TRUE(std::isfinite(m.loss) && std::isfinite(m.grad_norm));
    EXPECT_GT(m.mtp_loss, 0);
    EXPECT_GT(m.balancing_loss, 0);
    EXPECT_GT(m.text_tokens, 0);
    EXPECT_GE(m.maxvio, 0);
  }
  // save_every = 0: only the final step is saved.
  EXPECT_EQ(train::complete_checkpoint_steps(dir.path() / "out"), (std::vector<int64_t>{12}));
  const auto metrics = read_metrics(dir.path() / "out");
  ASSERT_EQ(metrics.size(), 12u);
  EXPECT_EQ(metrics.back().at("step").get<int64_t>(), 12);
  std::printf("loss %.4f -> %.4f in %.1fs\n", s.steps.front().loss, s.steps.back().loss, s.seconds);
}

TEST(TrainLoop, AnOutputDirThatCannotBeCreatedNamesTheKey) {
  TempDir dir("outdir");
  std::ofstream(dir.path() / "file") << "x";
  const fs::path out = dir.path() / "file" / "run";
  try {
    train::run_training(make_recipe(out, 2, 0), {});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.where(), "test recipe: output.dir") << e.what();
    EXPECT_NE(e.problem().find(out.string()), std::string::npos) << e.what();
    EXPECT_NE(e.problem().find("is a file, not a directory"), std::string::npos) << e.what();
    EXPECT_FALSE(e.fix().empty());
  }
}

TEST(TrainLoop, InterruptedAndResumedRunIsBitIdentical) {
  SCOPED_TRACE("data seed " + std::to_string(test_seed()));
  const train::TrainSummary& ref = reference_run();
  ASSERT_EQ(ref.steps.size(), 6u);
  TempDir dir("resume");
  const fs::path out = dir.path() / "out";
  std::atomic<bool> stop{false};
  train::TrainerOptions first;
  first.print_steps = false;
  first.stop = &stop;
  first.on_step = [&](const train::StepMetrics& m) {
    if (m.step == 3) stop = true;
  };
  const train::TrainSummary a = train::run_training(make_recipe(out, 6, 2), first);
  EXPECT_TRUE(a.interrupted);
  EXPECT_EQ(a.end_step, 3);
  // The stop saved step 3 (off the save_every grid).
  EXPECT_EQ(train::complete_checkpoint_steps(out), (std::vector<int64_t>{2, 3}));

  // Without --resume the directory is refused rather than overwritten.
  EXPECT_THROW(train::run_training(make_recipe(out, 6, 2), {}), Error);

  train::TrainerOptions second;
  second.print_steps = false;
  second.resume = true;
  const train::TrainSummary b = train::run_training(make_recipe(out, 6, 2), second);
  EXPECT_TRUE(b.resumed);
  EXPECT_EQ(b.start_step, 3);
  ASSERT_EQ(b.steps.size(), 3u);
  std::vector<train::StepMetrics> joined = a.steps;
  joined.insert(joined.end(), b.steps.begin(), b.steps.end());
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(bits(joined[i].loss), bits(ref.steps[i].loss)) << "step " << i + 1;
    EXPECT_EQ(bits(joined[i].mtp_loss), bits(ref.steps[i].mtp_loss)) << "step " << i + 1;
    EXPECT_EQ(bits(joined[i].grad_norm), bits(ref.steps[i].grad_norm)) << "step " << i + 1;
    EXPECT_EQ(joined[i].maxvio, ref.steps[i].maxvio) << "step " << i + 1;
  }
  // The final weights are the same bits too.
  const auto ra =
      io::SafetensorsFile::open(ref.checkpoint / "model" / "model-00001-of-00001.safetensors");
  const auto rb =
      io::SafetensorsFile::open(b.checkpoint / "model" / "model-00001-of-00001.safetensors");
  ASSERT_EQ(ra.names(), rb.names());
  for (const std::string& name : ra.names()) {
    const Tensor x = ra.tensor(name), y = rb.tensor(name);
    ASSERT_EQ(x.nbytes(), y.nbytes()) << name;
    EXPECT_EQ(std::memcmp(x.contiguous().data_ptr(), y.contiguous().data_ptr(), x.nbytes()), 0)
        << name;
  }
  // metrics.jsonl holds every step once.
  const auto metrics = read_metrics(out);
  ASSERT_EQ(metrics.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(metrics[i].at("step").get<int64_t>(), int64_t(i + 1));
}

TEST(TrainLoop, KilledDuringSaveResumesFromLastCompleteCheckpoint) {
  SCOPED_TRACE("data seed " + std::to_string(test_seed()));
  const train::TrainSummary& ref = reference_run();
  TempDir dir("kill");
  const fs::path out = dir.path() / "out";
  const fs::path recipe = dir.path() / "recipe.toml";
  std::ofstream(recipe) << recipe_text(out, 6, 2, test_seed());

  // Every save sleeps after writing the model; kill the process inside the step-4 save.
  const pid_t pid = spawn({"train", "--config", recipe.string()}, dir.path() / "killed.log",
                          {std::string(train::kSaveDelayEnv) + "=1500"});
  const fs::path ckdir = out / train::kCheckpointsDir;
  const bool in_save = wait_until(
      [&] {
        if (!fs::exists(ckdir)) return false;
        for (const auto& e : fs::directory_iterator(ckdir))
          if (e.path().filename().string().starts_with(".step-4.tmp")) return true;
        return false;
      },
      90);
  ::kill(pid, SIGKILL);
  EXPECT_EQ(wait_for(pid), 128 + SIGKILL);
  ASSERT_TRUE(in_save) << read_file(dir.path() / "killed.log");
  EXPECT_EQ(train::complete_checkpoint_steps(out), (std::vector<int64_t>{2}));

  const int rc =
      run_binary({"train", "--config", recipe.string(), "--resume"}, dir.path() / "resumed.log");
  const std::string log = read_file(dir.path() / "resumed.log");
  ASSERT_EQ(rc, 0) << log;
  EXPECT_NE(log.find("(step 2)"), std::string::npos) << log;
  EXPECT_NE(log.find("training finished: 6 of 6 steps"), std::string::npos) << log;
  EXPECT_EQ(train::complete_checkpoint_steps(out), (std::vector<int64_t>{2, 4, 6}));
  // No leftover temporary directory after a later save.
  for (const auto& e : fs::directory_iterator(ckdir))
    EXPECT_FALSE(e.path().filename().string().starts_with(".step-4.tmp")) << e.path();
  // The killed run's steps 3-4 were redone: metrics.jsonl equals the uninterrupted trajectory.
  const auto metrics = read_metrics(out);
  ASSERT_EQ(metrics.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(metrics[i].at("step").get<int64_t>(), int64_t(i + 1));
    EXPECT_EQ(bits(metrics[i].at("loss").get<double>()), bits(ref.steps[i].loss)) << i + 1;
  }

  // The final checkpoint is a complete released-layout model that eval and inspect read.
  const fs::path model = out / train::kCheckpointsDir / "step-6" / "model";
  const int irc = run_binary({"inspect", model.string()}, dir.path() / "inspect.log");
  const std::string inspect = read_file(dir.path() / "inspect.log");
  EXPECT_EQ(irc, 0) << inspect;
  EXPECT_NE(inspect.find("layout: complete"), std::string::npos) << inspect;
  const int erc = run_binary({"eval", "--model", model.string(), "--data",
                              (kSource / "examples/tiny/data/chat.jsonl").string(), "--pack-length",
                              "192", "--max-packs", "2", "--json"},
                             dir.path() / "eval.log");
  const std::string eval = read_file(dir.path() / "eval.log");
  ASSERT_EQ(erc, 0) << eval;
  const auto j = nlohmann::json::parse(eval.substr(eval.find('{')));
  EXPECT_TRUE(std::isfinite(j.at("loss").get<double>()));
  EXPECT_LT(j.at("loss").get<double>(), ref.steps.front().loss);
}

TEST(TrainLoop, SigtermSavesAtTheEndOfTheStep) {
  SCOPED_TRACE("data seed " + std::to_string(test_seed()));
  TempDir dir("term");
  const fs::path out = dir.path() / "out";
  const fs::path recipe = dir.path() / "recipe.toml";
  std::ofstream(recipe) << recipe_text(out, 200, 0, test_seed());
  const pid_t pid = spawn({"train", "--config", recipe.string()}, dir.path() / "term.log");
  const bool started = wait_until([&] { return read_metrics(out).size() >= 2; }, 90);
  ::kill(pid, SIGTERM);
  const int rc = wait_for(pid);
  const std::string log = read_file(dir.path() / "term.log");
  ASSERT_TRUE(started) << log;
  EXPECT_EQ(rc, 128 + SIGTERM) << log;
  EXPECT_NE(log.find("training stopped at step"), std::string::npos) << log;
  // The checkpoint is the step metrics.jsonl ends with.
  const auto metrics = read_metrics(out);
  ASSERT_FALSE(metrics.empty());
  const int64_t last = metrics.back().at("step").get<int64_t>();
  EXPECT_LT(last, 200);
  EXPECT_EQ(train::complete_checkpoint_steps(out), (std::vector<int64_t>{last}));
}

// train.fp8 = "tilewise": the GEMMs of the experts, the MLPs and the attention projections take
// block-scaled FP8 operands (ops/fp8.h). The run is another run (every loss moves), it stays near
// the full-precision run (each step within 3% of its loss: e4m3 keeps 3 mantissa bits, so each
// quantised operand is within 2^-4 of itself, and the reference trainer's FP8 run ended 1.3% from
// its bf16 run), and a run stopped at step 2 and resumed gives every later step bit for bit (the
// quantisation is a function of the weights and activations alone).
TEST(TrainLoop, Fp8TilewiseRunStaysNearTheF32RunAndResumesBitIdentical) {
  SCOPED_TRACE("data seed " + std::to_string(test_seed()));
  TempDir dir("fp8-tilewise");
  const auto recipe = [&](const std::string& out, bool fp8) {
    std::string text = recipe_text(dir.path() / out, 4, 0, test_seed());
    if (fp8) text.replace(text.find("[train]\n"), 8, "[train]\nfp8 = \"tilewise\"\n");
    return train::Recipe::parse(text, "test recipe");
  };
  train::TrainerOptions quiet;
  quiet.print_steps = false;
  const train::TrainSummary straight = train::run_training(recipe("straight", true), quiet);
  const train::TrainSummary f32 = train::run_training(recipe("f32", false), quiet);
  ASSERT_EQ(straight.steps.size(), 4u);
  ASSERT_EQ(f32.steps.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_NE(bits(straight.steps[i].loss), bits(f32.steps[i].loss)) << "step " << i + 1;
    EXPECT_LE(std::abs(straight.steps[i].loss - f32.steps[i].loss), 0.03 * f32.steps[i].loss)
        << "step " << i + 1;
  }

  std::atomic<bool> stop{false};
  train::TrainerOptions first = quiet;
  first.stop = &stop;
  first.on_step = [&](const train::StepMetrics& m) {
    if (m.step == 2) stop = true;
  };
  EXPECT_TRUE(train::run_training(recipe("resumed", true), first).interrupted);
  train::TrainerOptions second = quiet;
  second.resume = true;
  const train::TrainSummary rest = train::run_training(recipe("resumed", true), second);
  ASSERT_EQ(rest.steps.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(bits(rest.steps[i].loss), bits(straight.steps[2 + i].loss)) << "step " << 3 + i;
    EXPECT_EQ(bits(rest.steps[i].grad_norm), bits(straight.steps[2 + i].grad_norm))
        << "step " << 3 + i;
  }
}

// LoRA with dropout: the masks are keyed by the seed, the step and the pack, so a run stopped at
// step 2 and resumed gives every later step bit for bit as the uninterrupted run; and dropout
// changes the run (it is applied at all).
TEST(TrainLoop, LoraDropoutRunResumesBitIdentical) {
  SCOPED_TRACE("data seed " + std::to_string(test_seed()));
  TempDir dir("lora-dropout");
  const auto recipe = [&](const std::string& out, double dropout) {
    return train::Recipe::parse(
        recipe_text(dir.path() / out, 4, 0, test_seed()) +
            "[lora]\nrank = 4\nalpha = 8\ntarget_modules = [\"all-linear\"]\ndropout = " +
            std::to_string(dropout) + "\n",
        "test recipe");
  };
  train::TrainerOptions quiet;
  quiet.print_steps = false;
  const train::TrainSummary straight = train::run_training(recipe("straight", 0.2), quiet);
  const train::TrainSummary none = train::run_training(recipe("none", 0.0), quiet);
  ASSERT_EQ(straight.steps.size(), 4u);
  ASSERT_EQ(none.steps.size(), 4u);
  // Step 1 starts from PEFT's B = 0, where dropout changes no loss; the updates differ after.
  EXPECT_NE(bits(straight.steps[3].loss), bits(none.steps[3].loss));

  std::atomic<bool> stop{false};
  train::TrainerOptions first = quiet;
  first.stop = &stop;
  first.on_step = [&](const train::StepMetrics& m) {
    if (m.step == 2) stop = true;
  };
  EXPECT_TRUE(train::run_training(recipe("resumed", 0.2), first).interrupted);
  train::TrainerOptions second = quiet;
  second.resume = true;
  const train::TrainSummary rest = train::run_training(recipe("resumed", 0.2), second);
  ASSERT_EQ(rest.steps.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(bits(rest.steps[i].loss), bits(straight.steps[2 + i].loss)) << "step " << 3 + i;
    EXPECT_EQ(bits(rest.steps[i].grad_norm), bits(straight.steps[2 + i].grad_norm))
        << "step " << 3 + i;
  }
}
