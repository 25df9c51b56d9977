#!/usr/bin/env python3
"""The lab's tiny language model (sample_configs/lab_mlp_lm_t4_dp2_n8.json: embedding, MLP with
dropout, tied head, vocab-parallel cross entropy; tensor parallel 4) on K ranks of this
machine, K = 8, 64, 256 by default (data parallel K/4).

What it measures, per K, contenders in turn:
  checked     `mpirun -n K mpusim run` with the float64 check (one reference for the job)
  --no-check  the same without the check
  mpi floor   an MPI program that only starts and stops (bench/mpi_startup.cc): what Open
              MPI alone needs to start K processes on this machine
wall time and the job's real memory: the peak over the run of the sum of every rank's PSS
(proportional set size, sampled every 20 ms: pages shared between ranks counted once; a
sum of RSS would count each shared library once per rank).
What it is not: a test. Needs a Release build (bash .ci/setup builds bench/ too).

Usage: python3 bench/scale_bench.py [--ranks 8,64,256] [--rounds 3]
(K = 256 takes about a minute per run on 2 cores, most of it in MPI_Init.)
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

TEMPLATE = "sample_configs/lab_mlp_lm_t4_dp2_n8.json"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="8,64,256")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    mpusim = benchlib.mpusim()
    # One kernel set for every contender, named in the report (benchlib.pin_kernels).
    print(f"OpenBLAS kernels, every contender: {benchlib.pin_kernels()}")
    floor = os.path.join(benchlib.ROOT, "build", "bench", "mpi_startup")
    if not os.access(floor, os.X_OK):
        raise SystemExit(f"error: {floor} missing; build it: cmake --build build --target mpi_startup")
    print(f"{'K':>4} {'contender':<11} {'median wall s':>13} {'peak PSS MiB (all ranks)':>25}")
    for ranks in [int(k) for k in args.ranks.split(",")]:
        config = benchlib.load(TEMPLATE)
        config["parallel"]["world_size"] = ranks
        path = benchlib.temp_config(config)
        marker = os.path.basename(path)

        def job(argv, tag):
            def run():
                m = benchlib.Measured(benchlib.mpirun(ranks) + argv, sample_pss_of=tag)
                return {"wall": m.wall, "pss": m.peak_pss_mib}
            return run

        rounds = args.rounds if ranks <= 64 else 1
        try:
            results = benchlib.round_robin({
                "checked": job([mpusim, "run", path], marker),
                "--no-check": job([mpusim, "run", path, "--no-check"], marker),
                "mpi floor": job([floor], "mpi_startup"),
            }, rounds)
        finally:
            os.unlink(path)
        for name, r in results.items():
            print(f"{ranks:>4} {name:<11} {benchlib.median(r['wall']):>13.2f} "
                  f"{benchlib.median(r['pss']):>25.1f}", flush=True)


if __name__ == "__main__":
    main()
