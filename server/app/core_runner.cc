#include "server/app/core_runner.h"

#include <chrono>
#include <cmath>
#include <fstream>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/app/process_support.h"

namespace aloe::server {

CoreRunner::CoreRunner(Options options, std::vector<DataShard> train, std::string heldout_file)
    : options_(std::move(options)),
      train_(std::move(train)),
      heldout_file_(std::move(heldout_file)),
      executor_(static_cast<int>(options_.config.apply_threads()) - 1) {}

CoreRunner::~CoreRunner() {
  // The page reads the handle and the authenticator.
  if (endpoint_ != nullptr) endpoint_->RemovePages();
  StopTicking();
  StopListening();
}

absl::StatusOr<std::unique_ptr<CoreRunner>> CoreRunner::Create(Options options) {
  ALOE_ASSIGN_OR_RETURN(Corpus corpus, LoadCorpus(options.config));
  std::unique_ptr<CoreRunner> runner(
      new CoreRunner(std::move(options), std::move(corpus.train), std::move(corpus.heldout_file)));
  const v1::ServerConfig& config = runner->options_.config;
  ALOE_ASSIGN_OR_RETURN(runner->metrics_,
                        StartMetrics(config, &runner->metrics_port_, &runner->endpoint_));
  ALOE_ASSIGN_OR_RETURN(std::unique_ptr<ServerCore> core, runner->NewCore());
  if (!config.checkpoint().dir().empty()) {
    runner->checkpoints_ =
        std::make_unique<CheckpointStore>(config.checkpoint().dir(), config.checkpoint().keep());
  }
  if (runner->options_.resume) {
    if (runner->checkpoints_ == nullptr) {
      return absl::InvalidArgumentError("--resume needs checkpoint.dir (or --checkpoint_dir)");
    }
    absl::StatusOr<CheckpointStore::Loaded> loaded = runner->checkpoints_->LoadLatest();
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
  runner->handle_ = std::make_unique<CoreHandle>(std::move(core));
  ALOE_ASSIGN_OR_RETURN(runner->auth_, LoadAuthenticator(config));
  ALOE_ASSIGN_OR_RETURN(runner->credentials_, ServerCredentials(config, config.listen_address()));
  if (runner->endpoint_ != nullptr) {
    CoreRunner* r = runner.get();
    runner->status_ = std::make_unique<StatusPage>([r] {
      const std::string role = r->config().shard_processes() > 0 ? "coordinator" : "single process";
      uint64_t generation = 0;
      return r->handle_->Peek(&generation, [&](const ServerCore& core) {
        return CaptureStatus(
            core, r->config(), role, r->clock_.Now(),
            [r](uint64_t worker) { return r->auth_->OwnerOf(worker); }, *r->endpoint_);
      });
    });
    runner->status_->ServeOn(*runner->endpoint_);
  }
  return runner;
}

absl::StatusOr<std::unique_ptr<ServerCore>> CoreRunner::NewCore() {
  return ServerCore::Create(options_.config, train_, heldout_file_, clock_, executor_, *metrics_);
}

template <typename F>
auto CoreRunner::TickAnd(F&& done) {
  std::vector<v1::ServerCheckpoint> due;
  auto result = handle_->Run([&](ServerCore& core) {
    core.Tick();
    due = core.TakeDueCheckpoints();
    if (status_ != nullptr) status_->Record(clock_.Now(), core.version(), core.eval_history());
    return done(core);
  });
  // Written outside the core lock: training goes on meanwhile.
  for (const v1::ServerCheckpoint& c : due) {
    if (checkpoints_ != nullptr) WriteCheckpoint(*checkpoints_, c, *metrics_);
  }
  return result;
}

absl::Status CoreRunner::Listen(const std::vector<grpc::Service*>& services) {
  const v1::ServerConfig& config = options_.config;
  ALOE_ASSIGN_OR_RETURN(
      server_, StartGrpc(config.listen_address(), credentials_, services, config, &grpc_port_));
  const v1::ModelSpec& spec = handle_->spec();
  uint64_t params = 0;
  for (const auto& layer : spec.layers()) params += layer.num_elements();
  ALOE_LOG_INFO("server", "security: %s, %s, %s",
                config.security().tls_cert_file().empty() ? "plaintext" : "TLS",
                config.security().tls_client_ca_file().empty() ? "no client certificates"
                                                               : "client certificates required",
                auth_->enabled() ? "token auth" : "no token auth");
  ALOE_LOG_INFO(
      "server",
      "listening on %s (grpc port %d, metrics port %d); model %d layers, %d parameters "
      "in %d %s; %d training data shards; outer %s lr %g momentum %g; H=%d",
      config.listen_address(), grpc_port_, metrics_port_, spec.layers_size(), params,
      spec.num_shards(), config.shard_processes() > 0 ? "shard processes" : "apply groups",
      train_.size(), v1::OuterOptimizerType_Name(config.outer_optimizer().type()),
      config.outer_optimizer().lr(), config.outer_optimizer().momentum(), config.local_steps());
  StartTicking();
  return absl::OkStatus();
}

void CoreRunner::StopListening() {
  if (server_ == nullptr) return;
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  server_.reset();
}

void CoreRunner::StartTicking() {
  absl::MutexLock lock(&mu_);
  if (ticker_.joinable()) return;
  stop_ = false;
  ticker_ = std::thread([this] { TickLoop(); });
}

void CoreRunner::TickLoop() {
  while (true) {
    if (TickAnd([](ServerCore& core) { return core.Finished(); })) {
      finished_.store(true);
      return;
    }
    absl::MutexLock lock(&mu_);
    // Real time: this thread only paces the ticks; the core reads its clock.
    if (mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(100))) return;
  }
}

void CoreRunner::StopTicking() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (ticker_.joinable()) ticker_.join();
}

void CoreRunner::Drain(absl::string_view why, absl::FunctionRef<bool()> cut_short) {
  const absl::Duration drain = options_.drain_time;
  const absl::Time deadline = absl::Now() + drain;
  size_t open = handle_->Run([](ServerCore& core) {
    core.BeginDrain();
    return core.open_tasks();
  });
  ALOE_LOG_INFO("server", "%s: draining: no new work; waiting up to %.0f s for %d open task(s)",
                why, absl::ToDoubleSeconds(drain), open);
  bool cut = false;
  while (open > 0 && absl::Now() < deadline && !(cut = cut_short())) {
    absl::SleepFor(absl::Milliseconds(50));
    open = TickAnd([](ServerCore& core) { return core.open_tasks(); });
  }
  if (open == 0) {
    ALOE_LOG_INFO("server", "drained: every open task finished");
  } else {
    ALOE_LOG_WARNING("server", "drain %s with %d task(s) still open: their work is lost",
                     cut ? "cut short by a second signal" : "timed out", open);
  }
}

absl::Status CoreRunner::Finish() {
  if (checkpoints_ != nullptr) {
    const v1::ServerCheckpoint last =
        handle_->Run([](ServerCore& core) { return core.CaptureCheckpoint(); });
    WriteCheckpoint(*checkpoints_, last, *metrics_);
  }
  const std::string summary = handle_->Run([&](ServerCore& core) {
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
  if (!options_.summary_file.empty()) {
    std::ofstream out(options_.summary_file);
    out << summary;
    if (!out) return absl::UnavailableError("cannot write --summary_file");
  }
  return absl::OkStatus();
}

}  // namespace aloe::server
