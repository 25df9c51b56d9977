// The OpenBLAS kernel set a process computes with: the best one this CPU supports, pinned
// before OpenBLAS starts, and proven on a GEMM before it is used.
//
// What it is: OpenBLAS built with DYNAMIC_ARCH (Debian's) picks its kernels once, when the
// library is loaded, from the CPU model it recognises. A CPU newer than the OpenBLAS release
// is not recognised, and 0.3.21 (Debian 12) then falls back to its `Prescott` kernels (SSE3):
// a quarter of a 2022 Xeon's speed, without a word. PinBestBlasKernels reads what the CPU
// supports (AVX-512 with bf16, AVX-512, AVX2 with FMA, AVX, SSE4.2, SSSE3, SSE3: the
// instruction sets OpenBLAS's x86-64 kernel sets need) and, when OpenBLAS chose a set below
// the best one the CPU runs, re-executes the program once with OPENBLAS_CORETYPE naming that
// set. The re-executed process first multiplies integer-valued matrices with the pinned
// kernels (sgemm and dgemm, every transpose) and compares them with a plain loop, exactly (the
// sums stay far below 2^24); a wrong product re-executes once more with OpenBLAS's own choice.
// A user's own OPENBLAS_CORETYPE always wins: nothing is pinned or re-executed then.
// The pin is recorded in the environment (MPUSIM_OPENBLAS_CHOSE), which is how the run
// header (BlasKernelsNote) says which kernels ran and why.
// Test hooks (tests/cli, bench/blas_kernels.py), like MPUSIM_FAULT: a CPU that OpenBLAS
// knows cannot show the fallback, so
//   MPUSIM_OPENBLAS_PRETEND_CHOICE=1  takes a set OPENBLAS_CORETYPE for OpenBLAS's own choice
//                                     (an unknown CPU's fallback), which the pin may replace;
//   MPUSIM_OPENBLAS_PRETEND_WRONG=1   makes the start-up check find the pinned GEMM wrong.
// What it is not: a tuner (no kernel set is timed at start-up; bench/blas_kernels.py measures
// them), or anything on a CPU other than x86-64 or a build without OpenBLAS (no-ops there).
#pragma once

#include <string>

namespace mpusim {

// Called first in main(), before anything else: may replace the process (execv of
// /proc/self/exe with the same arguments), which is safe only before MPI_Init, threads or
// open output files.
void PinBestBlasKernels(char** argv);

// How the kernels came to be chosen, for the run header: "" when OpenBLAS's own choice is
// the best the CPU supports, else "set by OPENBLAS_CORETYPE", or "pinned by mpusim: OpenBLAS
// chose Prescott for this CPU", or "OpenBLAS's choice: the SkylakeX kernels failed the
// start-up GEMM check".
std::string BlasKernelsNote();

// The best of OpenBLAS's x86-64 kernel sets this CPU supports ("Cooperlake", "SkylakeX",
// "Haswell", "Sandybridge", "Nehalem", "Core2", "Prescott"); "" on another architecture.
std::string BestBlasKernelsForCpu();

}  // namespace mpusim
