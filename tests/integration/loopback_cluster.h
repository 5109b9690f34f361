// Shared fixtures of the loopback integration tests: a small corpus of real text, a real
// aloe-server on OS-chosen ports (LoopbackTest), workers as real processes, and a raw gRPC client
// for hostile input (RawClientTest).
#pragma once

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/config.h"
#include "common/corpus_manifest.h"
#include "common/model_spec.h"
#include "common/raw_push.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "common/token_shard.h"
#include "proto/aloe.grpc.pb.h"
#include "tests/testing/subprocess.h"
#include "worker/client.h"

namespace aloe::testing {

// Public-domain text (Lincoln, Gettysburg Address, 1863), split into paragraphs as shards.
inline constexpr const char* kParagraphs[] = {
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, "
    "conceived in Liberty, and dedicated to the proposition that all men are created equal. ",
    "Now we are engaged in a great civil war, testing whether that nation, or any nation so "
    "conceived and so dedicated, can long endure. We are met on a great battle-field of that "
    "war. We have come to dedicate a portion of that field, as a final resting place for those "
    "who here gave their lives that that nation might live. It is altogether fitting and proper "
    "that we should do this. ",
    "But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow "
    "-- this ground. The brave men, living and dead, who struggled here, have consecrated it, far "
    "above our poor power to add or detract. The world will little note, nor long remember what "
    "we say here, but it can never forget what they did here. ",
    "It is for us the living, rather, to be dedicated here to the unfinished work which they who "
    "fought here have thus far so nobly advanced. It is rather for us to be here dedicated to the "
    "great task remaining before us -- that from these honored dead we take increased devotion to "
    "that cause for which they gave the last full measure of devotion -- that we here highly "
    "resolve that these dead shall not have died in vain -- that this nation, under God, shall "
    "have a new birth of freedom -- and that government of the people, by the people, for the "
    "people, shall not perish from the earth.",
};

// The integer `key` of a worker's closing summary line ("summary: rounds=3 steps=..."); -1 when
// the log has no summary or the key is missing.
inline int SummaryValue(const std::string& log, const std::string& key) {
  const size_t summary = log.find("summary: rounds=");
  if (summary == std::string::npos) return -1;
  const std::string line = log.substr(summary, log.find('\n', summary) - summary);
  for (absl::string_view field : absl::StrSplit(line.substr(9), ' ', absl::SkipEmpty())) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(field, '=');
    int value = -1;
    if (kv.first == key && absl::SimpleAtoi(kv.second, &value)) return value;
  }
  return -1;
}

inline std::vector<uint32_t> Bytes(const std::string& text, int repeat) {
  std::vector<uint32_t> tokens;
  for (int r = 0; r < repeat; ++r) {
    for (unsigned char c : text) tokens.push_back(c);
  }
  return tokens;
}

// Writes `bytes` to a new raw push connection to `address` and reads the reply into *carried.
// Returns the transport's status.
inline absl::Status RawExchange(const std::string& address, const std::string& bytes,
                                absl::Status* carried, v1::PushReply* reply) {
  absl::StatusOr<int> fd = ConnectTcp(address, absl::Seconds(10));
  if (!fd.ok()) return fd.status();
  absl::Status s = WriteAll(*fd, bytes.data(), bytes.size(), absl::Seconds(30));
  SocketStream in(*fd, absl::Seconds(30));
  if (s.ok()) s = ReadRawPushReply(in, carried, reply);
  close(*fd);
  return s;
}

// The header of a simulated worker's push of update `update_id` for `task`.
inline v1::PushHeader TrainHeader(uint64_t worker_id, const v1::Task& task, uint64_t update_id) {
  v1::PushHeader header;
  header.set_worker_id(worker_id);
  header.set_task_id(task.task_id());
  header.set_update_id(update_id);
  header.set_base_version(task.base_version());
  header.set_steps_done(task.local_steps());
  header.set_tokens_learned(100);
  header.set_codec(v1::CODEC_FP32);
  return header;
}

// Plaintext client options for the server (or coordinator) on loopback port `port`.
inline worker::ClientOptions ClientOptionsFor(int port) {
  worker::ClientOptions options;
  options.address = absl::StrCat("127.0.0.1:", port);
  return options;
}

// Joins `client` as trainer `name`, retried while the shards assemble (up to 30 s), and points it
// at the shard processes (and their raw push listeners) of the reply.
inline absl::StatusOr<v1::JoinReply> JoinTrainer(worker::ServerClient& client,
                                                 const std::string& name) {
  v1::JoinRequest join;
  join.set_name(name);
  join.set_role(v1::ROLE_TRAINER);
  absl::StatusOr<v1::JoinReply> joined;
  for (int i = 0; i < 300; ++i) {
    joined = client.Join(join);
    if (joined.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (!joined.ok()) return joined.status();
  ALOE_RETURN_IF_ERROR(client.SetShards(
      {joined->shard_addresses().begin(), joined->shard_addresses().end()},
      {joined->shard_push_addresses().begin(), joined->shard_push_addresses().end()}));
  return joined;
}

class LoopbackTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/aloe_it_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    ASSERT_EQ(std::system(("rm -rf " + dir_ + " && mkdir -p " + dir_ + "/shards").c_str()), 0);
    std::vector<CorpusShardInfo> shards;
    std::string all;
    for (size_t i = 0; i < std::size(kParagraphs); ++i) {
      const std::string file = absl::StrCat("shards/p", i, ".tok");
      std::vector<uint32_t> tokens = Bytes(kParagraphs[i], 8);
      ASSERT_TRUE(WriteTokenShard(dir_ + "/" + file, tokens, 256).ok());
      shards.push_back({absl::StrCat("p", i), file, tokens.size(), false});
      all += kParagraphs[i];
    }
    std::vector<uint32_t> heldout = Bytes(all, 2);
    ASSERT_TRUE(WriteTokenShard(dir_ + "/heldout.tok", heldout, 256).ok());
    shards.push_back({"heldout", "heldout.tok", heldout.size(), true});
    ASSERT_TRUE(WriteCorpusManifest(dir_, shards).ok());
  }

  std::string Bin(const std::string& name) { return std::string(ALOE_BIN_DIR) + "/" + name; }

  // The config of a server role started in this process: the loopback corpus, a tiny model,
  // sync rounds of one trainer and `extra` config text; written to dir_/<name> and loaded
  // (common/config.h). A failure is reported and gives the default config.
  v1::ServerConfig InProcessConfig(const std::string& name, const std::string& extra) {
    std::ofstream(dir_ + "/" + name) << absl::StrCat(R"(
      listen_address: "127.0.0.1:0"
      metrics_address: "off"
      corpus_dir: ")",
                                                     dir_, R"("
      model { vocab_size: 256 seq_len: 32 d_model: 32 num_layers: 1 num_heads: 2 }
      inner_optimizer { batch_size: 2 }
      aggregation { min_workers: 1 }
      )",
                                                     extra);
    absl::StatusOr<v1::ServerConfig> config = LoadServerConfig(dir_ + "/" + name);
    EXPECT_TRUE(config.ok()) << config.status();
    return config.ok() ? *config : v1::ServerConfig();
  }

  static constexpr char kNesterov[] =
      "outer_optimizer { type: OUTER_NESTEROV lr: 0.7 momentum: 0.9 }";

  // Starts aloe-server with the given extra config text, outer optimizer block and extra
  // command-line flags; returns the gRPC port.
  int StartServer(const std::string& extra_config, const std::string& outer_optimizer = kNesterov,
                  const std::vector<std::string>& extra_flags = {}) {
    std::ofstream(dir_ + "/server.textproto")
        << absl::StrCat(R"(
      listen_address: "127.0.0.1:0"
      metrics_address: "127.0.0.1:0"
      corpus_dir: ")",
                        dir_, R"("
      )",
                        model_, R"(
      inner_optimizer { lr: 0.003 min_lr: 0.0003 warmup_steps: 5 total_steps: 400 batch_size: 8 }
      lease_seconds: )",
                        lease_seconds_, "\n", outer_optimizer, "\n", extra_config);
    std::remove((dir_ + "/ports").c_str());
    std::vector<std::string> argv = {Bin("aloe-server"), "--config=" + dir_ + "/server.textproto",
                                     "--port_file=" + dir_ + "/ports",
                                     "--summary_file=" + dir_ + "/summary"};
    argv.insert(argv.end(), extra_flags.begin(), extra_flags.end());
    server_ = std::make_unique<Subprocess>(argv, dir_ + "/server.log");
    EXPECT_GT(server_->pid(), 0);
    if (!WaitForFile(dir_ + "/ports", absl::Seconds(30))) {
      ADD_FAILURE() << "server did not start:\n" << ReadFile(dir_ + "/server.log");
      return 0;
    }
    std::map<std::string, int> ports;
    for (absl::string_view kv :
         absl::StrSplit(ReadFile(dir_ + "/ports"), absl::ByAnyChar(" \n"), absl::SkipEmpty())) {
      std::pair<std::string, std::string> p = absl::StrSplit(kv, '=');
      absl::SimpleAtoi(p.second, &ports[p.first]);
    }
    metrics_port_ = ports["metrics"];
    return ports["grpc"];
  }

  std::unique_ptr<Subprocess> StartWorker(int port, const std::string& role, int index,
                                          double slowdown = 1.0,
                                          const std::vector<std::string>& extra_flags = {}) {
    // On the CPU unless a test's flags say otherwise (a later --device wins): the same
    // numbers in every build, GPU or not.
    std::vector<std::string> argv = {
        Bin("aloe-worker"),    absl::StrCat("--server=127.0.0.1:", port),
        "--role=" + role,      "--corpus_dir=" + dir_,
        "--metrics=off",       absl::StrCat("--slowdown=", slowdown),
        "--eval_sequences=16", absl::StrCat("--name=", role, index),
        "--device=cpu"};
    argv.insert(argv.end(), model_flags_.begin(), model_flags_.end());
    argv.insert(argv.end(), extra_flags.begin(), extra_flags.end());
    return std::make_unique<Subprocess>(argv, absl::StrCat(dir_, "/", role, index, ".log"));
  }

  // Starts the evaluator and returns once it has joined (up to 60 s), so that trainers started
  // next leave it version 0 to evaluate (a loaded machine can take seconds to start LibTorch).
  std::unique_ptr<Subprocess> StartJoinedEvaluator(int port,
                                                   const std::vector<std::string>& flags = {}) {
    auto evaluator = StartWorker(port, "evaluator", 0, 1.0, flags);
    WaitForText(dir_ + "/evaluator0.log", "joined as worker", absl::Seconds(60));
    return evaluator;
  }

  std::string Logs() {
    std::string all;
    for (const char* f : {"server.log", "trainer0.log", "trainer1.log", "evaluator0.log"}) {
      all += absl::StrCat("==== ", f, "\n", ReadFile(dir_ + "/" + f));
    }
    return all;
  }

  struct TrainingRun {
    std::map<std::string, std::string> summary;  // the server's --summary_file
    std::vector<std::pair<int, double>> evals;   // (version, held-out loss)
    std::string scrape;  // a /metrics scrape taken once training moved past version 0
  };

  // Sync training with an evaluator and two trainers (one 1.5x slower) until the server's stop
  // condition; every process must exit with 0.
  void TrainTwoWorkers(const std::string& extra_config, const std::string& outer_optimizer,
                       TrainingRun* run, double slowdown = 1.5) {
    const int port = StartServer(extra_config, outer_optimizer);
    ASSERT_GT(port, 0);
    auto evaluator = StartJoinedEvaluator(port);
    auto w0 = StartWorker(port, "trainer", 0);
    auto w1 = StartWorker(port, "trainer", 1, slowdown);

    // A real scrape of the Prometheus endpoint while training runs.
    // Keeps the last successful scrape taken once training has moved past version 0.
    for (int i = 0; i < 400; ++i) {
      const std::string body = HttpGet(metrics_port_, "/metrics");
      if (!body.empty()) run->scrape = body;
      if (!run->scrape.empty() && run->scrape.find("aloe_model_version 0") == std::string::npos) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }

    std::optional<int> code = server_->Wait(absl::Seconds(240));
    ASSERT_TRUE(code.has_value()) << "server did not finish\n" << Logs();
    ASSERT_EQ(*code, 0) << Logs();
    EXPECT_EQ(w0->Wait(absl::Seconds(30)), std::optional<int>(0)) << Logs();
    EXPECT_EQ(w1->Wait(absl::Seconds(30)), std::optional<int>(0)) << Logs();
    EXPECT_EQ(evaluator->Wait(absl::Seconds(30)), std::optional<int>(0)) << Logs();

    ReadSummary(run);
  }

  // The server's --summary_file: its evaluations and the other key=value lines.
  void ReadSummary(TrainingRun* run) {
    for (absl::string_view line :
         absl::StrSplit(ReadFile(dir_ + "/summary"), '\n', absl::SkipEmpty())) {
      std::pair<std::string, std::string> kv = absl::StrSplit(line, '=');
      if (kv.first == "eval") {
        std::pair<std::string, std::string> ve = absl::StrSplit(kv.second, ':');
        int v = 0;
        double loss = 0;
        ASSERT_TRUE(absl::SimpleAtoi(ve.first, &v) && absl::SimpleAtod(ve.second, &loss));
        run->evals.emplace_back(v, loss);
      } else {
        run->summary[kv.first] = kv.second;
      }
    }
  }

  // 8 sync rounds of 2 workers each, evaluated at versions 0 and 8, and the model must clearly
  // learn the text: byte-level start is ln(256) = 5.55 nats.
  void ExpectEightRoundsAndEvalLossFalls(const TrainingRun& run) {
    EXPECT_EQ(run.summary.count("version") ? run.summary.at("version") : "", "8") << Logs();
    EXPECT_EQ(run.summary.count("updates_applied") ? run.summary.at("updates_applied") : "", "16")
        << Logs();
    ASSERT_GE(run.evals.size(), 2u) << Logs();
    EXPECT_EQ(run.evals.front().first, 0);
    EXPECT_EQ(run.evals.back().first, 8);
    EXPECT_GT(run.evals.front().second, 5.0);
    EXPECT_LT(run.evals.back().second, run.evals.front().second - 1.5)
        << "eval loss " << run.evals.front().second << " -> " << run.evals.back().second << "\n"
        << Logs();
  }

  // The value of the series `series` (e.g. aloe_model_version or
  // aloe_updates_rejected_total{reason="stale"}) in a fresh scrape; NaN when absent.
  double Scraped(const std::string& series) {
    const std::string scrape = HttpGet(metrics_port_, "/metrics");
    for (absl::string_view line : absl::StrSplit(scrape, '\n')) {
      if (absl::StartsWith(line, series + " ")) {
        double value = 0;
        if (absl::SimpleAtod(line.substr(series.size() + 1), &value)) return value;
      }
    }
    return std::nan("");
  }

  // A deterministic job: one trainer (started with `worker_flags`), sync rounds until
  // max_versions, with `config` (which must set local_steps and max_versions) and a checkpoint
  // directory dir_/ckpt_<name> that receives the final state. With `evaluate`, an evaluator joins
  // first and measures versions 0 and the final one (evaluation reads the model, so the training
  // stays deterministic); FinalEvalLoss() then reads the last. Returns the checkpoint directory;
  // the trainer's log is kept as <name>.log, the server's as <name>.server.log.
  std::string RunSingleTrainerJob(const std::string& name, const std::string& config,
                                  const std::vector<std::string>& worker_flags = {},
                                  bool evaluate = false,
                                  const std::vector<std::string>& server_flags = {}) {
    const std::string ckpt = dir_ + "/ckpt_" + name;
    const int port = StartServer(absl::StrCat(config, "\naggregation { min_workers: 1 }\n",
                                              evaluate ? "eval_every: 1000000\n" : "",
                                              "checkpoint { dir: \"", ckpt, "\" keep: 1 }\n"),
                                 kNesterov, server_flags);
    EXPECT_GT(port, 0);
    if (port == 0) return ckpt;
    std::unique_ptr<Subprocess> evaluator;
    if (evaluate) {
      evaluator = StartJoinedEvaluator(port, {"--eval_sequences=64"});
    }
    auto worker = StartWorker(port, "trainer", 0, 1.0, worker_flags);
    EXPECT_EQ(server_->Wait(absl::Seconds(180)), std::optional<int>(0)) << Logs();
    EXPECT_EQ(worker->Wait(absl::Seconds(60)), std::optional<int>(0)) << Logs();
    if (evaluator) {
      EXPECT_EQ(evaluator->Wait(absl::Seconds(60)), std::optional<int>(0)) << Logs();
    }
    std::rename((dir_ + "/trainer0.log").c_str(), (dir_ + "/" + name + ".log").c_str());
    std::rename((dir_ + "/server.log").c_str(), (dir_ + "/" + name + ".server.log").c_str());
    return ckpt;
  }

  // The held-out loss of the last evaluation in the server's summary; NaN when there is none.
  double FinalEvalLoss() {
    const std::string summary = ReadFile(dir_ + "/summary");
    const size_t at = summary.rfind("eval=");
    double loss = std::nan("");
    if (at != std::string::npos) {
      const std::string value = summary.substr(summary.find(':', at) + 1);
      absl::SimpleAtod(value.substr(0, value.find('\n')), &loss);
    }
    EXPECT_FALSE(std::isnan(loss)) << summary << Logs();
    return loss;
  }

  std::string dir_;
  // The model block of StartServer's config (a test of imported models sets model_file instead).
  std::string model_ =
      "model { vocab_size: 256 seq_len: 32 d_model: 64 num_layers: 2 num_heads: 2 }";
  std::vector<std::string> model_flags_;  // flags of every worker, e.g. --torchscript
  double lease_seconds_ = 20;             // the server's worker lease
  int metrics_port_ = 0;
  std::unique_ptr<Subprocess> server_;
};

// The version a shard process said it stopped at ("shard I stops at version N"), or -1.
inline int StoppedAt(const std::string& log) {
  const size_t at = log.rfind("stops at version ");
  int version = -1;
  if (at != std::string::npos) {
    absl::SimpleAtoi(log.substr(at + 17, log.find('\n', at) - at - 17), &version);
  }
  return version;
}

// A layer-sharded server: the coordinator is StartServer's (with --role=coordinator and
// shard_processes 2 in its config), the shard processes are StartShard's.
class ShardedLoopbackTest : public LoopbackTest {
 protected:
  // Starts shard process `index` of the coordinator at `coordinator_port`, listening on
  // shard_ports_[index] (and with raw_pushes_ on push_ports_[index]); its log is
  // shard<index>.log, or shard<index>-resumed.log with `resume`. `extra_flags` follow, e.g.
  // --advertise.
  std::unique_ptr<Subprocess> StartShard(int index, int coordinator_port, bool resume,
                                         const std::vector<std::string>& extra_flags = {}) {
    std::vector<std::string> argv = {Bin("aloe-server"),
                                     "--config=" + dir_ + "/server.textproto",
                                     "--role=shard",
                                     absl::StrCat("--shard_index=", index),
                                     absl::StrCat("--listen=127.0.0.1:", shard_ports_[index]),
                                     absl::StrCat("--coordinator=127.0.0.1:", coordinator_port),
                                     absl::StrCat("--port_file=", dir_, "/shard", index, ".ports"),
                                     "--metrics=127.0.0.1:0"};
    if (resume) argv.push_back("--resume");
    if (raw_pushes_) argv.push_back(absl::StrCat("--push_listen=127.0.0.1:", push_ports_[index]));
    argv.insert(argv.end(), extra_flags.begin(), extra_flags.end());
    return std::make_unique<Subprocess>(
        argv, absl::StrCat(dir_, "/shard", index, resume ? "-resumed" : "", ".log"));
  }

  // Logs() and the shard processes' logs.
  std::string ShardLogs() {
    std::string all = Logs();
    for (const char* f : {"shard0.log", "shard1.log", "shard0-resumed.log", "shard1-resumed.log"}) {
      all += absl::StrCat("==== ", f, "\n", ReadFile(dir_ + "/" + f));
    }
    return all;
  }

  // The coordinator ends the job (exit 0 within 300 s), then every one of `processes` exits 0.
  void ExpectJobEnds(const std::vector<Subprocess*>& processes) {
    std::optional<int> code = server_->Wait(absl::Seconds(300));
    ASSERT_TRUE(code.has_value()) << "coordinator did not finish\n" << ShardLogs();
    ASSERT_EQ(*code, 0) << ShardLogs();
    for (Subprocess* p : processes) {
      EXPECT_EQ(p->Wait(absl::Seconds(30)), std::optional<int>(0)) << ShardLogs();
    }
  }

  int shard_ports_[2] = {FreePort(), FreePort()};
  std::unique_ptr<Subprocess> shards_[2];  // the shard processes a test started
  bool raw_pushes_ = false;                // the shards also take raw pushes
  int push_ports_[2] = {FreePort(), FreePort()};
};

// A raw client joins as a trainer and sends malformed pushes over real gRPC.
class RawClientTest : public LoopbackTest {
 protected:
  void Connect(int port) {
    channel_ =
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
    coordinator_ = v1::Coordinator::NewStub(channel_);
    parameters_ = v1::ParameterService::NewStub(channel_);
  }

  std::vector<std::vector<float>> PullLatest(uint64_t worker) {
    grpc::ClientContext context;
    v1::PullRequest request;
    request.set_worker_id(worker);
    request.set_latest(true);
    auto reader = parameters_->Pull(&context, request);
    std::vector<std::vector<float>> layers(spec_.layers_size());
    v1::ParamChunk chunk;
    while (reader->Read(&chunk)) {
      auto& layer = layers[chunk.layer_id()];
      const size_t n = chunk.data().size() / 4;
      layer.resize(chunk.offset() + n);
      EXPECT_TRUE(
          DecodeFloats(chunk.data(), absl::MakeSpan(layer.data() + chunk.offset(), n)).ok());
    }
    EXPECT_TRUE(reader->Finish().ok());
    return layers;
  }

  // Pushes `chunks` after a header; returns the final status.
  grpc::Status Push(const v1::PushHeader& header, const std::vector<v1::PushChunk>& chunks) {
    grpc::ClientContext context;
    v1::PushReply reply;
    auto writer = parameters_->Push(&context, &reply);
    v1::PushChunk first;
    *first.mutable_header() = header;
    writer->Write(first);
    for (const auto& c : chunks) {
      if (!writer->Write(c)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }

  std::vector<v1::PushChunk> FullUpdate(float value) {
    std::vector<v1::PushChunk> chunks;
    for (const auto& layer : spec_.layers()) {
      std::vector<float> g(layer.num_elements(), value);
      for (auto [b, e] : ChunkRanges(g.size())) {
        v1::PushChunk c;
        c.set_layer_id(layer.id());
        c.set_offset(b);
        AppendFloats(absl::MakeConstSpan(g.data() + b, e - b), c.mutable_data());
        chunks.push_back(c);
      }
    }
    return chunks;
  }

  // Joins as a trainer named `name` and takes the first task (which must be TRAIN); sets spec_.
  void JoinTrainer(const std::string& name, v1::JoinReply* joined, v1::Task* task) {
    {
      grpc::ClientContext context;
      v1::JoinRequest request;
      request.set_name(name);
      ASSERT_TRUE(coordinator_->Join(&context, request, joined).ok());
    }
    spec_ = joined->model_spec();
    grpc::ClientContext context;
    v1::TaskRequest request;
    request.set_worker_id(joined->worker_id());
    ASSERT_TRUE(coordinator_->RequestTask(&context, request, task).ok());
    ASSERT_EQ(task->kind(), v1::Task::TRAIN);
  }

  // The header of a well-formed push for `task`.
  static v1::PushHeader HeaderFor(const v1::JoinReply& joined, const v1::Task& task) {
    v1::PushHeader header;
    header.set_worker_id(joined.worker_id());
    header.set_task_id(task.task_id());
    header.set_update_id(1);
    header.set_base_version(task.base_version());
    header.set_steps_done(task.local_steps());
    return header;
  }

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> coordinator_;
  std::unique_ptr<v1::ParameterService::Stub> parameters_;
  v1::ModelSpec spec_;
};

}  // namespace aloe::testing
