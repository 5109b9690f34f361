// A layer-sharded server on loopback: a coordinator and two shard processes (real aloe-server
// processes).
//  - ShardRestartReassemblesAndTrainingCompletes: an evaluator and two trainers (real aloe-worker
//    processes); a shard process is killed in the middle of training and started again from its
//    checkpoints; the processes reassemble at a common checkpoint and training completes, with
//    every shard at the coordinator's final version.
//  - SixteenWorkersKilledPushShardRestartAndExactReplay: 16 simulated workers (real gRPC clients
//    pushing known pseudo-gradients), a worker killed mid-push and a shard restart, with the EDiT
//    penalty and the staleness discount on; afterwards both shards hold exactly the parameters
//    of a single-process replay of the coordinator's order journal. Run twice: pushes over gRPC,
//    and raw pushes (common/raw_push.h; the victim's push to shard 1 breaks off mid-payload).
//  - APullWaitingForAVersionEndsWhenTheShardsGoBack: a shard restart makes every process go back
//    to an older version; a pull waiting for a newer one ends at once instead of after 10 s.
//  - CheckpointMovesFromOneProcessToShardProcessesAndBack: aloe-reshard moves a
//    job's checkpoint from one process to a coordinator and 2 shard processes and back, training
//    on after each move, with the exact state in the converted files; bad conversions are
//    refused, naming the problem, and write nothing.
//  - ALostShardHostStartsAgainFromTheCoordinatorsCopy: with checkpoint.replicate_shards a shard
//    whose host is lost for good (killed, its checkpoints deleted) starts again from the
//    coordinator's copy and the job completes; refused copies write nothing.
//  - RawPushesRefuseBadInputAndChangeNothing: malformed, mis-sized, non-float32, NaN-carrying,
//    unadmitted and cut-off raw pushes are refused with errors naming the problem, and the model
//    afterwards is exactly the initial one stepped once with the clean push that followed.
#include <gmock/gmock.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>

#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"
#include "common/config.h"
#include "common/executor.h"
#include "common/raw_push.h"
#include "common/status_macros.h"
#include "kernels/cpu/outer_kernels.h"
#include "server/core/checkpoint_store.h"
#include "server/core/order_journal.h"
#include "server/core/parameter_store.h"
#include "server/core/pseudo_gradient_penalty.h"
#include "server/service/checkpoint_copies.h"
#include "tests/integration/loopback_cluster.h"
#include "worker/client.h"

namespace aloe::testing {
namespace {

class ShardedServerTest : public ShardedLoopbackTest {
 protected:
  // The metrics port shard process `index` wrote to its port file (0 if none yet).
  int ShardMetricsPort(int index) {
    const std::string ports = ReadFile(absl::StrCat(dir_, "/shard", index, ".ports"));
    int port = 0;
    const size_t at = ports.find("metrics=");
    if (at != std::string::npos)
      absl::SimpleAtoi(ports.substr(at + 8, ports.find_first_of(" \n", at) - at - 8), &port);
    return port;
  }

  // A coordinator (plain async, 2 staging slots, `outer_optimizer`) and both shard processes
  // (shards_); the coordinator's port, or 0 when it did not start.
  int StartAsyncCluster(const std::string& outer_optimizer) {
    const int port = StartServer(
        "shard_processes: 2\nmax_staged_updates: 2\nlocal_steps: 10\neval_every: 1000000\n"
        "aggregation { mode: AGGREGATION_ASYNC min_workers: 1 grace_seconds: 0 }\n",
        outer_optimizer, {"--role=coordinator"});
    if (port > 0) {
      for (int i = 0; i < 2; ++i) shards_[i] = StartShard(i, port, false);
    }
    return port;
  }

  // A sync job of 12 versions for two trainers on a coordinator and both shard processes
  // (shards_), checkpointing every 2 versions into `ckpt` (`more`: other CheckpointConfig
  // fields); the coordinator's port, or 0 when it did not start.
  int StartSyncCluster(const std::string& ckpt, const std::string& more = "") {
    const int port = StartServer(
        absl::StrCat("shard_processes: 2\nmax_staged_updates: 4\nlocal_steps: 10\n"
                     "max_versions: 12\naggregation { mode: AGGREGATION_SYNC min_workers: 2 }\n"
                     "checkpoint { dir: \"",
                     ckpt, "\" every_versions: 2 keep: 3 ", more, " }\n"),
        kNesterov, {"--role=coordinator"});
    if (port > 0) {
      for (int i = 0; i < 2; ++i) shards_[i] = StartShard(i, port, false);
    }
    return port;
  }

  // SIGTERMs the coordinator and both shard processes; expects the shards to exit 0.
  void StopAsyncCluster() {
    server_->Signal(SIGTERM);
    for (auto& shard : shards_) shard->Signal(SIGTERM);
    for (auto& shard : shards_) EXPECT_EQ(shard->Wait(absl::Seconds(30)), std::optional<int>(0));
  }
};

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The pseudo-gradient that simulated worker `worker` pushes as update `update`: every value in
// [-0.01, 0.01), a function of (worker, update, layer, index) only, so the test can recompute
// any committed update.
std::vector<std::vector<float>> PseudoGradient(const v1::ModelSpec& spec, uint64_t worker,
                                               uint64_t update) {
  std::vector<std::vector<float>> layers;
  for (const v1::LayerSpec& layer : spec.layers()) {
    std::vector<float>& g = layers.emplace_back(layer.num_elements());
    uint64_t state = SplitMix64((worker << 40) ^ (update << 8) ^ layer.id());
    for (float& v : g) {
      state = SplitMix64(state);
      v = static_cast<float>((static_cast<double>(state >> 40) / (1 << 24) - 0.5) * 0.02);
    }
  }
  return layers;
}

// What the simulated workers share with the test.
struct Simulation {
  std::atomic<bool> stop{false};
  std::atomic<int> pushes{0};  // accepted pushes
  std::atomic<int> joins{0};   // joins, first ones included
  std::atomic<int> pulls{0};
  std::atomic<int> finished{0};  // workers told STOP
  absl::Mutex mu;
  std::vector<std::vector<float>> initial ABSL_GUARDED_BY(mu);  // version 0 as pulled
};

// A worker without a model: joins as a trainer, then per task pulls the base version (from
// every shard, like aloe-worker), "trains" for 20 ms and pushes PseudoGradient(worker id, update
// id). Joins again whenever the coordinator forgot it (NOT_FOUND: after a reassembly), retries
// what fails meanwhile, and leaves when told STOP.
void RunSimulatedWorker(int port, int index, Simulation& sim) {
  worker::ServerClient client(ClientOptionsFor(port));
  const absl::Time deadline = absl::Now() + absl::Seconds(240);
  while (!sim.stop.load() && absl::Now() < deadline) {
    v1::JoinRequest join;
    join.set_name(absl::StrCat("sim", index));
    join.set_role(v1::ROLE_TRAINER);
    absl::StatusOr<v1::JoinReply> joined = client.Join(join);
    if (!joined.ok() ||
        !client
             .SetShards(
                 {joined->shard_addresses().begin(), joined->shard_addresses().end()},
                 {joined->shard_push_addresses().begin(), joined->shard_push_addresses().end()})
             .ok()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));  // (re)assembling
      continue;
    }
    ++sim.joins;
    const uint64_t id = joined->worker_id();
    const v1::ModelSpec& spec = joined->model_spec();
    uint64_t update_id = 0;
    uint64_t dropped = 0;  // a task this worker cannot run, given up in its next request
    while (!sim.stop.load() && absl::Now() < deadline) {
      absl::StatusOr<v1::Task> task = client.RequestTask(id, /*ahead=*/false, dropped);
      if (task.ok()) dropped = 0;
      absl::Status failure = task.status();
      if (task.ok() && task->kind() == v1::Task::STOP) {
        (void)client.Leave(id);
        ++sim.finished;
        return;
      }
      if (task.ok() && task->kind() == v1::Task::TRAIN) {
        std::vector<std::vector<float>> params;
        uint64_t bytes = 0;
        absl::StatusOr<uint64_t> pulled =
            client.Pull(id, task->base_version(), false, spec, &params, &bytes);
        failure = pulled.status();
        if (pulled.ok()) {
          ++sim.pulls;
          if (*pulled == 0) {
            absl::MutexLock lock(&sim.mu);
            if (sim.initial.empty()) sim.initial = std::move(params);
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          const v1::PushHeader header = TrainHeader(id, *task, ++update_id);
          absl::StatusOr<v1::PushReply> pushed = client.Push(
              header, spec, PseudoGradient(spec, id, update_id), {}, 256, nullptr, &bytes);
          if (pushed.ok()) ++sim.pushes;
          failure = pushed.status();
        }
      }
      if (!failure.ok()) {
        if (failure.code() == absl::StatusCode::kNotFound) break;  // forgotten: join again
        // As aloe-worker: a training task that cannot run (its base version is no longer held,
        // it went stale) is given up, else a repeated request would hand it out again.
        if (failure.code() == absl::StatusCode::kFailedPrecondition && task.ok() &&
            task->kind() == v1::Task::TRAIN) {
          dropped = task->task_id();
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
  }
}

// The chunks of the layers of `spec` that shard process `shard` owns, filled with `g`.
std::vector<v1::PushChunk> ShardChunks(const v1::ModelSpec& spec, uint32_t shard,
                                       const std::vector<std::vector<float>>& g) {
  std::vector<v1::PushChunk> chunks;
  for (const v1::LayerSpec& layer : spec.layers()) {
    if (layer.shard() != shard) continue;
    for (auto [b, e] : ChunkRanges(layer.num_elements())) {
      v1::PushChunk& c = chunks.emplace_back();
      c.set_layer_id(layer.id());
      c.set_offset(b);
      AppendFloats(absl::MakeConstSpan(g[layer.id()].data() + b, e - b), c.mutable_data());
    }
  }
  return chunks;
}

// The float32 bytes of the layers of `spec` that shard process `shard` owns, in layer order.
std::string RawPayload(const v1::ModelSpec& spec, uint32_t shard,
                       const std::vector<std::vector<float>>& g) {
  std::string bytes;
  for (const RawPushRange& r : RawPushRanges(spec, shard, v1::PushHeader())) {
    bytes.append(reinterpret_cast<const char*>(g[r.layer_id].data()), r.count * sizeof(float));
  }
  return bytes;
}

// A worker killed in the middle of its push: it joins, takes a task, pushes its whole part to
// shard 0 and half of its first chunk to shard 1 (raw: half of its payload), then its streams
// break off and it is never heard from again. Returns (worker id, update id).
std::pair<uint64_t, uint64_t> PushAndVanish(int port, bool raw) {
  auto channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
  auto coordinator = v1::Coordinator::NewStub(channel);
  v1::JoinRequest join;
  join.set_name("victim");
  join.set_role(v1::ROLE_TRAINER);
  v1::JoinReply joined;
  for (int i = 0; i < 300; ++i) {  // until the shards are assembled
    grpc::ClientContext context;
    if (coordinator->Join(&context, join, &joined).ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(joined.shard_addresses_size(), 2);
  if (joined.shard_addresses_size() != 2) return {0, 0};
  EXPECT_EQ(joined.shard_push_addresses_size(), raw ? 2 : 0);
  v1::Task task;
  for (int i = 0; i < 100 && task.kind() != v1::Task::TRAIN; ++i) {
    grpc::ClientContext context;
    v1::TaskRequest request;
    request.set_worker_id(joined.worker_id());
    EXPECT_TRUE(coordinator->RequestTask(&context, request, &task).ok());
  }
  EXPECT_EQ(task.kind(), v1::Task::TRAIN);
  const v1::PushHeader header = TrainHeader(joined.worker_id(), task, 1);
  const auto g = PseudoGradient(joined.model_spec(), joined.worker_id(), 1);
  for (uint32_t shard : {0u, 1u}) {
    {
      // Alive until it dies: a loaded machine must not let its 3 s lease run out mid-push.
      grpc::ClientContext context;
      v1::HeartbeatRequest beat;
      beat.set_worker_id(joined.worker_id());
      v1::HeartbeatReply reply;
      const grpc::Status status = coordinator->Heartbeat(&context, beat, &reply);
      EXPECT_TRUE(status.ok()) << status.error_message();
    }
    if (raw && shard == 1) {
      // Half of the payload, then the connection breaks off mid-layer.
      absl::StatusOr<int> fd = ConnectTcp(joined.shard_push_addresses(1), absl::Seconds(10));
      EXPECT_TRUE(fd.ok()) << fd.status();
      if (!fd.ok()) return {0, 0};
      const std::string payload = RawPayload(joined.model_spec(), 1, g);
      const std::string bytes = EncodeRawPushPrelude("", header, payload.size()) +
                                payload.substr(0, payload.size() / 8 * 4);
      EXPECT_TRUE(WriteAll(*fd, bytes.data(), bytes.size(), absl::Seconds(30)).ok());
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      close(*fd);
      continue;
    }
    auto stub = v1::ParameterService::NewStub(
        grpc::CreateChannel(joined.shard_addresses(shard), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    v1::PushReply reply;
    auto writer = stub->Push(&context, &reply);
    v1::PushChunk first;
    *first.mutable_header() = header;
    EXPECT_TRUE(writer->Write(first));
    std::vector<v1::PushChunk> chunks = ShardChunks(joined.model_spec(), shard, g);
    if (shard == 0) {
      for (const v1::PushChunk& c : chunks) EXPECT_TRUE(writer->Write(c));
      writer->WritesDone();
      const grpc::Status status = writer->Finish();
      EXPECT_TRUE(status.ok()) << status.error_message();
      EXPECT_TRUE(reply.staged()) << "shard 0 staged its part; shard 1 has none yet";
    } else {
      chunks[0].mutable_data()->resize(chunks[0].data().size() / 8 * 4);  // half the floats
      const bool written = writer->Write(chunks[0]);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      // The process dies: its connection breaks off mid-layer. (A refused stream keeps the
      // shard's status for the message below.)
      if (written) context.TryCancel();
      const grpc::Status status = writer->Finish();
      EXPECT_TRUE(written) << "shard 1 ended the push early: " << status.error_code() << " "
                           << status.error_message();
      // Broken off by the pusher, not refused by the shard (the header message alone and the
      // half chunk are both acceptable so far).
      EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED) << status.error_message();
    }
  }
  return {joined.worker_id(), 1};
}

// The order journal's orders, or none while it is absent or being written.
std::vector<v1::ShardOrder> Journal(const std::string& path) {
  absl::StatusOr<std::vector<v1::ShardOrder>> orders = server::ReadOrderJournal(path);
  return orders.ok() ? *orders : std::vector<v1::ShardOrder>();
}

// The only shard process (shard_processes 1) reads a push without asking the coordinator's
// admission first (its own 2 slots are the bound), and its report admits the update: 3 async
// trainers pushing raw reach the last version, and the shard stops at it.
TEST_F(ShardedServerTest, TheOnlyShardProcessAdmitsOnItsOwnAndTheJobCompletes) {
  raw_pushes_ = true;
  const int port = StartServer(
      "shard_processes: 1\nmax_staged_updates: 2\nlocal_steps: 5\nmax_versions: 10\n"
      "eval_every: 1000000\naggregation { mode: AGGREGATION_ASYNC min_workers: 1 grace_seconds: 0 "
      "}\n",
      kNesterov, {"--role=coordinator"});
  ASSERT_GT(port, 0);
  shards_[0] = StartShard(0, port, false);
  std::vector<std::unique_ptr<Subprocess>> trainers;
  std::vector<Subprocess*> processes = {shards_[0].get()};
  for (int i = 0; i < 3; ++i) {
    trainers.push_back(StartWorker(port, "trainer", i));
    processes.push_back(trainers.back().get());
  }
  ASSERT_NO_FATAL_FAILURE(ExpectJobEnds(processes));
  // Tasks handed out before the stop still push: the job ends at 10 or a little after.
  const std::string summary = ReadFile(dir_ + "/summary");
  const size_t at = summary.find("version=");
  int version = 0;
  ASSERT_NE(at, std::string::npos) << summary;
  ASSERT_TRUE(absl::SimpleAtoi(summary.substr(at + 8, summary.find('\n', at) - at - 8), &version));
  EXPECT_GE(version, 10) << ShardLogs();
  const std::string shard = ReadFile(dir_ + "/shard0.log");
  EXPECT_EQ(StoppedAt(shard), version) << ShardLogs();
  EXPECT_FALSE(absl::StrContains(shard, "(0.0 MB raw)")) << ShardLogs();  // the pushes came raw
}

// A layer-sharded sync server takes no more trainers than staging slots (a round waits for every
// trainer's update to be staged on every shard). A trainer beyond them waits, asking again,
// and joins and trains once another trainer leaves.
TEST_F(ShardedServerTest, ATrainerBeyondTheStagingSlotsWaitsAndJoinsWhenOneLeaves) {
  const int port = StartServer(
      "shard_processes: 2\nmax_staged_updates: 1\nlocal_steps: 5\nmax_versions: 40\n"
      "eval_every: 1000000\naggregation { mode: AGGREGATION_SYNC min_workers: 1 }\n",
      kNesterov, {"--role=coordinator"});
  ASSERT_GT(port, 0);
  for (int i = 0; i < 2; ++i) shards_[i] = StartShard(i, port, false);
  // Slowed down, so that the job cannot end before the second trainer has started and asked
  // (alone on an idle host, 40 rounds take the first one about 3 s).
  auto first = StartWorker(port, "trainer", 0, 30);
  ASSERT_TRUE(WaitForText(dir_ + "/trainer0.log", "joined as worker", absl::Seconds(60)))
      << ReadFile(dir_ + "/trainer0.log") << ShardLogs();
  auto second = StartWorker(port, "trainer", 1);
  ASSERT_TRUE(WaitForText(dir_ + "/trainer1.log", "has no room for this worker", absl::Seconds(60)))
      << ReadFile(dir_ + "/trainer1.log") << ShardLogs();
  EXPECT_TRUE(
      absl::StrContains(ReadFile(dir_ + "/trainer1.log"), "as many as max_staged_updates (1)"))
      << ReadFile(dir_ + "/trainer1.log");
  EXPECT_FALSE(absl::StrContains(ReadFile(dir_ + "/server.log"), "the job is over"))
      << "the job ended before the second trainer could take the slot; raise max_versions";
  // The first trainer leaves (scaled down): the second takes its place and trains to the end.
  first->Signal(SIGTERM);
  EXPECT_EQ(first->Wait(absl::Seconds(60)), std::optional<int>(0));
  ASSERT_NO_FATAL_FAILURE(ExpectJobEnds({second.get(), shards_[0].get(), shards_[1].get()}));
  const std::string log = ReadFile(dir_ + "/trainer1.log");
  EXPECT_TRUE(absl::StrContains(log, "joined as worker")) << log;
  EXPECT_GT(SummaryValue(log, "rounds"), 0) << log;
  EXPECT_TRUE(absl::StrContains(ReadFile(dir_ + "/summary"), "version=40"))
      << ReadFile(dir_ + "/summary") << ShardLogs();
}

TEST_F(ShardedServerTest, ShardRestartReassemblesAndTrainingCompletes) {
  const std::string ckpt = dir_ + "/ckpt";
  const int port = StartSyncCluster(ckpt);
  ASSERT_GT(port, 0);
  std::unique_ptr<Subprocess>& shard0 = shards_[0];
  std::unique_ptr<Subprocess>& shard1 = shards_[1];
  auto evaluator = StartJoinedEvaluator(port);
  auto w0 = StartWorker(port, "trainer", 0);
  auto w1 = StartWorker(port, "trainer", 1, 1.5);

  // Both shards checkpointed version 4 (every 2 versions): kill shard 1 without warning.
  bool reached = false;
  for (int i = 0; i < 1200 && !reached; ++i) {
    reached = !server::CheckpointStore(ckpt + "/shard-1", 3).Versions().empty() &&
              server::CheckpointStore(ckpt + "/shard-1", 3).Versions().front() >= 4;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(reached) << ShardLogs();
  shard1->Signal(SIGKILL);
  ASSERT_TRUE(shard1->Wait(absl::Seconds(10)).has_value());
  auto resumed = StartShard(1, port, true);

  // The shard processes end with the job, told by the coordinator (no signal).
  ASSERT_NO_FATAL_FAILURE(
      ExpectJobEnds({w0.get(), w1.get(), evaluator.get(), shard0.get(), resumed.get()}));
  EXPECT_TRUE(absl::StrContains(ReadFile(dir_ + "/server.log"),
                                "the job is over at version 12; the 2 shard processes stop"))
      << ShardLogs();

  // Every process ends at the coordinator's final version.
  const std::string summary = ReadFile(dir_ + "/summary");
  ASSERT_TRUE(absl::StrContains(summary, "version=12")) << summary << ShardLogs();
  EXPECT_EQ(StoppedAt(ReadFile(dir_ + "/shard0.log")), 12) << ShardLogs();
  EXPECT_EQ(StoppedAt(ReadFile(dir_ + "/shard1-resumed.log")), 12) << ShardLogs();
  EXPECT_TRUE(absl::StrContains(ReadFile(dir_ + "/shard0.log"),
                                "the job is over: shard 0 stops at version 12"))
      << ShardLogs();
  // The restart made everybody go back to a common checkpoint (>= 4) and assemble again.
  const std::string coordinator = ReadFile(dir_ + "/server.log");
  EXPECT_TRUE(absl::StrContains(coordinator, "shard 1 restarted")) << ShardLogs();
  EXPECT_TRUE(absl::StrContains(ReadFile(dir_ + "/shard0.log"), "restored version")) << ShardLogs();
  // The pushes that completed rounds got their next task in the reply the shards relayed: at
  // least the 8 rounds after the common checkpoint (>= 4) and before the last version.
  EXPECT_GE(SummaryValue(ReadFile(dir_ + "/trainer0.log"), "tasks_from_push_replies") +
                SummaryValue(ReadFile(dir_ + "/trainer1.log"), "tasks_from_push_replies"),
            8)
      << ShardLogs();
  // Training made progress across the restart: the last evaluation beats the first.
  std::vector<double> losses;
  for (absl::string_view line : absl::StrSplit(summary, '\n', absl::SkipEmpty())) {
    if (absl::StartsWith(line, "eval=")) {
      double loss = 0;
      ASSERT_TRUE(absl::SimpleAtod(line.substr(line.find(':') + 1), &loss));
      losses.push_back(loss);
    }
  }
  ASSERT_GE(losses.size(), 2u) << summary;
  EXPECT_LT(losses.back(), losses.front() - 0.3) << summary;
}

// Runs `aloe-reshard --from=FROM --to=TO --shard_processes=N` with the test's
// config; returns its exit code (nullopt on a timeout) and leaves its output in *log.
std::optional<int> Reshard(const std::string& bin, const std::string& dir, const std::string& from,
                           const std::string& to, int processes, std::string* log,
                           const std::string& config = "server.textproto") {
  static int runs = 0;
  const std::string log_path = absl::StrCat(dir, "/reshard", ++runs, ".log");
  Subprocess tool({bin, absl::StrCat("--config=", dir, "/", config), "--from=" + from, "--to=" + to,
                   absl::StrCat("--shard_processes=", processes)},
                  log_path);
  std::optional<int> code = tool.Wait(absl::Seconds(60));
  *log = ReadFile(log_path);
  return code;
}

template <typename Checkpoint>
Checkpoint ReadCheckpoint(const std::string& path) {
  absl::StatusOr<Checkpoint> c = server::CheckpointStore::ReadFile<Checkpoint>(path);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : Checkpoint();
}

// Every layer of the one-process checkpoint `whole` is in exactly one of `shards`, with the same
// parameters and optimizer state, and the coordinator's checkpoint keeps whole's bookkeeping.
void ExpectSameState(const v1::ServerCheckpoint& whole, const v1::ServerCheckpoint& coordinator,
                     const std::vector<v1::ShardCheckpoint>& shards) {
  ASSERT_GT(whole.layer_params_size(), 0);
  std::vector<int> seen(whole.layer_params_size(), 0);
  for (const v1::ShardCheckpoint& shard : shards) {
    EXPECT_EQ(shard.version(), whole.version());
    ASSERT_EQ(shard.layer_params_size(), shard.layer_ids_size());
    for (int k = 0; k < shard.layer_ids_size(); ++k) {
      const int l = static_cast<int>(shard.layer_ids(k));
      ASSERT_LT(l, whole.layer_params_size());
      ++seen[l];
      EXPECT_EQ(shard.layer_params(k), whole.layer_params(l)) << "layer " << l;
      EXPECT_EQ(shard.optimizer_state(k), whole.optimizer_state(l)) << "layer " << l;
    }
    EXPECT_FALSE(shard.penalty_state().empty());
  }
  EXPECT_THAT(seen, ::testing::Each(1));
  EXPECT_EQ(coordinator.layer_params_size(), 0);
  EXPECT_EQ(coordinator.version(), whole.version());
  EXPECT_EQ(coordinator.updates_applied(), whole.updates_applied());
  EXPECT_EQ(coordinator.next_worker_id(), whole.next_worker_id());
  EXPECT_EQ(coordinator.sampler_rng(), whole.sampler_rng());
  EXPECT_THAT(coordinator.shard_steps(), ::testing::ElementsAreArray(whole.shard_steps()));
  EXPECT_THAT(coordinator.eval_versions(), ::testing::ElementsAreArray(whole.eval_versions()));
}

// A job trained by one process moves to a coordinator and 2 shard processes, trains on, moves
// back to one process and trains on again; the converted checkpoints hold exactly the state
// that was saved. Bad conversions are refused naming the problem and write nothing.
TEST_F(ShardedServerTest, CheckpointMovesFromOneProcessToShardProcessesAndBack) {
  const std::string a = dir_ + "/ckpt_one", b = dir_ + "/ckpt_two", c = dir_ + "/ckpt_back";
  auto config = [&](int processes, int versions, const std::string& ckpt) {
    return absl::StrCat("shard_processes: ", processes, "\nmax_versions: ", versions,
                        "\nlocal_steps: 10\naggregation { mode: AGGREGATION_SYNC min_workers: 1 }\n"
                        "penalty { enabled: true warmup: 1 }\n"
                        "checkpoint { dir: \"",
                        ckpt, "\" every_versions: 1 keep: 2 }\n");
  };

  // 1. One process to version 3.
  int port = StartServer(config(0, 3, a));
  ASSERT_GT(port, 0);
  auto w = StartWorker(port, "trainer", 0);
  ASSERT_EQ(server_->Wait(absl::Seconds(120)), std::optional<int>(0)) << Logs();
  ASSERT_EQ(w->Wait(absl::Seconds(30)), std::optional<int>(0)) << Logs();

  // 2. To two shard processes.
  std::string log;
  ASSERT_EQ(Reshard(Bin("aloe-reshard"), dir_, a, b, 2, &log), std::optional<int>(0)) << log;
  EXPECT_TRUE(absl::StrContains(log, absl::StrCat("version 3 of ", a, " (one process) is now in ",
                                                  b, " for a coordinator and 2 shard processes")))
      << log;
  const std::string name3 = "/checkpoint-000000000003.aloeckpt";
  const auto whole3 = ReadCheckpoint<v1::ServerCheckpoint>(a + name3);
  ExpectSameState(whole3, ReadCheckpoint<v1::ServerCheckpoint>(b + name3),
                  {ReadCheckpoint<v1::ShardCheckpoint>(b + "/shard-0" + name3),
                   ReadCheckpoint<v1::ShardCheckpoint>(b + "/shard-1" + name3)});

  // 3. Trains on from version 3 to 5 on the shard processes.
  port = StartServer(config(2, 5, b), kNesterov, {"--role=coordinator", "--resume"});
  ASSERT_GT(port, 0);
  shards_[0] = StartShard(0, port, true);
  shards_[1] = StartShard(1, port, true);
  w = StartWorker(port, "trainer", 1);
  ASSERT_EQ(server_->Wait(absl::Seconds(120)), std::optional<int>(0)) << ShardLogs();
  ASSERT_EQ(w->Wait(absl::Seconds(30)), std::optional<int>(0)) << ShardLogs();
  for (auto& shard : shards_) EXPECT_EQ(shard->Wait(absl::Seconds(30)), std::optional<int>(0));
  EXPECT_TRUE(absl::StrContains(ReadFile(dir_ + "/server.log"), "resumed at version 3"))
      << ShardLogs();
  EXPECT_TRUE(absl::StrContains(ReadFile(dir_ + "/summary"), "version=5\n")) << ShardLogs();
  EXPECT_EQ(StoppedAt(ReadFile(dir_ + "/shard0-resumed.log")), 5) << ShardLogs();
  EXPECT_EQ(StoppedAt(ReadFile(dir_ + "/shard1-resumed.log")), 5) << ShardLogs();

  // 4. Back to one process, which trains on to version 6.
  ASSERT_EQ(Reshard(Bin("aloe-reshard"), dir_, b, c, 0, &log), std::optional<int>(0)) << log;
  EXPECT_TRUE(absl::StrContains(log, "version 5 of " + b +
                                         " (a coordinator and 2 shard processes) "
                                         "is now in " +
                                         c + " for one process"))
      << log;
  const std::string name5 = "/checkpoint-000000000005.aloeckpt";
  ExpectSameState(ReadCheckpoint<v1::ServerCheckpoint>(c + name5),
                  ReadCheckpoint<v1::ServerCheckpoint>(b + name5),
                  {ReadCheckpoint<v1::ShardCheckpoint>(b + "/shard-0" + name5),
                   ReadCheckpoint<v1::ShardCheckpoint>(b + "/shard-1" + name5)});
  port = StartServer(config(0, 6, c), kNesterov, {"--resume"});
  ASSERT_GT(port, 0);
  w = StartWorker(port, "trainer", 2);
  ASSERT_EQ(server_->Wait(absl::Seconds(120)), std::optional<int>(0)) << Logs();
  ASSERT_EQ(w->Wait(absl::Seconds(30)), std::optional<int>(0)) << Logs();
  EXPECT_TRUE(absl::StrContains(ReadFile(dir_ + "/server.log"), "resumed at version 5")) << Logs();
  EXPECT_TRUE(absl::StrContains(ReadFile(dir_ + "/summary"), "version=6\n")) << Logs();

  // 5. Refused, naming the problem, with nothing written.
  const std::string out = dir_ + "/ckpt_refused";
  auto refused = [&](const std::string& from, int processes, const std::string& expected,
                     const std::string& to_dir = "") {
    SCOPED_TRACE(expected);
    const std::string to = to_dir.empty() ? out : to_dir;
    EXPECT_EQ(Reshard(Bin("aloe-reshard"), dir_, from, to, processes, &log), std::optional<int>(1))
        << log;
    EXPECT_TRUE(absl::StrContains(log, expected)) << log;
    if (to_dir.empty()) {
      EXPECT_EQ(::access(out.c_str(), F_OK), -1) << out << " was created";
    }
  };
  refused(a, 2, "is not empty", b);
  refused(b, 3, "are the same directory", b);
  refused(dir_ + "/nowhere", 2, "no checkpoints in");
  refused(a, 64, "owns no layer");
  ASSERT_EQ(std::system(absl::StrCat("cp -r ", b, " ", dir_, "/gap && rm -r ", dir_,
                                     "/gap/shard-0 && cp -r ", b, " ", dir_, "/one_shard && rm -r ",
                                     dir_, "/one_shard/shard-1")
                            .c_str()),
            0);
  refused(dir_ + "/gap", 0, "but no shard-0");
  refused(dir_ + "/one_shard", 0, "is of shard 0 of 2 shard processes");
  // No version that every process has: the coordinator kept 5 only, shard 1 4 only.
  ASSERT_EQ(std::system(absl::StrCat("cp -r ", b, " ", dir_, "/skew && rm ", dir_, "/skew/",
                                     "checkpoint-000000000004.aloeckpt ", dir_,
                                     "/skew/shard-1/checkpoint-000000000005.aloeckpt")
                            .c_str()),
            0);
  refused(dir_ + "/skew", 0, "coordinator [5], shard 0 [5, 4], shard 1 [4]");
  // A corrupt newest file: the version before it.
  ASSERT_EQ(std::system(absl::StrCat("cp -r ", b, " ", dir_, "/corrupt && truncate -s 100 ", dir_,
                                     "/corrupt/shard-0/checkpoint-000000000005.aloeckpt")
                            .c_str()),
            0);
  ASSERT_EQ(Reshard(Bin("aloe-reshard"), dir_, dir_ + "/corrupt", dir_ + "/ckpt_four", 3, &log),
            std::optional<int>(0))
      << log;
  EXPECT_TRUE(absl::StrContains(log, "version 5: ")) << log;
  EXPECT_TRUE(absl::StrContains(log, "version 4 of")) << log;
  // Another model.
  std::string other = ReadFile(dir_ + "/server.textproto");
  ASSERT_TRUE(absl::StrContains(other, "d_model: 64"));
  absl::StrReplaceAll({{"d_model: 64", "d_model: 32"}}, &other);
  std::ofstream(dir_ + "/other.textproto") << other;
  EXPECT_EQ(Reshard(Bin("aloe-reshard"), dir_, a, out, 2, &log, "other.textproto"),
            std::optional<int>(1));
  EXPECT_TRUE(absl::StrContains(log, "is of another model, outer optimizer, penalty or corpus"))
      << log;
  EXPECT_EQ(::access(out.c_str(), F_OK), -1);
}

// checkpoint.replicate_shards: the coordinator keeps a copy of every shard checkpoint. Shard 1's
// host is lost for good (SIGKILL, and its checkpoint directory deleted): a new shard 1 with
// nothing of its own fetches the newest copy and the job completes. A copy of another model, or
// of a shard index that does not exist, is refused.
TEST_F(ShardedServerTest, ALostShardHostStartsAgainFromTheCoordinatorsCopy) {
  const std::string ckpt = dir_ + "/ckpt";
  const int port = StartSyncCluster(ckpt, "replicate_shards: true");
  ASSERT_GT(port, 0);
  std::unique_ptr<Subprocess>& shard0 = shards_[0];
  std::unique_ptr<Subprocess>& shard1 = shards_[1];
  auto w0 = StartWorker(port, "trainer", 0);
  auto w1 = StartWorker(port, "trainer", 1, 1.5);

  // The coordinator holds shard 1's copy of version >= 4: the host goes, disk and all.
  const std::string copies = ckpt + "/replicas/shard-1";
  bool reached = false;
  for (int i = 0; i < 1200 && !reached; ++i) {
    const std::vector<uint64_t> v = server::CheckpointStore(copies, 3).Versions();
    reached = !v.empty() && v.front() >= 4;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(reached) << ShardLogs();
  // The coordinator says how current its copies are.
  EXPECT_GE(Scraped("aloe_shard_checkpoint_copy_version{process=\"1\"}"), 4) << ShardLogs();
  // And how far each shard process has applied the commits, as the processes report it; its
  // status page shows the same.
  for (const char* process : {"0", "1"}) {
    const std::string series =
        absl::StrCat("aloe_shard_applied_version{process=\"", process, "\"}");
    double applied = std::nan("");
    for (int i = 0; i < 100 && !(applied >= 4); ++i) {
      applied = Scraped(series);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    EXPECT_GE(applied, 4) << series << "\n" << ShardLogs();
    EXPECT_LE(applied, Scraped("aloe_model_version")) << series;
  }
  const std::string status = HttpGet(metrics_port_, "/status.json");
  EXPECT_TRUE(absl::StrContains(status, "{\"index\":1,\"address\":\"127.0.0.1:")) << status;
  const size_t applied_at = status.find("\"applied_version\":");
  ASSERT_NE(applied_at, std::string::npos) << status;
  EXPECT_NE(status.substr(applied_at, 20), "\"applied_version\":0,") << status;
  shard1->Signal(SIGKILL);
  ASSERT_TRUE(shard1->Wait(absl::Seconds(10)).has_value());
  ASSERT_EQ(std::system(("rm -rf " + ckpt + "/shard-1").c_str()), 0);
  auto resumed = StartShard(1, port, true);

  ASSERT_NO_FATAL_FAILURE(ExpectJobEnds({w0.get(), w1.get(), shard0.get(), resumed.get()}));
  const std::string log = ReadFile(dir_ + "/shard1-resumed.log");
  EXPECT_TRUE(absl::StrContains(log,
                                "shard 1 has no checkpoint of its own: fetched the "
                                "coordinator's copy of version "))
      << ShardLogs();
  EXPECT_TRUE(absl::StrContains(ReadFile(dir_ + "/summary"), "version=12")) << ShardLogs();
  EXPECT_EQ(StoppedAt(ReadFile(dir_ + "/shard0.log")), 12) << ShardLogs();
  EXPECT_EQ(StoppedAt(log), 12) << ShardLogs();
  // Every copy is byte for byte the shard's own checkpoint of that version.
  for (int i = 0; i < 2; ++i) {
    const std::string own = absl::StrCat(ckpt, "/shard-", i);
    const std::string copy = absl::StrCat(ckpt, "/replicas/shard-", i);
    const std::vector<uint64_t> versions = server::CheckpointStore(copy, 3).Versions();
    ASSERT_FALSE(versions.empty()) << copy;
    EXPECT_EQ(versions.front(), 12u) << copy;
    for (uint64_t v : versions) {
      const std::string name = absl::StrFormat("/checkpoint-%012d.aloeckpt", v);
      if (::access((own + name).c_str(), F_OK) != 0) continue;
      EXPECT_EQ(ReadFile(copy + name), ReadFile(own + name)) << copy << name;
    }
  }

  // The coordinator's directory alone (its checkpoints and copies, no shard directory) converts
  // to one process: aloe-reshard reads the copies.
  const std::string alone = dir_ + "/coordinator_only";
  ASSERT_EQ(std::system(absl::StrCat("mkdir -p ", alone, " && cp ", ckpt, "/checkpoint-* ", alone,
                                     " && cp -r ", ckpt, "/replicas ", alone)
                            .c_str()),
            0);
  std::string log_one;
  EXPECT_EQ(Reshard(Bin("aloe-reshard"), dir_, alone, dir_ + "/one", 0, &log_one),
            std::optional<int>(0))
      << log_one;
  EXPECT_TRUE(absl::StrContains(log_one, "the coordinator's copies in " + alone + "/replicas"))
      << log_one;
  EXPECT_TRUE(absl::StrContains(log_one, "version 12 of " + alone)) << log_one;

  // Refused copies: another model's, a shard index out of range (a second coordinator).
  const int second = StartServer(absl::StrCat("shard_processes: 2\nlocal_steps: 10\n"
                                              "checkpoint { dir: \"",
                                              ckpt, "2\" replicate_shards: true }\n"),
                                 kNesterov, {"--role=coordinator"});
  ASSERT_GT(second, 0);
  auto stub = v1::ShardControl::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", second), grpc::InsecureChannelCredentials()));
  v1::ShardCheckpoint foreign;
  foreign.set_format(1);
  foreign.set_fingerprint("another model");
  foreign.set_shard_index(0);
  foreign.set_shard_processes(2);
  foreign.set_version(2);
  absl::StatusOr<std::string> stored = server::StoreCheckpointCopy(*stub, "", foreign);
  EXPECT_EQ(stored.status().code(), absl::StatusCode::kFailedPrecondition) << stored.status();
  EXPECT_TRUE(absl::StrContains(stored.status().message(), "another model")) << stored.status();
  absl::StatusOr<v1::ShardCheckpoint> fetched = server::FetchCheckpointCopy(*stub, "", 5);
  EXPECT_EQ(fetched.status().code(), absl::StatusCode::kInvalidArgument) << fetched.status();
  fetched = server::FetchCheckpointCopy(*stub, "", 1);
  EXPECT_EQ(fetched.status().code(), absl::StatusCode::kNotFound) << fetched.status();
  for (const uint32_t shard : {1u, 2u}) {
    grpc::ClientContext context;
    v1::AppliedReport report;
    report.set_shard_index(shard);
    report.set_version(3);
    v1::AppliedAck ack;
    const grpc::Status reported = stub->ReportApplied(&context, report, &ack);
    EXPECT_EQ(reported.error_code(),
              shard == 1 ? grpc::StatusCode::OK : grpc::StatusCode::INVALID_ARGUMENT)
        << reported.error_message();
    if (shard == 2) {
      EXPECT_TRUE(absl::StrContains(reported.error_message(), "has 2 shard processes"))
          << reported.error_message();
    }
  }
  EXPECT_EQ(::access((ckpt + "2/replicas").c_str(), F_OK), -1) << "a refused copy was written";
  server_->Signal(SIGTERM);
  server_->Wait(absl::Seconds(30));
}

class ShardedReplayTest : public ShardedServerTest, public ::testing::WithParamInterface<bool> {};

TEST_P(ShardedReplayTest, SixteenWorkersKilledPushShardRestartAndExactReplay) {
  raw_pushes_ = GetParam();
  constexpr int kWorkers = 16;
  constexpr uint64_t kVersions = 40;
  const std::string ckpt = dir_ + "/ckpt";
  const std::string journal = dir_ + "/journal";
  lease_seconds_ = 3;  // the vanished worker expires soon
  const int port = StartServer(
      absl::StrCat("shard_processes: 2\nmax_staged_updates: 4\nlocal_steps: 10\n",
                   "max_versions: ", kVersions, "\neval_every: 1000000\n",
                   "aggregation { mode: AGGREGATION_ASYNC min_workers: 1 grace_seconds: 0.1 }\n"
                   // The EDiT penalty on the shards: anomaly tests from a stream's second norm,
                   // clipping of the larger steps (pushed norms are about 1.3 per layer).
                   "penalty { enabled: true warmup: 1 z_threshold: 2 clip_norm: 1 }\n"
                   "checkpoint { dir: \"",
                   ckpt, "\" every_versions: 4 keep: 3 }\n"),
      "outer_optimizer { type: OUTER_DELAYED_NESTEROV lr: 0.7 momentum: 0.9 dn_buffer_size: 2 "
      "staleness_exponent: 0.5 }",
      {"--role=coordinator", "--order_journal=" + journal});
  ASSERT_GT(port, 0);
  auto shard0 = StartShard(0, port, false);
  auto shard1 = StartShard(1, port, false);

  // A worker dies mid-push: shard 0 staged its part, shard 1 got half a chunk. Once its lease
  // runs out the coordinator tells the shards to discard it.
  const auto [victim, victim_update] = PushAndVanish(port, raw_pushes_);
  ASSERT_GT(victim, 0u) << ShardLogs();
  auto discarded = [&] {
    for (const v1::ShardOrder& o : Journal(journal)) {
      if (o.kind() == v1::ShardOrder::DISCARD && o.entries(0).worker_id() == victim &&
          o.entries(0).update_id() == victim_update) {
        return true;
      }
    }
    return false;
  };
  for (int i = 0; i < 200 && !discarded(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(discarded()) << ShardLogs();

  Simulation sim;
  std::vector<std::thread> workers;
  for (int w = 0; w < kWorkers; ++w) {
    workers.emplace_back([&, w] { RunSimulatedWorker(port, w, sim); });
  }
  // Both shards checkpointed version 8: kill shard 1 without warning and start it again.
  bool reached = false;
  for (int i = 0; i < 1200 && !reached; ++i) {
    const std::vector<uint64_t> versions = server::CheckpointStore(ckpt + "/shard-1", 3).Versions();
    reached = !versions.empty() && versions.front() >= 8;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (!reached) sim.stop = true;
  for (std::thread& t : workers) {
    if (!reached) t.join();
  }
  ASSERT_TRUE(reached) << ShardLogs();
  shard1->Signal(SIGKILL);
  ASSERT_TRUE(shard1->Wait(absl::Seconds(10)).has_value());
  auto resumed = StartShard(1, port, true);

  std::optional<int> code = server_->Wait(absl::Seconds(240));
  sim.stop = true;
  for (std::thread& t : workers) t.join();
  ASSERT_TRUE(code.has_value()) << "coordinator did not finish\n" << ShardLogs();
  ASSERT_EQ(*code, 0) << ShardLogs();
  EXPECT_EQ(sim.finished.load(), kWorkers);
  shard0->Signal(SIGTERM);
  resumed->Signal(SIGTERM);
  EXPECT_EQ(shard0->Wait(absl::Seconds(30)), std::optional<int>(0));
  EXPECT_EQ(resumed->Wait(absl::Seconds(30)), std::optional<int>(0));
  // Every process ends at the coordinator's final version: kVersions, or a little more (pushes of
  // tasks handed out before the stop are still applied).
  int final_version = 0;
  for (absl::string_view line : absl::StrSplit(ReadFile(dir_ + "/summary"), '\n')) {
    if (absl::ConsumePrefix(&line, "version=")) {
      ASSERT_TRUE(absl::SimpleAtoi(line, &final_version));
    }
  }
  ASSERT_GE(final_version, static_cast<int>(kVersions)) << ShardLogs();
  EXPECT_EQ(StoppedAt(ReadFile(dir_ + "/shard0.log")), final_version) << ShardLogs();
  EXPECT_EQ(StoppedAt(ReadFile(dir_ + "/shard1-resumed.log")), final_version) << ShardLogs();
  EXPECT_TRUE(absl::StrContains(ReadFile(dir_ + "/server.log"), "shard 1 restarted"))
      << ShardLogs();

  // The journal: assembled at 0, reassembled at a checkpoint >= 8 after the restart; the
  // vanished worker's update never committed; the commits that stand reach kVersions.
  absl::StatusOr<std::vector<v1::ShardOrder>> orders = server::ReadOrderJournal(journal);
  ASSERT_TRUE(orders.ok()) << orders.status();
  std::vector<uint64_t> restores;
  for (const v1::ShardOrder& o : *orders) {
    if (o.kind() == v1::ShardOrder::RESTORE) restores.push_back(o.version());
    for (const v1::CommitEntry& e : o.entries()) {
      if (o.kind() == v1::ShardOrder::COMMIT) {
        EXPECT_NE(e.worker_id(), victim);
      }
    }
  }
  ASSERT_EQ(restores.size(), 2u);
  EXPECT_EQ(restores[0], 0u);
  EXPECT_GE(restores[1], 8u);
  absl::StatusOr<std::vector<v1::ShardOrder>> history = server::CommittedHistory(*orders);
  ASSERT_TRUE(history.ok()) << history.status();
  ASSERT_EQ(history->size(), static_cast<size_t>(final_version));
  size_t committed_updates = 0, discounted = 0;
  for (const v1::ShardOrder& o : *history) {
    committed_updates += o.entries_size();
    for (const v1::CommitEntry& e : o.entries()) discounted += e.weight() < 1.0f;
  }
  EXPECT_GT(discounted, 0u) << "stale updates carry the staleness discount in their weight";
  for (const v1::ShardOrder& o : *history) {
    for (const v1::CommitEntry& e : o.entries()) {
      ASSERT_GT(e.discount(), 0.0f);
      ASSERT_LE(e.discount(), 1.0f);
      ASSERT_EQ(e.weight(), e.discount()) << "async: one update per step, aggregation weight 1";
    }
  }

  // Single-process replay: the initial model (version 0 as the workers pulled it), then every
  // commit that stands, in order, with its weights, through one ParameterStore.
  absl::StatusOr<v1::ServerConfig> config = LoadServerConfig(dir_ + "/server.textproto");
  ASSERT_TRUE(config.ok()) << config.status();
  v1::ModelSpec spec;
  std::vector<std::vector<float>> initial;
  {
    absl::MutexLock lock(&sim.mu);
    initial = sim.initial;
  }
  ASSERT_FALSE(initial.empty()) << "no worker pulled version 0";
  std::map<uint32_t, std::vector<float>> final_params;  // layer id -> shard's final values
  for (uint32_t shard : {0u, 1u}) {
    absl::StatusOr<server::CheckpointStore::LoadedOf<v1::ShardCheckpoint>> last =
        server::CheckpointStore(absl::StrCat(ckpt, "/shard-", shard), 3)
            .LoadLatest<v1::ShardCheckpoint>();
    ASSERT_TRUE(last.ok()) << last.status();
    EXPECT_EQ(last->checkpoint.version(), static_cast<uint64_t>(final_version));
    for (int i = 0; i < last->checkpoint.layer_ids_size(); ++i) {
      const std::string& bytes = last->checkpoint.layer_params(i);
      std::vector<float>& values = final_params[last->checkpoint.layer_ids(i)];
      values.resize(bytes.size() / 4);
      ASSERT_TRUE(DecodeFloats(bytes, absl::MakeSpan(values)).ok());
    }
  }
  ASSERT_EQ(final_params.size(), initial.size());
  spec.set_num_shards(1);
  for (size_t l = 0; l < initial.size(); ++l) {
    v1::LayerSpec* layer = spec.add_layers();
    layer->set_id(l);
    layer->set_name(absl::StrCat("layer", l));
    layer->set_num_elements(initial[l].size());
  }
  InlineExecutor executor;
  absl::StatusOr<std::unique_ptr<server::ParameterStore>> replay =
      server::ParameterStore::Create(spec, initial, config->outer_optimizer(), executor);
  ASSERT_TRUE(replay.ok()) << replay.status();
  absl::StatusOr<std::unique_ptr<server::PseudoGradientPenalty>> penalty =
      server::PseudoGradientPenalty::Create(config->penalty(), spec.layers_size());
  ASSERT_TRUE(penalty.ok()) << penalty.status();
  size_t anomalies = 0, rollbacks = 0, clipped = 0;
  for (const v1::ShardOrder& commit : *history) {
    std::vector<server::PendingUpdate> updates(commit.entries_size());
    std::vector<const server::PendingUpdate*> pointers;
    std::vector<float> weights;
    for (int i = 0; i < commit.entries_size(); ++i) {
      updates[i].worker_id = commit.entries(i).worker_id();
      updates[i].update_id = commit.entries(i).update_id();
      updates[i].layers = PseudoGradient(spec, updates[i].worker_id, updates[i].update_id);
      // As a single-process server: the staleness discount scales the update on arrival.
      if (commit.entries(i).discount() != 1.0f) {
        for (std::vector<float>& layer : updates[i].layers) {
          kernels::Scale(layer.data(), layer.size(), commit.entries(i).discount());
        }
      }
      pointers.push_back(&updates[i]);
    }
    server::PenaltyAggregation aggregation(**penalty);
    ASSERT_TRUE((*replay)->ApplyOuterStep(pointers, aggregation).ok());
    for (const server::PenaltyModuleReport& layer : aggregation.reports()) {
      rollbacks += layer.rollback;
      clipped += !layer.rollback && layer.clip_coefficient < 1;
      for (const server::PenaltyUpdateReport& u : layer.updates) anomalies += u.anomalous;
    }
  }
  EXPECT_GT(clipped, 0u) << "the penalty clipped steps";
  const server::ModelSnapshot expected = (*replay)->Snapshot();
  size_t different = 0;
  double max_diff = 0, max_moved = 0;
  for (size_t l = 0; l < initial.size(); ++l) {
    const std::vector<float>& want = *expected.layers[l];
    const std::vector<float>& got = final_params[l];
    ASSERT_EQ(got.size(), want.size()) << "layer " << l;
    for (size_t i = 0; i < want.size(); ++i) {
      if (got[i] != want[i]) ++different;
      max_diff = std::max(max_diff, static_cast<double>(std::fabs(got[i] - want[i])));
      max_moved = std::max(max_moved, static_cast<double>(std::fabs(want[i] - initial[l][i])));
    }
  }
  EXPECT_EQ(different, 0u) << "max |shard - replay| = " << max_diff;
  EXPECT_GT(max_moved, 0.01) << "the commits moved the parameters";
  std::printf(
      "%zu commits of %zu updates (%d accepted pushes, %d joins, %d pulls), restores at %lu and "
      "%lu, %zu stale (weight < 1); penalty: %zu anomalous (update, layer) pairs, %zu rollbacks, "
      "%zu clipped layer steps; max |shard - replay| = %g, max |replay - initial| = %g\n",
      history->size(), committed_updates, sim.pushes.load(), sim.joins.load(), sim.pulls.load(),
      static_cast<unsigned long>(restores[0]), static_cast<unsigned long>(restores[1]), discounted,
      anomalies, rollbacks, clipped, max_diff, max_moved);
}

// 16 workers push 6 MiB updates at the same moment into shards that stage 2 updates each: the
// coordinator admits the same 2 on both shards, so each push completes in turn (were each shard
// to admit on its own, each could fill with updates the other never takes, and nothing would
// commit again).
TEST_P(ShardedReplayTest, SimultaneousPushesBeyondStagingAllComplete) {
  raw_pushes_ = GetParam();  // raw: pushes wait for admission with their payload unread
  constexpr int kWorkers = 16;
  model_ = "model { vocab_size: 256 seq_len: 32 d_model: 256 num_layers: 2 num_heads: 4 }";
  const int port = StartServer(
      absl::StrCat(
          "shard_processes: 2\nmax_staged_updates: 2\nlocal_steps: 10\nmax_versions: ", kWorkers,
          "\neval_every: 1000000\naggregation { mode: AGGREGATION_ASYNC min_workers: 1 "
          "grace_seconds: 0 }\n"),
      kNesterov, {"--role=coordinator"});
  ASSERT_GT(port, 0);
  auto shard0 = StartShard(0, port, false);
  auto shard1 = StartShard(1, port, false);

  std::atomic<int> ready{0};
  std::atomic<int> pushed{0};
  std::vector<std::string> failures(kWorkers);
  std::vector<std::thread> workers;
  for (int w = 0; w < kWorkers; ++w) {
    workers.emplace_back([&, w] {
      worker::ServerClient client(ClientOptionsFor(port));
      absl::StatusOr<v1::JoinReply> joined = JoinTrainer(client, absl::StrCat("sim", w));
      absl::StatusOr<v1::Task> task;
      if (joined.ok()) task = client.RequestTask(joined->worker_id());
      ++ready;
      if (!joined.ok() || !task.ok() || task->kind() != v1::Task::TRAIN) {
        failures[w] = "no task";
        return;
      }
      while (ready.load() < kWorkers) std::this_thread::yield();  // all push at once
      const v1::PushHeader header = TrainHeader(joined->worker_id(), *task, 1);
      uint64_t bytes = 0;
      absl::StatusOr<v1::PushReply> reply =
          client.Push(header, joined->model_spec(), PseudoGradient(joined->model_spec(), w + 1, 1),
                      {}, 256, nullptr, &bytes);
      if (reply.ok() && !reply->staged()) {
        ++pushed;
      } else {
        failures[w] = reply.ok() ? "still staged" : reply.status().ToString();
      }
      (void)client.Leave(joined->worker_id());
    });
  }
  for (std::thread& t : workers) t.join();
  for (int w = 0; w < kWorkers; ++w) EXPECT_EQ(failures[w], "") << "worker " << w;
  EXPECT_EQ(pushed.load(), kWorkers);
  std::optional<int> code = server_->Wait(absl::Seconds(60));
  ASSERT_TRUE(code.has_value()) << "coordinator did not finish\n" << ShardLogs();
  EXPECT_EQ(*code, 0);
  EXPECT_TRUE(absl::StrContains(ReadFile(dir_ + "/summary"), absl::StrCat("version=", kWorkers)))
      << ShardLogs();
  shard0->Signal(SIGTERM);
  shard1->Signal(SIGTERM);
  EXPECT_EQ(shard0->Wait(absl::Seconds(30)), std::optional<int>(0));
  EXPECT_EQ(shard1->Wait(absl::Seconds(30)), std::optional<int>(0));
}

INSTANTIATE_TEST_SUITE_P(Transports, ShardedReplayTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "RawPushes" : "GrpcPushes";
                         });

TEST_F(ShardedServerTest, APullWaitingForAVersionEndsWhenTheShardsGoBack) {
  const int port = StartAsyncCluster(kNesterov);
  ASSERT_GT(port, 0);
  worker::ServerClient client(ClientOptionsFor(port));
  absl::StatusOr<v1::JoinReply> joined = JoinTrainer(client, "waiter");
  ASSERT_TRUE(joined.ok()) << joined.status() << ShardLogs();
  // Version 1 is committed nowhere yet: a pull of it from shard 1 waits for its COMMIT.
  auto stub = v1::ParameterService::NewStub(
      grpc::CreateChannel(joined->shard_addresses(1), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  v1::PullRequest request;
  request.set_worker_id(joined->worker_id());
  request.set_version(1);
  std::unique_ptr<grpc::ClientReader<v1::ParamChunk>> reader = stub->Pull(&context, request);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the pull is waiting
  // Shard 0 dies and starts again from the initial model: every process goes back to version 0,
  // so the version 1 the pull waits for would be another one. The wait ends at once.
  shards_[0]->Signal(SIGKILL);
  ASSERT_TRUE(shards_[0]->Wait(absl::Seconds(10)).has_value());
  shards_[0] = StartShard(0, port, false);
  v1::ParamChunk chunk;
  while (reader->Read(&chunk)) {
  }
  const grpc::Status status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << status.error_message() << ShardLogs();
  EXPECT_TRUE(absl::StrContains(status.error_message(),
                                "version 1 will not come to shard 1: the shard processes went "
                                "back to version 0"))
      << status.error_message();
  StopAsyncCluster();
}

TEST_F(ShardedServerTest, RawPushesRefuseBadInputAndChangeNothing) {
  raw_pushes_ = true;
  const int port = StartAsyncCluster("outer_optimizer { type: OUTER_SGD lr: 0.5 }");
  ASSERT_GT(port, 0);
  worker::ServerClient client(ClientOptionsFor(port));
  absl::StatusOr<v1::JoinReply> joined = JoinTrainer(client, "hostile");
  ASSERT_TRUE(joined.ok()) << joined.status() << ShardLogs();
  ASSERT_EQ(joined->shard_push_addresses_size(), 2);
  const v1::ModelSpec& spec = joined->model_spec();
  absl::StatusOr<v1::Task> task = client.RequestTask(joined->worker_id());
  ASSERT_TRUE(task.ok() && task->kind() == v1::Task::TRAIN) << task.status();
  std::vector<std::vector<float>> initial;
  uint64_t bytes = 0;
  ASSERT_TRUE(client.Pull(joined->worker_id(), 0, false, spec, &initial, &bytes).ok());

  const v1::PushHeader header = TrainHeader(joined->worker_id(), *task, 1);
  const std::vector<std::vector<float>> g = PseudoGradient(spec, joined->worker_id(), 1);
  const std::string raw0 = joined->shard_push_addresses(0);
  const std::string payload = RawPayload(spec, 0, g);
  std::string with_nan = payload;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(with_nan.data() + 4 * 1000, &nan,
              sizeof(nan));  // element 1000 of shard 0's first layer
  v1::PushHeader bf16 = header;
  bf16.set_codec(v1::CODEC_BF16);
  v1::PushHeader stranger = header;
  stranger.set_worker_id(joined->worker_id() + 1000);
  struct Case {
    const char* what;
    std::string bytes;
    absl::StatusCode code;
    const char* message;
  };
  const Case cases[] = {
      {"an HTTP/2 client", "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + std::string(64, '\0'),
       absl::StatusCode::kInvalidArgument, "not a raw push"},
      {"a short payload", EncodeRawPushPrelude("", header, payload.size() - 4) + payload,
       absl::StatusCode::kInvalidArgument, "expects"},
      {"bf16", EncodeRawPushPrelude("", bf16, payload.size()) + payload,
       absl::StatusCode::kInvalidArgument, "float32 only"},
      {"a NaN", EncodeRawPushPrelude("", header, payload.size()) + with_nan,
       absl::StatusCode::kInvalidArgument, "non-finite value nan at element 1000"},
      {"an unknown worker", EncodeRawPushPrelude("", stranger, payload.size()) + payload,
       absl::StatusCode::kNotFound, ""},
  };
  for (const Case& c : cases) {
    absl::Status carried;
    v1::PushReply reply;
    ASSERT_TRUE(RawExchange(raw0, c.bytes, &carried, &reply).ok()) << c.what << ShardLogs();
    EXPECT_EQ(carried.code(), c.code) << c.what << ": " << carried;
    EXPECT_TRUE(absl::StrContains(carried.message(), c.message)) << c.what << ": " << carried;
  }
  // A push cut off mid-payload: no reply, nothing staged.
  {
    absl::StatusOr<int> fd = ConnectTcp(raw0, absl::Seconds(10));
    ASSERT_TRUE(fd.ok());
    const std::string cut =
        EncodeRawPushPrelude("", header, payload.size()) + payload.substr(0, payload.size() / 2);
    ASSERT_TRUE(WriteAll(*fd, cut.data(), cut.size(), absl::Seconds(30)).ok());
    close(*fd);
  }
  // Nothing was applied: the model is still version 0.
  std::vector<std::vector<float>> now;
  absl::StatusOr<uint64_t> version = client.Pull(joined->worker_id(), 0, true, spec, &now, &bytes);
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ(*version, 0u);
  EXPECT_EQ(now, initial);

  // The clean push (raw to both shards, through the client) is the one outer step.
  absl::StatusOr<v1::PushReply> pushed = client.Push(header, spec, g, {}, 256, nullptr, &bytes);
  ASSERT_TRUE(pushed.ok()) << pushed.status() << ShardLogs();
  EXPECT_TRUE(pushed->applied());
  // Version 1 by number: each shard answers once its COMMIT arrived.
  version = client.Pull(joined->worker_id(), 1, false, spec, &now, &bytes);
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ(*version, 1u);
  double worst = 0;
  for (size_t l = 0; l < now.size(); ++l) {
    for (size_t i = 0; i < now[l].size(); ++i) {
      const double expected = static_cast<double>(initial[l][i]) - 0.5 * g[l][i];
      worst = std::max(worst, std::abs(now[l][i] - expected));
    }
  }
  EXPECT_LT(worst, 1e-6) << "theta_1 = theta_0 - 0.5 g, nothing else";
  // Shard 0 counts the clean push's payload as received over raw pushes, nothing of the others.
  const int metrics = ShardMetricsPort(0);
  ASSERT_GT(metrics, 0);
  const std::string scrape = HttpGet(metrics, "/metrics");
  double raw_bytes = -1;
  for (absl::string_view line : absl::StrSplit(scrape, '\n')) {
    if (absl::ConsumePrefix(&line, "aloe_raw_push_bytes_total ")) {
      ASSERT_TRUE(absl::SimpleAtod(line, &raw_bytes)) << line;
    }
  }
  EXPECT_EQ(raw_bytes, static_cast<double>(payload.size())) << scrape;
  (void)client.Leave(joined->worker_id());
  StopAsyncCluster();
}

}  // namespace
}  // namespace aloe::testing
