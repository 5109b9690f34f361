// Metrics facade. Algorithm code reports through a MetricsSink it receives by reference; the
// daemons wire in PrometheusMetrics (a real /metrics endpoint), tests a RecordingMetrics.
// Names follow the catalogue in docs/operations.md#metrics: prefixed aloe_, units in the name.
#pragma once

#include <functional>
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

enum class MetricKind { kCounter, kGauge, kHistogram };

// Label values of one series, in the order of its metric's label names (MetricDef::labels).
// Empty for an unlabelled metric.
using LabelValues = std::vector<std::string>;

// Thread-safe. A name not in the sink's catalogue, or label values that do not match the
// metric's label names, are ignored (a programming error, logged by PrometheusMetrics).
// Label values must come from bounded sets (a reason, a codec, a data shard, a live worker whose
// series is Remove()d when it goes), so that the number of series stays bounded.
class MetricsSink {
 public:
  virtual ~MetricsSink() = default;
  virtual void Add(std::string_view counter, double delta, const LabelValues& labels) = 0;
  virtual void Set(std::string_view gauge, double value, const LabelValues& labels) = 0;
  virtual void Observe(std::string_view histogram, double value, const LabelValues& labels) = 0;
  // Drops one series of a labelled metric (e.g. of a worker that left). No-op when absent.
  virtual void Remove(std::string_view name, const LabelValues& labels) = 0;

  // Unlabelled metrics.
  void Add(std::string_view counter, double delta) { Add(counter, delta, {}); }
  void Set(std::string_view gauge, double value) { Set(gauge, value, {}); }
  void Observe(std::string_view histogram, double value) { Observe(histogram, value, {}); }
};

// Reads the current value of one series back. Thread-safe.
class MetricsReader {
 public:
  virtual ~MetricsReader() = default;
  // Counter sum or last gauge value of one series (a histogram's observation count); 0 when the
  // series does not exist.
  virtual double Value(std::string_view name, const LabelValues& labels) const = 0;
  double Value(std::string_view name) const { return Value(name, {}); }
};

// Discards everything.
class NullMetrics final : public MetricsSink {
 public:
  using MetricsSink::Add;
  using MetricsSink::Observe;
  using MetricsSink::Set;
  void Add(std::string_view, double, const LabelValues&) override {}
  void Set(std::string_view, double, const LabelValues&) override {}
  void Observe(std::string_view, double, const LabelValues&) override {}
  void Remove(std::string_view, const LabelValues&) override {}
};

// Keeps the last gauge value, counter sums and all observations per series. For tests.
// Thread-safe.
class RecordingMetrics final : public MetricsSink, public MetricsReader {
 public:
  using MetricsReader::Value;
  using MetricsSink::Add;
  using MetricsSink::Observe;
  using MetricsSink::Set;
  void Add(std::string_view counter, double delta, const LabelValues& labels) override;
  void Set(std::string_view gauge, double value, const LabelValues& labels) override;
  void Observe(std::string_view histogram, double value, const LabelValues& labels) override;
  void Remove(std::string_view name, const LabelValues& labels) override;
  // Counter sum or last gauge value of one series; 0 if never set (or removed).
  double Value(std::string_view name, const LabelValues& labels) const override;
  // Whether the series exists (set and not removed).
  bool Has(std::string_view name, const LabelValues& labels = {}) const;
  std::vector<double> Observations(std::string_view name, const LabelValues& labels = {}) const;

 private:
  static std::string Key(std::string_view name, const LabelValues& labels);

  mutable absl::Mutex mu_;
  std::map<std::string, double, std::less<>> values_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<double>, std::less<>> observations_ ABSL_GUARDED_BY(mu_);
};

struct MetricDef {
  std::string name;
  MetricKind kind;
  std::string help;
  std::vector<double> buckets;      // histograms only
  std::vector<std::string> labels;  // label names; empty = one unlabelled series
};

class MetricsHttpServer;

// A read-only page served beside /metrics: its content type and a function that renders its
// body (called on the endpoint's thread, one request at a time; it must be thread-safe).
struct HttpPage {
  std::string content_type;
  std::function<std::string()> render;
};

// Serves the catalogue on http://<address>/metrics: prometheus-cpp metric families in the text
// exposition format, over a small read-only HTTP/1.0 server of our own (civetweb's 100 KiB
// thread stacks cannot hold LibTorch's static TLS, so its threads fail to start in a worker).
// GET only: no request can change anything.
class PrometheusMetrics final : public MetricsSink, public MetricsReader {
 public:
  // address is "host:port"; port 0 picks a free port (see port()). kInvalidArgument for a bad
  // catalogue, kUnavailable when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<PrometheusMetrics>> Start(
      const std::string& address, const std::vector<MetricDef>& catalogue);
  ~PrometheusMetrics() override;
  PrometheusMetrics(const PrometheusMetrics&) = delete;
  PrometheusMetrics& operator=(const PrometheusMetrics&) = delete;

  int port() const { return port_; }
  // Serves `page` on GET `path` (exact, a query string ignored) from now on, replacing any page
  // of that path; /metrics itself cannot be replaced. Thread-safe.
  void ServePage(const std::string& path, HttpPage page);
  // Stops serving every page (404 from now on); returns once no page is being rendered, so that
  // what the pages read may go. Thread-safe.
  void RemovePages();

  using MetricsSink::Add;
  using MetricsSink::Observe;
  using MetricsSink::Set;
  void Add(std::string_view counter, double delta, const LabelValues& labels) override;
  void Set(std::string_view gauge, double value, const LabelValues& labels) override;
  void Observe(std::string_view histogram, double value, const LabelValues& labels) override;
  void Remove(std::string_view name, const LabelValues& labels) override;
  using MetricsReader::Value;
  double Value(std::string_view name, const LabelValues& labels) const override;

 private:
  struct Entry;
  PrometheusMetrics() = default;
  // The catalogue entry of `name` if it has `kind` and as many label names as `labels` has
  // values; logs and returns null otherwise.
  const Entry* Find(std::string_view name, MetricKind kind, const LabelValues& labels);

  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<MetricsHttpServer> http_;
  // Written only in Start(); read-only afterwards, so lookups need no lock (prometheus-cpp's
  // families lock themselves). (Debian's absl::string_view is not std::string_view, so std::map
  // with std::less<> gives the heterogeneous lookup.)
  std::map<std::string, std::unique_ptr<Entry>, std::less<>> entries_;
  int port_ = 0;
};

// Latency buckets in seconds, 100 us .. ~100 s.
std::vector<double> LatencyBucketsSeconds();

}  // namespace aloe
