#!/usr/bin/python3
"""The PyTorch golden of the float64 GPT reference (reference/gpt_reference.h).

Builds three tiny Megatron-Core GPTModels (local layer spec) in torch float64, written from the
model's math and Megatron's semantics (not from the C++ reference), runs them forward on
random tokens with random parameters, lets autograd compute every parameter gradient, and
writes one safetensors file per config:

    __metadata__  {"config": <an mpusim config document: parallel, model, run>,
                   "generator": "...", "torch": <version>}
    <parameter>         F64, full shape (GPTModel's state-dict names)
    <parameter>.grad    F64, d loss / d parameter
    tokens, labels      F64 [M, s, B] token ids
    loss                F64 [1]: the mean token loss over all micro-batches

Dropout is 0 (the masks are the reference's own definition, tested in C++). The safetensors
format is written by hand (8-byte little-endian header length, JSON header, raw
little-endian data) so that no package beyond torch is needed.

Run with Debian's torch: /usr/bin/python3 tests/data/gpt_golden/make_gpt_golden.py
"""

import json
import math
import os
import struct
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))

# Config A: LayerNorm, gelu, learned absolute positions (more rows than seq_length), tied
# embeddings, multi-head attention, biases everywhere, a vocabulary padded 37 -> 40.
CONFIG_A = {
    "parallel": {"world_size": 2, "tensor_model_parallel_size": 1},
    "model": {
        "type": "gpt", "num_layers": 2, "hidden_size": 16, "num_attention_heads": 4,
        "ffn_hidden_size": 32, "normalization": "LayerNorm", "layernorm_epsilon": 1e-5,
        "activation": "gelu", "add_bias_linear": True, "hidden_dropout": 0.0,
        "attention_dropout": 0.0, "position_embedding_type": "learned_absolute",
        "max_position_embeddings": 8, "share_embeddings_and_output_weights": True,
        "vocab_size": 37, "make_vocab_size_divisible_by": 8, "label_smoothing": 0.0,
    },
    "run": {"seed": 11, "dtype": "float64", "seq_length": 6, "micro_batch_size": 2,
            "num_microbatches": 1},
}

# Config B: RMSNorm, swiglu, rope, grouped-query attention (4 heads, 2 groups) with
# kv_channels 8 != hidden/heads, untied output layer, no linear biases but linear_qkv's
# (add_qkv_bias, as Qwen models have), label smoothing, two micro-batches, tp 2 (vocabulary
# 29 padded to a multiple of 4 * 2 = 32), d = 2.
CONFIG_B = {
    "parallel": {"world_size": 4, "tensor_model_parallel_size": 2},
    "model": {
        "type": "gpt", "num_layers": 2, "hidden_size": 16, "num_attention_heads": 4,
        "num_query_groups": 2, "kv_channels": 8, "ffn_hidden_size": 24,
        "normalization": "RMSNorm", "layernorm_epsilon": 1e-6, "activation": "swiglu",
        "add_bias_linear": False, "add_qkv_bias": True, "hidden_dropout": 0.0,
        "attention_dropout": 0.0, "position_embedding_type": "rope", "rotary_base": 10000,
        "share_embeddings_and_output_weights": False, "vocab_size": 29,
        "make_vocab_size_divisible_by": 4, "label_smoothing": 0.1,
    },
    "run": {"seed": 12, "dtype": "float64", "seq_length": 6, "micro_batch_size": 2,
            "num_microbatches": 2},
}

# Config C: LayerNorm with query and key layer norms (qk_layernorm: q_layernorm and
# k_layernorm over each head's kv_channels, with biases), rope on half of each head's channels
# (rotary_percent 0.5: 4 of 8), grouped-query attention, gelu, tied embeddings, biases, tp 2.
CONFIG_C = {
    "parallel": {"world_size": 4, "tensor_model_parallel_size": 2},
    "model": {
        "type": "gpt", "num_layers": 2, "hidden_size": 16, "num_attention_heads": 4,
        "num_query_groups": 2, "kv_channels": 8, "ffn_hidden_size": 32,
        "normalization": "LayerNorm", "layernorm_epsilon": 1e-5, "activation": "gelu",
        "add_bias_linear": True, "qk_layernorm": True, "hidden_dropout": 0.0,
        "attention_dropout": 0.0, "position_embedding_type": "rope", "rotary_base": 10000,
        "rotary_percent": 0.5, "share_embeddings_and_output_weights": True, "vocab_size": 29,
        "make_vocab_size_divisible_by": 4, "label_smoothing": 0.0,
    },
    "run": {"seed": 13, "dtype": "float64", "seq_length": 6, "micro_batch_size": 2,
            "num_microbatches": 2},
}


class Sizes:
    def __init__(self, doc):
        p, m, r = doc["parallel"], doc["model"], doc["run"]
        tp = p.get("tensor_model_parallel_size", 1)
        self.h = m["hidden_size"]
        self.a = m["num_attention_heads"]
        self.g = m.get("num_query_groups", self.a)
        self.dk = m.get("kv_channels", self.h // self.a)
        self.ffn = m.get("ffn_hidden_size", 4 * self.h)
        self.L = m["num_layers"]
        self.V = m["vocab_size"]
        multiple = m.get("make_vocab_size_divisible_by", 128) * tp
        self.Vp = (self.V + multiple - 1) // multiple * multiple  # _vocab_size_with_padding
        self.s = r["seq_length"]
        self.B = r["micro_batch_size"] * (p["world_size"] // tp)
        self.M = r["num_microbatches"]
        self.max_pos = m.get("max_position_embeddings", self.s)
        self.layernorm = m.get("normalization", "LayerNorm") == "LayerNorm"
        self.swiglu = m.get("activation", "gelu") == "swiglu"
        self.bias = m.get("add_bias_linear", True)
        # linear_qkv has a bias with add_bias_linear or add_qkv_bias (TransformerConfig).
        self.qkv_bias = self.bias or m.get("add_qkv_bias", False)
        self.rope = m.get("position_embedding_type", "learned_absolute") == "rope"
        self.rotary_base = float(m.get("rotary_base", 10000))
        # RotaryEmbedding: dim = int(kv_channels * rotary_percent) when rotary_percent < 1.
        self.rot_dim = int(self.dk * m.get("rotary_percent", 1.0))
        self.qk_layernorm = m.get("qk_layernorm", False)
        self.tied = m.get("share_embeddings_and_output_weights", True)
        self.eps = m.get("layernorm_epsilon", 1e-5)
        self.label_smoothing = m.get("label_smoothing", 0.0)


def make_parameters(z):
    """GPTModel's state dict (local spec) with random values: weights N(0, 0.3^2), biases
    N(0, 0.1^2), norm weights 1 + N(0, 0.1^2), norm biases N(0, 0.1^2)."""
    params = {}

    def weight(name, *shape):
        params[name] = torch.randn(*shape, dtype=torch.float64) * 0.3

    def bias(name, n):
        params[name] = torch.randn(n, dtype=torch.float64) * 0.1

    def norm(prefix, width=z.h):
        params[prefix + ".weight"] = 1 + torch.randn(width, dtype=torch.float64) * 0.1
        if z.layernorm:
            bias(prefix + ".bias", width)

    weight("embedding.word_embeddings.weight", z.Vp, z.h)
    if not z.rope:
        weight("embedding.position_embeddings.weight", z.max_pos, z.h)
    qkv_rows = (z.a + 2 * z.g) * z.dk
    fc1_rows = 2 * z.ffn if z.swiglu else z.ffn
    for i in range(z.L):
        p = f"decoder.layers.{i}"
        norm(p + ".input_layernorm")
        weight(p + ".self_attention.linear_qkv.weight", qkv_rows, z.h)
        if z.qkv_bias:
            bias(p + ".self_attention.linear_qkv.bias", qkv_rows)
        if z.qk_layernorm:  # SelfAttention's q_layernorm, k_layernorm: over kv_channels
            norm(p + ".self_attention.q_layernorm", z.dk)
            norm(p + ".self_attention.k_layernorm", z.dk)
        weight(p + ".self_attention.linear_proj.weight", z.h, z.a * z.dk)
        if z.bias:
            bias(p + ".self_attention.linear_proj.bias", z.h)
        norm(p + ".pre_mlp_layernorm")
        weight(p + ".mlp.linear_fc1.weight", fc1_rows, z.h)
        if z.bias:
            bias(p + ".mlp.linear_fc1.bias", fc1_rows)
        weight(p + ".mlp.linear_fc2.weight", z.h, z.ffn)
        if z.bias:
            bias(p + ".mlp.linear_fc2.bias", z.h)
    norm("decoder.final_layernorm")
    if not z.tied:
        weight("output_layer.weight", z.Vp, z.h)
    return params


def normalize(z, x, prefix, P):
    """The model's normalization over the last dim of x (h, or kv_channels for q/k)."""
    if z.layernorm:
        return F.layer_norm(x, (x.shape[-1],), P[prefix + ".weight"], P[prefix + ".bias"],
                            z.eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + z.eps) * P[prefix + ".weight"]


def apply_rope(z, t):
    """Megatron's apply_rotary_pos_emb (non-interleaved) on the first rot_dim channels:
    t * cos + rotate_half(t) * sin, rotate_half(t) = cat(-t2, t1), frequencies
    base^(-2c/rot_dim) repeated for both halves; the other channels pass through.
    t: [s, B, heads, dk]."""
    d = z.rot_dim
    inv_freq = 1.0 / (z.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.outer(torch.arange(z.s, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
    t_rot, t_pass = t[..., :d], t[..., d:]
    t1, t2 = torch.chunk(t_rot, 2, dim=-1)
    rotated = t_rot * emb.cos() + torch.cat([-t2, t1], dim=-1) * emb.sin()
    return torch.cat([rotated, t_pass], dim=-1)


def microbatch_loss_sum(z, P, tokens, labels):
    """Sum of the token losses of one micro-batch; tokens, labels: [s, B] int64."""
    r = z.a // z.g
    x = F.embedding(tokens, P["embedding.word_embeddings.weight"])  # [s, B, h]
    if not z.rope:
        x = x + P["embedding.position_embeddings.weight"][: z.s].unsqueeze(1)
    causal = torch.triu(torch.ones(z.s, z.s, dtype=torch.bool), diagonal=1)
    for i in range(z.L):
        p = f"decoder.layers.{i}"
        get = lambda name: P.get(p + name)
        h1 = normalize(z, x, p + ".input_layernorm", P)
        qkv = F.linear(h1, get(".self_attention.linear_qkv.weight"),
                       get(".self_attention.linear_qkv.bias"))
        # Megatron: view [s, B, g, (r + 2) * dk], split into r query heads, key, value.
        qkv = qkv.view(z.s, z.B, z.g, r + 2, z.dk)
        q = qkv[:, :, :, :r, :].reshape(z.s, z.B, z.a, z.dk)
        k = qkv[:, :, :, r, :]
        v = qkv[:, :, :, r + 1, :]
        if z.qk_layernorm:  # get_query_key_value_tensors: the norms, then RoPE in forward
            q = normalize(z, q, p + ".self_attention.q_layernorm", P)
            k = normalize(z, k, p + ".self_attention.k_layernorm", P)
        if z.rope:
            q = apply_rope(z, q)
            k = apply_rope(z, k)
        k = k.repeat_interleave(r, dim=2)  # each query head reads its group's key/value
        v = v.repeat_interleave(r, dim=2)
        scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(z.dk)
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        context = torch.einsum("bhqk,kbhd->qbhd", probs, v).reshape(z.s, z.B, z.a * z.dk)
        x = x + F.linear(context, get(".self_attention.linear_proj.weight"),
                         get(".self_attention.linear_proj.bias"))
        h2 = normalize(z, x, p + ".pre_mlp_layernorm", P)
        fc1 = F.linear(h2, get(".mlp.linear_fc1.weight"), get(".mlp.linear_fc1.bias"))
        if z.swiglu:
            gate, up = torch.chunk(fc1, 2, dim=-1)
            act = F.silu(gate) * up
        else:
            act = F.gelu(fc1)  # exact (erf) GELU
        x = x + F.linear(act, get(".mlp.linear_fc2.weight"), get(".mlp.linear_fc2.bias"))
    final = normalize(z, x, "decoder.final_layernorm", P)
    out_w = P["embedding.word_embeddings.weight"] if z.tied else P["output_layer.weight"]
    logits = F.linear(final, out_w)  # [s, B, Vp]: the padded columns take part
    # Megatron's vocab_parallel_cross_entropy smooths with ls * Vp / (Vp - 1) over Vp
    # classes, which is torch's label_smoothing with that value.
    smoothing = z.label_smoothing * z.Vp / (z.Vp - 1)
    return F.cross_entropy(logits.reshape(-1, z.Vp), labels.reshape(-1), reduction="sum",
                           label_smoothing=smoothing)


def write_safetensors(path, tensors, metadata):
    header = {"__metadata__": metadata}
    blobs = []
    offset = 0
    for name, t in tensors:
        data = t.detach().contiguous().to(torch.float64).numpy().astype("<f8").tobytes()
        header[name] = {"dtype": "F64", "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors pads
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def make(doc, torch_seed, path):
    z = Sizes(doc)
    torch.manual_seed(torch_seed)
    P = make_parameters(z)
    tokens = torch.randint(0, z.V, (z.M, z.s, z.B))
    labels = torch.randint(0, z.V, (z.M, z.s, z.B))
    for t in P.values():
        t.requires_grad_(True)
    loss = sum(microbatch_loss_sum(z, P, tokens[m], labels[m]) for m in range(z.M))
    loss = loss / (z.M * z.s * z.B)
    loss.backward()
    tensors = [(name, t) for name, t in P.items()]
    tensors += [(name + ".grad", t.grad) for name, t in P.items()]
    tensors += [("tokens", tokens.to(torch.float64)), ("labels", labels.to(torch.float64)),
                ("loss", loss.detach().reshape(1))]
    metadata = {"config": json.dumps(doc, sort_keys=True),
                "generator": "tests/data/gpt_golden/make_gpt_golden.py",
                "torch": torch.__version__}
    write_safetensors(path, tensors, metadata)
    print(f"{os.path.basename(path)}: loss {loss.item():.17g}, {len(tensors)} tensors, "
          f"{os.path.getsize(path)} bytes")


def main():
    torch.use_deterministic_algorithms(True)
    make(CONFIG_A, 1, os.path.join(HERE, "gpt_golden_a.safetensors"))
    make(CONFIG_B, 2, os.path.join(HERE, "gpt_golden_b.safetensors"))
    make(CONFIG_C, 3, os.path.join(HERE, "gpt_golden_c.safetensors"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
