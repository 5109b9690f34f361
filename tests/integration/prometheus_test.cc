// Monitoring end to end: Debian's real `prometheus` scrapes a live aloe-server, two trainers and
// an evaluator through the shipped deploy/prometheus/prometheus.yml (only the scrape and rule
// intervals shortened to 1s, file_sd targets pointing at the daemons' OS-chosen ports) with the
// shipped recording rules, and every PromQL expression of every recording rule and of every
// panel of deploy/grafana/aloe-dashboard.json, and every aloe_* metric they use, must return a
// finite sample through the HTTP API. `promtool` checks the shipped configs and rules, and runs
// the rules' unit tests. Skips only when the prometheus/promtool binaries are missing
// (scripts/install-deps.sh installs them).
#include <arpa/inet.h>
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/corpus_manifest.h"
#include "common/token_shard.h"
#include "tests/testing/subprocess.h"

namespace aloe {
namespace {

using ::aloe::testing::FreePort;
using ::aloe::testing::HttpGet;
using ::aloe::testing::ReadFile;
using ::aloe::testing::Subprocess;
using ::aloe::testing::WaitForFile;
using ::google::protobuf::ListValue;
using ::google::protobuf::Struct;
using ::google::protobuf::Value;

// The repository root, from this file's compile-time path (tests/integration/...).
std::string SourceRoot() {
  const std::string file = __FILE__;
  const size_t at = file.rfind("tests/integration/");
  return at == std::string::npos ? "." : file.substr(0, at);
}

// Debian installs prometheus and promtool in /usr/bin; "" when neither place has `name`.
std::string FindTool(const std::string& name) {
  for (const char* dir : {"/usr/bin/", "/usr/local/bin/", "/bin/"}) {
    const std::string path = dir + name;
    if (::access(path.c_str(), X_OK) == 0) return path;
  }
  return "";
}

std::string UrlEncode(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out.push_back(static_cast<char>(c));
    } else {
      absl::StrAppend(&out, "%", absl::Hex(c, absl::kZeroPad2));
    }
  }
  return out;
}

std::optional<Struct> ParseJson(const std::string& text) {
  Struct out;
  if (!google::protobuf::util::JsonStringToMessage(text, &out).ok()) return std::nullopt;
  return out;
}

const Value* Field(const Struct& s, const std::string& key) {
  auto it = s.fields().find(key);
  return it == s.fields().end() ? nullptr : &it->second;
}

// Which server layout a query has data with.
enum class Layout {
  kOneProcess,  // one aloe-server process (the default)
  kSharded,     // a layer-sharded server only (job aloe-shard)
  kBoth,        // either: it reads every server process of both jobs
};

// One PromQL expression to check and where it comes from.
struct Query {
  std::string expr;
  std::string origin;  // "panel \"...\"", "rule ...", "metric"
  Layout layout = Layout::kOneProcess;
};

bool HasData(Layout layout, bool sharded) {
  return layout == Layout::kBoth || (layout == Layout::kSharded) == sharded;
}

// The dashboard row and the recording-rule group that read the shard processes.
constexpr char kShardRow[] = "Shard processes (layer-sharded server)";
constexpr char kShardRuleGroup[] = "aloe-shard";
// The panels and the rule group that read the server in either layout.
constexpr const char* kBothLayoutPanels[] = {"Server payload bytes per second",
                                             "Push and apply latency",
                                             "Received bytes per second per layer"};
constexpr char kBothLayoutRuleGroup[] = "aloe-server-processes";

// Every target expression of every panel, rows' nested panels included; a panel under the row
// kShardRow (nested, or following it at the top level) is marked kSharded, one of
// kBothLayoutPanels kBoth.
void CollectPanelQueries(const Struct& node, std::vector<Query>* out, bool in_shard_row = false) {
  if (const Value* panels = Field(node, "panels"); panels && panels->has_list_value()) {
    for (const Value& p : panels->list_value().values()) {
      if (!p.has_struct_value()) continue;
      const Struct& panel = p.struct_value();
      const Value* title = Field(panel, "title");
      const std::string name = title ? title->string_value() : "?";
      if (const Value* type = Field(panel, "type"); type && type->string_value() == "row") {
        in_shard_row = name == kShardRow;
      }
      if (const Value* targets = Field(panel, "targets"); targets && targets->has_list_value()) {
        for (const Value& t : targets->list_value().values()) {
          const Value* expr = t.has_struct_value() ? Field(t.struct_value(), "expr") : nullptr;
          if (expr != nullptr && !expr->string_value().empty()) {
            const bool both = std::find(std::begin(kBothLayoutPanels), std::end(kBothLayoutPanels),
                                        name) != std::end(kBothLayoutPanels);
            out->push_back({expr->string_value(), absl::StrCat("panel \"", name, "\""),
                            both           ? Layout::kBoth
                            : in_shard_row ? Layout::kSharded
                                           : Layout::kOneProcess});
          }
        }
      }
      CollectPanelQueries(panel, out, in_shard_row);
    }
  }
}

// aloe_* metric names an expression reads (not recording-rule names, which contain ':').
std::set<std::string> MetricNames(const std::string& expr) {
  static const std::regex kName("[a-zA-Z_:][a-zA-Z0-9_:]*");
  std::set<std::string> names;
  for (auto it = std::sregex_iterator(expr.begin(), expr.end(), kName);
       it != std::sregex_iterator(); ++it) {
    const std::string token = it->str();
    if (absl::StartsWith(token, "aloe_") && !absl::StrContains(token, ':')) names.insert(token);
  }
  return names;
}

// Runs a tool to completion (bounded); returns its exit code and fills *output.
int RunTool(const std::vector<std::string>& argv, const std::string& log, std::string* output) {
  Subprocess p(argv, log);
  std::optional<int> code = p.Wait(absl::Seconds(30));
  *output = ReadFile(log);
  return code.value_or(-1);
}

TEST(PromtoolTest, ShippedConfigsAndRulesPassPromtool) {
  const std::string promtool = FindTool("promtool");
  if (promtool.empty()) {
    GTEST_SKIP() << "promtool not found in /usr/bin or /usr/local/bin: install Debian's "
                    "`prometheus` package (scripts/install-deps.sh does)";
  }
  const std::string dir = SourceRoot() + "deploy/prometheus/";
  const std::string log = ::testing::TempDir() + "/aloe_promtool_" + std::to_string(::getpid());
  std::string out;
  for (const char* config : {"prometheus.yml", "prometheus-kubernetes.yml"}) {
    EXPECT_EQ(RunTool({promtool, "check", "config", dir + config}, log, &out), 0) << out;
    EXPECT_TRUE(absl::StrContains(out, "SUCCESS")) << out;
  }
  EXPECT_EQ(RunTool({promtool, "check", "rules", dir + "rules/aloe.rules.yml"}, log, &out), 0)
      << out;
  EXPECT_TRUE(absl::StrContains(out, "SUCCESS")) << out;
  // The rules' unit tests (synthetic series with known answers); paths relative to the file.
  EXPECT_EQ(RunTool({promtool, "test", "rules", dir + "rules/aloe.rules.test.yml"}, log, &out), 0)
      << out;
  EXPECT_TRUE(absl::StrContains(out, "SUCCESS")) << out;
}

// deploy/grafana/README.md (generated by make-readme.py) documents every panel's PromQL.
TEST(DashboardDocsTest, ReadmeListsEveryPanelQuery) {
  std::optional<Struct> dashboard =
      ParseJson(ReadFile(SourceRoot() + "deploy/grafana/aloe-dashboard.json"));
  ASSERT_TRUE(dashboard.has_value());
  std::vector<Query> queries;
  CollectPanelQueries(*dashboard, &queries);
  ASSERT_GE(queries.size(), 20u);
  const std::string readme = ReadFile(SourceRoot() + "deploy/grafana/README.md");
  for (const Query& q : queries) {
    EXPECT_TRUE(absl::StrContains(readme, "`" + q.expr + "`"))
        << q.origin << ": `" << q.expr
        << "` is not in deploy/grafana/README.md; run deploy/grafana/make-readme.py";
  }
}

// Public-domain text (Lincoln, Gettysburg Address, 1863): one shard per sentence group.
constexpr const char* kText[] = {
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, "
    "conceived in Liberty, and dedicated to the proposition that all men are created equal. ",
    "Now we are engaged in a great civil war, testing whether that nation, or any nation so "
    "conceived and so dedicated, can long endure. We are met on a great battle-field of that "
    "war. We have come to dedicate a portion of that field. ",
    "It is for us the living, rather, to be dedicated here to the unfinished work which they who "
    "fought here have thus far so nobly advanced. ",
};

class PrometheusTest : public ::testing::Test {
 protected:
  void SetUp() override {
    prometheus_bin_ = FindTool("prometheus");
    if (prometheus_bin_.empty()) {
      GTEST_SKIP() << "prometheus not found in /usr/bin or /usr/local/bin: install Debian's "
                      "`prometheus` package (scripts/install-deps.sh does) to run this test";
    }
    dir_ = ::testing::TempDir() + "/aloe_prom_" + std::to_string(::getpid());
    ASSERT_EQ(std::system(("rm -rf " + dir_ + " && mkdir -p " + dir_ + "/shards " + dir_ +
                           "/prom/rules " + dir_ + "/prom/targets")
                              .c_str()),
              0);
    std::vector<CorpusShardInfo> shards;
    std::vector<uint32_t> heldout;
    for (size_t i = 0; i < std::size(kText); ++i) {
      std::vector<uint32_t> tokens;
      for (int r = 0; r < 8; ++r) {
        for (unsigned char c : std::string(kText[i])) tokens.push_back(c);
      }
      heldout.insert(heldout.end(), tokens.begin(), tokens.begin() + tokens.size() / 4);
      const std::string file = absl::StrCat("shards/s", i, ".tok");
      ASSERT_TRUE(WriteTokenShard(dir_ + "/" + file, tokens, 256).ok());
      shards.push_back({absl::StrCat("s", i), file, tokens.size(), false});
    }
    ASSERT_TRUE(WriteTokenShard(dir_ + "/heldout.tok", heldout, 256).ok());
    shards.push_back({"heldout", "heldout.tok", heldout.size(), true});
    ASSERT_TRUE(WriteCorpusManifest(dir_, shards).ok());
  }

  void TearDown() override {
    // Workers first (they Leave), then the server, then Prometheus; the Subprocess destructors
    // SIGKILL whatever is still running.
    for (auto& w : workers_) w->Signal(SIGTERM);
    for (auto& w : workers_) w->Wait(absl::Seconds(10));
    if (server_) {
      server_->Signal(SIGTERM);
      server_->Wait(absl::Seconds(10));
    }
    for (auto& shard : shards_) shard->Signal(SIGTERM);
    for (auto& shard : shards_) shard->Wait(absl::Seconds(10));
    if (prometheus_) {
      prometheus_->Signal(SIGTERM);
      prometheus_->Wait(absl::Seconds(10));
    }
  }

  std::string Bin(const std::string& name) { return std::string(ALOE_BIN_DIR) + "/" + name; }

  // Async training that keeps every histogram and counter of the catalogue moving: Delayed
  // Nesterov with a short grace window (staleness), the EDiT penalty (norms, z-scores, weights,
  // clipping), frequent checkpoints and evaluations, no stop condition (stopped by TearDown).
  // `extra_config` and `extra_flags` make it a coordinator. Returns false (with a failure) when
  // the server does not start.
  bool StartServer(int* grpc_port, int* metrics_port, const std::string& extra_config = "",
                   const std::vector<std::string>& extra_flags = {}) {
    std::ofstream(dir_ + "/server.textproto")
        << absl::StrCat(R"(
      listen_address: "127.0.0.1:0"
      metrics_address: "127.0.0.1:0"
      corpus_dir: ")",
                        dir_, R"("
      model { vocab_size: 256 seq_len: 32 d_model: 32 num_layers: 2 num_heads: 2 }
      inner_optimizer { lr: 0.003 min_lr: 0.0003 warmup_steps: 5 total_steps: 100000 batch_size: 4 }
      outer_optimizer { type: OUTER_DELAYED_NESTEROV lr: 0.7 momentum: 0.9 dn_buffer_size: 2 }
      aggregation { mode: AGGREGATION_ASYNC grace_seconds: 0.05 }
      penalty { enabled: true warmup: 2 }
      checkpoint { dir: ")",
                        dir_, R"(/checkpoints" every_versions: 4 keep: 2 replicate_shards: true }
      local_steps: 4
      eval_every: 4
      lease_seconds: 20
    )",
                        extra_config, "\n");
    std::vector<std::string> argv = {Bin("aloe-server"), "--config=" + dir_ + "/server.textproto",
                                     "--port_file=" + dir_ + "/ports"};
    argv.insert(argv.end(), extra_flags.begin(), extra_flags.end());
    server_ = std::make_unique<Subprocess>(argv, dir_ + "/server.log");
    if (!WaitForFile(dir_ + "/ports", absl::Seconds(20))) {
      ADD_FAILURE() << "aloe-server did not start:\n" << ReadFile(dir_ + "/server.log");
      return false;
    }
    for (absl::string_view kv :
         absl::StrSplit(ReadFile(dir_ + "/ports"), absl::ByAnyChar(" \n"), absl::SkipEmpty())) {
      std::pair<std::string, std::string> p = absl::StrSplit(kv, '=');
      if (p.first == "grpc") absl::SimpleAtoi(p.second, grpc_port);
      if (p.first == "metrics") absl::SimpleAtoi(p.second, metrics_port);
    }
    return *grpc_port > 0 && *metrics_port > 0;
  }

  // Starts shard process `index` of the coordinator at `grpc_port` (taking raw pushes as well,
  // so that every shard metric moves); returns its metrics port, or 0 when it did not start.
  int StartShard(int index, int grpc_port) {
    const std::string ports = absl::StrCat(dir_, "/shard", index, ".ports");
    shards_.push_back(std::make_unique<Subprocess>(
        std::vector<std::string>{Bin("aloe-server"), "--config=" + dir_ + "/server.textproto",
                                 "--role=shard", absl::StrCat("--shard_index=", index),
                                 absl::StrCat("--listen=127.0.0.1:", FreePort()),
                                 absl::StrCat("--push_listen=127.0.0.1:", FreePort()),
                                 absl::StrCat("--coordinator=127.0.0.1:", grpc_port),
                                 "--metrics=127.0.0.1:0", "--port_file=" + ports},
        absl::StrCat(dir_, "/shard", index, ".log")));
    if (!WaitForFile(ports, absl::Seconds(20))) return 0;
    int port = 0;
    const std::string text = ReadFile(ports);
    const size_t at = text.find("metrics=");
    if (at != std::string::npos) {
      absl::SimpleAtoi(text.substr(at + 8, text.find_first_of(" \n", at) - at - 8), &port);
    }
    return port;
  }

  // Starts an aloe-worker serving its own /metrics on an OS-chosen loopback port; returns that
  // port from its log line "metrics on port N", or 0 after `timeout`.
  int StartWorker(int grpc_port, const std::string& role, const std::string& name, double slowdown,
                  absl::Duration timeout) {
    const std::string log = dir_ + "/" + name + ".log";
    workers_.push_back(std::make_unique<Subprocess>(
        std::vector<std::string>{Bin("aloe-worker"), absl::StrCat("--server=127.0.0.1:", grpc_port),
                                 "--role=" + role, "--corpus_dir=" + dir_, "--metrics=127.0.0.1:0",
                                 absl::StrCat("--slowdown=", slowdown), "--eval_sequences=8",
                                 "--name=" + name, "--device=cpu"},
        log));
    const absl::Time deadline = absl::Now() + timeout;
    const std::string kLine = "metrics on port ";
    while (absl::Now() < deadline) {
      const std::string text = ReadFile(log);
      const size_t at = text.find(kLine);
      int port = 0;
      if (at != std::string::npos &&
          absl::SimpleAtoi(text.substr(at + kLine.size(), text.find('\n', at) - at - kLine.size()),
                           &port)) {
        return port;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return 0;
  }

  // The shipped prometheus.yml with 1s intervals, the shipped rules and file_sd target files for
  // the daemons' ports, laid out as in deploy/prometheus (relative paths resolve the same way).
  void WritePrometheusConfig(int server_port, const std::vector<int>& trainer_ports,
                             const std::vector<int>& evaluator_ports,
                             const std::vector<int>& shard_ports = {}) {
    const std::string shipped = ReadFile(SourceRoot() + "deploy/prometheus/prometheus.yml");
    ASSERT_FALSE(shipped.empty());
    std::string config = shipped;
    for (const char* key : {"scrape_interval: ", "evaluation_interval: ", "scrape_timeout: "}) {
      const size_t at = config.find(key);
      ASSERT_NE(at, std::string::npos) << key << " missing from the shipped prometheus.yml";
      const size_t value = at + std::string(key).size();
      config.replace(value, config.find('\n', value) - value, "1s");
    }
    std::ofstream(dir_ + "/prom/prometheus.yml") << config;
    std::ofstream(dir_ + "/prom/rules/aloe.rules.yml")
        << ReadFile(SourceRoot() + "deploy/prometheus/rules/aloe.rules.yml");
    auto targets = [](const std::vector<int>& ports) {
      if (ports.empty()) return std::string("- targets: []\n");
      std::string yml = "- targets:\n";
      for (int p : ports) absl::StrAppend(&yml, "    - 127.0.0.1:", p, "\n");
      return yml;
    };
    std::ofstream(dir_ + "/prom/targets/aloe-server.yml") << targets({server_port});
    std::ofstream(dir_ + "/prom/targets/aloe-shard.yml") << targets(shard_ports);
    std::ofstream(dir_ + "/prom/targets/aloe-trainer.yml") << targets(trainer_ports);
    std::ofstream(dir_ + "/prom/targets/aloe-evaluator.yml") << targets(evaluator_ports);
  }

  // Starts the real Prometheus on the config WritePrometheusConfig wrote; false (with a
  // failure) when it is not ready by `deadline`.
  bool StartPrometheus(absl::Time deadline) {
    prometheus_port_ = FreePort();
    if (prometheus_port_ <= 0) {
      ADD_FAILURE() << "no free port for prometheus";
      return false;
    }
    prometheus_ = std::make_unique<Subprocess>(
        std::vector<std::string>{prometheus_bin_, "--config.file=" + dir_ + "/prom/prometheus.yml",
                                 "--storage.tsdb.path=" + dir_ + "/prom/data",
                                 absl::StrCat("--web.listen-address=127.0.0.1:", prometheus_port_),
                                 "--storage.tsdb.retention.time=1h"},
        dir_ + "/prometheus.log");
    while (absl::Now() < deadline) {
      if (absl::StrContains(HttpGet(prometheus_port_, "/-/ready"), "Ready")) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ADD_FAILURE() << "prometheus did not become ready\n" << Logs();
    return false;
  }

  // The dashboard's panel queries that have data with a layer-sharded server, or with one
  // process.
  std::vector<Query> PanelQueries(bool sharded) {
    std::optional<Struct> dashboard =
        ParseJson(ReadFile(SourceRoot() + "deploy/grafana/aloe-dashboard.json"));
    EXPECT_TRUE(dashboard.has_value()) << "deploy/grafana/aloe-dashboard.json is not valid JSON";
    std::vector<Query> all, chosen;
    if (dashboard) CollectPanelQueries(*dashboard, &all);
    for (const Query& q : all) {
      if (HasData(q.layout, sharded)) chosen.push_back(q);
    }
    return chosen;
  }

  // Every shipped recording rule as Prometheus parsed it from the shipped file (the query and,
  // as a second query, its output) that has data with a layer-sharded server, or with one
  // process; *total counts the rules of every group.
  void RuleQueries(bool sharded, std::vector<Query>* queries, size_t* total) {
    *total = 0;
    std::optional<Struct> rules = Api("rules?type=record");
    ASSERT_TRUE(rules.has_value()) << Logs();
    for (const Value& g : Field(*rules, "groups")->list_value().values()) {
      const std::string group = Field(g.struct_value(), "name")->string_value();
      const Layout layout = group == kShardRuleGroup        ? Layout::kSharded
                            : group == kBothLayoutRuleGroup ? Layout::kBoth
                                                            : Layout::kOneProcess;
      for (const Value& r : Field(g.struct_value(), "rules")->list_value().values()) {
        ++*total;
        if (!HasData(layout, sharded)) continue;
        const std::string name = Field(r.struct_value(), "name")->string_value();
        queries->push_back({Field(r.struct_value(), "query")->string_value(), "rule " + name});
        queries->push_back({name, "output of rule " + name});
      }
    }
  }

  // Polls until each query, and each aloe_* metric any of them reads, has a finite sample, up to
  // `deadline` (training moves every metric within seconds, and 1m-rate rules need two
  // scrapes); a failure for each that never did, with the last raw answer. Returns the number
  // of metrics checked.
  size_t ExpectData(const std::vector<Query>& queries, absl::Time deadline) {
    std::set<std::string> metrics;
    for (const Query& q : queries) {
      for (const std::string& m : MetricNames(q.expr)) metrics.insert(m);
    }
    std::vector<Query> all;
    for (const std::string& m : metrics) all.push_back({m, "metric"});
    all.insert(all.end(), queries.begin(), queries.end());
    std::map<std::string, std::string> pending;
    for (const Query& q : all) pending[q.expr] = "";
    while (!pending.empty() && absl::Now() < deadline) {
      for (auto it = pending.begin(); it != pending.end();) {
        if (HasFiniteSample(Instant(it->first, &it->second))) {
          it = pending.erase(it);
        } else {
          ++it;
        }
      }
      if (!pending.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
    for (const Query& q : all) {
      auto it = pending.find(q.expr);
      EXPECT_TRUE(it == pending.end())
          << q.origin << ": no finite sample for `" << q.expr
          << "`; last answer: " << (it == pending.end() ? "" : it->second);
    }
    return metrics.size();
  }

  // Scraped endpoints that are up, per job.
  // Polls `holds` every 200 ms until it returns true or `deadline` passes; returns its last
  // answer. Instant queries see only the latest scrape of each target, and with 1 s scrape
  // timeouts one slow scrape of a loaded machine marks a live target down (and its series stale)
  // until the next one: checks of the present state wait for a good scrape.
  template <typename Holds>
  static bool Eventually(absl::Time deadline, Holds holds) {
    while (true) {
      if (holds()) return true;
      if (absl::Now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }

  std::map<std::string, int> UpByJob() {
    std::map<std::string, int> up;
    for (const Struct& s : Instant("up == 1")) {
      ++up[Field(Field(s, "metric")->struct_value(), "job")->string_value()];
    }
    return up;
  }

  // Every recording rule evaluated without error.
  void ExpectRulesHealthy() {
    std::optional<Struct> rules = Api("rules?type=record");
    ASSERT_TRUE(rules.has_value());
    for (const Value& g : Field(*rules, "groups")->list_value().values()) {
      for (const Value& r : Field(g.struct_value(), "rules")->list_value().values()) {
        EXPECT_EQ(Field(r.struct_value(), "health")->string_value(), "ok")
            << Field(r.struct_value(), "name")->string_value() << ": "
            << (Field(r.struct_value(), "lastError")
                    ? Field(r.struct_value(), "lastError")->string_value()
                    : "");
      }
    }
  }

  // GET /api/v1/<path>; the "data" object of a successful answer, else nullopt.
  std::optional<Struct> Api(const std::string& path) {
    std::optional<Struct> reply = ParseJson(HttpGet(prometheus_port_, "/api/v1/" + path));
    if (!reply) return std::nullopt;
    const Value* status = Field(*reply, "status");
    const Value* data = Field(*reply, "data");
    if (status == nullptr || status->string_value() != "success" || data == nullptr ||
        !data->has_struct_value()) {
      return std::nullopt;
    }
    return data->struct_value();
  }

  // Instant query; the result vector, empty on any error.
  std::vector<Struct> Instant(const std::string& expr, std::string* raw = nullptr) {
    const std::string body = HttpGet(prometheus_port_, "/api/v1/query?query=" + UrlEncode(expr));
    if (raw) *raw = body;
    std::vector<Struct> samples;
    std::optional<Struct> reply = ParseJson(body);
    if (!reply || !Field(*reply, "data") || !Field(*reply, "data")->has_struct_value()) {
      return samples;
    }
    const Value* result = Field(Field(*reply, "data")->struct_value(), "result");
    if (result == nullptr || !result->has_list_value()) return samples;
    for (const Value& v : result->list_value().values()) {
      if (v.has_struct_value()) samples.push_back(v.struct_value());
    }
    return samples;
  }

  // True when some sample of the vector is a finite number ("value": [time, "number"]).
  static bool HasFiniteSample(const std::vector<Struct>& samples) {
    for (const Struct& s : samples) {
      const Value* value = Field(s, "value");
      if (value == nullptr || !value->has_list_value() || value->list_value().values_size() != 2) {
        continue;
      }
      double x = 0;
      if (absl::SimpleAtod(value->list_value().values(1).string_value(), &x) && std::isfinite(x)) {
        return true;
      }
    }
    return false;
  }

  std::string Logs() {
    std::string all;
    for (const char* f : {"server.log", "shard0.log", "shard1.log", "trainer0.log", "trainer1.log",
                          "evaluator.log", "prometheus.log"}) {
      std::string text = ReadFile(dir_ + "/" + f);
      if (text.size() > 4000) text = "..." + text.substr(text.size() - 4000);
      absl::StrAppend(&all, "==== ", f, "\n", text);
    }
    return all;
  }

  std::string prometheus_bin_;
  std::string dir_;
  int prometheus_port_ = 0;
  std::unique_ptr<Subprocess> server_;
  std::vector<std::unique_ptr<Subprocess>> workers_;
  std::vector<std::unique_ptr<Subprocess>> shards_;
  std::unique_ptr<Subprocess> prometheus_;
};

TEST_F(PrometheusTest, EveryDashboardPanelAndRecordingRuleReturnsData) {
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + absl::Seconds(50);
  // Every panel but those of the shard row (no shard processes here).
  const std::vector<Query> panel_queries = PanelQueries(/*sharded=*/false);
  ASSERT_GE(panel_queries.size(), 20u);

  // Live daemons on OS-chosen loopback ports. One layer is pushed low-rank with adaptive rank,
  // for the compression row.
  int grpc_port = 0, server_metrics = 0;
  ASSERT_TRUE(StartServer(&grpc_port, &server_metrics, R"(
      transport {
        layer_codecs { layer: "blocks.1" codec: CODEC_LOWRANK rank: 4
                       factor_codec: CODEC_INT4_BLOCKWISE }
        error_feedback: true
        adaptive_rank { enabled: true window: 3 adapt_local_steps: true }
      })"));
  const int evaluator = StartWorker(grpc_port, "evaluator", "evaluator", 1.0, absl::Seconds(20));
  const int trainer0 = StartWorker(grpc_port, "trainer", "trainer0", 1.0, absl::Seconds(20));
  const int trainer1 = StartWorker(grpc_port, "trainer", "trainer1", 2.0, absl::Seconds(20));
  ASSERT_TRUE(evaluator > 0 && trainer0 > 0 && trainer1 > 0) << Logs();
  ASSERT_NO_FATAL_FAILURE(WritePrometheusConfig(server_metrics, {trainer0, trainer1}, {evaluator}));
  ASSERT_TRUE(StartPrometheus(deadline));

  std::vector<Query> rule_queries;
  size_t records = 0;
  ASSERT_NO_FATAL_FAILURE(RuleQueries(/*sharded=*/false, &rule_queries, &records));
  const std::string rules_file = ReadFile(SourceRoot() + "deploy/prometheus/rules/aloe.rules.yml");
  size_t in_file = 0;
  for (size_t at = rules_file.find("- record:"); at != std::string::npos;
       at = rules_file.find("- record:", at + 1)) {
    ++in_file;
  }
  ASSERT_EQ(records, in_file) << "Prometheus loaded fewer rules than the file has";
  ASSERT_GE(rule_queries.size() / 2, 20u);

  std::vector<Query> all = rule_queries;
  all.insert(all.end(), panel_queries.begin(), panel_queries.end());
  const size_t metrics = ExpectData(all, deadline);

  // The shipped job names found the right endpoints, all up.
  std::map<std::string, int> up;
  Eventually(deadline, [&] {
    up = UpByJob();
    return up["aloe-server"] == 1 && up["aloe-shard"] == 0 && up["aloe-trainer"] == 2 &&
           up["aloe-evaluator"] == 1;
  });
  EXPECT_EQ(up["aloe-server"], 1);
  EXPECT_EQ(up["aloe-shard"], 0);
  EXPECT_EQ(up["aloe-trainer"], 2);
  EXPECT_EQ(up["aloe-evaluator"], 1);
  // Each trainer's model FLOP/s once it has finished a round (the gauge starts at 0).
  size_t busy = 0;
  Eventually(deadline, [&] {
    busy = Instant("aloe_worker_model_flops_per_second{job=\"aloe-trainer\"} > 0").size();
    return busy == 2;
  });
  EXPECT_EQ(busy, 2u);
  // Where each trainer trains, which the speed panel joins into its legend (aloe_worker_info).
  size_t described = 0;
  Eventually(deadline, [&] {
    described = Instant(
                    "aloe_worker_info{job=\"aloe-trainer\",device=\"cpu\",autocast=\"off\","
                    "ranks=\"1\"} == 1")
                    .size();
    return described == 2;
  });
  EXPECT_EQ(described, 2u);
  ExpectRulesHealthy();
  if (HasFailure()) ADD_FAILURE() << Logs();
  std::printf("prometheus: %zu metrics, %zu rules, %zu panel queries checked in %.1f s\n", metrics,
              rule_queries.size() / 2, panel_queries.size(),
              absl::ToDoubleSeconds(absl::Now() - start));
}

// The shard row of the dashboard, the panels that read both layouts and the aloe-shard and
// aloe-server-processes rules against a layer-sharded server: a coordinator (job aloe-server),
// two shard processes taking raw and gRPC pushes (aloe-shard) and one trainer.
TEST_F(PrometheusTest, ShardPanelsAndRulesReturnDataForALayerShardedServer) {
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + absl::Seconds(50);
  const std::vector<Query> panel_queries = PanelQueries(/*sharded=*/true);
  ASSERT_GE(panel_queries.size(), 12u);

  int grpc_port = 0, coordinator_metrics = 0;
  ASSERT_TRUE(
      StartServer(&grpc_port, &coordinator_metrics, "shard_processes: 2", {"--role=coordinator"}));
  const int shard0 = StartShard(0, grpc_port);
  const int shard1 = StartShard(1, grpc_port);
  ASSERT_TRUE(shard0 > 0 && shard1 > 0) << Logs();
  const int trainer0 = StartWorker(grpc_port, "trainer", "trainer0", 1.0, absl::Seconds(20));
  ASSERT_GT(trainer0, 0) << Logs();
  ASSERT_NO_FATAL_FAILURE(
      WritePrometheusConfig(coordinator_metrics, {trainer0}, {}, {shard0, shard1}));
  ASSERT_TRUE(StartPrometheus(deadline));

  std::vector<Query> rule_queries;
  size_t records = 0;
  ASSERT_NO_FATAL_FAILURE(RuleQueries(/*sharded=*/true, &rule_queries, &records));
  ASSERT_GE(rule_queries.size() / 2, 12u);
  std::vector<Query> all = rule_queries;
  all.insert(all.end(), panel_queries.begin(), panel_queries.end());
  const size_t metrics = ExpectData(all, deadline);

  std::map<std::string, int> up;
  Eventually(deadline, [&] {
    up = UpByJob();
    return up["aloe-server"] == 1 && up["aloe-shard"] == 2 && up["aloe-trainer"] == 1;
  });
  EXPECT_EQ(up["aloe-server"], 1);
  EXPECT_EQ(up["aloe-shard"], 2);
  EXPECT_EQ(up["aloe-trainer"], 1);
  // The trainer's pushes went raw (its shards offer it and every layer is float32). The share
  // may pass 1 by a little: a push counts its received bytes a moment before its raw bytes, and
  // rate() extrapolates each counter over the window on its own.
  const std::vector<Struct> share = Instant("job:aloe_shard_raw_push_share:ratio1m");
  EXPECT_TRUE(HasFiniteSample(share));
  for (const Struct& s : share) {
    double x = 0;
    ASSERT_TRUE(absl::SimpleAtod(Field(s, "value")->list_value().values(1).string_value(), &x));
    EXPECT_GT(x, 0.9) << "raw share of shard ingest";
    EXPECT_LE(x, 1.05) << "raw share of shard ingest";
  }
  ExpectRulesHealthy();
  if (HasFailure()) ADD_FAILURE() << Logs();
  std::printf("prometheus (sharded): %zu metrics, %zu rules, %zu panel queries checked in %.1f s\n",
              metrics, rule_queries.size() / 2, panel_queries.size(),
              absl::ToDoubleSeconds(absl::Now() - start));
}

}  // namespace
}  // namespace aloe
