// What the single-process server and the coordinator share: the ServerCore of the config's
// corpus (resumed from the newest checkpoint when asked), its metrics, checkpoints, token
// authenticator and gRPC server, a thread that ticks it, the status page, the drain on shutdown,
// the final checkpoint and the summary.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/executor.h"
#include "common/metrics.h"
#include "proto/aloe.pb.h"
#include "server/app/server_role.h"
#include "server/app/status_page.h"
#include "server/core/checkpoint_store.h"
#include "server/core/server_core.h"
#include "server/core/shard_sampler.h"
#include "server/service/auth.h"
#include "server/service/core_handle.h"

namespace aloe::server {

class CoreRunner {
 public:
  struct Options {
    v1::ServerConfig config;  // validated (common/config.h)
    // Restore the newest whole checkpoint in checkpoint.dir (a fresh start when there is none).
    bool resume = false;
    // On shutdown before the job is over: how long to wait for the tasks handed out.
    absl::Duration drain_time = absl::Seconds(10);
    // At exit write "version=N", "updates_applied=N" and one "eval=VERSION:LOSS" per line here;
    // "" = nowhere.
    std::string summary_file;
  };

  // Reads the corpus manifest, starts the metrics endpoint, builds the core and loads the
  // credentials of listen_address. kInvalidArgument for a corpus without training or held-out
  // shards; the checkpoint's, the core's, the token file's and the credentials' errors.
  static absl::StatusOr<std::unique_ptr<CoreRunner>> Create(Options options);
  ~CoreRunner();
  CoreRunner(const CoreRunner&) = delete;
  CoreRunner& operator=(const CoreRunner&) = delete;

  const v1::ServerConfig& config() const { return options_.config; }
  CoreHandle& handle() { return *handle_; }
  Authenticator& auth() { return *auth_; }
  MetricsSink& metrics() { return *metrics_; }
  const Clock& clock() const { return clock_; }
  int metrics_port() const { return metrics_port_; }
  int grpc_port() const { return grpc_port_; }
  size_t train_shards() const { return train_.size(); }
  // The checkpoints of checkpoint.dir; null without one.
  CheckpointStore* checkpoints() const { return checkpoints_.get(); }
  // A core at version 0 of this config, to replace the handle's (it shares this runner's clock,
  // executor and metrics).
  absl::StatusOr<std::unique_ptr<ServerCore>> NewCore();

  // Serves `services` (which must outlive the server, or StopListening) on listen_address,
  // logs what it serves, and starts the thread that ticks the core every 100 ms and writes the
  // checkpoints that fall due, until the job is finished (ServerCore::Finished) or StopTicking.
  absl::Status Listen(const std::vector<grpc::Service*>& services);
  // Stops listening (calls under way get 2 s to end). Idempotent.
  void StopListening();
  bool finished() const { return finished_.load(); }
  void StopTicking() ABSL_LOCKS_EXCLUDED(mu_);
  // Graceful shutdown (call after StopTicking): no new work is handed out (workers see WAIT with
  // draining set), while tasks already handed out may still push or report, each push applied
  // as usual, for up to drain_time or until `cut_short` says so. Periodic checkpoints that fall
  // due meanwhile are written. `why` opens the log line.
  void Drain(absl::string_view why, absl::FunctionRef<bool()> cut_short);
  // Writes the final checkpoint (on an early stop too, so a restart loses nothing that was
  // applied), logs the summary and writes the summary file (kUnavailable when it cannot).
  absl::Status Finish();

 private:
  CoreRunner(Options options, std::vector<DataShard> train, std::string heldout_file);
  void StartTicking() ABSL_LOCKS_EXCLUDED(mu_);
  void TickLoop() ABSL_LOCKS_EXCLUDED(mu_);
  // Ticks the core and writes the checkpoints due; returns the core's answer to `done`.
  template <typename F>
  auto TickAnd(F&& done);

  const Options options_;
  const std::vector<DataShard> train_;
  const std::string heldout_file_;
  RealClock clock_;
  ThreadPoolExecutor executor_;
  int metrics_port_ = 0;
  std::unique_ptr<MetricsSink> metrics_;
  PrometheusMetrics* endpoint_ = nullptr;  // metrics_ when it serves HTTP (the status page)
  std::unique_ptr<CoreHandle> handle_;
  std::unique_ptr<StatusPage> status_;  // served on endpoint_; null without one
  std::unique_ptr<CheckpointStore> checkpoints_;
  std::unique_ptr<Authenticator> auth_;
  std::shared_ptr<grpc::ServerCredentials> credentials_;
  std::unique_ptr<grpc::Server> server_;
  int grpc_port_ = 0;
  std::atomic<bool> finished_{false};
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread ticker_;
};

// A role that runs a CoreRunner (the single-process server, the coordinator): its ports and
// whether its job is over come from the runner, once Start made one.
class CoreServerRole : public ServerRole {
 public:
  int grpc_port() const override { return runner_ == nullptr ? 0 : runner_->grpc_port(); }
  int metrics_port() const override { return runner_ == nullptr ? 0 : runner_->metrics_port(); }
  bool finished() const override { return runner_ != nullptr && runner_->finished(); }

 protected:
  std::unique_ptr<CoreRunner> runner_;
};

}  // namespace aloe::server
