// aloe-sim's engine: a deterministic discrete-event simulation of k workers of different speeds
// training against the real ServerCore (scheduler, aggregation, outer optimizers, penalty),
// driven by a FakeClock and an InlineExecutor. This is how the papers' straggler experiments
// (paper 002 Sec. 5, paper 000 Table 6) are reproduced on a small CPU box: the local work is real
// (a TrainerInterface computes true pseudo-gradients), only its duration is virtual.
//
// Simulated worker i follows the daemon's loop (worker/main.cc) in virtual time:
//   Join -> RequestTask ->
//     TRAIN: base = SnapshotFor(task.base_version), which reaches the worker when its pull
//            arrives over the worker's downlink; its compute starts then. The step count n is
//            task.local_steps, or, when task.time_budget_seconds > 0 (A-EDiT), the first n whose
//            cumulative step time reaches the budget, capped at local_steps; the trainer runs n
//            steps at once (real time) and the compute lasts the sum of the n step times taken
//            from the worker's StepTimeProfile. Then the push goes over the worker's uplink and
//            reaches the server (SubmitUpdate with steps_done = n, compute_seconds = the compute
//            time) when its upload arrives. Right after the push the worker heartbeats its
//            measured steps/s (n / compute time: what DyLU estimates) and asks for its next task.
//     WAIT:  asks again after every event that may change the server state (a push, join,
//            leave, lease expiry) and on periodic Tick events (every tick_seconds of virtual
//            time, scheduled only while some worker waits) so that time-based windows close.
//     STOP:  Leave.
//   Every live worker heartbeats every max(0.05, lease/3) virtual seconds (as the daemon does),
//   so leases expire only for crashed workers.
// Membership events: join@T:i (the worker Joins at T; a worker whose first event is a join is
// absent at t = 0, every other worker joins at t = 0 in index order), leave@T:i (graceful: the
// worker drops its in-flight work and calls Leave), crash@T:i (the worker stops silently; the
// core drops it when its lease expires, at the Tick scheduled for then). Work in flight at a
// leave or crash is lost: its push never arrives.
//
// Pushes (sim/push_codec.h): every worker encodes its pseudo-gradient with the config's
// transport as aloe-worker does (the codec of each layer, error feedback with per-worker
// residuals, low-rank layers through a per-worker LowRankPushEncoder whose warm starts persist),
// and the core receives what the server decodes from those bytes: lossy codecs change the
// training as they do in a real run. With transport.adaptive_rank a worker compresses each push
// at the ranks its task names and submits the effective ranks its encoder observed. A push the
// server would refuse (a value it cannot decode) is a rejected row with nothing applied.
//
// Network (sim/link_model.h): every worker has an uplink and a downlink, each a FIFO of
// transfers taking latency + bytes / rate of virtual time. A pull moves the whole model as
// float32 (PullBytes), a push its encoded payload bytes. With a server link, every transfer also
// queues there, behind the other workers' transfers. Without links every transfer is instant
// and the run is the same, event for event, as one without a network model. Control messages
// (task requests, heartbeats, acknowledgements) take no time.
//
// Overlap (options.overlap, as aloe-worker --overlap delayed|eager; docs/algorithms.md,
// overlapped communication): after the first pull, every round's compute runs while, in the
// background, the previous round's push is uploaded and submitted, the look-ahead task is
// requested (TaskRequest.ahead) and its base pulled. The next round starts when both halves are
// done. A look-ahead request answered WAIT is held, as the server's service holds it, and asked
// again whenever the core may have changed, for up to 10 virtual seconds. When no look-ahead
// task comes (WAIT after the hold, STOP, draining, a rejected push) the round is pushed at once
// and the worker asks for work as usual. Eager adds the round's own pseudo-gradient, scaled by
// -outer lr, to the next round's base (paper 004).
//
// Evaluation: the simulator evaluates the current global parameters itself with its evaluation
// trainer at version 0, whenever the version reaches last_evaluated + eval_every, and at the end.
//
// The run ends at the first of: the core reports Finished(); the version reaches max_versions;
// the pushed local steps reach max_local_steps; the next event lies beyond max_virtual_seconds;
// nothing can happen any more (no worker waits and no push or membership event is pending); or a
// stall (workers keep waiting although no push, membership event or lease expiry is pending, for
// stall_seconds). Work still in flight at the end is not pushed.
//
// Determinism: events are ordered by (virtual time, creation order); time is an absl::Duration
// (exact integer ticks); the core draws from its seeded generators; trainers must be
// deterministic. Same inputs and seed -> the same rows, hence a bit-identical CSV.
//
// Not thread-safe. Reads no wall clock and no real randomness.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/metrics.h"
#include "common/step_times.h"
#include "common/token_source.h"
#include "common/trainer_interface.h"
#include "proto/aloe.pb.h"
#include "server/core/shard_sampler.h"
#include "sim/link_model.h"

namespace aloe::sim {

using ::aloe::LoadTrace;
using ::aloe::ParseSpeeds;
using ::aloe::ParseTrace;
using ::aloe::StepTimeProfile;

struct MembershipEvent {
  enum class Kind { kJoin, kLeave, kCrash };
  Kind kind = Kind::kJoin;
  double at_seconds = 0;  // virtual seconds since the start
  int worker = 0;         // index into the profiles
};

// Parses --events: comma-separated "join@T:i", "leave@T:i" or "crash@T:i" (T virtual seconds,
// finite >= 0; i the worker index >= 0). Empty text gives no events. kInvalidArgument naming the
// bad item otherwise. Whether each event fits the worker's presence is checked by
// Simulator::Create.
absl::StatusOr<std::vector<MembershipEvent>> ParseEvents(const std::string& text);

// Overlapped communication of the simulated workers (aloe-worker --overlap).
enum class Overlap { kOff, kDelayed, kEager };
// "off", "delayed" or "eager"; kInvalidArgument otherwise.
absl::StatusOr<Overlap> ParseOverlap(const std::string& text);

struct SimulatorOptions {
  std::vector<StepTimeProfile> workers;  // one per simulated worker, at least one
  std::vector<MembershipEvent> events;
  uint32_t eval_every = 1;         // evaluate every this many versions; 0 = first and last only
  uint64_t max_versions = 0;       // 0 = no limit (the config's own max_versions still applies)
  uint64_t max_local_steps = 0;    // total steps of pushed updates; 0 = no limit
  double max_virtual_seconds = 0;  // 0 = no limit
  double tick_seconds = 0.05;      // > 0: Tick / WAIT-retry period while some worker waits
  // Stall limit (see the file comment); 0 = max(10, 3 * lease_seconds + finite grace_seconds).
  double stall_seconds = 0;
  // Sent by every simulated worker at Join (JoinRequest.model_fingerprint): the imported model's
  // fingerprint (common/imported_model.h ServerModel) when the config has model_file, "" for the
  // built-in transformer.
  std::string model_fingerprint;
  // Receives the core's metrics; null = discarded. Must outlive Run().
  MetricsSink* metrics = nullptr;
  // The corpus' token shards by file (Task.shard_file, the held-out file) for trainers that
  // read tokens (TrainRequest.data, EvalRequest.heldout); null for trainers that need none.
  // What it returns must outlive Run().
  std::function<absl::StatusOr<const TokenSource*>(const std::string& file)> open_shard;
  uint32_t eval_sequences = 64;  // EvalRequest.max_sequences
  // Each worker's link (sim/link_model.h): none = every transfer instant; one = every worker's;
  // else one per worker.
  std::vector<LinkSpec> links;
  // The server's own link, shared by every worker (sim/link_model.h); none = unlimited.
  std::optional<LinkSpec> server_link;
  Overlap overlap = Overlap::kOff;
  // Window of WorkerStats' peak bytes/s, virtual seconds, > 0.
  double peak_window_seconds = 1;
  // When set: SimResult.target_seconds is the first evaluation at or below this loss.
  std::optional<double> target_loss;
};

// One CSV row: a push (applied, accepted into a batch that is not complete yet, or rejected), or
// an evaluation of a version that no push row produced (version 0, or a version completed by a
// leave or lease expiry).
struct SimRow {
  enum class Outcome { kApplied, kAccepted, kRejected, kEval };
  double virtual_seconds = 0;
  uint64_t version = 0;  // global version after the event
  int worker = -1;       // simulated worker index; -1 for kEval
  // Version the outer step saw before this update minus the update's base version (for
  // kAccepted: the current version minus the base version, its staleness if applied now).
  uint64_t staleness = 0;
  std::string shard;
  uint32_t steps = 0;
  std::optional<double> eval_loss;  // set when `version` was evaluated
  Outcome outcome = Outcome::kEval;
};

// One simulated worker's use of its time and link over the run.
struct WorkerStats {
  // Virtual seconds of compute (rounds lost at a leave or crash, or cut by the end, count up to
  // then) and of membership (join to leave, crash, STOP or the end of the run; a crashed worker
  // stops counting when it crashes).
  double compute_seconds = 0;
  double present_seconds = 0;
  double utilization = 0;  // compute_seconds / present_seconds; 0 if never present
  // Bytes of every transfer started (Link::bytes), including ones lost or cut by the end.
  uint64_t bytes_up = 0;
  uint64_t bytes_down = 0;
  // Link::PeakBytesPerSecond over peak_window_seconds.
  double peak_up_bytes_per_second = 0;
  double peak_down_bytes_per_second = 0;
};

struct SimResult {
  std::vector<SimRow> rows;
  double virtual_seconds = 0;  // when the run ended
  uint64_t final_version = 0;
  double final_eval_loss = 0;                 // evaluation of final_version
  uint64_t total_local_steps = 0;             // steps of every pushed update (incl. rejected)
  std::vector<uint64_t> updates_per_worker;   // pushes accepted (applied or batched)
  std::vector<uint64_t> rejected_per_worker;  // pushes rejected
  std::vector<std::string> rejections;        // status message of each rejected push
  // Payload bytes of every push that reached the server (applied, accepted or rejected), as
  // encoded (sim/push_codec.h).
  uint64_t pushed_bytes = 0;
  std::string stop_reason;            // e.g. "finished", "max_versions"
  std::vector<WorkerStats> workers;   // one per simulated worker
  std::optional<double> target_loss;  // SimulatorOptions.target_loss
  // Virtual time of the first evaluation whose loss was <= target_loss; unset if none was.
  std::optional<double> target_seconds;
};

// The CSV: header
//   virtual_time,version,worker,staleness,shard,steps,eval_loss,outcome
// then one line per row: virtual_time with 6 decimals; worker, staleness, shard, steps empty on
// eval rows; eval_loss (%.6f) empty unless that version was evaluated; outcome one of applied,
// accepted, rejected, eval.
std::string FormatCsv(const SimResult& result);
// One line: final eval loss, virtual time, versions, total local steps, updates per worker,
// rejected pushes, pushed bytes (SimResult.pushed_bytes), then per worker (comma lists) compute
// utilization, bytes up and down and peak bytes/s up and down, and, with a target loss, the virtual
// seconds to reach it ("never").
std::string FormatSummary(const SimResult& result);
// The per-worker CSV: header
//   worker,updates,rejected,compute_seconds,present_seconds,utilization,bytes_up,bytes_down,
//   peak_up_bytes_per_second,peak_down_bytes_per_second
// then one line per worker (seconds and rates with 6 decimals).
std::string FormatWorkersCsv(const SimResult& result);

class Simulator {
 public:
  // `config` must pass ValidateServerConfig (kInvalidArgument otherwise); `train_shards` and
  // `heldout_file` go to ServerCore::Create as given. One trainer per profile in
  // options.workers (each keeps its own inner state across rounds) and one evaluation trainer.
  // kInvalidArgument for a trainer count that does not match, a tick_seconds that is not > 0,
  // an event naming an unknown worker or not fitting its presence (a join of a present
  // worker, a leave or crash of an absent one), naming the event, a link count other than 0, 1
  // or the number of workers, a link (or the server link) out of range, a peak window that is not >
  // 0, or a non-finite target loss.
  static absl::StatusOr<std::unique_ptr<Simulator>> Create(
      v1::ServerConfig config, std::vector<server::DataShard> train_shards,
      std::string heldout_file, SimulatorOptions options,
      std::vector<std::unique_ptr<TrainerInterface>> worker_trainers,
      std::unique_ptr<TrainerInterface> eval_trainer);

  ~Simulator();
  Simulator(const Simulator&) = delete;
  Simulator& operator=(const Simulator&) = delete;

  // Runs the simulation to its end (see the file comment). Call once: kFailedPrecondition
  // afterwards. Errors from the core that a real worker could not handle (e.g. a failed Join)
  // and trainer errors are returned with the virtual time and worker in the message.
  absl::StatusOr<SimResult> Run();

 private:
  class Engine;
  explicit Simulator(std::unique_ptr<Engine> engine);
  std::unique_ptr<Engine> engine_;
};

}  // namespace aloe::sim
