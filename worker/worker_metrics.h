// The worker's metrics catalogue. README.md documents the same list.
#pragma once

#include <vector>

#include "common/metrics.h"

namespace aloe::worker {

inline constexpr char kLoss[] = "aloe_worker_loss";
inline constexpr char kTokensPerSecond[] = "aloe_worker_tokens_per_second";
inline constexpr char kStepsPerRound[] = "aloe_worker_steps_per_round";
inline constexpr char kSteps[] = "aloe_worker_steps_total";
inline constexpr char kTokens[] = "aloe_worker_tokens_total";
inline constexpr char kRounds[] = "aloe_worker_rounds_total";
inline constexpr char kPushedBytes[] = "aloe_worker_pushed_bytes_total";
inline constexpr char kPulledBytes[] = "aloe_worker_pulled_bytes_total";
inline constexpr char kComputeSeconds[] = "aloe_worker_compute_seconds_total";
inline constexpr char kNetworkSeconds[] = "aloe_worker_network_seconds_total";
inline constexpr char kBoundarySeconds[] = "aloe_worker_boundary_seconds_total";
inline constexpr char kEvalLoss[] = "aloe_worker_eval_loss";
inline constexpr char kModelVersion[] = "aloe_worker_model_version";
inline constexpr char kInfo[] = "aloe_worker_info";
inline constexpr char kModelFlops[] = "aloe_worker_model_flops_per_second";
inline constexpr char kRetries[] = "aloe_worker_retries_total";
inline constexpr char kRetryBackoff[] = "aloe_worker_retry_backoff_seconds";
inline constexpr char kInnerStateSaves[] = "aloe_worker_inner_state_saves_total";
inline constexpr char kInnerStateRestores[] = "aloe_worker_inner_state_restores_total";

inline std::vector<MetricDef> WorkerMetricCatalogue() {
  using K = MetricKind;
  return {
      {kLoss, K::kGauge, "Mean inner training loss of the last round (nats/token)", {}},
      {kTokensPerSecond, K::kGauge, "Training tokens per second of the last round, wall clock", {}},
      {kStepsPerRound, K::kGauge, "Local steps done in the last round", {}},
      {kSteps, K::kCounter, "Local steps done", {}},
      {kTokens, K::kCounter, "Training tokens processed", {}},
      {kRounds, K::kCounter, "Rounds (tasks) completed", {}},
      {kPushedBytes, K::kCounter, "Pseudo-gradient bytes pushed", {}},
      {kPulledBytes, K::kCounter, "Parameter bytes pulled", {}},
      {kComputeSeconds, K::kCounter, "Seconds spent in local training steps", {}},
      {kNetworkSeconds, K::kCounter, "Seconds blocked on pull, push and task requests", {}},
      {kBoundarySeconds,
       K::kCounter,
       "Seconds of the rounds' training time spent outside the steps, in the round boundary: "
       "the start put into the trainer, the pseudo-gradient taken out, the inner state saved",
       {}},
      {kEvalLoss, K::kGauge, "Held-out loss of the last evaluation (evaluator role)", {}},
      {kModelVersion, K::kGauge, "Global model version of the current task", {}},
      {kModelFlops,
       K::kGauge,
       "Model FLOP/s of the last round's steps: tokens per compute second x training FLOPs per "
       "token (6 N + 12 L d T); divided by the device's peak, the MFU",
       {}},
      {kRetries,
       K::kCounter,
       "Retries after a failure: kind task (a dropped task, asked for again), join, request "
       "(task requests), start_group or pull_group (calls retried while the server is away)",
       {},
       {"kind"}},
      {kRetryBackoff,
       K::kGauge,
       "The wait before asking again after the last dropped task; 0 once a round completes",
       {}},
      {kInnerStateSaves,
       K::kCounter,
       "Saves of the inner optimizer state to --state_dir: result saved or failed (e.g. disk "
       "full; training goes on and the next round tries again)",
       {},
       {"result"}},
      {kInnerStateRestores,
       K::kCounter,
       "The inner optimizer state at start: result restored, none (no file) or refused (another "
       "model or rank layout, or a damaged file; the worker starts from fresh moments)",
       {},
       {"result"}},
      {kInfo,
       K::kGauge,
       "Always 1: where this worker trains (device: cpu or cuda:I, rank 0's for a node), its "
       "autocast (off or bf16) and its ranks (--nproc)",
       {},
       {"device", "autocast", "ranks"}},
  };
}

}  // namespace aloe::worker
