#!/usr/bin/env python3
"""mpusim's step-time model against Table 1 of Narayanan et al. 2021 (arXiv 2104.04473).

For each row of bench/configs/narayanan_table1.json (model, tp, pp, GPUs, batch and what the
paper measured on Selene's A100s), it writes the config, runs
  mpusim estimate CONFIG --gpu a100-80gb --global-batch-size B --recompute full --format json
and turns the predicted step time into the paper's own measure: teraFLOP/s per GPU with the
recomputation counted, 96 B s l h^2 (1 + s / 6h + V / 16 l h) / step time / GPUs (the full
s x s attention, as the paper counts; Megatron's count halves it since 2025). The runs
materialised the attention probabilities: the table's "attention_backend" ("unfused") is
the model's. Nothing is
fitted per row: the GPU's datasheet figures and the three efficiency constants are
core/estimate/gpu_spec.cc's, the same for every row (docs/estimate.md, "The time model").
Checks first that each row is self-consistent: the parameters the shape implies match the
paper's column within 3%, and per-GPU x GPUs matches its aggregate within 1%.

Then, for each row, `mpusim advise` on the same model, GPU count and batch, searching what
the paper's runs could use (full recomputation, no sequence parallelism, no distributed
optimizer, no context parallelism; any tp, pp, vp and micro-batch size): the "advise" column
is where the paper's (tp, pp) ranks among the distinct (tp, pp) pairs of the fitting layouts,
fastest first, and "advise's pick" the first one. This part is reported, not required (--no-advise skips it).

What it is not: a timing benchmark (the estimate takes milliseconds) or a fit. Exit code 1
when a row is off by more than --tolerance (default 15%).

Usage: python3 bench/narayanan_table1.py [--mpusim build/cli/mpusim] [--tolerance 15]
           [--micro-batch-size 1] [--markdown FILE] [--no-advise]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def paper_flops(batch, s, layers, h, vocab):
    """The paper's FLOPs per iteration with activation recomputation."""
    return 96 * batch * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))


def config_of(row, table):
    _, heads, hidden, layers, tp, pp, gpus, _, _, _, _ = row
    return {
        "description": f"Narayanan et al. 2021, Table 1: {row[0]}B parameters",
        "parallel": {"world_size": gpus, "gpus_per_node": table["gpus_per_node"],
                     "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                     "num_layers": layers, "fp16": True},
        "model": {"type": "gpt", "num_layers": layers, "hidden_size": hidden,
                  "num_attention_heads": heads, "vocab_size": table["vocab_size"],
                  "max_position_embeddings": table["seq_length"],
                  "attention_backend": table["attention_backend"]},
        "optimizer": {"optimizer": "adam", "lr": 1e-4},
    }


def advise_rank(mpusim, path, batch, gpu, paper):
    """Where the paper's (tp, pp) ranks among advise's distinct (tp, pp), and the first."""
    out = subprocess.run(
        [mpusim, "advise", path, "--global-batch-size", str(batch), "--gpu", gpu,
         "--recompute", "full", "--sequence-parallel", "false", "--distributed-optimizer",
         "false", "--max-cp", "1", "--top", "1000", "--format", "json"], capture_output=True,
        text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(out.stderr)
    pairs = []
    for layout in json.loads(out.stdout)["layouts"]:
        pair = (layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"])
        if pair not in pairs:
            pairs.append(pair)
    rank = str(pairs.index(paper) + 1) if paper in pairs else ""
    pick = f"tp {pairs[0][0]} pp {pairs[0][1]}" if pairs else "none fits"
    return rank, pick


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mpusim", default=os.path.join(ROOT, "build", "cli", "mpusim"))
    ap.add_argument("--table", default=os.path.join(ROOT, "bench", "configs",
                                                    "narayanan_table1.json"))
    ap.add_argument("--tolerance", type=float, default=15.0, help="percent")
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--markdown", help="also write the table as Markdown to this file")
    ap.add_argument("--no-advise", action="store_true", help="skip the advise ranks")
    args = ap.parse_args()
    with open(args.table) as f:
        table = json.load(f)
    s, vocab = table["seq_length"], table["vocab_size"]
    lines = ["| parameters | tp | pp | dp | GPUs | batch | paper TFLOP/s | predicted | error "
             "| step time | bubble | tp comm | pp sends | dp comm | advise | advise's pick |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    worst = 0.0
    failed = False
    in_top3 = 0
    with tempfile.TemporaryDirectory() as tmp:
        for row in table["rows"]:
            params_b, heads, h, layers, tp, pp, gpus, batch, reported, _, aggregate = row
            implied = (12 * layers * h * h * (1 + 13 / (12 * h)) + (vocab + s) * h) / 1e9
            if abs(implied / params_b - 1) > 0.03 or abs(reported * gpus / 1e3 / aggregate - 1) > 0.01:
                print(f"error: row {params_b}B is not self-consistent (shape implies "
                      f"{implied:.1f}B; {reported} x {gpus} vs {aggregate} PFLOP/s)",
                      file=sys.stderr)
                return 2
            path = os.path.join(tmp, f"row_{params_b}.json")
            with open(path, "w") as f:
                json.dump(config_of(row, table), f)
            out = subprocess.run(
                [args.mpusim, "estimate", path, "--gpu", table["gpu"], "--global-batch-size",
                 str(batch), "--micro-batch-size", str(args.micro_batch_size), "--recompute",
                 "full", "--format", "json"], capture_output=True, text=True, check=False)
            if out.returncode != 0:
                print(out.stderr, file=sys.stderr)
                return 2
            est = json.loads(out.stdout)
            step = est["step_time_s"]
            predicted = paper_flops(batch, s, layers, h, vocab) / step / gpus / 1e12
            error = 100 * (predicted / reported - 1)
            worst = max(worst, abs(error))
            failed |= abs(error) > args.tolerance
            t = est["time"]
            rank, pick = "", ""
            if not args.no_advise:
                rank, pick = advise_rank(args.mpusim, path, batch, table["gpu"], (tp, pp))
                in_top3 += rank != "" and int(rank) <= 3
            lines.append(
                f"| {params_b}B | {tp} | {pp} | {gpus // (tp * pp)} | {gpus} | {batch} | "
                f"{reported} | {predicted:.1f} | {error:+.1f}% | {step:.2f} s | "
                f"{100 * t['bubble_s'] / step:.1f}% | {100 * t['tp_comm_s'] / step:.1f}% | "
                f"{100 * t['pp_comm_s'] / step:.1f}% | {100 * t['dp_comm_s'] / step:.1f}% | "
                f"{rank or '-'} | {pick} |")
    lines.append("")
    lines.append(f"Worst row: {worst:.1f}% off (tolerance {args.tolerance:g}%); micro-batch "
                 f"size {args.micro_batch_size}, full recomputation, {table['gpu']}.")
    if not args.no_advise:
        lines.append(f"The paper's (tp, pp) is among advise's first 3 in {in_top3} of "
                     f"{len(table['rows'])} rows.")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
