#!/usr/bin/env python3
"""PyTorch eager doing the math of bench/configs/gpt_moe_layer_n1.json: one MoE GPT layer.

What it is: the comparison point for `mpusim run ... --no-check --repeat N` in
bench/moe_bench.py. Forward and backward (autograd) of: word + position embeddings, one
pre-LayerNorm transformer layer without linear biases (fused qkv, causal softmax(q k^T / sqrt(d)) v, proj,
residual, LayerNorm) whose MLP is a mixture of experts as Megatron-Core's MoELayer computes
it: router logits x W_r^T, top-k of the logits (torch.topk), the probabilities a softmax
over the k chosen logits, the load-balancing loss coeff E / (k T^2) sum_i count_i
sum_t softmax(logits)_ti (counts of the top-k, no gradient), then per expert the tokens
routed to it gathered (index_select), fc1, exact GeLU, times the token's probability, fc2,
and scatter-added back per token (index_add_); then the residual, final LayerNorm, the
output layer tied to the word embeddings and the mean token cross entropy. float32, no
dropout, s = 1024, b = 1, hidden 512, 8 heads, 8 experts of ffn 1024, top-2.
What it is not: a test; it prints the median wall time of --repeat steps.

Usage: /usr/bin/python3 bench/moe_torch.py --threads 1 --repeat 3
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
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--aux", type=float, default=0.01)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    s, h, a, f, v = args.seq, args.hidden, args.heads, args.ffn, args.vocab
    E, K = args.experts, args.topk
    dk = h // a

    def param(*shape, std=0.02):
        return torch.nn.Parameter(torch.randn(*shape) * std)

    def ones(n):
        return torch.nn.Parameter(torch.ones(n))

    def zeros(n):
        return torch.nn.Parameter(torch.zeros(n))

    p = {
        "word": param(v, h), "pos": param(s, h),
        "ln1_w": ones(h), "ln1_b": zeros(h),
        "qkv_w": param(3 * h, h),
        "proj_w": param(h, h),
        "ln2_w": ones(h), "ln2_b": zeros(h),
        "router": param(E, h),
        "lnf_w": ones(h), "lnf_b": zeros(h),
    }
    for e in range(E):
        p[f"fc1_{e}"] = param(f, h)
        p[f"fc2_{e}"] = param(h, f)
    tokens = torch.randint(0, v, (s,))
    labels = torch.randint(0, v, (s,))
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)

    def moe(y):
        logits = F.linear(y, p["router"])  # [s, E]
        scores = torch.softmax(logits, dim=-1)
        values, idx = torch.topk(logits, K, dim=-1)
        probs = torch.softmax(values, dim=-1)  # [s, K]
        counts = torch.zeros(E).index_add_(0, idx.reshape(-1), torch.ones(s * K))
        aux = args.aux * E / (K * s * s) * (counts * scores.sum(0)).sum()
        out = torch.zeros_like(y)
        flat_idx, flat_probs = idx.reshape(-1), probs.reshape(-1)
        for e in range(E):
            chosen = (flat_idx == e).nonzero(as_tuple=True)[0]  # entries token * K + slot
            if chosen.numel() == 0:
                continue
            tok = chosen // K
            act = F.gelu(F.linear(y.index_select(0, tok), p[f"fc1_{e}"]))
            act = act * flat_probs.index_select(0, chosen).unsqueeze(1)
            out = out.index_add(0, tok, F.linear(act, p[f"fc2_{e}"]))
        return out, aux

    def step():
        for t in p.values():
            t.grad = None
        x = p["word"][tokens] + p["pos"]
        y = F.layer_norm(x, (h,), p["ln1_w"], p["ln1_b"])
        qkv = F.linear(y, p["qkv_w"]).view(s, a, 3, dk)
        q, k, val = (qkv[:, :, i, :].transpose(0, 1) for i in range(3))  # [a, s, dk]
        scores = torch.matmul(q, k.transpose(1, 2)) / math.sqrt(dk)
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        ctx = torch.matmul(probs, val).transpose(0, 1).reshape(s, h)
        x = x + F.linear(ctx, p["proj_w"])
        y = F.layer_norm(x, (h,), p["ln2_w"], p["ln2_b"])
        out, aux = moe(y)
        x = x + out
        logits = F.linear(F.layer_norm(x, (h,), p["lnf_w"], p["lnf_b"]), p["word"])
        (F.cross_entropy(logits, labels) + aux).backward()

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
