// What the worker agent (worker/agent.h) is told, AgentOptions, and what it is given to work
// with, AgentEnv: every dependency injected, so that tests run it against fakes.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "common/token_source.h"
#include "common/trainer_interface.h"
#include "proto/aloe.pb.h"
#include "worker/server_api.h"
#include "worker/sleeper.h"

namespace aloe::worker {

class Collectives;  // worker/fsdp.h

struct AgentOptions {
  std::string name;        // shown by the server (JoinRequest.name)
  bool evaluator = false;  // evaluator instead of trainer
  int32_t threads = 1;     // JoinRequest.num_threads
  // TrainRequest.slowdown: >= 1 emulates slower hardware (single-process trainers only).
  double slowdown = 1.0;
  uint32_t eval_sequences = 64;  // held-out windows per evaluation
  // Where a task's data shard file lives (Task.shard_file is relative to it); named in the
  // error when one is missing.
  std::string corpus_dir = "data/sotu";
  // How long calls that fail with kUnavailable (server restarting, not yet up) are retried,
  // and how often: RetryBackoff from retry_interval, doubling up to retry_max.
  absl::Duration connect_timeout = absl::Seconds(60);
  absl::Duration retry_interval = absl::Milliseconds(250);
  absl::Duration retry_max = absl::Seconds(5);
  // The jitter of every retry wait (RetryBackoff::Options::jitter) and its seed: workers that
  // share a seed wait alike.
  double retry_jitter = 0.5;
  uint64_t retry_seed = 0;
  // How long to keep asking to join while the server has no room (kResourceExhausted), and how
  // often; zero = give up at once.
  absl::Duration join_wait = absl::Seconds(600);
  absl::Duration join_wait_step = absl::Seconds(5);
  // Waits between consecutive dropped tasks (RetryBackoff; the first drop after a completed
  // round is asked again at once); a round that completes resets it.
  absl::Duration drop_backoff_initial = absl::Milliseconds(100);
  absl::Duration drop_backoff_max = absl::Seconds(5);
  // At most one log line per this interval about tasks dropped for want of the server
  // (kUnavailable); the others are logged each.
  absl::Duration drop_log_interval = absl::Seconds(10);
  // Overlapped rounds (paper 004): a round's push and the next pull run while the next round
  // trains; eager also applies the round's pseudo-gradient locally at once.
  enum class Overlap { kOff, kDelayed, kEager };
  Overlap overlap = Overlap::kOff;
  // Where an overlapped round's boundary runs (common/trainer_interface.h RoundBoundary): on the
  // trainer's device (its own device_round_boundary(), e.g. a GPU's buffers and copy streams),
  // or on the host (SetParameters and PseudoGradient). kAuto: the device when the trainer trains
  // on a GPU (worker/trainer.h TrainerDevice). A trainer without one runs it on the host.
  enum class Boundary { kAuto, kHost, kDevice };
  Boundary round_boundary = Boundary::kAuto;
  // JoinRequest.model_fingerprint: a bring-your-own model's architecture fingerprint, "" for the
  // built-in transformer; the join reply must name the same. model_source names the model in
  // the error when it does not (e.g. the TorchScript file).
  std::string model_fingerprint;
  std::string model_source;
  // Where the trainer's inner optimizer state is kept between runs (worker/inner_state_store.h);
  // empty = nowhere: a restarted worker starts from fresh moments. Saved after every
  // `state_every_rounds` rounds trained and when the worker leaves; restored at the first join
  // when it belongs to this model and rank layout, else the worker says why and starts fresh.
  std::string state_dir;
  uint32_t state_every_rounds = 1;
};

// kInvalidArgument, naming the aloe-worker flag, for a slowdown that is not finite and >= 1,
// threads, eval_sequences or state_every_rounds < 1, or an evaluator with overlap or a state
// directory.
absl::Status ValidateAgentOptions(const AgentOptions& options);

// Makes the trainer once the join reply says what to train (model, inner optimizer, spec,
// seed). Called once per agent.
using TrainerFactory =
    std::function<absl::StatusOr<std::unique_ptr<TrainerInterface>>(const v1::JoinReply& joined)>;

// The agent's dependencies. Every pointer must outlive the agent. `clock`, `sleep` and `sleeper`
// must measure the same time: the real one in a process, a FakeClock in tests.
struct AgentEnv {
  ServerApi* server = nullptr;
  MetricsSink* metrics = nullptr;
  const Clock* clock = nullptr;
  // The round loop's waits (retries, backoff): waits `d`, or less once *stop is set.
  std::function<void(absl::Duration d)> sleep;
  // The background threads' waits (the heartbeat); null: RealSleeper.
  Sleeper* sleeper = nullptr;
  // A stop request (SIGINT/SIGTERM): the round ends at the next step end, is pushed, and the
  // agent leaves. Also the trainer's TrainRequest.interrupt.
  const std::atomic<bool>* stop = nullptr;
  TrainerFactory make_trainer;
  // Opens a token shard by its file under the corpus directory; null: TokenShard files under
  // AgentOptions::corpus_dir. What it returns must live as long as the agent.
  std::function<absl::StatusOr<const TokenSource*>(const std::string& file)> open_shard;
  // Null for a one-process worker; else this process is rank node->rank() of a multi-rank node
  // (FSDP). control: with overlap in a multi-rank node, a second process group over the same
  // ranks for the background half of overlapped rounds.
  Collectives* node = nullptr;
  Collectives* control = nullptr;
};

}  // namespace aloe::worker
