#!/usr/bin/env python3
"""The MLP block (ColumnParallelLinear 1024 -> 4096, GeLU, RowParallelLinear 4096 -> 1024;
T = 2048 tokens, float32, forward + backward with weight gradients) on the CPU backend.

What it measures, every contender run in turn (round-robin) and quoted as medians over rounds:
  speed     mpusim tp=1 on 1 rank and tp=2 on 2 ranks (--no-check --repeat N, the median step)
            against PyTorch doing the same math with 1 and 2 threads (Debian's python3-torch,
            same OpenBLAS), plus the OpenBLAS kernel set each one ran;
  check     a checked tp=2 run against the same run with --no-check: total CPU time of all
            ranks (user + system), wall time, and the reference's memory per rank;
  memory    peak RSS of tp=1 with --repeat 1 and --repeat 8 (flat: a step reuses the last one's
            memory);
  dtypes    (--dtypes) tp=1 in float32, bfloat16, float16 and float64.
What it is not: a test. Needs a Release build (bash .ci/setup); the PyTorch rows need
  apt-get install python3-torch   (run this script with /usr/bin/python3).

Usage: /usr/bin/python3 bench/mlp_bench.py [--rounds 5] [--repeat 3] [--dtypes]
"""
import argparse
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

GFLOP = 12 * 2048 * 1024 * 4096 / 1e9  # 6 GEMMs of 2*T*h*f flops (2 forward, 4 backward)


def have_torch():
    return subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode == 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=5,
                        help="steps per run; the median step leaves out the cold first one")
    parser.add_argument("--dtypes", action="store_true")
    args = parser.parse_args()
    mpusim = benchlib.mpusim()
    # One kernel set for every contender, named in the report (benchlib.pin_kernels).
    print(f"OpenBLAS kernels, every contender: {benchlib.pin_kernels()}")
    t1_config = os.path.join(benchlib.ROOT, "bench/configs/mlp_t1_n1.json")
    t2_config = os.path.join(benchlib.ROOT, "bench/configs/mlp_t2_n2.json")
    info = {}

    def run_mpusim(ranks, config, *flags):
        def run():
            m = benchlib.Measured(benchlib.mpirun(ranks) + [mpusim, "run", config] + list(flags))
            info["mpusim blas"] = benchlib.backend_line(m.out)
            return {"step": benchlib.step_median(m.out)}
        return run

    def run_torch(threads):
        def run():
            with benchlib.blas_threads(threads):
                m = benchlib.Measured([sys.executable, os.path.join(benchlib.ROOT, "bench/mlp_torch.py"),
                                       "--threads", str(threads), "--repeat", str(args.repeat)])
            blas = re.search(r"^blas: (.*)$", m.out, re.M)
            info["torch blas"] = blas.group(1) if blas else "?"
            return {"step": benchlib.step_median(m.out)}
        return run

    print(f"speed: {args.rounds} rounds, contenders in turn, {args.repeat} steps per run")
    contenders = {
        "mpusim tp=1, 1 rank": run_mpusim(1, t1_config, "--no-check", "--repeat", str(args.repeat)),
        "mpusim tp=2, 2 ranks": run_mpusim(2, t2_config, "--no-check", "--repeat", str(args.repeat)),
    }
    if have_torch():
        contenders["pytorch, 1 thread"] = run_torch(1)
        contenders["pytorch, 2 threads"] = run_torch(2)
    speed = benchlib.round_robin(contenders, args.rounds)
    med = {name: benchlib.median(r["step"]) for name, r in speed.items()}
    print(f"\n{'MLP fwd+bwd, T=2048, fp32':<24} {'median s':>9} {'GFLOP/s/core':>13}  (per-round medians)")
    for name, value in med.items():
        cores = 2 if "2" in name.split(",")[1] else 1
        rounds = " ".join(f"{v:.3f}" for v in speed[name]["step"])
        print(f"{name:<24} {value:>9.3f} {GFLOP / value / cores:>13.1f}  ({rounds})")
    for key, value in info.items():
        print(f"{key}: {value}")
    t1, t2 = med["mpusim tp=1, 1 rank"], med["mpusim tp=2, 2 ranks"]
    print(f"speed-up tp=2 over tp=1: {t1 / t2:.2f}x")
    if "pytorch, 1 thread" in med:
        print(f"pytorch 1 thread / mpusim tp=1: {med['pytorch, 1 thread'] / t1:.2f}x "
              "(above 1: mpusim is faster)")
        print(f"pytorch 2 threads / mpusim tp=2: {med['pytorch, 2 threads'] / t2:.2f}x")

    print(f"\ncheck: a checked tp=2 run against --no-check ({args.rounds} rounds, in turn)")
    notes = {}

    def run_checked(flags):
        def run():
            m = benchlib.Measured(benchlib.mpirun(2) + [mpusim, "run", t2_config] + flags)
            ref = re.search(r"^reference memory: (.*)$", m.out, re.M)
            if ref:
                notes["reference memory"] = ref.group(1)
            return {"cpu": m.cpu, "wall": m.wall}
        return run

    check = benchlib.round_robin({"checked": run_checked([]),
                                  "--no-check": run_checked(["--no-check"])}, args.rounds)
    for name, r in check.items():
        print(f"  {name:<11} total CPU {benchlib.median(r['cpu']):6.2f} s   wall "
              f"{benchlib.median(r['wall']):5.2f} s")
    cpu_ratio = benchlib.median(check["checked"]["cpu"]) / benchlib.median(check["--no-check"]["cpu"])
    wall_ratio = benchlib.median(check["checked"]["wall"]) / benchlib.median(check["--no-check"]["wall"])
    print(f"  checked / --no-check: total CPU {cpu_ratio:.2f}x, wall {wall_ratio:.2f}x")
    if "reference memory" in notes:
        print(f"  reference memory: {notes['reference memory']}")

    print("\nmemory: peak RSS of tp=1, --no-check, --repeat 1 vs 8 (in turn)")
    memory = benchlib.round_robin({
        r: (lambda r=r: {"rss": benchlib.Measured(
            benchlib.mpirun(1) + [mpusim, "run", t1_config, "--no-check", "--repeat", str(r)]).max_rss_mib})
        for r in (1, 8)}, min(args.rounds, 3))
    for r, values in memory.items():
        print(f"  --repeat {r}: peak RSS {benchlib.median(values['rss']):.1f} MiB")

    if args.dtypes:
        print(f"\ndtypes: tp=1 step time per storage dtype ({args.rounds} rounds, in turn)")
        base = benchlib.load("bench/configs/mlp_t1_n1.json")
        paths = {}
        for dtype in ("float32", "bfloat16", "float16", "float64"):
            config = dict(base, run=dict(base["run"], dtype=dtype))
            paths[dtype] = benchlib.temp_config(config)
        try:
            dtypes = benchlib.round_robin({
                d: run_mpusim(1, p, "--no-check", "--repeat", str(args.repeat)) for d, p in paths.items()},
                args.rounds)
        finally:
            for p in paths.values():
                os.unlink(p)
        f32 = benchlib.median(dtypes["float32"]["step"])
        for dtype, r in dtypes.items():
            value = benchlib.median(r["step"])
            print(f"  {dtype:<9} {value:.3f} s  {value / f32:.2f}x float32")


if __name__ == "__main__":
    main()
