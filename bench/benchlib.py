"""Shared pieces of the mpusim benchmark scripts (bench/*.py).

What it is: running contenders in turn (round-robin, so that a noisy neighbour on a shared
machine slows every contender alike), medians, the CPU time and peak memory of a child
process tree, and parsing of `mpusim run` output.
What it is not: a benchmark by itself, or a test. Nothing here asserts a target.
"""
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mpusim(build="build"):
    path = os.path.join(ROOT, build, "cli", "mpusim")
    if not os.access(path, os.X_OK):
        raise SystemExit(f"error: {path} missing; build first: bash .ci/setup")
    return path


def mpirun(ranks):
    return ["mpirun", "-n", str(ranks), "--oversubscribe"]


class Measured:
    """One run of a command: its output, wall time, CPU time of the whole process tree
    (user + system of the command and every descendant it waited for: all MPI ranks under
    mpirun) and the largest peak RSS among them (os.wait4's rusage of this child)."""

    def __init__(self, argv, cwd=ROOT, sample_pss_of=None, allowed_codes=(0,)):
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            sampler = PssSampler(sample_pss_of) if sample_pss_of else None
            start = time.perf_counter()
            proc = subprocess.Popen(argv, stdout=out, stderr=err, env=ENV, cwd=cwd)
            _, status, usage = os.wait4(proc.pid, 0)
            self.wall = time.perf_counter() - start
            if sampler:
                sampler.stop()
            out.seek(0)
            err.seek(0)
            self.out = out.read()
            self.err = err.read()
        self.code = os.waitstatus_to_exitcode(status)
        self.cpu = usage.ru_utime + usage.ru_stime
        self.max_rss_mib = usage.ru_maxrss / 1024.0  # KiB on Linux
        self.peak_pss_mib = sampler.peak_mib if sampler else None
        if self.code not in allowed_codes:
            raise SystemExit(f"error: {' '.join(argv)} exited {self.code}:\n"
                             f"{self.out[-2000:]}\n{self.err[-2000:]}")


class PssSampler:
    """Polls /proc every 20 ms and keeps the largest sum of Pss (proportional set size: a
    page shared by n processes counts 1/n to each) over the processes whose command line
    contains `marker`: the real memory of an MPI job, which a sum of RSS overstates."""

    def __init__(self, marker):
        self.marker = marker.encode()
        self.peak_mib = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._done.is_set():
            total = 0
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if self.marker not in f.read():
                            continue
                    with open(f"/proc/{pid}/smaps_rollup") as f:
                        for line in f:
                            if line.startswith("Pss:"):
                                total += int(line.split()[1])
                                break
                except OSError:
                    continue
            self.peak_mib = max(self.peak_mib, total / 1024.0)
            self._done.wait(0.02)

    def stop(self):
        self._done.set()
        self._thread.join()


def round_robin(contenders, rounds):
    """contenders: {name: function returning a dict of metrics}. Runs one of each per round,
    in turn, and returns {name: {metric: [values per round]}}."""
    results = {name: {} for name in contenders}
    for r in range(rounds):
        for name, run in contenders.items():
            for metric, value in run().items():
                results[name].setdefault(metric, []).append(value)
        if rounds <= 10 or (r + 1) % 10 == 0:
            print(f"  round {r + 1}/{rounds} done", flush=True)
    return results


@contextlib.contextmanager
def blas_threads(threads):
    """ENV with OPENBLAS_NUM_THREADS and OMP_NUM_THREADS set to `threads` (the PyTorch
    contenders' thread count), restored afterwards."""
    saved = {k: ENV.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    ENV.update(OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                ENV.pop(k, None)
            else:
                ENV[k] = v


def median(values):
    return statistics.median(values)


def step_median(output):
    """The median step time `mpusim run --repeat` prints."""
    m = re.search(r"median ([0-9.]+) s", output)
    if not m:
        raise SystemExit("error: no 'median ... s' in the output:\n" + output[-2000:])
    return float(m.group(1))


def mpusim_step(ranks, config, repeat, build="build"):
    """A contender: `mpirun -n RANKS mpusim run CONFIG --no-check --repeat REPEAT`, returning
    {"step": its median step in seconds}."""
    program = mpusim(build)
    return lambda: {"step": step_median(Measured(
        mpirun(ranks) + [program, "run", config, "--no-check", "--repeat", str(repeat)]).out)}


def torch_step(script, threads, repeat, python=None):
    """A contender: the PyTorch script bench/SCRIPT with --threads THREADS --repeat REPEAT
    (BLAS threads set alike), returning {"step": the median step it prints}."""
    def run():
        with blas_threads(threads):
            m = Measured([python or sys.executable, os.path.join(ROOT, "bench", script),
                          "--threads", str(threads), "--repeat", str(repeat)])
        return {"step": step_median(m.out)}
    return run


def backend_line(output):
    m = re.search(r"^backend: (.*)$", output, re.M)
    return m.group(1) if m else "?"


CHECK_ROW = re.compile(r"^  (\S+)\s+\[[^\]]*\]\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(pass|FAIL.*)$")


def check_rows(output):
    """(tensor, max_abs, max_rel, normalized, allowed, result) rows of a run's check table."""
    rows = []
    for line in output.splitlines():
        m = CHECK_ROW.match(line)
        if m:
            rows.append((m.group(1), float(m.group(2)), float(m.group(3)), float(m.group(4)),
                         float(m.group(5)), m.group(6)))
    return rows


def temp_config(config):
    """Writes `config` (a dict) to a temporary JSON file and returns its path."""
    f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, dir="/tmp")
    json.dump(config, f)
    f.close()
    return f.name


def load(path):
    with open(os.path.join(ROOT, path)) as f:
        return json.load(f)


KERNELS = re.compile(r"\((\w+) kernels([^)]*)\)")


def kernels_of(output):
    """(kernel set, how it was chosen) from a `mpusim run` backend line."""
    m = KERNELS.search(backend_line(output))
    return (m.group(1), m.group(2).lstrip(", ")) if m else ("?", "")


def pin_kernels(build="build"):
    """Pins every contender (mpusim and PyTorch alike) to one OpenBLAS kernel set: the
    user's OPENBLAS_CORETYPE, else the one mpusim runs with on this CPU (sim/blas_kernels.h:
    the best the CPU supports), read off a one-rank run. Returns its name for the report."""
    if ENV.get("OPENBLAS_CORETYPE"):
        return ENV["OPENBLAS_CORETYPE"] + " (OPENBLAS_CORETYPE)"
    out = Measured(mpirun(1) + [mpusim(build), "run",
                                os.path.join(ROOT, "sample_configs/lab_parallel_embedding_t2_n2.json"),
                                "--world-size", "1", "--tp", "1", "--no-check"]).out
    name, _ = kernels_of(out)
    ENV["OPENBLAS_CORETYPE"] = name
    return name
