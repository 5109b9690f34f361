#include "common/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/logging.h"

namespace aloe {

std::string RecordingMetrics::Key(std::string_view name, const LabelValues& labels) {
  std::string key(name);
  if (!labels.empty()) key += "{" + absl::StrJoin(labels, ",") + "}";
  return key;
}

void RecordingMetrics::Add(std::string_view counter, double delta, const LabelValues& labels) {
  absl::MutexLock lock(&mu_);
  values_[Key(counter, labels)] += delta;
}

void RecordingMetrics::Set(std::string_view gauge, double value, const LabelValues& labels) {
  absl::MutexLock lock(&mu_);
  values_[Key(gauge, labels)] = value;
}

void RecordingMetrics::Observe(std::string_view histogram, double value,
                               const LabelValues& labels) {
  absl::MutexLock lock(&mu_);
  observations_[Key(histogram, labels)].push_back(value);
}

void RecordingMetrics::Remove(std::string_view name, const LabelValues& labels) {
  absl::MutexLock lock(&mu_);
  values_.erase(Key(name, labels));
  observations_.erase(Key(name, labels));
}

double RecordingMetrics::Value(std::string_view name, const LabelValues& labels) const {
  absl::MutexLock lock(&mu_);
  auto it = values_.find(Key(name, labels));
  return it == values_.end() ? 0.0 : it->second;
}

bool RecordingMetrics::Has(std::string_view name, const LabelValues& labels) const {
  absl::MutexLock lock(&mu_);
  const std::string key = Key(name, labels);
  return values_.count(key) > 0 || observations_.count(key) > 0;
}

std::vector<double> RecordingMetrics::Observations(std::string_view name,
                                                   const LabelValues& labels) const {
  absl::MutexLock lock(&mu_);
  auto it = observations_.find(Key(name, labels));
  return it == observations_.end() ? std::vector<double>{} : it->second;
}

// A minimal read-only HTTP/1.0 server: GET /metrics returns the registry in Prometheus text
// format, GET of a served page (PrometheusMetrics::ServePage) renders it; anything else gets 404
// (or 405 for other methods). One connection at a time, each with a 2 s budget, which is plenty
// for scrapes and a status page. The destructor stops and joins the thread.
class MetricsHttpServer {
 public:
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& address, std::shared_ptr<prometheus::Registry> registry) {
    const size_t colon = address.rfind(':');
    int port = -1;
    if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
        port < 0 || port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrFormat("metrics address \"%s\" is not host:port", address));
    }
    std::string host = address.substr(0, colon);
    if (host == "localhost") host = "127.0.0.1";
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    if (host.empty() || host == "0.0.0.0") {
      addr.sin_addr.s_addr = htonl(INADDR_ANY);
    } else if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
      return absl::InvalidArgumentError(
          absl::StrFormat("metrics address \"%s\": host must be an IPv4 address", address));
    }
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return absl::UnavailableError("metrics endpoint: socket() failed");
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(fd, 16) != 0) {
      const int err = errno;
      ::close(fd);
      return absl::UnavailableError(absl::StrFormat("metrics endpoint: cannot listen on %s: %s",
                                                    address, std::strerror(err)));
    }
    socklen_t len = sizeof(addr);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer(fd, std::move(registry)));
    server->port_ = ntohs(addr.sin_port);
    server->thread_ = std::thread([s = server.get()] { s->Loop(); });
    return server;
  }

  ~MetricsHttpServer() {
    stop_.store(true);
    ::shutdown(fd_, SHUT_RDWR);
    thread_.join();
    ::close(fd_);
  }

  int port() const { return port_; }

  void ServePage(const std::string& path, HttpPage page) {
    absl::MutexLock lock(&mu_);
    pages_[path] = std::move(page);
  }

  void RemovePages() {
    absl::MutexLock lock(&mu_);
    pages_.clear();
  }

 private:
  MetricsHttpServer(int fd, std::shared_ptr<prometheus::Registry> registry)
      : fd_(fd), registry_(std::move(registry)) {}

  void Loop() {
    while (!stop_.load()) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 200) <= 0) continue;
      const int client = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (client < 0) continue;
      Serve(client);
      ::close(client);
    }
  }

  void Serve(int client) {
    std::string request;
    char buffer[2048];
    const auto deadline = absl::Now() + absl::Seconds(2);
    while (request.find("\r\n\r\n") == std::string::npos && request.size() < 8192) {
      pollfd p{client, POLLIN, 0};
      const int wait_ms = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
      if (wait_ms <= 0 || ::poll(&p, 1, wait_ms) <= 0) return;
      const ssize_t n = ::read(client, buffer, sizeof(buffer));
      if (n <= 0) return;
      request.append(buffer, n);
    }
    std::string status = "200 OK";
    std::string body;
    std::string type = "text/plain; version=0.0.4; charset=utf-8";
    const std::string line = request.substr(0, request.find("\r\n"));
    // "GET /path?query HTTP/1.x": the path alone.
    std::string path = line.size() > 4 ? line.substr(4, line.find(' ', 4) - 4) : "";
    path = path.substr(0, path.find('?'));
    if (line.rfind("GET ", 0) != 0) {
      status = "405 Method Not Allowed";
      body = "only GET is supported\n";
    } else if (path == "/metrics") {
      body = prometheus::TextSerializer().Serialize(registry_->Collect());
    } else {
      // Rendered under the lock: RemovePages waits for it.
      absl::MutexLock lock(&mu_);
      if (auto page = pages_.find(path); page != pages_.end()) {
        type = page->second.content_type;
        body = page->second.render();
      } else {
        status = "404 Not Found";
        body = "see /metrics\n";
      }
    }
    const std::string response = absl::StrFormat(
        "HTTP/1.0 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
        status, type, body.size(), body);
    size_t sent = 0;
    while (sent < response.size()) {
      const ssize_t n =
          ::send(client, response.data() + sent, response.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return;
      sent += n;
    }
  }

  const int fd_;
  std::shared_ptr<prometheus::Registry> registry_;
  absl::Mutex mu_;
  std::map<std::string, HttpPage> pages_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> stop_{false};
  std::thread thread_;
  int port_ = 0;
};

// One catalogue entry: its family (exactly one of the three pointers is set), the label names,
// and for an unlabelled metric its single series.
struct PrometheusMetrics::Entry {
  MetricKind kind;
  std::vector<std::string> label_names;
  std::vector<double> buckets;
  prometheus::Family<prometheus::Counter>* counters = nullptr;
  prometheus::Family<prometheus::Gauge>* gauges = nullptr;
  prometheus::Family<prometheus::Histogram>* histograms = nullptr;

  prometheus::Labels LabelsOf(const LabelValues& values) const {
    prometheus::Labels labels;
    for (size_t i = 0; i < label_names.size(); ++i) labels[label_names[i]] = values[i];
    return labels;
  }
};

absl::StatusOr<std::unique_ptr<PrometheusMetrics>> PrometheusMetrics::Start(
    const std::string& address, const std::vector<MetricDef>& catalogue) {
  std::unique_ptr<PrometheusMetrics> m(new PrometheusMetrics());
  m->registry_ = std::make_shared<prometheus::Registry>();
  for (const MetricDef& def : catalogue) {
    if (def.name.rfind("aloe_", 0) != 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("metric %s: names must start with aloe_", def.name));
    }
    if (m->entries_.count(def.name) > 0) {
      return absl::InvalidArgumentError(absl::StrFormat("metric %s: defined twice", def.name));
    }
    auto entry = std::make_unique<Entry>();
    entry->kind = def.kind;
    entry->label_names = def.labels;
    entry->buckets = def.buckets;
    switch (def.kind) {
      case MetricKind::kCounter:
        entry->counters =
            &prometheus::BuildCounter().Name(def.name).Help(def.help).Register(*m->registry_);
        if (def.labels.empty()) entry->counters->Add({});
        break;
      case MetricKind::kGauge:
        entry->gauges =
            &prometheus::BuildGauge().Name(def.name).Help(def.help).Register(*m->registry_);
        if (def.labels.empty()) entry->gauges->Add({});
        break;
      case MetricKind::kHistogram:
        entry->histograms =
            &prometheus::BuildHistogram().Name(def.name).Help(def.help).Register(*m->registry_);
        if (def.labels.empty()) entry->histograms->Add({}, def.buckets);
        break;
    }
    m->entries_[def.name] = std::move(entry);
  }
  auto http = MetricsHttpServer::Start(address, m->registry_);
  if (!http.ok()) return http.status();
  m->http_ = *std::move(http);
  m->port_ = m->http_->port();
  return m;
}

PrometheusMetrics::~PrometheusMetrics() = default;  // stops the HTTP server first

void PrometheusMetrics::ServePage(const std::string& path, HttpPage page) {
  http_->ServePage(path, std::move(page));
}

void PrometheusMetrics::RemovePages() { http_->RemovePages(); }

double PrometheusMetrics::Value(std::string_view name, const LabelValues& labels) const {
  auto it = entries_.find(name);
  if (it == entries_.end() || it->second->label_names.size() != labels.size()) return 0;
  const Entry& e = *it->second;
  const prometheus::Labels l = e.LabelsOf(labels);
  // Family::Add returns the existing series (Has checked it exists, so nothing is added).
  if (e.counters != nullptr && e.counters->Has(l)) return e.counters->Add(l).Value();
  if (e.gauges != nullptr && e.gauges->Has(l)) return e.gauges->Add(l).Value();
  if (e.histograms != nullptr && e.histograms->Has(l)) {
    return static_cast<double>(e.histograms->Add(l, e.buckets).Collect().histogram.sample_count);
  }
  return 0;
}

const PrometheusMetrics::Entry* PrometheusMetrics::Find(std::string_view name, MetricKind kind,
                                                        const LabelValues& labels) {
  auto it = entries_.find(name);
  if (it == entries_.end() || it->second->kind != kind) {
    ALOE_LOG_ERROR("metrics", "metric %s is not in the catalogue (as this kind)", name);
    return nullptr;
  }
  if (it->second->label_names.size() != labels.size()) {
    ALOE_LOG_ERROR("metrics", "metric %s takes %d labels, got %d", name,
                   it->second->label_names.size(), labels.size());
    return nullptr;
  }
  return it->second.get();
}

// Family::Add returns the existing series for labels it already has (buckets are then ignored).
void PrometheusMetrics::Add(std::string_view counter, double delta, const LabelValues& labels) {
  if (const Entry* e = Find(counter, MetricKind::kCounter, labels)) {
    e->counters->Add(e->LabelsOf(labels)).Increment(delta);
  }
}

void PrometheusMetrics::Set(std::string_view gauge, double value, const LabelValues& labels) {
  if (const Entry* e = Find(gauge, MetricKind::kGauge, labels)) {
    e->gauges->Add(e->LabelsOf(labels)).Set(value);
  }
}

void PrometheusMetrics::Observe(std::string_view histogram, double value,
                                const LabelValues& labels) {
  if (const Entry* e = Find(histogram, MetricKind::kHistogram, labels)) {
    e->histograms->Add(e->LabelsOf(labels), e->buckets).Observe(value);
  }
}

void PrometheusMetrics::Remove(std::string_view name, const LabelValues& labels) {
  auto it = entries_.find(name);
  if (it == entries_.end() || labels.empty() || it->second->label_names.size() != labels.size()) {
    return;
  }
  const Entry& e = *it->second;
  const prometheus::Labels l = e.LabelsOf(labels);
  if (e.counters != nullptr && e.counters->Has(l)) e.counters->Remove(&e.counters->Add(l));
  if (e.gauges != nullptr && e.gauges->Has(l)) e.gauges->Remove(&e.gauges->Add(l));
  if (e.histograms != nullptr && e.histograms->Has(l)) {
    e.histograms->Remove(&e.histograms->Add(l, e.buckets));
  }
}

std::vector<double> LatencyBucketsSeconds() {
  return {1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1,
          0.25, 0.5,    1,    2.5,  5,      10,   25,   50,    100};
}

}  // namespace aloe
