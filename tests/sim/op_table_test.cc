// The op table (tests/ops/op_table.h) on the CPU backend, and the rule that keeps it whole:
// every Kernels method (each Do* of core/kernels.h) has exactly one row.
#include "tests/ops/op_table.h"

#include <gtest/gtest.h>

#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "sim/eigen_kernels.h"

namespace mpusim {
namespace {

// The names of the backend methods core/kernels.h declares: `virtual ... DoName(`.
std::set<std::string> KernelsMethods() {
  std::ifstream in(std::string(MPUSIM_SOURCE_DIR) + "/core/kernels.h");
  std::stringstream text;
  text << in.rdbuf();
  const std::string source = text.str();
  std::set<std::string> names;
  const std::regex method(R"(virtual\s+[\w:<>]+\s+Do(\w+)\s*\()");
  for (auto it = std::sregex_iterator(source.begin(), source.end(), method);
       it != std::sregex_iterator(); ++it) {
    names.insert((*it)[1].str());
  }
  return names;
}

TEST(OpTable, EveryKernelsMethodHasARow) {
  const std::set<std::string> methods = KernelsMethods();
  ASSERT_GT(methods.size(), 30u) << "core/kernels.h was not read";
  std::multiset<std::string> rows;
  for (const op_table::OpCase& op : op_table::AllOps()) rows.insert(std::string(op.method));
  for (const std::string& m : methods) {
    EXPECT_EQ(rows.count(m), 1u) << "Kernels::" << m << " needs one row in tests/ops/op_table.h";
  }
  for (const std::string& r : rows) {
    EXPECT_TRUE(methods.count(r)) << "row " << r << " names no Do" << r << " of core/kernels.h";
  }
}

TEST(OpTable, EigenEveryDtype) {
  EigenKernels k;
  EigenKernels cpu;
  op_table::CheckAll(k, cpu);
}

}  // namespace
}  // namespace mpusim
