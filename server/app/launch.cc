#include "server/app/launch.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/config.h"
#include "common/status_macros.h"
#include "server/app/process_support.h"

namespace aloe::server {
namespace {

// The config file with the flags' overrides, not validated yet.
absl::StatusOr<v1::ServerConfig> OverriddenConfig(const LaunchFlags& flags) {
  if (flags.config.empty()) return absl::InvalidArgumentError("--config is required (see --help)");
  ALOE_ASSIGN_OR_RETURN(v1::ServerConfig config, LoadServerConfig(flags.config));
  // A shard listens on --listen; listen_address stays the coordinator's.
  if (!flags.listen.empty() && flags.role != "shard") config.set_listen_address(flags.listen);
  if (!flags.metrics.empty()) {
    config.set_metrics_address(flags.metrics);
  } else if (flags.role == "shard") {
    config.set_metrics_address("off");  // the config's address is the coordinator's
  }
  if (!flags.corpus_dir.empty()) config.set_corpus_dir(flags.corpus_dir);
  if (flags.max_versions >= 0) config.set_max_versions(flags.max_versions);
  if (flags.max_seconds >= 0) config.set_max_seconds(flags.max_seconds);
  if (!flags.checkpoint_dir.empty()) config.mutable_checkpoint()->set_dir(flags.checkpoint_dir);
  if (flags.shard_processes != -1) {
    if (flags.shard_processes < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--shard_processes must be >= 0, got %d", flags.shard_processes));
    }
    config.set_shard_processes(static_cast<uint32_t>(flags.shard_processes));
  }
  if (flags.insecure) config.mutable_security()->set_insecure(true);
  return config;
}

// The flags that only some roles take, and the addresses a shard would advertise.
absl::Status CheckRoleFlags(const LaunchFlags& flags, const v1::ServerConfig& config) {
  const std::string& role = flags.role;
  if (role != "single" && role != "coordinator" && role != "shard") {
    return absl::InvalidArgumentError(
        absl::StrCat("--role must be single, coordinator or shard, got \"", role, "\""));
  }
  if (role == "single" && config.shard_processes() > 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the config has shard_processes %d: start one --role coordinator and %d --role shard "
        "processes (or set shard_processes 0 for one process)",
        config.shard_processes(), config.shard_processes()));
  }
  if (role != "single" && config.shard_processes() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--role ", role, " needs shard_processes > 0 in the config"));
  }
  if (!flags.order_journal.empty() && role != "coordinator") {
    return absl::InvalidArgumentError("--order_journal is for --role coordinator only");
  }
  if (!flags.record_commits.empty() && role != "shard") {
    return absl::InvalidArgumentError("--record_commits is for --role shard only");
  }
  if (const std::string& push = flags.push_listen; !push.empty()) {
    if (role == "coordinator") {
      return absl::InvalidArgumentError(
          "--push_listen is for --role shard or single (a coordinator takes no pushes)");
    }
    if (push.rfind(':') == std::string::npos || push.substr(push.rfind(':') + 1) == "0") {
      return absl::InvalidArgumentError(
          "--push_listen needs HOST:PORT with a fixed port (workers are told it)");
    }
  }
  if (role == "shard") {
    if (flags.shard_index < 0 ||
        static_cast<uint32_t>(flags.shard_index) >= config.shard_processes()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--role shard needs --shard_index in [0, %d), got %d",
                          config.shard_processes(), flags.shard_index));
    }
    if (flags.listen.empty() || flags.listen.substr(flags.listen.rfind(':') + 1) == "0") {
      return absl::InvalidArgumentError(
          "--role shard needs --listen with a fixed port (its own address, which workers are "
          "told; listen_address is the coordinator's)");
    }
    ALOE_RETURN_IF_ERROR(CheckAdvertised("--advertise", "--listen", flags.advertise, flags.listen));
  } else if (!flags.advertise.empty()) {
    return absl::InvalidArgumentError("--advertise is for --role shard only");
  }
  if (!flags.advertise_push.empty() && flags.push_listen.empty()) {
    return absl::InvalidArgumentError("--advertise_push needs --push_listen");
  }
  if (!flags.push_listen.empty()) {
    ALOE_RETURN_IF_ERROR(CheckAdvertised("--advertise_push", "--push_listen", flags.advertise_push,
                                         flags.push_listen));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::ServerConfig> LaunchConfig(const LaunchFlags& flags) {
  ALOE_ASSIGN_OR_RETURN(v1::ServerConfig config, OverriddenConfig(flags));
  if (!(flags.drain_seconds >= 0) || !std::isfinite(flags.drain_seconds)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--drain_seconds must be a finite number >= 0, got %g", flags.drain_seconds));
  }
  if (flags.resume && config.checkpoint().dir().empty()) {
    return absl::InvalidArgumentError("--resume needs checkpoint.dir (or --checkpoint_dir)");
  }
  ALOE_RETURN_IF_ERROR(ValidateServerConfig(config));
  ALOE_RETURN_IF_ERROR(CheckRoleFlags(flags, config));
  return config;
}

std::string CheckSummary(const LaunchFlags& flags, const v1::ServerConfig& config) {
  return absl::StrFormat(
      "aloe-server --check: %s is valid for --role %s%s: model %s; outer %s; aggregation %s; "
      "%s\n",
      flags.config, flags.role,
      flags.role == "shard"
          ? absl::StrFormat(" (shard %d of %d)", flags.shard_index, config.shard_processes())
      : config.shard_processes() > 0
          ? absl::StrFormat(" (%d shard processes)", config.shard_processes())
          : "",
      config.model_file().empty()
          ? absl::StrFormat("d_model %d, %d layers", config.model().d_model(),
                            config.model().num_layers())
          : absl::StrCat("file ", config.model_file()),
      v1::OuterOptimizerType_Name(config.outer_optimizer().type()),
      v1::AggregationMode_Name(config.aggregation().mode()),
      config.security().tls_cert_file().empty() ? "plaintext" : "TLS");
}

namespace {

CoreRunner::Options CoreOptions(const LaunchFlags& flags, const v1::ServerConfig& config) {
  return CoreRunner::Options{config, flags.resume, absl::Seconds(flags.drain_seconds),
                             flags.summary_file};
}

}  // namespace

SingleProcessServer::Options SingleProcessOptions(const LaunchFlags& flags,
                                                  const v1::ServerConfig& config) {
  return SingleProcessServer::Options{CoreOptions(flags, config),
                                      absl::Milliseconds(flags.pull_delay_ms), flags.push_listen,
                                      flags.advertise_push};
}

CoordinatorServer::Options CoordinatorOptions(const LaunchFlags& flags,
                                              const v1::ServerConfig& config) {
  return CoordinatorServer::Options{CoreOptions(flags, config), flags.order_journal};
}

ShardProcess::Options ShardProcessOptions(const LaunchFlags& flags,
                                          const v1::ServerConfig& config) {
  ShardProcess::Options options;
  options.config = config;
  options.shard_index = static_cast<uint32_t>(flags.shard_index);
  options.listen = flags.listen;
  options.advertise = flags.advertise;
  options.coordinator = flags.coordinator;
  options.push_listen = flags.push_listen;
  options.advertise_push = flags.advertise_push;
  options.token_file = flags.token_file;
  options.resume = flags.resume;
  options.record_commits = flags.record_commits;
  return options;
}

}  // namespace aloe::server
