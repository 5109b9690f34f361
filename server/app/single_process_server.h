// aloe-server --role single: one process holds the whole model and serves the Coordinator and
// ParameterService APIs (and raw pushes with a push listener), plus the metrics endpoint.
// The destructor stops a server still running (without a drain or a final checkpoint).
#pragma once

#include <memory>
#include <string>

#include "absl/time/time.h"
#include "server/app/core_runner.h"
#include "server/service/grpc_services.h"
#include "server/service/raw_push_listener.h"

namespace aloe::server {

class SingleProcessServer final : public CoreServerRole {
 public:
  struct Options {
    // core.config with shard_processes 0; its listen_address may name port 0 (grpc_port()).
    CoreRunner::Options core;
    // Testing: every Pull waits this long (a slow link); at most 600 s.
    absl::Duration pull_delay = absl::ZeroDuration();
    // Also take raw pushes on this HOST:PORT ("" = none), told to workers as advertise_push
    // ("" = push_listen).
    std::string push_listen;
    std::string advertise_push;
  };

  explicit SingleProcessServer(Options options) : options_(std::move(options)) {}
  ~SingleProcessServer() override;

  // kInvalidArgument for shard_processes > 0 or a bad pull delay; CoreRunner's and the raw push
  // listener's errors.
  absl::Status Start() override;
  // Drains when the job is not over (CoreRunner::Drain), stops listening, then writes the final
  // checkpoint and the summary (CoreRunner::Finish).
  absl::Status Shutdown(absl::string_view why, absl::FunctionRef<bool()> cut_short) override;
  using ServerRole::Shutdown;

 private:
  const Options options_;
  std::unique_ptr<CoordinatorService> coordinator_;
  std::unique_ptr<ParameterServiceImpl> parameters_;
  std::unique_ptr<RawPushListener> raw_pushes_;
  bool stopped_ = false;
};

}  // namespace aloe::server
