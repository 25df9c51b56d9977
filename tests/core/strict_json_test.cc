// The strict JSON reader (core/config/strict_json.h): what it refuses, how it says so, and that it
// keeps what it accepts intact.
#include "core/config/strict_json.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "core/config/config.h"
#include "core/status.h"

namespace mpusim {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

std::string Refusal(std::string_view text, const JsonLimits& limits = {}) {
  StatusOr<json> parsed = ParseStrictJson<json>(text, limits);
  EXPECT_FALSE(parsed.ok()) << text.substr(0, 80);
  return parsed.ok() ? "" : parsed.status().Message();
}

void ExpectRefused(std::string_view text, const std::string& part) {
  const std::string message = Refusal(text);
  EXPECT_NE(message.find(part), std::string::npos) << "message: " << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
}

std::string Deep(size_t levels, char open, char close, std::string_view inner = "1") {
  std::string text;
  for (size_t i = 0; i < levels; ++i) text += open == '{' ? "{\"k\":" : std::string(1, open);
  text += inner;
  text += std::string(levels, close);
  return text;
}

TEST(StrictJson, AcceptsOrdinaryDocumentsAndKeepsKeyOrder) {
  StatusOr<ordered_json> parsed =
      ParseStrictJson<ordered_json>(R"( {"z": 1, "a": [1, 2.5, "x", null, true], "m": {}} )");
  ASSERT_TRUE(parsed.ok()) << parsed.status().Message();
  EXPECT_EQ(parsed->dump(), R"({"z":1,"a":[1,2.5,"x",null,true],"m":{}})");
  StatusOr<json> scalar = ParseStrictJson<json>("-0.5e3");
  ASSERT_TRUE(scalar.ok());
  EXPECT_EQ(scalar->get<double>(), -500.0);
  // 63 open containers (the default limit is 64) are fine.
  EXPECT_TRUE(ParseStrictJson<json>(Deep(64, '[', ']')).ok());
}

TEST(StrictJson, NumbersOutOfDoubleRangeAreRefusedNotThrown) {
  ExpectRefused(R"({"parallel": {"world_size": 1e400}})",
                "line 1, column 33: invalid JSON: number overflow parsing '1e400' (inside "
                "parallel.world_size)");
  ExpectRefused(R"({"description": -1e400})", "number overflow");
  ExpectRefused(R"({"unknown_key": [1, 2, 1e999]})", "(inside unknown_key[2])");
  // Integers past uint64 become doubles (nlohmann's rule): accepted here, refused by the
  // integer readers as "not an integer".
  StatusOr<json> big = ParseStrictJson<json>("123456789012345678901234567890");
  ASSERT_TRUE(big.ok());
  EXPECT_TRUE(big->is_number_float());
}

TEST(StrictJson, DeepNestingIsRefusedWithoutRecursion) {
  for (const char open : {'[', '{'}) {
    const char close = open == '[' ? ']' : '}';
    ExpectRefused(Deep(100'000, open, close), "nested deeper than 64 levels");
    ExpectRefused(Deep(65, open, close), "nested deeper than 64 levels");
    // Unclosed: the depth limit is met before the end of input.
    ExpectRefused(std::string(1'000'000, open == '[' ? '[' : '['), "nested deeper than 64");
  }
  JsonLimits shallow;
  shallow.max_depth = 2;
  EXPECT_TRUE(ParseStrictJson<json>("[[1]]", shallow).ok());
  EXPECT_FALSE(ParseStrictJson<json>("[[[1]]]", shallow).ok());
}

TEST(StrictJson, DuplicateKeysAreRefusedWithTheirPath) {
  ExpectRefused(R"({"parallel": {"world_size": 8, "world_size": 4}})",
                "parallel.world_size: invalid JSON: this key appears twice");
  ExpectRefused(R"({"parallel": {}, "parallel": {}})", "parallel: invalid JSON: this key appears twice");
  ExpectRefused(R"({"layers": [{"a": 1}, {"b": 1, "b": 2}]})", "layers[1].b: invalid JSON");
  // The same key in two different objects is fine.
  EXPECT_TRUE(ParseStrictJson<json>(R"({"a": {"x": 1}, "b": {"x": 1}})").ok());
  // ordered_json takes the same path (it appends instead of searching).
  EXPECT_FALSE(ParseStrictJson<ordered_json>(R"({"a": 1, "b": 2, "a": 3})").ok());
}

TEST(StrictJson, TrailingContentAndNulBytesAreRefused) {
  ExpectRefused(R"({"parallel": {}} xyz)", "line 1, column 18: invalid JSON");
  ExpectRefused(R"({} {})", "invalid JSON");
  ExpectRefused(std::string("{}\0{}", 5), "line 1, column 3: invalid JSON: NUL byte");
  ExpectRefused("", "invalid JSON");
  ExpectRefused("   \n ", "invalid JSON");
  EXPECT_TRUE(ParseStrictJson<json>("{}\n\t ").ok());
}

TEST(StrictJson, SizeLimit) {
  JsonLimits small;
  small.max_bytes = 8;
  EXPECT_TRUE(ParseStrictJson<json>("[1,2,3]", small).ok());
  StatusOr<json> big = ParseStrictJson<json>("[1,2,3,4,5]", small);
  ASSERT_FALSE(big.ok());
  EXPECT_NE(big.status().Message().find("11 bytes, more than the 8"), std::string::npos);

  const std::string path = testing::TempDir() + "/mpusim_strict_json_big.json";
  {
    std::ofstream out(path);
    out << "[1,2,3,4,5]";
  }
  StatusOr<std::string> text = ReadJsonText(path, small);
  ASSERT_FALSE(text.ok());
  EXPECT_NE(text.status().Message().find("the file is 11 bytes"), std::string::npos);
  EXPECT_TRUE(ReadJsonText(path).ok());
  std::remove(path.c_str());
  EXPECT_FALSE(ReadJsonText("/nonexistent/mpusim.json").ok());
  EXPECT_FALSE(ReadJsonText(testing::TempDir()).ok());  // a directory
}

TEST(StrictJson, ControlCharactersInMessagesAreEscaped) {
  // A key with an escaped newline and tab: the message names it on one line.
  const std::string message = Refusal(R"({"a\nb": 1, "a\nb": 2})");
  EXPECT_NE(message.find("a\\nb: invalid JSON"), std::string::npos) << message;
  EXPECT_EQ(EscapeControl(std::string("x\ny\tz\r\x01\x7f", 8)), "x\\ny\\tz\\r\\x01\\x7f");
  const Status status = Status::Error("bad\nkey", "value \"\x1b[31m\"");
  EXPECT_EQ(status.Message(), "bad\\nkey: value \"\\x1b[31m\"");
}

TEST(StrictJson, ConfigReaderUsesIt) {
  Config config;
  StatusOr<json> parsed = ParseJsonText(R"({"parallel": {"world_size": 8, "world_size": 4}})");
  ASSERT_FALSE(parsed.ok());
  StatusOr<json> deep = ParseJsonText(R"({"parallel": {"world_size": 8}, "description": )" +
                                      Deep(100'000, '[', ']') + "}");
  ASSERT_FALSE(deep.ok());
  EXPECT_NE(deep.status().Message().find("description[0][0]"), std::string::npos)
      << deep.status().Message();
}

}  // namespace
}  // namespace mpusim
