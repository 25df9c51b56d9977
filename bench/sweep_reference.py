#!/usr/bin/env python3
"""`mpusim sweep` with stored references against the same sweep without the check, contenders
in turn.

What it measures: wall time of `mpusim sweep CONFIG --world-size N` (each distinct float64
reference computed once by `mpusim reference`, every layout checked against it with `mpusim run
--reference`) and of `mpusim sweep ... --no-check` (every layout run, nothing checked: the sum
of the layouts' own run times, with the same launches); medians over rounds and their ratio,
which is what the check costs a sweep. Also, once, one layout (the config as written) run
three ways: --no-check, --reference (a stored reference) and the inline check, which computes
the reference again.
What it is not: a benchmark of the layouts against each other (they share this machine's
cores).

Usage: python3 bench/sweep_reference.py [--config sample_configs/gpt_sweep_l4_n8.json]
       [--world-size 8] [--rounds 3]
"""
import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="sample_configs/gpt_sweep_l4_n8.json")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    exe = benchlib.mpusim()
    sweep = [exe, "sweep", args.config, "--world-size", str(args.world_size)]

    def run_sweep(flags):
        def run():
            m = benchlib.Measured(sweep + flags)
            layouts = re.search(r"(\d+) of (\d+) layouts (pass|ran)", m.out)
            if not layouts or layouts.group(1) != layouts.group(2):
                raise SystemExit(f"error: not every layout passed:\n{m.out[-3000:]}")
            return {"wall": m.wall, "layouts": int(layouts.group(2))}
        return run

    print(f"{' '.join(sweep)}: {args.rounds} rounds, the two sweeps in turn", flush=True)
    results = benchlib.round_robin(
        {"stored references": run_sweep([]), "--no-check": run_sweep(["--no-check"])},
        args.rounds)
    checked = statistics.median(results["stored references"]["wall"])
    unchecked = statistics.median(results["--no-check"]["wall"])
    layouts = results["stored references"]["layouts"][0]
    print(f"  {layouts} layouts; sweep with stored references: median {checked:.1f} s; "
          f"--no-check: median {unchecked:.1f} s; ratio {checked / unchecked:.2f}")

    # One layout three ways.
    folder = tempfile.mkdtemp(prefix="mpusim_sweep_bench.")
    try:
        reference = os.path.join(folder, "ref")
        ranks = benchlib.mpirun(args.world_size)
        stored = benchlib.Measured(ranks + [exe, "reference", args.config, "--out", reference])
        runs = {
            "--no-check": ranks + [exe, "run", args.config, "--no-check"],
            "--reference": ranks + [exe, "run", args.config, "--reference", reference],
            "inline check": ranks + [exe, "run", args.config],
        }
        times = benchlib.round_robin(
            {name: (lambda argv=argv: {"wall": benchlib.Measured(argv).wall})
             for name, argv in runs.items()}, args.rounds)
        print(f"  the config as written: mpusim reference {stored.wall:.2f} s once; then "
              + ", ".join(f"{name} {statistics.median(t['wall']):.2f} s"
                          for name, t in times.items()))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
