#include "server/core/shard_assembly.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace aloe::server {

std::string ShardedModelFingerprint(const v1::ServerConfig& config, const v1::ModelSpec& spec,
                                    const std::string& model_fingerprint) {
  std::string f =
      absl::StrFormat("sharded1;outer=%s/N=%d;processes=%d;",
                      v1::OuterOptimizerType_Name(config.outer_optimizer().type()),
                      config.outer_optimizer().dn_buffer_size(), config.shard_processes());
  for (const v1::LayerSpec& layer : spec.layers()) {
    absl::StrAppendFormat(&f, "%s:%d@%d;", layer.name(), layer.num_elements(), layer.shard());
  }
  if (!model_fingerprint.empty()) absl::StrAppend(&f, "model=", model_fingerprint);
  // The shards hold the penalty statistics: every process must agree on whether there are any.
  if (config.penalty().enabled()) absl::StrAppend(&f, ";penalty");
  // Every process must count the same layer groups (their versions are in the checkpoints).
  if (config.partial_sync().groups() > 1) {
    absl::StrAppend(&f, ";layer_groups=", config.partial_sync().groups());
  }
  return f;
}

uint64_t ChooseCommonVersion(const std::vector<uint64_t>& coordinator_versions,
                             const std::vector<ShardStart>& shards) {
  std::vector<uint64_t> candidates = coordinator_versions;
  std::sort(candidates.rbegin(), candidates.rend());
  for (uint64_t v : candidates) {
    const bool everybody = std::all_of(shards.begin(), shards.end(), [&](const ShardStart& s) {
      return s.version == v ||
             std::find(s.checkpoints.begin(), s.checkpoints.end(), v) != s.checkpoints.end();
    });
    if (everybody) return v;
  }
  return 0;
}

ShardAssembly::ShardAssembly(uint32_t shard_processes)
    : followers_(shard_processes), finish_sent_(shard_processes, false) {}

uint64_t ShardAssembly::Connect(uint32_t shard, const v1::FollowRequest& request) {
  Follower& f = followers_[shard];
  f.request = request;
  return ++f.connection;
}

bool ShardAssembly::MayFollowOn(uint32_t shard) const {
  return ready_ && !followers_[shard].request.fresh();
}

void ShardAssembly::FollowOn(uint32_t shard, uint64_t cursor) {
  followers_[shard].epoch = epoch_;
  followers_[shard].sent = cursor;
}

bool ShardAssembly::Join(uint32_t shard) {
  const bool began = ready_;
  if (began) Begin();
  // The new log starts at index 0 (RESTORE resets it), where this shard will start.
  followers_[shard].epoch = epoch_;
  followers_[shard].sent = 0;
  return began;
}

void ShardAssembly::Begin() {
  ready_ = false;
  ++epoch_;
}

std::optional<std::vector<ShardStart>> ShardAssembly::Starts() const {
  std::vector<ShardStart> starts;
  for (const Follower& f : followers_) {
    if (f.epoch != epoch_) return std::nullopt;
    starts.push_back(ShardStart{
        f.request.version(),
        {f.request.checkpoint_versions().begin(), f.request.checkpoint_versions().end()}});
  }
  return starts;
}

bool ShardAssembly::NeedsRestore(uint64_t version, uint64_t current) const {
  return !first_assembly_ || version != current;
}

void ShardAssembly::Complete(uint64_t version) {
  first_assembly_ = false;
  start_version_ = version;
  ready_ = true;
}

ShardAssembly::Stream ShardAssembly::StreamState(uint32_t shard, uint64_t connection) const {
  const Follower& f = followers_[shard];
  if (f.connection != connection || f.epoch != epoch_) return Stream::kEnded;
  return ready_ ? Stream::kFollowing : Stream::kWaiting;
}

bool ShardAssembly::Current(uint32_t shard, uint64_t connection, uint64_t epoch) const {
  return epoch_ == epoch && followers_[shard].connection == connection;
}

std::optional<uint64_t> ShardAssembly::Sent(uint32_t shard, uint64_t connection, uint64_t epoch,
                                            uint64_t cursor) {
  if (!Current(shard, connection, epoch)) return std::nullopt;
  followers_[shard].sent = cursor;
  uint64_t slowest = std::numeric_limits<uint64_t>::max();
  for (const Follower& f : followers_) {
    if (f.epoch != epoch_) return std::nullopt;
    slowest = std::min(slowest, f.sent);
  }
  if (slowest < 2 * kLogSlack) return std::nullopt;
  return slowest - kLogSlack;
}

uint32_t ShardAssembly::finished_shards() const {
  return static_cast<uint32_t>(std::count(finish_sent_.begin(), finish_sent_.end(), true));
}

bool RefusedForGood(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kPermissionDenied:
      return true;
    default:
      return false;
  }
}

}  // namespace aloe::server
