#!/usr/bin/env python3
"""The include rules of DESIGN.md ("Rules that keep the house livable") as a test.

Reads every #include (and __has_include) of every source and header of core/, sim/, cuda/,
mpi/, reference/, run/ and cli/, and fails, printing file:line and the rule, on one that is
outside its folder's allowed list. Comments and string literals (raw strings included) are
skipped; an include inside #if counts like any other (the condition is printed with it), so
a CUDA header in core/ is refused even under `#if defined(__CUDACC__)`: core/philox.h's
MPUSIM_HD needs no header (nvcc knows __host__ __device__ without one).

The allowed lists are the link graph of the CMake targets, which the configure checks with
mpusim_forbid_links (the top-level CMakeLists.txt): a folder includes only headers of the
folders and libraries its target links. core/ is split like its targets: mpusim_core (every
file of core/ outside the executor's folders, core/ops/ included) and the executor's
core/tensor_parallel, core/context_parallel, core/expert_parallel, core/pipeline, core/model
and core/train. It is not a test of the
compiler's view (a header found through another target's include path still has to be on
the list); it is the architecture you can read.

Usage: include_rules.py SOURCE_DIR      check the tree
       include_rules.py --self-test     break each rule once in a scratch tree, check that
                                        each is reported, and that what is allowed is not
"""
import os
import re
import sys
import tempfile

SCANNED = ("core", "sim", "cuda", "mpi", "reference", "run", "cli")
EXTENSIONS = (".h", ".hh", ".hpp", ".cc", ".cpp", ".cxx", ".cu", ".cuh", ".inc", ".inl", ".ipp")
# Folders a project include starts with (those not scanned are never allowed below).
PROJECT = SCANNED + ("tests", "bench", "tools")
EXECUTOR = ("core/tensor_parallel", "core/context_parallel", "core/expert_parallel",
            "core/pipeline", "core/model", "core/train")
# core/ folders with targets of their own beside mpusim_core: the executor's, and
# core/estimate (mpusim_estimate, which builds models to count their parameters).
CORE_PARTS = EXECUTOR + ("core/estimate",)
BACKEND_LIBS = ("MPI", "Eigen", "BLAS", "CUDA")

# What each part may include besides itself, the C/C++/POSIX system headers, nlohmann/json
# and fmt (which every target links through mpusim_core). The link graph:
#   mpusim_core             nlohmann_json, fmt
#   mpusim_tensor_parallel  mpusim_core            mpusim_pipeline  mpusim_core
#   mpusim_context_parallel mpusim_core
#   mpusim_expert_parallel  mpusim_core; tensor_parallel privately (its headers name none)
#   mpusim_model            tensor_parallel, expert_parallel, pipeline; context_parallel
#                           privately (no header of core/model names it, so what links model
#                           does not see it)
#   mpusim_train            mpusim_model
#   mpusim_mpi              mpusim_core, MPI
#   mpusim_sim              mpusim_core, mpusim_mpi, Eigen/BLAS
#   mpusim_cuda             mpusim_core, mpusim_mpi, CUDA, cuBLAS, NCCL
#   mpusim_reference        mpusim_core, Eigen/BLAS
#   mpusim_run              the executor, mpusim_mpi, mpusim_reference
#   mpusim_cli              mpusim_run, mpusim_sim, CLI11
ALLOWED = {
    "core": {"core"},
    "core/tensor_parallel": {"core"},
    "core/context_parallel": {"core"},
    "core/expert_parallel": {"core", "core/tensor_parallel"},
    "core/pipeline": {"core"},
    "core/model": {"core", "core/tensor_parallel", "core/context_parallel",
                   "core/expert_parallel", "core/pipeline"},
    "core/train": {"core", "core/tensor_parallel", "core/expert_parallel", "core/pipeline",
                   "core/model"},
    "core/estimate": {"core", "core/tensor_parallel", "core/expert_parallel", "core/pipeline",
                      "core/model"},
    "mpi": {"core", "MPI"},
    "sim": {"core", "mpi", "MPI", "Eigen", "BLAS"},
    "cuda": {"core", "mpi", "MPI", "CUDA"},
    "reference": {"core", "Eigen", "BLAS"},
    "run": {"core", *EXECUTOR, "core/estimate", "mpi", "reference", "MPI"},
    "cli": {"core", *EXECUTOR, "core/estimate", "mpi", "reference", "run", "sim", "MPI", "CLI11"},
}
EVERYWHERE = {"system", "nlohmann/json", "fmt"}

# Existing includes that break a rule, each with why it is allowed for now:
# {("path/of/file.cc", "included/path.h"): "why"}. An exception that no longer occurs fails
# the test, so the list only shrinks.
EXCEPTIONS = {}

CPP_HEADERS = set("""
algorithm any array atomic barrier bit bitset cassert ccomplex cctype cerrno cfenv cfloat
charconv chrono cinttypes ciso646 climits clocale cmath codecvt compare complex concepts
condition_variable coroutine csetjmp csignal cstdalign cstdarg cstdbool cstddef cstdint cstdio
cstdlib cstring ctgmath ctime cuchar cwchar cwctype deque exception execution expected
filesystem flat_map flat_set format forward_list fstream functional future generator
initializer_list iomanip ios iosfwd iostream istream iterator latch limits list locale map
mdspan memory memory_resource mutex new numbers numeric optional ostream print queue random
ranges ratio regex scoped_allocator semaphore set shared_mutex source_location span spanstream
sstream stack stacktrace stdexcept stdfloat stop_token streambuf string string_view strstream
syncstream system_error thread tuple type_traits typeindex typeinfo unordered_map
unordered_set utility valarray variant vector version
""".split())
C_HEADERS = set("""
assert.h complex.h ctype.h errno.h fenv.h float.h inttypes.h iso646.h limits.h locale.h math.h
setjmp.h signal.h stdalign.h stdarg.h stdatomic.h stdbool.h stddef.h stdint.h stdio.h stdlib.h
stdnoreturn.h string.h tgmath.h threads.h time.h uchar.h wchar.h wctype.h
""".split())
POSIX_HEADERS = set("""
dirent.h dlfcn.h execinfo.h fcntl.h fnmatch.h getopt.h glob.h grp.h libgen.h link.h netdb.h
poll.h pthread.h pwd.h sched.h semaphore.h spawn.h strings.h syslog.h termios.h unistd.h
cxxabi.h malloc.h alloca.h endian.h byteswap.h
""".split())
POSIX_DIRS = ("sys/", "arpa/", "netinet/", "linux/", "bits/")

# Third-party families, by the include's path.
FAMILIES = [
    ("MPI", re.compile(r"^(mpi\.h|mpif\.h|mpi-ext\.h|mpi_\w*\.h|mpicxx\.h|openmpi/|mpich/)")),
    ("Eigen", re.compile(r"^(Eigen/|unsupported/Eigen/|eigen3/)")),
    ("BLAS", re.compile(r"^(cblas\w*\.h|openblas\w*\.h|f77blas\.h|lapacke\w*\.h|openblas/)")),
    ("CUDA", re.compile(
        r"^(cuda\.h|cuda_\w+\.(h|hpp)|cudaTypedefs\.h|cuda/|nv/|cublas\w*\.h|cusparse\w*\.h"
        r"|cusolver\w*\.h|cufft\w*\.h|curand\w*\.h|cudnn\w*\.h|nccl\w*\.h|nvrtc\.h|cub/"
        r"|thrust/|cutlass/|cute/|nvtx3/|nvToolsExt\w*\.h|crt/|cooperative_groups"
        r"|device_launch_parameters\.h|device_functions\.h|vector_types\.h"
        r"|vector_functions\.h|driver_types\.h|host_defines\.h|library_types\.h|cuComplex\.h"
        r"|math_constants\.h|mma\.h|sm_\d+_\w+\.h|texture_\w+\.h|surface_\w+\.h)")),
    ("nlohmann/json", re.compile(r"^nlohmann/")),
    ("fmt", re.compile(r"^fmt/")),
    ("CLI11", re.compile(r"^CLI/")),
    ("GoogleTest", re.compile(r"^(gtest/|gmock/)")),
    ("Google Benchmark", re.compile(r"^benchmark/")),
]

DESIGN_CORE = ("DESIGN.md: core/ is backend-free: no MPI, CUDA, NCCL or Eigen header; it links "
               "only nlohmann_json and fmt")
DESIGN_REFERENCE = ("DESIGN.md: reference/ cannot link core/tensor_parallel, core/model, "
                    "core/pipeline, core/train, sim, cuda or run: its independence is a build "
                    "fact")


# DESIGN.md: "Nothing outside a model asks which model it holds": the run driver and the
# program see a model through core/model/model.h (BuildModel builds the one a config names).
MODEL_HEADERS = ("core/model/gpt_model.h", "core/model/graph.h")
MODEL_INTERFACE = ("DESIGN.md: nothing outside a model asks which model it holds; run/ and "
                   "cli/ work on the Model interface (core/model/model.h, BuildModel)")

REFERENCE_OPS = ("core/ops/ holds the backends' op functors; the reference computes every op "
                 "with its own float64 code, so that it checks them (it sees the Activation "
                 "enum through core/config/gpt_config.h, not the functors' math)")


def Part(path):
    """The part of the tree a repository path belongs to: "core/model", "core", "sim", ..."""
    parts = path.split("/")
    if parts[0] == "core" and len(parts) > 2 and "core/" + parts[1] in CORE_PARTS:
        return "core/" + parts[1]
    return parts[0]


def Reason(src, what):
    """The rule that refuses `what` (a part or a third-party family) in part `src`."""
    in_core = src == "core" or src.startswith("core/")
    if what == "cli":
        return "only cli/ includes cli/: the program's subcommands are not a library (DESIGN.md)"
    if what in ("GoogleTest", "Google Benchmark"):
        return f"{what} belongs in tests/ and bench/, not in a library"
    if what in ("tests", "bench", "tools"):
        return f"{what}/ is not a library: nothing of the tree includes it"
    if in_core and what in BACKEND_LIBS:
        return DESIGN_CORE
    if in_core and what == "run":
        return "nothing under core/ includes run/ (core is below the run driver)"
    if in_core and what in ("sim", "cuda", "mpi", "reference"):
        return (f"core/ is backend-free and below everything else: it includes nothing of "
                f"{what}/ (DESIGN.md: core/ includes no MPI, Eigen or CUDA)")
    if src == "core" and what in EXECUTOR:
        return ("mpusim_core links none of the executor (core/tensor_parallel, "
                "core/context_parallel, core/expert_parallel, core/pipeline, core/model, "
                "core/train): the reference links mpusim_core, so executor code stays out of "
                "it (" + DESIGN_REFERENCE + ")")
    if in_core and what in EXECUTOR:
        return (f"the executor's layers include only what their target links: {src} does not "
                f"link {what} (core/*/CMakeLists.txt: tensor_parallel, context_parallel and "
                f"pipeline link mpusim_core, expert_parallel links tensor_parallel, model "
                f"links those four, train links model)")
    if src == "reference" and (what in EXECUTOR or what in ("sim", "cuda", "run", "CUDA")):
        return DESIGN_REFERENCE
    if src == "reference" and what in ("mpi", "MPI"):
        return "DESIGN.md: the reference is a plain single-process float64 model (no MPI)"
    if src == "cuda" and what in ("sim", "Eigen", "BLAS"):
        return "DESIGN.md: cuda/ does not depend on sim/ (Eigen/BLAS is the CPU backend's)"
    if src == "sim" and what in ("cuda", "CUDA"):
        return "sim/ does not depend on cuda/: the GPU backend is a plugin (DESIGN.md)"
    if src == "mpi" and what in ("sim", "cuda", "Eigen", "BLAS", "CUDA"):
        return "DESIGN.md: mpi/ is shared by sim and cuda, so it includes neither backend"
    if src in ("sim", "cuda", "mpi") and (what in EXECUTOR or what in ("reference", "run")):
        return (f"{src}/ is a backend behind core/backend.h, core/kernels.h and "
                f"core/communicator.h: the program holds the executor, the reference and the "
                f"runner, and hands it the backend")
    if src == "run" and what in ("sim", "cuda", "CUDA", "Eigen", "BLAS"):
        return ("run/ reaches a backend through core/backend.h: the program links sim/ and "
                "hands it over, and the CUDA backend is a plugin loaded with dlopen")
    if src == "cli" and what in ("cuda", "CUDA"):
        return "the program links no CUDA library: the GPU backend is a plugin loaded with dlopen"
    return f"{src}/ includes only what its target links"


def Classify(inc, delim, root):
    """What an include names: a part of the tree, a third-party family, "system" or None."""
    parts = inc.split("/")
    if parts[0] in PROJECT and len(parts) > 1:
        # <cuda/std/...> and <nv/target> are the toolkit's; "cuda/x.h" that exists is ours.
        if delim == '"' or os.path.exists(os.path.join(root, inc)):
            return Part(inc)
    for family, pattern in FAMILIES:
        if pattern.match(inc):
            return family
    if inc in CPP_HEADERS or inc in C_HEADERS or inc in POSIX_HEADERS:
        return "system"
    if inc.startswith(POSIX_DIRS):
        return "system"
    return None


def DigitSeparator(text, i):
    """Whether the ' at text[i] is a digit separator (1'000'000), not a char literal."""
    j = i
    while j > 0 and re.match(r"[0-9A-Za-z_'.]", text[j - 1]):
        j -= 1
    return j < i and text[j].isdigit()


def Directives(text):
    """Yields (line, directive) for every preprocessor directive of `text`: comments removed,
    continuation lines joined; string literals, char literals and raw strings skipped."""
    i, n, line = 0, len(text), 1
    at_line_start = True
    ident = re.compile(r"[A-Za-z0-9_]")
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            at_line_start = True
            i += 1
            continue
        if c in " \t\r\f\v":
            i += 1
            continue
        if c == "/" and text.startswith("//", i):
            while i < n and text[i] != "\n":
                if text[i] == "\\" and text.startswith("\\\n", i):
                    line += 1
                    i += 1
                i += 1
            continue
        if c == "/" and text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            line += text.count("\n", i, end)
            i = end
            continue
        if c == "#" and at_line_start:
            start_line = line
            out = []
            i += 1
            while i < n and text[i] != "\n":
                if text.startswith("\\\n", i):
                    line += 1
                    i += 2
                    out.append(" ")
                elif text.startswith("//", i):
                    while i < n and text[i] != "\n":
                        i += 1
                elif text.startswith("/*", i):
                    end = text.find("*/", i + 2)
                    end = n if end < 0 else end + 2
                    line += text.count("\n", i, end)
                    i = end
                    out.append(" ")
                else:
                    out.append(text[i])
                    i += 1
            yield start_line, " ".join("".join(out).split())
            continue
        at_line_start = False
        if c == '"':
            # A raw string: R"delim( ... )delim", with an optional u8/u/U/L prefix.
            j = i - 1
            while j >= 0 and ident.match(text[j]):
                j -= 1
            prefix = text[j + 1:i]
            if prefix in ("R", "u8R", "uR", "UR", "LR"):
                open_paren = text.find("(", i)
                delim = text[i + 1:open_paren]
                end = text.find(")" + delim + '"', open_paren)
                end = n if end < 0 else end + len(delim) + 2
                line += text.count("\n", i, end)
                i = end
                continue
            i += 1
            while i < n and text[i] != '"' and text[i] != "\n":
                i += 2 if text[i] == "\\" else 1
            i += 1
            continue
        if c == "'" and not DigitSeparator(text, i):
            i += 1
            while i < n and text[i] != "'" and text[i] != "\n":
                i += 2 if text[i] == "\\" else 1
            i += 1
            continue
        i += 1


INCLUDE = re.compile(r'^(include_next|include|import)\s*(?:([<"])([^>"]*)[>"]|(.*))$')
HAS_INCLUDE = re.compile(r'__has_include(?:_next)?\s*\(\s*([<"])([^>"]*)[>"]\s*\)')


def Includes(text):
    """Yields (line, delimiter, path, condition, how) for each include of `text`: condition
    is the chain of #if's it sits under ("" at top level; include guards left out), how is
    "#include" (or #include_next) or "__has_include"."""
    stack = []  # (directive text, is the include guard)
    directives = list(Directives(text))
    for k, (line, d) in enumerate(directives):
        word = d.split(" ", 1)[0]
        rest = d[len(word):].strip()
        for delim, path in HAS_INCLUDE.findall(d):
            yield (line, delim, path, " && ".join(s for s, guard in stack if not guard),
                   "__has_include")
        if word in ("if", "ifdef", "ifndef"):
            nxt = directives[k + 1][1] if k + 1 < len(directives) else ""
            guard = word == "ifndef" and nxt == "define " + rest
            stack.append(("#" + d, guard))
        elif word in ("elif", "elifdef", "elifndef") and stack:
            stack[-1] = ("#" + d, False)
        elif word == "else" and stack:
            stack[-1] = ("#else of " + stack[-1][0], False)
        elif word == "endif" and stack:
            stack.pop()
        m = INCLUDE.match(d)
        if m:
            cond = " && ".join(s for s, guard in stack if not guard)
            if m.group(4) is not None:
                yield line, "", m.group(4).strip(), cond, "#" + m.group(1)
            else:
                yield line, m.group(2), m.group(3).strip(), cond, "#" + m.group(1)


def Check(root):
    """Returns (violations, files checked, includes checked) for the tree at `root`."""
    violations = []
    used_exceptions = set()
    files = includes = 0
    for top in SCANNED:
        folder = os.path.join(root, top)
        if not os.path.isdir(folder):
            violations.append(f"{top}/: the folder is missing (the rules name it)")
            continue
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames.sort()
            for name in sorted(filenames):
                if not name.endswith(EXTENSIONS):
                    continue
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                src = Part(rel)
                files += 1
                with open(full, encoding="utf-8", errors="replace") as f:
                    text = f.read()
                for line, delim, inc, cond, how in Includes(text):
                    includes += 1
                    shown = f"{delim}{inc}{'>' if delim == '<' else delim}"
                    shown = f"{how}({shown})" if how == "__has_include" else f"{how} {shown}"
                    where = f"{rel}:{line}: {shown}"
                    if cond:
                        where += f" (under {cond})"
                    if (rel, inc) in EXCEPTIONS:
                        used_exceptions.add((rel, inc))
                        continue
                    if delim == "":
                        violations.append(f"{where}: a computed include cannot be checked; "
                                          f"name the header")
                        continue
                    what = Classify(inc, delim, root)
                    if what is None and delim == '"' and ("/" not in inc or inc.startswith(".")):
                        violations.append(
                            f"{where}: project includes are written from the root "
                            f'("core/...", "sim/..."), so that these rules see where they lead')
                        continue
                    if what is None:
                        violations.append(
                            f"{where}: not a known system or third-party header; if it is one, "
                            f"add it to tests/rules/include_rules.py (FAMILIES, or the system "
                            f"lists) and allow it where its library is linked")
                        continue
                    if src in ("run", "cli") and inc in MODEL_HEADERS:
                        violations.append(f"{where}: {src}/ may not include {inc}: "
                                          f"{MODEL_INTERFACE}")
                        continue
                    if src == "reference" and inc.startswith("core/ops/"):
                        violations.append(f"{where}: reference/ may not include core/ops/: "
                                          f"{REFERENCE_OPS}")
                        continue
                    if what in EVERYWHERE or what == src or what in ALLOWED[src]:
                        continue
                    kind = f"{what}/" if what in PROJECT or what in CORE_PARTS else what
                    violations.append(f"{where}: {src}/ may not include {kind}: "
                                      f"{Reason(src, what)}")
    for rel, inc in sorted(set(EXCEPTIONS) - used_exceptions):
        violations.append(f"{rel}: the exception for {inc} is stale (no such include any more):"
                          f" remove it from EXCEPTIONS in tests/rules/include_rules.py")
    return violations, files, includes


# --- self-test: each rule broken once in a scratch tree ----------------------------------
# (file, text, expected substring of the violation or None when it must pass)
SELF_TEST = [
    # core/ and the backends' libraries
    ("core/a.h", "#include <mpi.h>\n",
     "core/ may not include MPI: DESIGN.md: core/ is backend-free"),
    ("core/b.cc", "#include <Eigen/Dense>\n", "core/ may not include Eigen: DESIGN.md"),
    ("core/c.h", "#include <unsupported/Eigen/SpecialFunctions>\n", "core/ may not include Eigen"),
    ("core/d.h", "#include <cuda_runtime.h>\n", "core/ may not include CUDA"),
    ("core/e.h", "#include <cublas_v2.h>\n", "core/ may not include CUDA"),
    ("core/f.h", "#include <nccl.h>\n", "core/ may not include CUDA"),
    ("core/g.h", "#include <cub/cub.cuh>\n", "core/ may not include CUDA"),
    ("core/h.h", "#include <thrust/device_vector.h>\n", "core/ may not include CUDA"),
    ("core/i.h", "#if defined(__CUDACC__)\n#include <cuda_fp16.h>\n#endif\n",
     "core/i.h:2: #include <cuda_fp16.h> (under #if defined(__CUDACC__)): "
     "core/ may not include CUDA"),
    ("core/j.h", "#if __has_include(<cuda_bf16.h>)\n#endif\n",
     "core/j.h:1: __has_include(<cuda_bf16.h>): core/ may not include CUDA"),
    ("core/ops/k.h", "#include <cblas.h>\n", "core/ may not include BLAS"),
    ("core/model/l.h", "#include <mpi.h>\n", "core/model/ may not include MPI"),
    # core/ includes nothing above it
    ("core/m.h", '#include "sim/eigen_kernels.h"\n', "core/ may not include sim/"),
    ("core/n.h", '#include "cuda/cuda_kernels.h"\n', "core/ may not include cuda/"),
    ("core/o.h", '#include "mpi/mpi_check.h"\n', "core/ may not include mpi/"),
    ("core/p.h", '#include "reference/trainer.h"\n', "core/ may not include reference/"),
    ("core/train/q.h", '#include "run/runner.h"\n', "nothing under core/ includes run/"),
    ("core/r.h", '#include "cli/cli.h"\n', "only cli/ includes cli/"),
    # mpusim_core and the executor's layers
    ("core/s.h", '#include "core/model/graph.h"\n', "mpusim_core links none of the executor"),
    ("run/model_a.cc", '#include "core/model/gpt_model.h"\n',
     "run/ may not include core/model/gpt_model.h: DESIGN.md: nothing outside a model asks"),
    ("cli/model_b.cc", '#include "core/model/graph.h"\n',
     "cli/ may not include core/model/graph.h: DESIGN.md: nothing outside a model asks"),
    ("cli/model_c.cc", '#include "core/model/model.h"\n', None),
    ("reference/o.cc", '#include "core/ops/activation.h"\n',
     "reference/ may not include core/ops/"),
    ("core/ops/t.h", '#include "core/tensor_parallel/mappings.h"\n',
     "core/ may not include core/tensor_parallel/: mpusim_core links none of the executor"),
    ("core/pipeline/u.h", '#include "core/model/graph.h"\n',
     "core/pipeline/ may not include core/model/: the executor's layers"),
    ("core/tensor_parallel/v.h", '#include "core/train/optimizer.h"\n',
     "core/tensor_parallel/ may not include core/train/"),
    ("core/model/w.h", '#include "core/train/optimizer.h"\n',
     "core/model/ may not include core/train/"),
    ("core/context_parallel/x.h", '#include "core/model/module.h"\n',
     "core/context_parallel/ may not include core/model/: the executor's layers"),
    ("core/context_parallel/y.cc", '#include "core/tensor_parallel/mappings.h"\n',
     "core/context_parallel/ may not include core/tensor_parallel/"),
    ("core/train/z.cc", '#include "core/context_parallel/ring.h"\n',
     "core/train/ may not include core/context_parallel/"),
    ("core/u.h", '#include "core/context_parallel/a2a.h"\n',
     "core/ may not include core/context_parallel/: mpusim_core links none of the executor"),
    ("core/expert_parallel/x.h", '#include "core/model/moe.h"\n',
     "core/expert_parallel/ may not include core/model/: the executor's layers"),
    ("core/expert_parallel/y.cc", '#include "core/context_parallel/ring.h"\n',
     "core/expert_parallel/ may not include core/context_parallel/"),
    ("core/tensor_parallel/w.h", '#include "core/expert_parallel/permute.h"\n',
     "core/tensor_parallel/ may not include core/expert_parallel/"),
    ("core/v.h", '#include "core/expert_parallel/expert_placement.h"\n',
     "core/ may not include core/expert_parallel/: mpusim_core links none of the executor"),
    # reference/
    ("reference/a.cc", '#include "core/tensor_parallel/mappings.h"\n',
     "reference/ may not include core/tensor_parallel/: DESIGN.md: reference/ cannot link"),
    ("reference/b.cc", '#include "core/model/linear.h"\n',
     "reference/ may not include core/model/"),
    ("reference/c.cc", '#include "core/pipeline/pipeline_plan.h"\n',
     "reference/ may not include core/pipeline/"),
    ("reference/d.cc", '#include "core/train/optimizer.h"\n',
     "reference/ may not include core/train/"),
    ("reference/i.cc", '#include "core/context_parallel/all_gather.h"\n',
     "reference/ may not include core/context_parallel/: DESIGN.md: reference/ cannot link"),
    ("reference/j.cc", '#include "core/expert_parallel/token_dispatcher.h"\n',
     "reference/ may not include core/expert_parallel/: DESIGN.md: reference/ cannot link"),
    ("reference/e.cc", '#include "sim/eigen_kernels.h"\n', "reference/ may not include sim/"),
    ("reference/f.cc", '#include "cuda/cuda_kernels.h"\n', "reference/ may not include cuda/"),
    ("reference/g.cc", '#include "run/check.h"\n', "reference/ may not include run/"),
    ("reference/h.cc", "#include <mpi.h>\n",
     "reference/ may not include MPI: DESIGN.md: the reference"),
    # the backends
    ("cuda/a.cc", '#include "sim/eigen_kernels.h"\n',
     "cuda/ may not include sim/: DESIGN.md: cuda/ does not depend on sim/"),
    ("cuda/b.cu", "#include <Eigen/Core>\n", "cuda/ may not include Eigen"),
    ("cuda/c.cc", '#include "core/model/graph.h"\n', "cuda/ may not include core/model/"),
    ("sim/a.cc", '#include "cuda/cuda_kernels.h"\n', "sim/ may not include cuda/"),
    ("sim/b.cc", "#include <cuda_runtime_api.h>\n", "sim/ may not include CUDA"),
    ("sim/c.cc", '#include "run/runner.h"\n', "sim/ may not include run/"),
    ("mpi/a.cc", '#include "sim/cpu_backend.h"\n', "mpi/ may not include sim/"),
    ("mpi/b.cc", '#include "cuda/cuda_check.h"\n', "mpi/ may not include cuda/"),
    ("run/a.cc", '#include "sim/cpu_backend.h"\n', "run/ may not include sim/"),
    ("run/b.cc", '#include "cuda/cuda_backend.h"\n', "run/ may not include cuda/"),
    ("run/c.cc", '#include "cli/commands.h"\n', "only cli/ includes cli/"),
    ("cli/a.cc", '#include "cuda/cuda_backend.h"\n', "the program links no CUDA library"),
    ("cli/b.cc", "#include <nccl.h>\n", "cli/ may not include CUDA"),
    ("sim/d.cc", "#include <gtest/gtest.h>\n", "GoogleTest belongs in tests/"),
    # how includes are written
    ("sim/e.cc", '#include "eigen_kernels.h"\n', "project includes are written from the root"),
    ("cuda/d.cu", '#include "../core/half.h"\n', "project includes are written from the root"),
    ("run/d.cc", "#include MPUSIM_HEADER\n", "a computed include cannot be checked"),
    ("core/x.h", "#include <boost/optional.hpp>\n", "not a known system or third-party header"),
    # allowed: must not be reported
    ("core/ok.h", "#ifndef MPUSIM_CORE_OK_H_\n#define MPUSIM_CORE_OK_H_\n#include <vector>\n"
     "#include <cstdint>\n#include <unistd.h>\n#include <sys/stat.h>\n#include <fmt/format.h>\n"
     '#include <nlohmann/json.hpp>\n#include "core/tensor.h"\n#include "core/ops/gelu.h"\n'
     "#if defined(__CUDACC__)\n#define MPUSIM_HD __host__ __device__\n#endif\n#endif\n", None),
    ("core/model/ok.cc", '#include "core/tensor_parallel/mappings.h"\n'
     '#include "core/pipeline/pipeline_walk.h"\n#include "core/model/linear.h"\n'
     '#include "core/context_parallel/ring.h"\n', None),
    ("core/context_parallel/ok.cc", '#include "core/kernels.h"\n#include "core/communicator.h"\n'
     '#include "core/context_parallel/sequence_order.h"\n', None),
    ("core/expert_parallel/ok.cc", '#include "core/tensor_parallel/mappings.h"\n'
     '#include "core/expert_parallel/permute.h"\n#include "core/config/gpt_config.h"\n', None),
    ("core/train/ok2.cc", '#include "core/expert_parallel/expert_placement.h"\n', None),
    ("core/train/ok.cc", '#include "core/model/parameter.h"\n', None),
    ("reference/ok.cc", '#include "core/init.h"\n#include "core/philox.h"\n#include <Eigen/Dense>\n'
     '#include "reference/trainer.h"\n', None),
    ("sim/ok.cc", '#include <Eigen/Core>\n#include <mpi.h>\n#include "mpi/mpi_communicator.h"\n'
     '#include "core/kernels.h"\n', None),
    ("cuda/ok.cu", '#include <cuda_runtime.h>\n#include <cub/device/device_radix_sort.cuh>\n'
     '#include <cuda/std/limits>\n#include "cuda/device_kernels.h"\n'
     '#include "mpi/watchdog.h"\n', None),
    ("run/ok.cc", '#include "core/model/model.h"\n#include "reference/trainer.h"\n'
     '#include <mpi.h>\n'
     '#include "mpi/agree.h"\n', None),
    ("cli/ok.cc", '#include "sim/cpu_backend.h"\n#include "run/runner.h"\n#include <CLI/CLI.hpp>\n'
     '#include "cli/commands.h"\n', None),
    # what looks like an include but is not one
    ("core/not_includes.cc", '// #include <mpi.h>\n/* #include <cuda.h>\n#include <nccl.h> */\n'
     'const char* kPage = R"html(\n#include <Eigen/Dense>\n)html";\n'
     'const char* kText = "#include <mpi.h>";\nint kMillion = 1\'000\'000;\nchar kQuote = \'"\';\n'
     '#include <vector>  // <mpi.h>\n', None),
]


def SelfTest():
    failures = []
    with tempfile.TemporaryDirectory() as root:
        for top in SCANNED:
            os.makedirs(os.path.join(root, top))
        # The project headers that "cuda/..." must find to count as ours.
        for rel in ("cuda/device_kernels.h", "cuda/cuda_check.h", "cuda/cuda_kernels.h",
                    "cuda/cuda_backend.h"):
            with open(os.path.join(root, rel), "w") as f:
                f.write("#include <cstddef>\n")
        for rel, text, _ in SELF_TEST:
            os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
            with open(os.path.join(root, rel), "w") as f:
                f.write(text)
        violations, files, _ = Check(root)
        for rel, _, expected in SELF_TEST:
            mine = [v for v in violations if v.startswith(rel + ":")]
            if expected is None and mine:
                failures.append(f"{rel}: allowed, but reported: {mine}")
            elif expected is not None and not any(expected in v for v in mine):
                failures.append(f"{rel}: expected a violation with '{expected}', got {mine}")
            elif expected is not None and len(mine) != 1:
                failures.append(f"{rel}: expected one violation, got {mine}")
        # An exception that no longer occurs is reported.
        EXCEPTIONS[("core/gone.h", "mpi.h")] = "self-test"
        stale, _, _ = Check(root)
        del EXCEPTIONS[("core/gone.h", "mpi.h")]
        if not any("core/gone.h: the exception for mpi.h is stale" in v for v in stale):
            failures.append("a stale exception was not reported")
    for failure in failures:
        print("self-test: " + failure)
    broken = sum(1 for _, _, e in SELF_TEST if e is not None)
    print(f"include_rules self-test: {broken} files that break a rule, "
          f"{len(SELF_TEST) - broken} that break none: {len(failures)} failures")
    return 1 if failures else 0


def main(argv):
    if argv[1:] == ["--self-test"]:
        return SelfTest()
    if len(argv) != 2:
        print(__doc__)
        return 2
    root = argv[1]
    violations, files, includes = Check(root)
    for v in violations:
        print(v)
    print(f"include_rules: {includes} includes in {files} files of "
          f"{', '.join(s + '/' for s in SCANNED)}: {len(violations)} outside the rules"
          + (f" ({len(EXCEPTIONS)} listed exceptions)" if EXCEPTIONS else ""))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
