#!/usr/bin/env python3
"""`mpusim layout` of the 1024-rank GPT-3 sample: this build against a build without the CUDA
backend (MPUSIM_WITH_CUDA=OFF, the "cpu" preset in build-cpu/), contenders in turn.

What it measures: wall time and peak RSS of the whole command (process start-up included),
medians over rounds, and their ratios. The planner never maps a CUDA library: the GPU
backend is a plugin that only `mpusim run --backend cuda` loads, so both builds should cost
the same.
What it is not: the planner's own throughput (bench/run_topology_bench.sh measures that).

Usage: python3 bench/layout_bench.py [--rounds 30]
Builds build-cpu/cli/mpusim first if it is missing (cmake --preset cpu, mpusim target only).
"""
import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

SAMPLE = "sample_configs/gpt3_175b_t8_p16_n1024.json"


def ensure_cpu_build():
    path = os.path.join(benchlib.ROOT, "build-cpu", "cli", "mpusim")
    if not os.access(path, os.X_OK):
        print("building build-cpu/ (MPUSIM_WITH_CUDA=OFF) ...", flush=True)
        for argv in (["cmake", "--preset", "cpu", "-DMPUSIM_BUILD_TESTS=OFF", "-DMPUSIM_BUILD_BENCH=OFF"],
                     ["cmake", "--build", "build-cpu", "--target", "mpusim"]):
            subprocess.run(argv, cwd=benchlib.ROOT, check=True, stdout=subprocess.DEVNULL)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    binaries = {"this build": benchlib.mpusim(), "build without CUDA": ensure_cpu_build()}

    def run(binary):
        def measure():
            m = benchlib.Measured([binary, "layout", SAMPLE])
            return {"wall": m.wall * 1000, "rss": m.max_rss_mib}
        return measure

    print(f"mpusim layout {SAMPLE}: {args.rounds} rounds, contenders in turn")
    results = benchlib.round_robin({name: run(b) for name, b in binaries.items()}, args.rounds)
    print(f"\n{'':<20} {'median ms':>10} {'peak RSS MiB':>13}")
    med = {}
    for name, r in results.items():
        med[name] = (benchlib.median(r["wall"]), benchlib.median(r["rss"]))
        print(f"{name:<20} {med[name][0]:>10.1f} {med[name][1]:>13.1f}")
    a, b = med["this build"], med["build without CUDA"]
    print(f"this build / without CUDA: time {a[0] / b[0]:.2f}x, peak RSS {a[1] / b[1]:.2f}x")


if __name__ == "__main__":
    main()
