// aloe-bench-worker, the worker benchmark that scripts/gpu.sh check bench runs on a GPU, run here
// on the CPU with a small model: every variant of its bare loop trains the same model on the same
// batches to the same loss (a variant that skipped or doubled the AdamW step, clipped another
// norm or left its bf16 copy stale would end elsewhere), and the lines carry the fields that the
// check reads.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/token_shard.h"
#include "tests/testing/subprocess.h"

namespace aloe {
namespace {

using ::aloe::testing::ReadFile;

constexpr uint32_t kVocab = 16;

class WorkerBenchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/worker_bench_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::system(absl::StrCat("rm -rf '", dir_, "' && mkdir -p '", dir_, "'").c_str());
    // A period-7 sequence: learnable from the context within a few dozen steps.
    const uint32_t pattern[] = {5, 2, 6, 0, 3, 1, 4};
    std::vector<uint32_t> tokens(20000);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = pattern[i % 7];
    tokens_ = dir_ + "/periodic.tokens";
    ASSERT_TRUE(WriteTokenShard(tokens_, tokens, kVocab).ok());
  }

  // One run; the fields of each output line by its first word, e.g. lines["bare_libtorch"]["loss"].
  std::map<std::string, std::map<std::string, std::string>> Run(const std::string& flags) {
    const std::string out = absl::StrCat(dir_, "/run", runs_++, ".txt");
    const std::string command = absl::StrCat(
        ALOE_BIN_DIR, "/aloe-bench-worker --token_file='", tokens_, "' --vocab_size=", kVocab,
        " --seq_len=16 --d_model=32 --num_layers=2 --num_heads=2 --batch_size=4 --steps=40 "
        "--warmup=0 --blocks=2 ",
        flags, " >'", out, "' 2>&1");
    const int rc = std::system(command.c_str());
    EXPECT_EQ(rc, 0) << command << "\n" << ReadFile(out);
    std::map<std::string, std::map<std::string, std::string>> lines;
    for (absl::string_view line : absl::StrSplit(ReadFile(out), '\n', absl::SkipEmpty())) {
      std::vector<absl::string_view> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (words.empty()) continue;
      auto& fields = lines[std::string(words[0])];
      for (size_t i = 1; i < words.size(); ++i) {
        std::pair<std::string, std::string> kv = absl::StrSplit(words[i], absl::MaxSplits('=', 1));
        fields[kv.first] = kv.second;
      }
    }
    return lines;
  }

  static double Number(const std::map<std::string, std::string>& fields, const std::string& key) {
    double value = NAN;
    auto it = fields.find(key);
    if (it == fields.end() || !absl::SimpleAtod(it->second, &value)) {
      ADD_FAILURE() << "no number for " << key;
    }
    return value;
  }

  std::string dir_;
  std::string tokens_;
  int runs_ = 0;
};

TEST_F(WorkerBenchTest, EveryBareLoopVariantTrainsThePeriodicTokensAlike) {
  auto base = Run("");
  const auto& step = base["bare_step"];
  EXPECT_EQ(step.at("adamw"), "foreach");
  EXPECT_EQ(step.at("clip"), "one_pass");
  EXPECT_EQ(step.at("sync"), "round");
  EXPECT_EQ(step.at("attention"), "auto");
  EXPECT_EQ(step.at("precision"), "autocast");
  EXPECT_EQ(base["bare_libtorch"].at("graph"), "off") << "no CUDA graphs on the CPU";
  const double loss = Number(base["bare_libtorch"], "loss");
  EXPECT_GT(Number(base["bare_libtorch"], "tokens_per_second"), 0);
  // The mean over the 40 steps falls well below the uniform guess's log(16) = 2.77.
  EXPECT_LT(loss, 0.75 * std::log(kVocab));
  // Float32 variants: the same arithmetic in another order or grouping.
  for (const std::string flags : {
           "--bare_adamw=libtorch --bare_clip=libtorch --bare_sync=step",
           "--bare_loss=fused",
           "--attention=math",
       }) {
    auto run = Run(flags);
    EXPECT_NEAR(Number(run["bare_libtorch"], "loss"), loss, 1e-3 * loss) << flags;
  }
  // bf16 throughout with float32 masters: near, not equal; it must train as far.
  auto bf16 = Run("--bare_precision=bf16");
  EXPECT_EQ(bf16["bare_step"].at("precision"), "bf16");
  EXPECT_NEAR(Number(bf16["bare_libtorch"], "loss"), loss, 0.05 * loss);
  // The trainer against the bare loop: both lines, its ratio the two speeds'.
  auto trainer = Run("--trainer");
  const double trainer_tps = Number(trainer["aloe_trainer"], "tokens_per_second");
  const double bare_tps = Number(trainer["bare_libtorch"], "tokens_per_second");
  EXPECT_NEAR(Number(trainer["aloe_trainer"], "ratio"), trainer_tps / bare_tps, 2e-3);
  EXPECT_EQ(trainer["aloe_trainer"].at("graph"), "off");
  // The same work: on this sequence every window is the same up to its phase, so the trainer's
  // own batches train as far as the bare loop's.
  EXPECT_NEAR(Number(trainer["aloe_trainer"], "loss"), Number(trainer["bare_libtorch"], "loss"),
              0.02 * loss);
}

TEST_F(WorkerBenchTest, BadVariantsAreRefusedByName) {
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"--bare_precision=fp8", "--bare_precision must be autocast or bf16"},
      {"--bare_precision=bf16 --bare_adamw=libtorch",
       "--bare_precision=bf16 steps the master parameters"},
      {"--attention=fastest", "attention kernel must be auto, flash, cudnn, efficient or math"},
      {"--attention=cudnn", "attention kernel cudnn"},
  };
  for (const auto& [flags, why] : refused) {
    const std::string out = absl::StrCat(dir_, "/refused", runs_++, ".txt");
    const std::string command =
        absl::StrCat(ALOE_BIN_DIR, "/aloe-bench-worker --steps=1 ", flags, " >'", out, "' 2>&1");
    EXPECT_NE(std::system(command.c_str()), 0) << flags;
    EXPECT_THAT(ReadFile(out), ::testing::HasSubstr(why)) << flags;
  }
}

}  // namespace
}  // namespace aloe
