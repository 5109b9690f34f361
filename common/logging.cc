#include "common/logging.h"

#include <unistd.h>

#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace aloe {

void LogLine(LogLevel level, std::string_view component, std::string_view message) {
  const char* tag = level == LogLevel::kInfo ? "I" : level == LogLevel::kWarning ? "W" : "E";
  std::string line = absl::StrFormat(
      "%s %s [%s] %s\n", tag, absl::FormatTime("%H:%M:%E3S", absl::Now(), absl::UTCTimeZone()),
      component, message);
  // One write per line keeps lines from different threads whole.
  ssize_t unused = ::write(STDERR_FILENO, line.data(), line.size());
  (void)unused;
}

}  // namespace aloe
