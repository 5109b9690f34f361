#include "worker/round_report.h"

#include <cmath>

#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/model_spec.h"
#include "common/status_macros.h"
#include "worker/worker_metrics.h"

namespace aloe::worker {

absl::StatusOr<std::unique_ptr<MetricsSink>> StartWorkerMetrics(const std::string& address) {
  if (address == "off") return std::make_unique<NullMetrics>();
  ALOE_ASSIGN_OR_RETURN(auto prometheus,
                        PrometheusMetrics::Start(address, WorkerMetricCatalogue()));
  ALOE_LOG_INFO("worker", "metrics on port %d", prometheus->port());
  return prometheus;
}

void RoundReporter::SetModel(const v1::JoinReply& joined) {
  flops_per_token_ = TrainingFlopsPerToken(joined.model_spec(), joined.model());
}

void RoundReporter::RoundStarted() {
  if (!first_round_.has_value()) first_round_ = clock_.Now();
}

void RoundReporter::Round(const v1::Task& task, const TrainStats& stats, const v1::PushReply& reply,
                          const RoundCosts& costs, uint32_t slices, bool publish) {
  ++rounds_;
  steps_ += stats.steps;
  tokens_ += stats.tokens;
  compute_s_ += stats.compute_seconds;
  network_s_ += costs.network_s;
  boundary_s_ += costs.boundary_s;
  pushed_bytes_ += costs.pushed_bytes;
  if (!publish) return;
  Publish(task, stats, costs);
  std::string outcome;
  if (reply.applied()) {
    outcome = absl::StrFormat(" -> version %d", reply.version());
  } else if (reply.staged()) {
    outcome = absl::StrFormat(" (%d of %d slices in)", reply.slices_received(), slices);
  }
  ALOE_LOG_INFO("worker",
                "round %d: version %d shard %s steps %d loss %.4f tokens/s %.0f "
                "(compute %.2fs, network %.3fs)%s",
                rounds_, task.base_version(), task.shard_name(), stats.steps, stats.mean_loss,
                costs.round_s > 0 ? stats.tokens / costs.round_s : 0, stats.compute_seconds,
                costs.network_s, outcome);
}

void RoundReporter::Publish(const v1::Task& task, const TrainStats& stats,
                            const RoundCosts& costs) {
  metrics_.Set(kLoss, stats.mean_loss);
  metrics_.Set(kTokensPerSecond, costs.round_s > 0 ? stats.tokens / costs.round_s : 0);
  if (stats.compute_seconds > 0) {
    metrics_.Set(kModelFlops, stats.tokens / stats.compute_seconds * flops_per_token_);
  }
  metrics_.Set(kStepsPerRound, stats.steps);
  metrics_.Set(kModelVersion, static_cast<double>(task.base_version()));
  metrics_.Add(kSteps, stats.steps);
  metrics_.Add(kTokens, static_cast<double>(stats.tokens));
  metrics_.Add(kRounds, 1);
  metrics_.Add(kPulledBytes, static_cast<double>(costs.pulled_bytes));
  metrics_.Add(kPushedBytes, static_cast<double>(costs.pushed_bytes));
  metrics_.Add(kComputeSeconds, stats.compute_seconds);
  metrics_.Add(kNetworkSeconds, costs.network_s);
  metrics_.Add(kBoundarySeconds, costs.boundary_s);
}

void RoundReporter::Evaluated(uint64_t version, double loss, uint64_t pulled_bytes) {
  metrics_.Set(kEvalLoss, loss);
  metrics_.Set(kModelVersion, static_cast<double>(version));
  metrics_.Add(kPulledBytes, static_cast<double>(pulled_bytes));
  ALOE_LOG_INFO("worker", "eval version %d: loss %.4f perplexity %.2f", version, loss,
                std::exp(loss));
}

void RoundReporter::Summary() const {
  const double wall = rounds_ > 0 && first_round_.has_value()
                          ? absl::ToDoubleSeconds(clock_.Now() - *first_round_)
                          : 0;
  ALOE_LOG_INFO("worker",
                "summary: rounds=%d steps=%d tokens=%d wall_seconds=%.2f compute_seconds=%.2f "
                "network_seconds=%.2f tokens_per_second=%.1f pushed_bytes=%d "
                "blocked_on_network=%.4f tasks_from_push_replies=%d tasks_taken_ahead=%d "
                "boundary_seconds=%.3f",
                rounds_, steps_, tokens_, wall, compute_s_, network_s_,
                wall > 0 ? static_cast<double>(tokens_) / wall : 0.0, pushed_bytes_,
                wall > 0 ? network_s_ / wall : 0.0, tasks_from_push_replies_, tasks_taken_ahead_,
                boundary_s_);
}

}  // namespace aloe::worker
