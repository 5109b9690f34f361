#include "server/core/order_feed.h"

#include <utility>

#include "absl/strings/str_format.h"
#include "common/logging.h"

namespace aloe::server {
namespace {

absl::Status Reassembling() {
  return absl::AbortedError("the shards are reassembling; follow again");
}
absl::Status Gone() { return absl::CancelledError("shard gone"); }

v1::ShardOrder OrderOf(v1::ShardOrder::Kind kind, uint64_t version) {
  v1::ShardOrder order;
  order.set_kind(kind);
  order.set_version(version);
  return order;
}

}  // namespace

OrderFeed::OrderFeed(Options options, FeedHost& host, FeedWaits& waits, const Clock& clock)
    : options_(std::move(options)),
      host_(host),
      waits_(waits),
      clock_(clock),
      assembly_(options_.shard_processes) {}

bool OrderFeed::ready() {
  absl::MutexLock lock(&mu_);
  return assembly_.ready();
}

uint64_t OrderFeed::epoch() {
  absl::MutexLock lock(&mu_);
  return assembly_.current_epoch();
}

uint32_t OrderFeed::Finish(uint64_t version, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  assembly_.Finish(version);
  const absl::Time deadline = clock_.Now() + timeout;
  while (assembly_.finished_shards() < options_.shard_processes) {
    const absl::Time now = clock_.Now();
    if (now >= deadline) break;
    waits_.Wait(mu_, deadline - now);
  }
  return assembly_.finished_shards();
}

absl::Status OrderFeed::Check(const v1::FollowRequest& request) const {
  const uint32_t shard = request.shard_index();
  if (shard >= options_.shard_processes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("shard index %d, but this coordinator has %d shard processes "
                        "(shard_processes)",
                        shard, options_.shard_processes));
  }
  if (request.fingerprint() != options_.fingerprint) {
    return absl::FailedPreconditionError(
        absl::StrFormat("shard process %d has another model, optimizer or shard count (%s) than "
                        "the coordinator (%s): start every process with the same config",
                        shard, request.fingerprint(), options_.fingerprint));
  }
  if (request.address().empty()) {
    return absl::InvalidArgumentError("the shard must say its address");
  }
  return absl::OkStatus();
}

absl::Status OrderFeed::Serve(const v1::FollowRequest& request, OrderSink& sink) {
  if (absl::Status s = Check(request); !s.ok()) return s;
  absl::StatusOr<Position> at = Connect(request, sink);
  if (!at.ok()) return at.status();
  return Stream(request.shard_index(), *at, sink);
}

void OrderFeed::BeginAssembly() {
  assembly_.Begin();
  std::vector<ShardAddress> nowhere(options_.shard_processes);
  for (uint32_t i = 0; i < options_.shard_processes; ++i) nowhere[i].shard = i;
  host_.SetAddresses(nowhere);
  ALOE_LOG_INFO("coordinator", "assembling the %d shard processes (epoch %d)",
                options_.shard_processes, assembly_.current_epoch());
  waits_.WakeAll();
}

void OrderFeed::MaybeCompleteAssembly() {
  const std::optional<std::vector<ShardStart>> starts = assembly_.Starts();
  if (!starts) return;
  const uint64_t version = ChooseCommonVersion(host_.RestartVersions(), *starts);
  if (assembly_.NeedsRestore(version, host_.version())) {
    if (absl::Status s = host_.Restore(version); !s.ok()) {
      ALOE_LOG_ERROR("coordinator", "cannot restore version %d: %s; starting over", version,
                     s.message());
      BeginAssembly();
      return;
    }
  }
  assembly_.Complete(version);
  host_.Assembled(version);
  std::vector<ShardAddress> addresses;
  for (uint32_t i = 0; i < options_.shard_processes; ++i) {
    const v1::FollowRequest& r = assembly_.request(i);
    addresses.push_back({i, r.address(), r.push_address()});
  }
  host_.SetAddresses(addresses);
  ALOE_LOG_INFO("coordinator", "the %d shard processes are assembled at version %d",
                options_.shard_processes, version);
  waits_.WakeAll();
}

absl::StatusOr<OrderFeed::Position> OrderFeed::Connect(const v1::FollowRequest& request,
                                                       OrderSink& sink) {
  const uint32_t shard = request.shard_index();
  absl::MutexLock lock(&mu_);
  Position at;
  at.connection = assembly_.Connect(shard, request);
  std::optional<uint64_t> next;
  if (assembly_.MayFollowOn(shard)) next = host_.OrderIndexAfter(request.version());
  if (next) {
    // Lost only its connection: follows on from its version.
    assembly_.FollowOn(shard, *next);
    at.cursor = *next;
    host_.SetAddresses({{shard, request.address(), request.push_address()}});
    ALOE_LOG_INFO("coordinator", "shard %d follows again from version %d", shard,
                  request.version());
  } else {
    if (assembly_.ready()) {
      ALOE_LOG_WARNING("coordinator",
                       "shard %d %s at version %d: its staged updates are lost, so every "
                       "process goes back to a common checkpoint",
                       shard, request.fresh() ? "restarted" : "fell out of the log",
                       request.version());
      BeginAssembly();
    }
    assembly_.Join(shard);
    MaybeCompleteAssembly();
    while (assembly_.StreamState(shard, at.connection) == ShardAssembly::Stream::kWaiting &&
           !sink.Cancelled()) {
      waits_.Wait(mu_, options_.poll);
    }
    if (assembly_.StreamState(shard, at.connection) != ShardAssembly::Stream::kFollowing) {
      return Reassembling();
    }
    at.restore = assembly_.start_version();
  }
  at.epoch = assembly_.epoch_of(shard);
  return at;
}

absl::Status OrderFeed::Stream(uint32_t shard, Position at, OrderSink& sink) {
  if (at.restore && !sink.Write(OrderOf(v1::ShardOrder::RESTORE, *at.restore))) return Gone();
  while (!sink.Cancelled()) {
    std::vector<v1::ShardOrder> batch;
    std::optional<uint64_t> finish;
    {
      absl::MutexLock lock(&mu_);
      if (!assembly_.Current(shard, at.connection, at.epoch)) return Reassembling();
      finish = assembly_.finish_version();
      batch = host_.OrdersFrom(at.cursor);
      at.cursor += batch.size();
    }
    for (const v1::ShardOrder& order : batch) {
      if (!sink.Write(order)) return Gone();
    }
    if (!batch.empty()) {
      absl::MutexLock lock(&mu_);
      const std::optional<uint64_t> trim =
          assembly_.Sent(shard, at.connection, at.epoch, at.cursor);
      if (trim) host_.TrimOrdersBefore(*trim);
    }
    if (finish.has_value() && batch.empty()) {
      // Every order was sent (the log held none past the cursor when finish was read).
      if (!sink.Write(OrderOf(v1::ShardOrder::FINISH, *finish))) return Gone();
      absl::MutexLock lock(&mu_);
      assembly_.FinishSent(shard);
      waits_.WakeAll();
      return absl::OkStatus();
    }
    // Woken by a new order only; a reassembly or a newer connection of this shard process is
    // noticed within the poll.
    host_.WaitForOrder(at.cursor, options_.poll);
  }
  return Gone();
}

}  // namespace aloe::server
