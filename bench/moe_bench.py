#!/usr/bin/env python3
"""One MoE GPT layer forward + backward on the CPU: mpusim against PyTorch doing the same math.

The model (bench/configs/gpt_moe_layer_n1.json): s = 1024 tokens, b = 1, hidden 512, 8 heads,
no linear biases, float32, no dropout; the layer's MLP is a mixture of 8 experts of ffn 1024
(GeLU), top-2 after the softmax, dropless, with the load-balancing loss; between a 1024-token
embedding and the tied output layer with its cross entropy.
FLOPs counted: the layer's GEMMs, 3 x (8 s h^2 + 4 s^2 h + 2 s h E + 4 k s h f) = 25.8 GFLOP
forward + backward (qkv, proj, the two attention products, the router, each routed token's
fc1 and fc2); the output layer adds 6 s h V = 3.2 GFLOP (12 %) that the rate leaves out.
Contenders, run in turn (round-robin) and quoted as medians over rounds:
  mpusim on 1 rank; tp = 2 with sequence parallelism on 2 ranks, with the allgather and with
  the alltoall dispatcher (each `mpusim run CONFIG --no-check --repeat N`, its median step);
  PyTorch (Debian's python3-torch) with 1 and 2 threads (bench/moe_torch.py: torch.topk,
  index_select and index_add_ per expert).
What it is not: a test. Needs a Release build (bash .ci/setup); run with /usr/bin/python3.

Usage: /usr/bin/python3 bench/moe_bench.py [--rounds 3] [--repeat 3]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

S, H, E, K, F = 1024, 512, 8, 2, 1024
GFLOP = 3 * (8 * S * H * H + 4 * S * S * H + 2 * S * H * E + 4 * K * S * H * F) / 1e9


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
    one = os.path.join(benchlib.ROOT, "bench/configs/gpt_moe_layer_n1.json")
    with open(one) as f:
        base = json.load(f)
    configs = {}
    for dispatcher in ("allgather", "alltoall"):
        c = json.loads(json.dumps(base))
        c["parallel"].update(world_size=2, tensor_model_parallel_size=2, sequence_parallel=True)
        c["model"]["moe_token_dispatcher_type"] = dispatcher
        configs[dispatcher] = benchlib.temp_config(c)

    def run_mpusim(ranks, config):
        return benchlib.mpusim_step(ranks, config, args.repeat)

    def run_torch(threads):
        return benchlib.torch_step("moe_torch.py", threads, args.repeat)

    contenders = {
        "mpusim, 1 rank": (1, run_mpusim(1, one)),
        "pytorch, 1 thread": (1, run_torch(1)),
        "mpusim tp=2 +SP allgather": (2, run_mpusim(2, configs["allgather"])),
        "mpusim tp=2 +SP alltoall": (2, run_mpusim(2, configs["alltoall"])),
        "pytorch, 2 threads": (2, run_torch(2)),
    }
    print(f"{args.rounds} rounds, contenders in turn, {args.repeat} steps per run")
    try:
        results = benchlib.round_robin({k: v[1] for k, v in contenders.items()}, args.rounds)
    finally:
        for path in configs.values():
            os.unlink(path)
    med = {k: benchlib.median(r["step"]) for k, r in results.items()}
    print(f"\n{'one MoE GPT layer fwd+bwd':<27} {'median s':>9} {'GFLOP/s/core':>13}  "
          "(per-round medians)")
    for name, value in med.items():
        cores = contenders[name][0]
        rounds = " ".join(f"{v:.3f}" for v in results[name]["step"])
        print(f"{name:<27} {value:>9.3f} {GFLOP / value / cores:>13.1f}  ({rounds})")
    t1, t2 = med["mpusim, 1 rank"], med["mpusim tp=2 +SP allgather"]
    print(f"speed-up tp=2 over 1 rank: {t1 / t2:.2f}x (alltoall: "
          f"{t1 / med['mpusim tp=2 +SP alltoall']:.2f}x)")
    print(f"pytorch 1 thread / mpusim 1 rank: {med['pytorch, 1 thread'] / t1:.2f}x "
          "(above 1: mpusim is faster)")
    print(f"pytorch 2 threads / mpusim tp=2: {med['pytorch, 2 threads'] / t2:.2f}x")


if __name__ == "__main__":
    main()
