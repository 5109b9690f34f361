// aloe-server: holds the global model and the outer optimizer, assigns tasks to workers, and
// serves the Coordinator and ParameterService gRPC APIs plus a Prometheus /metrics endpoint.
// One of three roles (server/app/): one process, or the coordinator and the shard processes of
// a layer-sharded server. This file turns the flags into the role's options and runs it.
#include <signal.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/allocator.h"
#include "common/flags_usage.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/app/launch.h"
#include "server/app/process_support.h"

ABSL_FLAG(std::string, config, "", "Server config file (text-format .textproto/.pbtxt or .json)");
ABSL_FLAG(std::string, listen, "", "Override listen_address (host:port; port 0 = OS-chosen)");
ABSL_FLAG(std::string, metrics, "", "Override metrics_address (host:port, or 'off')");
ABSL_FLAG(std::string, corpus_dir, "", "Override corpus_dir");
ABSL_FLAG(int64_t, max_versions, -1, "Override max_versions (outer steps before stopping)");
ABSL_FLAG(double, max_seconds, -1, "Override max_seconds (training time before stopping)");
ABSL_FLAG(std::string, checkpoint_dir, "", "Override checkpoint.dir");
ABSL_FLAG(bool, insecure, false,
          "Allow a non-loopback listen address without TLS and a token file (security.insecure)");
ABSL_FLAG(bool, resume, false,
          "Resume from the newest whole checkpoint in checkpoint.dir (fresh start when none)");
ABSL_FLAG(std::string, summary_file, "",
          "At exit write 'version=N', 'updates_applied=N' and one 'eval=VERSION:LOSS' per line");
ABSL_FLAG(double, drain_seconds, 10,
          "On SIGTERM/SIGINT: hand out no new work and wait up to this long for the tasks already "
          "handed out to be pushed (or reported) before the final checkpoint; a second signal "
          "ends the wait");
ABSL_FLAG(double, pull_delay_ms, 0,
          "Testing: delay every Pull by this many milliseconds (emulates a slow link)");
ABSL_FLAG(std::string, port_file, "",
          "Write 'grpc=PORT metrics=PORT' here once listening (for scripts and tests)");
ABSL_FLAG(std::string, role, "single",
          "single: one process serves everything (shard_processes must be 0); coordinator: "
          "membership, tasks and the update order of a layer-sharded server (shard_processes > "
          "0); shard: shard process --shard_index of it, serving Pull/Push for its layers on "
          "--listen");
ABSL_FLAG(std::string, order_journal, "",
          "--role coordinator: append every order sent to the shard processes (which updates, "
          "with which weights, formed each version) to this file as length-delimited ShardOrder "
          "messages, plus a RESTORE whenever they (re)assemble");
ABSL_FLAG(bool, check, false,
          "Check the config and the flags as a start would (every field's range, the role's "
          "flags, the addresses a shard would advertise), print a summary and exit: 0 when they "
          "are valid, 1 naming the first problem. Opens no file but the config (corpus, "
          "certificates, checkpoints and ports are not looked at)");
ABSL_FLAG(int32_t, shard_processes, -1,
          "Override shard_processes (0: one process; N > 0: one --role coordinator and N --role "
          "shard processes, every one given the same N)");
ABSL_FLAG(int32_t, shard_index, -1, "--role shard: which shard process this is, 0-based");
ABSL_FLAG(std::string, coordinator, "",
          "--role shard: the coordinator's address (default: the config's listen_address)");
ABSL_FLAG(std::string, push_listen, "",
          "--role shard or single: also take raw pushes (the float32 payload over its own TCP "
          "connections, without gRPC's framing; 1.2-1.5x the ingest of gRPC pushes here) on this "
          "HOST:PORT (a fixed port: workers are told it). With TLS configured they use TLS 1.3 "
          "with the certificates and client certificate rule of gRPC");
ABSL_FLAG(std::string, advertise, "",
          "--role shard: the HOST:PORT workers are told to reach this shard at (default: "
          "--listen). Needed when --listen is a wildcard such as 0.0.0.0:7071 (a container, a "
          "host with several interfaces): name this host as workers dial it (and as its TLS "
          "certificate names it)");
ABSL_FLAG(std::string, advertise_push, "",
          "--role shard or single: the HOST:PORT workers are told for raw pushes (default: "
          "--push_listen)");
ABSL_FLAG(std::string, record_commits, "",
          "Testing, --role shard: append every update this process commits to this file, for "
          "aloe-replay to replay the coordinator's --order_journal in one process");
ABSL_FLAG(std::string, token_file, "",
          "--role shard: file whose first line is the token this shard presents to the "
          "coordinator (security.token_file)");

namespace aloe::server {
namespace {

std::atomic<int> g_signal{0};
void OnSignal(int sig) { g_signal.store(sig); }

LaunchFlags FromFlags() {
  LaunchFlags f;
  f.config = absl::GetFlag(FLAGS_config);
  f.role = absl::GetFlag(FLAGS_role);
  f.listen = absl::GetFlag(FLAGS_listen);
  f.metrics = absl::GetFlag(FLAGS_metrics);
  f.corpus_dir = absl::GetFlag(FLAGS_corpus_dir);
  f.max_versions = absl::GetFlag(FLAGS_max_versions);
  f.max_seconds = absl::GetFlag(FLAGS_max_seconds);
  f.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  f.insecure = absl::GetFlag(FLAGS_insecure);
  f.resume = absl::GetFlag(FLAGS_resume);
  f.summary_file = absl::GetFlag(FLAGS_summary_file);
  f.drain_seconds = absl::GetFlag(FLAGS_drain_seconds);
  f.pull_delay_ms = absl::GetFlag(FLAGS_pull_delay_ms);
  f.order_journal = absl::GetFlag(FLAGS_order_journal);
  f.shard_processes = absl::GetFlag(FLAGS_shard_processes);
  f.shard_index = absl::GetFlag(FLAGS_shard_index);
  f.coordinator = absl::GetFlag(FLAGS_coordinator);
  f.push_listen = absl::GetFlag(FLAGS_push_listen);
  f.advertise = absl::GetFlag(FLAGS_advertise);
  f.advertise_push = absl::GetFlag(FLAGS_advertise_push);
  f.token_file = absl::GetFlag(FLAGS_token_file);
  f.record_commits = absl::GetFlag(FLAGS_record_commits);
  return f;
}

// Starts `role`, runs it until its job is over or SIGINT/SIGTERM, then shuts it down; a second
// signal cuts the drain short.
absl::Status RunRole(ServerRole& role) {
  ALOE_RETURN_IF_ERROR(role.Start());
  if (const std::string path = absl::GetFlag(FLAGS_port_file); !path.empty()) {
    ALOE_RETURN_IF_ERROR(WritePortFile(path, role.grpc_port(), role.metrics_port()));
  }
  signal(SIGINT, OnSignal);
  signal(SIGTERM, OnSignal);
  while (g_signal.load() == 0 && !role.finished()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const int first = g_signal.exchange(0);
  return role.Shutdown(first != 0 ? absl::StrCat("signal ", first) : "shutdown",
                       [] { return g_signal.load() != 0; });
}

absl::Status Run() {
  const LaunchFlags flags = FromFlags();
  ALOE_ASSIGN_OR_RETURN(v1::ServerConfig config, LaunchConfig(flags));
  if (absl::GetFlag(FLAGS_check)) {
    absl::PrintF("%s", CheckSummary(flags, config));
    return absl::OkStatus();
  }
  if (flags.role == "shard") {
    ShardProcess shard(ShardProcessOptions(flags, config));
    return RunRole(shard);
  }
  if (flags.role == "coordinator") {
    CoordinatorServer coordinator(CoordinatorOptions(flags, config));
    return RunRole(coordinator);
  }
  SingleProcessServer server(SingleProcessOptions(flags, config));
  return RunRole(server);
}

}  // namespace
}  // namespace aloe::server

int main(int argc, char** argv) {
  // Pushed updates and pulled snapshots are megabytes each: reuse heap memory instead of
  // page-faulting fresh buffers for every one (may re-execute the program once).
  aloe::KeepLargeBuffersInHeap(argv, /*arena_max=*/1);  // see common/allocator.h
  // Debian's abseil is built without NDEBUG, so every absl::Mutex lock would run deadlock
  // detection (a lock-order graph update); the tests keep it, the daemons skip the cost.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  aloe::SetUsage(
      "aloe-server --config FILE [flags]\n"
      "Parameter server for asynchronous Local-SGD (DiLoCo) training: holds the global model and\n"
      "the outer optimizer, assigns tasks to aloe-worker daemons over gRPC and exposes\n"
      "Prometheus metrics. Runs until max_versions/max_seconds are reached and every worker has\n"
      "left, or until SIGINT/SIGTERM.");
  absl::ParseCommandLine(argc, argv);
  absl::Status status = aloe::server::Run();
  if (!status.ok()) {
    ALOE_LOG_ERROR("server", "%s", status.ToString());
    return 1;
  }
  return 0;
}
