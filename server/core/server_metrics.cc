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
      {kUpdateStaleness, K::kHistogram,
       "Versions applied between an update's base version and its own application",
       {0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128}},
      {kTrainLoss, K::kGauge, "Mean inner training loss reported with the last update", {}},
      {kPenaltyAnomalies,
       K::kCounter,
       "EDiT penalty: (update, layer) pairs flagged anomalous by the EMA z-test",
       {}},
      {kPenaltyRollbacks,
       K::kCounter,
       "EDiT penalty: layers not stepped because every update was anomalous",
       {}},
      {kPenaltyClipCoefficient,
       K::kHistogram,
       "EDiT penalty: clip coefficient min(phi/(||g_bar||+eps), 1) per stepped layer",
       {0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1}},
      {kPenaltyZScore,
       K::kHistogram,
       "EDiT penalty: EMA z-score of each update's layer norm (0 before statistics exist)",
       {-3, -2, -1, 0, 1, 2, 3, 5, 10, 100}},
      {kPenaltyWeight,
       K::kHistogram,
       "EDiT penalty: softmax weight of each update per layer",
       {0, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1}},
      {kPseudoGradientNorm,
       K::kHistogram,
       "EDiT penalty: L2 norm of each update's pseudo-gradient per layer",
       {1e-4, 1e-3, 0.01, 0.1, 0.3, 1, 3, 10, 30, 100, 1000}},
  };
}

}  // namespace aloe::server
