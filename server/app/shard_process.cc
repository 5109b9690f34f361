#include "server/app/shard_process.h"

#include <chrono>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/imported_model.h"
#include "common/layer_groups.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/app/process_support.h"
#include "server/core/shard_assembly.h"
#include "server/core/shard_state.h"

namespace aloe::server {
namespace {

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
    if (copy.status().code() != absl::StatusCode::kUnavailable || absl::Now() > give_up) {
      return absl::Status(copy.status().code(),
                          absl::StrCat("fetching the coordinator's copy of shard ", index,
                                       "'s checkpoints: ", copy.status().message()));
    }
    absl::SleepFor(absl::Seconds(1));
  }
}

// The credentials this shard process dials the coordinator with: TLS when configured (the
// coordinator presents the same certificate chain: one config for every process).
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> CoordinatorCredentials(
    const v1::ServerConfig& config) {
  if (config.security().tls_cert_file().empty()) return grpc::InsecureChannelCredentials();
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
  return grpc::SslCredentials(ssl);
}

}  // namespace

ShardProcess::~ShardProcess() {
  stop_.store(true);
  if (shard_ != nullptr) shard_->StopFollowing();
  if (server_ != nullptr && !stopped_) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
  if (raw_pushes_ != nullptr && !stopped_) raw_pushes_->Shutdown();
  if (follow_.joinable()) follow_.join();
}

absl::Status ShardProcess::Start() {
  const v1::ServerConfig& config = options_.config;
  const uint32_t index = options_.shard_index;
  const std::string& listen = options_.listen;
  const std::string coordinator =
      options_.coordinator.empty() ? config.listen_address() : options_.coordinator;
  // Only this process's layers are built: a shard never holds the whole model.
  ALOE_ASSIGN_OR_RETURN(ServerModel model, LoadServerModel(config, index));
  const v1::ModelSpec spec = model.spec;
  const std::string fingerprint = ShardedModelFingerprint(config, spec, model.fingerprint);
  executor_ = std::make_unique<ThreadPoolExecutor>(static_cast<int>(config.apply_threads()) - 1);
  std::vector<uint32_t> layer_groups;
  if (config.partial_sync().groups() > 1) {
    ALOE_ASSIGN_OR_RETURN(layer_groups, AssignLayerGroups(spec, config.partial_sync().groups()));
  }
  if (!options_.record_commits.empty()) {
    ALOE_ASSIGN_OR_RETURN(recorder_, CommitRecorder::Open(options_.record_commits));
  }
  auto make_state =
      [spec, index, config, layer_groups, executor = executor_.get(), recorder = recorder_](
          std::vector<std::vector<float>> initial) -> absl::StatusOr<std::unique_ptr<ShardState>> {
    ALOE_ASSIGN_OR_RETURN(std::unique_ptr<ShardState> state,
                          ShardState::Create(spec, index, std::move(initial),
                                             config.outer_optimizer(), config.apply_threads(),
                                             config.max_staged_updates(), *executor, layer_groups));
    if (config.penalty().enabled()) ALOE_RETURN_IF_ERROR(state->EnablePenalty(config.penalty()));
    if (recorder != nullptr) {
      state->SetCommitObserver([recorder](const std::vector<uint32_t>& owned,
                                          const std::vector<const PendingUpdate*>& updates) {
        recorder->Record(owned, updates);
      });
    }
    return state;
  };
  ALOE_ASSIGN_OR_RETURN(std::unique_ptr<ShardState> state, make_state(std::move(model.initial)));
  uint64_t params = 0;
  for (uint32_t l : state->owned_layers()) params += spec.layers(l).num_elements();
  if (!config.checkpoint().dir().empty()) {
    checkpoints_ = std::make_unique<CheckpointStore>(
        absl::StrFormat("%s/shard-%d", config.checkpoint().dir(), index),
        config.checkpoint().keep());
  }
  PrometheusMetrics* endpoint = nullptr;
  ALOE_ASSIGN_OR_RETURN(metrics_, StartMetrics(config, &metrics_port_, &endpoint));
  if (endpoint != nullptr) {
    // Reads only the endpoint's own metrics, which outlive its pages.
    status_ = std::make_unique<StatusPage>([config, index, endpoint, params] {
      StatusSnapshot s = CaptureShardProcessStatus(config, index, absl::Now(), *endpoint);
      s.parameters = params;
      return s;
    });
    status_->ServeOn(*endpoint);
  }
  ALOE_ASSIGN_OR_RETURN(auth_, LoadAuthenticator(config));
  ALOE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                        ServerCredentials(config, listen));
  ALOE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> channel_credentials,
                        CoordinatorCredentials(config));
  ShardServer::Options options;
  options.shard_index = index;
  options.fingerprint = fingerprint;
  options.coordinator = grpc::CreateChannel(coordinator, channel_credentials);
  if (!options_.token_file.empty()) {
    ALOE_ASSIGN_OR_RETURN(std::string token, ReadWholeFile("--token_file", options_.token_file));
    options.token = token.substr(0, token.find('\n'));
  }
  // checkpoint.replicate_shards: the coordinator keeps a copy of every checkpoint written here.
  if (config.checkpoint().replicate_shards()) {
    copies_stub_ = v1::ShardControl::NewStub(options.coordinator);
    uploader_ = std::make_unique<CheckpointUploader>(*copies_stub_, options.token);
  }
  if (options_.resume) ALOE_RETURN_IF_ERROR(Resume(*state, fingerprint, options.token));
  options.checkpoints = checkpoints_.get();
  options.every_versions = config.checkpoint().every_versions();
  options.uploader = uploader_.get();
  options.max_staged = config.max_staged_updates();
  options.admit_locally = config.shard_processes() == 1;
  options.make_initial = [config, index,
                          make_state]() -> absl::StatusOr<std::unique_ptr<ShardState>> {
    ALOE_ASSIGN_OR_RETURN(ServerModel fresh, LoadServerModel(config, index));
    return make_state(std::move(fresh.initial));
  };
  // Told to the coordinator, and by it to the workers.
  options.address = options_.advertise.empty() ? listen : options_.advertise;
  options.push_address =
      options_.advertise_push.empty() ? options_.push_listen : options_.advertise_push;
  const std::string& push_listen = options_.push_listen;
  const size_t owned_layers = state->owned_layers().size();
  shard_ = std::make_unique<ShardServer>(spec, std::move(state), options, *auth_, *metrics_);
  ALOE_ASSIGN_OR_RETURN(server_,
                        StartGrpc(listen, credentials, {shard_.get()}, config, &grpc_port_));
  ALOE_ASSIGN_OR_RETURN(raw_pushes_,
                        StartRawPushes(config, push_listen,
                                       [this](const RawPushRequest& request, ByteReader& in,
                                              const std::function<bool()>& cancelled) {
                                         return shard_->ServeRawPush(request, in, cancelled);
                                       }));
  ALOE_LOG_INFO("shard",
                "shard %d of %d listening on %s%s%s (metrics port %d): %d layers, %d parameters; "
                "following the coordinator at %s",
                index, config.shard_processes(), listen,
                options.address == listen ? "" : absl::StrCat(" as ", options.address),
                push_listen.empty()
                    ? ""
                    : absl::StrCat(", raw pushes on ", push_listen,
                                   options.push_address == push_listen
                                       ? ""
                                       : absl::StrCat(" as ", options.push_address)),
                metrics_port_, owned_layers, params, coordinator);
  follow_ = std::thread([this] {
    followed_ = shard_->RunFollowLoop();
    if (!stop_.load()) ended_.store(true);  // over on its own: the job, or a refusal
  });
  return absl::OkStatus();
}

absl::Status ShardProcess::Resume(ShardState& state, const std::string& fingerprint,
                                  const std::string& token) {
  const uint32_t index = options_.shard_index;
  if (checkpoints_ == nullptr) {
    return absl::InvalidArgumentError("--resume needs checkpoint.dir (or --checkpoint_dir)");
  }
  auto loaded = checkpoints_->LoadLatest<v1::ShardCheckpoint>();
  if (loaded.status().code() == absl::StatusCode::kNotFound && copies_stub_ != nullptr) {
    // None of its own (a new host or disk): the coordinator's newest copy, if it has one.
    ALOE_ASSIGN_OR_RETURN(std::optional<v1::ShardCheckpoint> copy,
                          FetchCopyAtStart(*copies_stub_, token, index));
    if (copy.has_value()) {
      ALOE_ASSIGN_OR_RETURN(std::string path, checkpoints_->Write(*copy));
      ALOE_LOG_INFO("shard",
                    "shard %d has no checkpoint of its own: fetched the coordinator's copy of "
                    "version %d into %s",
                    index, copy->version(), path);
      loaded = checkpoints_->LoadLatest<v1::ShardCheckpoint>();
    }
  }
  if (loaded.status().code() == absl::StatusCode::kNotFound) {
    ALOE_LOG_WARNING("shard", "--resume: %s; starting from the initial model",
                     loaded.status().message());
  } else {
    ALOE_RETURN_IF_ERROR(loaded.status());
    ALOE_RETURN_IF_ERROR(state.Restore(loaded->checkpoint, fingerprint));
    ALOE_LOG_INFO("shard", "resumed from %s (version %d)", loaded->path, state.version());
  }
  return absl::OkStatus();
}

absl::Status ShardProcess::Shutdown(absl::string_view why, absl::FunctionRef<bool()>) {
  if (shard_ == nullptr || stopped_) return absl::OkStatus();
  stopped_ = true;
  const uint32_t index = options_.shard_index;
  const bool job_over = ended_.load();
  stop_.store(true);
  shard_->StopFollowing();
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (raw_pushes_ != nullptr) raw_pushes_->Shutdown();
  follow_.join();
  shard_->WriteFinalCheckpoint();
  if (uploader_ != nullptr && !uploader_->Flush(absl::Seconds(30))) {
    ALOE_LOG_WARNING("shard", "shard %d: the last checkpoint's copy did not reach the coordinator",
                     index);
  }
  ALOE_RETURN_IF_ERROR(followed_);
  ALOE_LOG_INFO("shard",
                "summary: shard %d at version %d, %.1f MB of pushes received (%.1f MB raw); "
                "%d of %d layer updates copied (an older version was held)",
                index, shard_->version(), shard_->received_bytes() / 1e6,
                shard_->raw_push_bytes() / 1e6, shard_->copied_layer_steps(),
                shard_->layer_steps());
  if (job_over) {
    ALOE_LOG_INFO("shard", "the job is over: shard %d stops at version %d", index,
                  shard_->version());
  } else {
    ALOE_LOG_INFO("shard", "%s: shard %d stops at version %d", why, index, shard_->version());
  }
  return absl::OkStatus();
}

}  // namespace aloe::server
