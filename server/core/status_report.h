// What the status page shows (docs/operations.md, status page): a snapshot of one server role
// (the job, its version, workers, shard processes, data shards, rejections, checkpoint and
// held-out losses), a bounded history of versions and losses for the plots, the JSON the page
// polls and the page itself. Pure: no threads, no network, time comes from the caller.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/metrics.h"
#include "proto/aloe.pb.h"
#include "server/core/server_core.h"

namespace aloe::server {

struct StatusSnapshot {
  std::string role;  // "single process", "coordinator", "shard process 1"
  absl::Time now;
  // The job: config summary as (key, value) in display order, and the model's size.
  std::vector<std::pair<std::string, std::string>> job;
  uint64_t parameters = 0;
  uint64_t version = 0;
  uint64_t max_versions = 0;  // 0 = no limit
  uint64_t updates_applied = 0;
  bool stopping = false;
  bool draining = false;
  struct Worker {
    LiveWorker live;
    std::string identity;  // the token identity that joined it; "" = anonymous
  };
  std::vector<Worker> workers;
  struct ShardProcess {
    uint32_t index = 0;
    std::string address;   // where workers reach it; "" = away
    uint64_t version = 0;  // the version the coordinator has committed for it to follow
    // The version it reported it applied (aloe_shard_applied_version); 0 before any report.
    uint64_t applied_version = 0;
  };
  std::vector<ShardProcess> shard_processes;
  struct DataShard {
    std::string name;
    uint64_t tokens = 0;
    uint64_t tokens_learned = 0;
    uint64_t tokens_in_flight = 0;
    double probability = 0;
  };
  std::vector<DataShard> data_shards;
  // aloe_updates_rejected_total by reason, every reason (0 included).
  std::vector<std::pair<std::string, double>> rejections;
  // The last checkpoint written; nullopt = none yet.
  std::optional<uint64_t> checkpoint_version;
  std::optional<absl::Time> checkpoint_time;
  std::vector<EvalPoint> evals;  // held-out losses, oldest first
  // Role-specific figures (a shard process's staged updates, ...), (label, value).
  std::vector<std::pair<std::string, double>> figures;
};

// The snapshot of a core (the single-process server's or the coordinator's). `config` is the
// core's; `identity_of` names the identity that joined a worker id; `metrics` is the sink the
// core reports to (rejections and checkpoints are read back from it). Evaluations beyond the
// newest `max_evals` are left out.
StatusSnapshot CaptureStatus(const ServerCore& core, const v1::ServerConfig& config,
                             std::string role, absl::Time now,
                             const std::function<std::string(uint64_t)>& identity_of,
                             const MetricsReader& metrics, size_t max_evals = 2000);

// The snapshot of a shard process: its version, staged updates and bytes, received bytes and
// checkpoint, read from its metrics.
StatusSnapshot CaptureShardProcessStatus(const v1::ServerConfig& config, uint32_t shard_index,
                                         absl::Time now, const MetricsReader& metrics);

// The config summary of the job section: mode, outer optimizer, local work, codec and so on.
std::vector<std::pair<std::string, std::string>> JobSummary(const v1::ServerConfig& config);

// Versions and held-out losses over time, for the plots: at most `capacity` samples of each
// (the oldest go first). Not thread-safe.
class StatusHistory {
 public:
  struct VersionSample {
    absl::Time time;
    uint64_t version = 0;
  };
  struct LossSample {
    absl::Time time;
    uint64_t version = 0;
    double loss = 0;
  };

  explicit StatusHistory(size_t capacity = 600) : capacity_(capacity) {}

  // A version sample when the version changed (within kMinGap of the last sample, that sample
  // takes the new version instead, so that the history spans at least capacity * kMinGap), and a
  // loss sample at `now` for each evaluation of `evals` (in version order) of a version newer
  // than those recorded. `evals` may be any tail of the evaluation history.
  void Record(absl::Time now, uint64_t version, absl::Span<const EvalPoint> evals);

  const std::deque<VersionSample>& versions() const { return versions_; }
  const std::deque<LossSample>& losses() const { return losses_; }

  static constexpr absl::Duration kMinGap = absl::Seconds(1);

 private:
  const size_t capacity_;
  std::deque<VersionSample> versions_;
  std::deque<LossSample> losses_;
  std::optional<uint64_t> last_eval_;  // the version of the newest evaluation recorded
};

// The JSON that /status.json serves: the snapshot, with times as ages in seconds before
// snapshot.now, and the history as [seconds before now, value] pairs.
std::string StatusJson(const StatusSnapshot& snapshot, const StatusHistory& history);

// The page itself: HTML, CSS and JavaScript in one document with no external assets. It polls
// status.json (relative to its own address) every 2 s and draws the plots as inline SVG.
const char* StatusHtml();

}  // namespace aloe::server
