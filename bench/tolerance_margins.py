#!/usr/bin/env python3
"""How close correct runs come to the check's tolerance, for the README's calibration table.

For every config with a model (sample_configs/lab_*.json and bench/configs/*.json) and every
storage dtype, runs the checked `mpirun -n N mpusim run` and reports, over all tensors:
  worst      the tensor whose error is the largest fraction of what it is allowed
  normalized its max |a - e| / max |e|
  allowed    its tolerance (core/dump/compare.h: lambda * sigma, sigma from the tensor's error
             budget: sqrt(roundings * u_storage^2 + terms * u_compute^2))
  ratio      normalized / allowed: 1 is the edge of failing; lambda = 8 was chosen so that
             every ratio here stays far below it
and the run's exit code. A run that fails its check is reported, not hidden.

Usage: python3 bench/tolerance_margins.py [config.json ...]   (default: all of them)
"""
import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

DTYPES = ("float64", "float32", "bfloat16", "float16")


def main():
    paths = sys.argv[1:] or sorted(glob.glob(os.path.join(benchlib.ROOT, "sample_configs/lab_*.json")) +
                                   glob.glob(os.path.join(benchlib.ROOT, "bench/configs/*.json")))
    mpusim = benchlib.mpusim()
    print(f"{'config':<40} {'dtype':<9} {'worst tensor':<22} {'normalized':>10} {'allowed':>9} "
          f"{'ratio':>6}  exit")
    overall = 0.0
    for path in paths:
        base = benchlib.load(path)
        if "model" not in base:
            continue
        for dtype in DTYPES:
            config = dict(base, run=dict(base["run"], dtype=dtype))
            config["parallel"] = {k: v for k, v in base["parallel"].items()
                                  if k not in ("bf16", "fp16", "params_dtype")}
            temp = benchlib.temp_config(config)
            try:
                m = benchlib.Measured(benchlib.mpirun(config["parallel"]["world_size"]) +
                                      [mpusim, "run", temp], allowed_codes=(0, 1))
            finally:
                os.unlink(temp)
            worst = max(((row[3] / row[4], row) for row in benchlib.check_rows(m.out) if row[4] > 0),
                        default=(0.0, None))
            overall = max(overall, worst[0])
            name, normalized, allowed = (worst[1][0], worst[1][3], worst[1][4]) if worst[1] else ("-", 0, 0)
            print(f"{os.path.basename(path):<40} {dtype:<9} {name:<22} {normalized:>10.3g} "
                  f"{allowed:>9.3g} {worst[0]:>6.3f}  {m.code}", flush=True)
    print(f"largest ratio: {overall:.3f}")


if __name__ == "__main__":
    main()
