#!/usr/bin/env python3
"""On one GPU: mpusim's CUDA backend against PyTorch eager doing the same math.

Cases (bench/configs/gpu_*_n1.json on 1 rank, NCCL communicators of one rank):
  gpt_layer  one GPT layer forward + backward, s = 2048, b = 1, hidden 4096, 32 heads,
             ffn 16384, with its 1024-token embedding, tied output layer and cross entropy
             (bench/gpt_layer_torch.py --device cuda), in bfloat16 and float32;
  mlp        the MLP block, 2048 tokens, 4096 -> 16384 -> 4096 (bench/mlp_torch.py
             --device cuda), in bfloat16 and float32.
FLOPs counted: the GEMMs, forward + backward = 3 x forward; a GPT layer's forward is
24 s h^2 + 4 s^2 h (qkv, proj, fc1, fc2 and both attention products over the full s x s
scores, as both contenders compute them), the MLP's 4 T h f. The output layer (6 s h V,
1.6 % here) is left out of the rate.
Each round runs every contender once, in turn (round-robin); each contender reports the
median of --repeat steps after a warm-up step, and the table quotes the median over rounds
and the ratio mpusim / PyTorch (below 1.0: mpusim is faster). float32 GEMMs are pedantic on
both sides (no TF32).
What it is not: a test, or a CPU benchmark (bench/gpt_layer_bench.py, bench/mlp_bench.py).
tools/gpu-kit/run calls it with the kit's launcher; by hand, from a build with CUDA:

Usage: python3 bench/gpu_bench.py [--rounds 3] [--repeat 10] [--cases gpt_layer,mlp]
           [--dtypes bfloat16,float32] [--mpusim build/cli/mpusim] [--mpirun mpirun]
           [--kit-exec WRAPPER] [--max-seconds S] [--json FILE] [--markdown FILE]
       /usr/bin/python3 bench/gpu_bench.py --device cpu --smoke --rounds 1 --repeat 2
           (no GPU: the script itself, on the CPU benchmarks' sizes)
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
S, H, HEADS, FFN, VOCAB = 2048, 4096, 32, 16384, 1024

# --smoke: the CPU benchmarks' smaller sizes (bench/configs/gpt_layer_t1_n1.json, mlp_t1_n1.json),
# for checking this script where no GPU is (with --device cpu).
SMOKE = {
    "gpt_layer": {
        "config": "bench/configs/gpt_layer_t1_n1.json",
        "torch": ["bench/gpt_layer_torch.py"],
        "gflop": 3 * (24 * 1024 * 1024 * 1024 + 4 * 1024 * 1024 * 1024) / 1e9,
        "what": "GPT layer s 1024, h 1024, 16 heads, ffn 4096",
    },
    "mlp": {
        "config": "bench/configs/mlp_t1_n1.json",
        "torch": ["bench/mlp_torch.py"],
        "gflop": 3 * 4 * 2048 * 1024 * 4096 / 1e9,
        "what": "MLP T 2048, 1024 -> 4096 -> 1024",
    },
}

CASES = {
    "gpt_layer": {
        "config": "bench/configs/gpu_gpt_layer_n1.json",
        "torch": ["bench/gpt_layer_torch.py", "--seq", str(S), "--hidden", str(H), "--heads",
                  str(HEADS), "--ffn", str(FFN), "--vocab", str(VOCAB)],
        "gflop": 3 * (24 * S * H * H + 4 * S * S * H) / 1e9,
        "what": f"GPT layer s {S}, h {H}, {HEADS} heads, ffn {FFN}",
    },
    "mlp": {
        "config": "bench/configs/gpu_mlp_n1.json",
        "torch": ["bench/mlp_torch.py", "--tokens", str(S), "--hidden", str(H), "--ffn", str(FFN)],
        "gflop": 3 * 4 * S * H * FFN / 1e9,
        "what": f"MLP T {S}, {H} -> {FFN} -> {H}",
    },
}


def run(argv, timeout):
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=ENV, cwd=ROOT,
                          timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n"
                           f"{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
    match = re.search(r"median ([0-9.]+) s", proc.stdout)
    if not match:
        raise RuntimeError(f"no 'median ... s' in the output of {' '.join(argv)}:\n"
                           f"{proc.stdout[-1500:]}")
    return float(match.group(1)), wall, proc.stdout


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--cases", default="gpt_layer,mlp")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--mpusim", default=os.path.join(ROOT, "build", "cli", "mpusim"))
    parser.add_argument("--mpirun", default="mpirun")
    parser.add_argument("--kit-exec", default="", help="a wrapper that runs mpusim's processes "
                        "with the GPU kit's libraries (tools/gpu-kit/run writes it)")
    parser.add_argument("--python", default=sys.executable, help="the Python with PyTorch")
    parser.add_argument("--max-seconds", type=float, default=0,
                        help="start no round after this many seconds (0: no limit)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: both contenders on the CPU (a check of this script)")
    parser.add_argument("--smoke", action="store_true", help="the CPU benchmarks' smaller sizes")
    parser.add_argument("--json", default="")
    parser.add_argument("--markdown", default="")
    args = parser.parse_args()
    if args.repeat < 2:
        parser.error("--repeat must be at least 2: mpusim run prints a median step only then")
    cases = [c for c in args.cases.split(",") if c]
    dtypes = [d for d in args.dtypes.split(",") if d]
    specs = SMOKE if args.smoke else CASES
    for c in cases:
        if c not in CASES:
            parser.error(f"--cases: '{c}' is not one of {', '.join(CASES)}")
    for d in dtypes:
        if d not in ("bfloat16", "float32", "float16"):
            parser.error(f"--dtypes: '{d}' is not bfloat16, float32 or float16")

    launcher = [args.kit_exec] if args.kit_exec else []
    contenders = []  # (case, dtype, who, argv)
    backend = ["--backend", "cuda", "--comm", "nccl"] if args.device == "cuda" else []
    for case in cases:
        spec = specs[case]
        for dtype in dtypes:
            contenders.append((case, dtype, "mpusim", launcher + [
                args.mpirun, "-n", "1", args.mpusim, "run", spec["config"], *backend,
                "--no-check", "--repeat", str(args.repeat), "--dtype", dtype]))
            contenders.append((case, dtype, "pytorch", [
                args.python, *spec["torch"], "--device", args.device, "--dtype", dtype,
                "--repeat", str(args.repeat)]))

    start = time.perf_counter()
    times = {(c, d, w): [] for c, d, w, _ in contenders}
    notes = {}
    failed = []
    rounds_done = 0
    for r in range(args.rounds):
        if args.max_seconds and r > 0 and time.perf_counter() - start > args.max_seconds * r / (r + 1):
            print(f"stopping after {r} round(s): the next would pass --max-seconds "
                  f"{args.max_seconds:.0f}", flush=True)
            break
        for case, dtype, who, argv in contenders:
            key = (case, dtype, who)
            if key in failed:
                continue
            try:
                step, wall, out = run(argv, timeout=max(60, args.max_seconds or 600))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"error: {case} {dtype} {who}: {e}", flush=True)
                failed.append(key)
                continue
            times[key].append(step)
            if who == "mpusim":
                backend = re.search(r"^backend: (.*)$", out, re.M)
                notes["mpusim"] = backend.group(1) if backend else "?"
            print(f"round {r + 1}: {case:9s} {dtype:8s} {who:7s} median step {step * 1e3:9.2f} ms "
                  f"(process {wall:.1f} s)", flush=True)
        rounds_done = r + 1

    rows = []
    for case in cases:
        for dtype in dtypes:
            m, t = times[(case, dtype, "mpusim")], times[(case, dtype, "pytorch")]
            if not m or not t:
                rows.append({"case": case, "dtype": dtype, "error": "no measurement"})
                continue
            mm, tm = statistics.median(m), statistics.median(t)
            gflop = specs[case]["gflop"]
            rows.append({"case": case, "what": specs[case]["what"], "dtype": dtype,
                         "mpusim_s": mm, "pytorch_s": tm, "ratio": mm / tm,
                         "mpusim_tflops": gflop / mm / 1e3, "pytorch_tflops": gflop / tm / 1e3,
                         "rounds": len(m)})
    table = ["| case | dtype | mpusim (ms) | PyTorch eager (ms) | mpusim / PyTorch | "
             "mpusim TFLOP/s | PyTorch TFLOP/s |", "|---|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        if "error" in row:
            table.append(f"| {row['case']} | {row['dtype']} | - | - | {row['error']} | - | - |")
            continue
        table.append(f"| {row['what']} | {row['dtype']} | {row['mpusim_s'] * 1e3:.2f} | "
                     f"{row['pytorch_s'] * 1e3:.2f} | {row['ratio']:.2f}x | "
                     f"{row['mpusim_tflops']:.1f} | {row['pytorch_tflops']:.1f} |")
    print()
    print("\n".join(table))
    heading = (f"Benchmark: medians of {rounds_done} round(s), each the median of {args.repeat} "
               f"steps (mpusim: {notes.get('mpusim', '?')})")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(heading + "\n\n" + "\n".join(table) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema_version": 1, "rounds": rounds_done, "repeat": args.repeat,
                       "rows": rows, "mpusim_backend": notes.get("mpusim")}, f, indent=1)
    ok = [r for r in rows if "error" not in r]
    summary = ", ".join(f"{r['case']} {r['dtype']} {r['ratio']:.2f}x" for r in ok)
    print(f"mpusim / PyTorch eager: {summary or 'nothing measured'}")
    return 1 if failed or len(ok) < len(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
