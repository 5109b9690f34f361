// Pure decisions of a layer-sharded server (coordinator + shard processes) that both sides must
// agree on: the fingerprint that says a shard process belongs to this coordinator, and the
// version every process restarts from when the shards (re)assemble.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "proto/aloe.pb.h"

namespace aloe::server {

// Model layout (layer names, sizes and owning process) + outer optimizer type and buffer size
// + bring-your-own model fingerprint (or ""). A shard process whose fingerprint differs from its
// coordinator's is refused, and a shard checkpoint of another fingerprint is not restored.
std::string ShardedModelFingerprint(const v1::ServerConfig& config, const v1::ModelSpec& spec,
                                    const std::string& model_fingerprint);

// What one shard process can restart from: the version it is at (with its state intact when
// it has not just started) and the versions of its checkpoints on disk.
struct ShardStart {
  uint64_t version = 0;
  std::vector<uint64_t> checkpoints;
};

// The newest version that the coordinator (at one of `coordinator_versions`: its current
// version and its checkpoints) and every shard (at its version, or one of its checkpoints) can
// all be at. Version 0, the initial model, is always possible.
uint64_t ChooseCommonVersion(const std::vector<uint64_t>& coordinator_versions,
                             const std::vector<ShardStart>& shards);

// The coordinator's side of assembling its shard processes, as state transitions without
// sockets or threads (ShardControlService is its gRPC adapter and holds a lock around it).
//
// The coordinator serves workers only while every shard process follows it from the same state.
// At start, and whenever a shard process starts again (a restart loses its staged updates, so
// the commits after its checkpoint cannot be replayed on it), the shards (re)assemble: a new
// assembly (epoch) begins, every stream of the old one ends and the shards follow again; once
// all of them have joined, the newest version that the coordinator and every shard can all be at
// is chosen (ChooseCommonVersion), the coordinator goes back to it and every shard gets RESTORE
// of it before the new log. A shard that only lost its connection follows on from its version.
//
// Each Follow call is a connection; a newer connection of the same shard supersedes the older.
class ShardAssembly {
 public:
  // The log is trimmed to this many orders before the slowest shard's position (a shard that
  // reconnects may not have applied everything it was sent).
  static constexpr uint64_t kLogSlack = 1024;

  explicit ShardAssembly(uint32_t shard_processes);

  uint32_t shard_processes() const { return static_cast<uint32_t>(followers_.size()); }
  // Every shard follows the current assembly: workers may be served.
  bool ready() const { return ready_; }
  uint64_t current_epoch() const { return epoch_; }
  // The version the current (or last completed) assembly started at.
  uint64_t start_version() const { return start_version_; }
  // The last request of shard `shard` (its addresses, version and checkpoints).
  const v1::FollowRequest& request(uint32_t shard) const { return followers_[shard].request; }

  // Shard `shard` (< shard_processes) asks to follow with `request`: returns the id of this
  // connection.
  uint64_t Connect(uint32_t shard, const v1::FollowRequest& request);
  // Whether it may follow on from its version, without an assembly: the shards are assembled and
  // it did not start again. (The order log must also still reach back to its version.)
  bool MayFollowOn(uint32_t shard) const;
  // It follows on in the current assembly from absolute order index `cursor`.
  void FollowOn(uint32_t shard, uint64_t cursor);
  // It joins the current assembly, which begins anew first when the shards were assembled.
  // Returns whether a new assembly began (the shards' addresses are no longer valid).
  bool Join(uint32_t shard);
  // A new assembly begins: every stream ends, workers wait.
  void Begin();
  // When every shard has joined the current assembly: what each can restart from; nullopt
  // while some have not.
  std::optional<std::vector<ShardStart>> Starts() const;
  // Whether the coordinator must restore `version` (the one chosen) before the shards start
  // there: always, but at its very first assembly at its own `current` version.
  bool NeedsRestore(uint64_t version, uint64_t current) const;
  // The current assembly completed at `version` (restored where needed).
  void Complete(uint64_t version);

  enum class Stream {
    kWaiting,    // joined an assembly that is not complete yet
    kFollowing,  // the assembly it joined is complete and current
    kEnded,      // superseded by a newer connection, or its assembly is over
  };
  // The state of `shard`'s stream of `connection`.
  Stream StreamState(uint32_t shard, uint64_t connection) const;
  // The assembly `shard` joined last.
  uint64_t epoch_of(uint32_t shard) const { return followers_[shard].epoch; }
  // Whether `shard`'s stream of `connection`, which joined assembly `epoch`, may go on.
  bool Current(uint32_t shard, uint64_t connection, uint64_t epoch) const;
  // The orders before absolute index `cursor` were sent on that stream (ignored when it is not
  // Current). Returns the index before which the log may be trimmed: kLogSlack before the
  // slowest shard, once every shard follows the current assembly and the slowest is 2 kLogSlack
  // in; nullopt otherwise.
  std::optional<uint64_t> Sent(uint32_t shard, uint64_t connection, uint64_t epoch,
                               uint64_t cursor);

  // The job is over at `version`: every stream sends its remaining orders, then FINISH.
  void Finish(uint64_t version) { finish_version_ = version; }
  std::optional<uint64_t> finish_version() const { return finish_version_; }
  // Shard `shard` was sent FINISH.
  void FinishSent(uint32_t shard) { finish_sent_[shard] = true; }
  // How many shards were sent FINISH.
  uint32_t finished_shards() const;

 private:
  struct Follower {
    uint64_t connection = 0;  // bumped by every Connect of this shard
    uint64_t epoch = 0;       // the assembly it joined
    uint64_t sent = 0;        // absolute index of the next order to send it
    v1::FollowRequest request;
  };

  std::vector<Follower> followers_;
  uint64_t epoch_ = 1;
  bool ready_ = false;
  bool first_assembly_ = true;
  uint64_t start_version_ = 0;
  std::optional<uint64_t> finish_version_;
  std::vector<bool> finish_sent_;
};

// Whether a shard process should stop following when its Follow stream ended with `code`: the
// coordinator refuses it for good (another config: kInvalidArgument or kFailedPrecondition; a
// missing or unknown token: kUnauthenticated or kPermissionDenied), so following again would be
// refused again. Any other end (the coordinator away, a reassembly) means: follow again.
bool RefusedForGood(absl::StatusCode code);

}  // namespace aloe::server
