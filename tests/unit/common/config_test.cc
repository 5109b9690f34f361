#include "common/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>

#include "common/status_matchers.h"

namespace aloe {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;

std::string WriteFile(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(ConfigTest, TextFormatLoadsWithDefaults) {
  auto config = LoadServerConfig(WriteFile("ok.textproto", R"(
    corpus_dir: "data/sotu"
    local_steps: 20
    model { d_model: 128 num_layers: 2 }
    outer_optimizer { lr: 0.5 }
  )"));
  ASSERT_THAT(config, IsOk());
  EXPECT_EQ(config->local_steps(), 20u);
  EXPECT_EQ(config->model().d_model(), 128u);
  EXPECT_EQ(config->model().num_heads(), 4u);  // default
  EXPECT_FLOAT_EQ(config->outer_optimizer().lr(), 0.5f);
  EXPECT_FLOAT_EQ(config->outer_optimizer().momentum(), 0.9f);
  EXPECT_EQ(config->outer_optimizer().type(), v1::OUTER_NESTEROV);
  EXPECT_EQ(config->listen_address(), "127.0.0.1:7070");
  EXPECT_EQ(config->receive_window_kib(), 2048u);
  EXPECT_EQ(config->max_retained_versions(), 1u);
  EXPECT_EQ(config->security().shard_identity(), "shards");
}

TEST(ConfigTest, JsonLoads) {
  auto config = LoadServerConfig(
      WriteFile("ok.json",
                R"({"corpusDir": "c", "localSteps": 7, "outerOptimizer": {"type": "OUTER_SGD"}})"));
  ASSERT_THAT(config, IsOk());
  EXPECT_EQ(config->local_steps(), 7u);
  EXPECT_EQ(config->outer_optimizer().type(), v1::OUTER_SGD);
}

// A sync round of a layer-sharded server needs all of its updates staged at once; async rounds
// (whose windows close on time) and single-process servers have no such limit.
TEST(ConfigTest, ShardedSyncRoundsMustFitTheStagingSlots) {
  const std::string sync = "corpus_dir: 'c' max_staged_updates: 3 aggregation { min_workers: 4";
  EXPECT_THAT(LoadServerConfig(WriteFile("s1.textproto", "shard_processes: 2 " + sync + " }")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("could never commit")));
  EXPECT_THAT(LoadServerConfig(WriteFile("s2.textproto", sync + " }")), IsOk());
  EXPECT_THAT(LoadServerConfig(WriteFile(
                  "s3.textproto", "shard_processes: 2 " + sync + " mode: AGGREGATION_ASYNC }")),
              IsOk());
  EXPECT_THAT(LoadServerConfig(WriteFile("s4.textproto",
                                         "shard_processes: 2 corpus_dir: 'c' max_staged_updates: 4 "
                                         "aggregation { min_workers: 4 }")),
              IsOk());
}

TEST(ConfigTest, ErrorsNameTheField) {
  struct Case {
    std::string text;
    std::string expected;
  };
  const Case cases[] = {
      {"corpus_dir: 'c' outer_optimizer { lr: -1 }", "outer_optimizer.lr must be > 0"},
      {"corpus_dir: 'c' outer_optimizer { momentum: 1.5 }", "outer_optimizer.momentum"},
      {"corpus_dir: 'c' model { d_model: 10 num_heads: 4 }", "model."},
      {"corpus_dir: 'c' listen_address: 'nohost'", "listen_address"},
      {"corpus_dir: 'c' lease_seconds: -2", "lease_seconds"},
      {"local_steps: 3", "corpus_dir"},
      {"corpus_dir: 'c' inner_optimizer { lr: 0.01 min_lr: 0.5 }", "inner_optimizer."},
      {"corpus_dir: 'c' receive_window_kib: 63", "receive_window_kib must be in [64, 262144]"},
      {"corpus_dir: 'c' receive_window_kib: 262145", "receive_window_kib must be in [64, 262144]"},
      {"corpus_dir: 'c' max_retained_versions: 4097", "max_retained_versions must be in [1, 4096]"},
      {"corpus_dir: 'c' shard_processes: 2 max_staged_updates: 3 aggregation { min_workers: 4 }",
       "aggregation.min_workers (4) exceeds max_staged_updates (3)"},
  };
  int i = 0;
  for (const Case& c : cases) {
    auto config = LoadServerConfig(WriteFile("bad" + std::to_string(i++) + ".textproto", c.text));
    EXPECT_THAT(config, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.expected)))
        << c.text;
  }
}

TEST(ConfigTest, SyntaxErrorsAndUnknownFieldsGiveLineNumbers) {
  EXPECT_THAT(LoadServerConfig(WriteFile("syntax.textproto", "corpus_dir: 'c'\nlocal_steps: }")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("line 2")));
  EXPECT_THAT(LoadServerConfig(WriteFile("unknown.textproto", "corpus_dir: 'c'\nno_such_field: 1")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no_such_field")));
  EXPECT_THAT(LoadServerConfig(WriteFile("unknown.json", R"({"noSuchField": 1})")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("noSuchField")));
}

// The text parser takes any bytes in a string field; proto3 strings must be UTF-8 (found by the
// config fuzzer: such a config cannot be written as JSON). Refused, naming the field.
TEST(ConfigTest, StringsThatAreNotUtf8AreRefused) {
  const std::pair<std::string, std::string> bad[] = {
      {"corpus_dir: 'data/\\377sotu'", "corpus_dir is not valid UTF-8"},
      {"corpus_dir: 'c' listen_address: '127.0.0\\314.1:0'", "listen_address"},
      {"corpus_dir: '\\300\\257'", "corpus_dir"},            // overlong '/'
      {"corpus_dir: '\\355\\240\\200'", "corpus_dir"},       // surrogate U+D800
      {"corpus_dir: '\\364\\220\\200\\200'", "corpus_dir"},  // U+110000
      {"corpus_dir: 'ab\\342\\202'", "corpus_dir"},          // truncated sequence
  };
  int i = 0;
  for (const auto& [text, expected] : bad) {
    EXPECT_THAT(LoadServerConfig(WriteFile("utf" + std::to_string(i++) + ".textproto", text)),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(expected)))
        << text;
  }
  // Multi-byte text is fine: 2, 3 and 4-byte sequences.
  auto ok = LoadServerConfig(WriteFile(
      "utf-ok.textproto", "corpus_dir: 'data/caf\\303\\251-\\342\\202\\254-\\360\\237\\230\\200'"));
  ASSERT_THAT(ok, IsOk());
  EXPECT_EQ(ok->corpus_dir(), "data/caf\u00e9-\u20ac-\U0001F600");
}

TEST(ConfigTest, MissingFileIsNotFound) {
  EXPECT_THAT(LoadServerConfig("/nonexistent/aloe.textproto"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("/nonexistent/aloe.textproto")));
}

}  // namespace
}  // namespace aloe
