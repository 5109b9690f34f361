// Exact resume: a real aloe-server is killed with SIGKILL mid-run, restarted with --resume (its
// newest checkpoint truncated on purpose, so the one before must be used), and a deterministic
// client finishes the job. The final parameters must be bit-identical to an uninterrupted run.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/corpus_manifest.h"
#include "common/tensor_codec.h"
#include "common/token_shard.h"
#include "proto/aloe.grpc.pb.h"
#include "server/core/checkpoint_store.h"
#include "tests/testing/subprocess.h"

namespace aloe {
namespace {

using ::aloe::testing::ReadFile;
using ::aloe::testing::Subprocess;
using ::aloe::testing::WaitForFile;

// A trainer whose pseudo-gradient depends only on the pulled parameters and the task:
// g = 0.05 * theta + 0.01 * sin(seed + i + 7 * shard_hash) - so any difference in the server's
// state, task sequence or seeds shows up in the final parameters.
class DeterministicClient {
 public:
  explicit DeterministicClient(int port) {
    auto channel =
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
    coordinator_ = v1::Coordinator::NewStub(channel);
    parameters_ = v1::ParameterService::NewStub(channel);
    grpc::ClientContext context;
    v1::JoinRequest request;
    request.set_name("deterministic");
    EXPECT_TRUE(coordinator_->Join(&context, request, &joined_).ok());
  }

  // Runs one task; returns the version after it, or -1 on STOP / error.
  int64_t Round() {
    v1::Task task;
    for (int i = 0; i < 50; ++i) {
      grpc::ClientContext context;
      v1::TaskRequest request;
      request.set_worker_id(joined_.worker_id());
      if (!coordinator_->RequestTask(&context, request, &task).ok()) return -1;
      if (task.kind() != v1::Task::WAIT) break;
    }
    if (task.kind() != v1::Task::TRAIN) return -1;
    const v1::ModelSpec& spec = joined_.model_spec();
    std::vector<std::vector<float>> theta(spec.layers_size());
    {
      grpc::ClientContext context;
      v1::PullRequest request;
      request.set_worker_id(joined_.worker_id());
      request.set_version(task.base_version());
      auto reader = parameters_->Pull(&context, request);
      v1::ParamChunk chunk;
      while (reader->Read(&chunk)) {
        auto& layer = theta[chunk.layer_id()];
        layer.resize(chunk.layer_elements());
        const size_t n = chunk.data().size() / 4;
        EXPECT_TRUE(
            DecodeFloats(chunk.data(), absl::MakeSpan(layer.data() + chunk.offset(), n)).ok());
      }
      if (!reader->Finish().ok()) return -1;
    }
    uint64_t shard_hash = 0;
    for (char c : task.shard_name()) shard_hash = shard_hash * 31 + static_cast<unsigned char>(c);
    grpc::ClientContext context;
    v1::PushReply reply;
    auto writer = parameters_->Push(&context, &reply);
    v1::PushChunk chunk;
    v1::PushHeader* header = chunk.mutable_header();
    header->set_worker_id(joined_.worker_id());
    header->set_task_id(task.task_id());
    header->set_update_id(task.task_id());
    header->set_base_version(task.base_version());
    header->set_steps_done(task.local_steps());
    header->set_tokens_learned(100);
    for (int l = 0; l < spec.layers_size(); ++l) {
      std::vector<float> g(theta[l].size());
      for (size_t i = 0; i < g.size(); ++i) {
        g[i] = 0.05f * theta[l][i] +
               0.01f * static_cast<float>(std::sin(double(task.seed() % 1000003) + i +
                                                   7.0 * double(shard_hash % 1000) + l));
      }
      for (auto [b, e] : ChunkRanges(g.size())) {
        chunk.set_layer_id(l);
        chunk.set_offset(b);
        chunk.mutable_data()->clear();
        AppendFloats(absl::MakeConstSpan(g.data() + b, e - b), chunk.mutable_data());
        if (!writer->Write(chunk)) break;
        chunk.clear_header();
      }
    }
    writer->WritesDone();
    if (!writer->Finish().ok()) return -1;
    return static_cast<int64_t>(reply.version());
  }

  void Leave() {
    grpc::ClientContext context;
    v1::LeaveRequest request;
    request.set_worker_id(joined_.worker_id());
    v1::LeaveReply reply;
    coordinator_->Leave(&context, request, &reply);
  }

 private:
  std::unique_ptr<v1::Coordinator::Stub> coordinator_;
  std::unique_ptr<v1::ParameterService::Stub> parameters_;
  v1::JoinReply joined_;
};

class ResumeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/aloe_resume_" + std::to_string(::getpid());
    ASSERT_EQ(std::system(("rm -rf " + dir_ + " && mkdir -p " + dir_ + "/shards").c_str()), 0);
    std::vector<CorpusShardInfo> shards;
    for (int i = 0; i < 3; ++i) {
      std::vector<uint32_t> tokens(2000 * (i + 1));
      for (size_t t = 0; t < tokens.size(); ++t) tokens[t] = (t * (i + 3)) % 256;
      const std::string file = absl::StrCat("shards/s", i, ".tok");
      ASSERT_TRUE(WriteTokenShard(dir_ + "/" + file, tokens, 256).ok());
      shards.push_back({absl::StrCat("s", i), file, tokens.size(), false});
    }
    ASSERT_TRUE(WriteTokenShard(dir_ + "/heldout.tok", std::vector<uint32_t>(500, 1), 256).ok());
    shards.push_back({"heldout", "heldout.tok", 500, true});
    ASSERT_TRUE(WriteCorpusManifest(dir_, shards).ok());
    std::ofstream(dir_ + "/server.textproto") << absl::StrCat(R"(
      listen_address: "127.0.0.1:0"
      metrics_address: "off"
      corpus_dir: ")",
                                                              dir_, R"("
      model { vocab_size: 256 seq_len: 16 d_model: 32 num_layers: 2 num_heads: 2 }
      outer_optimizer { type: OUTER_DELAYED_NESTEROV lr: 0.7 momentum: 0.9 dn_buffer_size: 3 }
      local_steps: 5
      max_versions: 12
      checkpoint { every_versions: 2 keep: 10 }
    )");
  }

  // Starts a server on checkpoint dir `ckpt`; returns its gRPC port.
  int Start(const std::string& ckpt, bool resume, const std::string& log) {
    std::remove((dir_ + "/ports").c_str());
    std::vector<std::string> argv = {std::string(ALOE_BIN_DIR) + "/aloe-server",
                                     "--config=" + dir_ + "/server.textproto",
                                     "--checkpoint_dir=" + ckpt, "--port_file=" + dir_ + "/ports"};
    if (resume) argv.push_back("--resume");
    server_ = std::make_unique<Subprocess>(argv, log);
    if (!WaitForFile(dir_ + "/ports", absl::Seconds(30))) {
      ADD_FAILURE() << ReadFile(log);
      return 0;
    }
    const std::string ports = ReadFile(dir_ + "/ports");
    int port = 0;
    absl::SimpleAtoi(ports.substr(5, ports.find(' ') - 5), &port);
    return port;
  }

  std::string FinalParams(const std::string& ckpt) {
    auto loaded = server::CheckpointStore(ckpt, 10).LoadLatest();
    EXPECT_TRUE(loaded.ok()) << loaded.status();
    if (!loaded.ok()) return "";
    EXPECT_EQ(loaded->checkpoint.version(), 12u);
    std::string all;
    for (const std::string& layer : loaded->checkpoint.layer_params()) all += layer;
    return all;
  }

  std::string dir_;
  std::unique_ptr<Subprocess> server_;
};

TEST_F(ResumeTest, SigkillThenResumeEndsBitIdenticalToAnUninterruptedRun) {
  // Uninterrupted.
  const std::string ckpt_a = dir_ + "/ckpt_a";
  int port = Start(ckpt_a, false, dir_ + "/a.log");
  ASSERT_GT(port, 0);
  {
    DeterministicClient client(port);
    while (client.Round() > 0) {
    }
    client.Leave();
  }
  ASSERT_EQ(server_->Wait(absl::Seconds(30)), std::optional<int>(0)) << ReadFile(dir_ + "/a.log");
  const std::string expected = FinalParams(ckpt_a);
  ASSERT_FALSE(expected.empty());

  // Interrupted: SIGKILL after version 7, once the checkpoint of version 6 is on disk.
  const std::string ckpt_b = dir_ + "/ckpt_b";
  port = Start(ckpt_b, false, dir_ + "/b1.log");
  ASSERT_GT(port, 0);
  {
    DeterministicClient client(port);
    // (Checkpoints due faster than the server's loop writes them are coalesced: wait for the
    // ones this test needs.)
    int64_t version = 0;
    while (version < 4) ASSERT_GT(version = client.Round(), 0);
    ASSERT_TRUE(WaitForFile(ckpt_b + "/checkpoint-000000000004.aloeckpt", absl::Seconds(10)));
    while (version < 7) ASSERT_GT(version = client.Round(), 0);
    ASSERT_TRUE(WaitForFile(ckpt_b + "/checkpoint-000000000006.aloeckpt", absl::Seconds(10)));
    server_->Signal(SIGKILL);
    ASSERT_EQ(server_->Wait(absl::Seconds(10)), std::optional<int>(128 + SIGKILL));
  }
  // A torn newest checkpoint: resume must detect it and fall back to version 4.
  const std::string newest = ckpt_b + "/checkpoint-000000000006.aloeckpt";
  ASSERT_EQ(::truncate(newest.c_str(), 200), 0);
  port = Start(ckpt_b, true, dir_ + "/b2.log");
  ASSERT_GT(port, 0);
  {
    DeterministicClient client(port);
    while (client.Round() > 0) {
    }
    client.Leave();
  }
  ASSERT_EQ(server_->Wait(absl::Seconds(30)), std::optional<int>(0)) << ReadFile(dir_ + "/b2.log");
  const std::string log = ReadFile(dir_ + "/b2.log");
  EXPECT_NE(log.find("checkpoint-000000000006.aloeckpt: truncated"), std::string::npos) << log;
  EXPECT_NE(log.find("trying the previous checkpoint"), std::string::npos) << log;
  EXPECT_NE(log.find("resumed at version 4"), std::string::npos) << log;
  const std::string resumed = FinalParams(ckpt_b);
  ASSERT_EQ(resumed.size(), expected.size());
  EXPECT_TRUE(resumed == expected) << "final parameters differ after resume";
}

}  // namespace
}  // namespace aloe
