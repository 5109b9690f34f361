#include "server/service/applied_reporter.h"

#include <chrono>
#include <utility>

#include "absl/time/clock.h"
#include "common/logging.h"
#include "server/service/auth.h"

namespace aloe::server {

AppliedReporter::AppliedReporter(v1::ShardControl::StubInterface& coordinator, Options options)
    : coordinator_(coordinator), options_(std::move(options)), thread_([this] { Loop(); }) {}

AppliedReporter::~AppliedReporter() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void AppliedReporter::Set(uint64_t version) {
  absl::MutexLock lock(&mu_);
  latest_ = version;
}

std::optional<uint64_t> AppliedReporter::reported() {
  absl::MutexLock lock(&mu_);
  return reported_;
}

bool AppliedReporter::AwaitReported(uint64_t version, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto done = [this, version]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return reported_ == version; };
  return mu_.AwaitWithTimeout(absl::Condition(&done), timeout);
}

void AppliedReporter::Loop() {
  absl::MutexLock lock(&mu_);
  bool failed = false;  // the last call failed
  while (true) {
    auto changed = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stop_ || (latest_.has_value() && latest_ != reported_);
    };
    // After a failure the next call waits the whole period (no busy retries against a
    // coordinator that is away); otherwise it goes at the next change, or at the period.
    mu_.AwaitWithTimeout(failed ? absl::Condition(&stop_) : absl::Condition(&changed),
                         options_.period);
    if (stop_) return;
    if (!latest_.has_value()) continue;
    const uint64_t version = *latest_;
    mu_.Unlock();
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         absl::ToChronoMilliseconds(options_.deadline));
    if (!options_.token.empty()) context.AddMetadata(kTokenMetadata, options_.token);
    v1::AppliedReport report;
    report.set_shard_index(options_.shard_index);
    report.set_version(version);
    v1::AppliedAck ack;
    const grpc::Status status = coordinator_.ReportApplied(&context, report, &ack);
    if (!status.ok() && !failed) {
      ALOE_LOG_WARNING("shard", "shard %d: reporting version %d to the coordinator: %s",
                       options_.shard_index, version, status.error_message());
    }
    mu_.Lock();
    failed = !status.ok();
    if (!failed) reported_ = version;
  }
}

}  // namespace aloe::server
