#include "tools/reshard.h"

#include <dirent.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/clock.h"
#include "common/executor.h"
#include "common/imported_model.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/status_macros.h"
#include "server/core/checkpoint_layout.h"
#include "server/core/checkpoint_store.h"
#include "server/core/server_core.h"
#include "server/core/shard_assembly.h"
#include "server/core/shard_state.h"

namespace aloe::server {
namespace {

std::string ShardDir(const std::string& dir, uint32_t i) {
  return absl::StrFormat("%s/shard-%d", dir, i);
}

// The entries of `dir` (none when it does not exist).
std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") names.push_back(name);
    }
    ::closedir(d);
  }
  return names;
}

// N when dir holds shard-0 ... shard-(N-1) (0 when none).
absl::StatusOr<uint32_t> CountShardDirs(const std::string& dir) {
  std::set<uint32_t> found;
  for (const std::string& name : Entries(dir)) {
    uint32_t i = 0;
    if (absl::StartsWith(name, "shard-") && absl::SimpleAtoi(name.substr(6), &i)) found.insert(i);
  }
  for (uint32_t i = 0; i < found.size(); ++i) {
    if (found.count(i) == 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s has shard directories [%s] but no shard-%d: copy every shard process's checkpoint "
          "directory (shard-<i> under its checkpoint.dir) beside the coordinator's checkpoints",
          dir, absl::StrJoin(found, ", "), i));
    }
  }
  return static_cast<uint32_t>(found.size());
}

std::string RealPath(const std::string& path) {
  char* resolved = ::realpath(path.c_str(), nullptr);
  if (resolved == nullptr) return path;
  std::string out = resolved;
  ::free(resolved);
  return out;
}

absl::Status CheckFingerprint(const std::string& path, const std::string& found,
                              const std::string& expected, uint32_t processes) {
  if (found == expected) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrFormat(
      "%s is of another model, outer optimizer, penalty or corpus than this config run as %s: "
      "the checkpoint says \"%s\", the config gives \"%s\"",
      path,
      processes == 0 ? std::string("one process")
                     : absl::StrFormat("%d shard processes", processes),
      found, expected));
}

// The newest version of from_dir's checkpoints (written by `processes` processes, the shards'
// in shards_dir/shard-<i>) that every process has whole, joined into the one-process layout
// (fingerprint not set).
// source: the model (spec alone) as a server of source_config lays it out.
absl::StatusOr<v1::ServerCheckpoint> ReadSource(const std::string& from_dir,
                                                const std::string& shards_dir, uint32_t processes,
                                                const v1::ServerConfig& source_config,
                                                const ServerModel& source, size_t data_shards) {
  const CheckpointStore coordinator_store(from_dir, 1);
  std::vector<uint64_t> candidates = coordinator_store.Versions();
  if (candidates.empty()) {
    return absl::NotFoundError(absl::StrFormat("no checkpoints in %s", from_dir));
  }
  std::vector<std::vector<uint64_t>> shard_versions(processes);
  for (uint32_t i = 0; i < processes; ++i) {
    shard_versions[i] = CheckpointStore(ShardDir(shards_dir, i), 1).Versions();
    std::vector<uint64_t> common;
    for (uint64_t v : candidates) {
      if (std::count(shard_versions[i].begin(), shard_versions[i].end(), v) > 0) {
        common.push_back(v);
      }
    }
    candidates = std::move(common);
  }
  if (candidates.empty()) {
    std::string listing =
        absl::StrFormat("coordinator [%s]", absl::StrJoin(coordinator_store.Versions(), ", "));
    for (uint32_t i = 0; i < processes; ++i) {
      absl::StrAppendFormat(&listing, ", shard %d [%s]", i, absl::StrJoin(shard_versions[i], ", "));
    }
    return absl::FailedPreconditionError(absl::StrFormat(
        "no version in %s is checkpointed by the coordinator and every shard process: %s", from_dir,
        listing));
  }
  const std::string expected =
      ServerCore::FingerprintOf(source_config, source.spec, data_shards, source.fingerprint);
  const std::string expected_shard =
      ShardedModelFingerprint(source_config, source.spec, source.fingerprint);
  for (uint64_t version : candidates) {
    const std::string path = coordinator_store.PathOf(version);
    absl::StatusOr<v1::ServerCheckpoint> coordinator =
        CheckpointStore::ReadFile<v1::ServerCheckpoint>(path);
    ShardedCheckpoint sharded;
    absl::Status read = coordinator.status();
    for (uint32_t i = 0; read.ok() && i < processes; ++i) {
      const std::string shard_path = CheckpointStore(ShardDir(shards_dir, i), 1).PathOf(version);
      absl::StatusOr<v1::ShardCheckpoint> shard =
          CheckpointStore::ReadFile<v1::ShardCheckpoint>(shard_path);
      read = shard.status();
      if (!read.ok()) break;
      if (shard->shard_processes() != processes) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s is of shard %d of %d shard processes, and %s has %d shard directories: copy "
            "every shard process's checkpoint directory (shard-<i> under its checkpoint.dir) "
            "beside the coordinator's checkpoints",
            shard_path, shard->shard_index(), shard->shard_processes(), shards_dir, processes));
      }
      ALOE_RETURN_IF_ERROR(
          CheckFingerprint(shard_path, shard->fingerprint(), expected_shard, processes));
      sharded.shards.push_back(*std::move(shard));
    }
    if (!read.ok()) {
      ALOE_LOG_WARNING("reshard", "version %d: %s; trying the previous one", version,
                       read.message());
      continue;
    }
    ALOE_RETURN_IF_ERROR(CheckFingerprint(path, coordinator->fingerprint(), expected, processes));
    if (processes == 0) {
      if (coordinator->layer_params_size() == 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s is a coordinator's checkpoint (no layers), and %s has no shard-<i> directories: "
            "copy every shard process's checkpoint directory beside it",
            path, from_dir));
      }
      ALOE_LOG_INFO("reshard", "read version %d of one process from %s", version, path);
      return *std::move(coordinator);
    }
    sharded.coordinator = *std::move(coordinator);
    ALOE_LOG_INFO("reshard", "read version %d of a coordinator and %d shard processes from %s",
                  version, processes, from_dir);
    return JoinShardCheckpoints(source.spec, sharded);
  }
  return absl::DataLossError(absl::StrFormat(
      "every version in %s that all processes checkpointed has a corrupt file (see above)",
      from_dir));
}

}  // namespace

absl::Status Reshard(const v1::ServerConfig& config, const std::string& from_dir,
                     const std::vector<DataShard>& train, const std::string& heldout_file) {
  const std::string to_dir = config.checkpoint().dir();
  if (to_dir.empty()) {
    return absl::InvalidArgumentError(
        "aloe-reshard writes to checkpoint.dir: set it (or --to) to a new directory");
  }
  if (RealPath(to_dir) == RealPath(from_dir)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--from %s and checkpoint.dir %s are the same directory: write the converted "
        "checkpoint to a new one",
        from_dir, to_dir));
  }
  if (!Entries(to_dir).empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "checkpoint.dir %s is not empty: the converted checkpoint goes to a new or empty directory",
        to_dir));
  }
  // The shard processes' checkpoints: copied beside the coordinator's, or else the copies the
  // coordinator kept itself (checkpoint.replicate_shards).
  std::string shards_dir = from_dir;
  ALOE_ASSIGN_OR_RETURN(uint32_t from_processes, CountShardDirs(from_dir));
  if (from_processes == 0) {
    ALOE_ASSIGN_OR_RETURN(from_processes, CountShardDirs(from_dir + "/replicas"));
    if (from_processes > 0) {
      shards_dir = from_dir + "/replicas";
      ALOE_LOG_INFO("reshard", "the shard processes' checkpoints: the coordinator's copies in %s",
                    shards_dir);
    }
  }
  RealClock clock;
  InlineExecutor executor;
  NullMetrics metrics;
  v1::ServerConfig source_config = config;
  source_config.set_shard_processes(from_processes);
  // The source's layout needs no server of its own: its spec and fingerprints suffice.
  ALOE_ASSIGN_OR_RETURN(const ServerModel source, LoadServerModel(source_config, kNoLayers));
  ALOE_ASSIGN_OR_RETURN(
      v1::ServerCheckpoint whole,
      ReadSource(from_dir, shards_dir, from_processes, source_config, source, train.size()));
  // The target's is built: the converted checkpoint must restore into it.
  ALOE_ASSIGN_OR_RETURN(std::unique_ptr<ServerCore> target,
                        ServerCore::Create(config, train, heldout_file, clock, executor, metrics));
  ALOE_ASSIGN_OR_RETURN(const ServerModel target_model, LoadServerModel(config, kNoLayers));
  const uint32_t to_processes = config.shard_processes();

  // Converted and restored into what the server builds before anything is written.
  ShardedCheckpoint out;
  if (to_processes == 0) {
    out.coordinator = std::move(whole);
  } else {
    ALOE_ASSIGN_OR_RETURN(out, SplitCheckpoint(target_model.spec, whole));
  }
  out.coordinator.set_fingerprint(target->Fingerprint());
  ALOE_RETURN_IF_ERROR(target->RestoreCheckpoint(out.coordinator));
  target.reset();
  for (uint32_t i = 0; i < to_processes; ++i) {
    ALOE_ASSIGN_OR_RETURN(ServerModel model, LoadServerModel(config, i));
    ALOE_ASSIGN_OR_RETURN(
        std::unique_ptr<ShardState> state,
        ShardState::Create(model.spec, i, std::move(model.initial), config.outer_optimizer(), 1,
                           config.max_staged_updates(), executor));
    if (config.penalty().enabled()) ALOE_RETURN_IF_ERROR(state->EnablePenalty(config.penalty()));
    const std::string fingerprint = ShardedModelFingerprint(config, model.spec, model.fingerprint);
    out.shards[i].set_fingerprint(fingerprint);
    ALOE_RETURN_IF_ERROR(state->Restore(out.shards[i], fingerprint));
  }

  // The shards first, the coordinator last; all of it or nothing (to_dir was empty or absent).
  const bool to_dir_existed = ::access(to_dir.c_str(), F_OK) == 0;
  std::vector<std::string> written;
  auto write = [&](auto& store, const auto& checkpoint) -> absl::Status {
    absl::StatusOr<std::string> path = store.Write(checkpoint);
    if (!path.ok()) {
      for (const std::string& p : written) ::unlink(p.c_str());
      for (uint32_t i = 0; i < to_processes; ++i) ::rmdir(ShardDir(to_dir, i).c_str());
      if (!to_dir_existed) ::rmdir(to_dir.c_str());
      return path.status();
    }
    written.push_back(*path);
    ALOE_LOG_INFO("reshard", "wrote %s (%.1f MB)", *path, checkpoint.ByteSizeLong() / 1e6);
    return absl::OkStatus();
  };
  const uint32_t keep = std::max<uint32_t>(1, config.checkpoint().keep());
  for (uint32_t i = 0; i < to_processes; ++i) {
    CheckpointStore store(ShardDir(to_dir, i), keep);
    ALOE_RETURN_IF_ERROR(write(store, out.shards[i]));
  }
  CheckpointStore store(to_dir, keep);
  ALOE_RETURN_IF_ERROR(write(store, out.coordinator));
  auto layout = [](uint32_t processes) {
    return processes == 0 ? std::string("one process")
                          : absl::StrFormat("a coordinator and %d shard processes", processes);
  };
  absl::PrintF(
      "aloe-reshard: version %d of %s (%s) is now in %s for %s; start the server "
      "with --resume and checkpoint.dir %s\n",
      out.coordinator.version(), from_dir, layout(from_processes), to_dir, layout(to_processes),
      to_dir);
  return absl::OkStatus();
}

}  // namespace aloe::server
