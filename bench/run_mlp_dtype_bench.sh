#!/usr/bin/env bash
# The MLP block of bench/configs/mlp_t1_n1.json (forward + backward, T = 2048, hidden 1024,
# ffn 4096, tp 1 on one rank) in each storage dtype, side by side in one run: what 16-bit
# storage costs the CPU backend, which widens 16-bit operands to float32 temporaries and runs
# the float32 kernels. Prints medians and the ratio to float32.
# Usage: bench/run_mlp_dtype_bench.sh [repetitions, default 5]   (needs a Release build)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
reps="${1:-5}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpusim=build/cli/mpusim
[[ -x ${mpusim} ]] || { echo "error: ${mpusim} missing; run bash .ci/setup first" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "${tmp}"' EXIT
printf '%-10s %10s %10s\n' "dtype" "median s" "vs float32"
base=
for dtype in float32 bfloat16 float16 float64; do
  sed "s/\"dtype\": \"float32\"/\"dtype\": \"${dtype}\"/" bench/configs/mlp_t1_n1.json > "${tmp}/${dtype}.json"
  t=$(mpirun -n 1 "${mpusim}" run "${tmp}/${dtype}.json" --no-check --repeat "${reps}" |
        grep -oE 'median [0-9.]+' | awk '{print $2}')
  base=${base:-${t}}
  printf '%-10s %10s %9.2fx\n' "${dtype}" "${t}" "$(awk -v a="${t}" -v b="${base}" 'BEGIN {print a / b}')"
done
