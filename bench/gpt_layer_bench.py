#!/usr/bin/env python3
"""One GPT layer forward + backward on the CPU: mpusim against PyTorch doing the same math.

The model (bench/configs/gpt_layer_t*_n*.json): s = 1024 tokens, b = 1, hidden 1024, 16 heads,
ffn 4096, float32, LayerNorm, learned positions, GeLU, biases, no dropout, one transformer
layer between a 1024-token embedding and the tied output layer with its cross entropy.
FLOPs counted: the layer's GEMMs, 3 x (24 s h^2 + 4 s^2 h) = 90.2 GFLOP forward + backward
(qkv, proj, fc1, fc2 and the two attention products, the full s x s score matrix as both
contenders compute it); the output layer adds 6 s h V = 6.4 GFLOP (7 %) that the rate leaves
out.
Contenders, run in turn (round-robin) and quoted as medians over rounds:
  mpusim tp=1 on 1 rank, tp=2 on 2 ranks (with and without sequence parallelism), each
  `mpusim run CONFIG --no-check --repeat N` (its median step);
  PyTorch (Debian's python3-torch) with 1 and 2 threads (bench/gpt_layer_torch.py).
What it is not: a test. Needs a Release build (bash .ci/setup); run with /usr/bin/python3.

Usage: /usr/bin/python3 bench/gpt_layer_bench.py [--rounds 3] [--repeat 3]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

S, H, FFN = 1024, 1024, 4096
GFLOP = 3 * (24 * S * H * H + 4 * S * S * H) / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.repeat < 2:
        parser.error("--repeat must be at least 2: mpusim run prints a median step only then")
    benchlib.mpusim()  # exits with a message when the build is missing
    # One kernel set for every contender, named in the report (benchlib.pin_kernels).
    print(f"OpenBLAS kernels, every contender: {benchlib.pin_kernels()}")
    t1 = os.path.join(benchlib.ROOT, "bench/configs/gpt_layer_t1_n1.json")
    t2 = os.path.join(benchlib.ROOT, "bench/configs/gpt_layer_t2_n2.json")
    with open(t2) as f:
        sp_config = json.load(f)
    sp_config["parallel"]["sequence_parallel"] = True
    t2_sp = benchlib.temp_config(sp_config)

    def run_mpusim(ranks, config):
        return benchlib.mpusim_step(ranks, config, args.repeat)

    def run_torch(threads):
        return benchlib.torch_step("gpt_layer_torch.py", threads, args.repeat)

    contenders = {
        "mpusim tp=1, 1 rank": (1, run_mpusim(1, t1)),
        "pytorch, 1 thread": (1, run_torch(1)),
        "mpusim tp=2, 2 ranks": (2, run_mpusim(2, t2)),
        "mpusim tp=2 +SP, 2 ranks": (2, run_mpusim(2, t2_sp)),
        "pytorch, 2 threads": (2, run_torch(2)),
    }
    print(f"{args.rounds} rounds, contenders in turn, {args.repeat} steps per run")
    try:
        results = benchlib.round_robin({k: v[1] for k, v in contenders.items()}, args.rounds)
    finally:
        os.unlink(t2_sp)
    med = {k: benchlib.median(r["step"]) for k, r in results.items()}
    print(f"\n{'one GPT layer fwd+bwd':<26} {'median s':>9} {'GFLOP/s/core':>13}  (per-round medians)")
    for name, value in med.items():
        cores = contenders[name][0]
        rounds = " ".join(f"{v:.3f}" for v in results[name]["step"])
        print(f"{name:<26} {value:>9.3f} {GFLOP / value / cores:>13.1f}  ({rounds})")
    one, two = med["mpusim tp=1, 1 rank"], med["mpusim tp=2, 2 ranks"]
    print(f"speed-up tp=2 over tp=1: {one / two:.2f}x (with sequence parallelism: "
          f"{one / med['mpusim tp=2 +SP, 2 ranks']:.2f}x)")
    print(f"pytorch 1 thread / mpusim tp=1: {med['pytorch, 1 thread'] / one:.2f}x "
          "(above 1: mpusim is faster)")
    print(f"pytorch 2 threads / mpusim tp=2: {med['pytorch, 2 threads'] / two:.2f}x")


if __name__ == "__main__":
    main()
