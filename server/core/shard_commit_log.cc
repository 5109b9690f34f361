#include "server/core/shard_commit_log.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "server/core/membership.h"

namespace aloe::server {

ShardCommitLog::ShardCommitLog(const v1::ServerConfig& config, const v1::ModelSpec& spec,
                               std::vector<uint32_t> layer_groups)
    : shard_processes_(config.shard_processes()),
      max_staged_(config.max_staged_updates()),
      sync_(config.aggregation().mode() == v1::AGGREGATION_SYNC),
      penalty_(config.penalty().enabled()),
      lease_seconds_(config.lease_seconds()),
      shard_addresses_(config.shard_processes()),
      shard_push_addresses_(config.shard_processes()) {
  const uint32_t groups =
      layer_groups.empty() ? 1 : *std::max_element(layer_groups.begin(), layer_groups.end()) + 1;
  group_versions_.assign(groups, 0);
  group_parts_.assign(groups, std::vector<bool>(shard_processes_, layer_groups.empty()));
  if (layer_groups.empty()) return;
  for (int l = 0; l < spec.layers_size() && static_cast<size_t>(l) < layer_groups.size(); ++l) {
    if (spec.layers(l).shard() < shard_processes_) {
      group_parts_[layer_groups[l]][spec.layers(l).shard()] = true;
    }
  }
}

ModelSnapshot ShardCommitLog::Snapshot() const {
  ModelSnapshot snapshot;
  snapshot.version = commit_version_;
  snapshot.group_versions = group_versions_;
  return snapshot;
}

uint32_t ShardCommitLog::PartsOf(uint32_t group) const {
  if (group >= group_parts_.size()) return shard_processes_;
  return static_cast<uint32_t>(
      std::count(group_parts_[group].begin(), group_parts_[group].end(), true));
}

void ShardCommitLog::SetAddress(uint32_t part, std::string address, std::string push_address) {
  if (part >= shard_addresses_.size()) return;
  shard_addresses_[part] = std::move(address);
  shard_push_addresses_[part] = std::move(push_address);
}

bool ShardCommitLog::ready() const {
  return std::none_of(shard_addresses_.begin(), shard_addresses_.end(),
                      [](const std::string& a) { return a.empty(); });
}

absl::Status ShardCommitLog::CheckJoin(v1::Role role, size_t live_trainers) const {
  if (!ready()) {
    return absl::UnavailableError(
        absl::StrFormat("waiting for the shard processes: %d of %d are following the coordinator",
                        std::count_if(shard_addresses_.begin(), shard_addresses_.end(),
                                      [](const std::string& a) { return !a.empty(); }),
                        shard_addresses_.size()));
  }
  const size_t groups = group_versions_.size();
  if (sync_ && IsTrainerRole(role) && (live_trainers + 1) * groups > max_staged_) {
    if (groups == 1) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "this layer-sharded sync server has %d trainers, as many as max_staged_updates (%d): "
          "a sync round commits only once every trainer's update is staged on every shard, so "
          "one more trainer would stop every round; raise max_staged_updates, train in async "
          "mode, or join once a trainer has left (or its lease of %.0f s has run out)",
          live_trainers, max_staged_, lease_seconds_));
    }
    return absl::ResourceExhaustedError(absl::StrFormat(
        "this layer-sharded sync server has %d trainers and %d layer groups, and "
        "max_staged_updates is %d: a round commits only once every trainer's update is staged, "
        "and each trainer may have an update of every group waiting, so one more trainer could "
        "stop the rounds; raise max_staged_updates to at least (trainers + 1) x groups, train in "
        "async mode, or join once a trainer has left (or its lease of %.0f s has run out)",
        live_trainers, groups, max_staged_, lease_seconds_));
  }
  return absl::OkStatus();
}

void ShardCommitLog::DescribeTo(v1::JoinReply& reply) const {
  for (const std::string& address : shard_addresses_) reply.add_shard_addresses(address);
  if (std::any_of(shard_push_addresses_.begin(), shard_push_addresses_.end(),
                  [](const std::string& a) { return !a.empty(); })) {
    for (const std::string& a : shard_push_addresses_) reply.add_shard_push_addresses(a);
  }
}

absl::Status ShardCommitLog::ApplyOuterStep(ApplyBatch& batch) {
  // The outer step happens on every shard process, in this order (ShardOrder COMMIT).
  v1::ShardOrder order;
  order.set_kind(v1::ShardOrder::COMMIT);
  order.set_version(commit_version_ + 1);
  const bool by_group = !batch.updates.empty() && batch.updates[0].by_group;
  if (by_group) {
    const uint32_t group = batch.updates[0].group;
    if (group >= group_versions_.size()) {
      return absl::InternalError(absl::StrFormat("outer step of layer group %d, the model has %d",
                                                 group, group_versions_.size()));
    }
    order.set_by_group(true);
    order.set_layer_group(group);
  }
  for (size_t i = 0; i < batch.updates.size(); ++i) {
    v1::CommitEntry* entry = order.add_entries();
    entry->set_worker_id(batch.updates[i].worker_id);
    entry->set_update_id(batch.updates[i].update_id);
    // The staleness discount travels with the commit as part of the update's weight.
    entry->set_weight(batch.weights[i] * batch.updates[i].weight_scale);
    entry->set_discount(batch.updates[i].weight_scale);
    admitted_.erase({batch.updates[i].worker_id, batch.updates[i].update_id});
  }
  if (by_group) {
    ++group_versions_[order.layer_group()];
  } else {
    for (uint64_t& v : group_versions_) ++v;
  }
  orders_.push_back(std::move(order));
  ++commit_version_;
  return absl::OkStatus();
}

absl::StatusOr<bool> ShardCommitLog::Admit(const v1::PushHeader& header) {
  const std::pair<uint64_t, uint64_t> key(header.worker_id(), header.update_id());
  if (admitted_.count(key)) return true;
  // A new update of this worker: its older one that did not reach every shard is given up.
  if (auto parts = parts_.find(header.worker_id());
      parts != parts_.end() && parts->second.update_id != header.update_id()) {
    DiscardParts(header.worker_id());
  }
  ReleaseUnsubmitted(header.worker_id());
  if (admitted_.size() >= max_staged_) return false;
  admitted_.emplace(key, false);
  return true;
}

absl::StatusOr<uint32_t> ShardCommitLog::StagePart(uint32_t part, const v1::PushHeader& header) {
  if (part >= shard_processes_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "shard %d reported a staged update, but this coordinator has %d shard processes", part,
        shard_processes_));
  }
  if (header.group() >= group_parts_.size() || !group_parts_[header.group()][part]) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "shard %d reported a staged update of layer group %d, of which it owns no layer", part,
        header.group()));
  }
  auto admitted = admitted_.find({header.worker_id(), header.update_id()});
  if (admitted == admitted_.end() && shard_processes_ == 1) {
    // Admitted now, as Admit would have.
    const absl::StatusOr<bool> room = Admit(header);
    if (room.ok() && !*room) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "%d updates are being pushed to the shards (max_staged_updates): push again later",
          admitted_.size()));
    }
    admitted = admitted_.find({header.worker_id(), header.update_id()});
  }
  if (admitted == admitted_.end()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "update %d of worker %d is not admitted (a newer update of the worker replaced it, or "
        "it was discarded): push again",
        header.update_id(), header.worker_id()));
  }
  auto it = parts_.find(header.worker_id());
  if (it != parts_.end() &&
      (it->second.update_id != header.update_id() || it->second.task_id != header.task_id())) {
    DiscardParts(header.worker_id());  // a new update supersedes the parts staged so far
    it = parts_.end();
  }
  if (it == parts_.end()) {
    Parts parts;
    parts.update_id = header.update_id();
    parts.task_id = header.task_id();
    parts.received.assign(shard_processes_, false);
    it = parts_.emplace(header.worker_id(), std::move(parts)).first;
  }
  Parts& parts = it->second;
  if (!parts.received[part]) {
    parts.received[part] = true;
    ++parts.count;
  }
  const uint32_t count = parts.count;
  if (count == PartsOf(header.group())) {
    parts_.erase(it);
    admitted->second = true;  // staged on every shard: released by its COMMIT or DISCARD
  }
  return count;
}

void ShardCommitLog::DiscardParts(uint64_t worker) {
  auto it = parts_.find(worker);
  if (it == parts_.end()) return;
  Discard(worker, it->second.update_id);
  parts_.erase(it);
}

void ShardCommitLog::Discard(uint64_t worker, uint64_t update_id) {
  v1::ShardOrder discard;
  discard.set_kind(v1::ShardOrder::DISCARD);
  v1::CommitEntry* entry = discard.add_entries();
  entry->set_worker_id(worker);
  entry->set_update_id(update_id);
  orders_.push_back(std::move(discard));
  admitted_.erase({worker, update_id});
}

void ShardCommitLog::DropUnsubmitted(uint64_t worker) {
  DiscardParts(worker);
  // What it did not push to every shard will never complete; a submitted update waits for its
  // COMMIT (a round may still apply it).
  ReleaseUnsubmitted(worker);
}

void ShardCommitLog::ReleaseUnsubmitted(uint64_t worker) {
  for (auto it = admitted_.lower_bound({worker, 0});
       it != admitted_.end() && it->first.first == worker;) {
    it = it->second ? std::next(it) : admitted_.erase(it);
  }
}

void ShardCommitLog::ForgetWorker(uint64_t worker) {
  if (!penalty_) return;
  v1::ShardOrder forget;  // the shards hold the penalty statistics
  forget.set_kind(v1::ShardOrder::FORGET);
  forget.add_entries()->set_worker_id(worker);
  orders_.push_back(std::move(forget));
}

void ShardCommitLog::SaveTo(v1::ServerCheckpoint& checkpoint) const {
  if (group_versions_.size() <= 1) return;
  for (uint64_t v : group_versions_) checkpoint.add_group_versions(v);
}

absl::Status ShardCommitLog::RestoreFrom(const v1::ServerCheckpoint& c) {
  if (c.layer_params_size() > 0 || c.optimizer_state_size() > 0) {
    return absl::FailedPreconditionError(
        "the checkpoint holds parameters: it was written by a single-process server, and this "
        "one is sharded across processes");
  }
  std::vector<uint64_t> group_versions(c.group_versions().begin(), c.group_versions().end());
  if (group_versions.empty()) group_versions.assign(group_versions_.size(), c.version());
  if (group_versions.size() != group_versions_.size() ||
      std::any_of(group_versions.begin(), group_versions.end(),
                  [&](uint64_t v) { return v > c.version(); })) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "checkpoint of version %d has %d layer group versions [%s]; this server has %d layer "
        "groups, each at most at the checkpoint's version",
        c.version(), c.group_versions_size(), absl::StrJoin(c.group_versions(), ", "),
        group_versions_.size()));
  }
  group_versions_ = std::move(group_versions);
  commit_version_ = c.version();
  orders_.clear();
  orders_base_version_ = c.version();
  orders_first_index_ = 0;
  return absl::OkStatus();
}

std::optional<uint64_t> ShardCommitLog::OrderIndexAfter(uint64_t shard_version) const {
  if (shard_version == orders_base_version_) return orders_first_index_;
  if (shard_version < orders_base_version_ || shard_version > commit_version_) return std::nullopt;
  for (size_t i = 0; i < orders_.size(); ++i) {
    if (orders_[i].kind() == v1::ShardOrder::COMMIT && orders_[i].version() == shard_version) {
      return orders_first_index_ + i + 1;
    }
  }
  return std::nullopt;
}

void ShardCommitLog::TrimOrdersBefore(uint64_t index) {
  if (index < orders_first_index_ + kOrderTrimBatch) return;
  const size_t drop = std::min<uint64_t>(index - orders_first_index_, orders_.size());
  for (size_t i = 0; i < drop; ++i) {
    if (orders_[i].kind() == v1::ShardOrder::COMMIT) orders_base_version_ = orders_[i].version();
  }
  orders_.erase(orders_.begin(), orders_.begin() + static_cast<std::ptrdiff_t>(drop));
  orders_first_index_ += drop;
}

}  // namespace aloe::server
