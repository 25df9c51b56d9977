#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets into tests/fuzz/corpus/<target>/.

What it is: the one place the committed seeds come from, so each can be read as the case it
stands for: valid inputs (the fuzzer mutates them into near-misses that reach deep checks)
and hostile ones (numbers beyond double, deep nesting, duplicate keys, trailing content,
control characters, NUL bytes, invalid UTF-8, sizes at and beyond int32/int64/uint64, keys
of 15000 characters, bad safetensors lengths and offsets, manifests that disagree with their
rank files). Every file is small except the deep-nesting ones (100000 levels, 200 KB each:
the replay needs the file itself) and the long keys (60 KB). With --mpusim it also
regenerates the dumps made by the program itself (mpirun, 2 and 4 ranks) from the tiny
configs among the fuzz_config seeds.
What it is not: a fuzzer, or the list of what must pass: fuzz_replay_<target> replays
whatever is in the directories (tests/fuzz/README.md).

Usage: python3 tests/fuzz/make_seeds.py [--mpusim build/cli/mpusim]
"""

import argparse
import json
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "corpus"
DEEP = 100_000

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1


def dumps(value):
    return json.dumps(value, separators=(",", ":")).encode()


def deep_array():
    """DEEP nested arrays, closed: valid JSON, so a reader that accepts any depth goes on to
    use the value (and, say, print it recursively in an error message)."""
    return b"[" * DEEP + b"]" * DEEP


# ---------------------------------------------------------------------------------------
# fuzz_config

TINY_RUN = {
    "description": "Tiny run for dump seeds: embedding -> column -> row parallel, t=2.",
    "parallel": {"world_size": 2, "tensor_model_parallel_size": 2},
    "model": {
        "vocab_size": 8,
        "make_vocab_size_divisible_by": 2,
        "layers": [
            {"name": "embedding", "type": "ParallelEmbedding", "num_embeddings": 8,
             "embedding_dim": 4},
            {"name": "fc1", "type": "ColumnParallelLinear", "input_size": 4, "output_size": 4,
             "gather_output": False},
            {"name": "fc2", "type": "RowParallelLinear", "input_size": 4, "output_size": 4,
             "input_is_parallel": True},
        ],
    },
    "run": {"seed": 7, "dtype": "float32", "seq_length": 2, "micro_batch_size": 1},
}
TINY_RUN_BF16_DP2 = json.loads(json.dumps(TINY_RUN))
TINY_RUN_BF16_DP2["parallel"]["world_size"] = 4
TINY_RUN_BF16_DP2["run"]["dtype"] = "bfloat16"

PARALLEL = b'{"parallel": {"world_size": 8, "tensor_model_parallel_size": 2}}'


def config_seeds():
    huge_model = json.loads(json.dumps(TINY_RUN))
    huge_model["model"]["vocab_size"] = INT32_MAX
    huge_model["model"]["layers"][0]["num_embeddings"] = INT32_MAX
    huge_model["model"]["layers"][0]["embedding_dim"] = INT32_MAX - 1
    huge_model["run"]["seq_length"] = INT32_MAX
    huge_model["run"]["micro_batch_size"] = INT32_MAX
    return {
        "valid_tiny_run_t2_n2.json": json.dumps(TINY_RUN, indent=1).encode(),
        "valid_tiny_run_bf16_t2_dp2_n4.json": json.dumps(TINY_RUN_BF16_DP2, indent=1).encode(),
        "valid_parallel_only.json": PARALLEL,
        "number_1e400.json": b'{"parallel": {"world_size": 1e400, '
                             b'"tensor_model_parallel_size": 2}}',
        "number_minus_1e400_seed.json": json.dumps(TINY_RUN).encode().replace(
            b'"seed": 7', b'"seed": -1e400'),
        "number_1e-400.json": b'{"parallel": {"world_size": 1e-400}}',
        "number_beyond_uint64.json": b'{"parallel": {"world_size": 99999999999999999999999}}',
        "size_int32_max.json": dumps({"parallel": {"world_size": INT32_MAX,
                                                   "tensor_model_parallel_size": INT32_MAX}}),
        "size_int32_max_plus_1.json": dumps({"parallel": {"world_size": INT32_MAX + 1}}),
        "size_int64_max.json": dumps({"parallel": {"world_size": INT64_MAX,
                                                   "pipeline_model_parallel_size": INT64_MAX}}),
        "size_uint64_max.json": dumps({"parallel": {"world_size": UINT64_MAX}}),
        "size_negative.json": dumps({"parallel": {"world_size": -1}}),
        "size_float.json": b'{"parallel": {"world_size": 8.0, "tensor_model_parallel_size": 2.5}}',
        "size_huge_model.json": dumps(huge_model),
        "size_rank_offset_at_limit.json": dumps(
            {"parallel": {"world_size": 2, "rank_offset": INT32_MAX - 1}}),
        "deep_nesting_in_world_size.json": b'{"parallel": {"world_size": ' + deep_array()
                                           + b"}}",
        "deep_nesting_object.json": b'{"a":' * 10_000 + b"1" + b"}" * 10_000,
        "duplicate_keys.json": b'{"parallel": {"world_size": 8, "world_size": 4, '
                               b'"tensor_model_parallel_size": 2}}',
        "duplicate_top_level_keys.json": PARALLEL[:-1] + b', "parallel": {"world_size": 2}}',
        "trailing_garbage.json": PARALLEL + b" garbage",
        "trailing_second_document.json": PARALLEL + b"{}",
        "trailing_nul.json": PARALLEL + b"\x00",
        "nul_inside.json": PARALLEL[:12] + b"\x00" + PARALLEL[12:],
        "control_char_key_escaped.json": b'{"parallel": {"world\\u0000_size": 8}}',
        "control_char_key_raw.json": b'{"parallel": {"world\x01_size": 8}}',
        "control_char_value_escaped.json": b'{"description": "a\\u0007\\u001b[31m", '
                                           + PARALLEL[1:],
        "invalid_utf8.json": b'{"description": "\xff\xfe\xc3", ' + PARALLEL[1:],
        "lone_surrogate.json": b'{"description": "\\ud800", ' + PARALLEL[1:],
        "utf8_bom.json": b"\xef\xbb\xbf" + PARALLEL,
        "unterminated_string.json": b'{"parallel": {"world_size',
        "empty.json": b"",
        "whitespace_only.json": b" \n\t\r ",
        "null.json": b"null",
        "array_top_level.json": b"[]",
        "unknown_order_axis.json": b'{"parallel": {"world_size": 8, "order": "tp-xx-dp"}}',
        "order_repeated_axis.json": b'{"parallel": {"world_size": 8, "order": "tp-tp-dp-pp-cp"}}',
        # Unknown keys of 15000 characters: the did-you-mean search once measured each
        # against every known key, seconds per input (a fuzzer timeout).
        "unknown_keys_15000_chars.json": dumps(
            {"parallel": {"world_size": 1},
             "model": {letter * 15_000: 1 for letter in "abcd"}}),
    }


# ---------------------------------------------------------------------------------------
# fuzz_safetensors


def safetensors(header, data=b"", pad=True):
    """A file from a header (dict, or raw bytes used verbatim) and the data bytes."""
    text = header if isinstance(header, bytes) else dumps(header)
    if pad:
        text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data


def f32(*values):
    return struct.pack(f"<{len(values)}f", *values)


def safetensors_seeds():
    one = {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    data = f32(1.0, 2.0)
    valid_one = safetensors(one, data)

    def with_tensor(entry, data_bytes=data):
        return safetensors({"t": entry}, data_bytes)

    return {
        "valid_empty.safetensors": safetensors({}),
        "valid_metadata_only.safetensors": safetensors({"__metadata__": {"k": "v"}}),
        "valid_one_f32.safetensors": valid_one,
        "valid_all_dtypes.safetensors": safetensors({
            "__metadata__": {"mpusim": '{"rank":0,"tp_rank":0,"dp_rank":0}'},
            "a": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [1, 1], "data_offsets": [8, 12]},
            "c": {"dtype": "BF16", "shape": [2], "data_offsets": [12, 16]},
            "d": {"dtype": "F16", "shape": [], "data_offsets": [16, 18]},
            "e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [18, 18]},
        }, struct.pack("<d", 1.0) + f32(2.0) + b"\x80\x3f\x00\x40" + b"\x00\x3c"),
        "length_short_file.safetensors": b"\x08\x00\x00",
        "length_zero.safetensors": struct.pack("<Q", 0) + b"{}",
        "length_uint64_max.safetensors": struct.pack("<Q", UINT64_MAX) + b"{}",
        "length_over_limit.safetensors": struct.pack("<Q", 100_000_001) + b"{}",
        "length_past_end.safetensors": struct.pack("<Q", 64) + b"{}",
        "header_not_object.safetensors": safetensors(b"[]"),
        "header_deep_nesting.safetensors": safetensors(
            b'{"t":{"dtype":"F32","shape":[2],"data_offsets":' + deep_array() + b"}}", data),
        "header_number_1e400.safetensors": safetensors(
            b'{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,1e400]}}', data),
        "header_duplicate_keys.safetensors": safetensors(
            b'{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
            b'"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', data),
        "header_trailing_garbage.safetensors": safetensors(dumps(one) + b"}garbage", data),
        "header_nul_byte.safetensors": safetensors(dumps(one) + b"\x00", data),
        "header_control_char_name.safetensors": safetensors(
            b'{"t\\u0000x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', data),
        "header_invalid_utf8_name.safetensors": safetensors(
            b'{"t\xff":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', data),
        "header_empty_name.safetensors": safetensors(
            {"": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, data),
        "header_metadata_as_tensor_name.safetensors": safetensors(
            {"__metadata__": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, data),
        "metadata_not_strings.safetensors": safetensors({"__metadata__": {"k": 1}}),
        "metadata_not_object.safetensors": safetensors({"__metadata__": "k"}),
        "dtype_unsupported.safetensors": with_tensor(
            {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}),
        "dtype_not_string.safetensors": with_tensor(
            {"dtype": 4, "shape": [2], "data_offsets": [0, 8]}),
        "shape_overflow.safetensors": with_tensor(
            {"dtype": "F32", "shape": [2**40, 2**40, 2**40], "data_offsets": [0, 8]}),
        "shape_zero_then_huge.safetensors": safetensors(
            {"t": {"dtype": "F32", "shape": [0, 2**62, 2**62], "data_offsets": [0, 0]}}),
        "shape_huge_then_zero.safetensors": safetensors(
            {"t": {"dtype": "F32", "shape": [2**62, 2**62, 0], "data_offsets": [0, 0]}}),
        "shape_uint64_max.safetensors": with_tensor(
            {"dtype": "F32", "shape": [UINT64_MAX], "data_offsets": [0, 8]}),
        "shape_negative.safetensors": with_tensor(
            {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}),
        "offsets_begin_after_end.safetensors": with_tensor(
            {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}),
        "offsets_past_end.safetensors": with_tensor(
            {"dtype": "F32", "shape": [2], "data_offsets": [0, UINT64_MAX]}),
        "offsets_float.safetensors": with_tensor(
            {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}),
        "offsets_three.safetensors": with_tensor(
            {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 8]}),
        "offsets_overlap.safetensors": safetensors({
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
        }, data),
        "offsets_gap.safetensors": safetensors(
            {"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, data),
        "data_trailing_bytes.safetensors": valid_one + b"\x00" * 4,
        "data_truncated.safetensors": valid_one[:-2],
        "entry_unknown_key.safetensors": with_tensor(
            {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "extra": 1}),
    }


# ---------------------------------------------------------------------------------------
# fuzz_manifest: the rank files it matches are written by fuzz_manifest.cc at start-up.

VALID_MANIFEST = {
    "schema_version": 2,
    "world_size": 2,
    "backend": "cpu",
    "dtype": "float32",
    "tensors": [
        {"name": "w", "full_shape": [4, 2], "dtype": "float32"},
        {"name": "h", "full_shape": [2, 4], "dtype": "bfloat16"},
        {"name": "b", "full_shape": [3], "dtype": "float64"},
        {"name": "y", "full_shape": [2], "dtype": "float32"},
        {"name": "x", "full_shape": [4, 3], "dtype": "float16"},
    ],
    "files": ["rank00000.safetensors", "rank00001.safetensors"],
}


# An effective config as `mpusim run` records it (core/config/config.h EffectiveConfigJson).
RECORDED_CONFIG = {
    "parallel": {"world_size": 2, "tensor_model_parallel_size": 2, "bf16": False},
    "model": {"type": "gpt", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
              "vocab_size": 100, "moe_layer_freq": [1, 0]},
    "run": {"seed": 99, "dtype": "float32", "seq_length": 8, "micro_batch_size": 2,
            "num_microbatches": 1, "train_iters": 1, "recompute_granularity": None},
}


def manifest(**changes):
    m = json.loads(json.dumps(VALID_MANIFEST))
    m.update(changes)
    return json.dumps(m, indent=1).encode()


def manifest_seeds():
    valid = manifest()
    tensors = VALID_MANIFEST["tensors"]
    return {
        "valid_tp2.json": valid,
        "valid_tp2_bf16_storage.json": manifest(dtype="bfloat16"),
        "files_swapped.json": manifest(files=["rank00001.safetensors", "rank00000.safetensors"]),
        "files_one_rank.json": manifest(world_size=1, files=["rank00000.safetensors"]),
        "files_listed_twice.json": manifest(files=["rank00000.safetensors"] * 2),
        "files_parent_dir.json": manifest(files=["../rank00000.safetensors",
                                                 "rank00001.safetensors"]),
        "files_absolute.json": manifest(files=["/dev/zero", "rank00001.safetensors"]),
        "files_manifest_itself.json": manifest(files=["manifest.json", "rank00001.safetensors"]),
        "files_missing.json": manifest(files=["rank00000.safetensors", "rank00009.safetensors"]),
        "tensor_missing.json": manifest(tensors=tensors[:-1]),
        "tensor_extra.json": manifest(tensors=tensors + [{"name": "z", "full_shape": [1],
                                                          "dtype": "float32"}]),
        "tensor_named_mpusim.json": manifest(tensors=tensors + [{"name": "mpusim",
                                                                 "full_shape": [1],
                                                                 "dtype": "float32"}]),
        "full_shape_mismatch.json": manifest(
            tensors=[{"name": "w", "full_shape": [2, 4], "dtype": "float32"}] + tensors[1:]),
        "full_shape_huge.json": manifest(
            tensors=[{"name": "w", "full_shape": [2**62, 2**62], "dtype": "float32"}]
            + tensors[1:]),
        "dtype_mismatch.json": manifest(
            tensors=[{"name": "w", "full_shape": [4, 2], "dtype": "float16"}] + tensors[1:]),
        # What the run recorded (config and command line): compared key by key by diff.
        "valid_tp2_config.json": manifest(config=RECORDED_CONFIG, config_file="c.json",
                                          command_line="mpusim run c.json --seed 99"),
        "config_not_object.json": manifest(config=[1, 2]),
        "config_null.json": manifest(config=None),
        "command_line_not_string.json": manifest(command_line=["mpusim", "run"]),
        "schema_version_1.json": manifest(schema_version=1),
        "schema_version_3.json": manifest(schema_version=3),
        "world_size_int64_max.json": manifest(world_size=INT64_MAX),
        "world_size_1e400.json": valid.replace(b'"world_size": 2', b'"world_size": 1e400'),
        "duplicate_keys.json": valid.replace(b'"world_size": 2',
                                             b'"world_size": 2, "world_size": 1'),
        "trailing_garbage.json": valid + b"]",
        "control_char_name.json": valid.replace(b'"name": "w"', b'"name": "w\\u0000"'),
        "deep_nesting.json": valid.replace(b'"world_size": 2', b'"world_size": ' + deep_array()),
        "empty.json": b"",
    }


# ---------------------------------------------------------------------------------------
# Dumps made by the program itself (--mpusim).


def program_seeds(mpusim):
    out = {"fuzz_safetensors": {}, "fuzz_manifest": {}}
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for name, config in (("t2_n2", TINY_RUN), ("bf16_t2_dp2_n4", TINY_RUN_BF16_DP2)):
        with tempfile.TemporaryDirectory() as scratch:
            config_path = Path(scratch) / "config.json"
            config_path.write_text(json.dumps(config))
            dump = Path(scratch) / "dump"
            ranks = str(config["parallel"]["world_size"])
            subprocess.run(["mpirun", "-n", ranks, "--oversubscribe", mpusim, "run",
                            str(config_path), "--dump", str(dump)],
                           check=True, env=env, stdout=subprocess.DEVNULL)
            manifest_text = (dump / "manifest.json").read_bytes()
            out["fuzz_manifest"][f"program_dump_{name}.json"] = manifest_text
            rank_file = "rank00001.safetensors"
            out["fuzz_safetensors"][f"program_dump_{name}_{rank_file}"] = (
                dump / rank_file).read_bytes()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mpusim", help="the mpusim program, to regenerate program-made dumps")
    args = parser.parse_args()
    seeds = {
        "fuzz_config": config_seeds(),
        "fuzz_safetensors": safetensors_seeds(),
        "fuzz_manifest": manifest_seeds(),
    }
    if args.mpusim:
        if shutil.which("mpirun") is None:
            parser.error("--mpusim needs mpirun on PATH")
        for target, files in program_seeds(args.mpusim).items():
            seeds[target].update(files)
    for target, files in seeds.items():
        directory = CORPUS / target
        directory.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (directory / name).write_bytes(data)
        print(f"{directory}: {len(files)} seeds written")


if __name__ == "__main__":
    main()
