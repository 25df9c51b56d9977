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
#include <utility>
#include <variant>

namespace mpusim {

class Status {
 public:
  Status() = default;  // OK
  static Status Error(std::string where, std::string what) {
    Status s;
    s.error_ = Detail{std::move(where), std::move(what)};
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
