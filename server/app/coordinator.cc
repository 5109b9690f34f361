#include "server/app/coordinator.h"

#include <optional>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/app/process_support.h"
#include "server/core/shard_assembly.h"

namespace aloe::server {

CoordinatorServer::~CoordinatorServer() {
  // The services must outlive the calls in flight.
  if (runner_ != nullptr) runner_->StopListening();
}

absl::Status CoordinatorServer::Start() {
  const v1::ServerConfig& config = options_.core.config;
  if (config.shard_processes() == 0) {
    return absl::InvalidArgumentError("a coordinator needs shard_processes > 0");
  }
  ALOE_ASSIGN_OR_RETURN(runner_, CoreRunner::Create(options_.core));
  CoreHandle& handle = runner_->handle();
  Authenticator& auth = runner_->auth();
  coordinator_ =
      std::make_unique<CoordinatorService>(handle, auth, config.security().shard_identity());
  // Workers pull and push at the shard processes; the shards follow this coordinator.
  ShardControlService::Options options;
  options.shard_processes = config.shard_processes();
  options.fingerprint = ShardedModelFingerprint(
      config, handle.spec(), handle.Run([](ServerCore& core) { return core.model_fingerprint(); }));
  options.shard_identity = config.security().shard_identity();
  if (config.checkpoint().replicate_shards()) {
    options.replica_dir = config.checkpoint().dir() + "/replicas";
    options.keep = config.checkpoint().keep();
  }
  options.metrics = &runner_->metrics();
  if (auth.enabled() && !auth.HasIdentity(options.shard_identity)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "security.token_file %s has no token of identity \"%s\" (security.shard_identity): "
        "the shard processes could not follow this coordinator; add a line \"%s TOKEN\" and "
        "give the shards that token (--token_file)",
        config.security().token_file(), options.shard_identity, options.shard_identity));
  }
  if (!options_.order_journal.empty()) {
    ALOE_ASSIGN_OR_RETURN(journal_, OrderJournal::Open(options_.order_journal));
    options.journal = journal_.get();
  }
  options.coordinator_versions = [this] { return Versions(); };
  options.restore = [this](uint64_t version) { return Restore(version); };
  shard_control_ = std::make_unique<ShardControlService>(handle, auth, std::move(options));
  return runner_->Listen({coordinator_.get(), shard_control_.get()});
}

std::vector<uint64_t> CoordinatorServer::Versions() {
  std::vector<uint64_t> versions;
  if (runner_->checkpoints() != nullptr) versions = runner_->checkpoints()->Versions();
  versions.push_back(runner_->handle().Run([](ServerCore& core) { return core.version(); }));
  return versions;
}

absl::Status CoordinatorServer::Restore(uint64_t version) {
  CoreHandle& handle = runner_->handle();
  std::optional<v1::ServerCheckpoint> from;
  const uint64_t current = handle.Run([](ServerCore& core) { return core.version(); });
  if (version == current) {
    from = handle.Run([](ServerCore& core) { return core.CaptureCheckpoint(); });
  } else if (version > 0) {
    if (runner_->checkpoints() == nullptr) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "version %d is not the current one and there are no checkpoints", version));
    }
    ALOE_ASSIGN_OR_RETURN(from, CheckpointStore::ReadFile(runner_->checkpoints()->PathOf(version)));
  }
  ALOE_ASSIGN_OR_RETURN(std::unique_ptr<ServerCore> fresh, runner_->NewCore());
  if (from) ALOE_RETURN_IF_ERROR(fresh->RestoreCheckpoint(*from));
  handle.Replace(std::move(fresh));
  ALOE_LOG_INFO("coordinator", "restored version %d; workers join again", version);
  return absl::OkStatus();
}

void CoordinatorServer::FinishShards() {
  const v1::ServerConfig& config = options_.core.config;
  // The shard processes end with the job (not on a signal: a restarted coordinator resumes).
  const uint64_t version = runner_->handle().Run([](ServerCore& core) { return core.version(); });
  const uint32_t told = shard_control_->Finish(version, absl::Seconds(10));
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
      !shard_control_->AwaitCopies(version, absl::Seconds(30))) {
    ALOE_LOG_WARNING("coordinator",
                     "not every shard process's copy of version %d arrived within 30 s", version);
  }
}

absl::Status CoordinatorServer::Shutdown(absl::string_view why,
                                         absl::FunctionRef<bool()> cut_short) {
  if (runner_ == nullptr || stopped_) return absl::OkStatus();
  stopped_ = true;
  runner_->StopTicking();
  if (runner_->finished()) {
    FinishShards();
  } else {
    runner_->Drain(why, cut_short);
  }
  runner_->StopListening();
  return runner_->Finish();
}

}  // namespace aloe::server
