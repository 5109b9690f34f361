#include "server/app/status_page.h"

namespace aloe::server {

void StatusPage::Record(absl::Time now, uint64_t version, absl::Span<const EvalPoint> evals) {
  absl::MutexLock lock(&mu_);
  history_.Record(now, version, evals);
}

std::string StatusPage::Json() {
  // Captured outside mu_: the capture takes the role's own locks, under which Record is called.
  const StatusSnapshot snapshot = capture_();
  absl::MutexLock lock(&mu_);
  history_.Record(snapshot.now, snapshot.version, snapshot.evals);
  return StatusJson(snapshot, history_);
}

void StatusPage::ServeOn(PrometheusMetrics& endpoint) {
  for (const char* path : {"/", "/status"}) {
    endpoint.ServePage(path,
                       {"text/html; charset=utf-8", [] { return std::string(StatusHtml()); }});
  }
  endpoint.ServePage("/status.json",
                     {"application/json; charset=utf-8", [this] { return Json(); }});
}

}  // namespace aloe::server
