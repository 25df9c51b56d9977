#!/usr/bin/env bash
# The MLP block forward + backward (T = 2048 tokens, hidden 1024, ffn 4096, float32), side by
# side in one run: mpusim at tensor parallel 1 on one rank and 2 on two ranks, and PyTorch on
# the CPU doing the same math with one and two threads (Debian's python3-torch, whose BLAS is
# Debian's OpenBLAS). Prints medians and the ratios the README quotes.
#
# What it is: a fixed, documented command line, so the numbers can be reproduced.
# What it is not: a test. Needs a Release build (bash .ci/setup) and, for the PyTorch rows,
#   apt-get install python3-torch
# Usage: bench/run_mlp_bench.sh [repetitions, default 7]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
reps="${1:-7}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpusim=build/cli/mpusim
[[ -x ${mpusim} ]] || { echo "error: ${mpusim} missing; run bash .ci/setup first" >&2; exit 2; }

median_of() { grep -oE 'median [0-9.]+' | awk '{print $2}'; }
t1=$(mpirun -n 1 "${mpusim}" run bench/configs/mlp_t1_n1.json --no-check --repeat "${reps}" | median_of)
t2=$(mpirun -n 2 "${mpusim}" run bench/configs/mlp_t2_n2.json --no-check --repeat "${reps}" | median_of)
torch1=-
torch2=-
if /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  # OpenBLAS ignores torch.set_num_threads; its own variable sets the core count.
  torch1=$(OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 /usr/bin/python3 bench/mlp_torch.py \
             --threads 1 --repeat "${reps}" | median_of)
  torch2=$(OPENBLAS_NUM_THREADS=2 OMP_NUM_THREADS=2 /usr/bin/python3 bench/mlp_torch.py \
             --threads 2 --repeat "${reps}" | median_of)
fi
# 6 GEMMs of 2 * 2048 * 1024 * 4096 flops each (2 forward, 4 backward).
gflop=$(awk 'BEGIN {print 12 * 2048 * 1024 * 4096 / 1e9}')
printf '%-34s %10s %12s\n' "MLP fwd+bwd (median of ${reps})" "seconds" "GFLOP/s/core"
printf '%-34s %10s %12.1f\n' "mpusim tp=1, 1 rank" "${t1}" "$(awk -v g="${gflop}" -v t="${t1}" 'BEGIN {print g / t}')"
printf '%-34s %10s %12.1f\n' "mpusim tp=2, 2 ranks" "${t2}" "$(awk -v g="${gflop}" -v t="${t2}" 'BEGIN {print g / t / 2}')"
printf '%-34s %10s\n' "pytorch, 1 thread" "${torch1}"
printf '%-34s %10s\n' "pytorch, 2 threads" "${torch2}"
echo "speed-up tp=2 over tp=1:        $(awk -v a="${t1}" -v b="${t2}" 'BEGIN {printf "%.2fx", a / b}')"
if [[ ${torch2} != - ]]; then
  echo "pytorch 1 thread / mpusim tp=1: $(awk -v a="${torch1}" -v b="${t1}" 'BEGIN {printf "%.2fx", a / b}')"
  echo "pytorch 2 threads / mpusim tp=2: $(awk -v a="${torch2}" -v b="${t2}" 'BEGIN {printf "%.2fx", a / b}')"
fi
