// Fuzz target: file bytes -> ReadSafetensors, and a round trip through WriteSafetensors.
//
// What it is: the libFuzzer entry point for the safetensors reader (core/dump/safetensors.h),
// which takes a path: each input is written to input.safetensors in a per-process scratch
// directory (scratch_dir.h) and read from there. Any input may be refused with a Status; a
// crash, a sanitizer report, a hang or an uncaught exception is a finding. An accepted file
// must also survive the writer: WriteSafetensors(ReadSafetensors(input)) must succeed and
// read back to the same metadata, names, dtypes, shapes and bytes; anything else aborts
// (a file the reader accepts that the writer cannot reproduce is a finding too).
// What it is not: a test of the format's meaning (tests/core/safetensors_test.cc). Built with
// -fsanitize=fuzzer when MPUSIM_FUZZ=ON, and always with replay_main.cc as the ctest test
// fuzz_replay_fuzz_safetensors.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/dump/safetensors.h"
#include "tests/fuzz/scratch_dir.h"

namespace {

void Require(bool holds, const char* what, const std::string& detail) {
  if (holds) return;
  std::fprintf(stderr, "fuzz_safetensors: round trip broken: %s %s\n", what, detail.c_str());
  std::abort();
}

void CheckRoundTrip(const mpusim::fuzz::ScratchDir& scratch,
                    const mpusim::SafetensorsFile& original) {
  const std::string path = (scratch.path() / "round_trip.safetensors").string();
  const mpusim::Status written = mpusim::WriteSafetensors(path, original);
  Require(written.ok(), "the writer refused what the reader accepted:", written.Message());
  const mpusim::StatusOr<mpusim::SafetensorsFile> reread = mpusim::ReadSafetensors(path);
  Require(reread.ok(), "the reader refused what the writer wrote:", reread.status().Message());
  Require(reread->metadata == original.metadata, "metadata differs", "");
  Require(reread->tensors.size() == original.tensors.size(), "tensor count differs", "");
  for (size_t i = 0; i < original.tensors.size(); ++i) {
    const mpusim::NamedTensor& a = original.tensors[i];
    const mpusim::NamedTensor& b = reread->tensors[i];
    Require(a.name == b.name, "name differs:", a.name + " vs " + b.name);
    Require(a.tensor.dtype() == b.tensor.dtype(), "dtype differs:", a.name);
    Require(a.tensor.shape() == b.tensor.shape(), "shape differs:", a.name);
    Require(a.tensor.bytes() == 0 ||
                std::memcmp(a.tensor.data(), b.tensor.data(), a.tensor.bytes()) == 0,
            "data differs:", a.name);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const mpusim::fuzz::ScratchDir scratch("fuzz_safetensors");
  const std::string path = scratch.Write("input.safetensors", data, size);
  const mpusim::StatusOr<mpusim::SafetensorsFile> file = mpusim::ReadSafetensors(path);
  if (file.ok()) CheckRoundTrip(scratch, *file);
  return 0;
}
