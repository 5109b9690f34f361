// Security on real processes: shared-token auth with per-worker identities, TLS and mutual TLS
// (certificates from scripts/make-test-ca.sh), and the refusal to listen on a non-loopback
// address without TLS and a token. Raw pushes (--push_listen) under mutual TLS: the job's
// certificates only, nothing staged from anybody else. A layer-sharded server under mutual TLS
// and tokens, and shard addresses workers could not dial refused.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <memory>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/corpus_manifest.h"
#include "common/raw_push.h"
#include "common/token_shard.h"
#include "proto/aloe.grpc.pb.h"
#include "tests/integration/loopback_cluster.h"
#include "tests/testing/subprocess.h"
#include "worker/client.h"

namespace aloe {
namespace {

using ::aloe::testing::FreePort;
using ::aloe::testing::HttpGet;
using ::aloe::testing::RawExchange;
using ::aloe::testing::ReadFile;
using ::aloe::testing::Subprocess;
using ::aloe::testing::WaitForFile;

// The largest |now - (before - lr g)| over every element: 0 when `now` is `before` after one
// outer SGD step of learning rate lr on g.
double SgdStepError(const std::vector<std::vector<float>>& before,
                    const std::vector<std::vector<float>>& g, double lr,
                    const std::vector<std::vector<float>>& now) {
  double worst = now.size() == before.size() ? 0 : INFINITY;
  for (size_t l = 0; l < now.size() && l < before.size(); ++l) {
    if (now[l].size() != before[l].size()) return INFINITY;
    for (size_t i = 0; i < now[l].size(); ++i) {
      const double expected = static_cast<double>(before[l][i]) - lr * g[l][i];
      worst = std::max(worst, std::abs(now[l][i] - expected));
    }
  }
  return worst;
}

constexpr char kTokenA[] = "alpha-0123456789abcdef";
constexpr char kTokenB[] = "bravo-0123456789abcdef";

class SecurityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/aloe_security_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    ASSERT_EQ(std::system(("rm -rf " + dir_ + " && mkdir -p " + dir_ + "/shards").c_str()), 0);
    std::vector<uint32_t> tokens(4000);
    for (size_t t = 0; t < tokens.size(); ++t) tokens[t] = (t * 7) % 256;
    ASSERT_TRUE(WriteTokenShard(dir_ + "/shards/a.tok", tokens, 256).ok());
    ASSERT_TRUE(WriteTokenShard(dir_ + "/heldout.tok", tokens, 256).ok());
    ASSERT_TRUE(WriteCorpusManifest(dir_, {{"a", "shards/a.tok", tokens.size(), false},
                                           {"heldout", "heldout.tok", tokens.size(), true}})
                    .ok());
    ASSERT_EQ(std::system((std::string(ALOE_SOURCE_DIR) + "/scripts/make-test-ca.sh " + dir_ +
                           "/ca > /dev/null")
                              .c_str()),
              0);
    std::ofstream(dir_ + "/tokens")
        << "# identity token\nalpha " << kTokenA << "\nbravo " << kTokenB << "\n";
    std::ofstream(dir_ + "/token_a") << kTokenA << "\n";
  }

  // Starts aloe-server with `security` (a SecurityConfig body) and `extra_config` (more config
  // fields); returns the gRPC port or 0.
  int Start(const std::string& security, const std::string& listen = "127.0.0.1:0",
            std::vector<std::string> extra_flags = {}, const std::string& extra_config = "") {
    std::ofstream(dir_ + "/server.textproto") << absl::StrCat(R"(
      listen_address: ")",
                                                              listen, R"("
      metrics_address: "off"
      corpus_dir: ")",
                                                              dir_, R"("
      model { vocab_size: 256 seq_len: 16 d_model: 32 num_layers: 1 num_heads: 2 }
      local_steps: 3
      max_versions: 3
      security { )",
                                                              security, " }\n", extra_config, "\n");
    std::vector<std::string> argv = {std::string(ALOE_BIN_DIR) + "/aloe-server",
                                     "--config=" + dir_ + "/server.textproto",
                                     "--port_file=" + dir_ + "/ports"};
    argv.insert(argv.end(), extra_flags.begin(), extra_flags.end());
    std::remove((dir_ + "/ports").c_str());
    server_ = std::make_unique<Subprocess>(argv, dir_ + "/server.log");
    // Up to 20 s, but not past the server's exit (a refused configuration exits at once).
    bool up = false;
    for (int i = 0; i < 200 && !up; ++i) {
      up = WaitForFile(dir_ + "/ports", absl::Milliseconds(100));
      if (!up && server_->Wait(absl::ZeroDuration()).has_value()) return 0;
    }
    if (!up) return 0;
    const std::string ports = ReadFile(dir_ + "/ports");
    int port = 0;
    absl::SimpleAtoi(ports.substr(5, ports.find(' ') - 5), &port);
    return port;
  }

  // Starts aloe-server as Start does and expects it to refuse at once: exit 1, with `message`
  // in its log.
  void ExpectRefused(const std::string& security, const std::vector<std::string>& flags,
                     const std::string& extra_config, const std::string& message) {
    EXPECT_EQ(Start(security, "127.0.0.1:0", flags, extra_config), 0) << message;
    EXPECT_EQ(server_->Wait(absl::Seconds(10)), std::optional<int>(1)) << message;
    EXPECT_NE(ReadFile(dir_ + "/server.log").find(message), std::string::npos)
        << ReadFile(dir_ + "/server.log");
  }

  std::string Pem(const std::string& name) { return ReadFile(dir_ + "/ca/" + name); }

  // The port `key` ("grpc", "metrics") of port file `file` in dir_; 0 when absent.
  int PortIn(const std::string& file, const std::string& key) {
    for (absl::string_view kv :
         absl::StrSplit(ReadFile(dir_ + "/" + file), absl::ByAnyChar(" \n"), absl::SkipEmpty())) {
      int port = 0;
      if (absl::ConsumePrefix(&kv, key + "=") && absl::SimpleAtoi(kv, &port)) return port;
    }
    return 0;
  }

  std::unique_ptr<v1::Coordinator::Stub> Stub(int port, bool tls, bool client_cert) {
    std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
    if (tls) {
      grpc::SslCredentialsOptions ssl;
      ssl.pem_root_certs = Pem("ca.pem");
      if (client_cert) {
        ssl.pem_cert_chain = Pem("client.pem");
        ssl.pem_private_key = Pem("client.key");
      }
      credentials = grpc::SslCredentials(ssl);
    }
    return v1::Coordinator::NewStub(
        grpc::CreateChannel(absl::StrCat("localhost:", port), credentials));
  }

  grpc::Status Join(v1::Coordinator::Stub& stub, const std::string& token, v1::JoinReply* reply) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!token.empty()) context.AddMetadata("x-aloe-token", token);
    v1::JoinRequest request;
    request.set_name("probe");
    return stub.Join(&context, request, reply);
  }

  std::string dir_;
  std::unique_ptr<Subprocess> server_;
};

TEST_F(SecurityTest, TokensIdentifyCallersAndWorkerIdsBelongToTheirIdentity) {
  const int port = Start(absl::StrCat("token_file: \"", dir_, "/tokens\""));
  ASSERT_GT(port, 0) << ReadFile(dir_ + "/server.log");
  auto stub = Stub(port, false, false);
  v1::JoinReply joined;
  grpc::Status s = Join(*stub, "", &joined);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  EXPECT_NE(s.error_message().find("x-aloe-token"), std::string::npos);
  s = Join(*stub, "not-a-valid-token-at-all", &joined);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  ASSERT_TRUE(Join(*stub, kTokenA, &joined).ok());
  // bravo may not act for alpha's worker.
  grpc::ClientContext context;
  context.AddMetadata("x-aloe-token", kTokenB);
  v1::TaskRequest request;
  request.set_worker_id(joined.worker_id());
  v1::Task task;
  s = stub->RequestTask(&context, request, &task);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_NE(s.error_message().find("alpha"), std::string::npos) << s.error_message();
  server_->Signal(SIGTERM);
  EXPECT_EQ(server_->Wait(absl::Seconds(20)), std::optional<int>(0));
}

TEST_F(SecurityTest, MutualTlsWorkerTrainsAndClientsWithoutCertificatesAreRefused) {
  const int port =
      Start(absl::StrCat("token_file: \"", dir_, "/tokens\" tls_cert_file: \"", dir_,
                         "/ca/server.pem\" tls_key_file: \"", dir_,
                         "/ca/server.key\" tls_client_ca_file: \"", dir_, "/ca/ca.pem\""));
  ASSERT_GT(port, 0) << ReadFile(dir_ + "/server.log");
  v1::JoinReply joined;
  // Plaintext and TLS without a client certificate both fail the handshake.
  auto plain = Stub(port, false, false);
  EXPECT_EQ(Join(*plain, kTokenA, &joined).error_code(), grpc::StatusCode::UNAVAILABLE);
  auto no_cert = Stub(port, true, false);
  EXPECT_EQ(Join(*no_cert, kTokenA, &joined).error_code(), grpc::StatusCode::UNAVAILABLE);
  // A real worker with the client certificate and token trains to the end.
  Subprocess worker(
      {std::string(ALOE_BIN_DIR) + "/aloe-worker", absl::StrCat("--server=localhost:", port),
       "--corpus_dir=" + dir_, "--metrics=off", "--token_file=" + dir_ + "/token_a",
       "--tls_ca_file=" + dir_ + "/ca/ca.pem", "--tls_cert_file=" + dir_ + "/ca/client.pem",
       "--tls_key_file=" + dir_ + "/ca/client.key"},
      dir_ + "/worker.log");
  EXPECT_EQ(worker.Wait(absl::Seconds(60)), std::optional<int>(0))
      << ReadFile(dir_ + "/worker.log");
  EXPECT_EQ(server_->Wait(absl::Seconds(30)), std::optional<int>(0))
      << ReadFile(dir_ + "/server.log");
  EXPECT_NE(ReadFile(dir_ + "/server.log").find("summary: version 3"), std::string::npos)
      << ReadFile(dir_ + "/server.log");
  EXPECT_NE(ReadFile(dir_ + "/server.log").find("TLS, client certificates required, token auth"),
            std::string::npos);
}

TEST_F(SecurityTest, NonLoopbackWithoutTlsAndTokenIsRefusedUnlessInsecure) {
  EXPECT_EQ(Start("", "0.0.0.0:0"), 0);
  EXPECT_EQ(server_->Wait(absl::Seconds(10)), std::optional<int>(1));
  EXPECT_NE(ReadFile(dir_ + "/server.log").find("refusing to listen on non-loopback address"),
            std::string::npos)
      << ReadFile(dir_ + "/server.log");
  const int port = Start("", "0.0.0.0:0", {"--insecure"});
  EXPECT_GT(port, 0) << ReadFile(dir_ + "/server.log");
  server_->Signal(SIGTERM);
  EXPECT_EQ(server_->Wait(absl::Seconds(20)), std::optional<int>(0));
}

TEST_F(SecurityTest, RawPushesOnANonLoopbackAddressNeedTlsAndATokenOrInsecure) {
  const std::string tls = absl::StrCat(
      "tls_cert_file: \"", dir_, "/ca/server.pem\" tls_key_file: \"", dir_, "/ca/server.key\"");
  const std::vector<std::string> shard = {"--role=shard", "--shard_index=0",
                                          "--listen=127.0.0.1:17071"};
  struct Case {
    std::string security;
    std::vector<std::string> flags;
    const char* message;
  };
  const Case cases[] = {
      {"",
       {"--push_listen=10.1.2.3:17072"},
       "refusing raw pushes on non-loopback address 10.1.2.3:17072 without TLS"},
      // TLS without a token file: as a gRPC address.
      {tls,
       {"--push_listen=10.1.2.3:17072"},
       "refusing raw pushes on non-loopback address 10.1.2.3:17072 without TLS "
       "(security.tls_cert_file) and a token file (security.token_file)"},
      {"", {"--push_listen=127.0.0.1:0"}, "--push_listen needs HOST:PORT with a fixed port"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> flags = shard;
    flags.insert(flags.end(), c.flags.begin(), c.flags.end());
    ExpectRefused(c.security, flags, "shard_processes: 1", c.message);
    // The same rules for a single-process server's raw pushes.
    ExpectRefused(c.security, c.flags, "", c.message);
  }
  ExpectRefused("", {"--role=coordinator", "--push_listen=127.0.0.1:17072"}, "shard_processes: 1",
                "--push_listen is for --role shard or single (a coordinator takes no pushes)");
  ExpectRefused("", {"--advertise_push=10.1.2.3:17072"}, "",
                "--advertise_push needs --push_listen");
}

// A layer-sharded server (one shard process, raw pushes on) under mutual TLS and tokens. A push
// over TLS with the job's certificates and a worker's token is applied; clients that trust
// another CA, present another CA's certificate or none, speak plaintext, or carry an unknown
// token are refused naming why, and nothing of theirs is received or staged.
TEST_F(SecurityTest, TlsRawPushesTakeOnlyTheJobsCertificatesAndTokens) {
  ASSERT_EQ(std::system((std::string(ALOE_SOURCE_DIR) + "/scripts/make-test-ca.sh " + dir_ +
                         "/other > /dev/null")
                            .c_str()),
            0);
  std::ofstream(dir_ + "/token_b") << kTokenB << "\n";
  const std::string security = absl::StrCat("token_file: \"", dir_, "/tokens\" tls_cert_file: \"",
                                            dir_, "/ca/server.pem\" tls_key_file: \"", dir_,
                                            "/ca/server.key\" tls_client_ca_file: \"", dir_,
                                            "/ca/ca.pem\" shard_identity: \"bravo\"");
  const int port = Start(security, "127.0.0.1:0",
                         {"--role=coordinator", "--shard_processes=1", "--metrics=127.0.0.1:0"},
                         "aggregation { mode: AGGREGATION_ASYNC min_workers: 1 grace_seconds: 0 }\n"
                         "outer_optimizer { type: OUTER_SGD lr: 0.5 }");
  ASSERT_GT(port, 0) << ReadFile(dir_ + "/server.log");
  const int coordinator_metrics = PortIn("ports", "metrics");
  const std::string push = absl::StrCat("127.0.0.1:", FreePort());
  Subprocess shard(
      {std::string(ALOE_BIN_DIR) + "/aloe-server", "--config=" + dir_ + "/server.textproto",
       "--role=shard", "--shard_processes=1", "--shard_index=0",
       absl::StrCat("--coordinator=localhost:", port), "--token_file=" + dir_ + "/token_b",
       absl::StrCat("--listen=127.0.0.1:", FreePort()), "--push_listen=" + push,
       "--metrics=127.0.0.1:0", "--port_file=" + dir_ + "/shard.ports"},
      dir_ + "/shard.log");
  auto logs = [&] {
    return absl::StrCat(ReadFile(dir_ + "/server.log"), ReadFile(dir_ + "/shard.log"));
  };
  ASSERT_TRUE(WaitForFile(dir_ + "/shard.ports", absl::Seconds(30))) << logs();
  const int shard_metrics = PortIn("shard.ports", "metrics");
  auto scraped = [](int metrics_port, const std::string& series) {
    for (absl::string_view line : absl::StrSplit(HttpGet(metrics_port, "/metrics"), '\n')) {
      double value = 0;
      if (absl::ConsumePrefix(&line, series + " ") && absl::SimpleAtod(line, &value)) return value;
    }
    return -1.0;
  };
  // A worker's client: the CA of `ca_dir`, the client certificate of `cert_dir` ("" = none).
  auto options = [&](const std::string& ca_dir, const std::string& cert_dir,
                     const std::string& token) {
    worker::ClientOptions o;
    o.address = absl::StrCat("localhost:", port);
    o.token = token;
    o.tls_ca_pem = ReadFile(dir_ + "/" + ca_dir + "/ca.pem");
    if (!cert_dir.empty()) {
      o.tls_cert_pem = ReadFile(dir_ + "/" + cert_dir + "/client.pem");
      o.tls_key_pem = ReadFile(dir_ + "/" + cert_dir + "/client.key");
    }
    return o;
  };
  worker::ServerClient client(options("ca", "ca", kTokenA));
  v1::JoinRequest join;
  join.set_name("raw");
  join.set_role(v1::ROLE_TRAINER);
  absl::StatusOr<v1::JoinReply> joined;
  for (int i = 0; i < 300 && !joined.ok(); ++i) {
    joined = client.Join(join);  // UNAVAILABLE until the shard process follows
    if (!joined.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(joined.ok()) << joined.status() << logs();
  const std::vector<std::string> shards(joined->shard_addresses().begin(),
                                        joined->shard_addresses().end());
  ASSERT_EQ(joined->shard_push_addresses_size(), 1);
  ASSERT_EQ(joined->shard_push_addresses(0), push);
  ASSERT_TRUE(client.SetShards(shards, {push}).ok());
  absl::StatusOr<v1::Task> task = client.RequestTask(joined->worker_id());
  ASSERT_TRUE(task.ok() && task->kind() == v1::Task::TRAIN) << task.status();
  const v1::ModelSpec& spec = joined->model_spec();
  std::vector<std::vector<float>> before;
  uint64_t bytes = 0;
  ASSERT_TRUE(client.Pull(joined->worker_id(), 0, false, spec, &before, &bytes).ok());
  v1::PushHeader header;
  header.set_worker_id(joined->worker_id());
  header.set_task_id(task->task_id());
  header.set_update_id(1);
  header.set_base_version(task->base_version());
  header.set_steps_done(task->local_steps());
  header.set_codec(v1::CODEC_FP32);
  std::vector<std::vector<float>> g(spec.layers_size());
  std::string payload;
  for (int l = 0; l < spec.layers_size(); ++l) {
    g[l].resize(spec.layers(l).num_elements());
    for (size_t i = 0; i < g[l].size(); ++i) g[l][i] = 0.001f * (i % 7) - 0.002f * l;
    payload.append(reinterpret_cast<const char*>(g[l].data()), g[l].size() * sizeof(float));
  }

  struct Refused {
    const char* what;
    worker::ClientOptions options;
    absl::StatusCode code;
    const char* message;
  };
  const Refused refused[] = {
      {"a client trusting another CA", options("other", "ca", kTokenA),
       absl::StatusCode::kUnauthenticated, "certificate verify failed"},
      {"a client certificate of another CA", options("ca", "other", kTokenA),
       absl::StatusCode::kUnavailable, "alert unknown ca"},
      {"no client certificate", options("ca", "", kTokenA), absl::StatusCode::kUnavailable,
       "alert certificate required"},
      {"an unknown token", options("ca", "ca", "not-a-token-the-server-knows"),
       absl::StatusCode::kUnauthenticated, "unknown token"},
  };
  for (const Refused& r : refused) {
    worker::ServerClient stranger(r.options);
    ASSERT_TRUE(stranger.SetShards(shards, {push}).ok());
    const absl::StatusOr<v1::PushReply> pushed =
        stranger.Push(header, spec, g, {}, 256, nullptr, &bytes);
    EXPECT_EQ(pushed.status().code(), r.code) << r.what << ": " << pushed.status();
    EXPECT_TRUE(absl::StrContains(pushed.status().message(), r.message))
        << r.what << ": " << pushed.status();
  }
  // A plaintext raw push to the TLS listener is answered in plaintext.
  absl::Status carried;
  v1::PushReply reply;
  ASSERT_TRUE(RawExchange(push, EncodeRawPushPrelude(kTokenA, header, payload.size()) + payload,
                          &carried, &reply)
                  .ok());
  EXPECT_EQ(carried.code(), absl::StatusCode::kUnauthenticated) << carried;
  EXPECT_TRUE(absl::StrContains(carried.message(), "this listener takes TLS only")) << carried;
  // The shard process names every refused connection.
  const std::string shard_log = ReadFile(dir_ + "/shard.log");
  for (const char* reason : {"alert unknown ca", "certificate verify failed",
                             "peer did not return a certificate", "refused a plaintext raw push"}) {
    EXPECT_TRUE(absl::StrContains(shard_log, reason)) << reason << "\n" << shard_log;
  }
  // Nothing was received, staged or applied.
  EXPECT_EQ(scraped(shard_metrics, "aloe_raw_push_bytes_total"), 0) << logs();
  EXPECT_EQ(scraped(shard_metrics, "aloe_staged_updates"), 0);
  EXPECT_EQ(scraped(shard_metrics, "aloe_staged_bytes"), 0);
  EXPECT_EQ(scraped(coordinator_metrics, "aloe_model_version"), 0);
  std::vector<std::vector<float>> now;
  absl::StatusOr<uint64_t> version = client.Pull(joined->worker_id(), 0, true, spec, &now, &bytes);
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ(*version, 0u);
  EXPECT_EQ(now, before);

  // The worker's push, raw over TLS, is the one outer step: theta_1 = theta_0 - 0.5 g.
  absl::StatusOr<v1::PushReply> pushed = client.Push(header, spec, g, {}, 256, nullptr, &bytes);
  ASSERT_TRUE(pushed.ok()) << pushed.status() << logs();
  EXPECT_TRUE(pushed->applied());
  EXPECT_EQ(scraped(shard_metrics, "aloe_raw_push_bytes_total"),
            static_cast<double>(payload.size()));
  EXPECT_EQ(client.Pull(joined->worker_id(), 1, false, spec, &now, &bytes).value_or(0), 1u);
  EXPECT_LT(SgdStepError(before, g, 0.5, now), 1e-6);
  (void)client.Leave(joined->worker_id());
  shard.Signal(SIGTERM);
  EXPECT_EQ(shard.Wait(absl::Seconds(30)), std::optional<int>(0)) << logs();
  server_->Signal(SIGTERM);
  EXPECT_EQ(server_->Wait(absl::Seconds(30)), std::optional<int>(0)) << logs();
}

TEST_F(SecurityTest, LayerShardedServerTrainsUnderMutualTlsAndTokens) {
  // Shards present kTokenB (identity bravo, security.shard_identity) to the coordinator and their
  // own certificate (issued by the client CA); shard 1 listens on every interface and tells
  // workers "localhost", the name in the certificate they verify. Shard 0 takes raw pushes too
  // (over TLS), shard 1 gRPC pushes only.
  const std::string security = absl::StrCat("token_file: \"", dir_, "/tokens\" tls_cert_file: \"",
                                            dir_, "/ca/server.pem\" tls_key_file: \"", dir_,
                                            "/ca/server.key\" tls_client_ca_file: \"", dir_,
                                            "/ca/ca.pem\" shard_identity: \"bravo\"");
  // The shard count comes from the command line (as in deploy/k8s/sharded), not the config.
  std::ofstream(dir_ + "/token_b") << kTokenB << "\n";
  const int port = Start(security, "127.0.0.1:0", {"--role=coordinator", "--shard_processes=2"},
                         "aggregation { mode: AGGREGATION_ASYNC }");
  ASSERT_GT(port, 0) << ReadFile(dir_ + "/server.log");
  const int shard_ports[2] = {FreePort(), FreePort()};
  std::unique_ptr<Subprocess> shards[2];
  for (int i = 0; i < 2; ++i) {
    std::vector<std::string> argv = {std::string(ALOE_BIN_DIR) + "/aloe-server",
                                     "--config=" + dir_ + "/server.textproto",
                                     "--role=shard",
                                     "--shard_processes=2",
                                     absl::StrCat("--shard_index=", i),
                                     absl::StrCat("--coordinator=localhost:", port),
                                     "--token_file=" + dir_ + "/token_b"};
    if (i == 0) {
      argv.push_back(absl::StrCat("--listen=127.0.0.1:", shard_ports[i]));
      argv.push_back(absl::StrCat("--push_listen=127.0.0.1:", FreePort()));
    } else {
      argv.push_back(absl::StrCat("--listen=0.0.0.0:", shard_ports[i]));
      argv.push_back(absl::StrCat("--advertise=localhost:", shard_ports[i]));
    }
    shards[i] = std::make_unique<Subprocess>(argv, absl::StrCat(dir_, "/shard", i, ".log"));
  }
  auto logs = [&] {
    return absl::StrCat(ReadFile(dir_ + "/server.log"), ReadFile(dir_ + "/shard0.log"),
                        ReadFile(dir_ + "/shard1.log"), ReadFile(dir_ + "/worker.log"));
  };
  // A worker with the client certificate and token trains through both shards to the end.
  Subprocess worker(
      {std::string(ALOE_BIN_DIR) + "/aloe-worker", absl::StrCat("--server=localhost:", port),
       "--corpus_dir=" + dir_, "--metrics=off", "--token_file=" + dir_ + "/token_a",
       "--tls_ca_file=" + dir_ + "/ca/ca.pem", "--tls_cert_file=" + dir_ + "/ca/client.pem",
       "--tls_key_file=" + dir_ + "/ca/client.key"},
      dir_ + "/worker.log");
  EXPECT_EQ(worker.Wait(absl::Seconds(90)), std::optional<int>(0)) << logs();
  EXPECT_EQ(server_->Wait(absl::Seconds(30)), std::optional<int>(0)) << logs();
  EXPECT_NE(ReadFile(dir_ + "/server.log").find("summary: version 3"), std::string::npos) << logs();
  EXPECT_NE(ReadFile(dir_ + "/worker.log").find("(2 shard processes)"), std::string::npos)
      << logs();
  EXPECT_NE(ReadFile(dir_ + "/shard1.log")
                .find(absl::StrCat("listening on 0.0.0.0:", shard_ports[1],
                                   " as localhost:", shard_ports[1])),
            std::string::npos)
      << logs();
  // The shards hold the parameters: a client without a certificate cannot reach them.
  auto no_cert = Stub(shard_ports[0], true, false);
  v1::JoinReply joined;
  EXPECT_EQ(Join(*no_cert, kTokenA, &joined).error_code(), grpc::StatusCode::UNAVAILABLE);
  for (auto& shard : shards) {
    shard->Signal(SIGTERM);
    EXPECT_EQ(shard->Wait(absl::Seconds(30)), std::optional<int>(0)) << logs();
  }
  for (int i = 0; i < 2; ++i) {
    EXPECT_NE(ReadFile(absl::StrCat(dir_, "/shard", i, ".log")).find("stops at version 3"),
              std::string::npos)
        << logs();
  }
  // The worker pushed shard 0's layers raw, over TLS.
  EXPECT_EQ(ReadFile(dir_ + "/shard0.log").find("(0.0 MB raw)"), std::string::npos) << logs();
  EXPECT_EQ(ReadFile(dir_ + "/worker.log").find("raw push"), std::string::npos) << logs();
}

TEST_F(SecurityTest, ShardAddressesWorkersCannotDialAreRefused) {
  struct Case {
    std::vector<std::string> flags;
    const char* message;
  };
  const Case cases[] = {
      {{"--listen=0.0.0.0:17071"},
       "--listen 0.0.0.0:17071 listens on every interface, and workers cannot dial that address: "
       "pass --advertise HOST:PORT"},
      {{"--listen=127.0.0.1:17071", "--advertise=[::]:17071"},
       "--advertise [::]:17071 is not an address workers can dial"},
      {{"--listen=127.0.0.1:17071", "--advertise=shard-0:0"},
       "--advertise shard-0:0 needs HOST:PORT with a port in [1, 65535]"},
      {{"--listen=127.0.0.1:17071", "--advertise_push=shard-0:7072"},
       "--advertise_push needs --push_listen"},
      {{"--listen=127.0.0.1:17071", "--shard_processes=-3"},
       "--shard_processes must be >= 0, got -3"},
      {{"--listen=127.0.0.1:17071", "--push_listen=0.0.0.0:17072", "--insecure"},
       "--push_listen 0.0.0.0:17072 listens on every interface, and workers cannot dial that "
       "address: pass --advertise_push HOST:PORT"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> flags = {"--role=shard", "--shard_index=0"};
    flags.insert(flags.end(), c.flags.begin(), c.flags.end());
    ExpectRefused("", flags, "shard_processes: 1", c.message);
  }
  ExpectRefused("", {"--role=coordinator", "--advertise=shard-0:7071"}, "shard_processes: 1",
                "--advertise is for --role shard only");
  // A single-process server's raw push address: the same rule as a shard's.
  ExpectRefused("", {"--push_listen=0.0.0.0:17072", "--insecure"}, "",
                "--push_listen 0.0.0.0:17072 listens on every interface, and workers cannot dial "
                "that address: pass --advertise_push HOST:PORT");
}

TEST_F(SecurityTest, ShardsTheCoordinatorRefusesExitWithTheReason) {
  // A coordinator with tokens and two shard processes; shards that can never follow it (no
  // token, an unknown token, a worker's token, another shard count) exit 1 naming why instead
  // of retrying forever.
  std::ofstream(dir_ + "/token_b") << kTokenB << "\n";
  std::ofstream(dir_ + "/token_bad") << "not-a-token-the-coordinator-knows\n";
  // Without a token of the shards' identity (default "shards") no shard could ever follow.
  ExpectRefused(absl::StrCat("token_file: \"", dir_, "/tokens\""), {"--role=coordinator"},
                "shard_processes: 2",
                "has no token of identity \"shards\" (security.shard_identity)");
  const int port =
      Start(absl::StrCat("token_file: \"", dir_, "/tokens\" shard_identity: \"bravo\""),
            "127.0.0.1:0", {"--role=coordinator"}, "shard_processes: 2");
  ASSERT_GT(port, 0) << ReadFile(dir_ + "/server.log");
  // The shards' identity cannot join as a worker either; a worker's can.
  auto stub = Stub(port, /*tls=*/false, /*client_cert=*/false);
  v1::JoinReply joined;
  const grpc::Status as_shard = Join(*stub, kTokenB, &joined);
  EXPECT_EQ(as_shard.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(as_shard.error_message().find("is the shard processes'"), std::string::npos)
      << as_shard.error_message();
  // (A worker's join waits for the shard processes: UNAVAILABLE, not PERMISSION_DENIED.)
  EXPECT_EQ(Join(*stub, kTokenA, &joined).error_code(), grpc::StatusCode::UNAVAILABLE);
  struct Case {
    std::vector<std::string> flags;
    const char* message;
  };
  const Case cases[] = {
      {{}, "the coordinator refuses shard 0: missing x-aloe-token"},
      {{"--token_file=" + dir_ + "/token_bad"}, "the coordinator refuses shard 0: unknown token"},
      {{"--token_file=" + dir_ + "/token_a"},
       "the coordinator refuses shard 0: ShardControl.Follow is for the shard processes (token "
       "identity \"bravo\", security.shard_identity); this token is identity \"alpha\""},
      {{"--token_file=" + dir_ + "/token_b", "--shard_processes=3"},
       "the coordinator refuses shard 0: shard process 0 has another model, optimizer or shard "
       "count"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> argv = {std::string(ALOE_BIN_DIR) + "/aloe-server",
                                     "--config=" + dir_ + "/server.textproto",
                                     "--role=shard",
                                     "--shard_index=0",
                                     absl::StrCat("--listen=127.0.0.1:", FreePort()),
                                     absl::StrCat("--coordinator=127.0.0.1:", port)};
    argv.insert(argv.end(), c.flags.begin(), c.flags.end());
    Subprocess shard(argv, dir_ + "/shard.log");
    EXPECT_EQ(shard.Wait(absl::Seconds(20)), std::optional<int>(1)) << c.message;
    EXPECT_NE(ReadFile(dir_ + "/shard.log").find(c.message), std::string::npos)
        << ReadFile(dir_ + "/shard.log");
  }
  server_->Signal(SIGTERM);
  EXPECT_EQ(server_->Wait(absl::Seconds(20)), std::optional<int>(0));
}

}  // namespace
}  // namespace aloe
