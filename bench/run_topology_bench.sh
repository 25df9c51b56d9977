#!/usr/bin/env bash
# Runs the planner benchmarks (topology_bench.cc) five times and prints the mean, median,
# standard deviation and coefficient of variation of each; quote the medians.
#
# What it is: a fixed, documented command line, so quoted numbers can be reproduced.
# What it is not: a build step. Build first, e.g.
#   cmake --preset release && cmake --build --preset release --target topology_bench
#
# Usage: bench/run_topology_bench.sh [path/to/topology_bench] [extra benchmark flags...]
# The exact command it runs (from the repository root, with the default path):
#   build/bench/topology_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
set -euo pipefail

binary="${1:-build/bench/topology_bench}"
shift || true
if [[ ! -x "${binary}" ]]; then
  echo "error: ${binary}: no such executable; build it first with" >&2
  echo "  cmake --preset release && cmake --build --preset release --target topology_bench" >&2
  exit 2
fi

cmd=("${binary}" --benchmark_repetitions=5 --benchmark_report_aggregates_only=true "$@")
echo "+ ${cmd[*]}"
"${cmd[@]}"
