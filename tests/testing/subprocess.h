// Starts a real child process (a daemon under test) with stdout and stderr sent to a log file,
// and stops it reliably. The destructor kills a child that is still running.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace aloe::testing {

class Subprocess {
 public:
  // argv[0] is the program path. Returns a started process, or one whose pid() is -1.
  Subprocess(const std::vector<std::string>& argv, const std::string& log_path);
  ~Subprocess();
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  pid_t pid() const { return pid_; }
  // Waits up to `timeout`; returns the exit code (128 + signal when killed by one) or nullopt.
  std::optional<int> Wait(absl::Duration timeout);
  void Signal(int sig);

 private:
  pid_t pid_ = -1;
  std::optional<int> exit_code_;
};

// Reads a whole file; empty when missing.
std::string ReadFile(const std::string& path);

// Waits until `path` exists and is non-empty, up to `timeout`.
bool WaitForFile(const std::string& path, absl::Duration timeout);
// Waits until the file at `path` (a process's log) contains `text`, up to `timeout`.
bool WaitForText(const std::string& path, const std::string& text, absl::Duration timeout);

// GET http://127.0.0.1:port/path over a plain socket; returns the body or "" on failure.
std::string HttpGet(int port, const std::string& path);

// A loopback port that was free a moment ago (for processes that need a fixed port, such as
// shard processes: workers are told their addresses). Drawn at random below the kernel's
// ephemeral range, so that no port-0 listener or outgoing connection takes it meanwhile.
int FreePort();

}  // namespace aloe::testing
