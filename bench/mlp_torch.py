#!/usr/bin/env python3
"""PyTorch eager doing the MLP block math of bench/configs/mlp_t*_n*.json.

What it is: the comparison point for `mpusim run ... --no-check --repeat N` in
bench/mlp_bench.py (CPU) and bench/gpu_bench.py (--device cuda, bench/configs/gpu_mlp_n1.json's
sizes): forward Y = gelu(X W1^T + b1) W2^T + b2 and the backward from a given dY (dX, dW1,
db1, dW2, db2); by default float32, T = 2048 tokens, hidden 1024, ffn 4096. --dtype
bfloat16 keeps every tensor in bfloat16 (mpusim accumulates weight gradients into float32
main_grad instead); float32 matrix products use no TF32.
What it is not: a test; it prints the median wall time of --repeat runs (on a GPU, each
between two torch.cuda.synchronize() calls).

Usage: python3 bench/mlp_torch.py --threads 1 --repeat 5
"""
import argparse
import ctypes
import statistics
import time

import torch


def blas():
    """The OpenBLAS this process loaded (torch's BLAS) and the kernel set it runs."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "openblas" in line}
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.openblas_get_config.restype = ctypes.c_char_p
            lib.openblas_get_corename.restype = ctypes.c_char_p
            version = " ".join(lib.openblas_get_config().decode().split()[:2])
            return f"{version} ({lib.openblas_get_corename().decode()} kernels)"
        except (OSError, AttributeError):
            continue
    return "not OpenBLAS (" + torch.__config__.show().split("BLAS_INFO=")[-1].split(",")[0] + ")"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # mpusim's float32 GEMMs are pedantic
    t, h, f = args.tokens, args.hidden, args.ffn

    def tensor(*shape, scale=1.0):
        return (torch.randn(*shape) * scale).to(device, dtype)

    x = tensor(t, h).requires_grad_(True)
    w1 = torch.nn.Parameter(tensor(f, h, scale=(2.0 / (f + h)) ** 0.5))
    b1 = torch.nn.Parameter(torch.zeros(f, device=device, dtype=dtype))
    w2 = torch.nn.Parameter(tensor(h, f, scale=(2.0 / (f + h)) ** 0.5))
    b2 = torch.nn.Parameter(torch.zeros(h, device=device, dtype=dtype))
    dy = tensor(t, h)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step():
        for p in (x, w1, b1, w2, b2):
            p.grad = None
        y = torch.nn.functional.linear(
            torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1)), w2, b2)
        y.backward(dy)

    step()  # warm-up
    sync()
    seconds = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        step()
        sync()
        seconds.append(time.perf_counter() - start)
    print(f"blas: {blas() if device.type == 'cpu' else torch.cuda.get_device_name(device)}")
    print(f"pytorch {torch.__version__} threads {args.threads}: median {statistics.median(seconds):.4f} s "
          f"over {args.repeat} runs, min {min(seconds):.4f} s, max {max(seconds):.4f} s")


if __name__ == "__main__":
    main()
