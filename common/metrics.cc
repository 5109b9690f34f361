#include "common/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <exception>

#include "absl/strings/str_format.h"
#include "common/logging.h"

namespace aloe {

void RecordingMetrics::Add(std::string_view counter, double delta) {
  absl::MutexLock lock(&mu_);
  values_[std::string(counter)] += delta;
}

void RecordingMetrics::Set(std::string_view gauge, double value) {
  absl::MutexLock lock(&mu_);
  values_[std::string(gauge)] = value;
}

void RecordingMetrics::Observe(std::string_view histogram, double value) {
  absl::MutexLock lock(&mu_);
  observations_[std::string(histogram)].push_back(value);
}

double RecordingMetrics::Value(std::string_view name) const {
  absl::MutexLock lock(&mu_);
  auto it = values_.find(name);
  return it == values_.end() ? 0.0 : it->second;
}

std::vector<double> RecordingMetrics::Observations(std::string_view name) const {
  absl::MutexLock lock(&mu_);
  auto it = observations_.find(name);
  return it == observations_.end() ? std::vector<double>{} : it->second;
}

absl::StatusOr<std::unique_ptr<PrometheusMetrics>> PrometheusMetrics::Start(
    const std::string& address, const std::vector<MetricDef>& catalogue) {
  std::unique_ptr<PrometheusMetrics> m(new PrometheusMetrics());
  m->registry_ = std::make_shared<prometheus::Registry>();
  for (const MetricDef& def : catalogue) {
    if (def.name.rfind("aloe_", 0) != 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("metric %s: names must start with aloe_", def.name));
    }
    switch (def.kind) {
      case MetricKind::kCounter:
        m->counters_[def.name] =
            &prometheus::BuildCounter().Name(def.name).Help(def.help).Register(*m->registry_).Add(
                {});
        break;
      case MetricKind::kGauge:
        m->gauges_[def.name] =
            &prometheus::BuildGauge().Name(def.name).Help(def.help).Register(*m->registry_).Add({});
        break;
      case MetricKind::kHistogram:
        m->histograms_[def.name] = &prometheus::BuildHistogram()
                                        .Name(def.name)
                                        .Help(def.help)
                                        .Register(*m->registry_)
                                        .Add({}, def.buckets);
        break;
    }
  }
  try {
    m->exposer_ = std::make_unique<prometheus::Exposer>(address);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrFormat("metrics endpoint: cannot listen on %s: %s", address, e.what()));
  }
  m->exposer_->RegisterCollectable(m->registry_);
  std::vector<int> ports = m->exposer_->GetListeningPorts();
  m->port_ = ports.empty() ? 0 : ports[0];
  return m;
}

PrometheusMetrics::~PrometheusMetrics() = default;

void PrometheusMetrics::Unknown(std::string_view name) {
  ALOE_LOG_ERROR("metrics", "metric %s is not in the catalogue", name);
}

void PrometheusMetrics::Add(std::string_view counter, double delta) {
  auto it = counters_.find(counter);
  if (it == counters_.end()) return Unknown(counter);
  it->second->Increment(delta);
}

void PrometheusMetrics::Set(std::string_view gauge, double value) {
  auto it = gauges_.find(gauge);
  if (it == gauges_.end()) return Unknown(gauge);
  it->second->Set(value);
}

void PrometheusMetrics::Observe(std::string_view histogram, double value) {
  auto it = histograms_.find(histogram);
  if (it == histograms_.end()) return Unknown(histogram);
  it->second->Observe(value);
}

std::vector<double> LatencyBucketsSeconds() {
  return {1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1,
          0.25, 0.5,    1,    2.5,  5,      10,   25,   50,    100};
}

}  // namespace aloe
