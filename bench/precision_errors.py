#!/usr/bin/env python3
"""Measures how far mixed-precision runs land from the float64 reference.

For every lab config in sample_configs/ with a model, and every storage dtype, runs
`mpirun -n N mpusim run` and reports the largest normalized error (max |a - e| / max |e|)
over all checked tensors, in units of the dtype's unit roundoff u (2^-24 float32, 2^-11
float16, 2^-8 bfloat16). The tolerance in core/compare.h allows 8u for 16-bit storage.

Usage: bench/precision_errors.py [path/to/mpusim]   (default build/cli/mpusim)
"""
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
binary = sys.argv[1] if len(sys.argv) > 1 else "build/cli/mpusim"
env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
row = re.compile(r"^  (\S+)\s+\[[^\]]*\]\s+(\S+)\s+(\S+)\s+(\S+)\s+(pass|FAIL.*)$")

print(f"{'config':<44} {'dtype':<9} {'worst tensor':<24} {'normalized':>10} {'in u':>6}  result")
for path in sorted(glob.glob("sample_configs/lab_*.json")):
    config = json.load(open(path))
    if "model" not in config:
        continue
    for dtype, u in UNIT_ROUNDOFF.items():
        config["parallel"].pop("bf16", None)
        config["parallel"].pop("fp16", None)
        config["run"]["dtype"] = dtype
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(config, f)
        ranks = config["parallel"]["world_size"]
        out = subprocess.run(["mpirun", "-n", str(ranks), "--oversubscribe", binary, "run", f.name],
                             capture_output=True, text=True, env=env)
        os.unlink(f.name)
        worst, name, failed = 0.0, "-", 0
        for line in out.stdout.splitlines():
            m = row.match(line)
            if not m:
                continue
            if m.group(5) != "pass":
                failed += 1
            if float(m.group(4)) > worst:
                worst, name = float(m.group(4)), m.group(1)
        verdict = f"exit {out.returncode}, {failed} failed"
        print(f"{os.path.basename(path):<44} {dtype:<9} {name:<24} {worst:>10.3g} {worst / u:>6.2f}  {verdict}")
