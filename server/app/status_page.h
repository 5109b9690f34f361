// The status page a server role serves on its metrics port (docs/operations.md, status page):
// "/" and "/status" give the page (StatusHtml), "/status.json" the snapshot it polls. GET only,
// on the same endpoint and under the same address rules as /metrics. Thread-safe.
#pragma once

#include <functional>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/metrics.h"
#include "server/core/status_report.h"

namespace aloe::server {

class StatusPage {
 public:
  // `capture` takes a snapshot of the role now; it must be thread-safe.
  explicit StatusPage(std::function<StatusSnapshot()> capture, size_t history = 600)
      : capture_(std::move(capture)), history_(history) {}
  StatusPage(const StatusPage&) = delete;
  StatusPage& operator=(const StatusPage&) = delete;

  // Adds the version and the evaluations not seen yet to the plots' history.
  void Record(absl::Time now, uint64_t version, absl::Span<const EvalPoint> evals)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A snapshot (recorded into the history first) as /status.json serves it.
  std::string Json() ABSL_LOCKS_EXCLUDED(mu_);
  // Serves the page and its JSON on `endpoint` until endpoint.RemovePages(), which the owner
  // must call before this page goes.
  void ServeOn(PrometheusMetrics& endpoint);

 private:
  const std::function<StatusSnapshot()> capture_;
  absl::Mutex mu_;
  StatusHistory history_ ABSL_GUARDED_BY(mu_);
};

}  // namespace aloe::server
