// Minimal leveled logging to stderr with a timestamp and the component name. Prefixed ALOE_ to
// stay clear of the glog macros that Debian's LibTorch pulls in.
#pragma once

#include <string_view>

#include "absl/strings/str_format.h"

namespace aloe {

enum class LogLevel { kInfo, kWarning, kError };

// Writes one line atomically (a single write call). Thread-safe.
void LogLine(LogLevel level, std::string_view component, std::string_view message);

}  // namespace aloe

#define ALOE_LOG_INFO(component, ...) \
  ::aloe::LogLine(::aloe::LogLevel::kInfo, component, ::absl::StrFormat(__VA_ARGS__))
#define ALOE_LOG_WARNING(component, ...) \
  ::aloe::LogLine(::aloe::LogLevel::kWarning, component, ::absl::StrFormat(__VA_ARGS__))
#define ALOE_LOG_ERROR(component, ...) \
  ::aloe::LogLine(::aloe::LogLevel::kError, component, ::absl::StrFormat(__VA_ARGS__))
