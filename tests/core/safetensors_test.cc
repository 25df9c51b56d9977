// safetensors reader and writer: round trips, a byte-exact golden file, the atomic write, and
// the reader's refusal of every corrupt input we can think of (each prefix of a valid file,
// bad lengths, bad JSON, bad dtypes, offsets, metadata), always as a Status, never a crash.
// What it is not: an interoperability test against the Python package (none is required here).
#include "core/dump/safetensors.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

namespace mpusim {
namespace {

namespace fs = std::filesystem;

// Each test gets its own directory under the system temp directory, removed afterwards.
class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           fmt::format("mpusim_safetensors_{}_{}", static_cast<long>(::getpid()), info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  std::string PathOf(const std::string& name) const { return (dir_ / name).string(); }

  std::vector<std::string> ListDir() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir_)) {
      names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  fs::path dir_;
};

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string LittleEndian64(uint64_t value) {
  std::string bytes(8, '\0');
  for (size_t i = 0; i < 8; ++i) bytes[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  return bytes;
}

uint64_t HeaderLength(const std::string& bytes) {
  uint64_t value = 0;
  for (size_t i = 0; i < 8; ++i) {
    value |= uint64_t{static_cast<unsigned char>(bytes[i])} << (8 * i);
  }
  return value;
}

// A raw file: little-endian header length, header text, data bytes.
std::string RawFile(const std::string& header, const std::string& data) {
  return LittleEndian64(header.size()) + header + data;
}

// Host tensor filled with 1, -2, 3, -4, ... (small integers: exact in both dtypes).
Tensor Filled(Shape shape, DType dtype) {
  Tensor t = Tensor::HostZeros(std::move(shape), dtype);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double v = static_cast<double>((i + 1) * (i % 2 == 0 ? 1 : -1));
    if (dtype == DType::kFloat32) {
      t.data_as<float>()[i] = static_cast<float>(v);
    } else {
      t.data_as<double>()[i] = v;
    }
  }
  return t;
}

::testing::AssertionResult SameTensors(const SafetensorsFile& actual,
                                       const SafetensorsFile& expected) {
  if (actual.metadata != expected.metadata) return ::testing::AssertionFailure() << "metadata";
  if (actual.tensors.size() != expected.tensors.size()) {
    return ::testing::AssertionFailure()
           << actual.tensors.size() << " tensors vs " << expected.tensors.size();
  }
  for (size_t i = 0; i < actual.tensors.size(); ++i) {
    const NamedTensor& a = actual.tensors[i];
    const NamedTensor& e = expected.tensors[i];
    if (a.name != e.name || a.tensor.shape() != e.tensor.shape() ||
        a.tensor.dtype() != e.tensor.dtype() || a.tensor.device() != Device::kHost ||
        std::memcmp(a.tensor.data(), e.tensor.data(), e.tensor.bytes()) != 0) {
      return ::testing::AssertionFailure()
             << "tensor " << i << ": '" << a.name << "' " << ShapeString(a.tensor.shape()) << " "
             << DTypeName(a.tensor.dtype()) << " vs '" << e.name << "' "
             << ShapeString(e.tensor.shape()) << " " << DTypeName(e.tensor.dtype());
    }
  }
  return ::testing::AssertionSuccess();
}

// The reader refuses `path` and its message contains `needle`.
::testing::AssertionResult Refused(const std::string& path, const std::string& needle) {
  StatusOr<SafetensorsFile> read = ReadSafetensors(path);
  if (read.ok()) return ::testing::AssertionFailure() << "accepted " << path;
  const std::string message = read.status().Message();
  if (message.find(needle) == std::string::npos) {
    return ::testing::AssertionFailure() << "message '" << message << "' lacks '" << needle << "'";
  }
  return ::testing::AssertionSuccess() << message;
}

// A small valid file: metadata, F32 (2,3) and F64 (4).
SafetensorsFile SmallFile() {
  SafetensorsFile file;
  file.metadata = {{"format", "pt"}, {"rank", "3"}};
  file.tensors.push_back({"fc1.weight", Filled({2, 3}, DType::kFloat32)});
  file.tensors.push_back({"fc1.bias", Filled({4}, DType::kFloat64)});
  return file;
}

TEST_F(SafetensorsTest, RoundTripsShapesDtypesAndMetadata) {
  SafetensorsFile file;
  file.metadata = {{"format", "pt"}, {"tp_rank", "1"}, {"note", "ünïcödé \"quoted\"\n"}};
  file.tensors.push_back({"z.last_name_first", Filled({3, 5}, DType::kFloat32)});
  file.tensors.push_back({"scalar", Filled({}, DType::kFloat64)});
  file.tensors.push_back({"empty", Filled({0, 7}, DType::kFloat32)});
  file.tensors.push_back({"also_empty", Filled({0}, DType::kFloat64)});
  file.tensors.push_back({"vec", Filled({9}, DType::kFloat64)});
  file.tensors.push_back({"cube", Filled({2, 3, 4}, DType::kFloat32)});
  file.tensors.push_back({"scalar32", Filled({}, DType::kFloat32)});
  file.tensors.push_back({"a.4d", Filled({1, 2, 1, 3}, DType::kFloat64)});
  ASSERT_GT(file.tensors[0].tensor.data_as<float>()[0], 0.0f);

  const std::string path = PathOf("round_trip.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, file).ok());
  StatusOr<SafetensorsFile> read = ReadSafetensors(path);
  ASSERT_TRUE(read.ok()) << read.status().Message();
  EXPECT_TRUE(SameTensors(*read, file));  // file order, including the zero-byte tensors
  EXPECT_EQ(read->tensors[1].tensor.numel(), 1);
}

TEST_F(SafetensorsTest, RoundTripsAnEmptyFile) {
  const std::string path = PathOf("empty.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, SafetensorsFile{}).ok());
  EXPECT_EQ(ReadBytes(path), LittleEndian64(8) + "{}      ");
  StatusOr<SafetensorsFile> read = ReadSafetensors(path);
  ASSERT_TRUE(read.ok()) << read.status().Message();
  EXPECT_TRUE(read->tensors.empty());
  EXPECT_TRUE(read->metadata.empty());
}

TEST_F(SafetensorsTest, WritesExactlyTheSafetensorsBytes) {
  SafetensorsFile file;
  file.metadata = {{"k", "v"}};
  Tensor a = Tensor::HostZeros({2}, DType::kFloat32);
  a.data_as<float>()[0] = 1.0f;
  a.data_as<float>()[1] = -2.0f;
  Tensor b = Tensor::HostZeros({}, DType::kFloat64);
  b.data_as<double>()[0] = 0.5;
  file.tensors = {{"a", a}, {"b", b}};

  // 132 bytes of JSON + 4 spaces = 136 = 0x88, so the data starts at byte 144 (8-aligned).
  const std::string expected =
      std::string("\x88\0\0\0\0\0\0\0", 8) +
      R"({"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"F64","shape":[],"data_offsets":[8,16]}})" +
      "    " +
      std::string(
          "\x00\x00\x80\x3f"                   // 1.0f
          "\x00\x00\x00\xc0"                   // -2.0f
          "\x00\x00\x00\x00\x00\x00\xe0\x3f",  // 0.5
          16);
  const std::string path = PathOf("golden.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, file).ok());
  EXPECT_EQ(ReadBytes(path), expected);

  // And the hand-built bytes read back as the same tensors.
  WriteBytes(PathOf("hand_built.safetensors"), expected);
  StatusOr<SafetensorsFile> read = ReadSafetensors(PathOf("hand_built.safetensors"));
  ASSERT_TRUE(read.ok()) << read.status().Message();
  EXPECT_TRUE(SameTensors(*read, file));
}

TEST_F(SafetensorsTest, ReturnsTensorsInDataOrderNotHeaderOrder) {
  const std::string header = R"({"second":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
                             R"("first":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  WriteBytes(PathOf("order.safetensors"),
             RawFile(header, std::string("\x00\x00\x80\x3f\x00\x00\x00\x40", 8)));
  StatusOr<SafetensorsFile> read = ReadSafetensors(PathOf("order.safetensors"));
  ASSERT_TRUE(read.ok()) << read.status().Message();
  ASSERT_EQ(read->tensors.size(), 2u);
  EXPECT_EQ(read->tensors[0].name, "first");
  EXPECT_EQ(read->tensors[0].tensor.data_as<float>()[0], 1.0f);
  EXPECT_EQ(read->tensors[1].name, "second");
  EXPECT_EQ(read->tensors[1].tensor.data_as<float>()[0], 2.0f);
}

TEST_F(SafetensorsTest, AtomicWriteLeavesNoTemporaryFile) {
  const std::string path = PathOf("dump.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, SmallFile()).ok());
  ASSERT_TRUE(WriteSafetensors(path, SmallFile()).ok());  // overwrite in place
  EXPECT_EQ(ListDir(), std::vector<std::string>{"dump.safetensors"});

  ASSERT_TRUE(WriteFileAtomically(PathOf("manifest.json"), "{\"ranks\": 4}\n").ok());
  EXPECT_EQ(ReadBytes(PathOf("manifest.json")), "{\"ranks\": 4}\n");
  EXPECT_EQ(ListDir(), (std::vector<std::string>{"dump.safetensors", "manifest.json"}));
}

TEST_F(SafetensorsTest, WriteErrorsAreStatusesAndLeaveNothingBehind) {
  const std::string missing_dir = PathOf("no/such/dir/x.safetensors");
  Status status = WriteSafetensors(missing_dir, SmallFile());
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.Message().find("cannot open"), std::string::npos) << status.Message();
  EXPECT_FALSE(WriteFileAtomically(missing_dir, "text").ok());

  // The rename fails when the target is a non-empty directory; the temporary must be removed.
  fs::create_directories(PathOf("occupied/child"));
  status = WriteSafetensors(PathOf("occupied"), SmallFile());
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.Message().find("cannot rename"), std::string::npos) << status.Message();
  EXPECT_EQ(ListDir(), std::vector<std::string>{"occupied"});
}

TEST_F(SafetensorsTest, WriterValidatesItsInputs) {
  auto refusal = [&](const SafetensorsFile& file) {
    Status status = WriteSafetensors(PathOf("bad.safetensors"), file);
    return status.ok() ? std::string() : status.Message();
  };
  const Tensor t = Filled({2}, DType::kFloat32);
  SafetensorsFile file;
  file.tensors = {{"", t}};
  EXPECT_NE(refusal(file).find("empty"), std::string::npos);
  file.tensors = {{"w", t}, {"w", t}};
  EXPECT_NE(refusal(file).find("'w': the name appears twice"), std::string::npos);
  file.tensors = {{"__metadata__", t}};
  EXPECT_NE(refusal(file).find("reserved"), std::string::npos);
  file.tensors = {{"undefined", Tensor()}};
  EXPECT_NE(refusal(file).find("no storage"), std::string::npos);
  // Host memory labelled as CUDA: refused before it is ever dereferenced.
  file.tensors = {{"gpu", Tensor({2}, DType::kFloat32, Device::kCuda,
                                 std::make_shared<std::array<float, 2>>())}};
  EXPECT_NE(refusal(file).find("not a host tensor"), std::string::npos);
  // int64 (token ids) stays in memory: dumps record tokens and labels as float64.
  file.tensors = {{"ids", Tensor::HostZeros({2}, DType::kInt64)}};
  EXPECT_NE(refusal(file).find("'ids': dtype int64 is not supported"), std::string::npos)
      << refusal(file);
  file.tensors = {{"ok", t}};
  file.metadata = {{"bad", std::string("\xff\xfe", 2)}};  // not UTF-8
  EXPECT_NE(refusal(file).find("header: cannot encode"), std::string::npos);
  EXPECT_EQ(ListDir(), std::vector<std::string>{});
}

TEST_F(SafetensorsTest, EveryPrefixOfAValidFileIsRefused) {
  const std::string full_path = PathOf("full.safetensors");
  ASSERT_TRUE(WriteSafetensors(full_path, SmallFile()).ok());
  const std::string bytes = ReadBytes(full_path);
  ASSERT_GT(bytes.size(), 100u);
  const std::string path = PathOf("prefix.safetensors");
  for (size_t n = 0; n < bytes.size(); ++n) {
    WriteBytes(path, bytes.substr(0, n));
    EXPECT_FALSE(ReadSafetensors(path).ok()) << "prefix of " << n << " bytes was accepted";
  }
  // A trailing extra byte is refused too (uncovered data).
  WriteBytes(path, bytes + "x");
  EXPECT_TRUE(Refused(path, "not covered by any tensor"));
}

TEST_F(SafetensorsTest, EverySingleByteCorruptionIsHandled) {
  // Flipped bytes may still form a valid file (a changed data byte does); the reader must
  // simply never crash, and a file it accepts must still be internally consistent.
  ASSERT_TRUE(WriteSafetensors(PathOf("full.safetensors"), SmallFile()).ok());
  const std::string bytes = ReadBytes(PathOf("full.safetensors"));
  const std::string path = PathOf("flipped.safetensors");
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (int value : {0x00, 0x7f, 0xff, int{'"'}, int{'9'}}) {
      std::string corrupt = bytes;
      corrupt[i] = static_cast<char>(value);
      WriteBytes(path, corrupt);
      StatusOr<SafetensorsFile> read = ReadSafetensors(path);
      if (!read.ok()) continue;
      uint64_t total = 0;
      for (const NamedTensor& named : read->tensors) total += named.tensor.bytes();
      EXPECT_EQ(8 + HeaderLength(corrupt) + total, corrupt.size()) << "byte " << i;
    }
  }
}

TEST_F(SafetensorsTest, RefusesBadHeaderLengths) {
  const std::string path = PathOf("bad.safetensors");
  WriteBytes(path, "");
  EXPECT_TRUE(Refused(path, "header length: the file is 0 bytes"));
  WriteBytes(path, "1234567");
  EXPECT_TRUE(Refused(path, "shorter than the 8-byte header length"));
  WriteBytes(path, LittleEndian64(0) + "{}");
  EXPECT_TRUE(Refused(path, "header length: is 0"));
  WriteBytes(path, LittleEndian64(100'000'001) + "{}");
  EXPECT_TRUE(Refused(path, "over the 100000000 byte limit"));
  WriteBytes(path, LittleEndian64(~uint64_t{0}) + "{}");
  EXPECT_TRUE(Refused(path, "over the 100000000 byte limit"));
  WriteBytes(path, LittleEndian64(3) + "{}");
  EXPECT_TRUE(Refused(path, "only 2 bytes follow it"));
  EXPECT_TRUE(Refused(PathOf("does_not_exist"), "file: cannot open"));
  EXPECT_TRUE(Refused(dir_.string(), "not a regular file"));
}

TEST_F(SafetensorsTest, RefusesHeaderGarbage) {
  const std::string path = PathOf("bad.safetensors");
  WriteBytes(path, RawFile("{\"a\": ", ""));
  EXPECT_TRUE(Refused(path, "header: line 1, column"));
  WriteBytes(path, RawFile("\x01\x02\x03\xff", ""));
  EXPECT_TRUE(Refused(path, "header: line 1, column"));
  WriteBytes(path, RawFile("{} trailing", ""));
  EXPECT_TRUE(Refused(path, "header: line 1, column"));
  WriteBytes(path, RawFile(std::string("{}\0garbage", 10), ""));
  EXPECT_TRUE(Refused(path, "header: line 1, column"));
  WriteBytes(path, RawFile("[1, 2]", ""));
  EXPECT_TRUE(Refused(path, "header: must be a JSON object, got array"));
  WriteBytes(path, RawFile(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},)"
                           R"( "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                           std::string(8, '\0')));
  EXPECT_TRUE(Refused(path, "header: a: invalid JSON: this key appears twice"));
  WriteBytes(
      path,
      RawFile(R"({"a": {"dtype": "F32", "dtype": "F64", "shape": [], "data_offsets": [0, 4]}})",
              std::string(4, '\0')));
  EXPECT_TRUE(Refused(path, "header: a.dtype: invalid JSON: this key appears twice"));
  // Deep nesting stays within the header's size limit; the depth limit refuses it.
  WriteBytes(path, RawFile("{\"__metadata__\": " + std::string(1'000'000, '[') +
                               std::string(1'000'000, ']') + "}",
                           ""));
  EXPECT_TRUE(Refused(path, "nested deeper than 64 levels"));
}

TEST_F(SafetensorsTest, RefusesBadMetadata) {
  const std::string path = PathOf("bad.safetensors");
  WriteBytes(path, RawFile(R"({"__metadata__": {"step": 3}})", ""));
  EXPECT_TRUE(Refused(path, "header: __metadata__.step: must be a string, got number"));
  WriteBytes(path, RawFile(R"({"__metadata__": {"a": {"b": "c"}}})", ""));
  EXPECT_TRUE(Refused(path, "__metadata__.a: must be a string, got object"));
  WriteBytes(path, RawFile(R"({"__metadata__": ["a", "b"]})", ""));
  EXPECT_TRUE(Refused(path, "__metadata__: must be an object of string to string, got array"));
  WriteBytes(path, RawFile(R"({"__metadata__": null})", ""));
  EXPECT_TRUE(Refused(path, "got null"));
}

TEST_F(SafetensorsTest, RefusesBadTensorEntries) {
  const std::string path = PathOf("bad.safetensors");
  const std::string data4(4, '\0');
  auto refused = [&](const std::string& entry, const std::string& data, const std::string& needle) {
    WriteBytes(path, RawFile(R"({"t": )" + entry + "}", data));
    return Refused(path, needle);
  };
  EXPECT_TRUE(refused("[1]", data4, "tensor 't': must be an object"));
  EXPECT_TRUE(refused(R"({"dtype": "F32", "shape": [1]})", data4, "missing key 'data_offsets'"));
  EXPECT_TRUE(refused(R"({"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1})", data4,
                      "unknown key 'x'"));
  EXPECT_TRUE(refused(R"({"dtype": "I64", "shape": [2], "data_offsets": [0, 16]})",
                      std::string(16, '\0'),
                      "tensor 't': dtype 'I64' is not supported; only F32, F64, BF16 and F16"));
  EXPECT_TRUE(refused(R"({"dtype": "BF16", "shape": [3], "data_offsets": [0, 4]})", data4,
                      "span 4 bytes, but shape [3] of BF16 needs 3 elements * 2 bytes"));
  EXPECT_TRUE(refused(R"({"dtype": 32, "shape": [1], "data_offsets": [0, 4]})", data4,
                      "dtype must be a string"));
  EXPECT_TRUE(refused(R"({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]})", data4,
                      "shape must be a list of non-negative integers"));
  EXPECT_TRUE(refused(R"({"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]})", data4,
                      "shape must be a list of non-negative integers"));
  EXPECT_TRUE(refused(R"({"dtype": "F32", "shape": ["1"], "data_offsets": [0, 4]})", data4,
                      "shape must be a list of non-negative integers"));
  EXPECT_TRUE(refused(R"({"dtype": "F32", "shape": 1, "data_offsets": [0, 4]})", data4,
                      "shape must be a list of non-negative integers, got number"));
  EXPECT_TRUE(
      refused(R"({"dtype": "F32", "shape": [99999999999999999999], "data_offsets": [0, 4]})", data4,
              "shape must be a list of non-negative integers"));
  EXPECT_TRUE(
      refused(R"({"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 4]})",
              data4, "more elements than fit in int64"));
  // Overflow before a zero dimension is still an overflow for NumElements().
  EXPECT_TRUE(
      refused(R"({"dtype": "F32", "shape": [4294967296, 4294967296, 0], "data_offsets": [0, 0]})",
              "", "more elements than fit in int64"));
  // numel fits int64 but numel * 8 bytes does not fit 64 bits.
  EXPECT_TRUE(refused(R"({"dtype": "F64", "shape": [4611686018427387904], "data_offsets": [0, 4]})",
                      data4, "needs 4611686018427387904 elements * 8 bytes"));
  EXPECT_TRUE(refused(R"({"dtype": "F32", "shape": [1], "data_offsets": [0]})", data4,
                      "data_offsets must be two non-negative integers"));
  EXPECT_TRUE(refused(R"({"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]})", data4,
                      "data_offsets must be two non-negative integers"));
  EXPECT_TRUE(refused(R"({"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]})", data4,
                      "data_offsets must be two non-negative integers"));
  EXPECT_TRUE(refused(R"({"dtype": "F32", "shape": [1], "data_offsets": "0-4"})", data4,
                      "data_offsets must be two non-negative integers"));
  EXPECT_TRUE(refused(R"({"dtype": "F32", "shape": [1], "data_offsets": [4, 0]})", data4,
                      "begin is after end"));
  EXPECT_TRUE(refused(R"({"dtype": "F32", "shape": [2], "data_offsets": [0, 8]})", data4,
                      "tensor 't': data_offsets [0, 8]: end is past the 4 bytes of data"));
  EXPECT_TRUE(
      refused(R"({"dtype": "F32", "shape": [1], "data_offsets": [0, 18446744073709551615]})", data4,
              "end is past the 4 bytes of data"));
  EXPECT_TRUE(refused(R"({"dtype": "F64", "shape": [1], "data_offsets": [0, 4]})", data4,
                      "span 4 bytes, but shape [1] of F64 needs 1 elements * 8 bytes"));
  EXPECT_TRUE(refused(R"({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]})",
                      std::string(8, '\0'), "span 8 bytes"));
  EXPECT_TRUE(refused(R"({"dtype": "F32", "shape": [], "data_offsets": [0, 0]})", data4,
                      "needs 1 elements * 4 bytes"));
  WriteBytes(path,
             RawFile(R"({"": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", data4));
  EXPECT_TRUE(Refused(path, "a tensor name is empty"));
}

TEST_F(SafetensorsTest, RefusesOverlapsAndGaps) {
  const std::string path = PathOf("bad.safetensors");
  auto refused = [&](const std::string& a_offsets, const std::string& b_offsets, size_t data_bytes,
                     const std::string& needle) {
    WriteBytes(
        path,
        RawFile(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": )" + a_offsets +
                    R"(}, "b": {"dtype": "F32", "shape": [1], "data_offsets": )" + b_offsets + "}}",
                std::string(data_bytes, '\0')));
    return Refused(path, needle);
  };
  EXPECT_TRUE(refused("[0, 4]", "[0, 4]", 4, "tensor 'b': data_offsets [0, 4] overlap tensor 'a'"));
  EXPECT_TRUE(refused("[0, 4]", "[2, 6]", 6, "overlap tensor 'a' at [0, 4]"));
  EXPECT_TRUE(refused("[0, 4]", "[6, 10]", 10, "data: bytes [4, 6) are not covered"));
  EXPECT_TRUE(refused("[2, 6]", "[6, 10]", 10, "data: bytes [0, 2) are not covered"));
  EXPECT_TRUE(refused("[0, 4]", "[4, 8]", 12, "data: bytes [8, 12) are not covered"));
  // Data with no tensors at all.
  WriteBytes(path, RawFile("{}", "abcd"));
  EXPECT_TRUE(Refused(path, "bytes [0, 4) are not covered"));
  // Zero-byte tensors may share an offset; one inside another tensor's range overlaps.
  WriteBytes(path, RawFile(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                           R"( "e": {"dtype": "F64", "shape": [0], "data_offsets": [4, 4]}})",
                           std::string(8, '\0')));
  EXPECT_TRUE(Refused(path, "tensor 'e': data_offsets [4, 4] overlap tensor 'a'"));
}

}  // namespace
}  // namespace mpusim
