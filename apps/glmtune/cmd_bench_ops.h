#pragma once
// `glmtune bench ops` (cmd_bench_ops.cpp), a subcommand of `glmtune bench` (cmd_bench.cpp).

#include <CLI/CLI.hpp>
#include <functional>

namespace glmtune::cli {

struct BenchSubcommand {
  CLI::App* app = nullptr;   // parsed() tells whether the command line chose it
  std::function<int()> run;  // runs it (exit code)
};

// Adds `ops` with its options to `bench`.
BenchSubcommand add_bench_ops(CLI::App& bench);

}  // namespace glmtune::cli
