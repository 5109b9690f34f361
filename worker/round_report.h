// The worker's account of its work: Prometheus metrics and a log line per round or evaluation,
// and the totals of the closing summary line.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "common/trainer_interface.h"
#include "proto/aloe.pb.h"

namespace aloe::worker {

// The worker's Prometheus endpoint at `address` (host:port, port 0 = any), or a sink that
// discards everything for "off". Errors as PrometheusMetrics::Start.
absl::StatusOr<std::unique_ptr<MetricsSink>> StartWorkerMetrics(const std::string& address);

// What one round took besides its training statistics.
struct RoundCosts {
  uint64_t pulled_bytes = 0;
  uint64_t pushed_bytes = 0;
  double train_s = 0;    // wall time of the steps, an emulated slowdown included
  double round_s = 0;    // the whole round: pull, steps, push
  double network_s = 0;  // of the round, the time spent waiting for the network
  // Of train_s, the time outside the steps: the start put into the trainer, the pseudo-gradient
  // taken out, the inner state saved. The training device is idle meanwhile.
  double boundary_s = 0;
};

// Not thread-safe. `metrics` and `clock` must outlive this.
class RoundReporter {
 public:
  RoundReporter(MetricsSink& metrics, const Clock& clock) : metrics_(metrics), clock_(clock) {}

  // The joined model's training FLOPs per token, for the model FLOP/s metric.
  void SetModel(const v1::JoinReply& joined);
  // A round begins: the summary's wall time counts from the first.
  void RoundStarted();
  // The next task came with a push reply instead of a RequestTask.
  void TaskFromPushReply() { ++tasks_from_push_replies_; }
  // The next task was taken ahead while the last one's last push travels (streaming overlap).
  void TaskTakenAhead() { ++tasks_taken_ahead_; }
  // Time spent waiting for the network outside a reported round (task requests, lost pushes).
  void AddNetwork(double seconds) { network_s_ += seconds; }
  // A round whose push `reply` answered. Counts it in the totals; with `publish` (this process
  // reports for its node) also sets the metrics and logs the round. `slices` is the number of
  // ranks that push a slice each.
  void Round(const v1::Task& task, const TrainStats& stats, const v1::PushReply& reply,
             const RoundCosts& costs, uint32_t slices, bool publish);
  // An evaluation of `version`: its held-out loss and the bytes its pull took.
  void Evaluated(uint64_t version, double loss, uint64_t pulled_bytes);
  // Logs the summary line of the run.
  void Summary() const;

 private:
  void Publish(const v1::Task& task, const TrainStats& stats, const RoundCosts& costs);

  MetricsSink& metrics_;
  const Clock& clock_;
  double flops_per_token_ = 0;
  uint64_t rounds_ = 0, steps_ = 0, tokens_ = 0, pushed_bytes_ = 0;
  uint64_t tasks_from_push_replies_ = 0;
  uint64_t tasks_taken_ahead_ = 0;
  double compute_s_ = 0, network_s_ = 0, boundary_s_ = 0;
  std::optional<absl::Time> first_round_;
};

}  // namespace aloe::worker
