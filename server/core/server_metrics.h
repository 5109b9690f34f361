// The server's metrics catalogue (names, kinds, help). README.md documents the same list.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/metrics.h"
#include "proto/aloe.pb.h"
#include "server/core/pseudo_gradient_penalty.h"

namespace aloe::server {

inline constexpr char kModelVersion[] = "aloe_model_version";
inline constexpr char kOuterSteps[] = "aloe_outer_steps_total";
inline constexpr char kUpdatesApplied[] = "aloe_updates_applied_total";
inline constexpr char kUpdatesRejected[] = "aloe_updates_rejected_total";
inline constexpr char kTokensLearned[] = "aloe_tokens_learned_total";
inline constexpr char kLiveWorkers[] = "aloe_live_workers";
inline constexpr char kWorkersJoined[] = "aloe_workers_joined_total";
inline constexpr char kWorkersLeft[] = "aloe_workers_left_total";
inline constexpr char kWorkersExpired[] = "aloe_workers_expired_total";
inline constexpr char kRoundParticipants[] = "aloe_round_participants";
inline constexpr char kEvalLoss[] = "aloe_eval_loss";
inline constexpr char kEvalPerplexity[] = "aloe_eval_perplexity";
inline constexpr char kEvalVersion[] = "aloe_eval_version";
inline constexpr char kReceivedBytes[] = "aloe_received_bytes_total";
inline constexpr char kSentBytes[] = "aloe_sent_bytes_total";
inline constexpr char kApplyLatency[] = "aloe_apply_latency_seconds";
inline constexpr char kPushLatency[] = "aloe_push_latency_seconds";
inline constexpr char kTrainLoss[] = "aloe_train_loss";
inline constexpr char kUpdateStaleness[] = "aloe_update_staleness";
// Partial synchronization: per layer group (label "group", at most partial_sync.groups values).
inline constexpr char kLayerGroupVersion[] = "aloe_layer_group_version";
inline constexpr char kLayerGroupStaleness[] = "aloe_layer_group_staleness";
inline constexpr char kCheckpointSeconds[] = "aloe_checkpoint_duration_seconds";
inline constexpr char kCheckpointTimestamp[] = "aloe_checkpoint_last_timestamp_seconds";
inline constexpr char kCheckpointVersion[] = "aloe_checkpoint_version";
// Shard processes of a layer-sharded server.
inline constexpr char kStagedUpdates[] = "aloe_staged_updates";
inline constexpr char kStagedBytes[] = "aloe_staged_bytes";
inline constexpr char kRawPushBytes[] = "aloe_raw_push_bytes_total";
inline constexpr char kReceivedLayerBytes[] = "aloe_received_layer_bytes_total";
// Adaptive low-rank compression (TransportConfig.adaptive_rank).
inline constexpr char kLowRankRank[] = "aloe_lowrank_rank";
inline constexpr char kLowRankEffectiveRank[] = "aloe_lowrank_effective_rank";
inline constexpr char kAdaptiveLocalSteps[] = "aloe_adaptive_local_steps";
// Coordinator with checkpoint.replicate_shards: per shard process (label "process").
inline constexpr char kShardProcessCopyVersion[] = "aloe_shard_checkpoint_copy_version";
// Coordinator: the version each shard process reports it applied (label "process").
inline constexpr char kShardProcessAppliedVersion[] = "aloe_shard_applied_version";
// EDiT pseudo-gradient penalty (paper 000 Alg. 2), one observation per (update, layer) or layer;
// no per-worker labels.
inline constexpr char kPenaltyAnomalies[] = "aloe_penalty_anomalies_total";
inline constexpr char kPenaltyRollbacks[] = "aloe_penalty_rollbacks_total";
inline constexpr char kPenaltyClipCoefficient[] = "aloe_penalty_clip_coefficient";
inline constexpr char kPenaltyZScore[] = "aloe_penalty_z_score";
inline constexpr char kPenaltyWeight[] = "aloe_penalty_weight";
inline constexpr char kPseudoGradientNorm[] = "aloe_pseudo_gradient_norm";
// Workers released together: each closed grace window (async) or completed round (sync).
inline constexpr char kGraceWindowWorkers[] = "aloe_grace_window_workers";
// Look-ahead tasks handed out to overlapping workers (TaskRequest.ahead).
inline constexpr char kTasksAhead[] = "aloe_tasks_ahead_total";
// Tasks handed out in the reply of the push that completed the worker's update
// (PushHeader.want_next_task).
inline constexpr char kTasksInPushReplies[] = "aloe_tasks_in_push_replies_total";
// Versions not held because max_retained_versions older ones were (ServerCore::CapRetained),
// and the tasks workers gave up (TaskRequest.dropped_task_id).
inline constexpr char kRetainedVersionsDropped[] = "aloe_retained_versions_dropped_total";
inline constexpr char kTasksGivenUp[] = "aloe_tasks_given_up_total";
// Layer updates that wrote a fresh buffer (ParameterStore::copied_layer_steps).
inline constexpr char kLayerStepsCopied[] = "aloe_layer_steps_copied_total";
// Per live trainer, labels {worker (id), name}; removed when the worker leaves or expires.
inline constexpr char kTrainerStepsPerSecond[] = "aloe_trainer_steps_per_second";
inline constexpr char kTrainerPlannedSteps[] = "aloe_trainer_planned_steps";
// Per data shard of the corpus, label {shard} (the data shard's name): learning progress
// (paper 002 Eq. 2) and each data shard's LR schedule (Eq. 3).
inline constexpr char kDataShardTokensLearned[] = "aloe_data_shard_tokens_learned";
inline constexpr char kDataShardTokensInFlight[] = "aloe_data_shard_tokens_in_flight";
inline constexpr char kDataShardSamplingProbability[] = "aloe_data_shard_sampling_probability";
inline constexpr char kDataShardLrStep[] = "aloe_data_shard_lr_step";
inline constexpr char kDataShardLearningRate[] = "aloe_data_shard_learning_rate";
// 1 while the configuration is known to be unstable, by reason: kDnBufferBelowTrainers is
// Delayed Nesterov in async mode with dn_buffer_size below the live trainers or
// aggregation.min_workers (docs/algorithms.md, outer optimizers).
inline constexpr char kConfigUnstable[] = "aloe_config_unstable";
inline constexpr char kDnBufferBelowTrainers[] = "dn_buffer_below_trainers";

// Label values of aloe_updates_rejected_total{reason}.
inline constexpr const char* kRejectReasons[] = {
    "invalid_argument",   // malformed push: shapes, codec, NaN/Inf, sizes, header fields
    "stale",              // not the worker's open task / version, or a second push
    "too_stale",          // dropped by outer_optimizer.max_staleness
    "unknown_worker",     // not a live member
    "unauthenticated",    // missing or unknown token
    "permission_denied",  // another identity's worker id
    "other",
};
// The reason label of a rejected push's status.
const char* RejectReason(const absl::Status& status);
// Label value of a codec in aloe_{received,sent}_bytes_total{codec}: fp32, bf16, int8_blockwise,
// int4_blockwise.
std::string CodecLabel(v1::Codec codec);

std::vector<MetricDef> ServerMetricCatalogue();

// Records what the EDiT penalty did in the outer step that produced `version` (one report per
// layer stepped): norms, z-scores, weights and clip coefficients as histograms, anomalies and
// rollbacks as counters, and one log line (`component` names the process: "server", or "shard"
// for a shard process).
void ReportPenalty(const std::vector<PenaltyModuleReport>& reports, uint64_t version,
                   const char* component, MetricsSink& metrics);

}  // namespace aloe::server
