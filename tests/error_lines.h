// How many lines of a program's output start with "error: ": the tests that launch the real
// binary check that a refusal is exactly one such line.
#pragma once

#include <string>

namespace mpusim {

inline int ErrorLines(const std::string& output) {
  int lines = 0;
  for (size_t at = output.find("error: "); at != std::string::npos;
       at = output.find("error: ", at + 1)) {
    if (at == 0 || output[at - 1] == '\n') ++lines;
  }
  return lines;
}

}  // namespace mpusim
