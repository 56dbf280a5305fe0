#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>

#include "command.h"
#include "glmtune/base/blas_buffers.h"
#include "glmtune/base/error.h"

namespace glmtune::cli {
std::vector<CommandInfo>& registry() {
  static std::vector<CommandInfo> commands;
  return commands;
}
}  // namespace glmtune::cli

int main(int argc, char** argv) {
  using namespace glmtune;
  // The helper that prepare_blas_buffers() runs to measure OpenBLAS's buffer.
  if (std::getenv(kBlasProbeVariable) != nullptr) return blas_probe_main();
  CLI::App app{"glmtune: fine-tune and evaluate GLM-5.3-Flash", "glmtune"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "glmtune 0.1.0");
  bool verbose = false;
  app.add_flag("-v,--verbose", verbose, "Debug logging");

  auto& commands = cli::registry();
  std::sort(commands.begin(), commands.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  std::function<int()> to_run;
  for (auto& command : commands) {
    CLI::App* sub = app.add_subcommand(command.name, command.help);
    auto run = std::make_shared<std::function<int()>>(command.setup(*sub));
    sub->callback([run, &to_run] { to_run = *run; });
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  spdlog::set_level(verbose ? spdlog::level::debug : spdlog::level::info);
  spdlog::set_pattern("[%H:%M:%S] %^%l%$ %v");
  // The commands that compute: under `ulimit -v` OpenBLAS's buffers are mapped now or the limit is
  // reported. _Exit: OpenBLAS's exit handlers would wait for workers stuck retrying a mapping.
  for (const char* name : {"train", "eval", "bench"}) {
    if (!app.got_subcommand(name)) continue;
    try {
      prepare_blas_buffers();
    } catch (const Error& e) {
      std::fprintf(stderr, "error: %s\n", e.what());
      std::fflush(nullptr);
      std::_Exit(2);
    }
  }
  try {
    return to_run ? to_run() : 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 3;
  }
}
