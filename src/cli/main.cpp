// dflash: trains DFlash speculative-decoding drafters against frozen target LLMs, and measures them.
#include <fmt/core.h>

#include <csignal>
#include <exception>

#include "cli/commands.h"

int main(int argc, char** argv) {
  // Past a file-size limit (ulimit -f), writes fail with EFBIG and the writer reports the file,
  // instead of the process dying of SIGXFSZ halfway through a checkpoint.
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{"dflash: train and measure DFlash block-diffusion drafters for speculative decoding"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "dflash 0.1.0");
  dflash::cli::Runner run;
  dflash::cli::add_inspect(app, run);
  dflash::cli::add_forward(app, run);
  dflash::cli::add_train(app, run);
  dflash::cli::add_bench(app, run);
  dflash::cli::add_prepare(app, run);
  dflash::cli::add_tokenize(app, run);
  dflash::cli::add_generate(app, run);
  dflash::cli::add_eval(app, run);
  if (argc > 1 && argv[1][0] != '-') {  // a mistyped command gets named, not "a subcommand is required"
    std::string names;
    bool known = false;
    for (const CLI::App* s : app.get_subcommands([](CLI::App*) { return true; })) {
      names += (names.empty() ? "" : ", ") + s->get_name();
      known = known || s->get_name() == argv[1];
    }
    if (!known) {
      fmt::print(stderr, "dflash: unknown command '{}'; commands: {} (see dflash --help)\n", argv[1], names);
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    return run();
  } catch (const std::exception& e) {
    fmt::print(stderr, "dflash: error: {}\n", e.what());
    return 1;
  }
}
