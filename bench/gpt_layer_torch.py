#!/usr/bin/env python3
"""PyTorch on the CPU doing the math of bench/configs/gpt_layer_t*_n*.json: one GPT layer.

What it is: the comparison point for `mpusim run ... --no-check --repeat N` in
bench/gpt_layer_bench.py. Forward and backward (autograd) of: word + position embeddings,
one pre-LayerNorm transformer layer (fused qkv, 16 heads, causal softmax(q k^T / sqrt(d)) v,
proj, residual, LayerNorm, fc1, exact GeLU, fc2, residual), final LayerNorm, the output layer
tied to the word embeddings, and the mean token cross entropy; float32, no dropout, s = 1024,
b = 1, hidden 1024, ffn 4096, vocabulary 1024.
What it is not: a test; it prints the median wall time of --repeat steps.

Usage: /usr/bin/python3 bench/gpt_layer_torch.py --threads 1 --repeat 3
"""
import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=1024)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    s, h, a, f, v = args.seq, args.hidden, args.heads, args.ffn, args.vocab
    dk = h // a

    def param(*shape, std=0.02):
        return torch.nn.Parameter(torch.randn(*shape) * std)

    params = {
        "word": param(v, h), "pos": param(s, h),
        "ln1_w": torch.nn.Parameter(torch.ones(h)), "ln1_b": torch.nn.Parameter(torch.zeros(h)),
        "qkv_w": param(3 * h, h), "qkv_b": torch.nn.Parameter(torch.zeros(3 * h)),
        "proj_w": param(h, h), "proj_b": torch.nn.Parameter(torch.zeros(h)),
        "ln2_w": torch.nn.Parameter(torch.ones(h)), "ln2_b": torch.nn.Parameter(torch.zeros(h)),
        "fc1_w": param(f, h), "fc1_b": torch.nn.Parameter(torch.zeros(f)),
        "fc2_w": param(h, f), "fc2_b": torch.nn.Parameter(torch.zeros(h)),
        "lnf_w": torch.nn.Parameter(torch.ones(h)), "lnf_b": torch.nn.Parameter(torch.zeros(h)),
    }
    tokens = torch.randint(0, v, (s,))
    labels = torch.randint(0, v, (s,))
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
    p = params

    def step():
        for t in p.values():
            t.grad = None
        x = p["word"][tokens] + p["pos"]
        y = F.layer_norm(x, (h,), p["ln1_w"], p["ln1_b"])
        qkv = F.linear(y, p["qkv_w"], p["qkv_b"]).view(s, a, 3, dk)
        q, k, val = (qkv[:, :, i, :].transpose(0, 1) for i in range(3))  # [a, s, dk]
        scores = torch.matmul(q, k.transpose(1, 2)) / math.sqrt(dk)
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        ctx = torch.matmul(probs, val).transpose(0, 1).reshape(s, h)
        x = x + F.linear(ctx, p["proj_w"], p["proj_b"])
        y = F.layer_norm(x, (h,), p["ln2_w"], p["ln2_b"])
        x = x + F.linear(F.gelu(F.linear(y, p["fc1_w"], p["fc1_b"])), p["fc2_w"], p["fc2_b"])
        logits = F.linear(F.layer_norm(x, (h,), p["lnf_w"], p["lnf_b"]), p["word"])
        F.cross_entropy(logits, labels).backward()

    step()  # warm-up
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    print(f"time per step (forward + backward): median {statistics.median(times):.4f} s "
          f"over {len(times)} runs")


if __name__ == "__main__":
    main()
