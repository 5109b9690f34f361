// The calls a worker makes to aloe-server, as an interface: worker::ServerClient
// (worker/client.h) implements it over gRPC, tests implement it with fakes. Every method has the
// contract of ServerClient's method of the same name. Implementations are thread-safe: the
// agent's heartbeat and overlap threads call them beside the round loop.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/tensor_codec.h"
#include "proto/aloe.pb.h"

namespace aloe {
class LowRankPushEncoder;  // common/low_rank_push.h
}  // namespace aloe

namespace aloe::worker {

class ServerApi {
 public:
  virtual ~ServerApi() = default;

  // The encoder that Push and PushGroup use for layers whose codec is CODEC_LOWRANK (null: such
  // a layer is refused). Implementations that encode nothing themselves ignore it.
  virtual void SetLowRankEncoder(std::shared_ptr<LowRankPushEncoder> encoder) {}

  // The wait between two tries of a call that failed for want of a server process (a retry or a
  // dropped task): blocks while a connection to the coordinator (or single server) or to a shard
  // process is down, until every one is up again (then at once: the process is back) or `wait`
  // passed. Returns what the caller must still sleep: all of `wait` when every connection was up
  // at the start (the failure was the server's answer, not an outage), none otherwise. Ends
  // early, within 100 ms, once *stop (when not null) is set. The default waits for nothing and
  // returns `wait`.
  virtual absl::Duration AwaitServers(absl::Duration wait, const std::atomic<bool>* stop) {
    return wait;
  }

  virtual absl::StatusOr<v1::JoinReply> Join(const v1::JoinRequest& request) = 0;
  virtual absl::StatusOr<v1::HeartbeatReply> Heartbeat(const v1::HeartbeatRequest& request) = 0;
  virtual absl::StatusOr<v1::Task> RequestTask(uint64_t worker_id, bool ahead,
                                               uint64_t dropped_task_id) = 0;
  virtual absl::Status ReportEval(const v1::EvalReport& report) = 0;
  virtual absl::Status Leave(uint64_t worker_id) = 0;
  virtual absl::Status SetShards(const std::vector<std::string>& addresses,
                                 const std::vector<std::string>& push_addresses,
                                 const std::string& server_push_address) = 0;
  virtual absl::StatusOr<uint64_t> Pull(uint64_t worker_id, uint64_t version, bool latest,
                                        const v1::ModelSpec& spec,
                                        std::vector<std::vector<float>>* layers, uint64_t* bytes,
                                        uint32_t slice, uint32_t slices) = 0;
  virtual absl::StatusOr<v1::PushReply> Push(const v1::PushHeader& header,
                                             const v1::ModelSpec& spec,
                                             const std::vector<std::vector<float>>& layers,
                                             const std::vector<v1::Codec>& codecs,
                                             const BlockSizes& block_sizes,
                                             std::vector<std::vector<float>>* residuals,
                                             uint64_t* bytes) = 0;
  // Partial synchronization (JoinReply.layer_groups).
  virtual absl::StatusOr<v1::Task> StartGroup(uint64_t worker_id, uint32_t group) = 0;
  virtual absl::StatusOr<uint64_t> PullGroup(uint64_t worker_id, uint32_t group,
                                             uint64_t min_group_version, const v1::ModelSpec& spec,
                                             absl::Span<const uint32_t> layer_groups,
                                             std::vector<std::vector<float>>* layers,
                                             uint64_t* bytes) = 0;
  virtual absl::StatusOr<v1::PushReply> PushGroup(
      const v1::PushHeader& header, const v1::ModelSpec& spec,
      absl::Span<const uint32_t> layer_groups, const std::vector<std::vector<float>>& layers,
      const std::vector<v1::Codec>& codecs, const BlockSizes& block_sizes,
      std::vector<std::vector<float>>* residuals, uint64_t* bytes) = 0;
};

}  // namespace aloe::worker
