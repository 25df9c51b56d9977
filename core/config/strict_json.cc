// The strict JSON reader (see strict_json.h): nlohmann's SAX parser feeding a document
// builder that counts depth, remembers each open object's keys and the path to the value
// being read.
#include "core/config/strict_json.h"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <system_error>
#include <unordered_set>
#include <utility>
#include <vector>

#include <fmt/format.h>

namespace mpusim {
namespace {

// "line L, column C" of byte `offset` (0-based) in `text`.
std::string LineColumn(std::string_view text, size_t offset) {
  offset = std::min(offset, text.size());
  size_t line = 1, column = 1;
  for (size_t i = 0; i < offset; ++i) {
    if (text[i] == '\n') {
      ++line;
      column = 1;
    } else {
      ++column;
    }
  }
  return fmt::format("line {}, column {}", line, column);
}

// nlohmann's message without its "[json.exception.parse_error.101] parse error at line 1,
// column 2: " prefix (we add our own location).
std::string NlohmannReason(const char* what) {
  std::string_view text = what;
  if (!text.empty() && text.front() == '[') {
    if (const size_t end = text.find("] "); end != std::string_view::npos) {
      text.remove_prefix(end + 2);
    }
  }
  if (text.rfind("parse error", 0) == 0) {
    if (const size_t colon = text.find(": "); colon != std::string_view::npos) {
      text.remove_prefix(colon + 2);
    }
  }
  return std::string(text);
}

template <typename Json>
class DocumentBuilder {
 public:
  using number_integer_t = typename Json::number_integer_t;
  using number_unsigned_t = typename Json::number_unsigned_t;
  using number_float_t = typename Json::number_float_t;
  using string_t = typename Json::string_t;
  using binary_t = typename Json::binary_t;

  DocumentBuilder(std::string_view text, const JsonLimits& limits)
      : text_(text), limits_(limits) {}

  bool null() { return Put(Json(nullptr)) != nullptr; }
  bool boolean(bool value) { return Put(Json(value)) != nullptr; }
  bool number_integer(number_integer_t value) { return Put(Json(value)) != nullptr; }
  bool number_unsigned(number_unsigned_t value) { return Put(Json(value)) != nullptr; }
  bool number_float(number_float_t value, const string_t& /*text*/) {
    return Put(Json(value)) != nullptr;
  }
  bool string(string_t& value) { return Put(Json(std::move(value))) != nullptr; }
  bool binary(binary_t& /*value*/) {
    return Fail(Path(), "invalid JSON: binary values are not JSON");  // only the binary formats have them
  }
  bool start_object(std::size_t /*elements*/) { return Open(Json::object()); }
  bool key(string_t& key) {
    Frame& frame = frames_.back();
    if (!frame.keys.insert(key).second) {
      frame.key = std::move(key);
      return Fail(Path(), "invalid JSON: this key appears twice in its object; keep one");
    }
    frame.key = std::move(key);
    return true;
  }
  bool end_object() {
    frames_.pop_back();
    return true;
  }
  bool start_array(std::size_t /*elements*/) { return Open(Json::array()); }
  bool end_array() {
    frames_.pop_back();
    return true;
  }
  bool parse_error(std::size_t position, const std::string& /*last_token*/,
                   const nlohmann::detail::exception& error) {
    const std::string path = Path();
    return Fail(LineColumn(text_, position == 0 ? 0 : position - 1),
                "invalid JSON: " + NlohmannReason(error.what()) +
                    (path.empty() ? "" : " (inside " + path + ")"));
  }

  StatusOr<Json> Finish(bool parsed) {
    if (!error_.ok()) return error_;
    if (!parsed || !has_root_) return Status::Error("", "invalid JSON: no document");
    return std::move(root_);
  }

 private:
  struct Frame {
    Json* container;
    std::unordered_set<string_t> keys;  // objects only
    string_t key;                       // objects: the key of the value being read
  };

  bool Fail(std::string where, std::string what) {
    if (error_.ok()) error_ = Status::Error(std::move(where), std::move(what));
    return false;
  }

  bool Open(Json&& empty) {
    if (static_cast<int>(frames_.size()) >= limits_.max_depth) {
      return Fail(Path(), fmt::format("invalid JSON: nested deeper than {} levels of arrays and objects; no "
                                      "mpusim file needs that many",
                                      limits_.max_depth));
    }
    Json* container = Put(std::move(empty));
    if (container == nullptr) return false;
    frames_.push_back(Frame{container, {}, {}});
    return true;
  }

  // Stores `value` where the parser is (the root, the end of the open array, or under the
  // open object's current key) and returns where it now lives. Pointers to open containers
  // stay valid: only the innermost open container grows.
  Json* Put(Json&& value) {
    if (frames_.empty()) {
      if (has_root_) {
        Fail("", "invalid JSON: more than one document");
        return nullptr;
      }
      root_ = std::move(value);
      has_root_ = true;
      return &root_;
    }
    Frame& frame = frames_.back();
    if (frame.container->is_array()) {
      frame.container->push_back(std::move(value));
      return &frame.container->back();
    }
    auto& object = frame.container->template get_ref<typename Json::object_t&>();
    // The key is known to be new (key() refused repeats), so an ordered object can append
    // without its linear search for an existing key.
    using Object = typename Json::object_t;
    if constexpr (requires { typename Object::Container; }) {  // nlohmann::ordered_map
      auto& entries = static_cast<typename Object::Container&>(object);
      entries.emplace_back(frame.key, std::move(value));
      return &entries.back().second;
    } else {
      return &object.emplace(frame.key, std::move(value)).first->second;
    }
  }

  // "parallel.world_size", "tensors[3].shape": where the parser is now. Every open array
  // but the innermost is inside its last element; the innermost is at its next one. Paths
  // longer than 120 characters keep their two ends.
  std::string Path() const {
    std::string path;
    for (size_t f = 0; f < frames_.size(); ++f) {
      const Frame& frame = frames_[f];
      if (frame.container->is_array()) {
        const size_t size = frame.container->size();
        path += fmt::format("[{}]", f + 1 < frames_.size() && size > 0 ? size - 1 : size);
      } else {
        if (!path.empty()) path += '.';
        path += frame.key;
      }
    }
    if (path.size() > 120) path = path.substr(0, 40) + "..." + path.substr(path.size() - 77);
    return path;
  }

  std::string_view text_;
  JsonLimits limits_;
  std::vector<Frame> frames_;
  Json root_;
  bool has_root_ = false;
  Status error_;
};

}  // namespace

template <typename Json>
StatusOr<Json> ParseStrictJson(std::string_view text, const JsonLimits& limits) {
  if (text.size() > limits.max_bytes) {
    return Status::Error("", fmt::format("the JSON text is {} bytes, more than the {} this "
                                         "reader accepts",
                                         text.size(), limits.max_bytes));
  }
  // nlohmann treats a NUL byte as the end of the input, which would accept "{...}\0junk";
  // JSON text never contains a raw NUL.
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos) {
    return Status::Error(LineColumn(text, nul), "invalid JSON: NUL byte");
  }
  DocumentBuilder<Json> builder(text, limits);
  bool parsed = false;
  try {
    parsed = Json::sax_parse(text.begin(), text.end(), &builder, nlohmann::json::input_format_t::json,
                             /*strict=*/true, /*ignore_comments=*/false);
  } catch (const std::bad_alloc&) {
    throw;  // not an input error: the caller's top level reports it
  } catch (const std::exception& e) {
    // The SAX interface reports errors through parse_error; this is a safety net for any
    // path that still throws, so that no input can end the program.
    return Status::Error("", std::string("invalid JSON: ") + NlohmannReason(e.what()));
  }
  return builder.Finish(parsed);
}

StatusOr<std::string> ReadJsonText(const std::string& path, const JsonLimits& limits) {
  std::ifstream in(path, std::ios::binary);
  std::error_code ec;
  if (!in || std::filesystem::is_directory(path, ec)) {
    return Status::Error("", "cannot open the file (does it exist and is it readable?)");
  }
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  if (size < 0) return Status::Error("", "cannot read the file");
  if (static_cast<uint64_t>(size) > limits.max_bytes) {
    return Status::Error("", fmt::format("the file is {} bytes, more than the {} a JSON file "
                                         "may have here",
                                         size, limits.max_bytes));
  }
  in.seekg(0, std::ios::beg);
  std::string text(static_cast<size_t>(size), '\0');
  in.read(text.data(), size);
  if (in.gcount() != size) return Status::Error("", "cannot read the file");
  return text;
}

template StatusOr<nlohmann::json> ParseStrictJson(std::string_view, const JsonLimits&);
template StatusOr<nlohmann::ordered_json> ParseStrictJson(std::string_view, const JsonLimits&);

}  // namespace mpusim
