// aloe-worker: one training daemon per node. Joins aloe-server, then loops: request a task,
// pull the global model of the task's version, run H local AdamW steps on the task's data shard
// (the optimizer state persists across rounds), push the pseudo-gradient theta_base - theta_end
// layer by layer. With --role evaluator it instead measures held-out loss of new versions.
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/allocator.h"
#include "common/flags_usage.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/model_spec.h"
#include "common/status_macros.h"
#include "common/token_shard.h"
#include "kernels/cpu/outer_kernels.h"
#include "worker/client.h"
#include "worker/fsdp.h"
#include "worker/launcher.h"
#include "worker/trainer.h"
#include "worker/worker_metrics.h"

ABSL_FLAG(std::string, server, "127.0.0.1:7070", "aloe-server address (host:port)");
ABSL_FLAG(std::string, role, "trainer", "trainer | evaluator");
ABSL_FLAG(std::string, corpus_dir, "data/sotu", "Prepared corpus directory (manifest.tsv)");
ABSL_FLAG(std::string, name, "", "Worker name shown by the server (default host:pid)");
ABSL_FLAG(int32_t, threads, 1, "Intra-op threads (1 = one worker per core is fastest on CPU)");
ABSL_FLAG(double, slowdown, 1.0,
          "Emulate slower hardware: after each step sleep (slowdown-1) x its compute time");
ABSL_FLAG(std::string, metrics, "127.0.0.1:0", "Prometheus endpoint host:port, or 'off'");
ABSL_FLAG(int32_t, eval_sequences, 64, "Held-out sequences per evaluation (evaluator role)");
ABSL_FLAG(double, connect_timeout, 60, "Seconds to keep retrying while the server is unreachable");
ABSL_FLAG(double, join_wait, 600,
          "Seconds to keep asking to join, every 5 s, while the server refuses for want of room "
          "(RESOURCE_EXHAUSTED: a layer-sharded sync server with as many trainers as staging "
          "slots); 0 = exit at once");
ABSL_FLAG(std::string, token_file, "", "File whose first line is this worker's access token");
ABSL_FLAG(std::string, tls_ca_file, "", "PEM CA that signed the server certificate (enables TLS)");
ABSL_FLAG(std::string, tls_cert_file, "", "PEM client certificate chain (mutual TLS)");
ABSL_FLAG(std::string, tls_key_file, "", "PEM client private key (mutual TLS)");
ABSL_FLAG(std::string, tls_server_name, "", "Name to verify in the server certificate");
ABSL_FLAG(
    bool, raw_push, true,
    "Push float32 layers to shard processes that offer raw pushes (aloe-server --push_listen) "
    "over plain TCP instead of gRPC; never with TLS");
ABSL_FLAG(int32_t, nproc, 1,
          "Ranks of this node (trainers): N > 1 starts N processes that train one model replica "
          "together with FSDP (over NCCL on GPUs, rank r on GPU r; over Gloo on the CPU; each rank "
          "holds 1/N of the parameters, gradients and AdamW state, and pulls and pushes only its "
          "slice of every layer); inner_optimizer.batch_size is the node's batch and must be a "
          "multiple of N");
ABSL_FLAG(std::string, device, "auto",
          "auto | cpu | cuda | cuda:I: where the inner loop trains (model, activations, gradients, "
          "AdamW state). auto: GPU 0 when LibTorch sees a GPU, else the CPU. With --nproc N on "
          "GPUs give cuda or auto: rank r trains on GPU r. GPUs need a worker built against a "
          "CUDA LibTorch (README: GPU workers)");
ABSL_FLAG(std::string, overlap, "off",
          "off | delayed | eager: push round r and pull the next model in the background while "
          "round r+1 trains (one-step delay); eager also applies round r's pseudo-gradient "
          "locally at once until the global model with it arrives (paper 004). Needs a plain "
          "async server (grace_seconds 0). With --nproc N every rank does this for its slices");
ABSL_FLAG(std::string, autocast, "off",
          "off | bf16: run the forward pass of every training step under LibTorch's bf16 autocast "
          "(matrix products in bfloat16); parameters, gradients, AdamW state and "
          "pseudo-gradients stay float32. Evaluation stays float32");
ABSL_FLAG(std::string, torchscript, "",
          "Bring-your-own model: a TorchScript file (torch.jit.script(m).save(path)) whose "
          "forward(inputs) returns logits [B,T,V] or forward(inputs, targets) the loss; the "
          "server must train the model aloe-import-model wrote from the same file (model_file)");
ABSL_FLAG(int32_t, rank, -1, "Internal (set by --nproc): this process' rank in the node");
ABSL_FLAG(std::string, rendezvous, "", "Internal (set by --nproc): the node's rendezvous file");

namespace aloe::worker {
namespace {

std::atomic<int> g_signal{0};
// How often a worker the server has no room for asks to join again (--join_wait).
constexpr absl::Duration kJoinWaitStep = absl::Seconds(5);
// Ends a training round at the next step end (LocalTrainer::Train), so that the steps done are
// pushed before the worker leaves.
std::atomic<bool> g_interrupt{false};
void OnSignal(int sig) {
  g_signal.store(sig);
  g_interrupt.store(true);
}

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Keeps the lease alive from a background thread. Stops and joins in the destructor.
class Heartbeater {
 public:
  Heartbeater(ServerClient& client, double lease_seconds)
      : client_(client), period_(absl::Seconds(std::max(0.05, lease_seconds / 3))) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~Heartbeater() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  void Set(uint64_t worker_id, double steps_per_second) {
    absl::MutexLock lock(&mu_);
    worker_id_ = worker_id;
    steps_per_second_ = steps_per_second;
  }

 private:
  void Loop() {
    absl::MutexLock lock(&mu_);
    while (!stop_) {
      mu_.AwaitWithTimeout(absl::Condition(&stop_), period_);
      if (stop_) break;
      v1::HeartbeatRequest request;
      request.set_worker_id(worker_id_);
      request.set_steps_per_second(steps_per_second_);
      mu_.Unlock();
      absl::StatusOr<v1::HeartbeatReply> reply = client_.Heartbeat(request);
      if (!reply.ok() && reply.status().code() != absl::StatusCode::kUnavailable) {
        ALOE_LOG_WARNING("worker", "heartbeat: %s", reply.status().ToString());
      }
      mu_.Lock();
    }
  }

  ServerClient& client_;
  const absl::Duration period_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t worker_id_ ABSL_GUARDED_BY(mu_) = 0;
  double steps_per_second_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

class Worker {
 public:
  // node: null for a one-process worker; else this process is rank node->rank() of a multi-rank
  // node (FSDP), and must outlive the worker.
  // control: with --overlap in a multi-rank node, a second process group over the same ranks
  // for the background half of overlapped rounds (it runs beside the training collectives).
  Worker(ServerClient& client, MetricsSink& metrics, Collectives* node = nullptr,
         Collectives* control = nullptr)
      : client_(client), metrics_(metrics), node_(node), control_(control) {}

  absl::Status Run();

 private:
  bool leader() const { return node_ == nullptr || node_->rank() == 0; }
  static std::string Name() {
    const std::string name = absl::GetFlag(FLAGS_name);
    return name.empty() ? absl::StrFormat("%s-%d", absl::GetFlag(FLAGS_role), getpid()) : name;
  }
  absl::Status JoinServer();
  absl::StatusOr<v1::JoinReply> JoinRpc();
  // Sets up for a join reply: the trainer (once), the heartbeat (leader), the push codecs.
  absl::Status Joined(const v1::JoinReply& joined);
  // The multi-rank loop: the leader asks the server and tells every rank what to do.
  absl::Status RunNode();
  v1::NodeDirective NextDirective();
  absl::Status Finish();
  // Stops the heartbeat and, as the node's leader, leaves the server (best effort).
  void Leave();
  // Ends the worker on an error of its own (not the server's): leaves the server first, so the
  // task goes to another worker at once instead of when the lease runs out.
  absl::Status LeaveAfter(absl::Status error);
  // The token shard `file` of the corpus. A missing or unreadable file is this node's setup
  // (--corpus_dir), never the server's: kInvalidArgument, so it ends the worker instead of being
  // retried as a dropped task (which asked for the same task again in a tight loop).
  absl::StatusOr<const TokenSource*> Shard(const std::string& file);
  // The next task: the one the last push's reply carried (PushReply.next_task), else
  // RequestTask's answer, naming the task given up since the last answer (NoteDropped).
  absl::StatusOr<v1::Task> RequestNextTask();
  // After a task ended in an error that drops it: a TRAIN task dropped on FAILED_PRECONDITION
  // (its base version is no longer held, say) cannot succeed when asked for again, so the next
  // request gives it up (TaskRequest.dropped_task_id) instead of getting the same task back in
  // a loop.
  void NoteDropped(const v1::Task& task, const absl::Status& status);
  absl::Status Train(const v1::Task& task);
  // Tells the server this worker (its slice) holds the base version of `task` in full, so the
  // server need not keep that version while the round trains. Best effort: on failure the
  // server keeps it until the task ends, as before.
  void ReportPulled(const v1::Task& task, uint32_t slice, uint32_t slices);
  // Overlapped rounds (--overlap) from `task`, a TRAIN task just handed out, until the server
  // hands out no look-ahead task or the worker stops.
  absl::Status TrainOverlapped(v1::Task task);
  // Local work of one round from `start` (the task's base, or for an eager round the base minus
  // the previous round's fresh pseudo-gradient); leaves start - end in delta_.
  absl::StatusOr<TrainStats> TrainRound(const v1::Task& task,
                                        const std::vector<std::vector<float>>& start);
  v1::PushHeader HeaderFor(const v1::Task& task, const TrainStats& stats);
  // Pushes `delta` under `header` (error feedback: adds and refreshes residual_).
  absl::StatusOr<v1::PushReply> PushDelta(const v1::PushHeader& header,
                                          std::vector<std::vector<float>>& delta, uint64_t* pushed);
  // Totals, metrics and the log line of a round whose push was answered.
  void ReportRound(const v1::Task& task, const TrainStats& stats, const v1::PushReply& reply,
                   uint64_t pulled, uint64_t pushed, double train_s, double round_s,
                   double network_s);
  absl::Status Evaluate(const v1::Task& task);
  template <typename T>
  absl::StatusOr<T> Retry(const std::function<absl::StatusOr<T>()>& call);

  // A multi-rank node acts on `status` (this rank's outcome of a step every rank took) only
  // together: OK when every rank's was; else this rank's error, or kUnavailable when only
  // another rank failed (so every rank drops the round alike). One process: `status`.
  absl::Status AgreeAcrossRanks(absl::Status status);
  // The background half of an overlapped round: pushes `push` (this rank's slice, if any), asks
  // for the next task (a node's leader asks once every rank's push is in, then tells the others)
  // and pulls its base (this rank's slice).
  struct Communicated;
  Communicated Communicate(const v1::PushHeader* header, std::vector<std::vector<float>>* delta);

  ServerClient& client_;
  MetricsSink& metrics_;
  Collectives* const node_;
  Collectives* const control_;
  double flops_per_token_ = 0;  // the joined model's training FLOPs per token
  bool need_join_ = true;
  bool evaluator_ = false;
  bool server_draining_ = false;
  // A TRAIN task given up on FAILED_PRECONDITION (e.g. its base version is gone): the next
  // RequestTask names it, so the server ends it and hands out another instead of the same one.
  uint64_t dropped_task_id_ = 0;
  // The task the reply of this worker's last push carried (PushHeader.want_next_task), until
  // RequestNextTask hands it out; cleared at every join.
  std::optional<v1::Task> next_task_;
  v1::JoinReply joined_;
  // LocalTrainer, or FsdpTrainer (this rank's slices) in a multi-rank node.
  std::unique_ptr<TrainerInterface> trainer_;
  ScriptModelPtr script_;           // --torchscript, until the trainer takes it over
  std::string script_fingerprint_;  // its architecture fingerprint ("" = built-in transformer)
  std::unique_ptr<Heartbeater> heartbeat_;
  std::map<std::string, std::unique_ptr<TokenShard>> shards_;
  std::vector<std::vector<float>> base_;
  std::vector<std::vector<float>> delta_;
  std::vector<v1::Codec> codecs_;             // per layer, from the server's transport
  std::vector<std::vector<float>> residual_;  // error feedback, per layer
  uint64_t update_id_ = 0;
  // --overlap: 0 off, 1 delayed, 2 eager; refused once the server grants no look-ahead task.
  int overlap_ = 0;
  bool overlap_refused_ = false;
  // Totals for the closing summary.
  uint64_t rounds_ = 0, steps_ = 0, tokens_ = 0, pushed_bytes_ = 0;
  uint64_t tasks_from_push_replies_ = 0;  // tasks that came with a push reply, not RequestTask
  double compute_s_ = 0, network_s_ = 0;
  std::chrono::steady_clock::time_point first_task_{};
};

// Retries calls that fail with kUnavailable (server restarting, not yet up) until
// --connect_timeout passes.
template <typename T>
absl::StatusOr<T> Worker::Retry(const std::function<absl::StatusOr<T>()>& call) {
  const auto give_up = std::chrono::steady_clock::now() +
                       std::chrono::duration<double>(absl::GetFlag(FLAGS_connect_timeout));
  while (true) {
    absl::StatusOr<T> result = call();
    if (result.ok() || result.status().code() != absl::StatusCode::kUnavailable ||
        std::chrono::steady_clock::now() > give_up || g_signal.load() != 0) {
      return result;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
}

absl::StatusOr<v1::JoinReply> Worker::JoinRpc() {
  v1::JoinRequest request;
  request.set_name(Name());
  request.set_role(evaluator_ ? v1::ROLE_EVALUATOR : v1::ROLE_TRAINER);
  request.set_num_threads(absl::GetFlag(FLAGS_threads));
  request.set_model_fingerprint(script_fingerprint_);
  // A server without room for one more trainer takes one once another leaves: wait for that
  // (saying so now and then) instead of exiting, up to --join_wait.
  const absl::Duration wait = absl::Seconds(absl::GetFlag(FLAGS_join_wait));
  const absl::Time give_up = absl::Now() + wait;
  absl::Time next_note = absl::InfinitePast();
  while (true) {
    absl::StatusOr<v1::JoinReply> joined =
        Retry<v1::JoinReply>([&] { return client_.Join(request); });
    if (joined.ok() || joined.status().code() != absl::StatusCode::kResourceExhausted ||
        absl::Now() >= give_up || g_signal.load() != 0) {
      return joined;
    }
    if (absl::Now() >= next_note) {
      ALOE_LOG_WARNING("worker",
                       "the server has no room for this worker yet (%s); asking again "
                       "every %.0f s for up to %.0f s more (--join_wait)",
                       joined.status().message(), absl::ToDoubleSeconds(kJoinWaitStep),
                       absl::ToDoubleSeconds(give_up - absl::Now()));
      next_note = absl::Now() + absl::Minutes(1);
    }
    for (absl::Time until = absl::Now() + kJoinWaitStep;
         absl::Now() < until && g_signal.load() == 0;) {
      absl::SleepFor(absl::Milliseconds(100));
    }
  }
}

absl::Status Worker::JoinServer() {
  ALOE_ASSIGN_OR_RETURN(v1::JoinReply joined, JoinRpc());
  return Joined(joined);
}

absl::Status Worker::Joined(const v1::JoinReply& joined) {
  next_task_.reset();  // a task of the previous membership
  // A layer-sharded server: pulls and pushes go to its shard processes (a single-process server
  // may take raw pushes itself). Every rank of a node comes through here (REJOIN), as each pulls
  // and pushes its own slices.
  absl::Status shards = client_.SetShards(
      {joined.shard_addresses().begin(), joined.shard_addresses().end()},
      {joined.shard_push_addresses().begin(), joined.shard_push_addresses().end()},
      joined.push_address());
  if (!shards.ok()) {
    return absl::Status(shards.code(),
                        absl::StrCat("the server's shard addresses: ", shards.message()));
  }
  joined_ = joined;
  need_join_ = false;
  if (script_ != nullptr && joined_.model_fingerprint() != script_fingerprint_) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the server trains model \"%s\", --torchscript %s is \"%s\"", joined_.model_fingerprint(),
        absl::GetFlag(FLAGS_torchscript), script_fingerprint_));
  }
  if (trainer_ == nullptr && node_ != nullptr && script_ != nullptr) {
    ALOE_ASSIGN_OR_RETURN(
        trainer_, FsdpTrainer::CreateForScript(std::move(script_), joined_.model().vocab_size(),
                                               joined_.model().seq_len(), joined_.inner_optimizer(),
                                               joined_.model_spec(), *node_));
  } else if (trainer_ == nullptr && node_ != nullptr) {
    ALOE_ASSIGN_OR_RETURN(trainer_,
                          FsdpTrainer::Create(joined_.model(), joined_.inner_optimizer(),
                                              joined_.model_spec(), joined_.seed(), *node_));
  } else if (trainer_ == nullptr && script_ != nullptr) {
    ALOE_ASSIGN_OR_RETURN(
        trainer_, LocalTrainer::CreateForScript(std::move(script_), joined_.model().vocab_size(),
                                                joined_.model().seq_len(),
                                                joined_.inner_optimizer(), joined_.model_spec()));
  } else if (trainer_ == nullptr) {
    ALOE_ASSIGN_OR_RETURN(trainer_, LocalTrainer::Create(joined_.model(), joined_.inner_optimizer(),
                                                         joined_.model_spec(), joined_.seed()));
  }
  if (leader()) {
    if (heartbeat_ == nullptr) {
      heartbeat_ = std::make_unique<Heartbeater>(client_, joined_.lease_seconds());
    }
    heartbeat_->Set(joined_.worker_id(), 0);
  }
  const v1::TransportConfig& transport = joined_.transport();
  codecs_.clear();
  for (const v1::LayerSpec& layer : joined_.model_spec().layers()) {
    v1::Codec codec =
        transport.codec() == v1::CODEC_UNSPECIFIED ? v1::CODEC_FP32 : transport.codec();
    for (const v1::LayerCodec& o : transport.layer_codecs()) {
      if (o.layer() == layer.name()) codec = o.codec();
    }
    codecs_.push_back(codec);
  }
  flops_per_token_ = TrainingFlopsPerToken(joined_.model_spec(), joined_.model());
  if (leader()) {
    ALOE_LOG_INFO("worker", "%s joined as worker %d at version %d%s%s", Name(), joined_.worker_id(),
                  joined_.version(),
                  node_ != nullptr ? absl::StrFormat(" (%d ranks)", node_->size()) : "",
                  joined_.shard_addresses().empty()
                      ? ""
                      : absl::StrFormat(" (%d shard processes)", joined_.shard_addresses_size()));
  }
  return absl::OkStatus();
}

absl::StatusOr<const TokenSource*> Worker::Shard(const std::string& file) {
  auto it = shards_.find(file);
  if (it != shards_.end()) return it->second.get();
  absl::StatusOr<std::unique_ptr<TokenShard>> shard =
      TokenShard::Open(absl::StrCat(absl::GetFlag(FLAGS_corpus_dir), "/", file));
  if (!shard.ok()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "training data: %s (--corpus_dir %s must hold the corpus the server was configured with, "
        "prepared by aloe-corpus or scripts/prepare-corpus.sh)",
        shard.status().message(), absl::GetFlag(FLAGS_corpus_dir)));
  }
  const TokenSource* source = shard->get();
  shards_[file] = *std::move(shard);
  return source;
}

absl::Status Worker::Run() {
  evaluator_ = absl::GetFlag(FLAGS_role) == "evaluator";
  if (!absl::GetFlag(FLAGS_torchscript).empty()) {
    ALOE_ASSIGN_OR_RETURN(script_,
                          OpenScriptModel(absl::GetFlag(FLAGS_torchscript), &script_fingerprint_));
    ALOE_LOG_INFO("worker", "model %s: %s", absl::GetFlag(FLAGS_torchscript), script_fingerprint_);
  }
  const std::string overlap = absl::GetFlag(FLAGS_overlap);
  overlap_ = overlap == "delayed" ? 1 : overlap == "eager" ? 2 : 0;
  if (node_ != nullptr) return RunNode();
  ALOE_RETURN_IF_ERROR(JoinServer());
  while (g_signal.load() == 0) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<v1::Task> task = Retry<v1::Task>([&] { return RequestNextTask(); });
    network_s_ += Seconds(t0, std::chrono::steady_clock::now());
    if (!task.ok() && task.status().code() == absl::StatusCode::kNotFound) {
      ALOE_LOG_WARNING("worker", "%s; joining again", task.status().message());
      ALOE_RETURN_IF_ERROR(JoinServer());
      continue;
    }
    if (!task.ok() && g_signal.load() != 0) break;  // stopping while the server is away
    if (!task.ok()) return task.status();
    absl::Status status;
    switch (task->kind()) {
      case v1::Task::WAIT:
        if (task->draining() && !server_draining_) {
          ALOE_LOG_INFO("worker", "server is draining (shutdown or restart): waiting for it");
        }
        server_draining_ = task->draining();
        continue;
      case v1::Task::STOP:
        ALOE_LOG_INFO("worker", "server says training is over");
        break;
      case v1::Task::TRAIN:
        status = overlap_ != 0 && !overlap_refused_ ? TrainOverlapped(*task) : Train(*task);
        break;
      case v1::Task::EVAL:
        status = Evaluate(*task);
        break;
      default:
        return absl::InvalidArgumentError(absl::StrFormat("unknown task kind %d", task->kind()));
    }
    if (task->kind() == v1::Task::STOP) break;
    if (status.code() == absl::StatusCode::kFailedPrecondition ||
        status.code() == absl::StatusCode::kNotFound ||
        status.code() == absl::StatusCode::kUnavailable) {
      // The server dropped this round (stale version, expired lease) or went away meanwhile
      // (restart): log and ask again; asking retries until the server is back.
      ALOE_LOG_WARNING("worker", "task %d dropped: %s", task->task_id(), status.message());
      NoteDropped(*task, status);
      continue;
    }
    if (!status.ok()) return LeaveAfter(status);
  }
  return Finish();
}

absl::StatusOr<v1::Task> Worker::RequestNextTask() {
  if (next_task_.has_value() && dropped_task_id_ == 0) {
    v1::Task task = *std::move(next_task_);
    next_task_.reset();
    ++tasks_from_push_replies_;
    return task;
  }
  next_task_.reset();
  absl::StatusOr<v1::Task> task =
      client_.RequestTask(joined_.worker_id(), /*ahead=*/false, dropped_task_id_);
  if (task.ok()) dropped_task_id_ = 0;
  return task;
}

void Worker::NoteDropped(const v1::Task& task, const absl::Status& status) {
  if (task.kind() == v1::Task::TRAIN && status.code() == absl::StatusCode::kFailedPrecondition) {
    dropped_task_id_ = task.task_id();
  }
}

v1::NodeDirective Worker::NextDirective() {
  v1::NodeDirective d;
  if (g_signal.load() != 0) {
    d.set_kind(v1::NodeDirective::STOP);
    return d;
  }
  if (!need_join_) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<v1::Task> task = Retry<v1::Task>([&] { return RequestNextTask(); });
    network_s_ += Seconds(t0, std::chrono::steady_clock::now());
    if (task.ok()) {
      d.set_kind(task->kind() == v1::Task::STOP ? v1::NodeDirective::STOP
                                                : v1::NodeDirective::TASK);
      if (task->kind() == v1::Task::STOP) ALOE_LOG_INFO("worker", "server says training is over");
      *d.mutable_task() = *std::move(task);
      return d;
    }
    if (g_signal.load() != 0) {
      d.set_kind(v1::NodeDirective::STOP);
      return d;
    }
    if (task.status().code() != absl::StatusCode::kNotFound) {
      d.set_kind(v1::NodeDirective::FAIL);
      d.set_error(task.status().ToString());
      return d;
    }
    ALOE_LOG_WARNING("worker", "%s; joining again", task.status().message());
  }
  absl::StatusOr<v1::JoinReply> joined = JoinRpc();
  if (!joined.ok()) {
    d.set_kind(g_signal.load() != 0 ? v1::NodeDirective::STOP : v1::NodeDirective::FAIL);
    d.set_error(joined.status().ToString());
    return d;
  }
  d.set_kind(v1::NodeDirective::REJOIN);
  *d.mutable_joined() = *std::move(joined);
  return d;
}

absl::Status Worker::RunNode() {
  while (true) {
    v1::NodeDirective d;
    std::string bytes;
    if (leader()) {
      d = NextDirective();
      d.SerializeToString(&bytes);
    }
    // Every rank learns the leader's decision (the same bytes), so they act in lockstep.
    ALOE_RETURN_IF_ERROR(node_->Broadcast(&bytes, /*root=*/0));
    if (!leader() && !d.ParseFromString(bytes)) {
      return absl::DataLossError("rank 0 sent a malformed node directive");
    }
    if (d.kind() == v1::NodeDirective::STOP) break;
    if (d.kind() == v1::NodeDirective::FAIL) {
      return absl::UnavailableError(absl::StrCat("the node's leader failed: ", d.error()));
    }
    if (d.kind() == v1::NodeDirective::REJOIN) {
      ALOE_RETURN_IF_ERROR(Joined(d.joined()));
      continue;
    }
    const v1::Task& task = d.task();
    if (task.kind() == v1::Task::WAIT) {
      if (leader() && task.draining() && !server_draining_) {
        ALOE_LOG_INFO("worker", "server is draining (shutdown or restart): waiting for it");
      }
      server_draining_ = task.draining();
      continue;
    }
    if (task.kind() != v1::Task::TRAIN) {
      return absl::InvalidArgumentError(
          absl::StrFormat("a multi-rank node cannot run task kind %d", task.kind()));
    }
    absl::Status status = overlap_ != 0 && !overlap_refused_ ? TrainOverlapped(task) : Train(task);
    // Barrier: every rank's slice has been answered before the leader asks for the next task
    // (else the server, still missing a slice, would hand out this task again).
    ALOE_RETURN_IF_ERROR(node_->AllReduceSum(0).status());
    if (status.code() == absl::StatusCode::kFailedPrecondition ||
        status.code() == absl::StatusCode::kNotFound ||
        status.code() == absl::StatusCode::kUnavailable) {
      ALOE_LOG_WARNING("worker", "rank %d: task %d dropped: %s", node_->rank(), task.task_id(),
                       status.message());
      NoteDropped(task, status);
      continue;
    }
    if (!status.ok()) return LeaveAfter(status);
  }
  return Finish();
}

void Worker::Leave() {
  heartbeat_.reset();
  if (leader() && !need_join_) {
    absl::Status left = client_.Leave(joined_.worker_id());
    if (!left.ok()) ALOE_LOG_WARNING("worker", "leave: %s", left.ToString());
  }
}

absl::Status Worker::LeaveAfter(absl::Status error) {
  Leave();
  return error;
}

absl::Status Worker::Finish() {
  Leave();
  const double wall = rounds_ > 0 ? Seconds(first_task_, std::chrono::steady_clock::now()) : 0;
  ALOE_LOG_INFO("worker",
                "summary: rounds=%d steps=%d tokens=%d wall_seconds=%.2f compute_seconds=%.2f "
                "network_seconds=%.2f tokens_per_second=%.1f pushed_bytes=%d "
                "blocked_on_network=%.4f tasks_from_push_replies=%d",
                rounds_, steps_, tokens_, wall, compute_s_, network_s_,
                wall > 0 ? static_cast<double>(tokens_) / wall : 0.0, pushed_bytes_,
                wall > 0 ? network_s_ / wall : 0.0, tasks_from_push_replies_);
  return absl::OkStatus();
}

absl::Status Worker::Train(const v1::Task& task) {
  if (first_task_ == std::chrono::steady_clock::time_point{}) {
    first_task_ = std::chrono::steady_clock::now();
  }
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t pulled = 0;
  // A rank of a multi-rank node pulls, trains and pushes only its slice of every layer.
  const uint32_t slice = node_ != nullptr ? node_->rank() : 0;
  const uint32_t slices = node_ != nullptr ? node_->size() : 1;
  ALOE_RETURN_IF_ERROR(
      AgreeAcrossRanks(client_
                           .Pull(joined_.worker_id(), task.base_version(), /*latest=*/false,
                                 joined_.model_spec(), &base_, &pulled, slice, slices)
                           .status()));
  ReportPulled(task, slice, slices);
  const auto t1 = std::chrono::steady_clock::now();
  ALOE_ASSIGN_OR_RETURN(TrainStats stats, TrainRound(task, base_));
  const auto t2 = std::chrono::steady_clock::now();
  if (stats.steps == 0) return absl::OkStatus();
  uint64_t pushed = 0;
  v1::PushHeader header = HeaderFor(task, stats);
  // The node's leader asks for its next task: it comes with the reply when this rank's push is
  // the one that completes the update (always for one rank), saving a RequestTask round trip.
  header.set_want_next_task(leader());
  absl::StatusOr<v1::PushReply> reply = PushDelta(header, delta_, &pushed);
  const auto t3 = std::chrono::steady_clock::now();
  if (!reply.ok()) return reply.status();
  if (leader() && reply->has_next_task()) next_task_ = reply->next_task();
  ReportRound(task, stats, *reply, pulled, pushed, Seconds(t1, t2), Seconds(t0, t3),
              Seconds(t0, t1) + Seconds(t2, t3));
  return absl::OkStatus();
}

void Worker::ReportPulled(const v1::Task& task, uint32_t slice, uint32_t slices) {
  v1::HeartbeatRequest request;
  request.set_worker_id(joined_.worker_id());
  request.set_pulled_task_id(task.task_id());
  if (slices > 1) {
    request.set_pulled_slice(slice);
    request.set_pulled_slices(slices);
  }
  if (absl::StatusOr<v1::HeartbeatReply> reply = client_.Heartbeat(request); !reply.ok()) {
    ALOE_LOG_WARNING("worker", "could not report task %d's base version as pulled: %s",
                     task.task_id(), reply.status().message());
  }
}

absl::StatusOr<TrainStats> Worker::TrainRound(const v1::Task& task,
                                              const std::vector<std::vector<float>>& start) {
  ALOE_ASSIGN_OR_RETURN(const TokenSource* data, Shard(task.shard_file()));
  TrainRequest request;
  request.data = data;
  request.shard_name = task.shard_name();
  request.steps = task.local_steps();
  request.lr_step = task.lr_step();
  request.seed = task.seed();
  request.slowdown = absl::GetFlag(FLAGS_slowdown);
  request.time_budget_seconds = task.time_budget_seconds();
  request.interrupt = &g_interrupt;
  ALOE_RETURN_IF_ERROR(trainer_->SetParameters(start));
  ALOE_ASSIGN_OR_RETURN(TrainStats stats, trainer_->Train(request));
  if (stats.steps == 0) {
    // Stopped before the first step: nothing to push; leaving hands the task back.
    if (leader()) {
      ALOE_LOG_INFO("worker", "task %d abandoned before its first step (stopping)", task.task_id());
    }
    return stats;
  }
  if (stats.steps < task.local_steps() && task.time_budget_seconds() == 0 && leader()) {
    ALOE_LOG_INFO("worker", "stopping: pushing the %d of %d steps done", stats.steps,
                  task.local_steps());
  }
  ALOE_RETURN_IF_ERROR(trainer_->PseudoGradient(start, &delta_));
  return stats;
}

v1::PushHeader Worker::HeaderFor(const v1::Task& task, const TrainStats& stats) {
  v1::PushHeader header;
  header.set_worker_id(joined_.worker_id());
  header.set_task_id(task.task_id());
  header.set_update_id(++update_id_);
  header.set_base_version(task.base_version());
  header.set_steps_done(stats.steps);
  header.set_tokens_learned(stats.tokens);
  header.set_train_loss(stats.mean_loss);
  header.set_compute_seconds(stats.compute_seconds);
  header.set_codec(v1::CODEC_FP32);
  if (node_ != nullptr && node_->size() > 1) {
    header.set_slice(node_->rank());
    header.set_slices(node_->size());
  }
  return header;
}

absl::StatusOr<v1::PushReply> Worker::PushDelta(const v1::PushHeader& header,
                                                std::vector<std::vector<float>>& delta,
                                                uint64_t* pushed) {
  const v1::TransportConfig& transport = joined_.transport();
  if (transport.error_feedback() && !residual_.empty()) {
    // Error feedback: what earlier rounds' quantisation lost is sent now.
    for (size_t l = 0; l < delta.size(); ++l) {
      kernels::WeightedAccumulate(residual_[l].data(), 1.0f, delta[l].data(), delta[l].size());
    }
  }
  return client_.Push(header, joined_.model_spec(), delta, codecs_,
                      std::max<uint32_t>(1, transport.int8_block_size()),
                      transport.error_feedback() ? &residual_ : nullptr, pushed);
}

void Worker::ReportRound(const v1::Task& task, const TrainStats& stats, const v1::PushReply& reply,
                         uint64_t pulled, uint64_t pushed, double train_s, double round_s,
                         double network_s) {
  ++rounds_;
  steps_ += stats.steps;
  tokens_ += stats.tokens;
  compute_s_ += stats.compute_seconds;
  network_s_ += network_s;
  pushed_bytes_ += pushed;
  if (!leader()) return;  // rank 0 reports for the node
  // Wall time of the steps (an emulated --slowdown included): what DyLU should plan with.
  heartbeat_->Set(joined_.worker_id(), train_s > 0 ? stats.steps / train_s : 0);
  metrics_.Set(kLoss, stats.mean_loss);
  metrics_.Set(kTokensPerSecond, stats.tokens / round_s);
  if (stats.compute_seconds > 0) {
    metrics_.Set(kModelFlops, stats.tokens / stats.compute_seconds * flops_per_token_);
  }
  metrics_.Set(kStepsPerRound, stats.steps);
  metrics_.Set(kModelVersion, static_cast<double>(task.base_version()));
  metrics_.Add(kSteps, stats.steps);
  metrics_.Add(kTokens, static_cast<double>(stats.tokens));
  metrics_.Add(kRounds, 1);
  metrics_.Add(kPulledBytes, static_cast<double>(pulled));
  metrics_.Add(kPushedBytes, static_cast<double>(pushed));
  metrics_.Add(kComputeSeconds, stats.compute_seconds);
  metrics_.Add(kNetworkSeconds, network_s);
  std::string outcome;
  if (reply.applied()) {
    outcome = absl::StrFormat(" -> version %d", reply.version());
  } else if (reply.staged()) {
    outcome = absl::StrFormat(" (%d of %d slices in)", reply.slices_received(),
                              node_ != nullptr ? node_->size() : 1);
  }
  ALOE_LOG_INFO("worker",
                "round %d: version %d shard %s steps %d loss %.4f tokens/s %.0f "
                "(compute %.2fs, network %.3fs)%s",
                rounds_, task.base_version(), task.shard_name(), stats.steps, stats.mean_loss,
                stats.tokens / round_s, stats.compute_seconds, network_s, outcome);
}

absl::Status Worker::AgreeAcrossRanks(absl::Status status) {
  if (node_ == nullptr) return status;
  ALOE_ASSIGN_OR_RETURN(const double failed, node_->AllReduceSum(status.ok() ? 0 : 1));
  if (!status.ok() || failed == 0) return status;
  return absl::UnavailableError(
      absl::StrFormat("%d other rank(s) of this node failed; the node drops the round together",
                      static_cast<int>(failed)));
}

// What the background half of an overlapped round did: the previous round's push, the
// look-ahead task and the pull of its base.
struct Worker::Communicated {
  std::optional<absl::StatusOr<v1::PushReply>> push;
  uint64_t pushed = 0;
  absl::StatusOr<v1::Task> next = absl::UnknownError("not asked");
  std::vector<std::vector<float>> base;
  uint64_t pulled = 0;
};

Worker::Communicated Worker::Communicate(const v1::PushHeader* header,
                                         std::vector<std::vector<float>>* delta) {
  Communicated c;
  if (header != nullptr) c.push = PushDelta(*header, *delta, &c.pushed);
  const bool pushed = !c.push.has_value() || c.push->ok();
  if (control_ == nullptr) {
    if (!pushed) return c;
    c.next = client_.RequestTask(joined_.worker_id(), /*ahead=*/true);
  } else {
    // Every rank's slice is in (or one failed) before the leader asks; then it tells the others.
    absl::StatusOr<double> failed = control_->AllReduceSum(pushed ? 0 : 1);
    if (!failed.ok()) {
      c.next = failed.status();
      return c;
    }
    v1::NodeDirective d;
    std::string bytes;
    if (leader()) {
      absl::StatusOr<v1::Task> next =
          *failed > 0 ? absl::UnavailableError("a rank's push failed")
                      : client_.RequestTask(joined_.worker_id(), /*ahead=*/true);
      if (next.ok()) {
        d.set_kind(v1::NodeDirective::TASK);
        *d.mutable_task() = *std::move(next);
      } else {
        d.set_kind(v1::NodeDirective::FAIL);
        d.set_error(next.status().ToString());
      }
      d.SerializeToString(&bytes);
    }
    if (absl::Status told = control_->Broadcast(&bytes, /*root=*/0); !told.ok()) {
      c.next = told;
      return c;
    }
    if (!leader() && !d.ParseFromString(bytes)) {
      c.next = absl::DataLossError("rank 0 sent a malformed look-ahead directive");
      return c;
    }
    c.next = d.kind() == v1::NodeDirective::TASK
                 ? absl::StatusOr<v1::Task>(d.task())
                 : absl::StatusOr<v1::Task>(absl::UnavailableError(d.error()));
  }
  if (c.next.ok() && c.next->kind() == v1::Task::TRAIN) {
    const uint32_t slice = node_ != nullptr ? node_->rank() : 0;
    const uint32_t slices = node_ != nullptr ? node_->size() : 1;
    absl::Status pulled =
        client_
            .Pull(joined_.worker_id(), c.next->base_version(),
                  /*latest=*/false, joined_.model_spec(), &c.base, &c.pulled, slice, slices)
            .status();
    if (!pulled.ok()) {
      c.next = pulled;
    } else {
      ReportPulled(*c.next, slice, slices);
    }
  }
  return c;
}

absl::Status Worker::TrainOverlapped(v1::Task task) {
  if (first_task_ == std::chrono::steady_clock::time_point{}) {
    first_task_ = std::chrono::steady_clock::now();
  }
  // A rank of a multi-rank node pulls, trains and pushes only its slice of every layer.
  const uint32_t slice = node_ != nullptr ? node_->rank() : 0;
  const uint32_t slices = node_ != nullptr ? node_->size() : 1;
  const auto pull0 = std::chrono::steady_clock::now();
  uint64_t pulled = 0;
  ALOE_RETURN_IF_ERROR(
      AgreeAcrossRanks(client_
                           .Pull(joined_.worker_id(), task.base_version(), /*latest=*/false,
                                 joined_.model_spec(), &base_, &pulled, slice, slices)
                           .status()));
  ReportPulled(task, slice, slices);
  double pull_s = Seconds(pull0, std::chrono::steady_clock::now());
  std::vector<std::vector<float>> start = base_;
  // The previous round, pushed in the background while this one trains.
  struct Pending {
    v1::Task task;
    v1::PushHeader header;
    std::vector<std::vector<float>> delta;
    TrainStats stats;
    uint64_t pulled = 0;
    double train = 0;    // its training time
    double seconds = 0;  // its training time plus the waits for the network
    double blocked = 0;  // of which waiting for the network
  };
  std::optional<Pending> pending;
  while (true) {
    // The background thread owns `previous` (its delta and error-feedback residual) until get().
    std::optional<Pending> previous = std::move(pending);
    pending.reset();
    Pending* const push = previous.has_value() ? &*previous : nullptr;
    std::future<Communicated> background = std::async(std::launch::async, [this, push] {
      return push != nullptr ? Communicate(&push->header, &push->delta)
                             : Communicate(nullptr, nullptr);
    });
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<TrainStats> stats = TrainRound(task, start);
    const auto t1 = std::chrono::steady_clock::now();
    Communicated c = background.get();
    const double blocked = Seconds(t1, std::chrono::steady_clock::now());
    if (previous.has_value()) {
      // The previous round's push was answered while this round trained.
      previous->blocked += blocked;
      if (!c.push->ok()) {
        ALOE_LOG_WARNING("worker", "task %d dropped: %s", previous->task.task_id(),
                         c.push->status().message());
        network_s_ += previous->blocked;
      } else {
        ReportRound(previous->task, previous->stats, **c.push, previous->pulled, c.pushed,
                    previous->train, previous->seconds + blocked, previous->blocked);
      }
    } else {
      network_s_ += blocked;
    }
    if (!stats.ok()) return stats.status();
    if (node_ == nullptr && c.push.has_value() && !c.push->ok() &&
        c.push->status().code() == absl::StatusCode::kNotFound) {
      return c.push->status();  // the lease is gone: the caller joins again
    }
    if (stats->steps == 0) return absl::OkStatus();  // stopping before the first step (all ranks)
    pending = Pending{task,   HeaderFor(task, *stats), std::move(delta_),        *stats,
                      pulled, Seconds(t0, t1),         Seconds(t0, t1) + pull_s, pull_s};
    pull_s = 0;
    bool next_train = c.next.ok() && c.next->kind() == v1::Task::TRAIN &&
                      c.next->task_id() != task.task_id() && g_signal.load() == 0;
    if (node_ != nullptr) {
      // The ranks go on together or not at all (a rank's pull failed, a rank is stopping).
      ALOE_ASSIGN_OR_RETURN(const double against, node_->AllReduceSum(next_train ? 0 : 1));
      next_train = against == 0;
    }
    if (!next_train) {
      // No task ahead (stopping, draining, a server without look-ahead, an error): this round
      // is pushed now and the caller asks for work as usual.
      if (c.next.ok() && c.next->kind() == v1::Task::WAIT && !c.next->draining() &&
          !overlap_refused_) {
        overlap_refused_ = true;
        if (leader()) {
          ALOE_LOG_WARNING("worker",
                           "the server hands out no look-ahead tasks (sync rounds or a grace "
                           "window): --overlap is off from now on");
        }
      }
      const auto p0 = std::chrono::steady_clock::now();
      uint64_t pushed = 0;
      absl::StatusOr<v1::PushReply> reply = PushDelta(pending->header, pending->delta, &pushed);
      const double push_s = Seconds(p0, std::chrono::steady_clock::now());
      if (!reply.ok()) return reply.status();
      ReportRound(pending->task, pending->stats, *reply, pending->pulled, pushed, pending->train,
                  pending->seconds + push_s, pending->blocked + push_s);
      return absl::OkStatus();
    }
    // The next round starts from the newest global model, which lacks this round's update
    // (one-step delay); eager applies it locally at once, scaled by the outer lr, and the global
    // model that includes it replaces this proxy one round later (paper 004). A rank does so on
    // its slices.
    task = *std::move(c.next);
    start = std::move(c.base);
    pulled = c.pulled;
    if (overlap_ == 2) {
      const float lr = joined_.outer_optimizer().lr();
      for (size_t l = 0; l < start.size(); ++l) {
        kernels::WeightedAccumulate(pending->delta[l].data(), -lr, start[l].data(),
                                    start[l].size());
      }
    }
  }
}

absl::Status Worker::Evaluate(const v1::Task& task) {
  uint64_t pulled = 0;
  ALOE_ASSIGN_OR_RETURN(uint64_t version,
                        client_.Pull(joined_.worker_id(), task.base_version(), /*latest=*/false,
                                     joined_.model_spec(), &base_, &pulled));
  ALOE_RETURN_IF_ERROR(trainer_->SetParameters(base_));
  ALOE_ASSIGN_OR_RETURN(const TokenSource* heldout, Shard(joined_.heldout_file()));
  EvalRequest eval;
  eval.heldout = heldout;
  eval.max_sequences = absl::GetFlag(FLAGS_eval_sequences);
  ALOE_ASSIGN_OR_RETURN(double loss, trainer_->Evaluate(eval));
  const uint64_t seq = joined_.model().seq_len();
  const uint64_t windows =
      std::min<uint64_t>(absl::GetFlag(FLAGS_eval_sequences), heldout->num_tokens() / (seq + 1));
  v1::EvalReport report;
  report.set_worker_id(joined_.worker_id());
  report.set_task_id(task.task_id());
  report.set_version(version);
  report.set_loss(loss);
  report.set_tokens(std::max<uint64_t>(1, windows * seq));
  ALOE_RETURN_IF_ERROR(client_.ReportEval(report));
  metrics_.Set(kEvalLoss, loss);
  metrics_.Set(kModelVersion, static_cast<double>(version));
  metrics_.Add(kPulledBytes, static_cast<double>(pulled));
  ALOE_LOG_INFO("worker", "eval version %d: loss %.4f perplexity %.2f", version, loss,
                std::exp(loss));
  return absl::OkStatus();
}

absl::Status Main() {
  const std::string role = absl::GetFlag(FLAGS_role);
  if (role != "trainer" && role != "evaluator") {
    return absl::InvalidArgumentError(
        absl::StrFormat("--role must be trainer or evaluator, got \"%s\"", role));
  }
  if (!(absl::GetFlag(FLAGS_slowdown) >= 1.0) || !std::isfinite(absl::GetFlag(FLAGS_slowdown))) {
    return absl::InvalidArgumentError("--slowdown must be a finite number >= 1");
  }
  if (absl::GetFlag(FLAGS_threads) < 1) return absl::InvalidArgumentError("--threads must be >= 1");
  if (absl::GetFlag(FLAGS_eval_sequences) < 1) {
    return absl::InvalidArgumentError("--eval_sequences must be >= 1");
  }
  const int nproc = absl::GetFlag(FLAGS_nproc);
  const int rank = absl::GetFlag(FLAGS_rank);
  const std::string overlap = absl::GetFlag(FLAGS_overlap);
  if (overlap != "off" && overlap != "delayed" && overlap != "eager") {
    return absl::InvalidArgumentError(
        absl::StrFormat("--overlap must be off, delayed or eager, got \"%s\"", overlap));
  }
  if (absl::GetFlag(FLAGS_autocast) != "off" && absl::GetFlag(FLAGS_autocast) != "bf16") {
    return absl::InvalidArgumentError(absl::StrFormat("--autocast must be off or bf16, got \"%s\"",
                                                      absl::GetFlag(FLAGS_autocast)));
  }
  if (overlap != "off" && role != "trainer") {
    return absl::InvalidArgumentError("--overlap is for trainers (not evaluators)");
  }
  if (nproc < 1 || nproc > static_cast<int>(kMaxSlices)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--nproc must be in [1, %d], got %d", kMaxSlices, nproc));
  }
  if (nproc > 1) {
    if (role != "trainer") return absl::InvalidArgumentError("--nproc > 1 is for trainers only");
    if (absl::GetFlag(FLAGS_slowdown) != 1.0) {
      return absl::InvalidArgumentError("--slowdown is not supported with --nproc > 1");
    }
    if (rank >= nproc || (rank >= 0 && absl::GetFlag(FLAGS_rendezvous).empty())) {
      return absl::InvalidArgumentError("--rank and --rendezvous are set by --nproc, not by hand");
    }
  } else if (rank >= 0) {
    return absl::InvalidArgumentError("--rank is set by --nproc > 1, not by hand");
  }
  std::string device = absl::GetFlag(FLAGS_device);
  if (nproc > 1 && (device == "cuda" || (device == "auto" && VisibleGpus() > 0))) {
    // One GPU per rank (with none, SetTrainerDevice says why).
    if (VisibleGpus() > 0 && VisibleGpus() < nproc) {
      return absl::FailedPreconditionError(
          absl::StrFormat("--nproc %d on GPUs needs a GPU per rank; LibTorch sees %d (give "
                          "--device cpu to train on the CPU)",
                          nproc, VisibleGpus()));
    }
    if (VisibleGpus() > 0) device = absl::StrCat("cuda:", rank);
  } else if (nproc > 1 && absl::StartsWith(device, "cuda:")) {
    return absl::InvalidArgumentError(
        "--device cuda:I is for one-process workers; with --nproc N give --device cuda (rank r "
        "trains on GPU r)");
  }
  absl::StatusOr<std::string> chosen = SetTrainerDevice(device);
  if (!chosen.ok()) {
    return absl::Status(chosen.status().code(), absl::StrCat("--", chosen.status().message()));
  }
  ALOE_LOG_INFO("worker", "%straining on %s",
                nproc > 1 ? absl::StrFormat("rank %d: ", rank) : std::string(), *chosen);
  SetTrainerThreads(absl::GetFlag(FLAGS_threads));
  SetTrainerAutocastBf16(absl::GetFlag(FLAGS_autocast) == "bf16");
  ConfigureAllocatorForTraining();
  std::unique_ptr<MetricsSink> metrics;
  if (absl::GetFlag(FLAGS_metrics) == "off") {
    metrics = std::make_unique<NullMetrics>();
  } else {
    ALOE_ASSIGN_OR_RETURN(auto prometheus, PrometheusMetrics::Start(absl::GetFlag(FLAGS_metrics),
                                                                    WorkerMetricCatalogue()));
    ALOE_LOG_INFO("worker", "metrics on port %d", prometheus->port());
    metrics = std::move(prometheus);
  }
  // Heterogeneous fleets: dashboards label each worker's speed with its hardware.
  metrics->Set(kInfo, 1, {*chosen, absl::GetFlag(FLAGS_autocast), absl::StrCat(nproc)});
  ClientOptions options;
  options.address = absl::GetFlag(FLAGS_server);
  options.raw_push = absl::GetFlag(FLAGS_raw_push);
  auto read = [](const char* what, const std::string& path, std::string* out) -> absl::Status {
    if (path.empty()) return absl::OkStatus();
    std::ifstream in(path);
    if (!in) return absl::NotFoundError(absl::StrCat(what, " ", path, ": cannot open"));
    std::stringstream buffer;
    buffer << in.rdbuf();
    *out = buffer.str();
    return absl::OkStatus();
  };
  ALOE_RETURN_IF_ERROR(read("--token_file", absl::GetFlag(FLAGS_token_file), &options.token));
  options.token =
      std::string(absl::StripAsciiWhitespace(options.token.substr(0, options.token.find('\n'))));
  ALOE_RETURN_IF_ERROR(
      read("--tls_ca_file", absl::GetFlag(FLAGS_tls_ca_file), &options.tls_ca_pem));
  ALOE_RETURN_IF_ERROR(
      read("--tls_cert_file", absl::GetFlag(FLAGS_tls_cert_file), &options.tls_cert_pem));
  ALOE_RETURN_IF_ERROR(
      read("--tls_key_file", absl::GetFlag(FLAGS_tls_key_file), &options.tls_key_pem));
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  ServerClient client(options);
  std::vector<std::unique_ptr<Collectives>> groups;
  if (nproc > 1) {
    // With --overlap a second group carries the background communication beside training.
    ALOE_ASSIGN_OR_RETURN(groups, ConnectNodeGroups(absl::GetFlag(FLAGS_rendezvous), rank, nproc,
                                                    overlap == "off" ? 1 : 2));
    ALOE_LOG_INFO("worker", "rank %d of %d connected", rank, nproc);
  }
  Worker worker(client, *metrics, groups.empty() ? nullptr : groups[0].get(),
                groups.size() > 1 ? groups[1].get() : nullptr);
  return worker.Run();
}

}  // namespace
}  // namespace aloe::worker

int main(int argc, char** argv) {
  // Pulled models and pushed pseudo-gradients are megabytes each (may re-execute once).
  aloe::KeepLargeBuffersInHeap(argv);
  // Debian's abseil is built without NDEBUG, so every absl::Mutex lock would run deadlock
  // detection (a lock-order graph update); the tests keep it, the daemons skip the cost.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  aloe::SetUsage(
      "aloe-worker --server HOST:PORT [--role trainer|evaluator] [flags]\n"
      "Training daemon for ALOE: joins aloe-server, pulls the global model, trains H local AdamW\n"
      "steps per task with LibTorch and pushes the pseudo-gradient; as an evaluator it reports\n"
      "held-out loss of new model versions. On SIGINT/SIGTERM it ends the current round at the\n"
      "next step end, pushes the steps done, leaves and exits.");
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_nproc) > 1 && absl::GetFlag(FLAGS_rank) < 0) {
    // The launcher of a multi-rank node: every rank is a copy of this binary.
    absl::StatusOr<int> code = aloe::worker::LaunchRanks(argc, argv, absl::GetFlag(FLAGS_nproc));
    if (!code.ok()) {
      ALOE_LOG_ERROR("worker", "%s", code.status().ToString());
      return 1;
    }
    return *code;
  }
  signal(SIGINT, aloe::worker::OnSignal);
  signal(SIGTERM, aloe::worker::OnSignal);
  absl::Status status = aloe::worker::Main();
  if (!status.ok()) {
    ALOE_LOG_ERROR("worker", "%s", status.ToString());
    return 1;
  }
  return 0;
}
