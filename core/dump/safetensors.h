// safetensors files: the per-rank dump format (reader and writer).
//
// Layout: 8-byte little-endian header length N, N bytes of JSON header, then the data.
// Header: {"__metadata__": {string: string}, "<name>": {"dtype": "F32"|"F64"|"BF16"|"F16",
// "shape": [...], "data_offsets": [begin, end]}, ...}; offsets are relative to the start of
// the data and tensors are stored back to back. See https://github.com/huggingface/safetensors.
//
// The reader trusts nothing: header length, JSON, dtypes, shapes, offsets (in range, not
// overlapping, matching dtype size * element count, covering the data exactly) are checked,
// and every problem is a Status naming the file part, never a crash.
// The writer writes to "<path>.tmp.<pid>" and renames, so a reader never sees a partial file.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"

namespace mpusim {

struct NamedTensor {
  std::string name;
  Tensor tensor;  // host, float32, float64, bfloat16 or float16
};

struct SafetensorsFile {
  std::map<std::string, std::string> metadata;  // "__metadata__"
  std::vector<NamedTensor> tensors;            // in file order
};

// Writes atomically. Names must be unique and non-empty; tensors must be host tensors.
Status WriteSafetensors(const std::string& path, const SafetensorsFile& file);

// Reads and validates. Errors name what is wrong ("header: tensor 'x': data_offsets ...").
StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path);

// Writes `text` to `path` atomically (temporary file + rename), for manifests.
Status WriteFileAtomically(const std::string& path, const std::string& text);

}  // namespace mpusim
