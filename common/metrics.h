// Metrics facade. Algorithm code reports through a MetricsSink it receives by reference; the
// daemons wire in PrometheusMetrics (a real /metrics endpoint), tests a RecordingMetrics.
// Names follow the catalogue in README.md: prefixed aloe_, units in the name.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace prometheus {
class Registry;
class Counter;
class Gauge;
class Histogram;
}  // namespace prometheus

namespace aloe {

// Thread-safe. A name not in the sink's catalogue is ignored (a programming error, logged once
// by PrometheusMetrics).
class MetricsSink {
 public:
  virtual ~MetricsSink() = default;
  virtual void Add(std::string_view counter, double delta) = 0;
  virtual void Set(std::string_view gauge, double value) = 0;
  virtual void Observe(std::string_view histogram, double value) = 0;
};

// Discards everything.
class NullMetrics final : public MetricsSink {
 public:
  void Add(std::string_view, double) override {}
  void Set(std::string_view, double) override {}
  void Observe(std::string_view, double) override {}
};

// Keeps the last gauge value, counter sums and all observations. For tests. Thread-safe.
class RecordingMetrics final : public MetricsSink {
 public:
  void Add(std::string_view counter, double delta) override;
  void Set(std::string_view gauge, double value) override;
  void Observe(std::string_view histogram, double value) override;
  double Value(std::string_view name) const;  // counter sum or last gauge value; 0 if never set
  std::vector<double> Observations(std::string_view name) const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, double, std::less<>> values_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<double>, std::less<>> observations_ ABSL_GUARDED_BY(mu_);
};

enum class MetricKind { kCounter, kGauge, kHistogram };

struct MetricDef {
  std::string name;
  MetricKind kind;
  std::string help;
  std::vector<double> buckets;  // histograms only
};

class MetricsHttpServer;

// Serves the catalogue on http://<address>/metrics: prometheus-cpp metric families in the text
// exposition format, over a small read-only HTTP/1.0 server of our own (civetweb's 100 KiB
// thread stacks cannot hold LibTorch's static TLS, so its threads fail to start in a worker).
class PrometheusMetrics final : public MetricsSink {
 public:
  // address is "host:port"; port 0 picks a free port (see port()). kInvalidArgument for a bad
  // catalogue, kUnavailable when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<PrometheusMetrics>> Start(
      const std::string& address, const std::vector<MetricDef>& catalogue);
  ~PrometheusMetrics() override;
  PrometheusMetrics(const PrometheusMetrics&) = delete;
  PrometheusMetrics& operator=(const PrometheusMetrics&) = delete;

  int port() const { return port_; }

  void Add(std::string_view counter, double delta) override;
  void Set(std::string_view gauge, double value) override;
  void Observe(std::string_view histogram, double value) override;

 private:
  PrometheusMetrics() = default;
  void Unknown(std::string_view name);

  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<MetricsHttpServer> http_;
  // Written only in Start(); read-only afterwards, so lookups need no lock.
  // (Debian's absl::string_view is not std::string_view, so std::map with std::less<> gives the
  // heterogeneous lookup.)
  std::map<std::string, prometheus::Counter*, std::less<>> counters_;
  std::map<std::string, prometheus::Gauge*, std::less<>> gauges_;
  std::map<std::string, prometheus::Histogram*, std::less<>> histograms_;
  int port_ = 0;
};

// Latency buckets in seconds, 100 us .. ~100 s.
std::vector<double> LatencyBucketsSeconds();

}  // namespace aloe
