#pragma once
// Each subcommand lives in its own file and registers itself here, so adding one touches no
// other file.

#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace glmtune::cli {

// Adds the subcommand's options to `app` and returns the function that runs it (exit code).
using CommandSetup = std::function<std::function<int()>(CLI::App& app)>;

struct CommandInfo {
  std::string name;
  std::string help;
  CommandSetup setup;
};

std::vector<CommandInfo>& registry();

struct Registrar {
  Registrar(std::string name, std::string help, CommandSetup setup) {
    registry().push_back({std::move(name), std::move(help), std::move(setup)});
  }
};

}  // namespace glmtune::cli

// Variadic so that the setup lambda may contain unparenthesised commas.
#define GLMTUNE_COMMAND(ident, name, help, ...) \
  static ::glmtune::cli::Registrar glmtune_command_##ident(name, help, __VA_ARGS__)
