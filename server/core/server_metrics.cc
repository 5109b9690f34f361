#include "server/core/server_metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "common/logging.h"

namespace aloe::server {

const char* RejectReason(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return "invalid_argument";
    case absl::StatusCode::kFailedPrecondition:
      return "stale";
    case absl::StatusCode::kNotFound:
      return "unknown_worker";
    case absl::StatusCode::kUnauthenticated:
      return "unauthenticated";
    case absl::StatusCode::kPermissionDenied:
      return "permission_denied";
    default:
      return "other";
  }
}

std::string CodecLabel(v1::Codec codec) {
  if (codec == v1::CODEC_UNSPECIFIED) codec = v1::CODEC_FP32;
  std::string name = v1::Codec_Name(codec);
  if (absl::StartsWith(name, "CODEC_")) name = name.substr(6);
  return absl::AsciiStrToLower(name);
}

std::vector<MetricDef> ServerMetricCatalogue() {
  using K = MetricKind;
  return {
      {kModelVersion, K::kGauge, "Global model version (outer steps applied since init)", {}},
      {kOuterSteps, K::kCounter, "Outer optimizer steps applied", {}},
      {kUpdatesApplied, K::kCounter, "Worker pseudo-gradients aggregated into outer steps", {}},
      {kUpdatesRejected, K::kCounter, "Pushes rejected, by reason", {}, {"reason"}},
      {kTokensLearned, K::kCounter, "Training tokens in applied updates", {}},
      {kLiveWorkers, K::kGauge, "Live members (trainers, evaluators and observers)", {}},
      {kWorkersJoined, K::kCounter, "Workers that joined", {}},
      {kWorkersLeft, K::kCounter, "Workers that left gracefully", {}},
      {kWorkersExpired, K::kCounter, "Workers dropped because their lease expired", {}},
      {kRoundParticipants, K::kGauge, "Trainers in the current sync round", {}},
      {kEvalLoss, K::kGauge, "Held-out loss (nats/token) of the latest evaluated version", {}},
      {kEvalPerplexity, K::kGauge, "Held-out perplexity of the latest evaluated version", {}},
      {kEvalVersion, K::kGauge, "Model version of the latest evaluation", {}},
      {kReceivedBytes,
       K::kCounter,
       "Pseudo-gradient payload bytes received, by wire codec",
       {},
       {"codec"}},
      {kSentBytes,
       K::kCounter,
       "Parameter payload bytes sent by Pull, by wire codec",
       {},
       {"codec"}},
      {kApplyLatency, K::kHistogram,
       "Time to aggregate and apply one outer step (a shard process: its layers of one)",
       LatencyBucketsSeconds()},
      {kPushLatency, K::kHistogram, "Time from a push's first chunk to its reply",
       LatencyBucketsSeconds()},
      {kUpdateStaleness,
       K::kHistogram,
       "Versions applied between an update's base version and its own application",
       {0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128}},
      {kLayerGroupVersion,
       K::kGauge,
       "Partial synchronization: outer steps of each layer group",
       {},
       {"group"}},
      {kLayerGroupStaleness,
       K::kHistogram,
       "Partial synchronization: steps of its layer group between a group push's base version "
       "and its application",
       {0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128},
       {"group"}},
      {kCheckpointSeconds, K::kHistogram, "Time to serialise and write one checkpoint",
       LatencyBucketsSeconds()},
      {kCheckpointTimestamp, K::kGauge, "Unix time of the last checkpoint written", {}},
      {kCheckpointVersion, K::kGauge, "Model version of the last checkpoint written", {}},
      {kStagedUpdates,
       K::kGauge,
       "Shard process: pushed updates staged, waiting for the coordinator's commit",
       {}},
      {kStagedBytes, K::kGauge, "Shard process: bytes of the staged updates", {}},
      {kRawPushBytes,
       K::kCounter,
       "Shard process: payload bytes received whole over raw pushes (the rest of "
       "aloe_received_bytes_total came over gRPC)",
       {}},
      {kReceivedLayerBytes,
       K::kCounter,
       "Pseudo-gradient payload bytes received per model layer, all codecs",
       {},
       {"layer"}},
      {kLowRankRank,
       K::kGauge,
       "Adaptive rank: the rank the next tasks compress each low-rank tensor with",
       {},
       {"layer", "tensor"}},
      {kLowRankEffectiveRank,
       K::kGauge,
       "Adaptive rank: mean effective rank of each low-rank tensor over the window of pushes",
       {},
       {"layer", "tensor"}},
      {kAdaptiveLocalSteps,
       K::kGauge,
       "Adaptive rank: local steps H the next tasks are planned from (H_0 scaled by the push "
       "bytes at the chosen ranks)",
       {}},
      {kShardProcessCopyVersion,
       K::kGauge,
       "Coordinator (checkpoint.replicate_shards): version of the newest copy it keeps of each "
       "shard process's checkpoints",
       {},
       {"process"}},
      {kShardProcessAppliedVersion,
       K::kGauge,
       "Coordinator: the version each shard process reports it has applied (behind "
       "aloe_model_version while commits are on their way to it)",
       {},
       {"process"}},
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
       "L2 norm of each applied update's pseudo-gradient per layer",
       {1e-4, 1e-3, 0.01, 0.1, 0.3, 1, 3, 10, 30, 100, 1000}},
      {kGraceWindowWorkers,
       K::kHistogram,
       "Workers released together with one model version: per closed grace window (async) or "
       "completed round (sync)",
       {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256}},
      {kTasksAhead, K::kCounter,
       "Look-ahead tasks handed out to overlapping workers (they start one version staler)"},
      {kTasksInPushReplies, K::kCounter,
       "Tasks handed out in the reply of the push that completed the worker's previous update "
       "(each saved the worker a RequestTask round trip)"},
      {kRetainedVersionsDropped, K::kCounter,
       "Superseded versions not held for the tasks that had not pulled them yet "
       "(max_retained_versions were held already)"},
      {kLayerStepsCopied, K::kCounter,
       "Layer updates of outer steps written to a fresh buffer because an older version (held "
       "for tasks, or a pull under way) still used the layer; the rest update in place"},
      {kTasksGivenUp, K::kCounter,
       "Training tasks their workers gave up (e.g. the base version was no longer held)"},
      {kTrainerStepsPerSecond,
       K::kGauge,
       "Measured local steps/s of each live trainer (EMA of heartbeats and pushes; DyLU input)",
       {},
       {"worker", "name"}},
      {kTrainerPlannedSteps,
       K::kGauge,
       "Local steps of each live trainer's latest task (DyLU: floor(v/v_max * H); time budget: "
       "the cap)",
       {},
       {"worker", "name"}},
      {kDataShardTokensLearned,
       K::kGauge,
       "Tokens learned from each data shard (n_i)",
       {},
       {"shard"}},
      {kDataShardTokensInFlight,
       K::kGauge,
       "Tokens of each data shard assigned to open tasks, not yet returned",
       {},
       {"shard"}},
      {kDataShardSamplingProbability,
       K::kGauge,
       "Probability that the next task draws each data shard (learning progress)",
       {},
       {"shard"}},
      {kDataShardLrStep,
       K::kGauge,
       "Inner LR schedule position t of each data shard (steps)",
       {},
       {"shard"}},
      {kDataShardLearningRate,
       K::kGauge,
       "Inner learning rate at each data shard's position",
       {},
       {"shard"}},
      {kConfigUnstable,
       K::kGauge,
       "1 while the configuration is known to be unstable, by reason; dn_buffer_below_trainers: "
       "async Delayed Nesterov with outer_optimizer.dn_buffer_size below the live trainers or "
       "aggregation.min_workers (set it to the number of trainers)",
       {},
       {"reason"}},
  };
}

void ReportPenalty(const std::vector<PenaltyModuleReport>& reports, uint64_t version,
                   const char* component, MetricsSink& metrics) {
  uint64_t anomalies = 0;
  uint64_t rollbacks = 0;
  double max_z = -std::numeric_limits<double>::infinity();
  double min_clip = 1;
  for (const PenaltyModuleReport& module : reports) {
    for (const PenaltyUpdateReport& u : module.updates) {
      metrics.Observe(kPseudoGradientNorm, u.norm);
      metrics.Observe(kPenaltyZScore, u.z_score);
      metrics.Observe(kPenaltyWeight, u.weight);
      if (u.anomalous) ++anomalies;
      max_z = std::max(max_z, u.z_score);
    }
    if (module.rollback) {
      ++rollbacks;
    } else if (!module.updates.empty()) {
      metrics.Observe(kPenaltyClipCoefficient, module.clip_coefficient);
      min_clip = std::min(min_clip, module.clip_coefficient);
    }
  }
  metrics.Add(kPenaltyAnomalies, static_cast<double>(anomalies));
  metrics.Add(kPenaltyRollbacks, static_cast<double>(rollbacks));
  if (anomalies > 0 || rollbacks > 0) {
    ALOE_LOG_WARNING(component,
                     "version %d: pseudo-gradient penalty flagged %d (update, layer) pairs as "
                     "anomalous (max z %.2f) and rolled back %d of %d layers",
                     version, anomalies, max_z, rollbacks, reports.size());
  } else {
    ALOE_LOG_INFO(component, "version %d: pseudo-gradient penalty max z %.2f, min clip %.3f",
                  version, max_z, min_clip);
  }
}

}  // namespace aloe::server
