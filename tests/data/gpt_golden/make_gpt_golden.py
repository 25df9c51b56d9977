#!/usr/bin/python3
"""The PyTorch golden of the float64 GPT reference (reference/gpt_reference.h).

Builds seven tiny Megatron-Core GPTModels (local layer spec) in torch float64, written from the
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

# Config D: mixture of experts (Megatron-Core's MoELayer, local spec: SequentialMLP experts,
# TopKRouter, allgather dispatcher). Layers 0 and 2 of 3 are MoE layers (moe_layer_freq 2), 4
# experts of moe_ffn_hidden_size 12 with swiglu, top-2 routing with softmax after top-k, a
# capacity factor of 1 dropping by probability (12 tokens per dp rank and micro-batch, so 6
# per expert), the load-balancing loss and the z-loss, a shared expert, d = 2, tp 1.
CONFIG_D = {
    "parallel": {"world_size": 2, "tensor_model_parallel_size": 1},
    "model": {
        "type": "gpt", "num_layers": 3, "hidden_size": 16, "num_attention_heads": 4,
        "ffn_hidden_size": 24, "normalization": "RMSNorm", "layernorm_epsilon": 1e-6,
        "activation": "swiglu", "add_bias_linear": False, "hidden_dropout": 0.0,
        "attention_dropout": 0.0, "position_embedding_type": "rope", "rotary_base": 10000,
        "share_embeddings_and_output_weights": False, "vocab_size": 29,
        "make_vocab_size_divisible_by": 4, "label_smoothing": 0.0,
        "num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 12,
        "moe_layer_freq": 2, "moe_router_pre_softmax": False,
        "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.01,
        "moe_z_loss_coeff": 0.001, "moe_expert_capacity_factor": 1.0,
        "moe_token_drop_policy": "probs", "moe_shared_expert_intermediate_size": 8,
    },
    "run": {"seed": 14, "dtype": "float64", "seq_length": 6, "micro_batch_size": 2,
            "num_microbatches": 2},
}

# Config E: the other router and drop choices: softmax before top-k (moe_router_pre_softmax),
# top-1 of 3 experts, capacity 1.5 dropping by position, gelu, moe_grouped_gemm (which names
# the experts as without it), no shared expert, every layer an MoE layer, d = 2, three
# micro-batches.
CONFIG_E = {
    "parallel": {"world_size": 2, "tensor_model_parallel_size": 1},
    "model": {
        "type": "gpt", "num_layers": 2, "hidden_size": 16, "num_attention_heads": 4,
        "ffn_hidden_size": 24, "normalization": "LayerNorm", "layernorm_epsilon": 1e-5,
        "activation": "gelu", "add_bias_linear": False, "hidden_dropout": 0.0,
        "attention_dropout": 0.0, "position_embedding_type": "learned_absolute",
        "share_embeddings_and_output_weights": True, "vocab_size": 29,
        "make_vocab_size_divisible_by": 4, "label_smoothing": 0.0,
        "num_moe_experts": 3, "moe_router_topk": 1, "moe_ffn_hidden_size": 20,
        "moe_router_pre_softmax": True, "moe_aux_loss_coeff": 0.02,
        "moe_expert_capacity_factor": 1.5, "moe_token_drop_policy": "position",
        "moe_grouped_gemm": True,
    },
    "run": {"seed": 15, "dtype": "float64", "seq_length": 6, "micro_batch_size": 2,
            "num_microbatches": 3},
}

# Config F: config D's model with the sequence-level load-balancing loss ("seq_aux_loss",
# coefficient 0.05): each sample's counts and softmax separately, averaged over the
# micro-batch's 2 samples; no token dropped.
CONFIG_F = json.loads(json.dumps(CONFIG_D))
CONFIG_F["model"].update({"moe_router_load_balancing_type": "seq_aux_loss",
                          "moe_aux_loss_coeff": 0.05, "moe_expert_capacity_factor": None})
CONFIG_F["model"] = {k: v for k, v in CONFIG_F["model"].items() if v is not None}
CONFIG_F["run"]["seed"] = 16

# Config G: DeepSeek-V3-style routing: sigmoid scores, 12 experts in 4 groups of 3, each token
# choosing 4 experts from the 2 groups whose top 2 biased sigmoids sum highest (the expert
# bias, a float32 buffer as a checkpoint would hold it: N(0, 0.05^2) per layer, added for
# choosing only), the chosen sigmoids normalised (topk > 1) and scaled by
# moe_router_topk_scaling_factor 2.5; the load-balancing loss on the sigmoids normalised over
# all experts, the z-loss, a shared expert, no token dropped; every layer an MoE layer. The
# file also holds each bias as the step leaves it (`<router>.expert_bias.updated`,
# get_updated_expert_bias on the step's token counts, rate 0.001).
CONFIG_G = json.loads(json.dumps(CONFIG_D))
CONFIG_G["model"].update({
    "num_moe_experts": 12, "moe_router_topk": 4, "moe_ffn_hidden_size": 8, "moe_layer_freq": 1,
    "moe_router_score_function": "sigmoid", "moe_router_num_groups": 4,
    "moe_router_group_topk": 2, "moe_router_topk_scaling_factor": 2.5,
    "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.001,
    "moe_expert_capacity_factor": None})
CONFIG_G["model"] = {k: v for k, v in CONFIG_G["model"].items() if v is not None}
CONFIG_G["model"]["num_layers"] = 2
CONFIG_G["run"]["seed"] = 17

# Config L: Qwen3's global-batch load-balancing loss, listed with the sequence-level one
# (Megatron's list form: moe_router_load_balancing_type ["seq_aux_loss", "global_aux_loss"]
# with moe_aux_loss_coeff [0.05, 0.1]) on config D's model, dropless, d = 2, three
# micro-batches: each micro-batch's top-k counts summed over both dp ranks join each router's
# float32 tracker (global_tokens_per_expert, ga_steps), whose running mean weights every dp
# rank's softmax, with the micro-batch's tokens of both dp ranks as the token count.
CONFIG_L = json.loads(json.dumps(CONFIG_D))
CONFIG_L["model"].update({"moe_router_load_balancing_type": ["seq_aux_loss", "global_aux_loss"],
                          "moe_aux_loss_coeff": [0.05, 0.1], "moe_expert_capacity_factor": None})
CONFIG_L["model"] = {k: v for k, v in CONFIG_L["model"].items() if v is not None}
CONFIG_L["run"].update({"seed": 18, "num_microbatches": 3})

# Config L sqrtsoftplus: config G's routing (group-limited, the expert bias, the scaling) with
# moe_router_score_function "sqrtsoftplus" (sqrt(softplus(logit)) per expert, the chosen ones
# normalised) and only the global load-balancing loss (coefficient 0.02) on the normalised
# sqrt(softplus) scores; two micro-batches.
CONFIG_L_SQRT = json.loads(json.dumps(CONFIG_G))
CONFIG_L_SQRT["model"].update({"moe_router_score_function": "sqrtsoftplus",
                               "moe_router_load_balancing_type": "global_aux_loss",
                               "moe_aux_loss_coeff": 0.02})
CONFIG_L_SQRT["run"]["seed"] = 19


# Megatron-Core's routing functions (megatron/core/transformer/moe/moe_utils.py), unfused,
# without router replay, precomputed indices or padding masks, as Megatron writes them, but
# for one change: where Megatron computes the scores in float32 (`logits.float()`,
# `dtype=torch.float32`), these use SCORES_DTYPE, float64: a float64 run keeps its router in
# float64 (RouterDTypesOf, core/config/gpt_config.h), as the softmax above does.
SCORES_DTYPE = torch.float64
def group_limited_topk(scores, topk, num_tokens, num_experts, num_groups, group_topk):
    group_scores = (
        scores.view(num_tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    )
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (
        group_mask.unsqueeze(-1)
        .expand(num_tokens, num_groups, num_experts // num_groups)
        .reshape(num_tokens, -1)
    )
    masked_scores = scores.masked_fill(~score_mask.bool(), float('-inf'))
    probs, top_indices = torch.topk(masked_scores, k=topk, dim=-1)
    return probs, top_indices


def topk_routing_with_score_function(logits, topk, use_pre_softmax=False, num_groups=None,
                                     group_topk=None, scaling_factor=None,
                                     score_function="softmax", expert_bias=None):
    num_tokens, num_experts = logits.shape

    def compute_topk(scores, topk, num_groups=None, group_topk=None):
        if group_topk:
            return group_limited_topk(scores=scores, topk=topk, num_tokens=num_tokens,
                                      num_experts=num_experts, num_groups=num_groups,
                                      group_topk=group_topk)
        return torch.topk(scores, k=topk, dim=1)

    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=SCORES_DTYPE)
            probs, top_indices = compute_topk(scores, topk, num_groups, group_topk)
        else:
            scores, top_indices = compute_topk(logits, topk, num_groups, group_topk)
            probs = torch.softmax(scores, dim=-1, dtype=SCORES_DTYPE)
    elif score_function in ("sigmoid", "sqrtsoftplus"):
        if score_function == "sigmoid":
            scores = torch.sigmoid(logits.to(SCORES_DTYPE))
        else:
            scores = torch.nn.functional.softplus(logits.to(SCORES_DTYPE)).sqrt()
        if expert_bias is not None:
            scores_for_routing = scores + expert_bias.float()
            _, top_indices = compute_topk(scores_for_routing, topk, num_groups, group_topk)
            scores = torch.gather(scores, dim=1, index=top_indices)
        else:
            scores, top_indices = compute_topk(scores, topk, num_groups, group_topk)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    else:
        raise ValueError(f"Invalid score_function: {score_function}")
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.type_as(logits)
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
    return routing_probs, routing_map


def get_updated_expert_bias(tokens_per_expert, expert_bias, expert_bias_update_rate):
    """moe_utils.get_updated_expert_bias after its all-reduce (here the counts are already
    the whole batch's)."""
    with torch.no_grad():
        average_tokens = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
        offset = average_tokens - tokens_per_expert
        updated_expert_bias = expert_bias + torch.sign(offset) * expert_bias_update_rate
        return updated_expert_bias


def compute_routing_scores_for_aux_loss(logits, topk, score_function):
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=SCORES_DTYPE)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.to(SCORES_DTYPE))
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    elif score_function == "sqrtsoftplus":
        scores = torch.nn.functional.softplus(logits.to(SCORES_DTYPE)).sqrt()
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"Invalid score_function: {score_function}")
    _, top_indices = torch.topk(scores, k=topk, dim=1)
    routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
    return routing_map, scores


def switch_load_balancing_loss_func(probs, tokens_per_expert, total_num_tokens, topk,
                                    num_experts, moe_aux_loss_coeff):
    """moe_utils.switch_load_balancing_loss_func, unfused, without a padding mask."""
    aggregated_probs_per_expert = probs.sum(dim=0)
    aux_loss = torch.sum(aggregated_probs_per_expert * tokens_per_expert) * (
        num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens)
    )
    return aux_loss


# Config K: multi-token prediction (Megatron-Core's MultiTokenPredictionBlock, local spec), two
# depths on config B's kind of model: RMSNorm, swiglu, rope, grouped-query attention, untied
# output layer, label smoothing, tp 2, d = 2, two micro-batches, mtp_loss_scaling_factor 0.3.
CONFIG_K = {
    "parallel": {"world_size": 4, "tensor_model_parallel_size": 2},
    "model": {
        "type": "gpt", "num_layers": 2, "hidden_size": 16, "num_attention_heads": 4,
        "num_query_groups": 2, "kv_channels": 8, "ffn_hidden_size": 24,
        "normalization": "RMSNorm", "layernorm_epsilon": 1e-6, "activation": "swiglu",
        "add_bias_linear": False, "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "position_embedding_type": "rope", "rotary_base": 10000,
        "share_embeddings_and_output_weights": False, "vocab_size": 29,
        "make_vocab_size_divisible_by": 4, "label_smoothing": 0.1,
        "mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.3,
    },
    "run": {"seed": 21, "dtype": "float64", "seq_length": 6, "micro_batch_size": 2,
            "num_microbatches": 2},
}
# Config K tied: LayerNorm, gelu, biases, rope, the output layer tied to the word embeddings
# (the MTP heads share it), tp 1, d = 2, three micro-batches, the default scaling factor 0.1.
CONFIG_K_TIED = {
    "parallel": {"world_size": 2, "tensor_model_parallel_size": 1},
    "model": {
        "type": "gpt", "num_layers": 2, "hidden_size": 16, "num_attention_heads": 4,
        "ffn_hidden_size": 32, "normalization": "LayerNorm", "layernorm_epsilon": 1e-5,
        "activation": "gelu", "add_bias_linear": True, "hidden_dropout": 0.0,
        "attention_dropout": 0.0, "position_embedding_type": "rope", "rotary_base": 10000,
        "share_embeddings_and_output_weights": True, "vocab_size": 29,
        "make_vocab_size_divisible_by": 4, "label_smoothing": 0.0, "mtp_num_layers": 2,
    },
    "run": {"seed": 22, "dtype": "float64", "seq_length": 6, "micro_batch_size": 2,
            "num_microbatches": 3},
}
# Config K MoE: DeepSeek-V3's pair, multi-token prediction on an MoE model: config G's routing
# (sigmoid scores, 12 experts in 4 groups, group top-2 of top-4, the expert bias and its
# update, scaling 2.5, a shared expert, the z-loss) with the sequence-level load-balancing
# loss (0.05), a dense first layer and an MoE second (moe_layer_freq [0, 1]), two depths whose
# transformer layers are MoE layers (the last decoder layer's spec), each with its own router,
# expert bias and experts; mtp_loss_scaling_factor 0.3, d = 2, two micro-batches.
CONFIG_K_MOE = json.loads(json.dumps(CONFIG_G))
CONFIG_K_MOE["model"].update({
    "moe_layer_freq": [0, 1], "moe_router_load_balancing_type": "seq_aux_loss",
    "moe_aux_loss_coeff": 0.05, "mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.3})
CONFIG_K_MOE["run"]["seed"] = 23

# Config K window: config K's two depths with a sliding window of 2 (window_size [2, 0]) on
# every layer whose number window_attn_skip_freq 2 does not divide: decoder layer 1 slides,
# layer 2 attends causally; the depths' layers, numbered 1 and 2 within the block
# (MultiTokenPredictionLayer's layer_number), slide and do not, whatever the last decoder
# layer does.
CONFIG_K_WINDOW = json.loads(json.dumps(CONFIG_K))
CONFIG_K_WINDOW["model"].update({"window_size": [2, 0], "window_attn_skip_freq": 2})
CONFIG_K_WINDOW["run"]["seed"] = 24

# Config K cp: config K tied's model (tp 1) on context parallelism 2 (world 4, d = 2), s = 8
# (chunks of 2: cp rank 0 holds positions 0 1 6 7, rank 1 2 3 4 5): the labels and the loss
# mask rolled across the cp ranks as roll_tensor does, each rank's depth losses over its own
# unmasked tokens (rank 0 loses position 7 at the first depth, 6 and 7 at the second; rank 1
# none), the gradient averaged over dp x cp. The model itself is cp-free math.
CONFIG_K_CP = json.loads(json.dumps(CONFIG_K_TIED))
CONFIG_K_CP["parallel"] = {"world_size": 4, "tensor_model_parallel_size": 1,
                           "context_parallel_size": 2}
CONFIG_K_CP["run"].update({"seed": 25, "seq_length": 8, "num_microbatches": 2})

# Config I: gpt-oss's MLP: the clamped quick-GELU gated linear unit (Megatron's activation_func
# quick_gelu with gated_linear_unit, glu_linear_offset 1, activation_func_clamp_value; the clamp
# at 1 here so that a good share of the fc1 outputs of these small random weights is clamped)
# with add_bias_linear on an MoE model: the router's bias, each expert's linear_fc1 and
# linear_fc2 biases (fc2's weighted by the routing probability), a dense layer's biases;
# layer 0 MoE, layer 1 dense; 4 experts, top-2, dropless; d = 2.
CONFIG_I = {
    "parallel": {"world_size": 2, "tensor_model_parallel_size": 1},
    "model": {
        "type": "gpt", "num_layers": 2, "hidden_size": 16, "num_attention_heads": 4,
        "ffn_hidden_size": 24, "normalization": "RMSNorm", "layernorm_epsilon": 1e-6,
        "activation": "quick_geglu", "glu_linear_offset": 1.0,
        "activation_func_clamp_value": 1.0, "add_bias_linear": True, "hidden_dropout": 0.0,
        "attention_dropout": 0.0, "position_embedding_type": "rope", "rotary_base": 10000,
        "share_embeddings_and_output_weights": False, "vocab_size": 29,
        "make_vocab_size_divisible_by": 4, "label_smoothing": 0.0,
        "num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 12,
        "moe_layer_freq": [1, 0], "moe_router_pre_softmax": False,
        "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.01,
    },
    "run": {"seed": 19, "dtype": "float64", "seq_length": 6, "micro_batch_size": 2,
            "num_microbatches": 2},
}

# Config H: gpt-oss's attention: a sliding window of 2 (window_size [2, 0]) on the layers
# window_attn_skip_freq marks 1 (here the second of two: a list), attention sinks
# (softmax_type "learnable": a softmax_offset logit per head), grouped-query attention with
# rope, tp 2 (the sinks split by heads), d = 2.
CONFIG_H = {
    "parallel": {"world_size": 4, "tensor_model_parallel_size": 2},
    "model": {
        "type": "gpt", "num_layers": 2, "hidden_size": 16, "num_attention_heads": 4,
        "num_query_groups": 2, "kv_channels": 8, "ffn_hidden_size": 24,
        "normalization": "RMSNorm", "layernorm_epsilon": 1e-6, "activation": "swiglu",
        "add_bias_linear": False, "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "position_embedding_type": "rope", "rotary_base": 10000,
        "share_embeddings_and_output_weights": False, "vocab_size": 29,
        "make_vocab_size_divisible_by": 4, "label_smoothing": 0.0,
        "window_size": [2, 0], "window_attn_skip_freq": [0, 1], "softmax_type": "learnable",
    },
    "run": {"seed": 18, "dtype": "float64", "seq_length": 6, "micro_batch_size": 2,
            "num_microbatches": 2},
}


# Megatron-Core's own pieces of gpt-oss's attention, as megatron/core writes them (torch
# only, no CUDA): transformer/utils.py's is_layer_window_attention (layer_number 1-based),
# get_sliding_window_causal_mask and attention_mask_func, and fusions/fused_softmax.py's
# SoftmaxOne. FusedScaleMaskSoftmax.forward_torch_softmax builds the window's mask in place of
# the causal one and takes SoftmaxOne whenever a softmax_offset is given.
def is_layer_window_attention(window_size, window_attn_skip_freq, layer_number):
    if not window_size:
        return False
    if window_attn_skip_freq is None:
        return True
    if isinstance(window_attn_skip_freq, int):
        return layer_number % window_attn_skip_freq != 0
    return bool(window_attn_skip_freq[layer_number - 1])


def get_sliding_window_causal_mask(sq, skv, window_size):
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    ml = torch.tril(mu, diagonal=skv - sq + window_size[1])
    return ~ml


def attention_mask_func(attention_scores, attention_mask):
    return attention_scores.masked_fill(attention_mask, -10000.0)


def softmax_one(x, denominator_offset):
    # sink: [np] --> [1, np, 1, 1] --> [b, np, sq, 1]
    sink = denominator_offset.reshape(1, -1, 1, 1).expand(x.size(0), -1, x.size(2), -1)
    # qk: [b, np, sq, sk] --> [b, np, sq, sk+1]
    qk = torch.cat([x, sink], dim=-1)
    # do softmax, and remove sink token at the end
    return torch.softmax(qk, dim=-1)[..., :-1]


# Config J: multi-latent attention (Megatron-Core's MLASelfAttention, local spec), DeepSeek-V3
# style: q_lora_rank 12 (linear_q_down_proj, q_layernorm, linear_q_up_proj), kv_lora_rank 10
# with 8 rope channels (linear_kv_down_proj, kv_layernorm, linear_kv_up_proj), qk_head_dim 6,
# v_head_dim 5 (query/key heads of 14 channels, value heads of 5), yarn rope with scaling
# factor 40, mscale 1 and mscale_all_dim 0.5 (cos/sin scaled by 1.156, the softmax by 1.403 /
# sqrt(14)), RMSNorm, swiglu, no biases, untied output, tp 2, d = 2, two micro-batches.
CONFIG_J = {
    "parallel": {"world_size": 4, "tensor_model_parallel_size": 2},
    "model": {
        "type": "gpt", "num_layers": 2, "hidden_size": 16, "num_attention_heads": 4,
        "ffn_hidden_size": 24, "normalization": "RMSNorm", "layernorm_epsilon": 1e-6,
        "activation": "swiglu", "add_bias_linear": False, "qk_layernorm": True,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "position_embedding_type": "rope",
        "rotary_base": 10000, "share_embeddings_and_output_weights": False,
        "vocab_size": 29, "make_vocab_size_divisible_by": 4, "label_smoothing": 0.0,
        "multi_latent_attention": True, "q_lora_rank": 12, "kv_lora_rank": 10,
        "qk_head_dim": 6, "qk_pos_emb_head_dim": 8, "v_head_dim": 5, "rope_type": "yarn",
        "rotary_scaling_factor": 40, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5,
    },
    "run": {"seed": 19, "dtype": "float64", "seq_length": 6, "micro_batch_size": 2,
            "num_microbatches": 2},
}

# Config J, q_proj: multi-latent attention without the query's latent (q_lora_rank null: one
# linear_q_proj), plain rope (rope_type "rope", base 500) yet mscale_all_dim 0.7 with scaling
# factor 40 (Megatron's softmax scale reads them whatever the rope), LayerNorm (kv_layernorm
# with a bias), gelu, linear_proj's bias, learned absolute positions beside MLA's rope, tied
# embeddings, d = 2.
CONFIG_J_Q_PROJ = {
    "parallel": {"world_size": 2, "tensor_model_parallel_size": 1},
    "model": {
        "type": "gpt", "num_layers": 2, "hidden_size": 16, "num_attention_heads": 4,
        "ffn_hidden_size": 32, "normalization": "LayerNorm", "layernorm_epsilon": 1e-5,
        "activation": "gelu", "add_bias_linear": True, "qk_layernorm": True,
        "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "position_embedding_type": "learned_absolute", "rotary_base": 500,
        "share_embeddings_and_output_weights": True, "vocab_size": 37,
        "make_vocab_size_divisible_by": 8, "label_smoothing": 0.0,
        "multi_latent_attention": True, "q_lora_rank": None, "kv_lora_rank": 8,
        "qk_head_dim": 4, "qk_pos_emb_head_dim": 4, "v_head_dim": 6, "rope_type": "rope",
        "rotary_scaling_factor": 40, "mscale_all_dim": 0.7,
    },
    "run": {"seed": 20, "dtype": "float64", "seq_length": 6, "micro_batch_size": 2,
            "num_microbatches": 1},
}


class MlaSizes:
    """MLATransformerConfig's fields and their defaults."""

    def __init__(self, m):
        self.q_lora = m.get("q_lora_rank", 512)
        self.kv_lora = m.get("kv_lora_rank", 512)
        self.qk = m.get("qk_head_dim", 128)
        self.pe = m.get("qk_pos_emb_head_dim", 64)
        self.v = m.get("v_head_dim", 128)
        self.rope_type = m.get("rope_type", "yarn")
        self.factor = float(m.get("rotary_scaling_factor", 40))
        self.original = m.get("original_max_position_embeddings", 4096)
        self.beta_fast = float(m.get("beta_fast", 32))
        self.beta_slow = float(m.get("beta_slow", 1))
        self.mscale = float(m.get("mscale", 1.0))
        self.mscale_all_dim = float(m.get("mscale_all_dim", 0.0))


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
        # Context parallelism (config K cp only: the MTP losses' per-rank normalisation).
        self.cp = p.get("context_parallel_size", 1)
        self.B = r["micro_batch_size"] * (p["world_size"] // (tp * self.cp))
        self.M = r["num_microbatches"]
        self.max_pos = m.get("max_position_embeddings", self.s)
        self.layernorm = m.get("normalization", "LayerNorm") == "LayerNorm"
        self.activation = m.get("activation", "gelu")
        self.swiglu = self.activation == "swiglu"
        self.gated = self.activation in ("swiglu", "quick_geglu")  # gated_linear_unit
        self.glu_linear_offset = m.get("glu_linear_offset", 0.0)
        self.clamp_value = m.get("activation_func_clamp_value")
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
        self.b = r["micro_batch_size"]
        # No pipeline parallelism in these configs; context parallelism in config K cp alone.
        self.d = p["world_size"] // (tp * self.cp)
        # Mixture of experts (TransformerConfig's moe_* fields and their defaults).
        self.E = m.get("num_moe_experts") or 0
        self.topk = m.get("moe_router_topk", 2)
        self.moe_ffn = m.get("moe_ffn_hidden_size") or self.ffn
        freq = m.get("moe_layer_freq", 1)
        self.moe_layers = ([i % freq == 0 for i in range(self.L)] if isinstance(freq, int)
                           else [bool(v) for v in freq])
        if not self.E:
            self.moe_layers = [False] * self.L
        self.pre_softmax = m.get("moe_router_pre_softmax", False)
        balancing = m.get("moe_router_load_balancing_type", "aux_loss")
        coeff = m.get("moe_aux_loss_coeff", 0.0)

        def get_aux_loss_coeff(aux_loss_type):
            """Router.get_aux_loss_coeff: a type's coefficient, a list's at its position."""
            if isinstance(balancing, str):
                return coeff if balancing == aux_loss_type else 0.0
            return coeff[balancing.index(aux_loss_type)] if aux_loss_type in balancing else 0.0
        self.aux_coeff = get_aux_loss_coeff("aux_loss")
        self.seq_coeff = get_aux_loss_coeff("seq_aux_loss")
        self.global_coeff = get_aux_loss_coeff("global_aux_loss")
        # TopKRouter's global_tokens_per_expert and ga_steps (float32), per router, over the
        # step's micro-batches (reset_global_aux_loss_tracker: at the step's end).
        self.global_tracker = {}
        self.z_coeff = m.get("moe_z_loss_coeff") or 0.0
        self.capacity_factor = m.get("moe_expert_capacity_factor")
        self.drop_policy = m.get("moe_token_drop_policy", "probs")
        self.shared_ffn = m.get("moe_shared_expert_intermediate_size")
        # Multi-token prediction (TransformerConfig: mtp_num_layers None, scaling factor 0.1).
        self.mtp = m.get("mtp_num_layers") or 0
        self.mtp_scale = m.get("mtp_loss_scaling_factor", 0.1)
        # DeepSeek-style routing: routed through Megatron's own functions above.
        self.score_function = m.get("moe_router_score_function", "softmax")
        self.num_groups = m.get("moe_router_num_groups")
        self.group_topk = m.get("moe_router_group_topk")
        self.scaling = m.get("moe_router_topk_scaling_factor")
        self.expert_bias = m.get("moe_router_enable_expert_bias", False)
        self.bias_update_rate = m.get("moe_router_bias_update_rate", 1e-3)
        self.megatron_router = (self.score_function != "softmax" or self.group_topk is not None
                                or self.scaling is not None or self.expert_bias)
        # TopKRouter.local_tokens_per_expert (float32), per router, summed over the step.
        self.tokens_per_expert = {}
        # gpt-oss's attention (TransformerConfig's window_size, window_attn_skip_freq,
        # softmax_type and their defaults).
        self.window_size = m.get("window_size")
        self.window_skip = m.get("window_attn_skip_freq")
        self.softmax_type = m.get("softmax_type", "vanilla")
        self.mla = MlaSizes(m) if m.get("multi_latent_attention", False) else None

    def expert(self, p, e, fc, kind="weight"):
        """An expert's weight (or bias) name: SequentialMLP's local_experts.<e>.linear_fc<n>.<kind>
        (global numbers). Megatron's local spec builds SequentialMLP whatever moe_grouped_gemm
        says (LocalSpecProvider.grouped_mlp_modules), so config E's flag changes no name."""
        return f"{p}.mlp.experts.local_experts.{e}.linear_fc{fc}.{kind}"


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
    fc1_rows = 2 * z.ffn if z.gated else z.ffn

    def layer_parameters(p, moe):
        """One TransformerLayer's parameters under prefix p (an MoE layer when moe)."""
        norm(p + ".input_layernorm")
        if z.mla:
            mla_parameters(z, p + ".self_attention", weight, norm)
        else:
            weight(p + ".self_attention.linear_qkv.weight", qkv_rows, z.h)
        if z.qkv_bias and not z.mla:
            bias(p + ".self_attention.linear_qkv.bias", qkv_rows)
        if z.qk_layernorm and not z.mla:  # SelfAttention's q/k_layernorm: over kv_channels
            norm(p + ".self_attention.q_layernorm", z.dk)
            norm(p + ".self_attention.k_layernorm", z.dk)
        if z.softmax_type == "learnable":  # DotProductAttention's softmax_offset [np]
            weight(p + ".self_attention.core_attention.softmax_offset", z.a)
        weight(p + ".self_attention.linear_proj.weight", z.h,
               z.a * (z.mla.v if z.mla else z.dk))
        if z.bias:
            bias(p + ".self_attention.linear_proj.bias", z.h)
        norm(p + ".pre_mlp_layernorm")
        if moe:
            # MoELayer: router.weight [E, h]; SequentialMLP's local_experts.<e> (global expert
            # numbers: one expert-parallel rank here); SharedExpertMLP's linear_fc1/fc2.
            # With add_bias_linear: TopKRouter's bias [E], each expert MLP's linear_fc1.bias and
            # linear_fc2.bias (Megatron refuses biases in the shared expert).
            weight(p + ".mlp.router.weight", z.E, z.h)
            if z.expert_bias:  # a float32 buffer, not a parameter
                params[p + ".mlp.router.expert_bias"] = (
                    torch.randn(z.E, dtype=torch.float64) * 0.05).float().double()
            if z.bias:
                bias(p + ".mlp.router.bias", z.E)
            expert_fc1 = 2 * z.moe_ffn if z.gated else z.moe_ffn
            for e in range(z.E):
                weight(z.expert(p, e, 1), expert_fc1, z.h)
                if z.bias:
                    bias(z.expert(p, e, 1, "bias"), expert_fc1)
                weight(z.expert(p, e, 2), z.h, z.moe_ffn)
                if z.bias:
                    bias(z.expert(p, e, 2, "bias"), z.h)
            if z.shared_ffn:
                shared_fc1 = 2 * z.shared_ffn if z.gated else z.shared_ffn
                weight(p + ".mlp.shared_experts.linear_fc1.weight", shared_fc1, z.h)
                weight(p + ".mlp.shared_experts.linear_fc2.weight", z.h, z.shared_ffn)
            return
        weight(p + ".mlp.linear_fc1.weight", fc1_rows, z.h)
        if z.bias:
            bias(p + ".mlp.linear_fc1.bias", fc1_rows)
        weight(p + ".mlp.linear_fc2.weight", z.h, z.ffn)
        if z.bias:
            bias(p + ".mlp.linear_fc2.bias", z.h)

    for i in range(z.L):
        layer_parameters(f"decoder.layers.{i}", z.moe_layers[i])
    norm("decoder.final_layernorm")
    # MultiTokenPredictionLayer (built after the decoder, before the output layer): enorm,
    # hnorm, eh_proj (ColumnParallelLinear 2h -> h, bias=False), the transformer layer
    # (mtp_model_layer, saved as transformer_layer; the last decoder layer's spec: an MoE
    # layer when the last decoder layer is one), final_layernorm.
    for k in range(z.mtp):
        p = f"mtp.layers.{k}"
        norm(p + ".enorm")
        norm(p + ".hnorm")
        weight(p + ".eh_proj.weight", z.h, 2 * z.h)
        layer_parameters(p + ".transformer_layer", z.moe_layers[-1])
        norm(p + ".final_layernorm")
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


def quick_gelu(y):
    """megatron/core/fusions/fused_bias_geglu.py: the sigmoid approximation of gelu."""
    return y * torch.sigmoid(1.702 * y)


def activation(z, fc1):
    """MLP.forward's unfused activation: a gated one is its glu (x_glu clamped above and
    x_linear on both sides by activation_func_clamp_value, then
    activation_func(x_glu) * (x_linear + glu_linear_offset)), else activation_func."""
    if not z.gated:
        return F.gelu(fc1)  # exact (erf) GELU
    x_glu, x_linear = torch.chunk(fc1, 2, dim=-1)
    if z.clamp_value is not None:
        x_glu = x_glu.clamp(min=None, max=z.clamp_value)
        x_linear = x_linear.clamp(min=-z.clamp_value, max=z.clamp_value)
    f = F.silu if z.swiglu else quick_gelu
    return f(x_glu) * (x_linear + z.glu_linear_offset)


def mlp(z, x, w1, w2, scale=None, b1=None, b2=None):
    """Megatron's MLP: fc2(act(fc1(x) + b1) * scale) + b2 * scale, the per-token scale (an
    expert's routing probability) applied after the activation and to fc2's bias, as
    MLP.forward's per_token_scale (output += output_bias * per_token_scale)."""
    act = activation(z, F.linear(x, w1, b1))
    if scale is not None:
        act = act * scale.unsqueeze(-1)
    out = F.linear(act, w2)
    if b2 is not None:
        out = out + (b2 * scale.unsqueeze(-1) if scale is not None else b2)
    return out


def ranked(values, k):
    """The k largest of each row, descending, equal values by the lower column (mpusim's tie
    rule, Kernels::TopK): (values, columns)."""
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.gather(values, -1, order), order


def moe_layer(z, P, p, h2):
    """Megatron-Core's MoELayer on the pre-MLP norm's output h2 [s, B, h], per data-parallel
    rank (its b samples; tp = cp = 1 here, so the router sees them all at once). Returns the
    layer's output [s, B, h] and the micro-batch's auxiliary objective: the load-balancing and
    z losses summed over the dp ranks (their gradients reach the router as Megatron's
    MoEAuxLossAutoScaler sends them; the caller scales them by 1 / (M d))."""
    out = torch.zeros_like(h2)
    aux = h2.new_zeros(())
    global_terms = []  # global_aux_loss: each dp rank's scores and top-k counts
    for dp in range(z.d):
        # Megatron's tokens [s, b, h] -> [s*b, h]: row i*b + j is position i of sample j.
        xs = h2[:, dp * z.b:(dp + 1) * z.b, :].reshape(-1, z.h)
        T = xs.shape[0]
        # router_gating_linear: x W^T + b (the bias with add_bias_linear).
        logits = F.linear(xs, P[p + ".mlp.router.weight"], P.get(p + ".mlp.router.bias"))
        if z.z_coeff:  # z_loss_func: mean over the tokens of logsumexp^2 (coeff / tp_cp)
            aux = aux + z.z_coeff * torch.logsumexp(logits, -1).pow(2).mean()
        if z.megatron_router:
            bias = P[p + ".mlp.router.expert_bias"].float() if z.expert_bias else None
            probs, routed = topk_routing_with_score_function(
                logits, z.topk, use_pre_softmax=z.pre_softmax, num_groups=z.num_groups,
                group_topk=z.group_topk, scaling_factor=z.scaling,
                score_function=z.score_function, expert_bias=bias)
        elif z.pre_softmax:
            top_p, top_e = ranked(torch.softmax(logits, -1), z.topk)
        else:
            top_logits, top_e = ranked(logits, z.topk)
            top_p = torch.softmax(top_logits, -1)
        if not z.megatron_router:
            probs = torch.zeros_like(logits).scatter(1, top_e, top_p)  # [T, E], 0 unrouted
            routed = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_e, True)
        if z.capacity_factor is not None:
            # apply_router_token_dropping: capacity = ceil(T k / E * factor) per expert; when it
            # is below T, each expert keeps the capacity tokens with the largest routing
            # probability ("probs"; 0 for a token not routed to it) or the earliest routed
            # ("position"), equal values by the lower token index.
            capacity = math.ceil(T * z.topk / z.E * z.capacity_factor)
            if capacity < T:
                key = probs if z.drop_policy == "probs" else routed.to(probs.dtype)
                keep_rows = ranked(key.detach().t(), capacity)[1]  # [E, capacity]
                kept = torch.zeros_like(routed).t().scatter(1, keep_rows, True).t()
                routed = routed & kept
                probs = probs * routed
        if z.aux_coeff or z.seq_coeff or z.global_coeff:
            # switch_load_balancing_loss_func on the softmax of all logits, with the top-k
            # counts (before any dropping) of the tokens of the tp x cp group: this dp rank's.
            if z.megatron_router:
                routing_map, scores = compute_routing_scores_for_aux_loss(
                    logits, z.topk, z.score_function)
                routing = routing_map.to(scores.dtype)
            else:
                scores = torch.softmax(logits, -1)
                routing = torch.zeros_like(logits).scatter(1, ranked(scores, z.topk)[1], 1.0)
            if z.aux_coeff:
                counts = routing.sum(0)
                aux = aux + (scores.sum(0) * counts.detach()).sum() * (
                    z.E * z.aux_coeff / (z.topk * T * T))
            if z.seq_coeff:
                # Router._apply_seq_aux_loss: [s*b, E] viewed as [s, b*E], each sample's
                # experts counted as experts of their own over its s tokens, the switch loss
                # with s tokens, divided by b.
                per_sample = scores.reshape(z.s, -1)
                counts = routing.reshape(z.s, -1).sum(0)
                aux = aux + (per_sample.sum(0) * counts.detach()).sum() * (
                    z.E * z.seq_coeff / (z.topk * z.s * z.s)) / z.b
            if z.global_coeff:  # after every dp rank's routing (below)
                global_terms.append((scores, routing.detach().sum(0).long()))
        if z.expert_bias:  # TopKRouter._apply_expert_bias: the routing map after dropping
            counts = z.tokens_per_expert.setdefault(p, torch.zeros(z.E, dtype=torch.float32))
            counts += routed.sum(dim=0).float()
        y = torch.zeros_like(xs)
        for e in range(z.E):
            rows = routed[:, e].nonzero().squeeze(-1)  # this expert's tokens, in order
            if rows.numel() == 0:
                continue
            y = y.index_add(0, rows, mlp(z, xs[rows], P[z.expert(p, e, 1)], P[z.expert(p, e, 2)],
                                         probs[rows, e], P.get(z.expert(p, e, 1, "bias")),
                                         P.get(z.expert(p, e, 2, "bias"))))
        if z.shared_ffn:
            y = y + mlp(z, xs, P[p + ".mlp.shared_experts.linear_fc1.weight"],
                        P[p + ".mlp.shared_experts.linear_fc2.weight"])
        out[:, dp * z.b:(dp + 1) * z.b, :] = y.reshape(z.s, z.b, z.h)
    if global_terms:
        # Router._apply_global_aux_loss: the counts all-reduced over tp x dp x cp (here the dp
        # ranks' summed), added to the float32 tracker, ga_steps += 1, their quotient the
        # tokens per expert; each dp rank's loss on its own scores with the token count of
        # the whole group (local_num_tokens * tp_dp_cp size).
        tracker = z.global_tracker.setdefault(
            p, [torch.zeros(z.E, dtype=torch.float32), torch.tensor(0, dtype=torch.float32)])
        tracker[0] += sum(counts for _, counts in global_terms)
        tracker[1] += 1
        averated_tokens_per_expert = tracker[0] / tracker[1]
        for scores, _ in global_terms:
            aux = aux + switch_load_balancing_loss_func(
                scores, averated_tokens_per_expert, scores.shape[0] * z.d, z.topk, z.E,
                z.global_coeff)
    return out, aux


def yarn_get_mscale(scale=1.0, mscale=1.0):
    """yarn_rotary_pos_embedding.py _yarn_get_mscale."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def mla_parameters(z, p, weight, norm):
    """MLASelfAttention's parameters (local spec: ColumnParallelLinear projections, the
    q/kv latent norms q_layernorm and kv_layernorm with qk_layernorm, q_layernorm only with
    q_lora_rank); linear_proj is the caller's."""
    ml = z.mla
    dq = ml.qk + ml.pe
    if ml.q_lora is not None:
        weight(p + ".linear_q_down_proj.weight", ml.q_lora, z.h)
        if z.qk_layernorm:
            norm(p + ".q_layernorm", ml.q_lora)
        weight(p + ".linear_q_up_proj.weight", z.a * dq, ml.q_lora)
    else:
        weight(p + ".linear_q_proj.weight", z.a * dq, z.h)
    weight(p + ".linear_kv_down_proj.weight", ml.kv_lora + ml.pe, z.h)
    if z.qk_layernorm:
        norm(p + ".kv_layernorm", ml.kv_lora)
    weight(p + ".linear_kv_up_proj.weight", z.a * (ml.qk + ml.v), ml.kv_lora)


def mla_rotary_pos_emb(z):
    """MLA's rotary_pos_emb and mscale: RotaryEmbedding(qk_pos_emb_head_dim) for rope_type
    "rope" (mscale 1), else YarnRotaryEmbedding.get_emb: emb [s, 1, 1, pe] and its
    concentration factor _yarn_get_concentration_factor(factor, mscale, mscale_all_dim)."""
    ml = z.mla
    dim = ml.pe
    seq = torch.arange(z.s, dtype=torch.float64)
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    if ml.rope_type == "rope":
        inv_freq = 1.0 / (z.rotary_base ** exponents)
        freqs = torch.outer(seq, inv_freq)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :], 1.0
    inv_freq_extra = 1.0 / (z.rotary_base ** exponents)
    inv_freq_inter = 1.0 / (ml.factor * z.rotary_base ** exponents)

    def correction_dim(num_rotations):  # _yarn_find_correction_dim
        return (dim * math.log(ml.original / (num_rotations * 2 * math.pi))) / (
            2 * math.log(z.rotary_base))

    low = max(math.floor(correction_dim(ml.beta_fast)), 0)  # _yarn_find_correction_range
    high = min(math.ceil(correction_dim(ml.beta_slow)), dim - 1)
    if low == high:  # _yarn_linear_ramp_mask
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
    inv_freq_mask = 1.0 - ramp
    inv_freq = inv_freq_inter * (1 - inv_freq_mask) + inv_freq_extra * inv_freq_mask
    freqs = torch.outer(seq, inv_freq)
    mscale = yarn_get_mscale(ml.factor, ml.mscale) / yarn_get_mscale(ml.factor, ml.mscale_all_dim)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :], mscale


def apply_mla_rope(t, freqs, mscale):
    """rope_utils._apply_rotary_pos_emb_bshd with mla_rotary_interleaved=True: the channels
    de-interleaved (even, then odd), then t * cos + rotate_half(t) * sin, cos and sin scaled by
    mscale; the output stays de-interleaved."""
    rot_dim = freqs.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    t = torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)
    cos_ = torch.cos(freqs) * mscale
    sin_ = torch.sin(freqs) * mscale
    x1, x2 = torch.chunk(t, 2, dim=-1)
    t = t * cos_ + torch.cat((-x2, x1), dim=-1) * sin_
    return torch.cat((t, t_pass), dim=-1)


def mla_qkv(z, P, p, h1):
    """MLASelfAttention.get_query_key_value_tensors (unfused rope) on h1 [s, B, h]: query and
    key [s, B, a, qk_head_dim + qk_pos_emb_head_dim], value [s, B, a, v_head_dim], and the
    softmax_scale MultiLatentAttention gives its core attention."""
    ml = z.mla
    dq = ml.qk + ml.pe
    if ml.q_lora is not None:
        q_compressed = F.linear(h1, P[p + ".linear_q_down_proj.weight"])
        if z.qk_layernorm:
            q_compressed = normalize(z, q_compressed, p + ".q_layernorm", P)
        q = F.linear(q_compressed, P[p + ".linear_q_up_proj.weight"])
    else:
        q = F.linear(h1, P[p + ".linear_q_proj.weight"])
    kv_combined = F.linear(h1, P[p + ".linear_kv_down_proj.weight"])
    kv_compressed, k_pos_emb = torch.split(kv_combined, [ml.kv_lora, ml.pe], dim=-1)
    if z.qk_layernorm:
        kv_compressed = normalize(z, kv_compressed, p + ".kv_layernorm", P)
    q = q.view(z.s, z.B, z.a, dq)
    kv = F.linear(kv_compressed, P[p + ".linear_kv_up_proj.weight"])
    kv = kv.view(z.s, z.B, z.a, ml.qk + ml.v)
    k_pos_emb = torch.unsqueeze(k_pos_emb, -2)  # [s, B, 1, pe]
    rotary_pos_emb, mscale = mla_rotary_pos_emb(z)
    q_no_pe, q_pos_emb = torch.split(q, [ml.qk, ml.pe], dim=-1)
    k_no_pe, value = torch.split(kv, [ml.qk, ml.v], dim=-1)
    q_pos_emb = apply_mla_rope(q_pos_emb, rotary_pos_emb, mscale)
    k_pos_emb = apply_mla_rope(k_pos_emb, rotary_pos_emb, mscale)
    query = torch.cat([q_no_pe, q_pos_emb], dim=-1)
    key = torch.cat([k_no_pe, k_pos_emb.expand(-1, -1, z.a, -1)], dim=-1)
    # MultiLatentAttention.__init__: mscale(rotary_scaling_factor, mscale_all_dim)^2 /
    # sqrt(q_head_dim), whatever rope_type is.
    m_all = yarn_get_mscale(ml.factor, ml.mscale_all_dim)
    return query, key, value, m_all * m_all / math.sqrt(dq)


def transformer_layer(z, P, p, layer_number, moe, x, aux_terms):
    """One TransformerLayer (local spec) under prefix p on the residual stream x [s, B, h]:
    layer_number (1-based) decides the sliding window, moe an MoE layer, whose auxiliary
    objective (moe_layer) joins aux_terms."""
    r = z.a // z.g
    causal = torch.triu(torch.ones(z.s, z.s, dtype=torch.bool), diagonal=1)
    get = lambda name: P.get(p + name)
    h1 = normalize(z, x, p + ".input_layernorm", P)
    divisor, width = math.sqrt(z.dk), z.dk  # the softmax scale's inverse, value heads
    if z.mla:  # MLASelfAttention: its own query, key and value heads and softmax scale
        q, k, v, softmax_scale = mla_qkv(z, P, p + ".self_attention", h1)
        divisor, width = 1 / softmax_scale, z.mla.v
    else:
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
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / divisor
    if is_layer_window_attention(z.window_size, z.window_skip, layer_number):
        scores = attention_mask_func(
            scores, get_sliding_window_causal_mask(z.s, z.s, z.window_size))
    else:
        scores = scores.masked_fill(causal, float("-inf"))
    if z.softmax_type == "vanilla":
        probs = torch.softmax(scores, dim=-1)
    else:
        # "off-by-one": a zeros buffer; "learnable": the parameter.
        offset = (get(".self_attention.core_attention.softmax_offset")
                  if z.softmax_type == "learnable" else torch.zeros(z.a, dtype=torch.float64))
        probs = softmax_one(scores, offset)
    context = torch.einsum("bhqk,kbhd->qbhd", probs, v).reshape(z.s, z.B, z.a * width)
    x = x + F.linear(context, get(".self_attention.linear_proj.weight"),
                     get(".self_attention.linear_proj.bias"))
    h2 = normalize(z, x, p + ".pre_mlp_layernorm", P)
    if moe:
        moe_out, aux = moe_layer(z, P, p, h2)
        aux_terms.append(aux)
        return x + moe_out
    fc1 = F.linear(h2, get(".mlp.linear_fc1.weight"), get(".mlp.linear_fc1.bias"))
    act = activation(z, fc1)
    return x + F.linear(act, get(".mlp.linear_fc2.weight"), get(".mlp.linear_fc2.bias"))


def microbatch_loss_sum(z, P, tokens, labels, aux_terms=None):
    """Sum of the token losses of one micro-batch; tokens, labels: [s, B] int64. An MoE
    model appends each MoE layer's auxiliary objective (moe_layer) to aux_terms."""
    x = F.embedding(tokens, P["embedding.word_embeddings.weight"])  # [s, B, h]
    if not z.rope:
        x = x + P["embedding.position_embeddings.weight"][: z.s].unsqueeze(1)
    for i in range(z.L):
        x = transformer_layer(z, P, f"decoder.layers.{i}", i + 1, z.moe_layers[i], x, aux_terms)
    final = normalize(z, x, "decoder.final_layernorm", P)
    out_w = P["embedding.word_embeddings.weight"] if z.tied else P["output_layer.weight"]
    logits = F.linear(final, out_w)  # [s, B, Vp]: the padded columns take part
    # Megatron's vocab_parallel_cross_entropy smooths with ls * Vp / (Vp - 1) over Vp
    # classes, which is torch's label_smoothing with that value.
    smoothing = z.label_smoothing * z.Vp / (z.Vp - 1)
    return F.cross_entropy(logits.reshape(-1, z.Vp), labels.reshape(-1), reduction="sum",
                           label_smoothing=smoothing)


def roll_tensor(t):
    """multi_token_prediction.roll_tensor with cp 1 on Megatron's [b, s] ids, labels and loss
    mask: torch.roll(shifts=-1) along the sequence, the vacated last position set to 0."""
    rolled = torch.roll(t, shifts=-1, dims=-1)
    rolled.select(-1, -1).fill_(0)
    return rolled


def cp_positions(z, r):
    """get_batch_on_this_cp_rank: the sequence cut into 2 cp chunks, cp rank r holding chunks
    r and 2 cp - 1 - r, in that order."""
    c = z.s // (2 * z.cp)
    return list(range(r * c, (r + 1) * c)) + list(range((2 * z.cp - 1 - r) * c,
                                                        (2 * z.cp - r) * c))


def roll_tensor_cp(local):
    """multi_token_prediction.roll_tensor(shifts=-1, dims=-1) with a cp group, every cp rank
    at once: local[r] is rank r's [b, s / cp] piece. Each rank rolls its two chunks, sends
    each chunk's first element (the rolled chunk's last) to the rank that needs it and puts
    what it receives in place of each chunk's last element: rank r != 0 sends its first
    chunk's to r - 1 and receives its second chunk's from r - 1 (rank 0: 0), rank
    r != cp - 1 receives its first chunk's from r + 1 and sends its second chunk's to r + 1
    (the last rank: its own second chunk's). Returns the rolled pieces and their local sums."""
    cp = len(local)
    rolled = [[torch.roll(part, shifts=-1, dims=-1) for part in t.chunk(2, dim=-1)]
              for t in local]
    send = [[part.select(-1, -1).clone() for part in parts] for parts in rolled]
    out = []
    for r in range(cp):
        recv_first = send[r + 1][0] if r != cp - 1 else send[r][1]
        recv_second = send[r - 1][1] if r != 0 else 0
        rolled[r][0][..., -1] = recv_first
        rolled[r][1][..., -1] = recv_second
        piece = torch.cat(rolled[r], dim=-1)
        out.append((piece, piece.sum()))
    return out


def mtp_microbatch(z, P, tokens, labels, aux_terms):
    """A GPTModel with MTP on one micro-batch (tokens, labels: [s, B] int64), as
    GPTModel._postprocess runs it: the decoder (its final layernorm included), then
    MultiTokenPredictionBlock.forward and process_mtp_loss. Returns (the sum of the main
    token losses, the MTP objective of the micro-batch): for each data-parallel rank (its own
    [b, s] labels and loss mask, as Megatron's forward_step sees them) and depth k,
    mtp_loss_scaling_factor / mtp_num_layers * sum(loss_mask_k * loss_k) / num_tokens_k, the
    term MTPLossAutoScaler attaches to the hidden states (its gradient 1 * the main loss's
    backward scale). Each MoE layer's auxiliary objective, the depths' included (their
    routers attach it as the decoder's do, unscaled by the MTP factor), joins aux_terms."""
    out_w = P["embedding.word_embeddings.weight"] if z.tied else P["output_layer.weight"]
    smoothing = z.label_smoothing * z.Vp / (z.Vp - 1)

    def lm_loss(h, target):  # compute_language_model_loss: [s, B] per-token losses
        logits = F.linear(h, out_w)
        return F.cross_entropy(logits.reshape(-1, z.Vp), target.reshape(-1), reduction="none",
                               label_smoothing=smoothing).view(z.s, z.B)

    x = F.embedding(tokens, P["embedding.word_embeddings.weight"])  # rope: no positions
    for i in range(z.L):
        x = transformer_layer(z, P, f"decoder.layers.{i}", i + 1, z.moe_layers[i], x, aux_terms)
    hidden = normalize(z, x, "decoder.final_layernorm", P)
    main = lm_loss(hidden, labels).sum()

    # MultiTokenPredictionBlock.forward: each layer rolls the ids ([b, s]: here [B, s]) once,
    # embeds them, and joins cat(enorm(embedding), hnorm(hidden)) through eh_proj.
    input_ids = tokens.t().contiguous()  # [B, s]
    depth_hidden = []
    h = hidden
    for k in range(z.mtp):
        p = f"mtp.layers.{k}"
        input_ids = roll_tensor(input_ids)
        decoder_input = F.embedding(input_ids.t(), P["embedding.word_embeddings.weight"])
        e = normalize(z, decoder_input, p + ".enorm", P)
        hn = normalize(z, h, p + ".hnorm", P)
        y = F.linear(torch.cat((e, hn), -1), P[p + ".eh_proj.weight"])
        # The last decoder layer's spec; its own layer number (MultiTokenPredictionLayer's
        # layer_number: the depth, 1-based).
        y = transformer_layer(z, P, p + ".transformer_layer", k + 1, z.moe_layers[-1], y,
                              aux_terms)
        h = normalize(z, y, p + ".final_layernorm", P)
        depth_hidden.append(h)

    # process_mtp_loss, per data-parallel rank (calculate_per_token_loss False).
    objective = hidden.new_zeros(())
    if z.cp > 1:
        # Per dp and cp rank: its [b, s / cp] labels and loss mask rolled across the cp group,
        # each depth's loss over its own unmasked tokens (roll_tensor's local sum); the
        # gradient average runs over dp x cp, so each rank's term carries 1 / cp besides the
        # caller's 1 / (M d).
        for dp in range(z.d):
            cols = slice(dp * z.b, (dp + 1) * z.b)
            mtp_labels = [labels[cp_positions(z, r), cols].t().contiguous() for r in range(z.cp)]
            loss_mask = [torch.ones(z.b, z.s // z.cp, dtype=torch.float64) for _ in range(z.cp)]
            for k in range(z.mtp):
                mtp_labels = [t for t, _ in roll_tensor_cp(mtp_labels)]
                rolled_mask = roll_tensor_cp(loss_mask)
                loss_mask = [t for t, _ in rolled_mask]
                for r in range(z.cp):
                    num_tokens = rolled_mask[r][1]
                    logits = F.linear(depth_hidden[k][cp_positions(z, r)][:, cols, :], out_w)
                    mtp_loss = F.cross_entropy(logits.reshape(-1, z.Vp),
                                               mtp_labels[r].t().reshape(-1), reduction="none",
                                               label_smoothing=smoothing)
                    mtp_loss = loss_mask[r] * mtp_loss.view(z.s // z.cp, z.b).t()
                    mtp_loss_scale = z.mtp_scale / z.mtp
                    objective = objective + mtp_loss_scale * mtp_loss.sum() / num_tokens.clamp(
                        min=1) / z.cp
        return main, objective
    for dp in range(z.d):
        cols = slice(dp * z.b, (dp + 1) * z.b)
        mtp_labels = labels[:, cols].t().contiguous()  # [b, s]
        loss_mask = torch.ones(z.b, z.s, dtype=torch.float64)
        for k in range(z.mtp):
            mtp_labels = roll_tensor(mtp_labels)
            loss_mask = roll_tensor(loss_mask)
            num_tokens = loss_mask.sum()
            logits = F.linear(depth_hidden[k][:, cols, :], out_w)  # [s, b, Vp]
            mtp_loss = F.cross_entropy(logits.reshape(-1, z.Vp), mtp_labels.t().reshape(-1),
                                       reduction="none", label_smoothing=smoothing)
            mtp_loss = loss_mask * mtp_loss.view(z.s, z.b).t()  # [b, s]
            mtp_loss_scale = z.mtp_scale / z.mtp
            objective = objective + mtp_loss_scale * mtp_loss.sum() / num_tokens.clamp(min=1)
    return main, objective


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
    for name, t in P.items():
        if not name.endswith(".expert_bias"):
            t.requires_grad_(True)
    aux_terms = []
    moe_aux = None  # with MTP: the MoE layers' part of the auxiliary objective
    if z.mtp:
        # The MTP objective joins the gradient as the MoE auxiliary losses do, 1 / (M d) of
        # each dp rank's and micro-batch's: MTPLossAutoScaler's scale is 1 / M (schedules.py
        # set_loss_scale(loss_scale / num_microbatches)) and the data-parallel average 1 / d.
        sums = [mtp_microbatch(z, P, tokens[m], labels[m], aux_terms) for m in range(z.M)]
        loss = sum(main for main, _ in sums) / (z.M * z.s * z.B)
        moe_aux = sum(aux_terms) / (z.M * z.d) if aux_terms else None
        aux_terms += [objective for _, objective in sums]
    else:
        loss = sum(microbatch_loss_sum(z, P, tokens[m], labels[m], aux_terms)
                   for m in range(z.M))
        loss = loss / (z.M * z.s * z.B)
    # MoE: the auxiliary losses add gradients, scaled as Megatron's schedule sets
    # MoEAuxLossAutoScaler (cp / M) and the data-parallel average (1 / (d cp)) leave them:
    # 1 / (M d) of each dp rank's and micro-batch's; the reported loss stays the LM loss.
    aux = sum(aux_terms) / (z.M * z.d) if aux_terms else loss.new_zeros(())
    (loss + aux).backward()
    tensors = [(name, t) for name, t in P.items()]
    tensors += [(name + ".grad", t.grad) for name, t in P.items() if t.requires_grad]
    for p, counts in z.tokens_per_expert.items():
        bias = P[p + ".mlp.router.expert_bias"].float()
        tensors.append((p + ".mlp.router.expert_bias.updated",
                        get_updated_expert_bias(counts, bias, z.bias_update_rate)))
    tensors += [("tokens", tokens.to(torch.float64)), ("labels", labels.to(torch.float64)),
                ("loss", loss.detach().reshape(1))]
    if aux_terms and not z.mtp:
        tensors.append(("moe_aux_objective", aux.detach().reshape(1)))
    if z.mtp and moe_aux is not None:
        tensors.append(("moe_aux_objective", moe_aux.detach().reshape(1)))
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
    make(CONFIG_D, 4, os.path.join(HERE, "gpt_golden_d.safetensors"))
    make(CONFIG_E, 5, os.path.join(HERE, "gpt_golden_e.safetensors"))
    make(CONFIG_F, 6, os.path.join(HERE, "gpt_golden_f.safetensors"))
    make(CONFIG_K, 21, os.path.join(HERE, "gpt_golden_k.safetensors"))
    make(CONFIG_K_TIED, 22, os.path.join(HERE, "gpt_golden_k_tied.safetensors"))
    make(CONFIG_G, 7, os.path.join(HERE, "gpt_golden_g.safetensors"))
    make(CONFIG_I, 9, os.path.join(HERE, "gpt_golden_i.safetensors"))
    make(CONFIG_H, 8, os.path.join(HERE, "gpt_golden_h.safetensors"))
    make(CONFIG_J, 10, os.path.join(HERE, "gpt_golden_j.safetensors"))
    make(CONFIG_J_Q_PROJ, 11, os.path.join(HERE, "gpt_golden_j_q_proj.safetensors"))
    make(CONFIG_L, 12, os.path.join(HERE, "gpt_golden_l.safetensors"))
    make(CONFIG_L_SQRT, 13, os.path.join(HERE, "gpt_golden_l_sqrtsoftplus.safetensors"))
    make(CONFIG_K_MOE, 23, os.path.join(HERE, "gpt_golden_k_moe.safetensors"))
    make(CONFIG_K_WINDOW, 24, os.path.join(HERE, "gpt_golden_k_window.safetensors"))
    make(CONFIG_K_CP, 25, os.path.join(HERE, "gpt_golden_k_cp.safetensors"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
