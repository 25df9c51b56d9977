// Status and StatusOr: how core reports a refused input without exceptions or asserts.
//
// A Status names *where* the problem is (a JSON path such as
// "parallel.tensor_model_parallel_size", or a command-line flag) and *what* is wrong,
// including what would be allowed. The CLI turns it into one line:
//   error: <source>: <where>: <what>
// and exit code 2. Release builds define NDEBUG, so validation never lives in assert().
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace mpusim {

// `text` with every control character (bytes 0x00-0x1f and 0x7f) written as a visible
// escape (\n, \t, \r, \xNN), so that a message built from a key, a value or a file name
// stays on one line.
inline std::string EscapeControl(std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte != 0x7f) {
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\r') {
      out += "\\r";
    } else {
      out += "\\x";
      out += kHex[byte >> 4];
      out += kHex[byte & 0xf];
    }
  }
  return out;
}


class Status {
 public:
  Status() = default;  // OK
  // Control characters in either part are escaped (EscapeControl): a message is one line.
  static Status Error(std::string_view where, std::string_view what) {
    Status s;
    s.error_ = Detail{EscapeControl(where), EscapeControl(what)};
    return s;
  }

  bool ok() const { return !error_.has_value(); }
  const std::string& where() const { return error_->where; }
  const std::string& what() const { return error_->what; }
  // "<where>: <what>", or "<what>" when there is no location.
  std::string Message() const {
    if (ok()) return "ok";
    return error_->where.empty() ? error_->what : error_->where + ": " + error_->what;
  }

 private:
  struct Detail {
    std::string where;
    std::string what;
  };
  std::optional<Detail> error_;
};

template <typename T>
class StatusOr {
 public:
  StatusOr(T value) : v_(std::move(value)) {}            // NOLINT: implicit by design
  StatusOr(Status status) : v_(std::move(status)) {}     // NOLINT: must be an error
  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

// Early return on error: MPUSIM_RETURN_IF_ERROR(ParseX(...));
#define MPUSIM_RETURN_IF_ERROR(expr)          \
  do {                                        \
    ::mpusim::Status mpusim_status_ = (expr); \
    if (!mpusim_status_.ok()) return mpusim_status_; \
  } while (0)

}  // namespace mpusim
