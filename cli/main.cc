// The mpusim program: forwards to RunCli (cli.h).
#include <iostream>

#include "cli/cli.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  return mpusim::cli::RunCli(args, std::cout, std::cerr);
}
