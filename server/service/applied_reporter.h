// A shard process tells its coordinator how far it has applied the order log
// (ShardControl.ReportApplied), so that the coordinator's metrics and status page show each
// shard process's own version next to the one it committed.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <optional>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/aloe.grpc.pb.h"

namespace aloe::server {

// Reports the newest version handed to Set on a thread of its own: after each change (one call
// at a time, so a burst of commits costs one call), and every `period` regardless, so that a
// restarted coordinator learns it without waiting for the next commit. A failed call is retried
// at the next change or period. Thread-safe.
class AppliedReporter {
 public:
  struct Options {
    uint32_t shard_index = 0;
    std::string token;  // x-aloe-token; "" = none
    absl::Duration period = absl::Seconds(5);
    absl::Duration deadline = absl::Seconds(2);  // of each call
  };
  // `coordinator` must outlive the reporter.
  AppliedReporter(v1::ShardControl::StubInterface& coordinator, Options options);
  // Stops, after the call in flight (bounded by the deadline).
  ~AppliedReporter();
  AppliedReporter(const AppliedReporter&) = delete;
  AppliedReporter& operator=(const AppliedReporter&) = delete;

  void Set(uint64_t version) ABSL_LOCKS_EXCLUDED(mu_);
  // The version the coordinator last accepted; nullopt before any.
  std::optional<uint64_t> reported() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until the coordinator accepted `version`, up to `timeout`; false on timeout.
  bool AwaitReported(uint64_t version, absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop();

  v1::ShardControl::StubInterface& coordinator_;
  const Options options_;
  absl::Mutex mu_;
  std::optional<uint64_t> latest_ ABSL_GUARDED_BY(mu_);
  std::optional<uint64_t> reported_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace aloe::server
