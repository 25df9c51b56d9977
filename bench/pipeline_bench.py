#!/usr/bin/env python3
"""Pipeline efficiency: one GPT step at pp = 2 on 2 ranks against pp = 1 on 1 rank.

The model (bench/configs/gpt_pipeline_p1_n1.json): 4 layers, s = 256, b = 1, hidden 512,
8 heads, ffn 2048, float32, no dropout, 1024-token vocabulary, M = 8 micro-batches.
Contenders, run in turn (round-robin) and quoted as medians over rounds, each
`mpusim run CONFIG --no-check --repeat N` (its median step):
  pp = 1 on 1 rank; pp = 2 on 2 ranks with 1F1B; pp = 2 with vp = 2 (interleaved 1F1B).
The ideal pp = 2 step is the pp = 1 step halved and stretched by the schedule's bubble:
  ideal = T1 / p * (M + p - 1) / M   (1F1B; bubble fraction (p - 1) / (M + p - 1))
  ideal = T1 / p * (M v + p - 1) / (M v)   (interleaved, the bubble shrunk by v)
and what the measured step spends beyond it (`over ideal`) bounds the point-to-point cost
together with the stages' imbalance (stage 0 holds the embedding, stage 1 the output layer
and the loss). What it is not: a test. Needs a Release build; run with /usr/bin/python3.

Usage: /usr/bin/python3 bench/pipeline_bench.py [--rounds 3] [--repeat 3]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.repeat < 2:
        parser.error("--repeat must be at least 2: mpusim run prints a median step only then")
    mpusim = benchlib.mpusim()
    p1 = os.path.join(benchlib.ROOT, "bench/configs/gpt_pipeline_p1_n1.json")
    with open(p1) as f:
        base = json.load(f)
    m = base["run"]["num_microbatches"]
    pp2 = json.loads(json.dumps(base))
    pp2["parallel"] = {"world_size": 2, "pipeline_model_parallel_size": 2}
    vp2 = json.loads(json.dumps(base))
    vp2["parallel"] = {"world_size": 2, "pipeline_model_parallel_size": 2,
                       "virtual_pipeline_model_parallel_size": 2}
    pp2_path, vp2_path = benchlib.temp_config(pp2), benchlib.temp_config(vp2)

    def run(ranks, config):
        return lambda: {"step": benchlib.step_median(benchlib.Measured(
            benchlib.mpirun(ranks) + [mpusim, "run", config, "--no-check", "--repeat",
                                      str(args.repeat)]).out)}

    contenders = {"pp=1, 1 rank": run(1, p1), "pp=2 1F1B, 2 ranks": run(2, pp2_path),
                  "pp=2 vp=2, 2 ranks": run(2, vp2_path)}
    print(f"{args.rounds} rounds, contenders in turn, {args.repeat} steps per run, M = {m}")
    try:
        results = benchlib.round_robin(contenders, args.rounds)
    finally:
        os.unlink(pp2_path)
        os.unlink(vp2_path)
    med = {k: benchlib.median(r["step"]) for k, r in results.items()}
    t1 = med["pp=1, 1 rank"]
    ideals = {"pp=1, 1 rank": t1, "pp=2 1F1B, 2 ranks": t1 / 2 * (m + 1) / m,
              "pp=2 vp=2, 2 ranks": t1 / 2 * (2 * m + 1) / (2 * m)}
    print(f"\n{'one step (8 micro-batches)':<22} {'median s':>9} {'ideal s':>8} {'speed-up':>9} "
          f"{'over ideal':>11}  (per-round medians)")
    for name, value in med.items():
        rounds = " ".join(f"{v:.3f}" for v in results[name]["step"])
        print(f"{name:<22} {value:>9.3f} {ideals[name]:>8.3f} {t1 / value:>8.2f}x "
              f"{100 * (value / ideals[name] - 1):>10.1f}%  ({rounds})")
    print(f"bubble fraction (p - 1) / (M + p - 1): {1 / (m + 1):.3f} (1F1B), "
          f"{1 / (2 * m + 1):.3f} (interleaved, v = 2)")


if __name__ == "__main__":
    main()
