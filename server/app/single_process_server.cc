#include "server/app/single_process_server.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/app/process_support.h"

namespace aloe::server {

SingleProcessServer::~SingleProcessServer() {
  // The services must outlive the calls in flight.
  if (runner_ != nullptr) runner_->StopListening();
  if (raw_pushes_ != nullptr && !stopped_) raw_pushes_->Shutdown();
}

absl::Status SingleProcessServer::Start() {
  const v1::ServerConfig& config = options_.core.config;
  if (config.shard_processes() > 0) {
    return absl::InvalidArgumentError("a single-process server needs shard_processes 0");
  }
  if (!(options_.pull_delay >= absl::ZeroDuration()) || options_.pull_delay > absl::Seconds(600)) {
    return absl::InvalidArgumentError("--pull_delay_ms must be in [0, 600000]");
  }
  ALOE_ASSIGN_OR_RETURN(runner_, CoreRunner::Create(options_.core));
  CoreHandle& handle = runner_->handle();
  coordinator_ = std::make_unique<CoordinatorService>(handle, runner_->auth());
  parameters_ = std::make_unique<ParameterServiceImpl>(
      handle, runner_->auth(), runner_->metrics(), runner_->clock(), config.max_staged_updates(),
      options_.pull_delay);
  ALOE_ASSIGN_OR_RETURN(raw_pushes_,
                        StartRawPushes(config, options_.push_listen,
                                       [this](const RawPushRequest& request, ByteReader& in,
                                              const std::function<bool()>& cancelled) {
                                         return parameters_->ServeRawPush(request, in, cancelled);
                                       }));
  const std::string advertised =
      options_.advertise_push.empty() ? options_.push_listen : options_.advertise_push;
  handle.Run([&](ServerCore& core) { core.SetPushAddress(advertised); });
  ALOE_RETURN_IF_ERROR(runner_->Listen({coordinator_.get(), parameters_.get()}));
  if (raw_pushes_ != nullptr) {
    ALOE_LOG_INFO("server", "raw pushes on %s%s", options_.push_listen,
                  advertised == options_.push_listen ? "" : absl::StrCat(" as ", advertised));
  }
  return absl::OkStatus();
}

absl::Status SingleProcessServer::Shutdown(absl::string_view why,
                                           absl::FunctionRef<bool()> cut_short) {
  if (runner_ == nullptr || stopped_) return absl::OkStatus();
  stopped_ = true;
  runner_->StopTicking();
  if (!runner_->finished()) runner_->Drain(why, cut_short);
  runner_->StopListening();
  if (raw_pushes_ != nullptr) {
    raw_pushes_->Shutdown();
    ALOE_LOG_INFO("server", "raw pushes: %d bytes received whole", parameters_->raw_push_bytes());
  }
  return runner_->Finish();
}

}  // namespace aloe::server
