#!/usr/bin/env python3
"""PyTorch eager doing the math of bench/configs/gpt_layer_t*_n*.json: one GPT layer.

What it is: the comparison point for `mpusim run ... --no-check --repeat N` in
bench/gpt_layer_bench.py (CPU) and bench/gpu_bench.py (--device cuda, with
bench/configs/gpu_gpt_layer_n1.json's sizes). Forward and backward (autograd) of: word + position embeddings,
one pre-LayerNorm transformer layer (fused qkv, 16 heads, causal softmax(q k^T / sqrt(d)) v,
proj, residual, LayerNorm, fc1, exact GeLU, fc2, residual), final LayerNorm, the output layer
tied to the word embeddings, and the mean token cross entropy; no dropout; by default
float32, s = 1024, b = 1, hidden 1024, ffn 4096, vocabulary 1024. With --dtype bfloat16 the
parameters and activations are bfloat16, and the attention softmax and the cross entropy run
in float32 (as mpusim and Megatron do: attention_softmax_in_fp32, the loss on logits.float());
unlike mpusim, whose bfloat16 runs accumulate weight gradients into float32 main_grad,
autograd keeps them in bfloat16. float32 matrix products use no TF32.
What it is not: a test; it prints the median wall time of --repeat steps (on a GPU, each
step between two torch.cuda.synchronize() calls).

Usage: /usr/bin/python3 bench/gpt_layer_torch.py --threads 1 --repeat 3
       python3 bench/gpt_layer_torch.py --device cuda --dtype bfloat16 --seq 2048 \
           --hidden 4096 --heads 32 --ffn 16384 --repeat 10
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
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # mpusim's float32 GEMMs are pedantic
        torch.backends.cudnn.allow_tf32 = False
    s, h, a, f, v = args.seq, args.hidden, args.heads, args.ffn, args.vocab
    dk = h // a

    def param(*shape, std=0.02):
        return torch.nn.Parameter((torch.randn(*shape) * std).to(device, dtype))

    def ones(n):
        return torch.nn.Parameter(torch.ones(n, device=device, dtype=dtype))

    def zeros(n):
        return torch.nn.Parameter(torch.zeros(n, device=device, dtype=dtype))

    params = {
        "word": param(v, h), "pos": param(s, h),
        "ln1_w": ones(h), "ln1_b": zeros(h),
        "qkv_w": param(3 * h, h), "qkv_b": zeros(3 * h),
        "proj_w": param(h, h), "proj_b": zeros(h),
        "ln2_w": ones(h), "ln2_b": zeros(h),
        "fc1_w": param(f, h), "fc1_b": zeros(f),
        "fc2_w": param(h, f), "fc2_b": zeros(h),
        "lnf_w": ones(h), "lnf_b": zeros(h),
    }
    tokens = torch.randint(0, v, (s,), device=device)
    labels = torch.randint(0, v, (s,), device=device)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)
    p = params

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step():
        for t in p.values():
            t.grad = None
        x = p["word"][tokens] + p["pos"]
        y = F.layer_norm(x, (h,), p["ln1_w"], p["ln1_b"])
        qkv = F.linear(y, p["qkv_w"], p["qkv_b"]).view(s, a, 3, dk)
        q, k, val = (qkv[:, :, i, :].transpose(0, 1) for i in range(3))  # [a, s, dk]
        scores = torch.matmul(q, k.transpose(1, 2)) / math.sqrt(dk)
        probs = torch.softmax(scores.float().masked_fill(mask, float("-inf")), dim=-1).to(dtype)
        ctx = torch.matmul(probs, val).transpose(0, 1).reshape(s, h)
        x = x + F.linear(ctx, p["proj_w"], p["proj_b"])
        y = F.layer_norm(x, (h,), p["ln2_w"], p["ln2_b"])
        x = x + F.linear(F.gelu(F.linear(y, p["fc1_w"], p["fc1_b"])), p["fc2_w"], p["fc2_b"])
        logits = F.linear(F.layer_norm(x, (h,), p["lnf_w"], p["lnf_b"]), p["word"])
        F.cross_entropy(logits.float(), labels).backward()

    step()  # warm-up
    sync()
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    print(f"time per step (forward + backward): median {statistics.median(times):.4f} s "
          f"over {len(times)} runs")


if __name__ == "__main__":
    main()
