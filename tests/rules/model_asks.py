#!/usr/bin/env python3
"""DESIGN.md's "Nothing outside a model asks which model it holds" as a test.

A Config holds a layer chain (config.model) or a GPT (config.gpt). What code outside a model
may know of it is core/config/model_facts.h (FactsOf: cp_comm_type, experts, fp8, tied
embeddings, the chain answering the neutral value of each), and the estimate, which counts
GPT models only, takes the GptConfig once from core/estimate/estimable.h (EstimatedModel).
So no other source looks inside Config::gpt.

What it checks: every C++/CUDA source and header (.h .cc .cu ...) of the tree outside tests/,
reference/, core/model/ and core/config/ (those build and parse the models) and outside build
trees (a folder holding CMakeCache.txt) and hidden folders. It fails, printing file:line and
the line, on a member access named gpt:

    (\\.|->)\\s*gpt\\b     config.gpt, config_.gpt, r.config.gpt, c.gpt, config->gpt
    Config\\s*::\\s*gpt\\b  a pointer to the member (&Config::gpt)

Config is the only type with a member named `gpt` (gpt_size, GptConfig, "type": "gpt" do not
match), so each hit is an ask. Comments, string and character literals are skipped. Not
caught: a structured binding of a whole Config (none exists).

Usage: model_asks.py SOURCE_DIR      check the tree
       model_asks.py --self-test     plant asks in a scratch tree, check that each is reported
                                     (file:line) and that comments, strings and the allowed
                                     folders are not
"""
import os
import re
import sys
import tempfile

EXTENSIONS = (".h", ".hh", ".hpp", ".cc", ".cpp", ".cxx", ".cu", ".cuh", ".inc", ".inl", ".ipp")
# Folders that may look inside Config::gpt: the models (core/model builds them, core/config
# parses them), the reference (its own GPT model, from the config) and the tests.
ALLOWED_FOLDERS = ("tests", "reference", "core/model", "core/config")
ASK = re.compile(r"(?:\.|->)\s*gpt\b|\bConfig\s*::\s*gpt\b")

# Files outside those folders that ask, each with why: {"path": "why"}. An entry whose file no
# longer asks fails the test, so the list only shrinks.
ALLOWED_FILES = {
    # The contract, declared once: the estimate counts GPT models only, and this is where it
    # takes one (EstimatedModel, EstimableModel).
    "core/estimate/estimable.h": "the estimate's one accessor of the GPT model",
}


def Blank(text):
    """`text` with comments, string literals (raw strings included) and character literals
    replaced by spaces, newlines kept, so that line numbers stay."""
    out = list(text)
    i, n = 0, len(text)

    def Clear(a, b):
        for k in range(a, min(b, n)):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        if text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            Clear(i, end)
            i = end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            Clear(i, end)
            i = end
        elif text[i] == '"':
            m = re.search(r"(?:u8|u|U|L)?R$", text[max(0, i - 3):i])
            if m:  # R"delim( ... )delim"
                open_paren = text.find("(", i)
                delim = text[i + 1:open_paren]
                end = text.find(")" + delim + '"', open_paren)
                end = n if end < 0 else end + len(delim) + 2
            else:
                end = i + 1
                while end < n and text[end] not in '"\n':
                    end += 2 if text[end] == "\\" else 1
                end += 1
            Clear(i, end)
            i = end
        elif text[i] == "'" and not (i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = i + 1
            while end < n and text[end] not in "'\n":
                end += 2 if text[end] == "\\" else 1
            end += 1
            Clear(i, end)
            i = end
        else:
            i += 1
    return "".join(out)


def Sources(root):
    """Yields the repository paths of the checked sources under `root`, sorted."""
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = sorted(
            d for d in dirnames
            if not d.startswith(".") and (rel_dir + d) not in ALLOWED_FOLDERS
            and not os.path.exists(os.path.join(dirpath, d, "CMakeCache.txt")))
        for name in sorted(filenames):
            if name.endswith(EXTENSIONS):
                yield rel_dir + name


def Check(root, allowed_files):
    """Returns (violations, files checked) for the tree at `root`."""
    violations = []
    asking = set()
    files = 0
    for rel in Sources(root):
        files += 1
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            text = f.read()
        lines = text.split("\n")
        for number, line in enumerate(Blank(text).split("\n"), start=1):
            if not ASK.search(line):
                continue
            if rel in allowed_files:
                asking.add(rel)
                continue
            violations.append(
                f"{rel}:{number}: {lines[number - 1].strip()}\n"
                f"    asks which model the Config holds (Config::gpt); read FactsOf(config) "
                f"(core/config/model_facts.h), or, in the GPT-only estimate, EstimatedModel "
                f"(core/estimate/estimable.h)")
    for rel in sorted(set(allowed_files) - asking):
        violations.append(f"{rel}: no longer asks Config::gpt: remove its entry from "
                          f"ALLOWED_FILES in tests/rules/model_asks.py")
    return violations, files


def SelfTest():
    planted = {
        "run/a.cc": "void F(const Config& config) {\n  if (config.gpt) G();\n}\n",
        "cli/b.cc": "int x = r.config.gpt->moe.num_experts;\n",
        "core/estimate/c.h": "// config.gpt in a comment\nauto p = c -> gpt;\n",
        "sim/d.cu": "/* config.gpt\n */ const char* s = \"config.gpt\"; auto m = &Config::gpt;\n",
        "mpi/e.cc": "auto r = R\"x(config.gpt)x\"; char q = '.'; bool b = config_.gpt.has_value();\n",
        # Not asks: the allowed folders, build trees, other names.
        "core/model/f.cc": "auto g = *config.gpt;\n",
        "core/config/g.cc": "if (config.gpt) {}\n",
        "reference/h.cc": "auto g = *config.gpt;\n",
        "tests/i_test.cc": "EXPECT_TRUE(config.gpt);\n",
        "build/cli/j.cc": "auto g = *config.gpt;\n",
        "run/k.cc": "int gpt_size = o.gpt_size; GptConfig gpt; auto t = \"gpt\"; // .gpt\n",
        "run/allowed.cc": "auto g = *config.gpt;\n",
    }
    expected = ["cli/b.cc:1:", "core/estimate/c.h:2:", "mpi/e.cc:1:", "run/a.cc:2:",
                "sim/d.cu:2:", "run/stale.cc: no longer asks"]
    with tempfile.TemporaryDirectory() as root:
        for rel, text in planted.items():
            os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
            with open(os.path.join(root, rel), "w", encoding="utf-8") as f:
                f.write(text)
        with open(os.path.join(root, "build", "CMakeCache.txt"), "w", encoding="utf-8") as f:
            f.write("")
        with open(os.path.join(root, "run", "stale.cc"), "w", encoding="utf-8") as f:
            f.write("int x;\n")
        violations, _ = Check(root, {"run/allowed.cc": "planted", "run/stale.cc": "planted"})
    ok = True
    for want in expected:
        if sum(v.startswith(want) for v in violations) != 1:
            print(f"self-test: expected exactly one report starting {want!r}")
            ok = False
    if len(violations) != len(expected):
        print(f"self-test: {len(violations)} reports, expected {len(expected)}:")
        for v in violations:
            print("  " + v.split("\n")[0])
        ok = False
    print("self-test: " + ("ok" if ok else "FAILED"))
    return 0 if ok else 1


def main(argv):
    if len(argv) == 2 and argv[1] == "--self-test":
        return SelfTest()
    if len(argv) != 2:
        print(__doc__)
        return 2
    violations, files = Check(argv[1], ALLOWED_FILES)
    for v in violations:
        print(v)
    print(f"model_asks: {files} files checked, {len(violations)} asks outside a model")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
