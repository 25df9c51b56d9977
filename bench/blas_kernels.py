#!/usr/bin/env python3
"""One GPT layer step under each OpenBLAS kernel set this CPU runs, and as it comes.

What it measures: `mpirun -n 1 mpusim run bench/configs/gpt_layer_t1_n1.json --no-check
--repeat N` (the median step it prints) with OPENBLAS_CORETYPE set to each of OpenBLAS's
x86-64 kernel sets up to the best this CPU supports (Prescott: SSE3, Haswell: AVX2 + FMA,
SkylakeX: AVX-512, Cooperlake: AVX-512 + bf16), and once with the environment as it comes
(no OPENBLAS_CORETYPE: mpusim pins the best set itself when OpenBLAS chose a lower one,
sim/blas_kernels.h), and once as on a CPU that OpenBLAS does not know: OPENBLAS_CORETYPE=
Prescott taken for OpenBLAS's own fallback (the test hook MPUSIM_OPENBLAS_PRETEND_CHOICE), which
mpusim replaces by the best set it pins. Contenders run in turn (round-robin); medians over rounds and each one's
ratio to the fastest pinned set are printed.
What it is not: a test. Needs a Release build (bash .ci/setup); run with /usr/bin/python3.

Usage: /usr/bin/python3 bench/blas_kernels.py [--rounds 5] [--repeat 3]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

LADDER = ["Prescott", "Haswell", "SkylakeX", "Cooperlake"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    program = benchlib.mpusim()
    config = os.path.join(benchlib.ROOT, "bench/configs/gpt_layer_t1_n1.json")
    benchlib.ENV.pop("OPENBLAS_CORETYPE", None)
    argv = benchlib.mpirun(1) + [program, "run", config, "--no-check", "--repeat",
                                 str(args.repeat)]
    first = benchlib.Measured(argv)
    best, why = benchlib.kernels_of(first.out)
    print(f"as it comes: {best} kernels" + (f" ({why})" if why else ""))
    sets = LADDER[:LADDER.index(best) + 1] if best in LADDER else ["Prescott", best]
    seen = {}

    def contender(name, env):
        def run():
            saved = {k: benchlib.ENV.pop(k, None) for k in env}
            benchlib.ENV.update(env)
            try:
                m = benchlib.Measured(argv)
            finally:
                for k, v in saved.items():
                    benchlib.ENV.pop(k, None)
                    if v is not None:
                        benchlib.ENV[k] = v
            seen[name] = benchlib.kernels_of(m.out)[0]
            return {"step": benchlib.step_median(m.out)}
        return run

    contenders = {
        "as it comes": contender("as it comes", {}),
        "fell back, pinned": contender("fell back, pinned", {
            "OPENBLAS_CORETYPE": "Prescott", "MPUSIM_OPENBLAS_PRETEND_CHOICE": "1"}),
    }
    for k in sets:
        contenders[k] = contender(k, {"OPENBLAS_CORETYPE": k})
    print(f"{args.rounds} rounds, contenders in turn, {args.repeat} steps per run")
    results = benchlib.round_robin(contenders, args.rounds)
    medians = {name: benchlib.median(r["step"]) for name, r in results.items()}
    fastest = min(medians[k] for k in sets)
    print(f"{'contender':<20} {'kernels ran':<12} {'step (s)':>9} {'x fastest':>10}")
    for name, value in medians.items():
        print(f"{name:<20} {seen.get(name, '?'):<12} {value:9.3f} {value / fastest:10.2f}")


if __name__ == "__main__":
    main()
