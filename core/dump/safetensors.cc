// safetensors reader and writer (see safetensors.h).
//
// What it is: a strict implementation, on nlohmann/json and fmt only, of the subset of
// https://github.com/huggingface/safetensors that mpusim dumps: F32, F64, BF16 and F16 host
// tensors plus string metadata. The reader validates every byte it is given before trusting it.
// What it is not: a memory-mapped loader, a converter between dtypes, or a reader for the
// other safetensors dtypes (I64, F8_E4M3, ...), which are refused by name.
#include "core/dump/safetensors.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <span>
#include <string_view>
#include <system_error>
#include <utility>

#include "core/config/strict_json.h"

namespace mpusim {
namespace {

// Tensor bytes are copied verbatim; safetensors stores them little-endian.
static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; byte swapping is not implemented");

using Json = nlohmann::ordered_json;  // keeps the header's key order (ties in data_offsets)

constexpr size_t kLengthBytes = 8;
// The reference implementation's limit (MAX_HEADER_SIZE); anything larger is refused before
// a single header byte is allocated.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr std::string_view kMetadataKey = "__metadata__";

std::string ErrnoSuffix(int err) { return err == 0 ? "" : fmt::format(": {}", std::strerror(err)); }

// Writes `pieces` back to back to "<path>.tmp.<pid>", then renames it onto `path`. The
// temporary file is removed on every failure, so no partial file is ever left behind.
Status WritePiecesAtomically(const std::string& path, std::span<const std::string_view> pieces) {
  const std::string tmp = fmt::format("{}.tmp.{}", path, static_cast<long>(::getpid()));
  auto fail = [&](std::string what) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    return Status::Error("file", std::move(what));
  };
  {
    errno = 0;
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) {
      return fail(fmt::format("cannot open '{}' for writing{}", tmp, ErrnoSuffix(errno)));
    }
    for (std::string_view piece : pieces) {
      out.write(piece.data(), static_cast<std::streamsize>(piece.size()));
      if (!out) return fail(fmt::format("cannot write '{}'{}", tmp, ErrnoSuffix(errno)));
    }
    out.close();
    if (!out) return fail(fmt::format("cannot close '{}'{}", tmp, ErrnoSuffix(errno)));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return fail(fmt::format("cannot rename '{}' to '{}': {}", tmp, path, ec.message()));
  return Status();
}

// The safetensors names of the dtypes mpusim stores. Dumps hold float tensors only (tokens
// and labels are recorded as float64), so int64 ("I64") is neither written nor read.
constexpr std::pair<std::string_view, DType> kSafetensorsDTypes[] = {
    {"F32", DType::kFloat32},
    {"F64", DType::kFloat64},
    {"BF16", DType::kBFloat16},
    {"F16", DType::kFloat16},
};

std::string_view SafetensorsDType(DType dtype) {
  for (const auto& [name, d] : kSafetensorsDTypes) {
    if (d == dtype) return name;
  }
  return "?";
}

// Accepts a JSON integer >= 0 (not 2.0, not "2", not -1).
bool AsNonNegativeInt(const Json& value, uint64_t* out) {
  if (value.is_number_unsigned()) {
    *out = value.get<uint64_t>();
    return true;
  }
  if (value.is_number_integer() && value.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(value.get<int64_t>());
    return true;
  }
  return false;
}

// One tensor entry of the header, validated on its own (not yet against its neighbours).
struct Entry {
  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

Status ParseEntry(const std::string& name, const Json& value, uint64_t data_bytes, Entry* out) {
  const std::string where = fmt::format("tensor '{}'", name);
  if (name.empty()) return Status::Error("header", "a tensor name is empty");
  if (!value.is_object()) {
    return Status::Error(where, fmt::format("must be an object with dtype, shape and "
                                            "data_offsets, got {}",
                                            value.type_name()));
  }
  for (const auto& [key, unused] : value.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return Status::Error(where, fmt::format("unknown key '{}'; allowed: dtype, shape, "
                                              "data_offsets",
                                              key));
    }
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!value.contains(key)) return Status::Error(where, fmt::format("missing key '{}'", key));
  }

  Entry entry;
  entry.name = name;
  const Json& dtype = value["dtype"];
  if (!dtype.is_string()) {
    return Status::Error(where, fmt::format("dtype must be a string (\"F32\", \"F64\", \"BF16\" "
                                            "or \"F16\"), got {}",
                                            dtype.type_name()));
  }
  const std::string& dtype_name = dtype.get_ref<const std::string&>();
  bool known = false;
  for (const auto& [known_name, d] : kSafetensorsDTypes) {
    if (dtype_name == known_name) {
      entry.dtype = d;
      known = true;
    }
  }
  if (!known) {
    return Status::Error(where, fmt::format("dtype '{}' is not supported; only F32, F64, BF16 "
                                            "and F16 are supported",
                                            dtype_name));
  }

  // The running product mirrors NumElements() left to right, so a shape accepted here can
  // never overflow int64 there (not even [2^40, 2^40, 0]).
  const Json& shape = value["shape"];
  if (!shape.is_array()) {
    return Status::Error(where, fmt::format("shape must be a list of non-negative integers, "
                                            "got {}",
                                            shape.type_name()));
  }
  constexpr uint64_t kMaxDim = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  uint64_t numel = 1;
  for (const Json& dim : shape) {
    uint64_t d = 0;
    if (!AsNonNegativeInt(dim, &d) || d > kMaxDim) {
      return Status::Error(where, fmt::format("shape must be a list of non-negative integers, "
                                              "got {}",
                                              shape.dump()));
    }
    if (d != 0 && numel > kMaxDim / d) {
      return Status::Error(
          where, fmt::format("shape {} has more elements than fit in int64", shape.dump()));
    }
    numel *= d;
    entry.shape.push_back(static_cast<int64_t>(d));
  }

  const Json& offsets = value["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !AsNonNegativeInt(offsets[0], &entry.begin) ||
      !AsNonNegativeInt(offsets[1], &entry.end)) {
    return Status::Error(where, fmt::format("data_offsets must be two non-negative integers "
                                            "[begin, end], got {}",
                                            offsets.dump()));
  }
  if (entry.begin > entry.end) {
    return Status::Error(
        where, fmt::format("data_offsets [{}, {}]: begin is after end", entry.begin, entry.end));
  }
  if (entry.end > data_bytes) {
    return Status::Error(where, fmt::format("data_offsets [{}, {}]: end is past the {} bytes "
                                            "of data",
                                            entry.begin, entry.end, data_bytes));
  }
  const uint64_t element_bytes = DTypeSize(entry.dtype);
  const uint64_t range_bytes = entry.end - entry.begin;
  if (numel > range_bytes / element_bytes || numel * element_bytes != range_bytes) {
    return Status::Error(where,
                         fmt::format("data_offsets [{}, {}] span {} bytes, but shape {} "
                                     "of {} needs {} elements * {} bytes",
                                     entry.begin, entry.end, range_bytes, ShapeString(entry.shape),
                                     dtype_name, numel, element_bytes));
  }
  *out = std::move(entry);
  return Status();
}

Status ParseMetadata(const Json& value, std::map<std::string, std::string>* out) {
  if (!value.is_object()) {
    return Status::Error("header: __metadata__", fmt::format("must be an object of string to "
                                                             "string, got {}",
                                                             value.type_name()));
  }
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) {
      return Status::Error(fmt::format("header: __metadata__.{}", key),
                           fmt::format("must be a string, got {}", item.type_name()));
    }
    (*out)[key] = item.get<std::string>();
  }
  return Status();
}

// Parses the header text strictly (core/config/strict_json.h: duplicate keys, depth, trailing
// content and NUL bytes are refused).
StatusOr<Json> ParseHeaderJson(const std::string& text) {
  StatusOr<Json> document = ParseStrictJson<Json>(text);
  if (!document.ok()) {
    const Status& error = document.status();
    return Status::Error("header", error.Message());
  }
  if (!document->is_object()) {
    return Status::Error("header",
                         fmt::format("must be a JSON object, got {}", document->type_name()));
  }
  return document;
}

}  // namespace

Status WriteSafetensors(const std::string& path, const SafetensorsFile& file) {
  std::set<std::string_view> names;
  Json header = Json::object();
  if (!file.metadata.empty()) {
    Json metadata = Json::object();
    for (const auto& [key, value] : file.metadata) metadata[key] = value;
    header[std::string(kMetadataKey)] = std::move(metadata);
  }
  uint64_t offset = 0;
  for (const NamedTensor& named : file.tensors) {
    const std::string where = fmt::format("tensor '{}'", named.name);
    const Tensor& tensor = named.tensor;
    if (named.name.empty()) return Status::Error("tensors", "a tensor name is empty");
    if (named.name == kMetadataKey) {
      return Status::Error(where, "the name is reserved for the metadata; pick another");
    }
    if (!names.insert(named.name).second) {
      return Status::Error(where, "the name appears twice; names must be unique");
    }
    if (!tensor.defined()) return Status::Error(where, "the tensor has no storage");
    if (tensor.device() != Device::kHost) {
      return Status::Error(where, "is not a host tensor; copy it to the host first");
    }
    if (!IsFloat(tensor.dtype())) {
      return Status::Error(where, fmt::format("dtype {} is not supported; only float32, "
                                              "float64, bfloat16 and float16 are written",
                                              DTypeName(tensor.dtype())));
    }
    for (int64_t d : tensor.shape()) {
      if (d < 0) {
        return Status::Error(
            where, fmt::format("shape {} has a negative dimension", ShapeString(tensor.shape())));
      }
    }
    const uint64_t bytes = tensor.bytes();
    header[named.name] = {{"dtype", SafetensorsDType(tensor.dtype())},
                          {"shape", tensor.shape()},
                          {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }

  std::string header_text;
  try {
    header_text = header.dump();
  } catch (const Json::exception& e) {  // invalid UTF-8 in a name or in the metadata
    return Status::Error("header", fmt::format("cannot encode: {}", e.what()));
  }
  // Pad with spaces so the data starts 8-byte aligned, as the reference writer does.
  header_text.append((kLengthBytes - header_text.size() % kLengthBytes) % kLengthBytes, ' ');

  char length[kLengthBytes];
  const uint64_t header_bytes = header_text.size();
  for (size_t i = 0; i < kLengthBytes; ++i) {
    length[i] = static_cast<char>((header_bytes >> (8 * i)) & 0xff);
  }
  std::vector<std::string_view> pieces = {std::string_view(length, kLengthBytes), header_text};
  for (const NamedTensor& named : file.tensors) {
    pieces.emplace_back(static_cast<const char*>(named.tensor.data()), named.tensor.bytes());
  }
  return WritePiecesAtomically(path, pieces);
}

StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  std::error_code ec;
  const std::filesystem::file_status file_status = std::filesystem::status(path, ec);
  if (!ec && std::filesystem::exists(file_status) &&
      !std::filesystem::is_regular_file(file_status)) {
    return Status::Error("file", fmt::format("'{}' is not a regular file", path));
  }
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return Status::Error("file", fmt::format("cannot open '{}'{}", path, ErrnoSuffix(errno)));
  in.seekg(0, std::ios::end);
  const std::streamoff end_position = in.tellg();
  in.seekg(0, std::ios::beg);
  if (!in || end_position < 0) {
    return Status::Error("file", fmt::format("cannot determine the size of '{}'", path));
  }
  const uint64_t file_bytes = static_cast<uint64_t>(end_position);

  if (file_bytes < kLengthBytes) {
    return Status::Error("header length", fmt::format("the file is {} bytes, shorter than the "
                                                      "8-byte header length",
                                                      file_bytes));
  }
  unsigned char length[kLengthBytes];
  if (!in.read(reinterpret_cast<char*>(length), kLengthBytes)) {
    return Status::Error("header length", "cannot read the first 8 bytes");
  }
  uint64_t header_bytes = 0;
  for (size_t i = 0; i < kLengthBytes; ++i) {
    header_bytes |= static_cast<uint64_t>(length[i]) << (8 * i);
  }
  if (header_bytes == 0) return Status::Error("header length", "is 0; the header cannot be empty");
  if (header_bytes > kMaxHeaderBytes) {
    return Status::Error("header length", fmt::format("is {} bytes, over the {} byte limit",
                                                      header_bytes, kMaxHeaderBytes));
  }
  if (header_bytes > file_bytes - kLengthBytes) {
    return Status::Error("header length", fmt::format("is {} bytes, but only {} bytes follow it "
                                                      "(truncated file?)",
                                                      header_bytes, file_bytes - kLengthBytes));
  }
  std::string header_text(static_cast<size_t>(header_bytes), '\0');
  if (!in.read(header_text.data(), static_cast<std::streamsize>(header_bytes))) {
    return Status::Error("header", fmt::format("cannot read its {} bytes", header_bytes));
  }
  const uint64_t data_bytes = file_bytes - kLengthBytes - header_bytes;

  StatusOr<Json> header = ParseHeaderJson(header_text);
  if (!header.ok()) return header.status();
  SafetensorsFile result;
  std::vector<Entry> entries;
  for (const auto& [key, value] : header->items()) {
    if (key == kMetadataKey) {
      MPUSIM_RETURN_IF_ERROR(ParseMetadata(value, &result.metadata));
      continue;
    }
    Entry entry;
    MPUSIM_RETURN_IF_ERROR(ParseEntry(key, value, data_bytes, &entry));
    entries.push_back(std::move(entry));
  }

  // The data must be covered exactly: sorted by offsets, each tensor starts where the previous
  // one ended and the last ends at the end of the file. A stable sort keeps header order for
  // zero-byte tensors sharing an offset.
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return std::pair(a.begin, a.end) < std::pair(b.begin, b.end);
  });
  uint64_t covered = 0;
  const Entry* previous = nullptr;
  for (const Entry& entry : entries) {
    if (entry.begin < covered) {
      return Status::Error(
          fmt::format("tensor '{}'", entry.name),
          fmt::format("data_offsets [{}, {}] overlap tensor '{}' at [{}, {}]", entry.begin,
                      entry.end, previous->name, previous->begin, previous->end));
    }
    if (entry.begin > covered) {
      return Status::Error("data", fmt::format("bytes [{}, {}) are not covered by any tensor",
                                               covered, entry.begin));
    }
    covered = entry.end;
    previous = &entry;
  }
  if (covered != data_bytes) {
    return Status::Error(
        "data", fmt::format("bytes [{}, {}) are not covered by any tensor", covered, data_bytes));
  }

  // Every size below is now bounded by the file size, so allocating it is safe.
  for (const Entry& entry : entries) {
    Tensor tensor = Tensor::HostZeros(entry.shape, entry.dtype);
    const uint64_t bytes = entry.end - entry.begin;
    if (bytes > 0 &&
        !in.read(static_cast<char*>(tensor.data()), static_cast<std::streamsize>(bytes))) {
      return Status::Error(
          fmt::format("tensor '{}'", entry.name),
          fmt::format("cannot read its {} bytes (file changed while reading?)", bytes));
    }
    result.tensors.push_back({entry.name, std::move(tensor)});
  }
  return result;
}

Status WriteFileAtomically(const std::string& path, const std::string& text) {
  const std::string_view pieces[] = {text};
  return WritePiecesAtomically(path, pieces);
}

}  // namespace mpusim
