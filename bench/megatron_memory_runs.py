#!/usr/bin/env python3
"""mpusim's memory estimate against the measured memory of real Megatron-Core training runs.

For each row of bench/configs/megatron_memory_runs.json (a Megatron-LM functional test run on a
DGX H100 node: its arguments from model_config.yaml, its measured memory from the golden values
its CI checks every run against) it writes a config in Megatron's key names (model, parallel,
run, optimizer sections) and runs
  mpusim estimate CONFIG --gpu GPU --global-batch-size GBS --format json
then takes the stage the measurement is for (the measuring rank's pipeline stage, with Megatron's
default order tp-cp-ep-dp-pp: stage = rank // (world size / pp)) and compares
  predicted = peak + cuBLAS workspaces
against the measured `mem-max-allocated-bytes` (torch.cuda.memory_stats()
["allocated_bytes.all.peak"]: the caching allocator's high-water mark of live tensors);
error = predicted / measured - 1. `peak` is the estimate's held bytes (parameters, main_grad,
optimizer state) plus the larger of the schedule's activations and buffers and the step's
gradient copies; the cuBLAS workspaces (PyTorch's and TransformerEngine's) are the one part of
the estimate's reserve that PyTorch allocates through its caching allocator, so they are inside
the measured number too. The parts (params, grads, optimizer, activations, buffers) say where a
gap comes from, and `held` is set against the measured `mem-allocated-bytes`, what stays
allocated between iterations: the same parts, measured without the activations.

What the measured number includes that the estimate does not count:
  - transient tensors of the backward and the optimizer that are not in Korthikanti et al.'s
    count: the gradient of the layer being finished, the loss's float32 copies of the logits
    and their gradient, TransformerEngine's and the kernels' scratch tensors, and with
    --no-gradient-accumulation-fusion (every row here) each weight's bf16 gradient before it is
    added to main_grad;
  - small persistent tensors (RoPE and attention-mask caches, TE's per-module state, the
    data-parallel buckets' padding);
and what it does not include but the estimate's reserve does (so the reserve is left out
here): the CUDA context (lives outside PyTorch's allocator), NCCL's buffers (NCCL allocates them
itself, with cudaMalloc / cuMem), and the caching allocator's fragmentation: memory it reserved
(mem-reserved-bytes, `max reserved` in Megatron's report_memory) but holds no live tensor in.
A run's nvidia-smi figure would be about peak + the whole reserve; max allocated is the one number
the estimate's peak claims to predict. The measurements are of one rank, the last (the only one
with a TensorBoard writer), which with the distributed optimizer may hold a slightly smaller piece
of its buffers than the stage's first rank the estimate reports; the table says which stage.

Settings the binary does not know are dropped with a warning as in megatron_core_runs.py (the
first run names the unknown key, the script drops it and retries; --omit-unknown KEY,... drops
up front, --strict refuses instead), and the table names them; settings a row sets that mpusim
has no key for at all (no gradient-accumulation fusion, deterministic mode) are listed per row
under `not_expressed`. A row whose model mpusim cannot express (`unsupported` in the row) is
listed as not run and left out of the gate.

What it is not: a fit (nothing is tuned per row), or a pass/fail test unless --tolerance is
given (exit 1 when a row is off by more; 2 when mpusim refuses a row it should run). Takes
about a second.

Usage: python3 bench/megatron_memory_runs.py [--mpusim build/cli/mpusim] [--markdown FILE]
           [--omit-unknown KEY,...] [--strict] [--tolerance PERCENT] [--only NAME]
           [--write-configs DIR]
"""
import json
import os
import sys
import tempfile

sys.dont_write_bytecode = True  # no __pycache__ in the source tree from the import below
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_core_runs import (  # noqa: E402  (the same options and unknown-key handling)
    finish_report, keep_config, omitted_up_front, run_mpusim, table_arguments)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30


def config_of(row, table):
    """The mpusim config of a row: Megatron's arguments (with its defaults where the row's
    config leaves a setting out) in mpusim's key names."""
    a = row["args"]
    tp = a.get("tensor_model_parallel_size", 1)
    pp = a.get("pipeline_model_parallel_size", 1)
    layers = a["num_layers"]
    local = a.get("transformer_impl") == "local"
    model = {"type": "gpt", "num_layers": layers, "hidden_size": a["hidden_size"],
             "num_attention_heads": a["num_attention_heads"],
             # Megatron's default: 4 x hidden (megatron/training/arguments.py, without --swiglu).
             "ffn_hidden_size": a.get("ffn_hidden_size", 4 * a["hidden_size"]),
             "vocab_size": a["vocab_size"],
             "make_vocab_size_divisible_by": a.get("make_vocab_size_divisible_by", 128),
             "max_position_embeddings": a["max_position_embeddings"],
             "normalization": a.get("normalization", "LayerNorm"),
             "activation": "swiglu" if a.get("swiglu") else "gelu",
             "position_embedding_type": a.get("position_embedding_type", "learned_absolute"),
             "add_bias_linear": not a.get("disable_bias_linear", False),
             "share_embeddings_and_output_weights":
                 not a.get("untie_embeddings_and_output_weights", False),
             # TransformerConfig's defaults: 0.1 each.
             "hidden_dropout": a.get("hidden_dropout", 0.1),
             "attention_dropout": a.get("attention_dropout", 0.1),
             # --transformer-impl local builds Megatron's own DotProductAttention: the
             # materialised s x s attention, whatever attention_backend says.
             "attention_backend": "local" if local else a.get("attention_backend", "auto")}
    if a.get("group_query_attention"):
        model["num_query_groups"] = a["num_query_groups"]
    if a.get("num_experts"):
        model["num_moe_experts"] = a["num_experts"]
        model["moe_router_topk"] = a.get("moe_router_topk", 2)
        model["moe_token_dispatcher_type"] = a.get("moe_token_dispatcher_type", "allgather")
        if a.get("moe_grouped_gemm"):
            model["moe_grouped_gemm"] = True
    parallel = {"world_size": row["gpus"], "gpus_per_node": row["gpus_per_node"],
                "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                "context_parallel_size": a.get("context_parallel_size", 1),
                "sequence_parallel": a.get("sequence_parallel", False),
                "num_layers": layers, "bf16": a.get("bf16", False),
                "gradient_accumulation_fusion": not a.get("no_gradient_accumulation_fusion", False),
                "deterministic_mode": a.get("deterministic_mode", False)}
    per_vp = a.get("num_layers_per_virtual_pipeline_stage")
    if per_vp:
        parallel["virtual_pipeline_model_parallel_size"] = layers // pp // per_vp
    if a.get("expert_model_parallel_size", 1) > 1:
        parallel["expert_model_parallel_size"] = a["expert_model_parallel_size"]
    run = {"dtype": "bfloat16" if a.get("bf16") else "float32", "seq_length": a["seq_length"],
           "micro_batch_size": a["micro_batch_size"]}
    for key in ("recompute_granularity", "recompute_method", "recompute_num_layers"):
        if key in a:
            run[key] = a[key]
    optimizer = {"optimizer": "adam", "lr": 1e-4,
                 "use_distributed_optimizer": a.get("use_distributed_optimizer", False),
                 "overlap_grad_reduce": a.get("overlap_grad_reduce", False),
                 "overlap_param_gather": a.get("overlap_param_gather", False)}
    return {"description": f"{row['name']} on {row['gpus']} {row['gpu']}: "
                           f"{table['sources'][row['source']]['url']}",
            "parallel": parallel, "model": model, "run": run, "optimizer": optimizer}


def gib(x):
    return f"{x / GIB:.2f}"


def layout_cell(a):
    parts = [f"tp {a.get('tensor_model_parallel_size', 1)}"]
    if a.get("sequence_parallel"):
        parts[0] += "+sp"
    if a.get("context_parallel_size", 1) > 1:
        parts.append(f"cp {a['context_parallel_size']}")
    parts.append(f"pp {a.get('pipeline_model_parallel_size', 1)}")
    if a.get("num_layers_per_virtual_pipeline_stage"):
        vp = (a["num_layers"] // a["pipeline_model_parallel_size"]
              // a["num_layers_per_virtual_pipeline_stage"])
        parts.append(f"vp {vp}")
    if a.get("expert_model_parallel_size", 1) > 1:
        parts.append(f"ep {a['expert_model_parallel_size']}")
    return " ".join(parts)


def main():
    args = table_arguments(__doc__, "megatron_memory_runs.json").parse_args()
    with open(args.table) as f:
        table = json.load(f)
    preset = omitted_up_front(args)
    if preset is None:
        return 2
    rows = []  # (cells before the dropped keys, dropped keys, cells after)
    worst, failed, broken, not_run, assumed = 0.0, False, False, [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, row in enumerate(table["rows"]):
            if args.only and args.only not in row["name"]:
                continue
            if row.get("unsupported"):
                not_run.append(f"{row['name']}: {row['unsupported']}")
                continue
            a = row["args"]
            config = config_of(row, table)
            path = os.path.join(tmp, f"row_{i}.json")
            omitted = list(preset)
            est, err = run_mpusim(
                args.mpusim, lambda p: ["estimate", p, "--gpu", row["gpu"],
                                        "--global-batch-size", str(a["global_batch_size"]),
                                        "--format", "json"],
                config, path, omitted, args.strict)
            keep_config(args.write_configs, i, config)
            if est is None:
                not_run.append(f"{row['name']}: {err.splitlines()[-1] if err else ''}")
                broken = True
                continue
            m = row["measured"]
            pp = a.get("pipeline_model_parallel_size", 1)
            stage = m["rank"] // (row["gpus"] // pp)
            st = next(s for s in est["stages"] if s["stage"] == stage)
            mem = st["memory"]
            workspaces = st["reserve"]["cublas_workspaces_bytes"]
            predicted = mem["peak"] + workspaces
            error = 100 * (predicted / m["bytes"] - 1)
            worst = max(worst, abs(error))
            failed |= args.tolerance is not None and abs(error) > args.tolerance
            # What stays allocated between iterations: the held parts and the workspaces.
            held = mem["held"] + workspaces
            held_error = 100 * (held / m["allocated_bytes"] - 1)
            # The step's own part: the peak less what stays allocated, on both sides.
            measured_step = m["bytes"] - m["allocated_bytes"]
            step = predicted - held
            step_error = 100 * (step / measured_step - 1)
            name = row["name"] + (" *" if row["assumed"] else "")
            setting = [f"mbs {a['micro_batch_size']}", f"seq {a['seq_length']}"]
            if a.get("recompute_granularity"):
                setting.append(f"{a['recompute_granularity']} recompute")
            if a.get("use_distributed_optimizer"):
                setting.append("dist. opt.")
            rows.append((
                f"| {name} | {layout_cell(a)}, {', '.join(setting)} | {est['attention_backend']} "
                f"| {m['rank']} ({stage}) | {gib(m['bytes'])} | {gib(predicted)} | {error:+.1f}% "
                f"| {gib(m['allocated_bytes'])} | {gib(held)} | {held_error:+.1f}% "
                f"| {gib(measured_step)} | {gib(step)} | {step_error:+.1f}% "
                f"| {gib(mem['parameters'])} | {gib(mem['gradients'])} | {gib(mem['optimizer'])} "
                f"| {gib(mem['activations'])} | {gib(mem['buffers'])} "
                f"| {gib(mem['step_gradient_copies'])} |",
                ", ".join(k.split(".", 1)[1] for k in omitted) or "-", ""))
            for note in row["assumed"]:
                assumed.setdefault(note, []).append(row["name"])
    # The dropped keys get a column only when they differ between rows; else one line.
    same = len({d for _, d, _ in rows}) <= 1
    lines = ["| run | layout | attention | rank (stage) | max allocated | predicted | error "
             "| between steps | held + ws | error | step (peak − between) | predicted step "
             "| error | params | grads | optimizer | activations | buffers | grad copies |"
             + ("" if same else " dropped keys |"),
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:"
             "|---:|---:|" + ("" if same else "---|")]
    lines += [x + ("" if same else f" {d} |") for x, d, _ in rows]
    lines.append("")
    lines.append("GiB (2^30 bytes). predicted = the stage's peak + cuBLAS workspaces; held + ws = "
                 "parameters + grads + optimizer + cuBLAS workspaces; error = predicted / "
                 "measured - 1.")
    if same and rows and rows[0][1] != "-":
        lines.append(f"Dropped from every row (unknown to this mpusim): {rows[0][1]}.")
    for note, names in assumed.items():
        lines.append(f"* Assumed ({len(names)} rows): {note}.")
    lines.append(f"Worst row: {worst:.1f}% off"
                 + (f" (tolerance {args.tolerance:g}%)" if args.tolerance is not None else
                    " (report only: no tolerance)") + ".")
    return finish_report(lines, not_run, table["skipped"], args.markdown,
                         2 if broken else 1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
