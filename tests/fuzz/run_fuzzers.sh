#!/usr/bin/env bash
# tests/fuzz/run_fuzzers.sh: run every fuzz target for a fixed time from the committed corpus.
#
# What it is: the fuzzing step of CI (.ci/run) and the command to fuzz by hand. The targets
# run side by side; each starts from its committed seeds (read only) and writes what it
# discovers into a scratch corpus under OUT_DIR, never into tests/fuzz/corpus/. Per target it prints the executions,
# exec/s, new units and peak RSS that libFuzzer reports (-print_final_stats=1). Exit code 0
# when no target reported a finding; 1 otherwise, after printing each finding's report and
# where its reproducer was saved (copy it into tests/fuzz/findings/ to keep it).
# What it is not: the corpus replay (ctest -R fuzz_replay, in every build) or a build step:
# the fuzzers must already be built (cmake --preset fuzz && cmake --build --preset fuzz).
#
# Usage: bash tests/fuzz/run_fuzzers.sh [BUILD_DIR [SECONDS [OUT_DIR]]]
#   defaults: build-fuzz, 60 seconds per target, BUILD_DIR/fuzz-out
# Inputs are at most 64 KiB (-max_len; longer seeds are cut). Findings besides crashes and
# sanitizer reports: 10 s on one input (-timeout), 2048 MB RSS (-rss_limit_mb), 1 GiB in
# one allocation (-malloc_limit_mb).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build_dir="${1:-build-fuzz}"
seconds="${2:-60}"
out_dir="${3:-${build_dir}/fuzz-out}"
corpus="${repo_root}/tests/fuzz/corpus"

# The committed seed directories of each target (as in tests/fuzz/CMakeLists.txt).
declare -A seeds=(
  [fuzz_config]="${corpus}/fuzz_config ${repo_root}/sample_configs"
  [fuzz_safetensors]="${corpus}/fuzz_safetensors"
  [fuzz_manifest]="${corpus}/fuzz_manifest"
)

targets=(fuzz_config fuzz_safetensors fuzz_manifest)
for target in "${targets[@]}"; do
  binary="${build_dir}/tests/fuzz/${target}"
  if [[ ! -x "${binary}" ]]; then
    echo "[fuzz] error: ${binary} is not built;" \
         "run cmake --preset fuzz && cmake --build --preset fuzz" >&2
    exit 2
  fi
done

# The targets fuzz side by side, each for SECONDS: the step takes SECONDS of wall time, not
# three times that (each target gets the cores' share; libFuzzer is single-threaded).
declare -A pids
for target in "${targets[@]}"; do
  binary="${build_dir}/tests/fuzz/${target}"
  work="${out_dir}/${target}"
  rm -rf "${work}"
  mkdir -p "${work}/corpus" "${work}/artifacts"
  echo "[fuzz] ${target}: ${seconds} s from ${seeds[${target}]}"
  # shellcheck disable=SC2086  # the seed list is split on purpose
  "${binary}" -max_total_time="${seconds}" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
    -malloc_limit_mb=1024 -print_final_stats=1 -artifact_prefix="${work}/artifacts/" \
    "${work}/corpus" ${seeds[${target}]} >"${work}/fuzz.log" 2>&1 &
  pids[${target}]=$!
done

findings=0
for target in "${targets[@]}"; do
  binary="${build_dir}/tests/fuzz/${target}"
  work="${out_dir}/${target}"
  log="${work}/fuzz.log"
  status=0
  wait "${pids[${target}]}" || status=$?
  stat() { sed -n "s/^stat::$1: *//p" "${log}" | tail -n 1; }
  echo "[fuzz] ${target}: $(stat number_of_executed_units) executions," \
       "$(stat average_exec_per_sec) exec/s, $(stat new_units_added) new units," \
       "peak RSS $(stat peak_rss_mb) MB, exit ${status}"
  grep -E '^#[0-9]+[[:space:]]+DONE' "${log}" | tail -n 1 | sed 's/^/[fuzz]   /' || true
  if ((status != 0)); then
    findings=$((findings + 1))
    echo "[fuzz] FINDING in ${target} (exit ${status}); the report (whole log: ${log}):"
    # From its first line on: a sanitizer's or libFuzzer's (crash, timeout, out-of-memory)
    # ERROR, UBSan's runtime error, an uncaught exception, a target's broken invariant.
    sed -n '/ERROR: \|runtime error:\|terminate called\|broken/,$p' "${log}" | head -n 60
    for artifact in "${work}"/artifacts/*; do
      [[ -e "${artifact}" ]] || continue
      echo "[fuzz] reproducer: ${artifact}"
      echo "[fuzz]   replay it: ${binary} ${artifact}"
    done
  fi
done

if ((findings > 0)); then
  echo "[fuzz] ${findings} target(s) reported a finding" >&2
  exit 1
fi
echo "[fuzz] no finding"
