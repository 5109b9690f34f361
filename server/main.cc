// aloe-server: holds the global model and the outer optimizer, assigns tasks to workers, and
// serves the Coordinator and ParameterService gRPC APIs plus a Prometheus /metrics endpoint.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/allocator.h"
#include "common/clock.h"
#include "common/config.h"
#include "common/corpus_manifest.h"
#include "common/executor.h"
#include "common/flags_usage.h"
#include "common/imported_model.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/status_macros.h"
#include "server/core/checkpoint_store.h"
#include "server/core/order_journal.h"
#include "server/core/server_core.h"
#include "server/core/server_metrics.h"
#include "server/core/shard_assembly.h"
#include "server/core/shard_state.h"
#include "server/reshard.h"
#include "server/service/auth.h"
#include "server/service/checkpoint_copies.h"
#include "server/service/core_handle.h"
#include "server/service/grpc_services.h"
#include "server/service/raw_push_listener.h"
#include "server/service/shard_control.h"
#include "server/service/shard_service.h"

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
ABSL_FLAG(std::string, reshard_from, "",
          "Convert the newest checkpoint in this directory (of one process, or of a coordinator "
          "with the shard-<i> directories of its shard processes copied beside it) to the layout "
          "of this config and --shard_processes, write it to checkpoint.dir (a new or empty "
          "directory; --checkpoint_dir) and exit. Then start the server there with --resume");
ABSL_FLAG(int32_t, shard_processes, -1,
          "Override shard_processes (0: one process; N > 0: one --role coordinator and N --role "
          "shard processes, every one given the same N)");
ABSL_FLAG(int32_t, shard_index, -1, "--role shard: which shard process this is, 0-based");
ABSL_FLAG(std::string, coordinator, "",
          "--role shard: the coordinator's address (default: the config's listen_address)");
ABSL_FLAG(std::string, push_listen, "",
          "--role shard or single: also take raw pushes (the float32 payload over plain TCP, "
          "without gRPC's framing; 1.2-1.5x the ingest of gRPC pushes here) on this HOST:PORT (a "
          "fixed port: workers are told it). Refused with TLS: raw pushes are not encrypted");
ABSL_FLAG(std::string, advertise, "",
          "--role shard: the HOST:PORT workers are told to reach this shard at (default: "
          "--listen). Needed when --listen is a wildcard such as 0.0.0.0:7071 (a container, a "
          "host with several interfaces): name this host as workers dial it (and as its TLS "
          "certificate names it)");
ABSL_FLAG(std::string, advertise_push, "",
          "--role shard or single: the HOST:PORT workers are told for raw pushes (default: "
          "--push_listen)");
ABSL_FLAG(std::string, token_file, "",
          "--role shard: file whose first line is the token this shard presents to the "
          "coordinator (security.token_file)");

namespace aloe::server {
namespace {

std::atomic<int> g_signal{0};
void OnSignal(int sig) { g_signal.store(sig); }

// The address a shard tells workers (`flag`, default the one it listens on): one they can dial,
// so neither a wildcard host nor port 0.
absl::Status CheckAdvertised(const char* flag, const char* listen_flag, const std::string& given,
                             const std::string& listen) {
  const std::string address = given.empty() ? listen : given;
  const size_t colon = address.rfind(':');
  const std::string host = colon == std::string::npos ? "" : address.substr(0, colon);
  const std::string port = colon == std::string::npos ? "" : address.substr(colon + 1);
  if (host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]" || host == "*") {
    if (given.empty()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s %s listens on every interface, and workers cannot dial that address: pass %s "
          "HOST:PORT, the name or address of this host as workers reach it",
          listen_flag, listen, flag));
    }
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s %s is not an address workers can dial (give this host's name or address and the "
        "port)",
        flag, address));
  }
  int number = 0;
  if (!absl::SimpleAtoi(port, &number) || number <= 0 || number > 65535) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s %s needs HOST:PORT with a port in [1, 65535]", flag, address));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ServerConfig> ConfigFromFlags() {
  const std::string path = absl::GetFlag(FLAGS_config);
  if (path.empty()) return absl::InvalidArgumentError("--config is required (see --help)");
  ALOE_ASSIGN_OR_RETURN(v1::ServerConfig config, LoadServerConfig(path));
  // A shard listens on --listen; listen_address stays the coordinator's.
  if (!absl::GetFlag(FLAGS_listen).empty() && absl::GetFlag(FLAGS_role) != "shard") {
    config.set_listen_address(absl::GetFlag(FLAGS_listen));
  }
  if (!absl::GetFlag(FLAGS_metrics).empty()) {
    config.set_metrics_address(absl::GetFlag(FLAGS_metrics));
  } else if (absl::GetFlag(FLAGS_role) == "shard") {
    config.set_metrics_address("off");  // the config's address is the coordinator's
  }
  if (!absl::GetFlag(FLAGS_corpus_dir).empty()) {
    config.set_corpus_dir(absl::GetFlag(FLAGS_corpus_dir));
  }
  if (absl::GetFlag(FLAGS_max_versions) >= 0) {
    config.set_max_versions(absl::GetFlag(FLAGS_max_versions));
  }
  if (absl::GetFlag(FLAGS_max_seconds) >= 0)
    config.set_max_seconds(absl::GetFlag(FLAGS_max_seconds));
  if (!absl::GetFlag(FLAGS_checkpoint_dir).empty()) {
    config.mutable_checkpoint()->set_dir(absl::GetFlag(FLAGS_checkpoint_dir));
  }
  if (const int32_t n = absl::GetFlag(FLAGS_shard_processes); n != -1) {
    if (n < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--shard_processes must be >= 0, got %d", n));
    }
    config.set_shard_processes(static_cast<uint32_t>(n));
  }
  if (absl::GetFlag(FLAGS_insecure)) config.mutable_security()->set_insecure(true);
  const double drain = absl::GetFlag(FLAGS_drain_seconds);
  if (!(drain >= 0) || !std::isfinite(drain)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--drain_seconds must be a finite number >= 0, got %g", drain));
  }
  if (absl::GetFlag(FLAGS_resume) && config.checkpoint().dir().empty()) {
    return absl::InvalidArgumentError("--resume needs checkpoint.dir (or --checkpoint_dir)");
  }
  ALOE_RETURN_IF_ERROR(ValidateServerConfig(config));
  const std::string role = absl::GetFlag(FLAGS_role);
  if (role != "single" && role != "coordinator" && role != "shard") {
    return absl::InvalidArgumentError(
        absl::StrCat("--role must be single, coordinator or shard, got \"", role, "\""));
  }
  const bool reshard = !absl::GetFlag(FLAGS_reshard_from).empty();
  if (reshard && role == "shard") {
    return absl::InvalidArgumentError(
        "--reshard_from converts the whole server's checkpoint: run it without --role shard");
  }
  if (role == "single" && config.shard_processes() > 0 && !reshard) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the config has shard_processes %d: start one --role coordinator and %d --role shard "
        "processes (or set shard_processes 0 for one process)",
        config.shard_processes(), config.shard_processes()));
  }
  if (role != "single" && config.shard_processes() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--role ", role, " needs shard_processes > 0 in the config"));
  }
  if (!absl::GetFlag(FLAGS_order_journal).empty() && role != "coordinator") {
    return absl::InvalidArgumentError("--order_journal is for --role coordinator only");
  }
  if (const std::string push = absl::GetFlag(FLAGS_push_listen); !push.empty()) {
    if (role == "coordinator") {
      return absl::InvalidArgumentError(
          "--push_listen is for --role shard or single (a coordinator takes no pushes)");
    }
    if (push.rfind(':') == std::string::npos || push.substr(push.rfind(':') + 1) == "0") {
      return absl::InvalidArgumentError(
          "--push_listen needs HOST:PORT with a fixed port (workers are told it)");
    }
    if (!config.security().tls_cert_file().empty()) {
      return absl::InvalidArgumentError(
          "--push_listen with TLS configured (security.tls_cert_file): raw pushes are not "
          "encrypted; leave --push_listen off to keep every push on TLS");
    }
  }
  if (role == "shard") {
    const int32_t index = absl::GetFlag(FLAGS_shard_index);
    if (index < 0 || static_cast<uint32_t>(index) >= config.shard_processes()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--role shard needs --shard_index in [0, %d), got %d", config.shard_processes(), index));
    }
    const std::string listen = absl::GetFlag(FLAGS_listen);
    if (listen.empty() || listen.substr(listen.rfind(':') + 1) == "0") {
      return absl::InvalidArgumentError(
          "--role shard needs --listen with a fixed port (its own address, which workers are "
          "told; listen_address is the coordinator's)");
    }
    ALOE_RETURN_IF_ERROR(
        CheckAdvertised("--advertise", "--listen", absl::GetFlag(FLAGS_advertise), listen));
  } else if (!absl::GetFlag(FLAGS_advertise).empty()) {
    return absl::InvalidArgumentError("--advertise is for --role shard only");
  }
  if (!absl::GetFlag(FLAGS_advertise_push).empty() && absl::GetFlag(FLAGS_push_listen).empty()) {
    return absl::InvalidArgumentError("--advertise_push needs --push_listen");
  }
  if (!absl::GetFlag(FLAGS_push_listen).empty()) {
    ALOE_RETURN_IF_ERROR(CheckAdvertised("--advertise_push", "--push_listen",
                                         absl::GetFlag(FLAGS_advertise_push),
                                         absl::GetFlag(FLAGS_push_listen)));
  }
  return config;
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& what, const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(what, " ", path, ": cannot open"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

bool IsLoopback(const std::string& address) {
  const std::string host = address.substr(0, address.rfind(':'));
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "[::1]" || host == "::1";
}

// TLS (optionally mutual) when configured, else plaintext. A non-loopback address needs TLS and
// a token file unless security.insecure is set.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const v1::ServerConfig& config, const std::string& listen_address) {
  const v1::SecurityConfig& security = config.security();
  const bool tls = !security.tls_cert_file().empty();
  if (!IsLoopback(listen_address) && !security.insecure() &&
      (!tls || security.token_file().empty())) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "refusing to listen on non-loopback address %s without TLS (security.tls_cert_file) "
        "and a token file (security.token_file); pass --insecure to do it anyway",
        listen_address));
  }
  if (!tls) return grpc::InsecureServerCredentials();
  if (security.tls_key_file().empty()) {
    return absl::InvalidArgumentError("security.tls_key_file is required with tls_cert_file");
  }
  grpc::SslServerCredentialsOptions options;
  ALOE_ASSIGN_OR_RETURN(std::string cert,
                        ReadWholeFile("TLS certificate", security.tls_cert_file()));
  ALOE_ASSIGN_OR_RETURN(std::string key, ReadWholeFile("TLS key", security.tls_key_file()));
  options.pem_key_cert_pairs.push_back({key, cert});
  if (!security.tls_client_ca_file().empty()) {
    ALOE_ASSIGN_OR_RETURN(options.pem_root_certs,
                          ReadWholeFile("TLS client CA", security.tls_client_ca_file()));
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

// The raw push listener of --push_listen serving `handler`, or null without the flag. Plaintext,
// as gRPC without TLS: the same rule for non-loopback addresses.
absl::StatusOr<std::unique_ptr<RawPushListener>> StartRawPushes(const v1::ServerConfig& config,
                                                                RawPushListener::Handler handler) {
  const std::string push_listen = absl::GetFlag(FLAGS_push_listen);
  if (push_listen.empty()) return nullptr;
  if (!IsLoopback(push_listen) && !config.security().insecure()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "refusing raw pushes on non-loopback address %s: they are not encrypted; pass "
        "--insecure (security.insecure) on a trusted network",
        push_listen));
  }
  return RawPushListener::Start(push_listen, std::move(handler), RawPushListener::Options());
}

// Where workers are told to send raw pushes: --advertise_push, else --push_listen ("" = none).
std::string AdvertisedPushAddress() {
  return absl::GetFlag(FLAGS_advertise_push).empty() ? absl::GetFlag(FLAGS_push_listen)
                                                     : absl::GetFlag(FLAGS_advertise_push);
}

absl::Status WritePortFile(const std::string& path, int grpc_port, int metrics_port) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << "grpc=" << grpc_port << " metrics=" << metrics_port << "\n";
    if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

// Writes one checkpoint and records it in the metrics. Logs and carries on when the disk fails:
// training continues, the next checkpoint tries again.
void WriteCheckpoint(CheckpointStore& store, const v1::ServerCheckpoint& checkpoint,
                     MetricsSink& metrics) {
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> path = store.Write(checkpoint);
  if (!path.ok()) {
    ALOE_LOG_ERROR("server", "checkpoint of version %d failed: %s", checkpoint.version(),
                   path.status().message());
    return;
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  metrics.Observe(kCheckpointSeconds, seconds);
  metrics.Set(kCheckpointTimestamp, absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
  metrics.Set(kCheckpointVersion, static_cast<double>(checkpoint.version()));
  ALOE_LOG_INFO("server", "checkpoint of version %d written to %s (%.1f MB, %.0f ms)",
                checkpoint.version(), *path, checkpoint.ByteSizeLong() / 1e6, seconds * 1e3);
}

// Graceful shutdown after SIGTERM/SIGINT: no new work is handed out (workers see WAIT with
// draining set), while tasks already handed out may still push or report — each push is
// applied as usual — for up to --drain_seconds, or until a second signal. Periodic checkpoints
// that fall due meanwhile are written; the caller writes the final one.
void Drain(CoreHandle& handle, CheckpointStore* checkpoints, MetricsSink& metrics) {
  const int first_signal = g_signal.exchange(0);
  const absl::Time deadline = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_drain_seconds));
  size_t open = handle.Run([](ServerCore& core) {
    core.BeginDrain();
    return core.open_tasks();
  });
  ALOE_LOG_INFO("server",
                "signal %d: draining: no new work; waiting up to %.0f s for %d open "
                "task(s)",
                first_signal, absl::GetFlag(FLAGS_drain_seconds), open);
  while (open > 0 && absl::Now() < deadline && g_signal.load() == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    std::vector<v1::ServerCheckpoint> due;
    open = handle.Run([&](ServerCore& core) {
      core.Tick();
      due = core.TakeDueCheckpoints();
      return core.open_tasks();
    });
    for (const v1::ServerCheckpoint& c : due) {
      if (checkpoints) WriteCheckpoint(*checkpoints, c, metrics);
    }
  }
  if (open == 0) {
    ALOE_LOG_INFO("server", "drained: every open task finished");
  } else {
    ALOE_LOG_WARNING("server", "drain %s with %d task(s) still open: their work is lost",
                     g_signal.load() != 0 ? "cut short by a second signal" : "timed out", open);
  }
}

// The Prometheus endpoint of config.metrics_address (or none for "off"); *port its port.
absl::StatusOr<std::unique_ptr<MetricsSink>> StartMetrics(const v1::ServerConfig& config,
                                                          int* port) {
  *port = 0;
  if (config.metrics_address() == "off") return std::make_unique<NullMetrics>();
  ALOE_ASSIGN_OR_RETURN(
      auto prometheus, PrometheusMetrics::Start(config.metrics_address(), ServerMetricCatalogue()));
  *port = prometheus->port();
  // The payload counters have a series per codec from the start, at 0: a series born with its
  // first push's bytes in it would hide them from rate() (and put the shards' raw share, raw
  // bytes over received bytes, above 1 for a minute).
  for (const v1::Codec codec : {v1::CODEC_FP32, v1::CODEC_BF16, v1::CODEC_INT8_BLOCKWISE}) {
    prometheus->Add(kReceivedBytes, 0, {CodecLabel(codec)});
    prometheus->Add(kSentBytes, 0, {CodecLabel(codec)});
  }
  return prometheus;
}

// Builds, registers and starts the gRPC server on `address` (receive windows of
// receive_window_kib); *port is the port bound.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpc(
    const std::string& address, std::shared_ptr<grpc::ServerCredentials> credentials,
    const std::vector<grpc::Service*>& services, uint32_t receive_window_kib, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, credentials, port);
  // Chunks are <= 1 MiB; anything much larger is hostile or broken.
  builder.SetMaxReceiveMessageSize(2 << 20);
  // Fixed receive windows instead of gRPC's BDP-probed ones (see receive_window_kib).
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES,
                             static_cast<int>(receive_window_kib << 10));
  for (grpc::Service* service : services) builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address, " (address in use?)"));
  }
  return server;
}

// The coordinator's newest copy of shard `index`'s checkpoints, for a shard that has none of its
// own; nullopt when the coordinator keeps none. Waits up to a minute for a coordinator that is
// not up yet (they may start together).
absl::StatusOr<std::optional<v1::ShardCheckpoint>> FetchCopyAtStart(
    v1::ShardControl::Stub& coordinator, const std::string& token, uint32_t index) {
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (true) {
    absl::StatusOr<v1::ShardCheckpoint> copy = FetchCheckpointCopy(coordinator, token, index);
    if (copy.ok()) return std::optional<v1::ShardCheckpoint>(*std::move(copy));
    if (copy.status().code() == absl::StatusCode::kNotFound) {
      ALOE_LOG_WARNING("shard", "shard %d: the coordinator has no copy either: %s", index,
                       copy.status().message());
      return std::optional<v1::ShardCheckpoint>();
    }
    if (copy.status().code() != absl::StatusCode::kUnavailable || absl::Now() > give_up ||
        g_signal.load() != 0) {
      return absl::Status(copy.status().code(),
                          absl::StrCat("fetching the coordinator's copy of shard ", index,
                                       "'s checkpoints: ", copy.status().message()));
    }
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
}

// --role shard: one shard process of a layer-sharded server.
absl::Status RunShard(const v1::ServerConfig& config) {
  const uint32_t index = static_cast<uint32_t>(absl::GetFlag(FLAGS_shard_index));
  const std::string listen = absl::GetFlag(FLAGS_listen);
  const std::string coordinator = absl::GetFlag(FLAGS_coordinator).empty()
                                      ? config.listen_address()
                                      : absl::GetFlag(FLAGS_coordinator);
  // Only this process's layers are built: a shard never holds the whole model.
  ALOE_ASSIGN_OR_RETURN(ServerModel model, LoadServerModel(config, index));
  const v1::ModelSpec spec = model.spec;
  const std::string fingerprint = ShardedModelFingerprint(config, spec, model.fingerprint);
  ThreadPoolExecutor executor(static_cast<int>(config.apply_threads()) - 1);
  auto make_state =
      [&](std::vector<std::vector<float>> initial) -> absl::StatusOr<std::unique_ptr<ShardState>> {
    ALOE_ASSIGN_OR_RETURN(
        std::unique_ptr<ShardState> state,
        ShardState::Create(spec, index, std::move(initial), config.outer_optimizer(),
                           config.apply_threads(), config.max_staged_updates(), executor));
    if (config.penalty().enabled()) ALOE_RETURN_IF_ERROR(state->EnablePenalty(config.penalty()));
    return state;
  };
  ALOE_ASSIGN_OR_RETURN(std::unique_ptr<ShardState> state, make_state(std::move(model.initial)));
  uint64_t params = 0;
  for (uint32_t l : state->owned_layers()) params += spec.layers(l).num_elements();
  std::unique_ptr<CheckpointStore> checkpoints;
  if (!config.checkpoint().dir().empty()) {
    checkpoints = std::make_unique<CheckpointStore>(
        absl::StrFormat("%s/shard-%d", config.checkpoint().dir(), index),
        config.checkpoint().keep());
  }
  int metrics_port = 0;
  ALOE_ASSIGN_OR_RETURN(std::unique_ptr<MetricsSink> metrics, StartMetrics(config, &metrics_port));
  std::unique_ptr<Authenticator> auth = std::make_unique<Authenticator>();
  if (!config.security().token_file().empty()) {
    ALOE_ASSIGN_OR_RETURN(auth, Authenticator::FromTokenFile(config.security().token_file()));
  }
  ALOE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                        ServerCredentials(config, listen));
  std::shared_ptr<grpc::ChannelCredentials> channel_credentials =
      grpc::InsecureChannelCredentials();
  if (!config.security().tls_cert_file().empty()) {
    // The coordinator presents the same certificate chain (one config for every process).
    grpc::SslCredentialsOptions ssl;
    ALOE_ASSIGN_OR_RETURN(ssl.pem_root_certs,
                          ReadWholeFile("TLS certificate", config.security().tls_cert_file()));
    if (!config.security().tls_client_ca_file().empty()) {
      // Mutual TLS: the coordinator asks this shard for a client certificate too, and gets the
      // shard's own (so it must be issued by tls_client_ca_file's CA, as the workers' are).
      ssl.pem_cert_chain = ssl.pem_root_certs;
      ALOE_ASSIGN_OR_RETURN(ssl.pem_private_key,
                            ReadWholeFile("TLS key", config.security().tls_key_file()));
    }
    channel_credentials = grpc::SslCredentials(ssl);
  }
  ShardServer::Options options;
  options.shard_index = index;
  options.fingerprint = fingerprint;
  options.coordinator = grpc::CreateChannel(coordinator, channel_credentials);
  if (!absl::GetFlag(FLAGS_token_file).empty()) {
    ALOE_ASSIGN_OR_RETURN(std::string token,
                          ReadWholeFile("--token_file", absl::GetFlag(FLAGS_token_file)));
    options.token = token.substr(0, token.find('\n'));
  }
  // checkpoint.replicate_shards: the coordinator keeps a copy of every checkpoint written here.
  std::unique_ptr<v1::ShardControl::Stub> copies_stub;
  std::unique_ptr<CheckpointUploader> uploader;
  if (config.checkpoint().replicate_shards()) {
    copies_stub = v1::ShardControl::NewStub(options.coordinator);
    uploader = std::make_unique<CheckpointUploader>(*copies_stub, options.token);
  }
  if (absl::GetFlag(FLAGS_resume)) {
    auto loaded = checkpoints->LoadLatest<v1::ShardCheckpoint>();
    if (loaded.status().code() == absl::StatusCode::kNotFound && copies_stub != nullptr) {
      // None of its own (a new host or disk): the coordinator's newest copy, if it has one.
      ALOE_ASSIGN_OR_RETURN(std::optional<v1::ShardCheckpoint> copy,
                            FetchCopyAtStart(*copies_stub, options.token, index));
      if (copy.has_value()) {
        ALOE_ASSIGN_OR_RETURN(std::string path, checkpoints->Write(*copy));
        ALOE_LOG_INFO("shard",
                      "shard %d has no checkpoint of its own: fetched the coordinator's copy of "
                      "version %d into %s",
                      index, copy->version(), path);
        loaded = checkpoints->LoadLatest<v1::ShardCheckpoint>();
      }
    }
    if (loaded.status().code() == absl::StatusCode::kNotFound) {
      ALOE_LOG_WARNING("shard", "--resume: %s; starting from the initial model",
                       loaded.status().message());
    } else {
      ALOE_RETURN_IF_ERROR(loaded.status());
      ALOE_RETURN_IF_ERROR(state->Restore(loaded->checkpoint, fingerprint));
      ALOE_LOG_INFO("shard", "resumed from %s (version %d)", loaded->path, state->version());
    }
  }
  options.checkpoints = checkpoints.get();
  options.every_versions = config.checkpoint().every_versions();
  options.uploader = uploader.get();
  options.max_staged = config.max_staged_updates();
  options.admit_locally = config.shard_processes() == 1;
  options.make_initial = [&]() -> absl::StatusOr<std::unique_ptr<ShardState>> {
    ALOE_ASSIGN_OR_RETURN(ServerModel fresh, LoadServerModel(config, index));
    return make_state(std::move(fresh.initial));
  };
  // Told to the coordinator, and by it to the workers.
  options.address =
      absl::GetFlag(FLAGS_advertise).empty() ? listen : absl::GetFlag(FLAGS_advertise);
  options.push_address = AdvertisedPushAddress();
  const std::string push_listen = absl::GetFlag(FLAGS_push_listen);
  const size_t owned_layers = state->owned_layers().size();
  auto shard = std::make_unique<ShardServer>(spec, std::move(state), options, *auth, *metrics);
  int grpc_port = 0;
  ALOE_ASSIGN_OR_RETURN(
      std::unique_ptr<grpc::Server> server,
      StartGrpc(listen, credentials, {shard.get()}, config.receive_window_kib(), &grpc_port));
  ALOE_ASSIGN_OR_RETURN(
      std::unique_ptr<RawPushListener> raw_pushes,
      StartRawPushes(config, [&shard](const RawPushRequest& request, ByteReader& in,
                                      const std::function<bool()>& cancelled) {
        return shard->ServeRawPush(request, in, cancelled);
      }));
  ALOE_LOG_INFO("shard",
                "shard %d of %d listening on %s%s%s (metrics port %d): %d layers, %d parameters; "
                "following the coordinator at %s",
                index, config.shard_processes(), listen,
                options.address == listen ? "" : absl::StrCat(" as ", options.address).c_str(),
                push_listen.empty() ? ""
                                    : absl::StrCat(", raw pushes on ", push_listen,
                                                   options.push_address == push_listen
                                                       ? ""
                                                       : absl::StrCat(" as ", options.push_address))
                                          .c_str(),
                metrics_port, owned_layers, params, coordinator);
  if (!absl::GetFlag(FLAGS_port_file).empty()) {
    ALOE_RETURN_IF_ERROR(WritePortFile(absl::GetFlag(FLAGS_port_file), grpc_port, metrics_port));
  }
  signal(SIGINT, OnSignal);
  signal(SIGTERM, OnSignal);
  std::atomic<bool> stop{false};
  std::atomic<bool> ended{false};  // the job is over, or the coordinator refuses this shard
  absl::Status followed;
  std::thread follow([&] {
    followed = shard->RunFollowLoop(stop);
    ended.store(true);
  });
  while (g_signal.load() == 0 && !ended.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  stop.store(true);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (raw_pushes != nullptr) raw_pushes->Shutdown();
  follow.join();
  shard->WriteFinalCheckpoint();
  if (uploader != nullptr && !uploader->Flush(absl::Seconds(30))) {
    ALOE_LOG_WARNING("shard", "shard %d: the last checkpoint's copy did not reach the coordinator",
                     index);
  }
  ALOE_RETURN_IF_ERROR(followed);
  ALOE_LOG_INFO("shard",
                "summary: shard %d at version %d, %.1f MB of pushes received (%.1f MB raw); "
                "%d of %d layer updates copied (an older version was held)",
                index, shard->version(), shard->received_bytes() / 1e6,
                shard->raw_push_bytes() / 1e6, shard->copied_layer_steps(), shard->layer_steps());
  if (g_signal.load() != 0) {
    ALOE_LOG_INFO("shard", "signal %d: shard %d stops at version %d", g_signal.load(), index,
                  shard->version());
  } else {
    ALOE_LOG_INFO("shard", "the job is over: shard %d stops at version %d", index,
                  shard->version());
  }
  return absl::OkStatus();
}

absl::Status Run() {
  ALOE_ASSIGN_OR_RETURN(v1::ServerConfig config, ConfigFromFlags());
  if (absl::GetFlag(FLAGS_check)) {
    const std::string role = absl::GetFlag(FLAGS_role);
    absl::PrintF(
        "aloe-server --check: %s is valid for --role %s%s: model %s; outer %s; aggregation %s; "
        "%s\n",
        absl::GetFlag(FLAGS_config), role,
        role == "shard" ? absl::StrFormat(" (shard %d of %d)", absl::GetFlag(FLAGS_shard_index),
                                          config.shard_processes())
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
    return absl::OkStatus();
  }
  if (absl::GetFlag(FLAGS_role) == "shard") return RunShard(config);
  ALOE_ASSIGN_OR_RETURN(std::vector<CorpusShardInfo> corpus,
                        LoadCorpusManifest(config.corpus_dir()));
  std::vector<DataShard> train;
  std::string heldout_file;
  for (const CorpusShardInfo& shard : corpus) {
    if (shard.heldout) {
      if (heldout_file.empty()) heldout_file = shard.file;
    } else {
      train.push_back(DataShard{shard.name, shard.file, shard.tokens});
    }
  }

  if (heldout_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(config.corpus_dir(), "/manifest.tsv has no heldout shard"));
  }
  if (!absl::GetFlag(FLAGS_reshard_from).empty()) {
    return Reshard(config, absl::GetFlag(FLAGS_reshard_from), train, heldout_file);
  }
  const size_t num_train_shards = train.size();
  RealClock clock;
  ThreadPoolExecutor executor(static_cast<int>(config.apply_threads()) - 1);
  int metrics_port = 0;
  ALOE_ASSIGN_OR_RETURN(std::unique_ptr<MetricsSink> metrics, StartMetrics(config, &metrics_port));
  ALOE_ASSIGN_OR_RETURN(auto core,
                        ServerCore::Create(config, train, heldout_file, clock, executor, *metrics));
  std::unique_ptr<CheckpointStore> checkpoints;
  if (!config.checkpoint().dir().empty()) {
    checkpoints =
        std::make_unique<CheckpointStore>(config.checkpoint().dir(), config.checkpoint().keep());
  }
  if (absl::GetFlag(FLAGS_resume)) {
    absl::StatusOr<CheckpointStore::Loaded> loaded = checkpoints->LoadLatest();
    if (loaded.status().code() == absl::StatusCode::kNotFound) {
      ALOE_LOG_WARNING("server", "--resume: %s; starting from the initial model",
                       loaded.status().message());
    } else {
      ALOE_RETURN_IF_ERROR(loaded.status());
      ALOE_RETURN_IF_ERROR(core->RestoreCheckpoint(loaded->checkpoint));
      core->SkipWorkerIdsOfLostProcess();
      ALOE_LOG_INFO("server", "resumed at version %d (%d updates applied, %.1f s trained) from %s",
                    core->version(), core->updates_applied(), loaded->checkpoint.trained_seconds(),
                    loaded->path);
    }
  }
  const v1::ModelSpec spec = core->spec();
  const std::string model_fingerprint = core->model_fingerprint();
  uint64_t params = 0;
  for (const auto& layer : spec.layers()) params += layer.num_elements();

  std::unique_ptr<Authenticator> auth = std::make_unique<Authenticator>();
  if (!config.security().token_file().empty()) {
    ALOE_ASSIGN_OR_RETURN(auth, Authenticator::FromTokenFile(config.security().token_file()));
  }
  ALOE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                        ServerCredentials(config, config.listen_address()));
  CoreHandle handle(std::move(core));
  CoordinatorService coordinator(
      handle, *auth, config.shard_processes() > 0 ? config.security().shard_identity() : "");
  const double pull_delay_ms = absl::GetFlag(FLAGS_pull_delay_ms);
  if (!(pull_delay_ms >= 0) || pull_delay_ms > 600000) {
    return absl::InvalidArgumentError("--pull_delay_ms must be in [0, 600000]");
  }
  ParameterServiceImpl parameters(handle, *auth, *metrics, clock, config.max_staged_updates(),
                                  absl::Milliseconds(pull_delay_ms));
  std::vector<grpc::Service*> services = {&coordinator};
  std::unique_ptr<OrderJournal> journal;
  std::unique_ptr<ShardControlService> shard_control;
  std::unique_ptr<RawPushListener> raw_pushes;
  if (config.shard_processes() == 0) {
    services.push_back(&parameters);
    ALOE_ASSIGN_OR_RETURN(
        raw_pushes,
        StartRawPushes(config, [&parameters](const RawPushRequest& request, ByteReader& in,
                                             const std::function<bool()>& cancelled) {
          return parameters.ServeRawPush(request, in, cancelled);
        }));
    handle.Run([](ServerCore& core) { core.SetPushAddress(AdvertisedPushAddress()); });
  } else {
    // Workers pull and push at the shard processes; the shards follow this coordinator.
    ShardControlService::Options options;
    options.shard_processes = config.shard_processes();
    options.fingerprint = ShardedModelFingerprint(config, spec, model_fingerprint);
    options.shard_identity = config.security().shard_identity();
    if (config.checkpoint().replicate_shards()) {
      options.replica_dir = config.checkpoint().dir() + "/replicas";
      options.keep = config.checkpoint().keep();
      options.metrics = metrics.get();
    }
    if (auth->enabled() && !auth->HasIdentity(options.shard_identity)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "security.token_file %s has no token of identity \"%s\" (security.shard_identity): "
          "the shard processes could not follow this coordinator; add a line \"%s TOKEN\" and "
          "give the shards that token (--token_file)",
          config.security().token_file(), options.shard_identity, options.shard_identity));
    }
    if (!absl::GetFlag(FLAGS_order_journal).empty()) {
      ALOE_ASSIGN_OR_RETURN(journal, OrderJournal::Open(absl::GetFlag(FLAGS_order_journal)));
      options.journal = journal.get();
    }
    options.coordinator_versions = [&]() {
      std::vector<uint64_t> versions;
      if (checkpoints) versions = checkpoints->Versions();
      versions.push_back(handle.Run([](ServerCore& core) { return core.version(); }));
      return versions;
    };
    options.restore = [&](uint64_t version) -> absl::Status {
      // A new core at `version`: the current state, a checkpoint or the initial model. Its
      // workers are forgotten (they join again): their tasks may start from versions undone.
      std::optional<v1::ServerCheckpoint> from;
      const uint64_t current = handle.Run([](ServerCore& core) { return core.version(); });
      if (version == current) {
        from = handle.Run([](ServerCore& core) { return core.CaptureCheckpoint(); });
      } else if (version > 0) {
        ALOE_ASSIGN_OR_RETURN(from, CheckpointStore::ReadFile(checkpoints->PathOf(version)));
      }
      ALOE_ASSIGN_OR_RETURN(
          auto fresh, ServerCore::Create(config, train, heldout_file, clock, executor, *metrics));
      if (from) ALOE_RETURN_IF_ERROR(fresh->RestoreCheckpoint(*from));
      handle.Replace(std::move(fresh));
      ALOE_LOG_INFO("coordinator", "restored version %d; workers join again", version);
      return absl::OkStatus();
    };
    shard_control = std::make_unique<ShardControlService>(handle, *auth, std::move(options));
    services.push_back(shard_control.get());
  }
  int grpc_port = 0;
  ALOE_ASSIGN_OR_RETURN(std::unique_ptr<grpc::Server> server,
                        StartGrpc(config.listen_address(), credentials, services,
                                  config.receive_window_kib(), &grpc_port));
  ALOE_LOG_INFO("server", "security: %s, %s, %s",
                config.security().tls_cert_file().empty() ? "plaintext" : "TLS",
                config.security().tls_client_ca_file().empty() ? "no client certificates"
                                                               : "client certificates required",
                auth->enabled() ? "token auth" : "no token auth");
  ALOE_LOG_INFO("server",
                "listening on %s (grpc port %d, metrics port %d); model %d layers, %d parameters "
                "in %d shards; %d training shards; outer %s lr %g momentum %g; H=%d",
                config.listen_address(), grpc_port, metrics_port, spec.layers_size(), params,
                spec.num_shards(), num_train_shards,
                v1::OuterOptimizerType_Name(config.outer_optimizer().type()),
                config.outer_optimizer().lr(), config.outer_optimizer().momentum(),
                config.local_steps());
  if (raw_pushes != nullptr) {
    ALOE_LOG_INFO("server", "raw pushes on %s%s", absl::GetFlag(FLAGS_push_listen),
                  AdvertisedPushAddress() == absl::GetFlag(FLAGS_push_listen)
                      ? ""
                      : absl::StrCat(" as ", AdvertisedPushAddress()).c_str());
  }
  if (!absl::GetFlag(FLAGS_port_file).empty()) {
    ALOE_RETURN_IF_ERROR(WritePortFile(absl::GetFlag(FLAGS_port_file), grpc_port, metrics_port));
  }

  signal(SIGINT, OnSignal);
  signal(SIGTERM, OnSignal);
  bool finished = false;
  while (g_signal.load() == 0) {
    std::vector<v1::ServerCheckpoint> due;
    finished = handle.Run([&](ServerCore& core) {
      core.Tick();
      due = core.TakeDueCheckpoints();
      return core.Finished();
    });
    // Written outside the core lock: training goes on meanwhile.
    for (const v1::ServerCheckpoint& c : due) {
      if (checkpoints) WriteCheckpoint(*checkpoints, c, *metrics);
    }
    if (finished) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (!finished) {
    Drain(handle, checkpoints.get(), *metrics);
  } else if (shard_control != nullptr) {
    // The shard processes end with the job (not on a signal: a restarted coordinator resumes).
    const uint64_t version = handle.Run([](ServerCore& core) { return core.version(); });
    const uint32_t told = shard_control->Finish(version, absl::Seconds(10));
    if (told < config.shard_processes()) {
      ALOE_LOG_WARNING("coordinator",
                       "the job is over at version %d; %d of %d shard processes were told (the "
                       "others are not following now: stop them)",
                       version, told, config.shard_processes());
    } else {
      ALOE_LOG_INFO("coordinator", "the job is over at version %d; the %d shard processes stop",
                    version, told);
    }
    // Each shard's last checkpoint is of this version: keep serving until its copy is in.
    if (config.checkpoint().replicate_shards() &&
        !shard_control->AwaitCopies(version, absl::Seconds(30))) {
      ALOE_LOG_WARNING("coordinator",
                       "not every shard process's copy of version %d arrived within 30 s", version);
    }
  }
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (raw_pushes != nullptr) {
    raw_pushes->Shutdown();
    ALOE_LOG_INFO("server", "raw pushes: %d bytes received whole", parameters.raw_push_bytes());
  }
  if (checkpoints) {
    // The final state (on SIGTERM/SIGINT too), so a restart loses nothing that was applied.
    const v1::ServerCheckpoint last =
        handle.Run([](ServerCore& core) { return core.CaptureCheckpoint(); });
    WriteCheckpoint(*checkpoints, last, *metrics);
  }

  const std::string summary = handle.Run([&](ServerCore& core) {
    const auto& evals = core.eval_history();
    std::string eval_line = "no evaluations";
    if (!evals.empty()) {
      eval_line =
          absl::StrFormat("eval loss %.4f -> %.4f, perplexity %.2f -> %.2f (versions %d -> %d)",
                          evals.front().loss, evals.back().loss, std::exp(evals.front().loss),
                          std::exp(evals.back().loss), evals.front().version, evals.back().version);
    }
    ALOE_LOG_INFO("server", "summary: version %d, %d updates applied; %s", core.version(),
                  core.updates_applied(), eval_line);
    std::string text =
        absl::StrFormat("version=%d\nupdates_applied=%d\n", core.version(), core.updates_applied());
    for (const EvalPoint& e : evals) {
      absl::StrAppendFormat(&text, "eval=%d:%.6f\n", e.version, e.loss);
    }
    return text;
  });
  if (!absl::GetFlag(FLAGS_summary_file).empty()) {
    std::ofstream out(absl::GetFlag(FLAGS_summary_file));
    out << summary;
    if (!out) return absl::UnavailableError("cannot write --summary_file");
  }
  return absl::OkStatus();
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
