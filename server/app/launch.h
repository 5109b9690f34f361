// aloe-server's command line as plain data, and what it makes: the config with the flags'
// overrides, checked against the role's flags (what --check reports), and each role's options.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "proto/aloe.pb.h"
#include "server/app/coordinator.h"
#include "server/app/shard_process.h"
#include "server/app/single_process_server.h"

namespace aloe::server {

// One field per aloe-server flag (server/main.cc documents them); -1 = not given.
struct LaunchFlags {
  std::string config;
  std::string role = "single";  // single, coordinator or shard
  std::string listen;
  std::string metrics;
  std::string corpus_dir;
  int64_t max_versions = -1;
  double max_seconds = -1;
  std::string checkpoint_dir;
  bool insecure = false;
  bool resume = false;
  std::string summary_file;
  double drain_seconds = 10;
  double pull_delay_ms = 0;
  std::string order_journal;
  int32_t shard_processes = -1;
  int32_t shard_index = -1;
  std::string coordinator;
  std::string push_listen;
  std::string advertise;
  std::string advertise_push;
  std::string token_file;
  std::string record_commits;
};

// The config file with the flags' overrides, validated (common/config.h) together with the
// flags of the role: kInvalidArgument naming the first problem. Opens no file but the config.
absl::StatusOr<v1::ServerConfig> LaunchConfig(const LaunchFlags& flags);

// The line --check prints for a valid config and flags.
std::string CheckSummary(const LaunchFlags& flags, const v1::ServerConfig& config);

SingleProcessServer::Options SingleProcessOptions(const LaunchFlags& flags,
                                                  const v1::ServerConfig& config);
CoordinatorServer::Options CoordinatorOptions(const LaunchFlags& flags,
                                              const v1::ServerConfig& config);
ShardProcess::Options ShardProcessOptions(const LaunchFlags& flags, const v1::ServerConfig& config);

}  // namespace aloe::server
