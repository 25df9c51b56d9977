#!/usr/bin/env python3
"""Context parallelism: one long-sequence GPT step at cp = 2 on 2 ranks against cp = 1 on 1 rank.

The model (bench/configs/gpt_attention_s8192_n1.json): one layer at s = 8192, b = 1, hidden
256, 4 heads of 64 channels, ffn 1024, RoPE, float32, no dropout, so the step is mostly
attention: its scores, softmax and the two GEMMs around them grow with s^2, the rest with s.
Contenders, run in turn (round-robin) and quoted as medians over rounds, each
`mpusim run CONFIG --no-check --repeat N` (its median step):
  cp = 1 on 1 rank; cp = 2 on 2 ranks with each cp_comm_type:
  "all_gather"  each rank computes the attention of its 4096 queries, chunks r and 3 - r,
                against all 8192 keys (half of those scores are masked);
  "p2p"         the ring: blocks of 2048 queries by 2048 keys, the 3 of 8 whose keys all
                follow their queries skipped, merged by log-sum-exp;
  "a2a"         Ulysses: every position of 2 of the 4 heads after an all-to-all.
Each cp = 2 run also writes its last step's trace (`--trace`); the time rank 0 is blocked on
the cp group (its collectives, and the waits of the ring's sends and receives, as the union
of those intervals) over its step is the share the exchange takes.
What it is not: a test. Needs a Release build; run with /usr/bin/python3.

Usage: /usr/bin/python3 bench/cp_bench.py [--rounds 3] [--repeat 2] [--seq 8192]
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
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--seq", type=int, default=8192)
    args = parser.parse_args()
    if args.repeat < 2:
        parser.error("--repeat must be at least 2: mpusim run prints a median step only then")
    mpusim = benchlib.mpusim()
    # One kernel set for every contender, named in the report (benchlib.pin_kernels).
    print(f"OpenBLAS kernels, every contender: {benchlib.pin_kernels()}")
    with open(os.path.join(benchlib.ROOT, "bench/configs/gpt_attention_s8192_n1.json")) as f:
        base = json.load(f)
    base["run"]["seq_length"] = args.seq
    paths = {"cp=1, 1 rank": (1, benchlib.temp_config(base))}
    for comm in ("all_gather", "p2p", "a2a"):
        cp2 = json.loads(json.dumps(base))
        cp2["parallel"] = {"world_size": 2, "context_parallel_size": 2}
        cp2["model"]["cp_comm_type"] = comm
        paths[f"cp=2 {comm}, 2 ranks"] = (2, benchlib.temp_config(cp2))
    trace = paths["cp=1, 1 rank"][1] + ".trace.json"

    def run(ranks, config):
        def measure():
            argv = benchlib.mpirun(ranks) + [mpusim, "run", config, "--no-check", "--repeat",
                                             str(args.repeat)]
            if ranks > 1:
                argv += ["--trace", trace]
            result = {"step": benchlib.step_median(benchlib.Measured(argv).out)}
            if ranks > 1:
                result["cp_share"] = cp_share(trace)
            return result
        return measure

    contenders = {name: run(ranks, path) for name, (ranks, path) in paths.items()}
    print(f"{args.rounds} rounds, contenders in turn, {args.repeat} steps per run, s = {args.seq}")
    try:
        results = benchlib.round_robin(contenders, args.rounds)
    finally:
        for path in [p for _, p in paths.values()] + [trace]:
            if os.path.exists(path):
                os.unlink(path)
    t1 = benchlib.median(results["cp=1, 1 rank"]["step"])
    print(f"\n{'one step':<26} {'median s':>9} {'speed-up':>9} {'cp collectives':>15}  "
          f"(per-round steps)")
    for name, r in results.items():
        value = benchlib.median(r["step"])
        share = (f"{100 * benchlib.median(r['cp_share']):.1f}%" if "cp_share" in r else "-")
        rounds = " ".join(f"{v:.3f}" for v in r["step"])
        print(f"{name:<26} {value:>9.3f} {t1 / value:>8.2f}x {share:>15}  ({rounds})")
    print("cp collectives: rank 0's time blocked on the cp group (collectives, ring waits) over "
          "its last step (from the trace)")


def cp_share(path):
    """Rank 0's time blocked on the cp group over its step span, from a Chrome trace: the
    union of its cp collectives and its cp send/receive waits."""
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    # Rank 0's tracks: its steps ("rank 0 (...)") and its collectives ("rank 0 collectives").
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
              if e.get("ph") == "M" and e.get("name") == "thread_name"}
    steps = {k for k, name in tracks.items() if name.startswith("rank 0 (")}
    blocked = {k for k, name in tracks.items()
               if name in ("rank 0 collectives", "rank 0 send/recv waits")}
    spans = [e for e in events if e.get("ph") == "X" and (e["pid"], e["tid"]) in steps]
    intervals = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X"
                       and (e["pid"], e["tid"]) in blocked and e["args"].get("group") == "cp")
    comm, reach = 0.0, float("-inf")
    for lo, hi in intervals:  # the union's length: overlapping waits count once
        lo = max(lo, reach)
        if hi > lo:
            comm += hi - lo
        reach = max(reach, hi)
    begin = min(e["ts"] for e in spans)
    end = max(e["ts"] + e["dur"] for e in spans)
    return comm / (end - begin)


if __name__ == "__main__":
    main()
