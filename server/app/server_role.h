// One role of aloe-server (single process, coordinator, shard process) as a process-like object
// that a main or a test starts, watches and stops in-process.
#pragma once

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace aloe::server {

class ServerRole {
 public:
  virtual ~ServerRole() = default;

  // Builds the role's state (resuming when asked), listens and starts serving. Call once.
  virtual absl::Status Start() = 0;
  // The ports bound by Start (0 before it; metrics 0 with metrics_address "off").
  virtual int grpc_port() const = 0;
  virtual int metrics_port() const = 0;
  // The role ended on its own: the job is over (or a shard process was refused for good).
  virtual bool finished() const = 0;
  // Stops serving and writes the final state. A role whose job is not over drains first where it
  // has tasks out, until they end, its drain time passes or `cut_short` says so; `why` names the
  // cause in the log. Returns the role's final error, if any. Call once, after Start.
  virtual absl::Status Shutdown(absl::string_view why, absl::FunctionRef<bool()> cut_short) = 0;
  absl::Status Shutdown(absl::string_view why = "shutdown") {
    return Shutdown(why, [] { return false; });
  }
};

}  // namespace aloe::server
