// aloe-worker: one training daemon per node. Turns flags into the agent's options, builds the
// gRPC client and the trainer, and runs the agent (worker/agent.h) until it is done.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/allocator.h"
#include "common/clock.h"
#include "common/flags_usage.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/status_macros.h"
#include "common/step_times.h"
#include "worker/agent.h"
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
ABSL_FLAG(double, slowdown, 1.0, "Emulate slower hardware: sleep (slowdown-1) x each step's time");
ABSL_FLAG(std::string, step_trace, "", "Replay an aloe-sim --trace file (docs/simulations.md)");
ABSL_FLAG(int32_t, trace_worker, 0, "This worker's index in --step_trace");
ABSL_FLAG(std::string, metrics, "127.0.0.1:0", "Prometheus endpoint host:port, or 'off'");
ABSL_FLAG(int32_t, eval_sequences, 64, "Held-out sequences per evaluation (evaluator role)");
ABSL_FLAG(double, connect_timeout, 60, "Seconds to keep retrying while the server is unreachable");
ABSL_FLAG(double, join_wait, 600,
          "Seconds to keep asking to join, every 5 s, while the server has no room; 0 = exit");
ABSL_FLAG(std::string, token_file, "", "File whose first line is this worker's access token");
ABSL_FLAG(std::string, tls_ca_file, "", "PEM CA that signed the server certificate (enables TLS)");
ABSL_FLAG(std::string, tls_cert_file, "", "PEM client certificate chain (mutual TLS)");
ABSL_FLAG(std::string, tls_key_file, "", "PEM client private key (mutual TLS)");
ABSL_FLAG(std::string, tls_server_name, "", "Name to verify in the server certificate");
ABSL_FLAG(int32_t, pull_streams, 1,
          "Pull from a single-process server in N parts on N connections (long, fast links)");
ABSL_FLAG(bool, raw_push, true, "Push layers over TCP (TLS with a CA) to shard processes");
ABSL_FLAG(int32_t, nproc, 1,
          "Ranks of this node (trainers): N > 1 trains one replica with FSDP over N processes "
          "(NCCL on GPUs, Gloo on the CPU), each holding, pulling and pushing 1/N of every "
          "layer; inner_optimizer.batch_size is the node's batch, a multiple of N");
ABSL_FLAG(std::string, device, "auto",
          "auto | cpu | cuda | cuda:I: where the inner loop trains; auto: GPU 0 when LibTorch "
          "sees one, else the CPU; with --nproc N rank r trains on GPU r (docs/operations.md)");
ABSL_FLAG(std::string, overlap, "off",
          "off | delayed | eager: push round r and pull the next model in the background while "
          "round r+1 trains (one-step delay); eager also applies round r's pseudo-gradient "
          "locally at once until the global model with it arrives (paper 004). Any aggregation "
          "policy; with --nproc N every rank does this for its slices. With layer groups "
          "(partial_sync), the next task is taken ahead and trains while the last group push "
          "of a task travels");
ABSL_FLAG(std::string, round_boundary, "auto",
          "auto | host | device: with --overlap, where the boundary between two rounds runs. "
          "device: the round's base and pseudo-gradient stay on the training device and move "
          "to and from the host on copy streams beside training (three more model copies on the "
          "device); host: through host buffers, the device waiting. auto: device on a GPU. A "
          "multi-rank node (--nproc > 1) uses host");
ABSL_FLAG(std::string, autocast, "off",
          "off | bf16: forward passes of training steps under LibTorch's bf16 autocast; "
          "parameters, gradients, AdamW state, pseudo-gradients and evaluation stay float32");
ABSL_FLAG(bool, cuda_graphs, true,
          "On a GPU: run the built-in transformer's inner step as one CUDA graph, captured after "
          "3 eager steps and replayed (one launch a step instead of one per kernel; the same "
          "arithmetic). Needs a CUDA LibTorch >= 2.3; single-process trainers only. false: "
          "launch every kernel");
ABSL_FLAG(std::string, attention, "auto",
          "auto | flash | cudnn | efficient | math: the kernel of the built-in transformer's "
          "fused attention (LibTorch 2.x). auto: LibTorch's choice; flash: FlashAttention (16-bit "
          "inputs: with --autocast bf16 on a GPU); cudnn: cuDNN's (a GPU, LibTorch >= 2.4, "
          "16-bit inputs); efficient: the memory-efficient kernel (a GPU); math: unfused. A "
          "kernel that cannot take the model is refused, naming why, before training");
ABSL_FLAG(std::string, torchscript, "",
          "Bring-your-own model: a TorchScript file whose forward(inputs) returns logits or "
          "forward(inputs, targets) the loss; the server trains aloe-import-model's import of it");
ABSL_FLAG(std::string, state_dir, "",
          "Keep the AdamW inner optimizer state here between runs (one file per rank, replaced "
          "atomically): a worker restarted after a kill or preemption trains on with its "
          "moments instead of fresh ones. Empty: not kept");
ABSL_FLAG(int32_t, state_every_rounds, 1,
          "With --state_dir: save the inner optimizer state after every this many rounds (and "
          "when the worker leaves)");
ABSL_FLAG(int32_t, rank, -1, "Internal (set by --nproc): this process' rank in the node");
ABSL_FLAG(std::string, rendezvous, "", "Internal (set by --nproc): the node's rendezvous file");

namespace aloe::worker {
namespace {

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop.store(true); }

absl::StatusOr<AgentOptions> OptionsFromFlags() {
  AgentOptions o;
  const std::string role = absl::GetFlag(FLAGS_role);
  const std::string overlap = absl::GetFlag(FLAGS_overlap);
  const std::string autocast = absl::GetFlag(FLAGS_autocast);
  const std::string boundary = absl::GetFlag(FLAGS_round_boundary);
  const bool many = absl::GetFlag(FLAGS_nproc) > 1;
  const bool traced = !absl::GetFlag(FLAGS_step_trace).empty();
  o.name = absl::GetFlag(FLAGS_name);
  o.evaluator = role == "evaluator";
  o.threads = absl::GetFlag(FLAGS_threads);
  o.slowdown = absl::GetFlag(FLAGS_slowdown);
  o.eval_sequences = std::max(0, absl::GetFlag(FLAGS_eval_sequences));
  o.corpus_dir = absl::GetFlag(FLAGS_corpus_dir);
  o.state_dir = absl::GetFlag(FLAGS_state_dir);
  o.state_every_rounds =
      static_cast<uint32_t>(std::max(0, absl::GetFlag(FLAGS_state_every_rounds)));
  o.connect_timeout = absl::Seconds(absl::GetFlag(FLAGS_connect_timeout));
  o.join_wait = absl::Seconds(absl::GetFlag(FLAGS_join_wait));
  o.overlap = overlap == "eager"     ? AgentOptions::Overlap::kEager
              : overlap == "delayed" ? AgentOptions::Overlap::kDelayed
                                     : AgentOptions::Overlap::kOff;
  o.round_boundary = boundary == "host"     ? AgentOptions::Boundary::kHost
                     : boundary == "device" ? AgentOptions::Boundary::kDevice
                                            : AgentOptions::Boundary::kAuto;
  const std::pair<bool, std::string> refusals[] = {
      {role != "trainer" && !o.evaluator,
       absl::StrFormat("--role must be trainer or evaluator, got \"%s\"", role)},
      {overlap != "off" && overlap != "delayed" && overlap != "eager",
       absl::StrFormat("--overlap must be off, delayed or eager, got \"%s\"", overlap)},
      {boundary != "auto" && boundary != "host" && boundary != "device",
       absl::StrFormat("--round_boundary must be auto, host or device, got \"%s\"", boundary)},
      {autocast != "off" && autocast != "bf16",
       absl::StrFormat("--autocast must be off or bf16, got \"%s\"", autocast)},
      {many && o.evaluator, "--nproc > 1 is for trainers only"},
      {many && o.slowdown != 1.0, "--slowdown is not supported with --nproc > 1"},
      {absl::GetFlag(FLAGS_pull_streams) < 1, "--pull_streams must be at least 1"},
      {traced && (many || o.evaluator), "--step_trace is for single-process trainers"},
  };
  for (const auto& [refused, message] : refusals) {
    if (refused) return absl::InvalidArgumentError(message);
  }
  ALOE_RETURN_IF_ERROR(ValidateAgentOptions(o));
  return o;
}

absl::StatusOr<int> Main() {
  ALOE_ASSIGN_OR_RETURN(AgentOptions options, OptionsFromFlags());
  const int nproc = absl::GetFlag(FLAGS_nproc);
  const int rank = absl::GetFlag(FLAGS_rank);
  ALOE_ASSIGN_OR_RETURN(const std::string device,
                        SetRankDevice(absl::GetFlag(FLAGS_device), nproc, rank,
                                      !absl::GetFlag(FLAGS_rendezvous).empty()));
  SetTrainerThreads(options.threads);
  SetTrainerAutocastBf16(absl::GetFlag(FLAGS_autocast) == "bf16");
  SetTrainerCudaGraphs(absl::GetFlag(FLAGS_cuda_graphs));
  ALOE_ASSIGN_OR_RETURN(const AttentionKernel attention,
                        ParseAttentionKernel(absl::GetFlag(FLAGS_attention)));
  ALOE_RETURN_IF_ERROR(SetAttentionKernel(attention));
  ConfigureAllocatorForTraining();
  ALOE_ASSIGN_OR_RETURN(std::unique_ptr<MetricsSink> metrics,
                        StartWorkerMetrics(absl::GetFlag(FLAGS_metrics)));
  // Heterogeneous fleets: dashboards label each worker's speed with its hardware.
  metrics->Set(kInfo, 1, {device, absl::GetFlag(FLAGS_autocast), absl::StrCat(nproc)});
  ClientOptions client_options;
  client_options.address = absl::GetFlag(FLAGS_server);
  client_options.raw_push = absl::GetFlag(FLAGS_raw_push);
  client_options.pull_streams = static_cast<uint32_t>(absl::GetFlag(FLAGS_pull_streams));
  client_options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  ALOE_RETURN_IF_ERROR(
      LoadClientFiles({absl::GetFlag(FLAGS_token_file), absl::GetFlag(FLAGS_tls_ca_file),
                       absl::GetFlag(FLAGS_tls_cert_file), absl::GetFlag(FLAGS_tls_key_file)},
                      &client_options));
  ServerClient client(client_options);
  // With --overlap a second group carries the background communication beside training.
  ALOE_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Collectives>> groups,
                        ConnectRank(absl::GetFlag(FLAGS_rendezvous), rank, nproc,
                                    options.overlap == AgentOptions::Overlap::kOff ? 1 : 2));
  options.model_source = absl::GetFlag(FLAGS_torchscript);
  ALOE_ASSIGN_OR_RETURN(ScriptModelPtr script,
                        OpenScriptModel(options.model_source, &options.model_fingerprint));
  if (script)
    ALOE_LOG_INFO("worker", "model %s: %s", options.model_source, options.model_fingerprint);
  ALOE_ASSIGN_OR_RETURN(
      std::optional<StepSlowdowns> slowdowns,
      LoadStepSlowdowns(absl::GetFlag(FLAGS_step_trace), absl::GetFlag(FLAGS_trace_worker)));
  // Workers that lost a server or shard process together retry out of step; the ranks of a node
  // wait alike (their rendezvous file is the node's).
  const std::string rendezvous = absl::GetFlag(FLAGS_rendezvous);
  options.retry_seed = !rendezvous.empty()
                           ? std::hash<std::string>()(rendezvous)
                           : static_cast<uint64_t>(getpid()) * 0x9E3779B97F4A7C15ull +
                                 static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
  RealClock clock;
  AgentEnv env;
  env.server = &client;
  env.metrics = metrics.get();
  env.clock = &clock;
  env.sleep = [](absl::Duration d) { SleepUnlessStopped(d, g_stop); };
  env.stop = &g_stop;
  env.node = groups.empty() ? nullptr : groups[0].get();
  env.control = groups.size() > 1 ? groups[1].get() : nullptr;
  env.make_trainer = [&script, &slowdowns, node = env.node](const v1::JoinReply& joined) {
    return TrainerFor(joined, std::move(script), node, slowdowns);
  };
  Agent agent(std::move(options), std::move(env));
  ALOE_RETURN_IF_ERROR(agent.Run());
  return 0;
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
      "steps per task and pushes the pseudo-gradient; an evaluator reports held-out loss. On\n"
      "SIGINT/SIGTERM it ends the round at the next step end, pushes it, leaves and exits.");
  absl::ParseCommandLine(argc, argv);
  // The launcher of a multi-rank node starts the ranks, each a copy of this binary.
  const bool launcher = absl::GetFlag(FLAGS_nproc) > 1 && absl::GetFlag(FLAGS_rank) < 0;
  if (!launcher) {
    signal(SIGINT, aloe::worker::OnSignal);
    signal(SIGTERM, aloe::worker::OnSignal);
  }
  absl::StatusOr<int> code = launcher
                                 ? aloe::worker::LaunchRanks(argc, argv, absl::GetFlag(FLAGS_nproc))
                                 : aloe::worker::Main();
  if (!code.ok()) {
    ALOE_LOG_ERROR("worker", "%s", code.status().ToString());
    return 1;
  }
  return *code;
}
