#include "common/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <string>

#include "absl/strings/str_format.h"
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
  EXPECT_EQ(config->transport().int8_block_size(), 256u);
  EXPECT_EQ(config->transport().int4_block_size(), 64u);
}

TEST(ConfigTest, JsonLoads) {
  auto config = LoadServerConfig(
      WriteFile("ok.json",
                R"({"corpusDir": "c", "localSteps": 7, "outerOptimizer": {"type": "OUTER_SGD"}})"));
  ASSERT_THAT(config, IsOk());
  EXPECT_EQ(config->local_steps(), 7u);
  EXPECT_EQ(config->outer_optimizer().type(), v1::OUTER_SGD);
}

TEST(ConfigTest, ApplyGroupsDefaultToTwoAndSetTheApplyThreads) {
  auto config = LoadServerConfig(WriteFile("groups-default.textproto", "corpus_dir: 'c'"));
  ASSERT_THAT(config, IsOk());
  EXPECT_EQ(config->apply_groups(), 2u);
  EXPECT_EQ(config->apply_threads(), 2u);
  EXPECT_EQ(config->num_shards(), 0u);  // the deprecated alias is not filled in

  config = LoadServerConfig(WriteFile("groups-new.textproto", "corpus_dir: 'c' apply_groups: 5"));
  ASSERT_THAT(config, IsOk());
  EXPECT_EQ(config->apply_groups(), 5u);
  EXPECT_EQ(config->apply_threads(), 5u);

  config = LoadServerConfig(
      WriteFile("groups-threads.textproto", "corpus_dir: 'c' apply_groups: 5 apply_threads: 3"));
  ASSERT_THAT(config, IsOk());
  EXPECT_EQ(config->apply_groups(), 5u);
  EXPECT_EQ(config->apply_threads(), 3u);

  EXPECT_THAT(LoadServerConfig(WriteFile("groups-big.textproto",
                                         "corpus_dir: 'c' "
                                         "apply_groups: 1025")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("apply_groups must be in [1, 1024], got 1025")));
}

// num_shards is the deprecated name of apply_groups: still read, copied into apply_groups.
TEST(ConfigTest, NumShardsIsAnAliasOfApplyGroups) {
  auto config = LoadServerConfig(WriteFile("alias.textproto", "corpus_dir: 'c' num_shards: 3"));
  ASSERT_THAT(config, IsOk());
  EXPECT_EQ(config->apply_groups(), 3u);
  EXPECT_EQ(config->apply_threads(), 3u);

  config = LoadServerConfig(WriteFile("alias.json", R"({"corpusDir": "c", "numShards": 4})"));
  ASSERT_THAT(config, IsOk());
  EXPECT_EQ(config->apply_groups(), 4u);

  // Both names with the same value say the same thing.
  config = LoadServerConfig(
      WriteFile("alias-same.textproto", "corpus_dir: 'c' num_shards: 3 apply_groups: 3"));
  ASSERT_THAT(config, IsOk());
  EXPECT_EQ(config->apply_groups(), 3u);

  EXPECT_THAT(
      LoadServerConfig(WriteFile("alias-big.textproto", "corpus_dir: 'c' num_shards: 2000")),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("num_shards (deprecated name of apply_groups) must be in "
                         "[1, 1024], got 2000")));
}

TEST(ConfigTest, NumShardsAndApplyGroupsThatDifferAreRefused) {
  for (const char* text : {"corpus_dir: 'c' num_shards: 3 apply_groups: 4",
                           "corpus_dir: 'c' num_shards: 2 apply_groups: 1"}) {
    SCOPED_TRACE(text);
    EXPECT_THAT(LoadServerConfig(WriteFile("alias-conflict.textproto", text)),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         ::testing::AllOf(HasSubstr("num_shards"), HasSubstr("apply_groups"),
                                          HasSubstr("differ"))));
  }
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
      {"corpus_dir: 'c' transport { int4_block_size: 63 }",
       "transport.int4_block_size must be even and in [2, 65536], got 63"},
      {"corpus_dir: 'c' transport { int4_block_size: 65538 }", "transport.int4_block_size"},
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

TEST(ConfigTest, LowRankLayerCodecsNeedARankAndAFactorCodec) {
  struct Case {
    std::string transport;
    std::string expected;  // "" = accepted
  };
  const Case cases[] = {
      {"layer_codecs { layer: 'head' codec: CODEC_LOWRANK rank: 16 }", ""},
      {"layer_codecs { layer: 'head' codec: CODEC_LOWRANK rank: 4096 "
       "factor_codec: CODEC_INT8_BLOCKWISE }",
       ""},
      {"layer_codecs { layer: 'head' codec: CODEC_LOWRANK rank: 1 "
       "factor_codec: CODEC_INT4_BLOCKWISE }",
       ""},
      {"layer_codecs { layer: 'head' codec: CODEC_LOWRANK }", "rank must be in [1, 4096], got 0"},
      {"layer_codecs { layer: 'head' codec: CODEC_LOWRANK rank: 4097 }",
       "rank must be in [1, 4096], got 4097"},
      {"layer_codecs { layer: 'head' codec: CODEC_LOWRANK rank: 8 factor_codec: CODEC_LOWRANK }",
       "cannot encode low-rank factors"},
      {"layer_codecs { layer: 'head' codec: CODEC_INT8_BLOCKWISE rank: 8 }",
       "rank and factor_codec are for CODEC_LOWRANK"},
      {"codec: CODEC_LOWRANK", "CODEC_LOWRANK is chosen per layer"},
  };
  int i = 0;
  for (const Case& c : cases) {
    auto config = LoadServerConfig(WriteFile("lowrank" + std::to_string(i++) + ".textproto",
                                             "corpus_dir: 'c' transport { " + c.transport + " }"));
    if (c.expected.empty()) {
      EXPECT_THAT(config, IsOk()) << c.transport;
    } else {
      EXPECT_THAT(config, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.expected)))
          << c.transport;
    }
  }
}

// A low-rank tensor whose Q cannot share a chunk with the header and one row of P could never
// be pushed: the config is refused at load, naming layer, tensor, rank, bytes and limit.
// ffn_mult 16 makes mlp.fc2.weight 256 x 4096: in FP32, Q at rank 64 is 4096 * 64 * 4 bytes,
// and 40 + 1048576 + 256 exceeds kMaxChunkBytes = 1047552, while rank 63 (1032484 bytes) fits.
TEST(ConfigTest, LowRankLayersWhoseQDoesNotFitInAChunkAreRefused) {
  struct Case {
    std::string text;
    std::string expected;  // "" = accepted
  };
  const Case cases[] = {
      {"model { ffn_mult: 16 } transport { layer_codecs { layer: 'blocks.1' "
       "codec: CODEC_LOWRANK rank: 64 } }",
       "layer \"blocks.1\", tensor blocks.1.mlp.fc2.weight: at rank 64 its Q (4096 columns x 64 in "
       "CODEC_FP32) with the header and one row of P takes 1048872 bytes, above the chunk limit "
       "of 1047552 bytes; at most rank 63 fits"},
      {"model { ffn_mult: 16 } transport { layer_codecs { layer: 'blocks.1' "
       "codec: CODEC_LOWRANK rank: 63 } }",
       ""},
      // A quarter of the bytes in int8: rank 64 fits.
      {"model { ffn_mult: 16 } transport { layer_codecs { layer: 'blocks.1' "
       "codec: CODEC_LOWRANK rank: 64 factor_codec: CODEC_INT8_BLOCKWISE } }",
       ""},
      // The default model's widest matrix has 256 columns: rank 4096 is clamped to 256, where
      // the factors would not be smaller than the tensor, which then goes whole.
      {"transport { layer_codecs { layer: 'blocks.0' codec: CODEC_LOWRANK rank: 4096 } }", ""},
      // Another layer, and a layer of another codec, are not concerned.
      {"model { ffn_mult: 16 } transport { layer_codecs { layer: 'head' "
       "codec: CODEC_LOWRANK rank: 64 } layer_codecs { layer: 'blocks.1' codec: CODEC_BF16 } }",
       ""},
  };
  int i = 0;
  for (const Case& c : cases) {
    auto config = LoadServerConfig(WriteFile("lowrank_chunk" + std::to_string(i++) + ".textproto",
                                             "corpus_dir: 'c' " + c.text));
    if (c.expected.empty()) {
      EXPECT_THAT(config, IsOk()) << c.text;
    } else {
      EXPECT_THAT(config, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.expected)))
          << c.text;
    }
  }
}

// c = 1/N as a config writes it parses to the float nearest 1/N, which lies above 1/N for N = 3,
// 5 and 10: it is the upper end of the range, and the next float up is refused.
TEST(ConfigTest, DnMomentumActivationAcceptsOneOverNAsWritten) {
  struct Case {
    uint32_t n;
    std::string one_over_n;  // as written in a config
    std::string next_up;     // the next float above float(1/N), shortest decimal
  };
  const Case cases[] = {
      {3, "0.33333334", "0.33333337"},
      {5, "0.2", "0.20000002"},
      {10, "0.1", "0.10000001"},
  };
  for (const Case& c : cases) {
    const std::string dn = absl::StrFormat(
        "corpus_dir: 'c' outer_optimizer { type: OUTER_DELAYED_NESTEROV dn_buffer_size: %d "
        "dn_momentum_activation: ",
        c.n);
    auto ok = LoadServerConfig(WriteFile("dn-ok.textproto", dn + c.one_over_n + " }"));
    ASSERT_THAT(ok, IsOk()) << c.n;
    EXPECT_EQ(ok->outer_optimizer().dn_momentum_activation(), 1.0f / c.n);
    EXPECT_GT(static_cast<double>(ok->outer_optimizer().dn_momentum_activation()), 1.0 / c.n);
    EXPECT_EQ(MaxDnMomentumActivation(c.n), 1.0f / c.n);
    // The case's next_up is indeed the neighbouring float.
    EXPECT_EQ(std::stof(c.next_up), std::nextafter(1.0f / c.n, 2.0f)) << c.n;
    EXPECT_THAT(LoadServerConfig(WriteFile("dn-bad.textproto", dn + c.next_up + " }")),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrFormat(
                             "outer_optimizer.dn_momentum_activation must be in [0, 1/N] with "
                             "N = dn_buffer_size = %d, got %.9g",
                             c.n, std::nextafter(1.0f / c.n, 2.0f)))));
  }
}

// Every N in 1..16, 1/N written with 17 digits (parsed through double) or as the float itself,
// and the neighbours of float(1/N).
TEST(ConfigTest, DnMomentumActivationBoundaryForEveryBufferSizeUpTo16) {
  for (uint32_t n = 1; n <= 16; ++n) {
    const float top = 1.0f / n;
    auto validate = [n](const std::string& c) {
      auto config = ParseServerConfig(
          absl::StrFormat("corpus_dir: 'c' outer_optimizer { type: OUTER_DELAYED_NESTEROV "
                          "dn_buffer_size: %d dn_momentum_activation: %s }",
                          n, c),
          "dn.textproto");
      if (!config.ok()) return config.status();
      FillServerDefaults(&*config);
      return ValidateServerConfig(*config);
    };
    EXPECT_THAT(validate(absl::StrFormat("%.17g", 1.0 / n)), IsOk()) << n;
    EXPECT_THAT(validate(absl::StrFormat("%.9g", top)), IsOk()) << n;
    EXPECT_THAT(validate(absl::StrFormat("%.9g", std::nextafter(top, 0.0f))), IsOk()) << n;
    EXPECT_THAT(validate(absl::StrFormat("%.9g", std::nextafter(top, 2.0f))),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("outer_optimizer.dn_momentum_activation")))
        << n;
    EXPECT_THAT(validate("-1e-30"), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr("outer_optimizer.dn_momentum_activation")))
        << n;
  }
}

// ValidateOuterOptimizerConfig reads only the fields of the chosen type (the optimizer factory
// calls it on configs built in code); the loader refuses a bad value in any field.
TEST(ConfigTest, OuterOptimizerCheckIsPerTypeAndTheLoaderChecksEveryField) {
  v1::OuterOptimizerConfig sgd;
  sgd.set_type(v1::OUTER_SGD);
  sgd.set_lr(0.5f);
  sgd.set_momentum(1.5f);
  EXPECT_THAT(ValidateOuterOptimizerConfig(sgd), IsOk());
  EXPECT_THAT(LoadServerConfig(WriteFile("sgd.textproto",
                                         "corpus_dir: 'c' outer_optimizer { type: OUTER_SGD "
                                         "momentum: 1.5 }")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("outer_optimizer.momentum must be in [0, 1), got 1.5")));

  v1::OuterOptimizerConfig nesterov = sgd;
  nesterov.set_type(v1::OUTER_NESTEROV);
  EXPECT_THAT(ValidateOuterOptimizerConfig(nesterov),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outer_optimizer.momentum")));
  nesterov.set_momentum(0.9f);
  EXPECT_THAT(ValidateOuterOptimizerConfig(nesterov), IsOk());  // Adam's eps 0 is not read

  v1::OuterOptimizerConfig adam = nesterov;
  adam.set_type(v1::OUTER_ADAM);
  adam.set_adam_beta1(0.9f);
  adam.set_adam_beta2(0.999f);
  EXPECT_THAT(ValidateOuterOptimizerConfig(adam),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("outer_optimizer.adam_eps must be > 0, got 0")));
  adam.set_adam_eps(std::numeric_limits<float>::infinity());
  EXPECT_THAT(ValidateOuterOptimizerConfig(adam),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("outer_optimizer.adam_eps must be > 0 and finite, got inf")));

  v1::OuterOptimizerConfig unknown = nesterov;
  unknown.set_type(static_cast<v1::OuterOptimizerType>(7));
  EXPECT_THAT(ValidateOuterOptimizerConfig(unknown),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("outer_optimizer.type 7 is not a known outer optimizer")));
  v1::OuterOptimizerConfig stale = nesterov;
  stale.set_staleness_exponent(-0.5f);
  EXPECT_THAT(ValidateStalenessExponent(stale),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("outer_optimizer.staleness_exponent must be >= 0")));
  EXPECT_THAT(ValidateOuterOptimizerConfig(stale),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("outer_optimizer.staleness_exponent")));
}

TEST(ConfigTest, PenaltyRangesAreCheckedEvenWhenOff) {
  v1::PenaltyConfig penalty;
  penalty.set_ema_alpha(1.0f);
  penalty.set_z_threshold(3.0f);
  penalty.set_temperature(1.0f);
  penalty.set_clip_norm(10.0f);
  EXPECT_THAT(ValidatePenaltyConfig(penalty), IsOk());
  v1::PenaltyConfig alpha = penalty;
  alpha.set_ema_alpha(1.01f);
  EXPECT_THAT(ValidatePenaltyConfig(alpha),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("penalty.ema_alpha must be in (0, 1], got 1.01")));
  v1::PenaltyConfig clip = penalty;
  clip.set_clip_norm(std::numeric_limits<float>::quiet_NaN());
  EXPECT_THAT(ValidatePenaltyConfig(clip),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("penalty.clip_norm")));
  EXPECT_THAT(LoadServerConfig(
                  WriteFile("penalty.textproto", "corpus_dir: 'c' penalty { temperature: -1 }")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("penalty.temperature must be > 0, got -1")));
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
