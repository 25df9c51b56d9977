// Fuzz target: manifest.json bytes -> LoadDump, then Assemble and DiffDumps on what loads.
//
// What it is: the libFuzzer entry point for the dump reader (core/dump/diff.h). At start-up it
// writes a valid two-rank dump's rank files into a per-process scratch directory
// (scratch_dir.h); each input becomes that directory's manifest.json, so an input close to
// the matching manifest (tests/fuzz/corpus/fuzz_manifest/valid_tp2.json) gets past the
// manifest into the cross-checks: file list, rank metadata, full shapes and dtypes against
// the rank files, coverage. A dump that loads is then reassembled tensor by tensor and
// diffed against itself, and both renderings are produced; its recorded config, if any, is
// also compared with a fixed one (core/dump/config_diff.h). Any input may be refused with a
// Status; a crash, a sanitizer report, a hang or an uncaught exception is a finding.
//
// The rank files (tp = 2, one data-parallel rank), one tensor per kind of layout:
//   w  float32  (4, 2)  split on dim 0 into 2 shards            local (2, 2)
//   h  bfloat16 (2, 4)  split on dim 1 into 2 shards, stride 2  local (2, 2)
//   b  float64  (3)     replicated: bit-identical copies        local (3)
//   y  float32  (2)     partial sum over the tp ranks           local (2)
//   x  float16  (4, 3)  split on dim 0 over "dp" into 2 shards  local (2, 3)
// What it is not: a fuzzer of the rank files themselves (fuzz_safetensors covers their
// reader); their sharding metadata is fixed here. Built with -fsanitize=fuzzer when
// MPUSIM_FUZZ=ON, and always with replay_main.cc as the ctest test fuzz_replay_fuzz_manifest.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "core/dump/diff.h"
#include "core/dump/safetensors.h"
#include "tests/fuzz/scratch_dir.h"

namespace {

using mpusim::DType;

// A host tensor whose element k is base + k: the value for float32 and float64, the bit
// pattern for the 16-bit dtypes (0x3f80 is bfloat16 1.0, 0x3c00 float16 1.0).
mpusim::Tensor Filled(mpusim::Shape shape, DType dtype, int base) {
  mpusim::Tensor t = mpusim::Tensor::HostZeros(std::move(shape), dtype);
  for (int64_t k = 0; k < t.numel(); ++k) {
    const int value = base + static_cast<int>(k);
    switch (dtype) {
      case DType::kFloat32: t.data_as<float>()[k] = static_cast<float>(value); break;
      case DType::kFloat64: t.data_as<double>()[k] = value; break;
      case DType::kBFloat16:
      case DType::kFloat16: t.data_as<uint16_t>()[k] = static_cast<uint16_t>(value); break;
      case DType::kInt64: t.data_as<int64_t>()[k] = value; break;  // not in dumps; complete
    }
  }
  return t;
}

// Metadata of a tensor split by one placement over `axis` (run/dump.cc's format).
std::string ShardMetadata(const std::string& full_shape, const char* axis, int dim, int shards,
                          int index, int stride) {
  return fmt::format(R"({{"full_shape":{},"placements":[{{"axis":"{}","dim":{},"shards":{},)"
                     R"("index":{},"stride":{}}}]}})",
                     full_shape, axis, dim, shards, index, stride);
}

void WriteRankFiles(const mpusim::fuzz::ScratchDir& scratch) {
  for (int tp_rank = 0; tp_rank < 2; ++tp_rank) {
    mpusim::SafetensorsFile file;
    file.metadata["mpusim"] = fmt::format(R"({{"rank":{0},"tp_rank":{0},"dp_rank":0}})", tp_rank);
    file.metadata["w"] = ShardMetadata("[4,2]", "tp", 0, 2, tp_rank, 1);
    file.metadata["h"] = ShardMetadata("[2,4]", "tp", 1, 2, tp_rank, 2);
    file.metadata["b"] = R"({"full_shape":[3],"placements":[]})";
    file.metadata["y"] = R"({"full_shape":[2],"placements":[],"partial_sum":true})";
    // x stands for an activation split over dp; here the two ranks play the two dp ranks.
    file.metadata["x"] = ShardMetadata("[4,3]", "dp", 0, 2, tp_rank, 1);
    file.tensors.push_back({"w", Filled({2, 2}, DType::kFloat32, 10 * tp_rank)});
    file.tensors.push_back({"h", Filled({2, 2}, DType::kBFloat16, 0x3f80 + tp_rank)});
    file.tensors.push_back({"b", Filled({3}, DType::kFloat64, 7)});
    file.tensors.push_back({"y", Filled({2}, DType::kFloat32, tp_rank)});
    file.tensors.push_back({"x", Filled({2, 3}, DType::kFloat16, 0x3c00 + 6 * tp_rank)});
    const std::string path =
        (scratch.path() / fmt::format("rank{:05d}.safetensors", tp_rank)).string();
    const mpusim::Status written = mpusim::WriteSafetensors(path, file);
    if (!written.ok()) {
      std::fprintf(stderr, "fuzz_manifest: cannot write %s: %s\n", path.c_str(),
                   written.Message().c_str());
      std::abort();
    }
  }
}

// The scratch directory with the rank files in it, made once per process.
struct DumpDir {
  DumpDir() { WriteRankFiles(scratch); }
  mpusim::fuzz::ScratchDir scratch{"fuzz_manifest"};
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const DumpDir dump_dir;
  const mpusim::fuzz::ScratchDir& dir = dump_dir.scratch;
  dir.Write("manifest.json", data, size);
  const mpusim::StatusOr<mpusim::Dump> dump = mpusim::LoadDump(dir.path().string());
  if (!dump.ok()) return 0;
  for (const mpusim::DumpTensor& t : dump->tensors()) dump->Assemble(t.name);
  const mpusim::StatusOr<mpusim::DiffResult> diff =
      mpusim::DiffDumps(*dump, *dump, mpusim::DiffOptions{});
  if (!diff.ok()) return 0;
  mpusim::DiffText(*diff);
  mpusim::DiffJson(*diff);
  // Against itself the config has no differences; against a fixed one every key of the
  // input is classified and rendered (hostile values, keys and nesting included).
  if (dump->config()) {
    static const mpusim::FlatConfig reference = mpusim::FlattenConfig(nlohmann::ordered_json::parse(
        R"({"parallel": {"world_size": 2, "tensor_model_parallel_size": 2},
            "model": {"type": "gpt", "num_layers": 2, "hidden_size": 64, "vocab_size": 100},
            "run": {"seed": 1234, "micro_batch_size": 2, "global_batch_size": 8}})"));
    mpusim::DiffResult config_only = *diff;
    config_only.config = mpusim::CompareConfigs(*dump->config(), reference);
    mpusim::DiffText(config_only);
    mpusim::DiffJson(config_only);
  }
  return 0;
}
