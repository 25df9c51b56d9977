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
and the loss).

To separate the two, each pp = 2 run also writes its last step's timeline (`--summary`:
every rank's forward and backward step spans on the machine's monotonic clock). The
schedule is replayed with those measured step durations and free communication: a step
starts when the rank's previous step has ended and the step it depends on has (the forward
of the previous virtual stage, the backward of the next). That replay is the step this
machine's compute allows, imbalance included; the measured schedule span beyond it is what
point-to-point costs (`p2p`: transfers, their waits and the executor's bookkeeping).
What it is not: a test. Needs a Release build; run with /usr/bin/python3.

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
    # One kernel set for every contender, named in the report (benchlib.pin_kernels).
    print(f"OpenBLAS kernels, every contender: {benchlib.pin_kernels()}")
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

    summary = benchlib.temp_config({})

    def run(ranks, config):
        def measure():
            out = benchlib.Measured(benchlib.mpirun(ranks) + [
                mpusim, "run", config, "--no-check", "--repeat", str(args.repeat),
                "--summary", summary]).out
            result = {"step": benchlib.step_median(out)}
            if ranks > 1:
                with open(summary) as f:
                    real, replayed, busy = replay(json.load(f)["timeline"], ranks)
                result.update(real=real, replayed=replayed, busy=busy)
            return result
        return measure

    contenders = {"pp=1, 1 rank": run(1, p1), "pp=2 1F1B, 2 ranks": run(2, pp2_path),
                  "pp=2 vp=2, 2 ranks": run(2, vp2_path)}
    print(f"{args.rounds} rounds, contenders in turn, {args.repeat} steps per run, M = {m}")
    try:
        results = benchlib.round_robin(contenders, args.rounds)
    finally:
        os.unlink(pp2_path)
        os.unlink(vp2_path)
        os.unlink(summary)
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
    print(f"\n{'schedule of the last step':<22} {'measured':>9} {'replayed':>9} {'p2p':>7} "
          f"{'busiest rank':>13}  (per-round p2p)")
    for name, r in results.items():
        if "real" not in r:
            continue
        over = [100 * (a / b - 1) for a, b in zip(r["real"], r["replayed"])]
        print(f"{name:<22} {benchlib.median(r['real']):>8.3f}s "
              f"{benchlib.median(r['replayed']):>8.3f}s {benchlib.median(over):>6.1f}% "
              f"{benchlib.median(r['busy']):>12.3f}s  ({' '.join(f'{o:.1f}%' for o in over)})")
    print("measured: first step start to the last rank's last send; replayed: the schedule "
          "with the measured step durations and free communication; busiest rank: its "
          "steps' total time")


def replay(timeline, p):
    """(measured span, replayed span, busiest rank's compute) of one step's timeline."""
    real = max(t["schedule_end"] for t in timeline)
    # One rank per stage here; recomputations ("R") lie inside their backward steps.
    ranks = {t["pp_rank"]: [s for s in t["steps"] if s[2] != "R"] for t in timeline}
    v = 1 + max(step[0] for steps in ranks.values() for step in steps)
    done = {}  # (kind, virtual stage, micro-batch) -> end time
    clock = {r: 0.0 for r in ranks}
    position = {r: 0 for r in ranks}
    remaining = sum(len(steps) for steps in ranks.values())
    while remaining:
        progressed = False
        for r, steps in ranks.items():
            while position[r] < len(steps):
                chunk, mb, kind, begin, end = steps[position[r]]
                u = chunk * p + r
                need = (("F", u - 1, mb) if kind == "F" and u > 0 else
                        ("B", u + 1, mb) if kind == "B" and u < p * v - 1 else None)
                if need is not None and need not in done:
                    break
                start = max(clock[r], done[need] if need else 0.0)
                clock[r] = start + (end - begin)
                done[(kind, u, mb)] = clock[r]
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("the timeline's steps cannot be replayed in any order")
    busy = max(sum(e - b for _, _, _, b, e in steps) for steps in ranks.values())
    return real, max(clock.values()), busy


if __name__ == "__main__":
    main()
