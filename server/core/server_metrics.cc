#include "server/core/server_metrics.h"

namespace aloe::server {

std::vector<MetricDef> ServerMetricCatalogue() {
  using K = MetricKind;
  return {
      {kModelVersion, K::kGauge, "Global model version (outer steps applied since init)", {}},
      {kOuterSteps, K::kCounter, "Outer optimizer steps applied", {}},
      {kUpdatesApplied, K::kCounter, "Worker pseudo-gradients aggregated into outer steps", {}},
      {kUpdatesRejected, K::kCounter, "Pushes rejected (bad input, stale, unknown worker)", {}},
      {kTokensLearned, K::kCounter, "Training tokens in applied updates", {}},
      {kLiveWorkers, K::kGauge, "Live members (trainers and evaluators)", {}},
      {kWorkersJoined, K::kCounter, "Workers that joined", {}},
      {kWorkersLeft, K::kCounter, "Workers that left gracefully", {}},
      {kWorkersExpired, K::kCounter, "Workers dropped because their lease expired", {}},
      {kRoundParticipants, K::kGauge, "Trainers in the current sync round", {}},
      {kEvalLoss, K::kGauge, "Held-out loss (nats/token) of the latest evaluated version", {}},
      {kEvalPerplexity, K::kGauge, "Held-out perplexity of the latest evaluated version", {}},
      {kEvalVersion, K::kGauge, "Model version of the latest evaluation", {}},
      {kReceivedBytes, K::kCounter, "Pseudo-gradient payload bytes received", {}},
      {kSentBytes, K::kCounter, "Parameter payload bytes sent by Pull", {}},
      {kApplyLatency, K::kHistogram, "Time to aggregate and apply one outer step",
       LatencyBucketsSeconds()},
      {kPushLatency, K::kHistogram, "Time from a push's first chunk to its reply",
       LatencyBucketsSeconds()},
      {kTrainLoss, K::kGauge, "Mean inner training loss reported with the last update", {}},
  };
}

}  // namespace aloe::server
